"""Convolution and Pooling: forward against plain loop references with Caffe's arithmetic,
gradients by central finite differences (float64), parameter errors, float32 agreement."""
import math

import numpy as np
import pytest

from minigist.errors import LayerSetupError
from minigist.testing import LayerRun, check_gradients, make_layer

FLT_MAX = float(np.finfo(np.float32).max)


# ---- references (explicit loops, small shapes only) -----------------------------------------

def ref_conv(x, weight, bias, stride, pad, dilation, group):
    n, c, h, w = x.shape
    o, cg, kh, kw = weight.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, pad, dilation
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    og = o // group
    y = np.zeros((n, o, oh, ow))
    for b in range(n):
        for oc in range(o):
            g = oc // og
            for i in range(oh):
                for j in range(ow):
                    total = 0.0 if bias is None else float(bias[oc])
                    for ci in range(cg):
                        for a in range(kh):
                            for e in range(kw):
                                r = i * sh - ph + a * dh
                                s = j * sw - pw + e * dw
                                if 0 <= r < h and 0 <= s < w:
                                    total += weight[oc, ci, a, e] * x[b, g * cg + ci, r, s]
                    y[b, oc, i, j] = total
    return y


def caffe_pool_size(size, k, s, p, ceil, padded=None):
    """Caffe's pooled size on one axis; `padded`: whether either axis has a pad (Caffe's
    `pad_h_ || pad_w_`, which decides the drop on both axes), default this axis's."""
    padded = p > 0 if padded is None else padded
    if ceil:
        out = int(math.ceil(float(size + 2 * p - k) / s)) + 1
    else:
        out = int(math.floor(float(size + 2 * p - k) / s)) + 1
    if padded and (out - 1) * s >= size + p:
        out -= 1
    return out


def ref_pool(x, method, kernel, stride, pad, ceil=True):
    """Caffe's pooling_layer.cpp, loop for loop. Returns (y, argmax as window index)."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, pad
    oh = caffe_pool_size(h, kh, sh, ph, ceil, bool(ph or pw))
    ow = caffe_pool_size(w, kw, sw, pw, ceil, bool(ph or pw))
    y = np.zeros((n, c, oh, ow))
    arg = np.full((n, c, oh, ow), -1)
    for b in range(n):
        for ch in range(c):
            for i in range(oh):
                for j in range(ow):
                    hs, ws = i * sh - ph, j * sw - pw
                    he, we = min(hs + kh, h + ph), min(ws + kw, w + pw)
                    size = (he - hs) * (we - ws)
                    h0, w0, h1, w1 = max(hs, 0), max(ws, 0), min(he, h), min(we, w)
                    if method == "MAX":
                        best, where = -FLT_MAX, -1
                        for r in range(h0, h1):
                            for s in range(w0, w1):
                                if x[b, ch, r, s] > best:
                                    best, where = x[b, ch, r, s], (r - hs) * kw + (s - ws)
                        y[b, ch, i, j], arg[b, ch, i, j] = best, where
                    else:
                        total = 0.0
                        for r in range(h0, h1):
                            for s in range(w0, w1):
                                total += x[b, ch, r, s]
                        y[b, ch, i, j] = total / size if size > 0 else 0.0
    return y, arg


def distinct(shape, rng, spacing=0.01):
    """Values with no near-ties (spacing >> the finite-difference step), shuffled."""
    return (rng.permutation(int(np.prod(shape))) - np.prod(shape) / 2).reshape(shape) * spacing


# ---- Convolution -------------------------------------------------------------------------

def conv_text(body, fillers=True):
    fill = ' weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "gaussian" }' if fillers else ""
    return f'name: "conv" type: "Convolution" bottom: "x" top: "y" convolution_param {{ {body}{fill} }}'


# (param body, input shape, stride, pad, dilation, group, bias)
CONV_CASES = [
    ("num_output: 3 kernel_size: 3", (2, 2, 5, 6), (1, 1), (0, 0), (1, 1), 1, True),
    ("num_output: 3 kernel_size: 3 pad: 1", (2, 2, 5, 6), (1, 1), (1, 1), (1, 1), 1, True),
    ("num_output: 4 kernel_size: 3 stride: 2 pad: 1", (2, 3, 7, 6), (2, 2), (1, 1), (1, 1), 1, True),
    ("num_output: 2 kernel_size: [2, 3] stride: [2, 1] pad: [1, 0]", (2, 2, 6, 5), (2, 1), (1, 0), (1, 1), 1, True),
    ("num_output: 2 kernel_h: 3 kernel_w: 2 stride_h: 1 stride_w: 3 pad_h: 0 pad_w: 2", (1, 3, 5, 7), (1, 3), (0, 2), (1, 1), 1, True),
    ("num_output: 4 kernel_size: 3 pad: 1 group: 2", (2, 4, 5, 5), (1, 1), (1, 1), (1, 1), 2, True),
    ("num_output: 6 kernel_size: 2 stride: 2 group: 3", (2, 3, 6, 5), (2, 2), (0, 0), (1, 1), 3, True),
    ("num_output: 2 kernel_size: 3 dilation: 2 pad: 2", (2, 2, 7, 6), (1, 1), (2, 2), (2, 2), 1, True),
    ("num_output: 2 kernel_size: 2 dilation: [2, 1] stride: 2 pad: 1", (2, 2, 7, 6), (2, 2), (1, 1), (2, 1), 1, True),
    ("num_output: 3 kernel_size: 3 pad: 1 bias_term: false", (2, 2, 4, 5), (1, 1), (1, 1), (1, 1), 1, False),
    ("num_output: 3 kernel_size: 1", (2, 4, 3, 5), (1, 1), (0, 0), (1, 1), 1, True),
    ("num_output: 4 kernel_size: 1 group: 2", (2, 4, 3, 3), (1, 1), (0, 0), (1, 1), 2, True),
    ("num_output: 3 kernel_size: 1 stride: 2 pad: 1", (2, 2, 5, 4), (2, 2), (1, 1), (1, 1), 1, True),
    ("num_output: 2 kernel_size: 2 pad: 2", (1, 2, 4, 3), (1, 1), (2, 2), (1, 1), 1, True),
    ("num_output: 2 kernel_size: 3 pad: [1, 0]", (3, 1, 4, 5), (1, 1), (1, 0), (1, 1), 1, True),
    # frames whose rows share their zero padding: no top padding (a window past a row's end
    # reads the next row's border, the last sample's reads the slack), a wide kernel, and a
    # pad larger than the kernel's reach (the padded gy is cropped)
    ("num_output: 2 kernel_size: [1, 3] pad: [0, 1]", (3, 2, 4, 5), (1, 1), (0, 1), (1, 1), 1, True),
    ("num_output: 2 kernel_size: 5 pad: 2", (3, 2, 6, 7), (1, 1), (2, 2), (1, 1), 1, True),
    ("num_output: 2 kernel_size: 3 pad: 3", (3, 2, 4, 5), (1, 1), (3, 3), (1, 1), 1, True),
    # a one-channel, one-row frame no longer than the wide columns' overrun: the last
    # sample's columns read whole frames past it, which must hold zeros
    ("num_output: 1 kernel_size: [1, 3] pad: [0, 1] bias_term: false", (1, 1, 1, 1), (1, 1), (0, 1), (1, 1), 1, False),
    ("num_output: 2 kernel_size: [1, 5] pad: [0, 2]", (2, 1, 1, 1), (1, 1), (0, 2), (1, 1), 1, True),
    ("num_output: 1 kernel_size: [1, 3] pad: [0, 1] dilation: [1, 2]", (4, 1, 1, 3), (1, 1), (0, 1), (1, 2), 1, True),
]
CONV_IDS = [c[0] for c in CONV_CASES]


@pytest.mark.parametrize("case", CONV_CASES, ids=CONV_IDS)
@pytest.mark.parametrize("chunk", [None, 2])
def test_conv_forward_matches_reference(case, chunk, kernel_path):
    body, shape, stride, pad, dilation, group, bias = case
    layer = make_layer(conv_text(body), [shape])
    layer.batch_chunk = chunk
    run = LayerRun(layer)
    x = np.random.default_rng(3).standard_normal(shape)
    y = run.forward([x])[0]
    expected = ref_conv(x, run.params[0], run.params[1] if bias else None, stride, pad,
                        dilation, group)
    assert y.shape == expected.shape == layer.top_shapes[0]
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)


def _gradient_modes():
    """(case, mode) pairs; the transposed input gradient exists only for stride 1, non-1x1."""
    pairs = []
    for case, case_id in zip(CONV_CASES, CONV_IDS):
        body, shape, stride = case[:3]
        modes = ["auto", "scatter"]
        if stride == (1, 1) and not make_layer(conv_text(body), [shape]).pointwise:
            modes.append("transposed")
        pairs += [pytest.param(case, mode, id=f"{mode}-{case_id}") for mode in modes]
    return pairs


@pytest.mark.parametrize("case,mode", _gradient_modes())
def test_conv_gradients(case, mode, kernel_path):
    body, shape, stride = case[:3]
    layer = make_layer(conv_text(body), [shape])
    if mode != "auto":
        layer.transposed_backward = mode == "transposed"
    layer.batch_chunk = None if mode == "auto" else 1
    x = np.random.default_rng(4).standard_normal(shape)
    check_gradients(layer, [x], seed=5)


def test_conv_partial_backward_writes_only_what_is_asked(kernel_path):
    layer = make_layer(conv_text("num_output: 4 kernel_size: 3 pad: 1 group: 2"), [(3, 4, 5, 4)])
    layer.batch_chunk = 2
    x = np.random.default_rng(6).standard_normal((3, 4, 5, 4))
    gy = np.random.default_rng(7).standard_normal(layer.top_shapes[0])
    run = LayerRun(layer)
    run.forward([x])
    gx_full, gp_full = run.backward([gy])
    gx, gp = run.backward([gy], need_bottoms=[False])
    assert gx[0] is None
    np.testing.assert_allclose(gp[0], gp_full[0])
    np.testing.assert_allclose(gp[1], gp_full[1])
    gx, gp = run.backward([gy], need_params=False)
    assert gp == [None, None]
    np.testing.assert_allclose(gx[0], gx_full[0])


def test_conv_params_and_stash():
    layer = make_layer(conv_text("num_output: 6 kernel_h: 3 kernel_w: 2 group: 2", fillers=False),
                       [(2, 4, 5, 5)])
    assert [(p.name, p.shape) for p in layer.params] == [("weight", (6, 2, 3, 2)), ("bias", (6,))]
    assert layer.params[0].filler["type"] == "constant" and layer.params[0].filler["value"] == 0
    assert layer.keeps_bottoms == (0,) and layer.keeps_tops == () and layer.saved == {}
    assert layer.top_shapes == [(2, 6, 3, 4)]
    nobias = make_layer(conv_text("num_output: 2 kernel_size: 1 bias_term: false"), [(1, 3, 2, 2)])
    assert [p.name for p in nobias.params] == ["weight"]


def test_conv_workspace_is_bounded_by_chunk():
    layer = make_layer(conv_text("num_output: 8 kernel_size: 3 pad: 1"), [(16, 8, 10, 10)])
    layer.batch_chunk = 4
    col = layer.workspace("forward")["col"]
    # stride-1 columns of the padded input are taken at its frame's full width: 10 + 1, the
    # rows sharing one zero column between them
    assert col.shape == (4 * 8 * 9 * 10 * 11,)


@pytest.mark.parametrize("body, shape, message", [
    ("kernel_size: 3", (1, 2, 5, 5), "num_output"),
    ("num_output: 2", (1, 2, 5, 5), "kernel_size"),
    ("num_output: 2 kernel_size: 3 kernel_h: 3 kernel_w: 3", (1, 2, 5, 5), "not both"),
    ("num_output: 2 kernel_h: 3", (1, 2, 5, 5), "together"),
    ("num_output: 2 kernel_size: [3, 3, 3]", (1, 2, 5, 5), "kernel_size"),
    ("num_output: 2 kernel_size: 0", (1, 2, 5, 5), "positive"),
    ("num_output: 2 kernel_size: 3 stride: 0", (1, 2, 5, 5), "positive"),
    ("num_output: 2 kernel_size: 3 stride: 1 stride_h: 1 stride_w: 1", (1, 2, 5, 5), "not both"),
    ("num_output: 2 kernel_size: 3 dilation: 0", (1, 2, 5, 5), "positive"),
    ("num_output: 2 kernel_size: 3 group: 2", (1, 3, 5, 5), "divisible"),
    ("num_output: 3 kernel_size: 3 group: 2", (1, 4, 5, 5), "divisible"),
    ("num_output: 2 kernel_size: 6", (1, 2, 5, 5), "larger"),
    ("num_output: 2 kernel_size: 3 dilation: 4 pad: 1", (1, 2, 5, 5), "larger"),
    ("num_output: 2 kernel_size: 3", (1, 2, 5), "not supported"),
    ("num_output: 2 kernel_size: 3", (1, 2, 5, 5, 5), "not supported"),
    ("num_output: 2 kernel_size: 3 axis: 2", (1, 2, 5, 5), "not supported"),
])
def test_conv_setup_errors(body, shape, message):
    with pytest.raises(LayerSetupError, match=message):
        make_layer(conv_text(body), [shape])


@pytest.mark.parametrize("body", ["num_output: 8 kernel_size: 3 pad: 1 group: 2",
                                  "num_output: 8 kernel_size: 3 stride: 2",
                                  "num_output: 8 kernel_size: 1"])
def test_conv_float32_agrees_with_float64(body, kernel_path):
    shape = (3, 4, 9, 8)
    x = np.random.default_rng(8).standard_normal(shape)
    gy = np.random.default_rng(9).standard_normal(make_layer(conv_text(body), [shape]).top_shapes[0])
    params = LayerRun(make_layer(conv_text(body), [shape]), seed=1).params
    results = []
    for dtype in (np.float64, np.float32):
        run = LayerRun(make_layer(conv_text(body), [shape], dtype=dtype))
        run.params = [p.astype(dtype) for p in params]
        y = run.forward([x.astype(dtype)])[0]
        gx, gp = run.backward([gy.astype(dtype)])
        assert y.dtype == dtype and gx[0].dtype == dtype
        results.append((y, gx[0], gp[0], gp[1]))
    for a64, a32 in zip(*results):
        np.testing.assert_allclose(a32, a64, rtol=1e-4, atol=1e-4 * np.abs(a64).max())


# ---- Pooling -----------------------------------------------------------------------------

def pool_text(body):
    return f'name: "pool" type: "Pooling" bottom: "x" top: "y" pooling_param {{ {body} }}'




# (param body, input shape, kernel, stride, pad, ceil)
POOL_GEOMETRIES = [
    ("kernel_size: 2 stride: 2", (2, 3, 6, 4), (2, 2), (2, 2), (0, 0), True),
    ("kernel_size: 3 stride: 2", (2, 2, 7, 6), (3, 3), (2, 2), (0, 0), True),          # ceil overhang
    ("kernel_size: 3 stride: 2 round_mode: FLOOR", (2, 2, 7, 6), (3, 3), (2, 2), (0, 0), False),
    ("kernel_size: 3 stride: 2 pad: 1", (2, 2, 6, 7), (3, 3), (2, 2), (1, 1), True),   # pad + ceil
    ("kernel_size: 3 stride: 2 pad: 1 round_mode: FLOOR", (2, 2, 6, 7), (3, 3), (2, 2), (1, 1), False),
    ("kernel_size: 3 stride: 1 pad: 1", (1, 2, 4, 5), (3, 3), (1, 1), (1, 1), True),   # overlapping
    ("kernel_size: 2 stride: 3 pad: 1", (1, 2, 7, 8), (2, 2), (3, 3), (1, 1), True),   # gaps
    ("kernel_size: 2", (1, 2, 4, 3), (2, 2), (1, 1), (0, 0), True),                    # default stride
    ("kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0", (2, 2, 7, 5), (3, 2), (2, 1), (1, 0), True),
    ("kernel_h: 2 kernel_w: 3 stride_h: 1 stride_w: 2 pad_h: 0 pad_w: 2", (1, 2, 5, 8), (2, 3), (1, 2), (0, 2), True),
    ("kernel_size: 4 stride: 3 pad: 2", (1, 2, 8, 9), (4, 4), (3, 3), (2, 2), True),
    ("kernel_size: 2 stride: 2 pad: 1", (1, 2, 5, 6), (2, 2), (2, 2), (1, 1), True),   # pad drop rule
    ("kernel_size: 4 stride: 2", (1, 1, 3, 4), (4, 4), (2, 2), (0, 0), True),          # kernel > input
    ("kernel_size: 1 stride: 2", (1, 2, 4, 5), (1, 1), (2, 2), (0, 0), True),          # empty windows
    ("kernel_size: 3 stride: 2 round_mode: FLOOR", (1, 2, 8, 8), (3, 3), (2, 2), (0, 0), False),  # rows unused
    # a pad on one axis drops the other axis's last window when it starts past the input
    ("kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 3 pad_h: 1 pad_w: 0", (2, 2, 6, 6), (3, 2), (2, 3), (1, 0), True),
    ("kernel_h: 2 kernel_w: 3 stride_h: 3 stride_w: 2 pad_h: 0 pad_w: 1", (1, 2, 6, 6), (2, 3), (3, 2), (0, 1), True),
    ("kernel_h: 1 kernel_w: 3 stride_h: 2 stride_w: 1 pad_h: 0 pad_w: 1", (1, 2, 5, 4), (1, 3), (2, 1), (0, 1), True),
]
POOL_IDS = [g[0] for g in POOL_GEOMETRIES]


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("geometry", POOL_GEOMETRIES, ids=POOL_IDS)
def test_pool_forward_matches_caffe(geometry, method, kernel_path):
    body, shape, kernel, stride, pad, ceil = geometry
    layer = make_layer(pool_text(f"pool: {method} {body}"), [shape])
    x = np.random.default_rng(10).standard_normal(shape)
    run = LayerRun(layer)
    y = run.forward([x])[0]
    expected, arg = ref_pool(x, method, kernel, stride, pad, ceil)
    assert layer.top_shapes[0] == expected.shape
    np.testing.assert_allclose(y, expected, rtol=1e-13, atol=1e-13)
    if method == "MAX":
        assert run.saved["argmax"].dtype == np.uint8
        has_input = arg >= 0
        np.testing.assert_array_equal(run.saved["argmax"][has_input], arg[has_input])
        assert layer.keeps_bottoms == () and layer.keeps_tops == ()
    else:
        assert layer.saved == {} and layer.keeps_bottoms == () and layer.keeps_tops == ()


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("geometry", POOL_GEOMETRIES, ids=POOL_IDS)
def test_pool_gradients(geometry, method, kernel_path):
    body, shape, kernel, stride, pad, ceil = geometry
    layer = make_layer(pool_text(f"pool: {method} {body}"), [shape])
    x = distinct(shape, np.random.default_rng(11))
    # MAX outputs -FLT_MAX for a window wholly outside the input: weight those outputs 0, or
    # the 1e38-sized objective swamps the finite differences
    weights = np.random.default_rng(12).standard_normal(layer.top_shapes[0])
    weights[ref_pool(x, "MAX", kernel, stride, pad, ceil)[1] < 0] = 0
    check_gradients(layer, [x], seed=12, top_weights=[weights])


def test_pool_output_sizes_follow_caffe():
    # (size, kernel, stride, pad, round_mode) -> output size, worked out by hand
    cases = [((8, 3, 2, 0, "CEIL"), 4), ((8, 3, 2, 0, "FLOOR"), 3), ((6, 3, 2, 1, "CEIL"), 4),
             ((6, 3, 2, 1, "FLOOR"), 3), ((5, 2, 2, 1, "CEIL"), 3), ((4, 3, 3, 2, "CEIL"), 2),
             ((8, 4, 3, 2, "CEIL"), 4), ((4, 1, 2, 0, "CEIL"), 3), ((3, 4, 2, 0, "CEIL"), 1),
             ((13, 3, 2, 0, "CEIL"), 6), ((7, 3, 2, 0, "CEIL"), 3)]
    for (size, k, s, p, mode), expected in cases:
        assert caffe_pool_size(size, k, s, p, mode == "CEIL") == expected
        layer = make_layer(pool_text(f"kernel_size: {k} stride: {s} pad: {p} round_mode: {mode}"),
                           [(1, 1, size, size)])
        assert layer.top_shapes[0] == (1, 1, expected, expected), (size, k, s, p, mode)


def test_pool_pad_on_either_axis_drops_windows_on_both():
    """Caffe's `if (pad_h_ || pad_w_)`: the issue's 6x6 input, kernel 3x2, stride 2x3, pad
    1x0 gives 4x2 (the third column window would start at column 6, past the input)."""
    layer = make_layer(pool_text("kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 3 pad_h: 1 pad_w: 0"),
                       [(1, 1, 6, 6)])
    assert layer.top_shapes[0] == (1, 1, 4, 2)
    assert not layer.empty_windows
    # no pad at all: the last window may lie in the overhang (Caffe's quirk), 6x6 -> 3x3
    layer = make_layer(pool_text("kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 3"), [(1, 1, 6, 6)])
    assert layer.top_shapes[0] == (1, 1, 3, 3)


def test_pool_ave_divisor_counts_padding_not_overhang():
    # H = W = 5, kernel 3, stride 2, pad 1 (ceil): windows start at -1, 1, 3 and end at 2, 4, 6,
    # clipped to H + pad = 6: sizes 3, 3, 3 -> every divisor is 9, padding included.
    layer = make_layer(pool_text("pool: AVE kernel_size: 3 stride: 2 pad: 1"), [(1, 1, 5, 5)])
    y = LayerRun(layer).forward([np.ones((1, 1, 5, 5))])[0]
    np.testing.assert_allclose(y[0, 0], [[4 / 9, 6 / 9, 4 / 9], [6 / 9, 1, 6 / 9], [4 / 9, 6 / 9, 4 / 9]])
    # H = W = 6, kernel 3, stride 2, no pad (ceil): the last window overhangs by one and its
    # divisor is the clipped 2 (not 3).
    layer = make_layer(pool_text("pool: AVE kernel_size: 3 stride: 2"), [(1, 1, 6, 6)])
    y = LayerRun(layer).forward([np.ones((1, 1, 6, 6))])[0]
    np.testing.assert_allclose(y, np.ones((1, 1, 3, 3)))
    # pad 1 and an overhang: H = 6, windows start at -1, 1, 3, 5; the last one is clipped to
    # H + pad = 7 -> size 2 of which 1 row is input.
    layer = make_layer(pool_text("pool: AVE kernel_size: 3 stride: 2 pad: 1"), [(1, 1, 6, 6)])
    y = LayerRun(layer).forward([np.ones((1, 1, 6, 6))])[0]
    edge = [2 / 3, 1, 1, 1 / 2]
    np.testing.assert_allclose(y[0, 0], np.outer(edge, edge))


def test_pool_max_ties_take_the_first_in_window_order(kernel_path):
    rng = np.random.default_rng(13)
    x = rng.integers(0, 3, size=(2, 3, 7, 7)).astype(np.float64)     # many ties
    for body, kernel, stride, pad in [("kernel_size: 3 stride: 2 pad: 1", (3, 3), (2, 2), (1, 1)),
                                      ("kernel_size: 2 stride: 2", (2, 2), (2, 2), (0, 0)),
                                      ("kernel_size: 3 stride: 1", (3, 3), (1, 1), (0, 0))]:
        layer = make_layer(pool_text(body), [x.shape])
        run = LayerRun(layer)
        y = run.forward([x])[0]
        expected, arg = ref_pool(x, "MAX", kernel, stride, pad)
        np.testing.assert_array_equal(y, expected)
        np.testing.assert_array_equal(run.saved["argmax"], arg)
        gy = rng.standard_normal(y.shape)
        gx = run.backward([gy])[0][0]
        # the whole gradient of each window goes to its first maximum
        ref_gx = np.zeros_like(x)
        kh, kw = kernel
        for idx in np.ndindex(*y.shape):
            n, c, i, j = idx
            a = arg[idx]
            ref_gx[n, c, i * stride[0] - pad[0] + a // kw, j * stride[1] - pad[1] + a % kw] += gy[idx]
        np.testing.assert_allclose(gx, ref_gx, atol=1e-14)


def test_pool_max_with_padding_never_picks_padding(kernel_path):
    x = -np.ones((1, 1, 4, 4)) - np.arange(16).reshape(1, 1, 4, 4)   # all negative
    layer = make_layer(pool_text("kernel_size: 3 stride: 2 pad: 1"), [x.shape])
    y = LayerRun(layer).forward([x])[0]
    expected, _ = ref_pool(x, "MAX", (3, 3), (2, 2), (1, 1))
    np.testing.assert_array_equal(y, expected)
    assert (y < 0).all()


def test_pool_empty_windows_behave_like_caffe(kernel_path):
    x = np.random.default_rng(14).standard_normal((1, 1, 4, 4))
    layer = make_layer(pool_text("kernel_size: 1 stride: 2"), [x.shape])
    run = LayerRun(layer)
    y = run.forward([x])[0]
    assert y.shape == (1, 1, 3, 3)
    np.testing.assert_array_equal(y[0, 0, :2, :2], x[0, 0, ::2, ::2])
    assert (y[0, 0, 2, :] == -FLT_MAX).all() and (y[0, 0, :, 2] == -FLT_MAX).all()
    gx = run.backward([np.ones(y.shape)])[0][0]
    expected = np.zeros_like(x)
    expected[0, 0, ::2, ::2] = 1
    np.testing.assert_array_equal(gx, expected)


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 2, 17, 17)])
def test_pool_global(method, shape):
    layer = make_layer(pool_text(f"pool: {method} global_pooling: true"), [shape])
    assert layer.top_shapes[0] == shape[:2] + (1, 1)
    x = distinct(shape, np.random.default_rng(15))
    run = LayerRun(layer)
    y = run.forward([x])[0]
    if method == "MAX":
        np.testing.assert_array_equal(y[..., 0, 0], x.max(axis=(2, 3)))
        wide = shape[2] * shape[3] > 256
        assert run.saved["argmax"].dtype == (np.uint16 if wide else np.uint8)
        np.testing.assert_array_equal(run.saved["argmax"][..., 0, 0],
                                      x.reshape(shape[:2] + (-1,)).argmax(axis=2))
    else:
        np.testing.assert_allclose(y[..., 0, 0], x.mean(axis=(2, 3)), rtol=1e-12, atol=1e-15)
    if shape[2] * shape[3] <= 20:
        check_gradients(layer, [x], seed=16)
    else:
        gy = np.random.default_rng(17).standard_normal(y.shape)
        gx = run.backward([gy])[0][0]
        if method == "MAX":
            expected = (x == x.max(axis=(2, 3), keepdims=True)) * gy
        else:
            expected = np.broadcast_to(gy / (shape[2] * shape[3]), shape)
        np.testing.assert_allclose(gx, expected, rtol=1e-12)


def test_pool_global_max_ties_and_equivalence_with_explicit_kernel(kernel_path):
    x = np.zeros((1, 2, 3, 3))
    x[0, 0, 1, 2] = x[0, 0, 2, 0] = 5.0        # tie: (1, 2) comes first
    glob = make_layer(pool_text("global_pooling: true"), [x.shape])
    run = LayerRun(glob)
    run.forward([x])
    assert run.saved["argmax"][0, 0, 0, 0] == 1 * 3 + 2
    assert run.saved["argmax"][0, 1, 0, 0] == 0
    explicit = make_layer(pool_text("kernel_size: 3"), [x.shape])
    run2 = LayerRun(explicit)
    run2.forward([x])
    np.testing.assert_array_equal(run.saved["argmax"], run2.saved["argmax"])


@pytest.mark.parametrize("body", ["kernel_size: 3 stride: 2 pad: 1", "kernel_size: 2 stride: 2",
                                  "kernel_size: 3 stride: 1", "global_pooling: true"])
def test_pool_backward_from_index(body):
    shape = (2, 2, 6, 6)
    layer = make_layer(pool_text(body), [shape])
    x = distinct(shape, np.random.default_rng(18))
    run = LayerRun(layer)
    run.forward([x])
    gy = np.random.default_rng(19).standard_normal(layer.top_shapes[0])
    gx = run.backward([gy])[0][0]
    ws = {name: np.empty(d.shape, d.dtype or np.float64)
          for name, d in layer.workspace("backward").items()}
    out = np.full(shape, np.nan)
    index = run.saved["argmax"].astype(np.int32)        # another integer form of the same index
    layer.backward_from_index(np, index, gy, out, ws)
    np.testing.assert_array_equal(out, gx)


@pytest.mark.parametrize("body, shape, message", [
    ("pool: STOCHASTIC kernel_size: 2", (1, 1, 4, 4), "not supported"),
    ("stride: 2", (1, 1, 4, 4), "kernel_size"),
    ("kernel_h: 2", (1, 1, 4, 4), "kernel_size"),
    ("kernel_size: 2 kernel_h: 2 kernel_w: 2", (1, 1, 4, 4), "not both"),
    ("kernel_size: 0", (1, 1, 4, 4), "positive"),
    ("kernel_size: 2 stride: 0", (1, 1, 4, 4), "positive"),
    ("kernel_size: 2 pad: 2", (1, 1, 4, 4), "smaller than the kernel"),
    ("kernel_h: 3 kernel_w: 2 pad_h: 1 pad_w: 2", (1, 1, 4, 4), "smaller than the kernel"),
    ("kernel_size: 2 pad_h: 1", (1, 1, 4, 4), "together"),
    ("kernel_size: 2 stride: 1 stride_h: 1 stride_w: 1", (1, 1, 4, 4), "not both"),
    ("global_pooling: true kernel_size: 2", (1, 1, 4, 4), "global_pooling"),
    ("global_pooling: true stride: 2", (1, 1, 4, 4), "global_pooling"),
    ("global_pooling: true pad: 1", (1, 1, 4, 4), "global_pooling"),
    ("kernel_size: 5 round_mode: FLOOR", (1, 1, 4, 4), "larger"),
    ("kernel_size: 2", (1, 4, 4), "not supported"),
    ("kernel_size: 2", (1, 1, 4, 4, 4), "not supported"),
])
def test_pool_setup_errors(body, shape, message):
    with pytest.raises(LayerSetupError, match=message):
        make_layer(pool_text(body), [shape])


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("body", ["kernel_size: 3 stride: 2 pad: 1", "kernel_size: 2 stride: 2",
                                  "kernel_size: 3 stride: 1", "global_pooling: true"])
def test_pool_float32_agrees_with_float64(method, body):
    shape = (2, 3, 8, 7)
    x = distinct(shape, np.random.default_rng(20), spacing=0.001)
    results = []
    for dtype in (np.float64, np.float32):
        layer = make_layer(pool_text(f"pool: {method} {body}"), [shape], dtype=dtype)
        run = LayerRun(layer)
        y = run.forward([x.astype(dtype)])[0]
        gy = np.random.default_rng(21).standard_normal(y.shape).astype(dtype)
        gx = run.backward([gy])[0][0]
        assert y.dtype == dtype and gx.dtype == dtype
        results.append((y, gx))
    for a64, a32 in zip(*results):
        np.testing.assert_allclose(a32, a64, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("body", ["num_output: 3 kernel_size: 3 pad: 1",
                                  "num_output: 3 kernel_size: 3 stride: 2 pad: 1",
                                  "num_output: 3 kernel_size: 1"])
def test_conv_frozen_weights(body, kernel_path):
    text = conv_text(body).replace(
        "convolution_param", "param { lr_mult: 0 } param { lr_mult: 1 } convolution_param")
    layer = make_layer(text, [(2, 2, 5, 5)])
    assert not layer.params[0].trained and layer.params[1].trained
    assert layer.keeps_bottoms == ()       # x is read only for the weight gradient
    ws = layer.workspace("backward")
    assert "gwn" not in ws and "xpad" not in ws
    x = np.random.default_rng(22).standard_normal((2, 2, 5, 5))
    check_gradients(layer, [x], seed=23)


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("geometry", POOL_GEOMETRIES, ids=POOL_IDS)
def test_pool_batch_chunks_give_the_same_bits(geometry, method):
    """Workspaces hold one batch chunk; chunks of 1 and 2 samples reproduce the whole batch."""
    body, shape, kernel, stride, pad, ceil = geometry
    shape = (5,) + shape[1:]
    rng = np.random.default_rng(13)
    x = distinct(shape, rng)
    whole = make_layer(pool_text(f"pool: {method} {body}"), [shape])
    reference = LayerRun(whole)
    ref_y = reference.forward([x])[0]
    gy = rng.standard_normal(ref_y.shape)
    ref_gx = reference.backward([gy])[0][0]
    for samples in (1, 2):
        layer = make_layer(pool_text(f"pool: {method} {body}"), [shape])
        (hb, wb), (oh, ow) = layer.buf_hw, layer.out_hw
        layer.chunk_bytes = samples * shape[1] * max(hb * wb if layer.needs_buffer else 0, oh * ow) * 8
        for phase in ("forward", "backward"):
            for decl in layer.workspace(phase).values():
                assert decl.shape[0] == samples
        run = LayerRun(layer)
        np.testing.assert_array_equal(run.forward([x])[0], ref_y)
        if method == "MAX":
            np.testing.assert_array_equal(run.saved["argmax"], reference.saved["argmax"])
        np.testing.assert_array_equal(run.backward([gy])[0][0], ref_gx)


@pytest.mark.parametrize("body", ["num_output: 4 kernel_size: 1", "num_output: 4 kernel_size: 1 group: 2",
                                  "num_output: 4 kernel_size: 3 pad: 1"])
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_conv_in_place_gives_the_out_of_place_bits(body, chunk, kernel_path):
    """Same-shape convolutions (1x1 ones too) write y over x and gx over gy, chunk by chunk.
    The reference runs the same chunks out of place: BLAS may round a GEMM of another width
    differently (OpenBLAS's AVX-512 kernels do), so only equal chunks promise equal bits."""
    shape = (5, 4, 3, 4)
    rng = np.random.default_rng(15)
    x, gy = rng.standard_normal(shape), rng.standard_normal(shape)
    out_of_place = make_layer(conv_text(body), [shape])
    out_of_place.batch_chunk = chunk
    reference = LayerRun(out_of_place)
    ref_y = reference.forward([x])[0]
    (ref_gx,), ref_gp = reference.backward([gy])
    layer = make_layer(conv_text(body), [shape])
    layer.batch_chunk = chunk
    assert layer.inplace_safe(0, 0) and layer.stream_chunk() == chunk
    ws = {phase: {k: np.empty(d.shape, d.dtype or np.float64) for k, d in layer.workspace(phase).items()}
          for phase in ("forward", "backward")}
    params = reference.params
    inplace = x.copy()
    layer.forward(np, [inplace], [inplace], params, {}, ws["forward"])
    np.testing.assert_array_equal(inplace, ref_y)
    grad = gy.copy()
    gp = [np.empty_like(p) for p in params]
    layer.backward(np, [x], [None], [grad], [grad], params, gp, {}, ws["backward"])
    np.testing.assert_allclose(grad, ref_gx, rtol=1e-12, atol=1e-12)
    for got, want in zip(gp, ref_gp):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CONV_CASES, ids=CONV_IDS)
def test_conv_weight_gradient_transposed(case, kernel_path):
    """Where dW fits gw_block_bytes it is computed as dW^T = cols gy^T in a (g, K, O/g)
    workspace, copied (first chunk) or added (later chunks) into dW: same gradients as the
    direct orientation, with one chunk and with one sample per chunk."""
    body, shape, stride, pad, dilation, group, bias = case
    rng = np.random.default_rng(17)
    shape = (3,) + shape[1:]
    x = rng.standard_normal(shape)
    direct = make_layer(conv_text(body), [shape])
    direct.gw_block_bytes = 0       # never transposed
    reference = LayerRun(direct)
    gy = rng.standard_normal(reference.forward([x])[0].shape)
    (ref_gx,), ref_gp = reference.backward([gy])
    for batch_chunk in (None, 1):
        layer = make_layer(conv_text(body), [shape])
        layer.batch_chunk = batch_chunk
        run = LayerRun(layer)
        run.params = [p.copy() for p in reference.params]
        run.forward([x])
        (gx,), gp = run.backward([gy])
        workspace = layer.workspace("backward")
        if not layer.pointwise:
            assert workspace["gwt"].shape == (group, layer.cols, layer.num_output // group)
            assert "gwsum" not in workspace and "gwt" not in direct.workspace("backward")
        np.testing.assert_allclose(gx, ref_gx, rtol=1e-12, atol=1e-12)
        for got, want in zip(gp, ref_gp):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CONV_CASES, ids=CONV_IDS)
def test_conv_weight_gradient_added_in_row_blocks(case, kernel_path):
    """Later chunks add their weight gradient a few output rows at a time (a small workspace,
    not a second dW): same gradients as one chunk."""
    body, shape, stride, pad, dilation, group, bias = case
    rng = np.random.default_rng(16)
    shape = (3,) + shape[1:]
    x = rng.standard_normal(shape)
    reference = LayerRun(make_layer(conv_text(body), [shape]))
    gy = rng.standard_normal(reference.forward([x])[0].shape)
    (ref_gx,), ref_gp = reference.backward([gy])
    layer = make_layer(conv_text(body), [shape])
    layer.batch_chunk = 1
    layer.gw_block_bytes = 1        # one output row per block (and dW never transposed)
    run = LayerRun(layer)
    run.params = [p.copy() for p in reference.params]
    run.forward([x])
    (gx,), gp = run.backward([gy])
    if not layer.pointwise:
        assert layer.workspace("backward")["gwsum"].shape == (group, 1, layer.cols)
    np.testing.assert_allclose(gx, ref_gx, rtol=1e-12, atol=1e-12)
    for got, want in zip(gp, ref_gp):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


class SliceReader:
    """What a replay hands a convolution for a source decoded a slice at a time
    (passes/gist_steps.StreamedStash): at most `chunk_samples` consecutive samples per read,
    each read a fresh copy."""

    def __init__(self, array, chunk_samples):
        self.array, self.chunk_samples = array, chunk_samples
        self.shape, self.dtype = array.shape, array.dtype
        self.reads = []

    def __getitem__(self, index):
        start, stop, step = index.indices(self.shape[0])
        assert step == 1 and stop - start <= self.chunk_samples, (start, stop)
        self.reads.append((start, stop))
        return self.array[start:stop].copy()


@pytest.mark.parametrize("body", ["num_output: 6 kernel_size: 1", "num_output: 6 kernel_size: 1 group: 2",
                                  "num_output: 4 kernel_size: 1", "num_output: 6 kernel_size: 3 pad: 1 stride: 2"])
@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_conv_forward_reads_a_slice_reader_in_its_stream_chunks(body, chunk, kernel_path):
    """A convolution's forward reads its input in slices of forward_stream_chunk() samples
    (the 1x1 path too, which reads an array whole, or through its staging workspace where the
    shapes allow in place: 4 -> 4 channels), covering the batch once, and writes the bits the
    array gives at the same chunks."""
    shape = (5, 4, 6, 6)
    x = np.random.default_rng(16).standard_normal(shape)
    layer = make_layer(conv_text(body), [shape])
    layer.batch_chunk = chunk
    assert layer.forward_stream_chunk() == layer.stream_chunk() == chunk
    run = LayerRun(layer)
    want = run.forward([x])[0]
    ws = {k: np.empty(d.shape, d.dtype or np.float64) for k, d in layer.workspace("forward").items()}
    reader = SliceReader(x, chunk)
    got = np.full_like(want, np.nan)
    layer.forward(np, [reader], [got], run.params, {}, ws)
    np.testing.assert_array_equal(got, want)
    assert [start for start, _ in reader.reads] == list(range(0, shape[0], chunk))
