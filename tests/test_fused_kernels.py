"""The fused kernels of BatchNorm, Scale, ReLU and the convolution's unfold/fold
(minigist/layers/fused_kernels.py) against their ufunc chains, byte for byte: the same
layer run on both paths, in float32 and float64, in place and not, in one chunk and in
several, on values with infinities, NaN and signed zeros mixed in. A NaN must be a NaN in
the same place; its sign and payload may differ. (tests/test_layers_norm.py and the ReLU
test run their references and gradient checks on both paths.)"""
import numpy as np
import pytest

from minigist import jit
from minigist.fillers import fill
from minigist.testing import codes_dpr_writes, make_layer

from test_layers_conv_pool import CONV_CASES, CONV_IDS, conv_text

pytestmark = pytest.mark.skipif(not jit.available(), reason="numba is not installed")

SHAPE = (5, 3, 4, 6)


def values(rng, shape, dtype, special):
    x = rng.standard_normal(shape).astype(dtype)
    if special:
        spots = rng.random(shape) < 0.05
        x[spots] = rng.choice(np.array([0.0, -0.0, np.inf, -np.inf, np.nan], dtype), size=int(spots.sum()))
    return x


def run(layer, x, gy, params, inplace):
    """forward then backward with every array handed in (in place: y over x, gx over gy)."""
    ws = {phase: {k: np.full(d.shape, np.nan if np.dtype(d.dtype or layer.dtype).kind == "f" else 0,
                            d.dtype or layer.dtype)
                  for k, d in layer.workspace(phase).items()} for phase in ("forward", "backward")}
    params = [p.copy() for p in params]
    saved = {k: np.empty(d.shape, d.dtype or layer.dtype) for k, d in layer.saved.items()}
    x_in = x.copy()
    y = x_in if inplace else np.empty(layer.top_shapes[0], x.dtype)
    layer.forward(np, [x_in], [y], params, saved, ws["forward"])
    g = gy.copy()
    gx = g if inplace else np.empty_like(x)
    gp = [np.empty_like(p) if d.trained else None for p, d in zip(params, layer.params)]
    layer.backward(np, [x], [y], [g], [gx], params, gp, saved, ws["backward"])
    return [y.copy(), gx] + [p for p in gp if p is not None] + list(params) + list(saved.values())


def same_bytes(a, b):
    nan = np.isnan(a)
    np.testing.assert_array_equal(nan, np.isnan(b))
    assert a[~nan].tobytes() == b[~nan].tobytes()


def same_on_both_paths(layer, x, gy, params, inplace):
    """Every output, gradient, parameter and stash: the same bytes with the kernels off and on."""
    results = []
    for on in (False, True):
        with jit.use_kernels(on), np.errstate(all="ignore"):
            results.append(run(layer, x, gy, params, inplace))
    for a, b in zip(*results):
        same_bytes(a, b)


LAYERS = {
    "batchnorm": 'name: "bn" type: "BatchNorm" bottom: "x" top: "y"',
    "scale+bias": 'name: "s" type: "Scale" bottom: "x" top: "y" scale_param { bias_term: true '
                  'filler { type: "gaussian" } bias_filler { type: "gaussian" } }',
    "scale": 'name: "s" type: "Scale" bottom: "x" top: "y" scale_param { filler { type: "gaussian" } }',
    "scale axis 2": 'name: "s" type: "Scale" bottom: "x" top: "y" scale_param { axis: 2 num_axes: 2 '
                    'bias_term: true filler { type: "gaussian" } bias_filler { type: "gaussian" } }',
    "relu": 'name: "r" type: "ReLU" bottom: "x" top: "y"',
}


@pytest.mark.parametrize("special", [False, True], ids=["normal", "special"])
@pytest.mark.parametrize("chunk_bytes", [None, 2 * 3 * 4 * 6 * 4])
@pytest.mark.parametrize("inplace", [False, True], ids=["apart", "in place"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_fused_kernels_write_the_same_bytes(kind, dtype, inplace, chunk_bytes, special):
    layer = make_layer(LAYERS[kind], [SHAPE], dtype=dtype)
    if chunk_bytes and hasattr(layer, "chunk_bytes"):
        layer.chunk_bytes = chunk_bytes
    rng = np.random.default_rng(31)
    x, gy = values(rng, SHAPE, dtype, special), values(rng, SHAPE, dtype, special)
    params = [fill(p.filler, p.shape, rng, dtype) for p in layer.params]
    same_on_both_paths(layer, x, gy, params, inplace)


def test_the_kernels_run_when_on(monkeypatch):
    from minigist.layers import fused_kernels
    calls = []
    for name in ("center_square", "batchnorm_input_grad", "scale_bias", "scale_grads", "relu", "relu_grad"):
        original = getattr(fused_kernels, name)
        monkeypatch.setattr(fused_kernels, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    rng = np.random.default_rng(32)
    x, gy = rng.standard_normal(SHAPE), rng.standard_normal(SHAPE)
    for kind in ("batchnorm", "scale+bias", "relu"):
        layer = make_layer(LAYERS[kind], [SHAPE])
        params = [fill(p.filler, p.shape, rng, np.float64) for p in layer.params]
        before = len(calls)
        with jit.use_kernels(False):
            run(layer, x, gy, params, False)
        assert len(calls) == before
        with jit.use_kernels(True):
            run(layer, x, gy, params, False)
    assert calls == ["center_square", "batchnorm_input_grad", "scale_bias", "scale_grads", "relu", "relu_grad"]


@pytest.mark.parametrize("name", ["half_bits_to_float", "half_f16c_to_float"])
def test_half_to_float_is_numpys_cast_for_every_code_dpr_writes(name):
    """The integer conversion is numpy's cast for every code; F16C's for every code but a
    signalling NaN (the hardware quiets it), which DPR fp16 never writes."""
    from minigist.codecs import kernels
    from minigist.codecs.dpr import DPR
    from minigist.layers import fused_kernels
    if name == "half_f16c_to_float" and not jit.HALF:
        pytest.skip("this CPU has no F16C: the integer conversion serves")
    convert = getattr(fused_kernels, name)

    @jit.numba.njit
    def widen_all(codes, out):
        for i in range(codes.size):
            out[i] = convert(codes[i])

    codes = np.arange(1 << 16, dtype=np.uint16)
    # every float32 NaN, signalling ones included, encodes to a quiet NaN code
    nan_bits = np.array([0x7F800001, 0x7FA00000, 0x7FBFFFFF, 0x7FC00000, 0x7FFFFFFF], np.uint32)
    nans = np.concatenate([nan_bits, nan_bits | 0x80000000]).view(np.float32)
    codec = DPR("fp16")
    workspace = {key: np.empty(decl.shape, decl.dtype)
                 for key, decl in codec.flat_workspace(nans.size, "encode").items()}
    for compiled in (True, False):
        written = np.empty(nans.size, np.uint16)
        with kernels.use_codec_kernels(compiled):
            codec.encode_flat(np, nans, written, workspace)
        assert codes_dpr_writes("fp16", written).size == written.size
    if name == "half_f16c_to_float":
        codes = codes_dpr_writes("fp16", codes)
    out = np.empty(codes.size, np.float32)
    widen_all(codes, out)
    # NaNs included: sign and payload kept
    assert out.view(np.uint32).tobytes() == codes.view(np.float16).astype(np.float32).view(np.uint32).tobytes()


@pytest.mark.parametrize("special", [False, True], ids=["normal", "special"])
@pytest.mark.parametrize("chunk_bytes", [None, 2 * 3 * 4 * 6 * 4])
@pytest.mark.parametrize("inplace", [False, True], ids=["apart", "in place"])
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "ufuncs"])
@pytest.mark.parametrize("kind", ["batchnorm", "scale+bias", "scale", "scale axis 2"])
def test_backward_reads_a_float16_stash_as_its_float32_values(kind, kernels, inplace, chunk_bytes, special):
    """BatchNorm's y and Scale's x as float16 (Layer.reads_half, Gist's fp16 stash): every
    gradient the same bytes as from the same values in float32."""
    layer = make_layer(LAYERS[kind], [SHAPE])
    assert layer.reads_half()
    if chunk_bytes:
        layer.chunk_bytes = chunk_bytes
    rng = np.random.default_rng(33)
    x, gy = values(rng, SHAPE, np.float32, special), values(rng, SHAPE, np.float32, special)
    params = [fill(p.filler, p.shape, rng, np.float32) for p in layer.params]
    ws = {phase: {k: np.zeros(d.shape, d.dtype or layer.dtype) for k, d in layer.workspace(phase).items()}
          for phase in ("forward", "backward")}
    saved = {k: np.empty(d.shape, d.dtype or layer.dtype) for k, d in layer.saved.items()}
    y = np.empty(layer.top_shapes[0], np.float32)
    with np.errstate(all="ignore"):
        layer.forward(np, [x.copy()], [y], params, saved, ws["forward"])
    stash16 = (y if kind == "batchnorm" else x).astype(np.float16)
    results = []
    for stash in (stash16, stash16.astype(np.float32)):
        x_in, y_in = (x, stash) if kind == "batchnorm" else (stash, y)
        g = gy.copy()
        gx = g if inplace else np.empty_like(g)
        gp = [np.empty_like(p) if d.trained else None for p, d in zip(params, layer.params)]
        with jit.use_kernels(kernels), np.errstate(all="ignore"):
            layer.backward(np, [x_in], [y_in], [g], [gx], params, gp, saved, ws["backward"])
        results.append([gx] + [p for p in gp if p is not None])
    for a, b in zip(*results):
        same_bytes(a, b)


@pytest.mark.parametrize("inplace", [False, True], ids=["apart", "in place"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_backward_from_a_mask_writes_the_same_bytes(dtype, inplace):
    """Gist's Binarize: ReLU backward from the decoded bool mask, kernels off and on."""
    layer = make_layer(LAYERS["relu"], [SHAPE], dtype=dtype)
    rng = np.random.default_rng(34)
    gy = values(rng, SHAPE, dtype, True)
    mask = rng.random(SHAPE) < 0.5
    results = []
    for on in (False, True):
        g = gy.copy()
        gx = g if inplace else np.empty_like(g)
        with jit.use_kernels(on), np.errstate(all="ignore"):
            layer.backward_from_mask(np, mask.copy(), g, gx, {})
        results.append(gx)
    same_bytes(*results)


@pytest.mark.skipif(not jit.available(), reason="numba is not installed")
def test_relu_in_place_on_bit_patterns_writes_the_select_bytes():
    """The in-place ReLU that CPUs without cheap masked stores run (jit.MASKED_STORES false):
    every float32 bit pattern's result, NaN payloads and signs included, is what the select
    kernel writes, and what numpy gives for every value that is not NaN."""
    from minigist.layers import fused_kernels
    rng = np.random.default_rng(37)
    bits = np.concatenate([rng.integers(0, 1 << 32, size=20000, dtype=np.uint64).astype(np.uint32),
                           np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F800001, 0xFF800001, 0x7FC00000,
                                     0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF, 1, 0x80000001], np.uint32)])
    by_bits = bits.copy()
    fused_kernels.relu_in_place_bits(by_bits)
    by_select = bits.view(np.float32).copy()
    fused_kernels.relu(by_select, by_select, np.float32(0), True)
    assert by_bits.tobytes() == by_select.tobytes()
    x = bits.view(np.float32)
    with np.errstate(invalid="ignore"):
        expected = np.maximum(x, np.float32(0))
    expected[expected == 0] = 0.0      # numpy's maximum(-0, +0) may keep -0; the layer writes +0
    same_bytes(by_bits.view(np.float32), expected)


def test_layers_that_cannot_read_a_float16_stash_say_so():
    assert not make_layer(LAYERS["relu"], [SHAPE]).reads_half()
    assert not make_layer('name: "s" type: "Scale" bottom: "x" top: "y" param { lr_mult: 0 }', [SHAPE]).reads_half()
    assert not make_layer('name: "bn" type: "BatchNorm" bottom: "x" top: "y" '
                          'batch_norm_param { use_global_stats: true }', [SHAPE]).reads_half()


def _conv_modes():
    """(case, transposed) pairs: the transposed input gradient exists for stride 1, non-1x1."""
    pairs = []
    for case, case_id in zip(CONV_CASES, CONV_IDS):
        layer = make_layer(conv_text(case[0]), [case[1]])
        for transposed in (False, True):
            if not transposed or (layer.stride == (1, 1) and not layer.pointwise):
                mode = "transposed" if transposed else "scatter"
                pairs.append(pytest.param(case, transposed, id=f"{mode}-{case_id}"))
    return pairs


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case,transposed", _conv_modes())
def test_convolution_unfold_and_fold_kernels_write_the_same_bytes(case, transposed, dtype):
    body, shape = case[:2]
    layer = make_layer(conv_text(body), [shape], dtype=dtype)
    layer.transposed_backward = transposed
    layer.batch_chunk = 2
    rng = np.random.default_rng(33)
    x = values(rng, shape, dtype, True)
    gy = values(rng, layer.top_shapes[0], dtype, True)
    params = [fill(p.filler, p.shape, rng, dtype) for p in layer.params]
    same_on_both_paths(layer, x, gy, params, False)

