"""ONNX model files -> layer specs: the second front end beside prototxt.py.

`OnnxFront(path, ...).specs()` yields one LayerSpec (the same kind a prototxt layer gives)
per layer, in the file's node order, and graph.build_graph assembles them into the same Graph
the passes consume. Each node becomes existing layers where their semantics match ONNX's
exactly (Conv -> Convolution, Relu -> ReLU, Concat, LRN, Dropout, Softmax, plain Gemm ->
InnerProduct, ...) and layers of ONNX's own semantics where they do not (MaxPool /
AveragePool with asymmetric pads and ONNX's rounding, BatchNormalization's running averages,
broadcasting Add / Mul, Clip, HardSwish, ...); `docs/onnx.md` has the table.

Shapes are known at import (build_graph sets each layer up before the next node is read), so
nodes whose inputs are all constants are evaluated here, by onnx's own reference evaluator:
the Shape -> Gather -> Unsqueeze -> Concat -> Reshape chains exporters emit for a flatten
become one Reshape of a known shape, a weight reshaped or unsqueezed in the graph becomes its
value. Weights (initializers, or constants computed from them) are each layer's starting
values (LayerSpec.initial); the constant operand of an Add or Mul stays fixed (state).

Needs the `onnx` package (`pip install 'minigist[onnx]'`); without it, an .onnx model is a
one-line error saying so.
"""
import json
import os
import zlib

import numpy as np

from .errors import ModelFileError
from .layers.base import LayerSpec
from .prototxt import Msg

INSTALL = "pip install 'minigist[onnx]' (or pip install onnx)"

# operators that become layers, and those evaluated at import when their inputs are constants
LAYER_OPS = ("Conv", "BatchNormalization", "Relu", "LeakyRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish",
             "Add", "Sum", "Mul", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "ReduceMean",
             "Gemm", "MatMul", "Concat", "Flatten", "Reshape", "Squeeze", "Unsqueeze", "Transpose", "Pad",
             "Dropout", "LRN", "Softmax", "Identity")
CONSTANT_OPS = ("Constant", "ConstantOfShape", "Shape", "Size")
RANDOM_OPS = ("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Bernoulli", "Multinomial")
SMALL = 1 << 16     # constants of at most this many elements keep their value once computed


def is_onnx(source, path=None):
    """Whether build_graph's model names an ONNX file (by its .onnx suffix)."""
    name = path if path is not None else source
    return isinstance(name, (str, os.PathLike)) and str(name).lower().endswith(".onnx")


def _onnx(path):
    try:
        import onnx
    except ImportError:
        raise ModelFileError(path, 0, f"reading an ONNX model needs the onnx package, which is not installed: "
                                      f"{INSTALL}") from None
    return onnx


def load_model(path):
    """The ModelProto of the file (its external data read from beside it)."""
    onnx = _onnx(path)
    if not os.path.isfile(path):
        raise ModelFileError(path, 0, "file not found")
    try:
        model = onnx.load(path)
    except Exception as exc:    # protobuf's DecodeError, a missing external data file, ...
        raise ModelFileError(path, 0, f"not a readable ONNX model: {' '.join(str(exc).split()) or type(exc).__name__}") from None
    if not model.HasField("graph"):     # protobuf reads an empty file as an empty ModelProto
        raise ModelFileError(path, 0, "not an ONNX model: it holds no graph (an empty or foreign file)")
    return model


def opset_of(model):
    """The version of the default ONNX operator set the model imports."""
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    return 1


class Const:
    """A tensor the file fixes (an initializer, a Constant, or computed from them at import):
    its shape and dtype now, its values when asked (np.asarray), so that a plan from shapes
    alone never materializes a large placeholder weight."""

    def __init__(self, shape, dtype, make, from_shape=False):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self._make = make
        self._value = None
        self.from_shape = from_shape    # computed from a Shape (the built shapes, batch included)

    @classmethod
    def of(cls, array, from_shape=False):
        array = np.asarray(array)
        return cls(array.shape, array.dtype, lambda: array, from_shape)

    def value(self):
        if self._value is not None:
            return self._value
        array = np.asarray(self._make())
        if array.size <= SMALL:
            self._value = array
        return array

    def __array__(self, dtype=None, copy=None):
        array = self.value()
        if dtype is not None and array.dtype != np.dtype(dtype):
            return array.astype(dtype)
        return array.copy() if copy else array


def _attributes(node):
    from onnx import helper
    out = {}
    for attribute in node.attribute:
        value = helper.get_attribute_value(attribute)
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        out[attribute.name] = value
    return out


def _msg(type_name, fields):
    """A prototxt Msg of `fields` ({name: value, list of values, or dict for a sub-message})."""
    msg = Msg(type_name, 0)
    for name, value in fields.items():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            msg.fields.append((name, _msg(name, item) if isinstance(item, dict) else item, 0))
    return msg


def node_names(model):
    """A unique layer name per node: its own, else OpType_index (a repeated name gets _2, _3)."""
    names, taken = [], set()
    for index, node in enumerate(model.graph.node):
        base = node.name or f"{node.op_type}_{index}"
        name, count = base, 2
        while name in taken:
            name, count = f"{base}_{count}", count + 1
        taken.add(name)
        names.append(name)
    return names


def model_definition(path):
    """[[node name or '(net)', canonical JSON text], ...] of an ONNX file, as
    checkpoint.model_definition gives a prototxt's: what a checkpoint keeps to notice an edited
    model (the operators, their wiring and attributes; a tensor's shape and a digest of it)."""
    model = load_model(path)

    def plain(value):
        if hasattr(value, "dims"):      # a TensorProto
            return {"dims": list(value.dims), "type": value.data_type, "crc32": zlib.crc32(value.SerializeToString())}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, (int, float, str, bool)) or value is None:
            return value
        return str(value)

    def dims(info):
        return [d.dim_value or d.dim_param for d in info.type.tensor_type.shape.dim]

    graph = model.graph
    header = {"opset": opset_of(model), "inputs": [[i.name, dims(i)] for i in graph.input],
              "outputs": [o.name for o in graph.output],
              "initializers": [[t.name, list(t.dims)] for t in graph.initializer]}
    out = [["(net)", json.dumps(header, sort_keys=True)]]
    for name, node in zip(node_names(model), graph.node):
        entry = {"op": node.op_type, "domain": node.domain, "inputs": list(node.input), "outputs": list(node.output),
                 "attributes": {k: plain(v) for k, v in sorted(_attributes(node).items())}}
        out.append([name, json.dumps(entry, sort_keys=True)])
    return out


def _same_pads(auto_pad, sizes, kernel_extents, strides):
    """ONNX's auto_pad SAME_UPPER / SAME_LOWER: outputs ceil(size / stride), the total pad split
    with the odd one at the end (UPPER) or the start (LOWER); VALID: none. [begins..., ends...]."""
    begins, ends = [], []
    for size, extent, stride in zip(sizes, kernel_extents, strides):
        if auto_pad == "VALID":
            total = 0
        else:
            total = max(0, (-(-size // stride) - 1) * stride + extent - size)
        small, large = total // 2, total - total // 2
        begins.append(small if auto_pad == "SAME_UPPER" else large if auto_pad == "SAME_LOWER" else 0)
        ends.append(total - begins[-1])
    return begins + ends


class OnnxFront:
    """One ONNX file read for one phase. `shape_of(name)` gives the shape build_graph inferred
    for a blob the specs already produced."""

    def __init__(self, path, phase, batch_size, input_size, shape_of):
        self.path = str(path)
        self.phase = phase
        self.batch_size = batch_size
        self.input_size = input_size
        self.shape_of = shape_of
        self.model = load_model(self.path)
        self.onnx = _onnx(self.path)
        self.opset = opset_of(self.model)
        self.graph = self.model.graph
        self.name = self.graph.name
        self.consts = {}      # tensor name -> Const
        self.alias = {}       # tensor name -> the blob that holds it (Identity, a reshape to the same shape)
        self.blobs = set()    # tensor names a spec produced
        self.file_batch = None   # the first input's batch size as the file states it (None: symbolic)
        self.taken = {name for node in self.graph.node for name in list(node.input) + list(node.output)}
        self.taken.update(i.name for i in self.graph.input)
        self.layer_names = set(node_names(self.model))
        self.outputs = {output.name for output in self.graph.output}
        self.uses = {}        # tensor name -> how many node inputs and graph outputs read it
        for node in self.graph.node:
            for name in node.input:
                if name:
                    self.uses[name] = self.uses.get(name, 0) + 1
        for output in self.graph.output:
            self.uses[output.name] = self.uses.get(output.name, 0) + 1

    # ---- errors and names ---------------------------------------------------------------
    def error(self, message, node=None, label=None):
        where = f"node '{label}' ({node.op_type}): " if node is not None else ""
        return ModelFileError(self.path, 0, where + message)

    def fresh(self, base):
        """A tensor or layer name used nowhere in the file nor by an earlier spec."""
        name, count = base, 2
        while name in self.taken or name in self.layer_names:
            name, count = f"{base}_{count}", count + 1
        self.taken.add(name)
        return name

    # ---- tensors --------------------------------------------------------------------------
    def blob(self, name, node, label):
        """The blob of an activation input."""
        name = self.alias.get(name, name)
        if name in self.consts:
            raise self.error(f"input '{name}' is a constant where this importer needs a computed tensor "
                             f"(the node would be evaluated at import if all its inputs were constants)", node, label)
        if name not in self.blobs:
            raise self.error(f"input '{name}' is given by no earlier node, graph input or initializer", node, label)
        return name

    def shape(self, name):
        return tuple(self.shape_of(self.alias.get(name, name)))

    def const(self, name, node, label, what):
        if name not in self.consts:
            raise self.error(f"{what} '{name}' must be a constant (an initializer, or computed from them), not a "
                             f"tensor the network computes", node, label)
        return self.consts[name]

    def const_ints(self, name, node, label, what):
        return [int(v) for v in np.asarray(self.const(name, node, label, what)).reshape(-1)]

    def optional_input(self, node, index):
        return node.input[index] if len(node.input) > index and node.input[index] else None

    def unused_outputs(self, node, label, keep=1, what="output"):
        """Outputs past the first `keep` must be read by nothing (a Dropout's mask, ...)."""
        for name in node.output[keep:]:
            if name and self.uses.get(name):
                raise self.error(f"its {what} '{name}' is read by the network; minigist computes only the "
                                 f"first output of this operator", node, label)

    # ---- specs ----------------------------------------------------------------------------
    def spec(self, label, type_name, bottoms, tops, fields=None, initial=None, node=None):
        msg = _msg("LayerParameter", {"name": label, "type": type_name, **(fields or {})})
        self.blobs.update(tops)
        self.layer_names.add(label)
        origin = f"node '{label}' ({node.op_type})" if node is not None else ""
        return LayerSpec(name=label, type=type_name, bottoms=list(bottoms), tops=list(tops), msg=msg, path=self.path,
                         line=0, phase=self.phase, initial={k: v for k, v in (initial or {}).items() if v is not None},
                         origin=origin)

    def specs(self):
        """LayerSpecs of the graph's inputs, then of every node, in the file's order."""
        for tensor in self.graph.initializer:
            self.consts[tensor.name] = self._initializer(tensor)
        images = []
        for spec in self._inputs():
            yield spec
            images.append(spec.tops[0])
        # the first input's batch size as built (the file's, or the one asked for)
        self.batch = self.shape(images[0])[0] if images else None
        names = node_names(self.model)
        for node, label in zip(self.graph.node, names):
            if node.domain not in ("", "ai.onnx"):
                raise self.error(f"operator {node.domain}.{node.op_type} is not supported (only the default ONNX "
                                 f"domain)", node, label)
            inputs = [name for name in node.input if name]
            if node.op_type in CONSTANT_OPS or (inputs and all(self.alias.get(n, n) in self.consts for n in inputs)
                                                and node.op_type not in RANDOM_OPS):
                self._fold(node, label)
                continue
            handler = getattr(self, f"_op_{node.op_type}", None) if node.op_type in LAYER_OPS else None
            if handler is None:
                raise self.error(f"operator {node.op_type} is not supported (supported: {', '.join(LAYER_OPS)}; and "
                                 f"any operator whose inputs are all constants, evaluated at import)", node, label)
            yield from handler(node, label, _attributes(node))

    def _initializer(self, tensor):
        from onnx import helper, numpy_helper
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
        return Const(tuple(tensor.dims), dtype, lambda: numpy_helper.to_array(tensor))

    def _inputs(self):
        for info in self.graph.input:
            if info.name in self.consts or not self.uses.get(info.name):
                continue        # an initializer listed as an input (IR < 4), or an input nothing reads
            tensor_type = info.type.tensor_type
            if tensor_type.elem_type not in (1, 10, 11):    # float, float16, double
                raise ModelFileError(self.path, 0, f"input '{info.name}' is not a floating-point tensor (ONNX "
                                                   f"element type {tensor_type.elem_type}): minigist's inputs are images")
            dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
            if not dims:
                raise ModelFileError(self.path, 0, f"input '{info.name}' has no shape in the file")
            symbolic = [i for i, d in enumerate(dims) if d is None or d <= 0]
            if 0 in symbolic and self.batch_size is None:
                raise ModelFileError(self.path, 0, f"input '{info.name}' has a symbolic batch size "
                                                   f"('{tensor_type.shape.dim[0].dim_param}'); set the batch size "
                                                   f"(--batch-size, batch_size=)")
            if [i for i in symbolic if i > 0] and not (len(dims) == 4 and self.input_size is not None
                                                       and all(i >= 2 for i in symbolic if i > 0)):
                raise ModelFileError(self.path, 0, f"input '{info.name}' has symbolic dimensions {dims}; set the "
                                                   f"input size (--input-size, input_size=) where they are H and W")
            if self.file_batch is None and dims[0]:
                self.file_batch = dims[0]
            shape = [d or 0 for d in dims]
            label = self.fresh(f"input_{info.name}") if info.name in self.layer_names else info.name
            yield self.spec(label, "Input", [], [info.name], {"input_param": {"shape": {"dim": shape}}})

    # ---- constants ------------------------------------------------------------------------
    def _fold(self, node, label):
        """A node whose inputs are constants (or a Shape of a computed tensor): its outputs
        become constants."""
        attrs = _attributes(node)
        op = node.op_type
        if op in ("Shape", "Size") and node.input[0] not in self.consts:
            shape = self.shape(self.blob(node.input[0], node, label))
            if op == "Size":
                value = np.array(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)
            else:
                start, end = attrs.get("start", 0), attrs.get("end", len(shape))
                value = np.array(shape[slice(start, end)], dtype=np.int64)
            self.consts[node.output[0]] = Const.of(value, from_shape=True)
            return
        if op == "ConstantOfShape":     # lazily: a placeholder weight may be large
            shape = self.const_ints(node.input[0], node, label, "shape")
            fill = np.asarray(self.onnx.numpy_helper.to_array(attrs["value"])) if "value" in attrs else np.zeros(1, np.float32)
            self.consts[node.output[0]] = Const(shape, fill.dtype,
                                                lambda: np.full(shape, fill.reshape(-1)[0], dtype=fill.dtype),
                                                self.consts[node.input[0]].from_shape)
            return
        if op == "Constant" and "sparse_value" in attrs:
            raise self.error("a sparse constant is not supported", node, label)
        feeds = {name: np.asarray(self.consts[self.alias.get(name, name)]) for name in node.input if name}
        try:
            results = self._evaluate(node, feeds)
        except Exception as exc:
            raise self.error(f"could not be evaluated at import ({' '.join(str(exc).split())[:300]})", node, label) from None
        from_shape = any(self.consts[self.alias.get(n, n)].from_shape for n in node.input if n)
        for name, value in zip(node.output, results):
            if name:
                self.consts[name] = Const.of(value, from_shape)

    def _evaluate(self, node, feeds):
        """The node's outputs from onnx's reference evaluator, at the model's opset."""
        from onnx import TensorProto, helper
        from onnx.reference import ReferenceEvaluator
        graph = helper.make_graph([node], "fold",
                                  [helper.make_tensor_value_info(k, TensorProto.UNDEFINED, None) for k in feeds],
                                  [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in node.output if o])
        model = helper.make_model(graph, opset_imports=list(self.model.opset_import))
        return ReferenceEvaluator(model).run(None, feeds)

    # ---- shared pieces -------------------------------------------------------------------
    def _spatial(self, node, label, attrs, x_shape, kernel, dilations=(1, 1)):
        """(strides, pads [hb, wb, he, we]) of a 2-D conv or pool, auto_pad resolved."""
        strides = list(attrs.get("strides", [1, 1]))
        auto_pad = attrs.get("auto_pad", "NOTSET")
        if len(strides) != 2:
            raise self.error(f"strides {strides}: only 2-D is supported", node, label)
        if auto_pad in ("", "NOTSET"):
            pads = list(attrs.get("pads", [0, 0, 0, 0]))
            if len(pads) != 4:
                raise self.error(f"pads {pads}: only 2-D (4 values) is supported", node, label)
            return strides, pads
        if auto_pad not in ("SAME_UPPER", "SAME_LOWER", "VALID"):
            raise self.error(f"auto_pad {auto_pad} is not an ONNX value", node, label)
        if attrs.get("ceil_mode"):
            raise self.error("auto_pad with ceil_mode is not supported", node, label)
        extents = [d * (k - 1) + 1 for k, d in zip(kernel, dilations)]
        return strides, _same_pads(auto_pad, x_shape[2:], extents, strides)

    def _four_d(self, node, label, shape):
        if len(shape) != 4:
            raise self.error(f"a {len(shape)}-D input {shape} is not supported: only 2-D operations on "
                             f"4-D (N, C, H, W) tensors", node, label)

    def _same(self, node, label, x, top):
        """`top` as x itself: an alias, or a copy (Caffe's Split) where `top` is a graph output,
        so that the outputs keep the file's names."""
        if top in self.outputs:
            yield self.spec(label, "Split", [x], [top], node=node)
        else:
            self.alias[top] = x

    def _reshape(self, node, label, x, target, top):
        """`top` as x reshaped to `target` (resolved); x itself when the shape is x's own."""
        if tuple(target) == self.shape(x):
            yield from self._same(node, label, x, top)
            return
        yield self.spec(label, "Reshape", [x], [top], {"reshape_param": {"shape": {"dim": list(target)}}}, node=node)

    # ---- operators that become layers ---------------------------------------------------
    def _op_Conv(self, node, label, attrs):
        x = self.blob(node.input[0], node, label)
        weight = self.const(node.input[1], node, label, "the weight W")
        bias_name = self.optional_input(node, 2)
        bias = self.const(bias_name, node, label, "the bias B") if bias_name else None
        x_shape = self.shape(x)
        self._four_d(node, label, x_shape)
        if len(weight.shape) != 4:
            raise self.error(f"weight of shape {weight.shape}: only 2-D convolution is supported", node, label)
        kernel = list(attrs.get("kernel_shape", weight.shape[2:]))
        if kernel != list(weight.shape[2:]):
            raise self.error(f"kernel_shape {kernel} does not match the weight's {list(weight.shape[2:])}", node, label)
        dilations = list(attrs.get("dilations", [1, 1]))
        strides, pads = self._spatial(node, label, attrs, x_shape, kernel, dilations)
        yield from self._padded(node, label, x, pads, lambda source, sym: self.spec(
            label, "Convolution", [source], [node.output[0]],
            {"convolution_param": {"num_output": weight.shape[0], "kernel_h": kernel[0], "kernel_w": kernel[1],
                                   "stride_h": strides[0], "stride_w": strides[1], "pad_h": sym[0], "pad_w": sym[1],
                                   "dilation": dilations, "group": int(attrs.get("group", 1)),
                                   "bias_term": bias is not None, "weight_filler": {"type": "msra"},
                                   "bias_filler": {"type": "constant"}}},
            {"weight": weight, "bias": self._vector(bias, weight.shape[0], node, label, "B")}, node))

    def _padded(self, node, label, x, pads, make):
        """The layer `make(source, symmetric pads)` on x, after a zero Pad layer for the part of
        asymmetric pads that Caffe's symmetric convolution padding cannot take."""
        symmetric = [min(pads[0], pads[2]), min(pads[1], pads[3])]
        extra = [pads[0] - symmetric[0], pads[1] - symmetric[1], pads[2] - symmetric[0], pads[3] - symmetric[1]]
        source = x
        if any(extra):
            source = self.fresh(f"{node.output[0]}/padded")
            yield self.spec(self.fresh(f"{label}/pad"), "Pad", [x], [source],
                            {"pad_param": {"pads": [0, 0, extra[0], extra[1], 0, 0, extra[2], extra[3]]}}, node=node)
        yield make(source, symmetric)

    def _vector(self, const, length, node, label, what):
        """A bias-like constant of `length` values as a (length,) Const ((1, length) accepted)."""
        if const is None:
            return None
        if int(np.prod(const.shape)) != length or len([d for d in const.shape if d != 1]) > 1:
            raise self.error(f"{what} of shape {const.shape}: a vector of {length} values is needed", node, label)
        if const.shape == (length,):
            return const
        return Const((length,), const.dtype, lambda: np.asarray(const).reshape(length))

    def _op_BatchNormalization(self, node, label, attrs):
        x = self.blob(node.input[0], node, label)
        scale, bias, mean, var = (self.const(node.input[i], node, label, what) for i, what in
                                  ((1, "scale"), (2, "B"), (3, "mean"), (4, "var")))
        if not attrs.get("spatial", 1):
            raise self.error("spatial=0 (per-activation statistics) is not supported", node, label)
        self.unused_outputs(node, label, what="running-statistics output")
        channels = self.shape(x)[1] if len(self.shape(x)) > 1 else 0
        normalized = self.fresh(f"{node.output[0]}/normalized")
        yield self.spec(label, "BatchNormalization", [x], [normalized],
                        {"batch_normalization_param": {"epsilon": float(attrs.get("epsilon", 1e-5)),
                                                       "momentum": float(attrs.get("momentum", 0.9))}},
                        {"mean": self._vector(mean, channels, node, label, "mean"),
                         "variance": self._vector(var, channels, node, label, "var")}, node)
        yield self.spec(self.fresh(f"{label}/affine"), "Scale", [normalized], [node.output[0]],
                        {"scale_param": {"axis": 1, "num_axes": 1, "bias_term": True}},
                        {"scale": self._vector(scale, channels, node, label, "scale"),
                         "bias": self._vector(bias, channels, node, label, "B")}, node)

    def _op_Relu(self, node, label, attrs):
        yield self.spec(label, "ReLU", [self.blob(node.input[0], node, label)], [node.output[0]], node=node)

    def _op_LeakyRelu(self, node, label, attrs):
        alpha = float(attrs.get("alpha", 0.01))
        if alpha < 0:
            raise self.error(f"alpha {alpha} < 0 is not supported", node, label)
        yield self.spec(label, "ReLU", [self.blob(node.input[0], node, label)], [node.output[0]],
                        {"relu_param": {"negative_slope": alpha}}, node=node)

    def _op_Clip(self, node, label, attrs):
        x = self.blob(node.input[0], node, label)
        bounds = [attrs.get("min", -np.inf), attrs.get("max", np.inf)]
        for index in (1, 2):
            name = self.optional_input(node, index)
            if name:
                bounds[index - 1] = float(np.asarray(self.const(name, node, label, ("min", "max")[index - 1])))
        low, high = float(bounds[0]), float(bounds[1])
        if low == 0.0 and high == np.inf:   # max(x, 0), the same forward and backward as a ReLU
            yield self.spec(label, "ReLU", [x], [node.output[0]], node=node)
            return
        fields = {name: value for name, value in (("min", low), ("max", high)) if np.isfinite(value)}
        yield self.spec(label, "Clip", [x], [node.output[0]], {"clip_param": fields}, node=node)

    def _op_Sigmoid(self, node, label, attrs):
        yield self.spec(label, "Sigmoid", [self.blob(node.input[0], node, label)], [node.output[0]], node=node)

    def _op_HardSigmoid(self, node, label, attrs):
        yield self.spec(label, "HardSigmoid", [self.blob(node.input[0], node, label)], [node.output[0]],
                        {"hard_sigmoid_param": {"alpha": float(attrs.get("alpha", 0.2)),
                                                "beta": float(attrs.get("beta", 0.5))}}, node=node)

    def _op_HardSwish(self, node, label, attrs):
        yield self.spec(label, "HardSwish", [self.blob(node.input[0], node, label)], [node.output[0]], node=node)

    def _elementwise(self, node, label, operation):
        """Add / Sum / Mul: Caffe's Eltwise where the inputs share one shape, else a
        broadcasting Add / Mul (one input may be a constant, kept fixed)."""
        names = [self.alias.get(n, n) for n in node.input if n]
        constants = [n for n in names if n in self.consts]
        computed = [self.blob(n, node, label) for n in names if n not in self.consts]
        shapes = [self.shape(n) for n in computed]
        if not constants and len(set(shapes)) == 1 and len(computed) >= 2:
            yield self.spec(label, "Eltwise", computed, [node.output[0]],
                            {"eltwise_param": {"operation": "PROD" if operation == "Mul" else "SUM"}}, node=node)
            return
        if len(names) != 2:
            raise self.error(f"{len(names)} inputs of different shapes: broadcasting takes 2", node, label)
        initial = {"operand": self.consts[constants[0]]} if constants else None
        yield self.spec(label, operation, computed, [node.output[0]], initial=initial, node=node)

    def _op_Add(self, node, label, attrs):
        yield from self._elementwise(node, label, "Add")

    def _op_Sum(self, node, label, attrs):
        yield from self._elementwise(node, label, "Add")

    def _op_Mul(self, node, label, attrs):
        yield from self._elementwise(node, label, "Mul")

    def _pool(self, node, label, attrs, type_name):
        x = self.blob(node.input[0], node, label)
        x_shape = self.shape(x)
        self._four_d(node, label, x_shape)
        self.unused_outputs(node, label, what="Indices output")
        kernel = list(attrs.get("kernel_shape", []))
        if len(kernel) != 2:
            raise self.error(f"kernel_shape {kernel}: only 2-D pooling is supported", node, label)
        if any(d != 1 for d in attrs.get("dilations", [1, 1])):
            raise self.error(f"dilations {list(attrs['dilations'])} are not supported (only 1)", node, label)
        strides, pads = self._spatial(node, label, attrs, x_shape, kernel)
        fields = {"kernel_shape": kernel, "strides": strides, "pads": pads,
                  "ceil_mode": bool(attrs.get("ceil_mode", 0))}
        if type_name == "AveragePool":
            fields["count_include_pad"] = bool(attrs.get("count_include_pad", 0))
        yield self.spec(label, type_name, [x], [node.output[0]], {"onnx_pool_param": fields}, node=node)

    def _op_MaxPool(self, node, label, attrs):
        yield from self._pool(node, label, attrs, "MaxPool")

    def _op_AveragePool(self, node, label, attrs):
        yield from self._pool(node, label, attrs, "AveragePool")

    def _global_pool(self, node, label, method, top):
        x = self.blob(node.input[0], node, label)
        self._four_d(node, label, self.shape(x))
        return self.spec(label, "Pooling", [x], [top], {"pooling_param": {"pool": method, "global_pooling": True}},
                         node=node)

    def _op_GlobalAveragePool(self, node, label, attrs):
        yield self._global_pool(node, label, "AVE", node.output[0])

    def _op_GlobalMaxPool(self, node, label, attrs):
        yield self._global_pool(node, label, "MAX", node.output[0])

    def _op_ReduceMean(self, node, label, attrs):
        x_shape = self.shape(self.blob(node.input[0], node, label))
        axes = attrs.get("axes")
        if self.optional_input(node, 1):
            axes = self.const_ints(node.input[1], node, label, "axes")
        if len(x_shape) != 4 or axes is None or sorted(a % 4 for a in axes) != [2, 3]:
            raise self.error(f"only the mean over H and W of a 4-D input is supported (axes {axes}, input "
                             f"{x_shape})", node, label)
        if attrs.get("keepdims", 1):
            yield self._global_pool(node, label, "AVE", node.output[0])
            return
        pooled = self.fresh(f"{node.output[0]}/pooled")
        yield self._global_pool(node, label, "AVE", pooled)
        yield self.spec(self.fresh(f"{label}/squeeze"), "Reshape", [pooled], [node.output[0]],
                        {"reshape_param": {"shape": {"dim": list(x_shape[:2])}}}, node=node)

    def _op_Gemm(self, node, label, attrs):
        x = self.blob(node.input[0], node, label)
        if len(self.shape(x)) != 2:
            raise self.error(f"input A of shape {self.shape(x)}: Gemm takes a 2-D A", node, label)
        if attrs.get("transA", 0):
            raise self.error("transA=1 is not supported (the batch must be A's first axis)", node, label)
        weight = self.const(node.input[1], node, label, "B (the weight)")
        bias_name = self.optional_input(node, 2)
        transposed = not attrs.get("transB", 0)     # B as (K, N): InnerProduct's transpose layout
        outputs = weight.shape[1] if transposed else weight.shape[0]
        bias = self._vector(self.const(bias_name, node, label, "C (the bias)"), outputs, node, label, "C") \
            if bias_name else None
        alpha, beta = float(attrs.get("alpha", 1.0)), float(attrs.get("beta", 1.0))
        fields = {"inner_product_param": {"num_output": outputs, "transpose": transposed, "bias_term": bias is not None,
                                          "weight_filler": {"type": "msra"}, "bias_filler": {"type": "constant"}}}
        plain = alpha == 1.0 and (beta == 1.0 or bias is None)
        if not plain:
            fields["gemm_param"] = {"alpha": alpha, "beta": beta}
        yield self.spec(label, "InnerProduct" if plain else "Gemm", [x], [node.output[0]], fields,
                        {"weight": weight, "bias": bias}, node)

    def _op_MatMul(self, node, label, attrs):
        x = self.blob(node.input[0], node, label)
        weight = self.const(node.input[1], node, label, "B (the weight)")
        x_shape = self.shape(x)
        if len(weight.shape) != 2 or len(x_shape) < 2 or x_shape[-1] != weight.shape[0]:
            raise self.error(f"only a product of an input of shape (..., K) and a constant (K, N) is supported, "
                             f"got {x_shape} and {weight.shape}", node, label)
        yield self.spec(label, "InnerProduct", [x], [node.output[0]],
                        {"inner_product_param": {"num_output": weight.shape[1], "axis": len(x_shape) - 1,
                                                 "transpose": True, "bias_term": False,
                                                 "weight_filler": {"type": "msra"}}},
                        {"weight": weight}, node)

    def _op_Concat(self, node, label, attrs):
        bottoms = [self.blob(n, node, label) for n in node.input if n]
        yield self.spec(label, "Concat", bottoms, [node.output[0]], {"concat_param": {"axis": int(attrs["axis"])}},
                        node=node)

    def _op_Flatten(self, node, label, attrs):
        x = self.blob(node.input[0], node, label)
        shape = self.shape(x)
        axis = int(attrs.get("axis", 1))
        axis = axis + len(shape) if axis < 0 else axis
        if not 0 <= axis <= len(shape):
            raise self.error(f"axis {attrs.get('axis')} out of range for input shape {shape}", node, label)
        target = (int(np.prod(shape[:axis], dtype=np.int64)), int(np.prod(shape[axis:], dtype=np.int64)))
        yield from self._reshape(node, label, x, target, node.output[0])

    def _op_Reshape(self, node, label, attrs):
        x = self.blob(node.input[0], node, label)
        shape = self.shape(x)
        requested = self.const(node.input[1], node, label, "shape")
        dims = [int(d) for d in np.asarray(requested).reshape(-1)]
        if attrs.get("allowzero", 0) and 0 in dims:
            raise self.error("allowzero=1 with a 0 in the shape (an empty tensor) is not supported", node, label)
        target = [shape[i] if d == 0 else d for i, d in enumerate(dims)]
        if (not requested.from_shape and target and self.file_batch is not None and target[0] == self.file_batch
                and shape and shape[0] == self.batch != self.file_batch):
            # a shape written for the file's batch size (exporters write [1, -1]): its first
            # axis is the batch, which follows the batch size asked for
            target[0] = shape[0]
        if target.count(-1) == 1:
            known = int(np.prod([d for d in target if d != -1], dtype=np.int64))
            total = int(np.prod(shape, dtype=np.int64))
            if known == 0 or total % known:
                raise self.error(f"cannot reshape {shape} to {dims}", node, label)
            target[target.index(-1)] = total // known
        if int(np.prod(target, dtype=np.int64)) != int(np.prod(shape, dtype=np.int64)) or min(target, default=1) < 1:
            raise self.error(f"cannot reshape {shape} to {dims}", node, label)
        yield from self._reshape(node, label, x, target, node.output[0])

    def _axes(self, node, label, attrs):
        if self.optional_input(node, 1):
            return self.const_ints(node.input[1], node, label, "axes")
        return list(attrs.get("axes", []))

    def _op_Squeeze(self, node, label, attrs):
        x = self.blob(node.input[0], node, label)
        shape = self.shape(x)
        axes = [a % len(shape) for a in self._axes(node, label, attrs)] or [i for i, d in enumerate(shape) if d == 1]
        if any(shape[a] != 1 for a in axes):
            raise self.error(f"axes {axes} of shape {shape} are not all 1", node, label)
        yield from self._reshape(node, label, x, [d for i, d in enumerate(shape) if i not in axes], node.output[0])

    def _op_Unsqueeze(self, node, label, attrs):
        x = self.blob(node.input[0], node, label)
        target = list(self.shape(x))
        rank = len(target) + len(self._axes(node, label, attrs))
        for axis in sorted(a % rank for a in self._axes(node, label, attrs)):
            target.insert(axis, 1)
        yield from self._reshape(node, label, x, target, node.output[0])

    def _op_Transpose(self, node, label, attrs):
        x = self.blob(node.input[0], node, label)
        perm = list(attrs.get("perm", reversed(range(len(self.shape(x))))))
        yield self.spec(label, "Transpose", [x], [node.output[0]], {"transpose_param": {"perm": perm}}, node=node)

    def _op_Pad(self, node, label, attrs):
        x = self.blob(node.input[0], node, label)
        if attrs.get("mode", "constant") != "constant":
            raise self.error(f"mode {attrs['mode']} is not supported (only constant)", node, label)
        pads = list(attrs.get("pads", attrs.get("paddings", [])))
        value = float(attrs.get("value", 0.0))
        if self.optional_input(node, 1):
            pads = self.const_ints(node.input[1], node, label, "pads")
        if self.optional_input(node, 2):
            value = float(np.asarray(self.const(node.input[2], node, label, "constant_value")).reshape(-1)[0])
        if self.optional_input(node, 3):
            raise self.error("the axes input is not supported (give pads for every axis)", node, label)
        if value != 0.0:
            raise self.error(f"a constant value {value} is not supported (only 0)", node, label)
        yield self.spec(label, "Pad", [x], [node.output[0]], {"pad_param": {"pads": pads}}, node=node)

    def _op_Dropout(self, node, label, attrs):
        x = self.blob(node.input[0], node, label)
        ratio = float(attrs.get("ratio", 0.5))
        if self.optional_input(node, 1):
            ratio = float(np.asarray(self.const(node.input[1], node, label, "ratio")).reshape(-1)[0])
        self.unused_outputs(node, label, what="mask output")
        yield self.spec(label, "Dropout", [x], [node.output[0]], {"dropout_param": {"dropout_ratio": ratio}}, node=node)

    def _op_LRN(self, node, label, attrs):
        size = int(attrs["size"])
        if size % 2 != 1:
            raise self.error(f"size {size}: only an odd size (a window centred on the channel) is supported",
                             node, label)
        yield self.spec(label, "LRN", [self.blob(node.input[0], node, label)], [node.output[0]],
                        {"lrn_param": {"local_size": size, "alpha": float(attrs.get("alpha", 1e-4)),
                                       "beta": float(attrs.get("beta", 0.75)), "k": float(attrs.get("bias", 1.0))}},
                        node=node)

    def _op_Softmax(self, node, label, attrs):
        x = self.blob(node.input[0], node, label)
        shape = self.shape(x)
        axis = int(attrs.get("axis", 1 if self.opset < 13 else -1))
        axis = axis + len(shape) if axis < 0 else axis
        inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
        if self.opset >= 13 or inner == 1:
            yield self.spec(label, "Softmax", [x], [node.output[0]], {"softmax_param": {"axis": axis}}, node=node)
            return
        # before opset 13 the softmax runs over all axes from `axis` on, as one
        flat = self.fresh(f"{node.output[0]}/flat")
        probabilities = self.fresh(f"{node.output[0]}/flat_softmax")
        outer = int(np.prod(shape[:axis], dtype=np.int64))
        yield self.spec(self.fresh(f"{label}/flatten"), "Reshape", [x], [flat],
                        {"reshape_param": {"shape": {"dim": [outer, -1]}}}, node=node)
        yield self.spec(label, "Softmax", [flat], [probabilities], {"softmax_param": {"axis": 1}}, node=node)
        yield self.spec(self.fresh(f"{label}/unflatten"), "Reshape", [probabilities], [node.output[0]],
                        {"reshape_param": {"shape": {"dim": list(shape)}}}, node=node)

    def _op_Identity(self, node, label, attrs):
        yield from self._same(node, label, self.blob(node.input[0], node, label), node.output[0])
