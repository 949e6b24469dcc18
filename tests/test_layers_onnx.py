"""The layers of ONNX's semantics (minigist/onnx_import.py maps nodes onto them): forward
against plain numpy (explicit loops for pooling), gradients against central finite
differences in float64, and the facts Gist relies on. These need no onnx package; their
agreement with onnx's reference evaluator is tests/test_onnx.py's."""
import math

import numpy as np
import pytest

from minigist.errors import LayerSetupError
from minigist.testing import LayerRun, check_gradients, make_layer_from
from minigist.onnx_import import Const


def away_from(rng, shape, kinks, margin=0.05, scale=3.0):
    """Random values at least `margin` away from every kink, so eps never crosses one."""
    x = rng.uniform(-scale, scale, size=shape)
    for kink in kinks:
        near = np.abs(x - kink) < margin
        x = np.where(near, kink + np.where(x >= kink, margin, -margin) * 2, x)
    return x


# ---- activations --------------------------------------------------------------------------

@pytest.mark.parametrize("low,high", [(0.0, 6.0), (-1.0, 1.0), (-np.inf, 0.5)])
def test_clip(low, high):
    rng = np.random.default_rng(0)
    x = away_from(rng, (2, 3, 4, 5), [b for b in (low, high) if np.isfinite(b)], scale=8.0)
    fields = {k: v for k, v in (("min", low), ("max", high)) if np.isfinite(v)}
    layer = make_layer_from("Clip", [x.shape], {"clip_param": fields})
    y, = LayerRun(layer).forward([x])
    np.testing.assert_array_equal(y, np.clip(x, low, high))
    check_gradients(layer, [x])
    assert layer.keeps_tops == (0,) and layer.keeps_bottoms == ()
    # ReLU6 is no ReLU for Gist: no 1-bit mask backward, no source of sparsity
    assert not layer.sparse_output and not layer.mask_backward and not layer.gradient_only_where_positive
    assert layer.keeps_zeros == (low <= 0 <= high)


def test_clip_gradient_is_zero_on_the_bounds():
    x = np.array([[-1.0, 0.0, 3.0, 6.0, 7.0]])
    layer = make_layer_from("Clip", [x.shape], {"clip_param": {"min": 0.0, "max": 6.0}})
    run = LayerRun(layer)
    run.forward([x])
    gx, _ = run.backward([np.ones_like(x)])
    np.testing.assert_array_equal(gx[0], [[0, 0, 1, 0, 0]])


def test_clip_rejects_min_above_max():
    with pytest.raises(LayerSetupError, match="min 2.0 is above max 1.0"):
        make_layer_from("Clip", [(2, 3)], {"clip_param": {"min": 2.0, "max": 1.0}})


def test_sigmoid():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 5)) * 4
    layer = make_layer_from("Sigmoid", [x.shape])
    y, = LayerRun(layer).forward([x])
    np.testing.assert_allclose(y, 1 / (1 + np.exp(-x)), rtol=1e-11)
    check_gradients(layer, [x])
    assert layer.keeps_tops == (0,) and not layer.sparse_output and not layer.keeps_zeros


@pytest.mark.parametrize("alpha,beta", [(0.2, 0.5), (1 / 6, 0.5), (0.5, -0.25)])
def test_hard_sigmoid(alpha, beta):
    rng = np.random.default_rng(2)
    x = away_from(rng, (2, 3, 6), [-beta / alpha, (1 - beta) / alpha], scale=8.0)
    layer = make_layer_from("HardSigmoid", [x.shape], {"hard_sigmoid_param": {"alpha": alpha, "beta": beta}})
    y, = LayerRun(layer).forward([x])
    np.testing.assert_allclose(y, np.maximum(0, np.minimum(1, alpha * x + beta)), rtol=1e-14)
    check_gradients(layer, [x])
    assert layer.keeps_tops == (0,) and not layer.mask_backward


def test_hard_swish():
    rng = np.random.default_rng(3)
    x = away_from(rng, (2, 3, 4, 5), [-3.0, 3.0], scale=6.0)
    layer = make_layer_from("HardSwish", [x.shape])
    y, = LayerRun(layer).forward([x])
    alpha = float(np.float32(1 / 6))     # ONNX's attribute, a float32
    np.testing.assert_allclose(y, x * np.maximum(0, np.minimum(1, alpha * x + 0.5)), rtol=1e-14)
    check_gradients(layer, [x])
    assert layer.keeps_bottoms == (0,) and layer.keeps_tops == ()
    assert not layer.sparse_output and not layer.mask_backward and not layer.keeps_zeros


@pytest.mark.parametrize("kind", ["Clip", "Sigmoid", "HardSigmoid", "HardSwish"])
def test_activations_in_place(kind):
    """y may overwrite x and gx gy (inplace_safe): the same values as with separate arrays."""
    rng = np.random.default_rng(4)
    x = away_from(rng, (2, 3, 8), [-3.0, 0.0, 3.0, 6.0], scale=7.0)
    gy = rng.standard_normal(x.shape)
    fields = {"clip_param": {"min": 0.0, "max": 6.0}} if kind == "Clip" else {}
    layer = make_layer_from(kind, [x.shape], fields)
    assert layer.inplace_safe(0, 0) and layer.elementwise
    run = LayerRun(layer)
    y, = run.forward([x])
    gx, _ = run.backward([gy])
    ws = {k: np.empty(d.shape, d.dtype or np.float64) for k, d in layer.workspace("forward").items()}
    same = x.copy()
    layer.forward(np, [same], [same], [], {}, ws)
    np.testing.assert_array_equal(same, y)
    g = gy.copy()
    ws = {k: np.empty(d.shape, d.dtype or np.float64) for k, d in layer.workspace("backward").items()}
    kept_x = [x] if layer.keeps_bottoms else [None]
    kept_y = [y] if layer.keeps_tops else [None]
    layer.backward(np, kept_x, kept_y, [g], [g], [], [], {}, ws)
    np.testing.assert_array_equal(g, gx[0])


# ---- broadcasting Add and Mul ---------------------------------------------------------------

BROADCASTS = [((2, 3, 4, 5), (2, 3, 1, 1)), ((2, 3, 1, 1), (2, 3, 4, 5)), ((2, 3, 4, 5), (3, 1, 1)),
              ((2, 6), (6,)), ((2, 3, 4), (2, 3, 4))]


@pytest.mark.parametrize("kind", ["Add", "Mul"])
@pytest.mark.parametrize("shapes", BROADCASTS)
def test_broadcast_two_bottoms(kind, shapes):
    rng = np.random.default_rng(5)
    a, b = (rng.standard_normal(s) for s in shapes)
    layer = make_layer_from(kind, [a.shape, b.shape])
    y, = LayerRun(layer).forward([a, b])
    np.testing.assert_array_equal(y, a + b if kind == "Add" else a * b)
    assert y.shape == np.broadcast_shapes(a.shape, b.shape)
    check_gradients(layer, [a, b])
    assert layer.keeps_bottoms == ((0, 1) if kind == "Mul" else ())


@pytest.mark.parametrize("kind", ["Add", "Mul"])
def test_broadcast_constant_operand_is_fixed_state(kind):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 4, 4))
    operand = rng.standard_normal((3, 1, 1))
    layer = make_layer_from(kind, [x.shape], initial={"operand": Const.of(operand)})
    decl, = layer.params
    assert decl.shape == (3, 1, 1) and not decl.learnable and not decl.trained
    run = LayerRun(layer)
    np.testing.assert_array_equal(run.params[0], operand)   # its filler is the file's values
    y, = run.forward([x])
    np.testing.assert_array_equal(y, x + operand if kind == "Add" else x * operand)
    check_gradients(layer, [x])
    assert layer.keeps_bottoms == ()


def test_broadcast_shape_error():
    with pytest.raises(LayerSetupError, match="do not broadcast"):
        make_layer_from("Mul", [(2, 3, 4), (2, 4, 4)])


# ---- Reshape, Transpose, Pad ----------------------------------------------------------------

@pytest.mark.parametrize("dims,axis,num_axes,expected", [
    ([0, -1], 0, -1, (2, 60)), ([6, 10], 1, -1, (2, 6, 10)), ([-1], 2, 2, (2, 3, 20)),
    ([2, 1, 3, 20], 0, -1, (2, 1, 3, 20))])
def test_reshape(dims, axis, num_axes, expected):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 4, 5))
    layer = make_layer_from("Reshape", [x.shape], {"reshape_param": {"shape": {"dim": dims}, "axis": axis,
                                                                     "num_axes": num_axes}})
    y, = LayerRun(layer).forward([x])
    np.testing.assert_array_equal(y, x.reshape(expected))
    check_gradients(layer, [x])
    assert layer.keeps_zeros and layer.inplace_safe(0, 0)


@pytest.mark.parametrize("dims,match", [([7, -1], "cannot infer"), ([-1, -1], "more than one"),
                                        ([2, 3, 4], "does not hold")])
def test_reshape_errors(dims, match):
    with pytest.raises(LayerSetupError, match=match):
        make_layer_from("Reshape", [(2, 3, 4, 5)], {"reshape_param": {"shape": {"dim": dims}}})


def test_transpose():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 3, 4, 2, 5))
    layer = make_layer_from("Transpose", [x.shape], {"transpose_param": {"perm": [0, 2, 1, 3, 4]}})
    y, = LayerRun(layer).forward([x])
    np.testing.assert_array_equal(y, x.transpose(0, 2, 1, 3, 4))
    check_gradients(layer, [x])


def test_pad():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 3, 4, 5))
    pads = [0, 0, 1, 0, 0, 0, 2, 3]
    layer = make_layer_from("Pad", [x.shape], {"pad_param": {"pads": pads}})
    y, = LayerRun(layer).forward([x])
    np.testing.assert_array_equal(y, np.pad(x, [(0, 0), (0, 0), (1, 2), (0, 3)]))
    check_gradients(layer, [x])
    with pytest.raises(LayerSetupError, match="negative pads"):
        make_layer_from("Pad", [x.shape], {"pad_param": {"pads": [0, 0, -1, 0, 0, 0, 0, 0]}})


# ---- BatchNormalization -----------------------------------------------------------------------

def test_batch_normalization_train_forward_running_averages_and_gradients():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((4, 3, 2, 5)) * 2 + 1
    mean0, var0 = rng.standard_normal(3), rng.uniform(0.5, 2, 3)
    layer = make_layer_from("BatchNormalization", [x.shape],
                            {"batch_normalization_param": {"epsilon": 1e-3, "momentum": 0.8}},
                            initial={"mean": Const.of(mean0), "variance": Const.of(var0)})
    assert [(p.name, p.learnable) for p in layer.params] == [("mean", False), ("variance", False)]
    run = LayerRun(layer)
    run.params = [mean0.copy(), var0.copy()]
    y, = run.forward([x])
    batch_mean, batch_var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    expected = (x - batch_mean[:, None, None]) / np.sqrt(batch_var[:, None, None] + 1e-3)
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)
    # ONNX's running averages: the old value weighs momentum, the biased batch variance 1 - momentum
    np.testing.assert_allclose(run.params[0], mean0 * 0.8 + batch_mean * 0.2, rtol=1e-14)
    np.testing.assert_allclose(run.params[1], var0 * 0.8 + batch_var * 0.2, rtol=1e-14)
    check_gradients(layer, [x], atol=1e-6)


def test_batch_normalization_replay_leaves_the_running_averages():
    """Recomputation replays the forward: the same x_hat, the running averages updated once."""
    rng = np.random.default_rng(14)
    x = rng.standard_normal((3, 2, 4, 4))
    layer = make_layer_from("BatchNormalization", [x.shape], {"batch_normalization_param": {"momentum": 0.5}})
    assert layer.forward_updates_state and layer.recomputable
    run = LayerRun(layer)
    y, = run.forward([x])
    after = [p.copy() for p in run.params]
    again = np.empty_like(y)
    ws = {k: np.empty(d.shape, d.dtype or np.float64) for k, d in layer.replay_workspace().items()}
    layer.replay_forward(np, [x], [again], run.params, run.saved, ws)
    np.testing.assert_array_equal(again, y)
    for before, now in zip(after, run.params):
        np.testing.assert_array_equal(before, now)


def test_batch_normalization_test_phase_uses_running_statistics():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 4, 3, 3))
    mean, var = rng.standard_normal(4), rng.uniform(0.5, 2, 4)
    layer = make_layer_from("BatchNormalization", [x.shape], {"batch_normalization_param": {"epsilon": 1e-5}},
                            phase="TEST")
    run = LayerRun(layer)
    run.params = [mean, var]
    y, = run.forward([x])
    np.testing.assert_allclose(y, (x - mean[:, None, None]) / np.sqrt(var[:, None, None] + 1e-5), rtol=1e-12)
    assert layer.keeps_tops == () and not layer.saved
    assert [p.filler["value"] for p in layer.params] == [0.0, 1.0]     # fillers: mean 0, variance 1


# ---- ONNX pooling -----------------------------------------------------------------------------

def onnx_pool_reference(x, method, kernel, strides, pads, ceil_mode, count_include_pad):
    """ONNX's MaxPool / AveragePool, from the operator's definition, one window at a time."""
    n, c, h, w = x.shape
    out = []
    for size, k, s, begin, end in zip((h, w), kernel, strides, pads[:2], pads[2:]):
        span = (size + begin + end - k) / s
        o = (math.ceil(span) if ceil_mode else math.floor(span)) + 1
        if ceil_mode and (o - 1) * s >= size + begin:
            o -= 1
        out.append(o)
    y = np.zeros((n, c) + tuple(out))
    for i in range(out[0]):
        for j in range(out[1]):
            r0, c0 = i * strides[0] - pads[0], j * strides[1] - pads[1]
            rows = [r for r in range(r0, r0 + kernel[0]) if 0 <= r < h]
            cols = [q for q in range(c0, c0 + kernel[1]) if 0 <= q < w]
            window = x[:, :, rows][:, :, :, cols]
            if method == "MaxPool":
                y[:, :, i, j] = window.max(axis=(2, 3))
            else:
                count = len(rows) * len(cols)
                if count_include_pad:   # the window clipped to the padded input (it starts inside it)
                    count = (min(r0 + kernel[0], h + pads[2]) - r0) * (min(c0 + kernel[1], w + pads[3]) - c0)
                y[:, :, i, j] = window.sum(axis=(2, 3)) / count
    return y


POOLS = [  # kernel, strides, pads [hb, wb, he, we], ceil_mode
    ((3, 3), (2, 2), (0, 0, 0, 0), False), ((3, 3), (2, 2), (0, 0, 0, 0), True),
    ((3, 3), (2, 2), (0, 0, 1, 1), False), ((3, 3), (2, 2), (1, 1, 1, 1), True),
    ((2, 3), (2, 1), (1, 0, 0, 2), True), ((3, 3), (1, 1), (1, 1, 1, 1), False),
    ((2, 2), (3, 3), (0, 0, 0, 0), True)]


@pytest.mark.parametrize("method,count_include_pad", [("MaxPool", False), ("AveragePool", False),
                                                       ("AveragePool", True)])
@pytest.mark.parametrize("kernel,strides,pads,ceil_mode", POOLS)
def test_onnx_pooling(method, kernel, strides, pads, ceil_mode, count_include_pad):
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 2, 7, 8))
    fields = {"kernel_shape": list(kernel), "strides": list(strides), "pads": list(pads), "ceil_mode": ceil_mode}
    if method == "AveragePool":
        fields["count_include_pad"] = count_include_pad
    layer = make_layer_from(method, [x.shape], {"onnx_pool_param": fields})
    y, = LayerRun(layer).forward([x])
    np.testing.assert_allclose(y, onnx_pool_reference(x, method, kernel, strides, pads, ceil_mode, count_include_pad),
                               rtol=1e-12)
    check_gradients(layer, [x])


def test_onnx_pooling_rounds_as_onnx_not_as_caffe():
    """6 rows, kernel 2, stride 2, pad 1 at the start only: ONNX gives floor(7 - 2) / 2 + 1 = 3
    rows; Caffe's CEIL (with its pad on both sides) would give 4."""
    layer = make_layer_from("MaxPool", [(1, 1, 6, 6)], {"onnx_pool_param": {
        "kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 0, 0]}})
    assert layer.top_shapes == [(1, 1, 3, 3)]


def test_onnx_pooling_rejects_a_pad_as_large_as_the_kernel():
    with pytest.raises(LayerSetupError, match="smaller than the kernel"):
        make_layer_from("MaxPool", [(1, 1, 6, 6)], {"onnx_pool_param": {
            "kernel_shape": [2, 2], "strides": [1, 1], "pads": [0, 0, 2, 0]}})


# ---- Gemm with alpha and beta -------------------------------------------------------------------

@pytest.mark.parametrize("transpose", [False, True])
def test_gemm_alpha_beta(transpose):
    rng = np.random.default_rng(13)
    x = rng.standard_normal((3, 4))
    weight = rng.standard_normal((4, 5) if transpose else (5, 4))
    bias = rng.standard_normal(5)
    layer = make_layer_from("Gemm", [x.shape], {
        "inner_product_param": {"num_output": 5, "transpose": transpose, "bias_term": True},
        "gemm_param": {"alpha": 0.5, "beta": -2.0}})
    run = LayerRun(layer)
    run.params = [weight, bias]
    y, = run.forward([x])
    np.testing.assert_allclose(y, 0.5 * x @ (weight if transpose else weight.T) - 2.0 * bias, rtol=1e-13)
    check_gradients(layer, [x])
