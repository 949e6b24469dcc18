"""The ONNX front end (minigist/onnx_import.py) against things nobody here wrote: onnx's own
reference evaluator (float64, random inputs, one case per operator and attribute that
matters), the real CNN graphs the onnx wheel ships with their published parameter counts and
the outputs shipped beside them, and Gist on an imported model (lossless bit for bit like
none). Skipped, with the reason, when the onnx package is not installed."""
import glob
import os
import sys

import numpy as np
import pytest

onnx = pytest.importorskip("onnx", reason="the onnx package is not installed (pip install 'minigist[onnx]')")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

import minigist  # noqa: E402
from minigist.errors import ModelFileError  # noqa: E402
from minigist.graph import build_graph  # noqa: E402
from minigist.executor import Executor  # noqa: E402
from minigist.fillers import fill  # noqa: E402
from minigist.program import param_buffer_names  # noqa: E402
from minigist.testing import LayerRun  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIGHT = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")


def save(tmp_path, nodes, inputs, outputs, initializers=None, opset=17, name="model", elem=TensorProto.DOUBLE):
    """Write a model of `nodes` (inputs {name: shape}, outputs [name], initializers {name:
    array}) to tmp_path and return (path, ModelProto)."""
    graph = helper.make_graph(
        nodes, name, [helper.make_tensor_value_info(n, elem, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, elem, None) for n in outputs],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in (initializers or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    path = str(tmp_path / f"{name}.onnx")
    onnx.save(model, path)
    return path, model


def parity(tmp_path, nodes, inputs, outputs, initializers=None, opset=17, rtol=1e-12, seed=0):
    """minigist's TEST-phase forward (float64) against onnx's ReferenceEvaluator on random inputs."""
    path, model = save(tmp_path, nodes, inputs, outputs, initializers, opset)
    rng = np.random.default_rng(seed)
    feeds = {name: rng.standard_normal(shape) for name, shape in inputs.items()}
    expected = ReferenceEvaluator(model).run(None, feeds)
    got = minigist.Net(path, dtype=np.float64).evaluate(*feeds.values())
    for name, want in zip(outputs, expected):
        assert got[name].shape == want.shape, name
        np.testing.assert_allclose(got[name], want, rtol=rtol, atol=1e-12, err_msg=name)
    return path


def rand(*shape, seed=1):
    return np.random.default_rng(seed + len(shape)).standard_normal(shape)


X = "x"
NCHW = {X: (2, 4, 9, 8)}


# ---- operators, one model of several branches per family ---------------------------------------

def test_conv_group_dilation_pads_and_auto_pad(tmp_path):
    node = helper.make_node
    weights = {"w2": rand(6, 2, 3, 3), "b": rand(6), "w": rand(5, 4, 3, 3, seed=2), "w1": rand(3, 4, 2, 2, seed=3)}
    nodes = [
        node("Conv", [X, "w2", "b"], ["group_dilation"], group=2, dilations=[2, 1], strides=[2, 1], pads=[1, 2, 1, 2]),
        node("Conv", [X, "w"], ["asymmetric"], pads=[0, 1, 2, 0]),
        node("Conv", [X, "w"], ["same_upper"], auto_pad="SAME_UPPER", strides=[2, 2]),
        node("Conv", [X, "w1"], ["same_lower"], auto_pad="SAME_LOWER", strides=[2, 3]),
        node("Conv", [X, "w", ""], ["valid"], auto_pad="VALID", strides=[1, 2])]
    parity(tmp_path, nodes, NCHW, [n.output[0] for n in nodes], weights)


def test_batch_normalization_inference(tmp_path):
    stats = {"scale": rand(4), "bias": rand(4, seed=2), "mean": rand(4, seed=3), "var": np.linspace(0.5, 2, 4)}
    nodes = [helper.make_node("BatchNormalization", [X, "scale", "bias", "mean", "var"], ["y"], epsilon=1e-3)]
    parity(tmp_path, nodes, NCHW, ["y"], stats, opset=15)


def test_activations(tmp_path):
    node = helper.make_node
    nodes = [node("Relu", [X], ["relu"]), node("LeakyRelu", [X], ["leaky"], alpha=0.1),
             node("Sigmoid", [X], ["sigmoid"]), node("HardSigmoid", [X], ["hard_sigmoid"], alpha=0.3, beta=0.4),
             node("HardSwish", [X], ["hard_swish"]), node("Clip", [X, "low", "high"], ["clip"]),
             node("Clip", [X, "zero"], ["clip_min_only"]), node("Clip", [X, "", "high"], ["clip_max_only"])]
    bounds = {"low": np.array(-0.5), "high": np.array(0.75), "zero": np.array(0.0)}
    path = parity(tmp_path, nodes, NCHW, [n.output[0] for n in nodes], bounds)
    types = {n.layer.name: n.layer.type for n in build_graph(path).nodes}
    # Clip(min 0) alone is max(x, 0): a ReLU; with an upper bound it is a Clip, no ReLU
    assert types["Clip_6"] == "ReLU" and types["Clip_5"] == "Clip" and types["Clip_7"] == "Clip"


def test_clip_attributes_before_opset_11(tmp_path):
    nodes = [helper.make_node("Clip", [X], ["relu6"], min=0.0, max=6.0)]
    parity(tmp_path, nodes, {X: (2, 3, 4, 4)}, ["relu6"], opset=9)


def test_add_mul_sum_with_broadcasting(tmp_path):
    """Squeeze-and-excitation (x * sigmoid(mean(x)) over the channels), a constant shift and
    scale (C, 1, 1), a residual sum, a three-way Sum."""
    node = helper.make_node
    nodes = [node("GlobalAveragePool", [X], ["pooled"]), node("Sigmoid", ["pooled"], ["gate"]),
             node("Mul", [X, "gate"], ["excited"]), node("Mul", ["gate", X], ["excited_swapped"]),
             node("Add", [X, "pooled"], ["shifted"]), node("Add", ["shift", X], ["constant_shift"]),
             node("Mul", [X, "scale"], ["constant_scale"]), node("Relu", [X], ["r"]),
             node("Add", [X, "r"], ["residual"]), node("Mul", [X, "r"], ["product"]),
             node("Sum", [X, "r", X], ["sum3"])]
    parity(tmp_path, nodes, NCHW, [n.output[0] for n in nodes if n.output[0] not in ("pooled", "gate", "r")],
           {"shift": rand(4, 1, 1), "scale": rand(4, 1, 1, seed=2)})


POOLS = [("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)),
         ("MaxPool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[0, 0, 1, 1])),
         ("MaxPool", dict(kernel_shape=[3, 2], strides=[2, 2], auto_pad="SAME_UPPER")),
         ("MaxPool", dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
         ("AveragePool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)),
         ("AveragePool", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1)),
         ("AveragePool", dict(kernel_shape=[3, 3], strides=[2, 1], pads=[0, 1, 1, 0], count_include_pad=1,
                              ceil_mode=1)),
         ("AveragePool", dict(kernel_shape=[2, 3], strides=[1, 2], auto_pad="SAME_LOWER")),
         ("AveragePool", dict(kernel_shape=[7, 7], pads=[0, 0, 1, 1]))]


def test_pooling(tmp_path):
    nodes = [helper.make_node(kind, [X], [f"pool{i}"], **attrs) for i, (kind, attrs) in enumerate(POOLS)]
    nodes += [helper.make_node("GlobalAveragePool", [X], ["gap"]), helper.make_node("GlobalMaxPool", [X], ["gmp"]),
              helper.make_node("ReduceMean", [X], ["mean_keep"], axes=[2, 3])]
    parity(tmp_path, nodes, NCHW, [n.output[0] for n in nodes], opset=13)


def test_reduce_mean_axes_input_without_keepdims(tmp_path):
    nodes = [helper.make_node("ReduceMean", [X, "axes"], ["mean"], keepdims=0)]
    parity(tmp_path, nodes, NCHW, ["mean"], {"axes": np.array([-1, -2])}, opset=18)


def test_gemm_and_matmul(tmp_path):
    node = helper.make_node
    weights = {"wt": rand(5, 12), "w": rand(12, 5, seed=2), "c": rand(5, seed=3), "c2": rand(1, 5, seed=4),
               "m": rand(8, 3, seed=5)}
    nodes = [node("Flatten", [X], ["flat"], axis=1),
             node("Reshape", [X, "shape"], ["rows"]),
             node("Gemm", ["rows", "wt", "c"], ["gemm_transposed"], transB=1),
             node("Gemm", ["rows", "w"], ["gemm_plain"]),
             node("Gemm", ["rows", "w", "c2"], ["gemm_alpha_beta"], alpha=0.5, beta=-2.0),
             node("MatMul", [X, "m"], ["matmul"])]
    parity(tmp_path, nodes, {X: (2, 3, 4, 8)}, ["flat", "gemm_transposed", "gemm_plain", "gemm_alpha_beta", "matmul"],
           {**weights, "shape": np.array([-1, 12])})


def test_shapes_concat_transpose_pad(tmp_path):
    node = helper.make_node
    nodes = [node("Flatten", [X], ["flat2"], axis=2), node("Reshape", [X, "shape"], ["reshaped"]),
             node("Concat", [X, X], ["concat1"], axis=1), node("Concat", [X, X], ["concat_last"], axis=-1),
             node("Transpose", [X], ["transposed"], perm=[0, 2, 1, 3]),
             node("Unsqueeze", [X, "axes"], ["unsqueezed"]), node("Squeeze", ["unsqueezed", "axes"], ["squeezed"]),
             node("Pad", [X, "pads"], ["padded"]), node("Identity", ["padded"], ["identity"]),
             node("Dropout", [X, "ratio"], ["dropout", "mask"])]
    consts = {"shape": np.array([0, 8, -1]), "axes": np.array([2]), "pads": np.array([0, 0, 1, 0, 0, 0, 2, 3]),
              "ratio": np.array(0.3)}
    parity(tmp_path, nodes, NCHW, ["flat2", "reshaped", "concat1", "concat_last", "transposed", "squeezed",
                                    "identity", "dropout"], consts, opset=13)


def test_lrn_and_softmax(tmp_path):
    node = helper.make_node
    nodes = [node("LRN", [X], ["lrn"], size=3, alpha=0.02, beta=0.6, bias=2.0),
             node("Softmax", [X], ["softmax_axis1"], axis=1)]
    # onnx 1.23's reference LRN loops over range(N) where it means the channels: a batch as
    # large as the channel count gives the operator's definition. It also divides alpha by
    # size in float32 (attributes are float32 scalars there): agreement to 1e-8, not 1e-12
    parity(tmp_path, nodes, {X: (4, 4, 5, 3)}, ["lrn", "softmax_axis1"], opset=13, rtol=1e-8)
    # before opset 13 Softmax runs over every axis from `axis` on, as one (Softmax-11's
    # definition; onnx's reference evaluator implements only Softmax-13, hence the formula here)
    path, _ = save(tmp_path, [node("Softmax", [X], ["softmax_coerced"], axis=1)], NCHW, ["softmax_coerced"], opset=11)
    x = np.random.default_rng(0).standard_normal(NCHW[X])
    flat = np.exp(x.reshape(2, -1) - x.reshape(2, -1).max(axis=1, keepdims=True))
    expected = (flat / flat.sum(axis=1, keepdims=True)).reshape(x.shape)
    np.testing.assert_allclose(minigist.Net(path, dtype=np.float64).evaluate(x)["softmax_coerced"], expected,
                               rtol=1e-12)


def test_flatten_chain_is_folded_for_the_batch_built(tmp_path):
    """Shape -> Gather -> Unsqueeze -> Concat -> Reshape, as exporters write x.view(x.size(0), -1),
    folds into one Reshape; at a batch size other than the file's it follows the batch. A
    Constant node and an initializer feed the chain."""
    node = helper.make_node
    nodes = [node("Shape", [X], ["shape"]), node("Constant", [], ["zero"], value=numpy_helper.from_array(np.array(0))),
             node("Gather", ["shape", "zero"], ["batch"], axis=0), node("Unsqueeze", ["batch", "axes"], ["batch1"]),
             node("Concat", ["batch1", "minus_one"], ["target"], axis=0), node("Reshape", [X, "target"], ["flat"]),
             node("Gemm", ["flat", "w"], ["scores"], transB=1)]
    consts = {"axes": np.array([0]), "minus_one": np.array([-1]), "w": rand(3, 288)}
    path = parity(tmp_path, nodes, NCHW, ["scores"], consts, opset=13)
    graph = build_graph(path, "TEST", batch_size=5)
    assert [n.layer.type for n in graph.nodes] == ["Input", "Reshape", "InnerProduct"]
    assert graph.blobs["scores"].shape == (5, 3)


def test_reshape_written_for_the_files_batch_follows_the_batch_size(tmp_path):
    """A literal shape [1, -1] in a file whose input has batch 1 (what Caffe2 and exporters
    write) reshapes per sample at any batch size."""
    nodes = [helper.make_node("Reshape", [X, "shape"], ["flat"])]
    path, _ = save(tmp_path, nodes, {X: (1, 4, 3, 3)}, ["flat"], {"shape": np.array([1, 36])})
    assert build_graph(path, "TEST").blobs["flat"].shape == (1, 36)
    assert build_graph(path, "TEST", batch_size=8).blobs["flat"].shape == (8, 36)


def test_batch_normalization_training_mode_matches_the_reference(tmp_path):
    """The TRAIN phase runs training_mode=1: batch statistics, and the running averages as
    ONNX's momentum updates them (the reference evaluator's outputs 2 and 3)."""
    stats = {"scale": rand(4), "bias": rand(4, seed=2), "mean": rand(4, seed=3), "var": np.linspace(0.5, 2, 4)}
    nodes = [helper.make_node("BatchNormalization", [X, "scale", "bias", "mean", "var"], ["y", "mean_out", "var_out"],
                              epsilon=1e-3, momentum=0.8, training_mode=1)]
    _, model = save(tmp_path, nodes, NCHW, ["y", "mean_out", "var_out"], stats, opset=15, name="reference")
    path, _ = save(tmp_path, nodes, NCHW, ["y"], stats, opset=15)    # minigist updates the state in place
    x = np.random.default_rng(0).standard_normal(NCHW[X])
    y_ref, mean_ref, var_ref = ReferenceEvaluator(model).run(None, {X: x})
    graph = build_graph(path, "TRAIN", dtype=np.float64)
    values, state = {X: x}, {}
    for node in graph.nodes[1:]:      # the BatchNormalization (normalize), then its Scale (affine)
        run = LayerRun(node.layer)
        run.params = [np.array(decl.initial, dtype=np.float64) for decl in node.layer.params]
        values[node.tops[0]], = run.forward([values[b] for b in node.bottoms])
        state.update({f"{node.layer.name}.{d.name}": p for d, p in zip(node.layer.params, run.params)})
    name = graph.nodes[1].layer.name
    np.testing.assert_allclose(values["y"], y_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(state[f"{name}.mean"], mean_ref, rtol=1e-13)
    np.testing.assert_allclose(state[f"{name}.variance"], var_ref, rtol=1e-13)


# ---- errors ------------------------------------------------------------------------------------

def test_unsupported_operator_is_one_line_naming_node_type_and_file(tmp_path, capsys):
    nodes = [helper.make_node("Tanh", [X], ["y"], name="squash")]
    path, _ = save(tmp_path, nodes, {X: (1, 3, 8, 8)}, ["y"], elem=TensorProto.FLOAT)
    with pytest.raises(ModelFileError) as info:
        build_graph(path)
    assert str(info.value).startswith(f"{path}: node 'squash' (Tanh): operator Tanh is not supported")
    sys.path.insert(0, ROOT)
    import train
    assert train.main(["--model", path, "--summary"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "node 'squash' (Tanh)" in err and path in err


@pytest.mark.parametrize("nodes,initializers,match", [
    ([helper.make_node("ConvTranspose", [X, "w"], ["y"])], {"w": np.ones((3, 2, 2, 2), np.float32)},
     "node 'ConvTranspose_0' \\(ConvTranspose\\): operator ConvTranspose is not supported"),
    ([helper.make_node("Gemm", [X, "w"], ["y"], transA=1)], {"w": np.ones((3, 2), np.float32)}, "transA=1"),
    ([helper.make_node("Relu", [X], ["r"]), helper.make_node("Conv", [X, "r"], ["y"])], {},
     "the weight W 'r' must be a constant"),
    ([helper.make_node("MaxPool", [X], ["y", "indices"], kernel_shape=[2, 2]), helper.make_node("Relu", ["indices"], ["z"])],
     {}, "Indices output 'indices' is read by the network"),
    ([helper.make_node("LRN", [X], ["y"], size=4)], {}, "only an odd size")])
def test_refused_nodes(tmp_path, nodes, initializers, match):
    shape = (2, 3) if nodes[0].op_type == "Gemm" else (1, 3, 8, 8)
    path, _ = save(tmp_path, nodes, {X: shape}, [nodes[-1].output[0]], initializers, elem=TensorProto.FLOAT)
    with pytest.raises(ModelFileError, match=match):
        build_graph(path)


def test_symbolic_batch_needs_a_batch_size(tmp_path):
    path, _ = save(tmp_path, [helper.make_node("Relu", [X], ["y"])], {X: ("N", 3, 8, 8)}, ["y"], elem=TensorProto.FLOAT)
    with pytest.raises(ModelFileError, match="symbolic batch size \\('N'\\); set the batch size"):
        build_graph(path)
    assert build_graph(path, batch_size=4).blobs["y"].shape == (4, 3, 8, 8)


def test_without_onnx_an_onnx_model_says_what_to_install(tmp_path, monkeypatch):
    path, _ = save(tmp_path, [helper.make_node("Relu", [X], ["y"])], {X: (1, 3, 8, 8)}, ["y"])
    monkeypatch.setitem(sys.modules, "onnx", None)      # import onnx now raises ImportError
    with pytest.raises(ModelFileError, match=r"needs the onnx package, which is not installed: "
                                             r"pip install 'minigist\[onnx\]'"):
        build_graph(path)


def test_not_an_onnx_file(tmp_path):
    path = tmp_path / "broken.onnx"
    path.write_bytes(b"\x08\x07not a model at all")
    with pytest.raises(ModelFileError, match="not a readable ONNX model"):
        build_graph(str(path))


# ---- initializers, Gist, training ------------------------------------------------------------

def small_cnn(tmp_path, name="cnn"):
    """conv-BN-ReLU-maxpool, conv-BN-ReLU6, squeeze-and-excitation, HardSwish, global pool, Gemm:
    the operators of a MobileNet in a net that trains on the CPU in a blink."""
    node = helper.make_node
    rng = np.random.default_rng(0)
    f32 = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)   # noqa: E731
    weights = {"w1": f32(8, 3, 3, 3), "s1": 1 + f32(8), "b1": f32(8), "m1": f32(8), "v1": 1 + abs(f32(8)),
               "w2": f32(8, 8, 3, 3), "s2": 1 + f32(8), "b2": f32(8), "m2": f32(8), "v2": 1 + abs(f32(8)),
               "w3": f32(8, 8, 1, 1), "b3": f32(8), "fc": f32(10, 8), "fcb": f32(10),
               "low": np.array(0.0, np.float32), "high": np.array(6.0, np.float32)}
    nodes = [node("Conv", ["data", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             node("BatchNormalization", ["c1", "s1", "b1", "m1", "v1"], ["n1", "rm1", "rv1"], training_mode=1),
             node("Relu", ["n1"], ["r1"]), node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
             node("Conv", ["p1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             node("BatchNormalization", ["c2", "s2", "b2", "m2", "v2"], ["n2"]),
             node("Clip", ["n2", "low", "high"], ["r2"]),
             node("GlobalAveragePool", ["r2"], ["g"]), node("Conv", ["g", "w3", "b3"], ["g3"]),
             node("HardSigmoid", ["g3"], ["gate"]), node("Mul", ["r2", "gate"], ["se"]),
             node("HardSwish", ["se"], ["hs"]), node("GlobalAveragePool", ["hs"], ["pooled"]),
             node("Flatten", ["pooled"], ["flat"]), node("Gemm", ["flat", "fc", "fcb"], ["scores"], transB=1)]
    return save(tmp_path, nodes, {"data": (4, 3, 16, 16)}, ["scores"], weights, name=name, elem=TensorProto.FLOAT)


def test_initializers_are_the_starting_weights_unless_ignored(tmp_path):
    path, model = small_cnn(tmp_path)
    files = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    net = minigist.Net(path)
    params = net.params()
    np.testing.assert_array_equal(params["Conv_0.weight"], files["w1"])
    np.testing.assert_array_equal(params["BatchNormalization_1/affine.scale"], files["s1"])
    np.testing.assert_array_equal(params["BatchNormalization_1.variance"], files["v1"])
    np.testing.assert_array_equal(params["Gemm_14.bias"], files["fcb"])
    filled = minigist.Net(path, initializers=False).params()
    assert not np.array_equal(filled["Conv_0.weight"], files["w1"])
    np.testing.assert_array_equal(filled["BatchNormalization_1.variance"], np.ones(8, np.float32))
    np.testing.assert_array_equal(filled["Gemm_14.bias"], np.zeros(10, np.float32))
    assert net.train_graph.param_count() == sum(files[k].size for k in ("w1", "s1", "b1", "w2", "s2", "b2", "w3", "b3",
                                                                      "fc", "fcb"))


def test_gist_treats_relu6_and_hardswish_as_no_relu(tmp_path):
    path, _ = small_cnn(tmp_path)
    # calibrating: every SSDC candidate planned, at full capacity
    program = minigist.compile(path, minigist.Options(gist="lossless", add_loss=True), calibrating=True).program
    encodings = {e.tensor: e.name for e in program.encodings.values()}
    assert encodings["blob:r1"] == "dropped"     # the ReLU's: Binarize, fused into the max-pool's code
    assert encodings["blob:p1"].startswith("ssdc")   # the pooled ReLU output the next conv keeps: SSDC
    # the ReLU6's output (kept by itself and the Mul) and the HardSwish's input (the Mul's
    # output, kept by the HardSwish): no mask, no SSDC, kept as they are
    assert "blob:r2" not in encodings and "blob:se" not in encodings
    lossy = minigist.compile(path, minigist.Options(gist="all", add_loss=True)).program
    encodings = {e.tensor: e.name for e in lossy.encodings.values()}
    assert encodings["blob:r2"] == "fp16" and encodings["blob:se"] == "fp16"      # DPR applies


def test_add_loss_trains_and_lossless_is_bit_identical_to_none(tmp_path):
    path, _ = small_cnn(tmp_path)
    rng = np.random.default_rng(1)
    batch = (rng.standard_normal((4, 3, 16, 16)).astype(np.float32), rng.integers(0, 10, 4))
    batches = [batch] * 3      # one batch, fitted: the loss falls within three steps
    weights, losses = {}, {}
    for gist in ("none", "lossless"):
        net = minigist.Net(path, gist=gist, add_loss=True, solver=minigist.SGD(lr=0.05, momentum=0.9))
        assert "SoftmaxWithLoss" in net.train_graph.added_loss
        losses[gist] = [net.train_step(*batch) for batch in batches]
        weights[gist] = net.state()
    assert losses["none"] == losses["lossless"]
    for key, value in weights["none"].items():
        np.testing.assert_array_equal(value, weights["lossless"][key], err_msg=key)
    assert losses["none"][-1] < losses["none"][0]
    # the running statistics moved, by ONNX's momentum
    assert not np.array_equal(weights["none"]["BatchNormalization_1.mean"], net.graphs["TEST"].nodes[2].layer.params[0].initial)


@pytest.mark.parametrize("gist", ["none", "all"])
def test_an_imported_model_keeps_cupy_rules(tmp_path, gist):
    """A training step of the small MobileNet-like net on the CPU-side checker of CuPy's rules
    (minigist/gpu/rules.py): no output overlapping an input, no allocation outside the arena,
    no subnormal arithmetic; the syncs are the loss (and SSDC's fit)."""
    from minigist.gpu.rules import XP, Report, relu_like_batch
    path, _ = small_cnn(tmp_path)
    net = minigist.Net(path, device="cupy-rules", gist=gist, conv="im2col", update="fused", add_loss=True)
    batches = [relu_like_batch((4, 3, 16, 16), 10, k) for k in range(2)]
    net.train_step(*batches[0])
    report = Report()
    with XP.checking(report):
        net.train_step(*batches[1])
        report.steps += 1
    assert report.all_violations() == [], report.lines()
    assert report.summary()["host_syncs_per_step"] <= 2


def test_train_py_trains_an_onnx_model_and_resumes_with_its_definition(tmp_path, capsys):
    path, _ = small_cnn(tmp_path)
    sys.path.insert(0, ROOT)
    import train
    run = str(tmp_path / "run")
    argv = ["--model", path, "--add-loss", "--data", "synthetic", "--checkpoint", run, "--train-eval-size", "0",
            "--conv", "im2col"]
    assert train.main(argv + ["--iters", "2", "--ignore-initializers"]) == 0
    assert train.main(argv + ["--iters", "4", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "added loss: SoftmaxWithLoss" in out and f"resumed from {run}" in out


# ---- the real graphs the onnx wheel ships --------------------------------------------------------

# learned parameters: the published count of each architecture where one is published for it
# (BVLC's AlexNet and GoogLeNet deploy files, He et al.'s ResNet-50, VGG-19, DenseNet-121 and
# SqueezeNet 1.1 as torchvision counts them); the others as their layers add up (test below)
PUBLISHED = {"bvlc_alexnet": 60_965_224, "inception_v1": 6_998_552, "resnet50": 25_557_032, "vgg19": 143_667_240,
             "densenet121": 7_978_856, "squeezenet": 1_235_496}
QUICK = ("squeezenet",)
LIGHT_NAMES = sorted(os.path.basename(p)[6:-5] for p in glob.glob(os.path.join(LIGHT, "light_*.onnx")))


def layer_arithmetic(path):
    """The learned parameters as the file's nodes give them, read here without minigist: conv and
    Gemm weights and biases, BatchNormalization's scale and B (a Caffe2 file's Mul / Add after a
    BatchNormalization are constants)."""
    model = onnx.load(path)
    initializers = {t.name: t for t in model.graph.initializer}
    shapes = {name: tuple(t.dims) for name, t in initializers.items()}
    for node in model.graph.node:     # the light files' weights: ConstantOfShape(shape), some reshaped
        if node.op_type == "ConstantOfShape":
            shapes[node.output[0]] = tuple(numpy_helper.to_array(initializers[node.input[0]]))
        elif node.op_type == "Reshape" and node.input[0] in shapes:
            shapes[node.output[0]] = shapes[node.input[0]]
    learned = {"Conv": (1, 2), "Gemm": (1, 2), "BatchNormalization": (1, 2)}
    return sum(int(np.prod(shapes[node.input[i]])) for node in model.graph.node
               for i in learned.get(node.op_type, ()) if len(node.input) > i and node.input[i])


def forward(path, x):
    """The TEST program alone (a Net would add the training program's gradients and momentum:
    3 GB more for VGG-19 in float64), every buffer its own array, the file's weights."""
    compiled = minigist.compile(path, minigist.Options(dtype=np.float64, alloc="none"), "TEST")
    program = compiled.program
    arrays = {name: np.empty(b.shape, b.dtype) for name, b in program.buffers.items()}
    for layer in compiled.graph.layers:
        for index, decl in enumerate(layer.params):
            initial = decl.initial if decl.initial is not None else fill(decl.filler, decl.shape, None, np.float64)
            arrays[param_buffer_names(layer, index)[0]][...] = np.asarray(initial)
    data = next(node for node in compiled.graph.nodes if node.layer.is_data)
    output, = program.outputs.values()
    return Executor(program, arrays, np).run(lambda a: a[f"blob:{data.tops[0]}"].__setitem__(Ellipsis, x),
                                             lambda a: a[output].copy())


def dummy_input(graph):
    """onnx's backend test runner's generate_dummy_data(seed=0, random=False): arange / n."""
    data = next(n for n in graph.nodes if n.layer.is_data)
    shape = graph.blobs[data.tops[0]].shape
    count = int(np.prod(shape))
    return (np.arange(count).reshape(shape) / count).astype(np.float32)


@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in LIGHT_NAMES])
def test_shipped_model_loads_counts_and_matches_its_output(name):
    path = os.path.join(LIGHT, f"light_{name}.onnx")
    graph = build_graph(path, "TEST")
    assert graph.param_count() == PUBLISHED.get(name, layer_arithmetic(path)) == layer_arithmetic(path)
    # float64: the placeholder weights give logits of up to 1e10, equal for every class; in float32
    # their last bits decide a softmax, in float64 they do not (the shipped output is 0.001 each)
    got = forward(path, dummy_input(graph))
    expected = numpy_helper.to_array(onnx.load_tensor(os.path.join(LIGHT, f"light_{name}_output_0.pb")))
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-7)


# the static planner is quadratic in the buffers: DenseNet-121's 6,800 take it ~10 s a plan, so
# the largest graphs are planned here with dynamic allocation (tools/onnx_table.py gives the
# README their static plans)
STATIC_PLANNED = ("bvlc_alexnet", "inception_v1", "squeezenet", "vgg19", "zfnet512")


@pytest.mark.slow
@pytest.mark.parametrize("name", LIGHT_NAMES)
def test_shipped_model_plans_under_every_gist_mode(name):
    path = os.path.join(LIGHT, f"light_{name}.onnx")
    alloc = "static" if name in STATIC_PLANNED else "dynamic"
    footprints = {}
    for gist in ("none", "lossless", "lossy", "all"):
        report = minigist.plan_footprint(path, batch_size=4, alloc=alloc, gist=gist, add_loss=True)
        assert report["parameters"] == build_graph(path).param_count() and "SoftmaxWithLoss" in report["added_loss"]
        footprints[gist] = report["footprint_bytes"]
    assert footprints["lossless"] <= footprints["none"]
    assert footprints["lossy"] < footprints["none"] and footprints["all"] < footprints["none"]


def test_every_listed_model_is_shipped():
    assert set(PUBLISHED) | {"inception_v2", "shufflenet", "zfnet512"} <= set(LIGHT_NAMES)
