"""Graph -> Program: a flat list of steps over named buffers.

A training program is forward steps, loss seeds, backward steps (with accumulation where a
blob feeds several layers) and SGD updates. Every buffer carries its shape, dtype and category,
and after `compute_liveness` its first_use and last_use step, which is all a memory planner
needs. Later passes (in-place, Gist encode/decode) rewrite the program before planning.
"""
import math
from dataclasses import dataclass, field

import numpy as np

# the footprint categories, in report order
WEIGHTS = "weights"
WEIGHT_GRADS = "weight_grads"
OPTIMIZER_STATE = "optimizer_state"
INPUT = "input"
STASH = "stash"
FEATURE = "feature"
GRADIENT = "gradient"
WORKSPACE = "workspace"
ENCODED = "encoded"
CATEGORIES = (WEIGHTS, WEIGHT_GRADS, OPTIMIZER_STATE, INPUT, STASH, FEATURE, GRADIENT,
              WORKSPACE, ENCODED)
PERSISTENT_CATEGORIES = (WEIGHTS, WEIGHT_GRADS, OPTIMIZER_STATE)
UPDATE_CHUNK = 1 << 18      # elements the SGD update handles at a time


@dataclass
class Buffer:
    name: str
    shape: tuple
    dtype: np.dtype
    category: str
    layer: str = ""           # the layer that owns or produces it
    first_use: int = -1
    last_use: int = -1
    pinned: bool = None       # lives the whole run; None: as its category says

    @property
    def nbytes(self):
        return math.prod(int(d) for d in self.shape) * np.dtype(self.dtype).itemsize   # exact: no int64 wrap

    @property
    def persistent(self):
        if self.pinned is not None:
            return self.pinned
        return self.category in PERSISTENT_CATEGORIES


def names_in(value):
    """The buffer names in one step argument: a name, a list of names or a dict of names
    (None entries are absent buffers; numbers are not names)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, str)]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, str)]
    return []


@dataclass
class Step:
    """One step. `kind` is forward, backward, seed, zero, accumulate or update; `args` maps
    each role (x, y, gy, gx, p, gp, saved, ws, ...) to buffer names (lists, dicts or None)."""
    kind: str
    layer: object = None
    args: dict = field(default_factory=dict)
    codec: object = None      # encode / decode steps: the codec they run; a forward step: its
                              # top's HalfStash, which the layer writes as it runs (writes_half)
    variant: str = None       # backward steps: "mask" or "identity" when Gist changed the stash
    note: str = ""            # encode / decode steps: the tensor they work on
    streams: dict = None      # backward steps: {decoded slice buffer: (codec, tensor, enc, ws)}

    def buffer_names(self, roles=None):
        for role, value in self.args.items():
            if roles is None or role in roles:
                yield from names_in(value)

    @property
    def label(self):
        name = self.layer.name if self.layer is not None else self.args.get("target", "")
        if self.note:
            name = self.note
        return f"{self.kind}:{name}"


class Program:
    def __init__(self, graph, buffers, steps, outputs, loss_weights):
        self.graph = graph
        self.buffers = buffers          # name -> Buffer
        self.steps = steps
        self.outputs = outputs          # blob id -> buffer name, read after the run
        self.loss_weights = loss_weights  # buffer name -> weight
        self.encodings = {}             # stashed buffer -> Encoding (filled by the Gist pass)
        self.compute_liveness()

    @property
    def fused_update(self):
        """Whether update steps run inside the backward pass (each right after the backward
        of its layer): its weight gradients are then per-iteration buffers."""
        return any(b.category == WEIGHT_GRADS and not b.persistent for b in self.buffers.values())

    def compute_liveness(self):
        """first_use / last_use of every buffer; persistent buffers and outputs span it all."""
        for buffer in self.buffers.values():
            buffer.first_use = buffer.last_use = -1
        for index, step in enumerate(self.steps):
            for name in step.buffer_names():
                buffer = self.buffers[name]
                if buffer.first_use < 0:
                    buffer.first_use = index
                buffer.last_use = index
        end = len(self.steps) - 1
        for buffer in self.buffers.values():
            if buffer.persistent:
                buffer.first_use, buffer.last_use = 0, end
        for name in self.outputs.values():
            self.buffers[name].last_use = end
        for buffer in self.buffers.values():
            if buffer.category == INPUT:
                buffer.first_use = 0    # written by the executor before the first step
        unused = [b.name for b in self.buffers.values() if b.first_use < 0]
        for name in unused:
            del self.buffers[name]


def param_buffer_names(layer, index):
    key = f"{layer.name}.{layer.params[index].name}"
    return f"param:{key}", f"pgrad:{key}", f"momentum:{key}"


def _gradient_flags(graph):
    """Which blobs need a gradient: they reach a loss and depend on a trained parameter, or
    (force_backward, as Caffe) a layer that reaches a loss can send one to them."""
    reaches_loss = {name: name in graph.loss_weights for name in graph.blobs}
    for node in reversed(graph.nodes):
        if node.layer.has_backward and any(reaches_loss[t] for t in node.tops):
            for bottom in node.bottoms:
                reaches_loss[bottom] = True
    if graph.force_backward:
        forced = {name: name in graph.loss_weights for name in graph.blobs}
        for node in graph.nodes:
            if node.layer.has_backward and any(reaches_loss[t] for t in node.tops):
                for index, bottom in enumerate(node.bottoms):
                    forced[bottom] = forced[bottom] or _propagates(graph, node.layer, index)
        return forced
    trained_upstream = {}
    for node in graph.nodes:
        layer = node.layer
        flows = layer.has_backward and (
            any(p.trained for p in layer.params) or
            any(trained_upstream[b] and _propagates(graph, layer, i) for i, b in enumerate(node.bottoms)))
        for top in node.tops:
            trained_upstream[top] = flows
    return {name: trained_upstream[name] and reaches_loss[name] for name in graph.blobs}


def _propagates(graph, layer, index):
    """Whether the backward of `layer` writes the gradient of its bottom `index`: where it can,
    unless the file's propagate_down says no (force_backward overrides that, as in Caffe)."""
    if not layer.propagates_down(index):
        return False
    flags = layer.spec.propagate_down
    return graph.force_backward or index >= len(flags) or flags[index]


def _add_workspace(buffers, layer, phase):
    names = {}
    for ws_name, decl in layer.workspace(phase).items():
        name = f"ws:{layer.name}.{phase}.{ws_name}"
        buffers[name] = Buffer(name, tuple(decl.shape), np.dtype(decl.dtype or layer.dtype),
                               WORKSPACE, layer.name)
        names[ws_name] = name
    return names


def build_program(graph, train=True, fused_update=False):
    """The program of one training iteration (train=True) or of one inference pass.

    The SGD update of a parameter runs after the whole backward pass (fused_update=False, as
    Caffe does: every weight gradient stays readable until the next iteration), or right after
    the backward step of its layer (fused_update=True): nothing reads a layer's weights or its
    weight gradient after that step (shared weights are refused), so the update gives the same
    weights bit for bit, and each weight gradient lives only from its backward step to its
    update, where the planner can reuse its bytes."""
    buffers, steps = {}, []

    def add(name, shape, dtype, category, layer_name):
        buffers[name] = Buffer(name, tuple(shape), np.dtype(dtype), category, layer_name)
        return name

    needs_grad = _gradient_flags(graph) if train else {name: False for name in graph.blobs}
    backward_indices = [i for i, node in enumerate(graph.nodes)
                        if train and node.layer.has_backward and any(needs_grad[t] for t in node.tops)]
    backward_set = set(backward_indices)
    kept = set()
    for node in (graph.nodes[i] for i in backward_indices):
        kept.update(node.bottoms[i] for i in node.layer.keeps_bottoms)
        kept.update(node.tops[i] for i in node.layer.keeps_tops)

    for node_index, node in enumerate(graph.nodes):
        layer = node.layer
        for top, shape in zip(node.tops, layer.top_shapes):
            category = INPUT if layer.is_data else (STASH if top in kept else FEATURE)
            add(f"blob:{top}", shape, layer.dtype, category, layer.name)
        params = []
        for index, decl in enumerate(layer.params):
            weight, grad, momentum = param_buffer_names(layer, index)
            params.append(add(weight, decl.shape, layer.dtype, WEIGHTS, layer.name))
        saved = {}
        for saved_name, decl in layer.saved.items():
            saved[saved_name] = add(f"saved:{layer.name}.{saved_name}", decl.shape,
                                    decl.dtype or layer.dtype,
                                    STASH if node_index in backward_set else FEATURE, layer.name)
        steps.append(Step("forward", layer, {
            "x": [f"blob:{b}" for b in node.bottoms], "y": [f"blob:{t}" for t in node.tops],
            "p": params, "saved": saved, "ws": _add_workspace(buffers, layer, "forward")}))

    outputs = {name: f"blob:{name}" for name in graph.outputs()}
    loss_weights = {f"blob:{name}": weight for name, weight in graph.loss_weights.items()}
    if not train:
        return Program(graph, buffers, steps, outputs, loss_weights)

    for name, weight in graph.loss_weights.items():
        if needs_grad[name]:
            seed = add(f"grad:{name}", graph.blobs[name].shape, graph.nodes[0].layer.dtype,
                       GRADIENT, graph.nodes[graph.blobs[name].producer].layer.name)
            steps.append(Step("seed", None, {"target": seed, "value": weight}))

    partial_count = {}
    for node_index in reversed(backward_indices):
        node = graph.nodes[node_index]
        layer = node.layer
        gy = []
        for top, shape in zip(node.tops, layer.top_shapes):
            if needs_grad[top]:
                gy.append(f"grad:{top}")
            else:   # a top nobody differentiates through: its gradient is zero
                zero = add(f"zero:{top}", shape, layer.dtype, GRADIENT, layer.name)
                steps.append(Step("zero", None, {"target": zero}))
                gy.append(zero)
        gx, accumulate = [], []
        for index, bottom in enumerate(node.bottoms):
            if not (needs_grad[bottom] and _propagates(graph, layer, index)):
                gx.append(None)
                continue
            count = partial_count.get(bottom, 0)
            partial_count[bottom] = count + 1
            name = f"grad:{bottom}" if count == 0 else f"grad:{bottom}#{count}"
            gx.append(add(name, graph.blobs[bottom].shape, layer.dtype, GRADIENT, layer.name))
            if count:
                accumulate.append((f"grad:{bottom}", name))
        gp = []
        for index, decl in enumerate(layer.params):
            if decl.trained:
                _, grad, _ = param_buffer_names(layer, index)
                gp.append(add(grad, decl.shape, layer.dtype, WEIGHT_GRADS, layer.name))
                if fused_update:
                    buffers[grad].pinned = False
            else:
                gp.append(None)
        forward = steps[node_index]
        # which input gradients the backward writes: a layer may size its workspace by them
        layer.gx_needed = tuple(name is not None for name in gx)
        steps.append(Step("backward", layer, {
            "x": [f"blob:{b}" if i in layer.keeps_bottoms else None for i, b in enumerate(node.bottoms)],
            "y": [f"blob:{t}" if i in layer.keeps_tops else None for i, t in enumerate(node.tops)],
            "gy": gy, "gx": gx, "p": forward.args["p"], "gp": gp,
            "saved": dict(forward.args["saved"]), "ws": _add_workspace(buffers, layer, "backward")}))
        for target, source in accumulate:
            steps.append(Step("accumulate", None, {"target": target, "source": source}))
        if fused_update:
            _add_updates(layer, buffers, steps, add)

    if not fused_update:
        for node in graph.nodes:
            _add_updates(node.layer, buffers, steps, add)
    for node in graph.nodes:    # force_backward's input gradients: readable after the run
        for top in node.tops if node.layer.is_data else ():
            if f"grad:{top}" in buffers:
                outputs[f"grad:{top}"] = f"grad:{top}"
    return Program(graph, buffers, steps, outputs, loss_weights)


def _add_updates(layer, buffers, steps, add):
    """The SGD update steps of the trained parameters of `layer` that got a gradient."""
    for index, decl in enumerate(layer.params):
        if not decl.trained:
            continue
        weight, grad, momentum = param_buffer_names(layer, index)
        if grad not in buffers:     # the layer's output reaches no loss
            continue
        add(momentum, decl.shape, layer.dtype, OPTIMIZER_STATE, layer.name)
        scratch = add(f"ws:{layer.name}.update.{decl.name}", (min(int(np.prod(decl.shape)), UPDATE_CHUNK),),
                      layer.dtype, WORKSPACE, layer.name)
        steps.append(Step("update", layer, {
            "param": weight, "grad": grad, "momentum": momentum, "ws": scratch,
            "lr_mult": decl.lr_mult, "decay_mult": decl.decay_mult}))
