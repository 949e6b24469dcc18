"""Model file -> Graph: layers over named blobs, shapes known, no arrays.

Blobs are in SSA form: a layer written the Caffe way with top == bottom (in place) produces a
new version of the blob (`conv1@relu1`), so every blob version has exactly one producer and
later passes decide whether two versions may share memory.
"""
import os
from dataclasses import dataclass, field

import numpy as np

from . import onnx_import, prototxt
from .caffe_schema import V1_TYPE_NAMES
from .errors import LayerSetupError, ModelFileError
from .layers import LAYER_TYPES
from .layers.base import LayerSpec


@dataclass
class Blob:
    name: str                 # SSA version id, unique in the graph
    base: str                 # the name the model file uses
    shape: tuple
    producer: int             # node index
    top_index: int
    consumers: list = field(default_factory=list)   # [(node index, bottom index)]


@dataclass
class Node:
    layer: object
    bottoms: list             # blob version ids
    tops: list


@dataclass
class Graph:
    path: str
    name: str
    phase: str
    nodes: list
    blobs: dict
    loss_weights: dict        # blob id -> weight, for blobs that enter the objective
    batch_size: int
    input_shape: tuple        # shape of one input sample (C, H, W) of the first data top
    force_backward: bool = False   # the file's force_backward: gradients to every input blob
    added_loss: str = ""      # what add_loss appended, in words ("" when it appended nothing)

    @property
    def layers(self):
        return [node.layer for node in self.nodes]

    def node_of(self, layer_name):
        for node in self.nodes:
            if node.layer.name == layer_name:
                return node
        raise KeyError(layer_name)

    def outputs(self):
        """Blobs no layer consumes (losses, accuracies, scores)."""
        return [b.name for b in self.blobs.values() if not b.consumers]

    def param_count(self, learned_only=True):
        return sum(int(np.prod(p.shape)) for layer in self.layers for p in layer.params
                   if p.learnable or not learned_only)


def _rule_matches(rule, phase):
    if rule.has("phase") and rule.get("phase") != phase:
        return False
    if rule.get("min_level", 0) > 0 or rule.all("stage"):
        return False
    if rule.has("max_level") and rule.get("max_level") < 0:
        return False
    return True


def _included(layer_msg, phase):
    includes = layer_msg.all("include")
    if includes:
        return any(_rule_matches(rule, phase) for rule in includes)
    return not any(_rule_matches(rule, phase) for rule in layer_msg.all("exclude"))


def _layer_specs(net, path, phase):
    """Yield a LayerSpec for each layer of the net included in `phase`."""
    if net.all("layer") and net.all("layers"):
        raise ModelFileError(path, net.line_of("layers"),
                             "mixes the 'layer' and legacy 'layers' syntax; use one")
    net_inputs = net.all("input")
    if net_inputs:
        yield _net_input_spec(net, path)
    else:
        for orphan in ("input_shape", "input_dim"):
            if net.has(orphan):
                raise ModelFileError(path, net.line_of(orphan), f"'{orphan}' given without a net-level 'input' to name the blob")
    for msg in net.all("layer") + net.all("layers"):
        if msg.has("include") and msg.has("exclude"):
            raise ModelFileError(path, msg.line_of("exclude"),
                                 f"layer '{msg.get('name', '')}': give include rules or exclude rules, not both")
        if _included(msg, phase):
            yield layer_spec(msg, path, phase)


def _missing_producer(net, spec, name, phase):
    """Why no earlier layer gives `name`: a producer that the phase rules leave out, or none."""
    for msg in net.all("layer") + net.all("layers"):
        if msg is spec.msg:
            break
        if name in msg.all("top") and not _included(msg, phase):
            rule = "include" if msg.has("include") else "exclude"
            return (f"comes only from layer '{msg.get('name', '')}' (line {msg.line}), which its {rule} "
                    f"rule leaves out of the {phase} phase")
    return "is not produced by any earlier layer"


def _free_name(base, taken):
    """`base`, or `base` with the first free numeric suffix, whichever no blob uses yet."""
    name, count = base, 1
    while name in taken:
        name, count = f"{base}_{count}", count + 1
    return name


def layer_spec(msg, path, phase):
    """The LayerSpec of one `layer { }` or legacy `layers { }` message."""
    legacy = msg.type_name == "V1LayerParameter"
    if legacy and msg.has("layer"):
        raise ModelFileError(path, msg.line, "the V0 layer format (layers { layer { } }) is not supported")
    name = msg.get("name")
    if not name:
        raise ModelFileError(path, msg.line, "layer has no name")
    type_name = msg.get("type")
    if type_name is None:
        raise ModelFileError(path, msg.line, f"layer '{name}' has no type")
    if legacy:
        type_name = V1_TYPE_NAMES.get(type_name, type_name)
        if msg.has("param"):
            raise ModelFileError(path, msg.line_of("param"), f"layer '{name}': shared parameters (param: \"...\") are not supported")
        lrs, decays = msg.all("blobs_lr"), msg.all("weight_decay")
        param_specs = [(lrs[i] if i < len(lrs) else 1.0, decays[i] if i < len(decays) else 1.0)
                       for i in range(max(len(lrs), len(decays)))]
    else:
        param_specs = [(p.get("lr_mult", 1.0), p.get("decay_mult", 1.0)) for p in msg.all("param")]
        for p in msg.all("param"):
            if p.has("name"):
                raise ModelFileError(path, p.line, f"layer '{name}': shared parameters (param {{ name }}) are not supported")
    return LayerSpec(name=name, type=type_name, bottoms=msg.all("bottom"), tops=msg.all("top"),
                     msg=msg, path=path, line=msg.line, phase=phase, param_specs=param_specs,
                     loss_weights=msg.all("loss_weight"), propagate_down=msg.all("propagate_down"))


def _net_input_spec(net, path):
    """The legacy net-level `input:` / `input_dim:` / `input_shape` as an Input layer."""
    names = net.all("input")
    dims = net.all("input_dim")
    shapes = [tuple(s.all("dim")) for s in net.all("input_shape")]
    if dims and not shapes:  # Caffe uses input_shape when a file gives both
        if len(dims) != 4 * len(names):
            raise ModelFileError(path, net.line_of("input_dim"),
                                 f"{len(names)} input(s) need {4 * len(names)} input_dim values, got {len(dims)}")
        shapes = [tuple(dims[4 * i:4 * i + 4]) for i in range(len(names))]
    if len(shapes) != len(names):
        raise ModelFileError(path, net.line_of("input"), "each 'input' needs an input_shape or 4 input_dim values")
    msg = prototxt.Msg("LayerParameter", net.line_of("input"))
    input_param = prototxt.Msg("InputParameter", msg.line)
    for shape in shapes:
        blob_shape = prototxt.Msg("BlobShape", msg.line)
        blob_shape.fields = [("dim", d, msg.line) for d in shape]
        input_param.fields.append(("shape", blob_shape, msg.line))
    msg.fields.append(("input_param", input_param, msg.line))
    return LayerSpec(name="input", type="Input", bottoms=[], tops=list(names), msg=msg,
                     path=path, line=msg.line)


def _field_lines(spec, name):
    """The line of each value of a repeated field of the layer (the layer's line if synthesized)."""
    lines = [line for field_name, _, line in spec.msg.fields if field_name == name]
    return lines if lines else [spec.line] * len(getattr(spec, name + "s"))


# the model files train.py knows by name (`--model resnet20`); the library takes the names too
MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")


def bundled_path(name):
    """The bundled model file a bare name (no folder, no suffix) stands for, when `name` is no
    file itself and models/ has NAME.prototxt; else None."""
    if not isinstance(name, str) or os.path.sep in name or "." in name or os.path.exists(name):
        return None
    path = os.path.join(MODELS_DIR, name + ".prototxt")
    return path if os.path.isfile(path) else None


def build_graph(source, phase="TRAIN", batch_size=None, input_size=None, dtype=np.float32,
                path=None, add_loss=False, input_channels=None, conv=None):
    """Build the Graph of a model file (a path) or of prototxt text (`path` then names it).
    A path ending in .onnx is read by the ONNX front end (minigist/onnx_import.py), whose
    nodes become the same layers.
    add_loss=True appends a SoftmaxWithLoss and its label input to a file without a loss
    layer (a deploy file), so that it can be trained (see `_with_added_loss`).
    `input_channels` sets the channel count of data layers whose file states none (Data,
    ImageData without is_color); one that contradicts a count the file states is an error.
    `conv`: the engine its Convolution layers compute with (None: im2col)."""
    if phase not in ("TRAIN", "TEST"):
        raise ValueError(f"phase must be TRAIN or TEST, got {phase!r}")
    if isinstance(input_size, int):
        input_size = (input_size, input_size)
    nodes, blobs, current, loss_weights = [], {}, {}, {}
    if path is None:
        source = bundled_path(source) or source
    if onnx_import.is_onnx(source, path):     # the ONNX front end: specs made as the graph grows
        path = str(path if path is not None else source)
        front = onnx_import.OnnxFront(path, phase, batch_size, input_size, lambda name: blobs[current[name]].shape)
        net, net_name, force_backward, specs = None, front.name, False, front.specs()
    else:
        if path is None:
            path = str(source)
            net = prototxt.parse_file(path)
        else:
            net = prototxt.parse(source, path)
        net_name, force_backward = net.get("name", ""), bool(net.get("force_backward", False))
        specs = _layer_specs(net, path, phase)
    data_shape = None
    added = {}
    if add_loss:
        specs = _with_added_loss(specs, phase, current, blobs, added)
    for spec in specs:
        cls = LAYER_TYPES.get(spec.type)
        if cls is None or (net is not None and not cls.caffe_type):
            onnx_only = "" if cls is None else f": ONNX's operator, read from .onnx files, not a Caffe type"
            raise ModelFileError(path, spec.msg.line_of("type"),
                                 f"unknown layer type '{spec.type}' (layer '{spec.name}'){onnx_only}")
        layer = cls(spec, np.dtype(dtype), conv)
        if not spec.tops and layer.is_loss:
            # Caffe's LossLayer gives a loss layer written without a top an anonymous one
            spec.tops = [_free_name(spec.name, current)]
        if any(node.layer.name == spec.name for node in nodes):
            raise ModelFileError(path, spec.msg.line_of("name"), f"layer name '{spec.name}' used twice")
        lo, hi = cls.num_bottoms
        if len(spec.bottoms) < lo or (hi is not None and len(spec.bottoms) > hi):
            want = f"{lo}" if lo == hi else f"{lo} to {hi if hi is not None else 'any'}"
            raise ModelFileError(path, spec.line, f"layer '{spec.name}' ({spec.type}) takes {want} bottom(s), got {len(spec.bottoms)}")
        lo, hi = cls.num_tops
        if len(spec.tops) < lo or (hi is not None and len(spec.tops) > hi):
            want = f"{lo}" if lo == hi else f"{lo} to {hi if hi is not None else 'any'}"
            raise ModelFileError(path, spec.line, f"layer '{spec.name}' ({spec.type}) gives {want} top(s), got {len(spec.tops)}")
        bottom_lines = _field_lines(spec, "bottom")
        bottom_ids = []
        for name, line in zip(spec.bottoms, bottom_lines):
            if name not in current:
                raise ModelFileError(path, line, f"layer '{spec.name}': bottom '{name}' "
                                     + (_missing_producer(net, spec, name, phase) if net is not None
                                        else "is not produced by any earlier layer"))
            bottom_ids.append(current[name])
        try:
            if layer.is_data:
                layer.override(batch_size, input_size, input_channels)
            top_shapes = layer.setup([blobs[b].shape for b in bottom_ids])
        except LayerSetupError as exc:
            raise ModelFileError(path, spec.line, _located(spec, exc)) from None
        layer.bottom_shapes = [blobs[b].shape for b in bottom_ids]
        layer.top_shapes = [tuple(int(d) for d in s) for s in top_shapes]
        for shape in layer.top_shapes:
            if any(d <= 0 for d in shape):
                raise ModelFileError(path, spec.line, _located(spec, f"layer '{spec.name}' ({spec.type}): output shape "
                                                                     f"{shape} is empty; the input is too small for this layer"))
        index = len(nodes)
        top_ids = []
        top_lines = _field_lines(spec, "top")
        for top_index, name in enumerate(spec.tops):
            if name in current and name not in spec.bottoms:
                raise ModelFileError(path, top_lines[top_index],
                                     f"layer '{spec.name}': top '{name}' is already produced by another layer")
            blob_id = name if name not in current else f"{name}@{spec.name}"
            if blob_id in blobs or name in top_ids:
                raise ModelFileError(path, top_lines[top_index], f"layer '{spec.name}': top '{name}' given twice")
            blobs[blob_id] = Blob(blob_id, name, layer.top_shapes[top_index], index, top_index)
            top_ids.append(blob_id)
        for bottom_index, blob_id in enumerate(bottom_ids):
            blobs[blob_id].consumers.append((index, bottom_index))
        for name, blob_id in zip(spec.tops, top_ids):
            current[name] = blob_id
        nodes.append(Node(layer, bottom_ids, top_ids))
        weights = list(spec.loss_weights) or ([1.0] if layer.is_loss else [])
        if spec.loss_weights and len(spec.loss_weights) != len(top_ids):  # Caffe: none or one per top
            raise ModelFileError(path, spec.msg.line_of("loss_weight"),
                                 f"layer '{spec.name}' has {len(spec.loss_weights)} loss_weight values for {len(top_ids)} top(s); give none or one per top")
        if spec.propagate_down and len(spec.propagate_down) != len(bottom_ids):
            raise ModelFileError(path, spec.msg.line_of("propagate_down"),
                                 f"layer '{spec.name}' has {len(spec.propagate_down)} propagate_down values for {len(bottom_ids)} bottom(s); give none or one per bottom")
        for blob_id, weight in zip(top_ids, weights):
            if weight != 0.0:
                if int(np.prod(blobs[blob_id].shape)) != 1:
                    raise ModelFileError(path, spec.msg.line_of("loss_weight"), f"layer '{spec.name}': loss_weight on top '{blob_id}' which is not a scalar")
                loss_weights[blob_id] = float(weight)
        if layer.is_data and data_shape is None and layer.top_shapes:
            data_shape = layer.top_shapes[0]
    if not nodes:
        raise ModelFileError(path, 0, f"no layers in phase {phase}")
    if data_shape is None:
        raise ModelFileError(path, 0, "the net has no input or data layer")
    return Graph(path=path, name=net_name, phase=phase, nodes=nodes, blobs=blobs,
                 loss_weights=loss_weights, batch_size=int(data_shape[0]),
                 input_shape=tuple(data_shape[1:]), force_backward=force_backward,
                 added_loss=added.get("text", ""))


def _located(spec, message):
    """A layer's error, prefixed with the model-file node it comes from where that is not a
    layer of its own (an ONNX node)."""
    return f"{spec.origin}: {message}" if spec.origin else str(message)


def _with_added_loss(specs, phase, current, blobs, added):
    """The file's layer specs, then a SoftmaxWithLoss on the scores (in the TEST phase an
    Accuracy too, as a train_val file has). The scores are the bottom of a final Softmax (a
    deploy file's "prob", which then runs in the TEST phase only, as in a train_val file), or
    else the first top of the last layer. The labels are a data layer's second top where the
    file has one, else a new label Input of one label per sample. It runs as build_graph
    consumes it, so `current` and `blobs` hold every layer built before the spec it is asked
    for; `added["text"]` says what it appended. Only a Softmax is held back until the next spec
    shows it is not the last one: a front end that reads the shapes of what it gave (ONNX's)
    finds every other spec built when it is asked for the next."""
    held, last, layer_names, data_label = None, None, set(), None
    for spec in specs:
        cls = LAYER_TYPES.get(spec.type)
        if cls is not None and cls.is_data and spec.type != "Input" and len(spec.tops) == 2 and not data_label:
            data_label = spec.tops[1]      # a data layer's (data, label) pair: feed that label
        if cls is not None and cls.is_loss:
            raise ModelFileError(spec.path, spec.line, f"--add-loss: the model already has a loss layer "
                                 f"'{spec.name}'; add a loss only to a file without one (a deploy file)")
        layer_names.add(spec.name)
        if held is not None:
            yield held
            held = None
        last = spec
        if spec.type == "Softmax" and len(spec.bottoms) == 1 and spec.tops != spec.bottoms:
            held = spec
        else:
            yield spec
    if last is None:
        return
    if held is not None:
        scores = held.bottoms[0]
        chosen = f"'{scores}', the scores that feed the final Softmax '{held.name}'"
        if phase == "TRAIN":
            chosen += f" ('{held.name}' runs in the TEST phase only)"
        else:
            yield held
    else:
        held = last
        if not held.tops:
            raise ModelFileError(held.path, held.line, f"--add-loss: the last layer '{held.name}' has no top "
                                 "to put a loss on")
        scores = held.tops[0]
        chosen = f"'{scores}', the output of the last layer '{held.name}'"
    taken = set(current) | layer_names
    label = data_label or _free_name("label", taken)
    loss = _free_name("loss", taken | {label})
    if data_label is None:
        yield _label_input_spec(label, blobs[current[scores]].shape[0], held)
    yield LayerSpec(name=loss, type="SoftmaxWithLoss", bottoms=[scores, label], tops=[loss],
                    msg=prototxt.Msg("LayerParameter", held.line), path=held.path, line=held.line,
                    phase=phase)
    added["text"] = (f"SoftmaxWithLoss '{loss}' on {chosen}, with the label "
                     + (f"'{label}' of the data layer" if data_label else f"input '{label}'"))
    if phase == "TEST":     # what a train_val file measures on held-out data
        accuracy = _free_name("accuracy", taken | {label, loss})
        yield LayerSpec(name=accuracy, type="Accuracy", bottoms=[scores, label], tops=[accuracy],
                        msg=prototxt.Msg("LayerParameter", held.line), path=held.path, line=held.line,
                        phase=phase)
        added["text"] += f", and an Accuracy '{accuracy}'"


def _label_input_spec(label, batch, near):
    """An Input layer giving `batch` integer labels (as float, like Caffe's data layers)."""
    msg = prototxt.Msg("LayerParameter", near.line)
    input_param = prototxt.Msg("InputParameter", near.line)
    shape = prototxt.Msg("BlobShape", near.line)
    shape.fields = [("dim", batch, near.line)]
    input_param.fields.append(("shape", shape, near.line))
    msg.fields.append(("input_param", input_param, near.line))
    return LayerSpec(name=label, type="Input", bottoms=[], tops=[label], msg=msg, path=near.path,
                     line=near.line, phase=near.phase)
