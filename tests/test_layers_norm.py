"""BatchNorm, Scale and LRN: forward against plain numpy references, gradients by central
finite differences (float64), and parameter errors. Every test runs on the ufunc path and,
with numba, on the compiled kernels (minigist/layers/fused_kernels.py)."""
import numpy as np
import pytest

from minigist.errors import LayerSetupError
from minigist.testing import LayerRun, check_gradients, make_layer


pytestmark = pytest.mark.usefixtures("kernel_path")


def bn_text(extra=""):
    return f'name: "bn" type: "BatchNorm" bottom: "x" top: "x" {extra}'


def channel_axes(x):
    return (0,) + tuple(range(2, x.ndim))


def assert_in_place_gives_the_bits_of(layer, reference, x, gy):
    """`layer` run in place (y over x, gx over gy) writes `reference`'s bits; returns its y."""
    ref_y = reference.forward([x])[0]
    ref_gx = reference.backward([gy])[0][0]
    ws = {phase: {k: np.empty(d.shape) for k, d in layer.workspace(phase).items()} for phase in ("forward", "backward")}
    inplace = x.copy()
    layer.forward(np, [inplace], [inplace], [], {}, ws["forward"])
    np.testing.assert_array_equal(inplace, ref_y)
    grad = gy.copy()
    layer.backward(np, [x], [None], [grad], [grad], [], [], {}, ws["backward"])
    np.testing.assert_array_equal(grad, ref_gx)
    return ref_y


def channel_view(v, x):
    return v.reshape((1, -1) + (1,) * (x.ndim - 2))


# ---- BatchNorm ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (7, 4)])
def test_batchnorm_train_forward_and_running_stats(shape):
    rng = np.random.default_rng(1)
    maf, eps = 0.9, 1e-3
    layer = make_layer(bn_text(f"batch_norm_param {{ moving_average_fraction: {maf} eps: {eps} }}"),
                       [shape])
    assert not layer.use_global
    assert [p.name for p in layer.params] == ["mean", "variance", "scale_factor"]
    assert [p.shape for p in layer.params] == [(shape[1],), (shape[1],), (1,)]
    assert all(not p.trained and p.lr_mult == 0 for p in layer.params)
    assert layer.keeps_tops == (0,) and layer.keeps_bottoms == ()
    assert set(layer.saved) == {"inv_std"} and layer.saved["inv_std"].shape == (shape[1],)

    run = LayerRun(layer)
    x1 = rng.standard_normal(shape) * 3 + 2
    x2 = rng.standard_normal(shape) * 0.5 - 1
    axes = channel_axes(x1)
    m = x1.size // shape[1]
    state_mean = np.zeros(shape[1])
    state_var = np.zeros(shape[1])
    state_sf = 0.0
    for x in (x1, x2):
        y = run.forward([x])[0].copy()
        mean_b, var_b = x.mean(axis=axes), x.var(axis=axes)
        ref = (x - channel_view(mean_b, x)) / np.sqrt(channel_view(var_b, x) + eps)
        np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(run.saved["inv_std"], 1 / np.sqrt(var_b + eps), rtol=1e-12)
        state_sf = state_sf * maf + 1
        state_mean = state_mean * maf + mean_b
        state_var = state_var * maf + var_b * m / (m - 1)
    np.testing.assert_allclose(run.params[2], [state_sf], rtol=1e-12)      # 1.9
    np.testing.assert_allclose(run.params[0], state_mean, rtol=1e-12)
    np.testing.assert_allclose(run.params[1], state_var, rtol=1e-12)
    assert run.params[2][0] == pytest.approx(1 + maf)

    # the same state used in global-stats mode (TEST phase default)
    test_layer = make_layer(bn_text(f"batch_norm_param {{ eps: {eps} }}"), [shape], phase="TEST")
    assert test_layer.use_global and test_layer.keeps_tops == () and test_layer.saved == {}
    test_run = LayerRun(test_layer)
    test_run.params = [p.copy() for p in run.params]
    x3 = rng.standard_normal(shape)
    y = test_run.forward([x3])[0]
    mean, var = state_mean / state_sf, state_var / state_sf
    ref = (x3 - channel_view(mean, x3)) / np.sqrt(channel_view(var, x3) + eps)
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-12)
    for got, want in zip(test_run.params, run.params):   # global mode leaves the state alone
        np.testing.assert_array_equal(got, want)
    gy = rng.standard_normal(shape)
    gx, gp = test_run.backward([gy])
    np.testing.assert_allclose(gx[0], gy / np.sqrt(channel_view(var, x3) + eps), rtol=1e-12)
    assert gp == [None, None, None]


def test_batchnorm_global_stats_zero_scale_factor():
    # scale_factor 0 (fresh state): Caffe's factor is 0, so mean = 0 and var = 0
    layer = make_layer(bn_text("batch_norm_param { use_global_stats: true eps: 0.01 }"), [(2, 3, 2, 2)])
    assert layer.use_global and layer.spec.phase == "TRAIN"
    run = LayerRun(layer)
    run.params[0][:] = [1.0, 2.0, 3.0]
    run.params[1][:] = [4.0, 5.0, 6.0]
    x = np.random.default_rng(2).standard_normal((2, 3, 2, 2))
    np.testing.assert_allclose(run.forward([x])[0], x / np.sqrt(0.01), rtol=1e-12)


def test_batchnorm_use_global_stats_false_in_test_updates_state():
    layer = make_layer(bn_text("batch_norm_param { use_global_stats: false }"), [(3, 2)], phase="TEST")
    assert not layer.use_global
    run = LayerRun(layer)
    run.forward([np.arange(6.0).reshape(3, 2)])
    np.testing.assert_allclose(run.params[2], [1.0])
    np.testing.assert_allclose(run.params[0], [2.0, 3.0])
    np.testing.assert_allclose(run.params[1], [4.0, 4.0])   # var_b 8/3 * 3/2


def test_batchnorm_in_place_same_array():
    # Caffe nets run BatchNorm in place: y and x the same array, gx and gy the same array
    shape = (3, 2, 2, 2)
    rng = np.random.default_rng(3)
    layer = make_layer(bn_text(), [shape])
    assert layer.inplace_safe(0, 0)
    x = rng.standard_normal(shape)
    gy = rng.standard_normal(shape)
    ref_run = LayerRun(layer)
    ref_y = ref_run.forward([x])[0].copy()
    ref_gx = ref_run.backward([gy])[0][0].copy()

    params = [np.zeros(2), np.zeros(2), np.zeros(1)]
    buf = x.copy()
    saved = {"inv_std": np.full(2, np.nan)}
    ws = {k: np.full(d.shape, np.nan) for k, d in layer.workspace("forward").items()}
    layer.forward(np, [buf], [buf], params, saved, ws)
    np.testing.assert_allclose(buf, ref_y, rtol=1e-12)
    grad = gy.copy()
    ws = {k: np.full(d.shape, np.nan) for k, d in layer.workspace("backward").items()}
    layer.backward(np, [None], [buf], [grad], [grad], params, [None] * 3, saved, ws)
    np.testing.assert_allclose(grad, ref_gx, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", [(3, 2, 2, 3), (5, 3)])
def test_batchnorm_train_gradients(shape):
    rng = np.random.default_rng(4)
    layer = make_layer(bn_text("batch_norm_param { eps: 0.001 }"), [shape])
    check_gradients(layer, [rng.standard_normal(shape) * 2 + 1], rtol=1e-5, atol=1e-7)


def test_batchnorm_global_gradients():
    rng = np.random.default_rng(5)
    shape = (2, 3, 2, 2)
    layer = make_layer(bn_text(), [shape], phase="TEST")
    # a non-trivial state: check_gradients fills the parameters from their fillers
    layer.params[0].filler = {"type": "uniform", "min": -1.0, "max": 1.0}
    layer.params[1].filler = {"type": "uniform", "min": 0.5, "max": 2.0}
    layer.params[2].filler = {"type": "constant", "value": 1.5}
    check_gradients(layer, [rng.standard_normal(shape)])


# ---- Scale -------------------------------------------------------------------------------

def scale_text(param="", extra=""):
    return f'name: "sc" type: "Scale" bottom: "x" top: "y" scale_param {{ {param} }} {extra}'


def test_scale_defaults_and_forward():
    shape = (2, 3, 4, 5)
    layer = make_layer(scale_text(), [shape])
    assert [p.name for p in layer.params] == ["scale"]
    assert layer.params[0].shape == (3,)
    assert layer.params[0].filler["type"] == "constant" and layer.params[0].filler["value"] == 1.0
    assert layer.keeps_bottoms == (0,) and layer.keeps_tops == ()
    # in place is the planner's call: it lets y overwrite x only where no later step reads x
    assert layer.inplace_safe(0, 0) and layer.stream_chunk() == 2
    run = LayerRun(layer)
    np.testing.assert_array_equal(run.params[0], np.ones(3))
    run.params[0][:] = [0.5, -2.0, 3.0]
    x = np.random.default_rng(6).standard_normal(shape)
    np.testing.assert_allclose(run.forward([x])[0], x * np.array([0.5, -2.0, 3.0])[None, :, None, None])


def test_scale_bias_forward_and_fillers():
    shape = (2, 3, 4)
    layer = make_layer(scale_text('axis: 1 num_axes: 2 bias_term: true '
                                  'filler { type: "constant" value: 2 } '
                                  'bias_filler { type: "constant" value: -1 }'), [shape])
    assert [p.shape for p in layer.params] == [(3, 4), (3, 4)]
    run = LayerRun(layer)
    np.testing.assert_array_equal(run.params[0], np.full((3, 4), 2.0))
    np.testing.assert_array_equal(run.params[1], np.full((3, 4), -1.0))
    rng = np.random.default_rng(7)
    run.params = [rng.standard_normal((3, 4)), rng.standard_normal((3, 4))]
    x = rng.standard_normal(shape)
    np.testing.assert_allclose(run.forward([x])[0], x * run.params[0] + run.params[1])


def test_scale_frozen_keeps_nothing():
    layer = make_layer(scale_text("bias_term: true", "param { lr_mult: 0 } param { lr_mult: 1 }"),
                       [(2, 3)])
    assert not layer.params[0].trained and layer.params[1].trained
    assert layer.keeps_bottoms == () and layer.workspace("backward") == {}
    assert layer.inplace_safe(0, 0)
    run = LayerRun(layer)
    rng = np.random.default_rng(8)
    run.params = [rng.standard_normal(3), rng.standard_normal(3)]
    x, gy = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    run.forward([x])
    gx, gp = run.backward([gy])
    assert gp[0] is None
    np.testing.assert_allclose(gx[0], gy * run.params[0])
    np.testing.assert_allclose(gp[1], gy.sum(axis=0))


SCALE_CASES = [
    ((2, 3, 3, 2), ""),
    ((2, 3, 3, 2), "bias_term: true"),
    ((2, 3, 3, 2), "axis: 1 num_axes: 2 bias_term: true"),
    ((2, 3, 3, 2), "axis: 2 num_axes: -1"),
    ((2, 3, 3, 2), "axis: -2 num_axes: 1 bias_term: true"),
    ((2, 3, 3, 2), "axis: 0 num_axes: 0 bias_term: true"),      # one scalar scale
    ((4, 5), "bias_term: true"),
    ((4, 5), "axis: 0 num_axes: 2"),
]


@pytest.mark.parametrize("shape,param", SCALE_CASES)
def test_scale_gradients(shape, param):
    rng = np.random.default_rng(9)
    filler = 'filler { type: "gaussian" std: 1 } bias_filler { type: "gaussian" std: 1 }'
    layer = make_layer(scale_text(f"{param} {filler}"), [shape])
    check_gradients(layer, [rng.standard_normal(shape)])


# ---- LRN ---------------------------------------------------------------------------------

def lrn_text(param=""):
    return f'name: "norm" type: "LRN" bottom: "x" top: "y" lrn_param {{ {param} }}'


def lrn_reference(x, size, alpha, beta, k):
    channels = x.shape[1]
    half = (size - 1) // 2
    scale = np.empty_like(x)
    for c in range(channels):
        lo, hi = max(0, c - half), min(channels, c + half + 1)
        scale[:, c] = k + alpha / size * np.sum(x[:, lo:hi] ** 2, axis=1)
    return x * scale ** -beta, scale


@pytest.mark.parametrize("param,size,alpha,beta,k", [
    ("", 5, 1.0, 0.75, 1.0),
    ("local_size: 3 alpha: 0.5 beta: 0.6 k: 2", 3, 0.5, 0.6, 2.0),
    ("local_size: 5 alpha: 0.0001 beta: 0.75", 5, 1e-4, 0.75, 1.0),
    ("local_size: 9 alpha: 2 beta: 1.3 k: 1.5", 9, 2.0, 1.3, 1.5),   # window wider than C
    ("local_size: 1", 1, 1.0, 0.75, 1.0),
])
def test_lrn_forward(param, size, alpha, beta, k):
    shape = (2, 7, 3, 4)
    x = np.random.default_rng(10).standard_normal(shape) * 2
    layer = make_layer(lrn_text(param), [shape])
    # backward keeps x alone (Caffe keeps x, y and scale) and recomputes scale
    assert layer.keeps_bottoms == (0,) and layer.keeps_tops == () and layer.saved == {}
    run = LayerRun(layer)
    y = run.forward([x])[0]
    ref_y, ref_scale = lrn_reference(x, size, alpha, beta, k)
    np.testing.assert_allclose(y, ref_y, rtol=1e-12)


@pytest.mark.parametrize("chunk_samples", [1, 2, 3])
def test_lrn_chunks_in_place(chunk_samples):
    """Chunk-sized workspaces; y written over x and gx over gy give the out-of-place bits."""
    shape = (5, 6, 3, 2)
    rng = np.random.default_rng(12)
    x, gy = rng.standard_normal(shape), rng.standard_normal(shape)
    text = lrn_text("local_size: 3 alpha: 0.7 beta: 0.4 k: 2")
    layer = make_layer(text, [shape])
    layer.chunk_bytes = chunk_samples * 6 * 3 * 2 * 8
    assert layer.stream_chunk() == chunk_samples
    assert layer.workspace("backward")["scale"].shape == (chunk_samples, 6, 6)
    whole = make_layer(text, [shape])
    assert whole.stream_chunk() == 5
    reference = LayerRun(whole)
    ref_y = assert_in_place_gives_the_bits_of(layer, reference, x, gy)
    np.testing.assert_allclose(ref_y, lrn_reference(x, 3, 0.7, 0.4, 2.0)[0], rtol=1e-12)


@pytest.mark.parametrize("shape,param", [
    ((2, 6, 2, 3), "local_size: 3"),
    ((2, 6, 2, 3), "local_size: 5"),
    ((2, 4, 3, 2), "local_size: 5 alpha: 0.7 beta: 0.4 k: 2"),
    ((2, 5, 2, 2), "local_size: 3 alpha: 1.5 beta: 1.2 k: 0.5"),
    ((2, 3, 2, 2), "local_size: 7 alpha: 0.3 beta: 0.9 k: 1.2"),
])
def test_lrn_gradients(shape, param):
    rng = np.random.default_rng(11)
    layer = make_layer(lrn_text(param), [shape])
    check_gradients(layer, [rng.standard_normal(shape)])


def caffe_lrn_within_channel(x, size, alpha, beta):
    """Caffe's WITHIN_CHANNEL chain in float64, loop for loop: square, AVE pooling (kernel
    size, stride 1, pad (size-1)/2, CEIL sizes, divisor the window clipped to the padded
    input), power (1 + alpha * pooled)^-beta, product with x."""
    n, c, h, w = x.shape
    pad = (size - 1) // 2
    square = x * x
    oh, ow = [int(np.ceil((d + 2 * pad - size) / 1.0)) + 1 for d in (h, w)]
    if pad:     # Caffe's drop of a last window starting in the padding (never at stride 1)
        oh, ow = [o - 1 if (o - 1) >= d + pad else o for o, d in ((oh, h), (ow, w))]
    pooled = np.zeros((n, c, oh, ow))
    for b in range(n):
        for ch in range(c):
            for i in range(oh):
                for j in range(ow):
                    hs, ws = i - pad, j - pad
                    he, we = min(hs + size, h + pad), min(ws + size, w + pad)
                    pool_size = (he - hs) * (we - ws)
                    hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, h), min(we, w)
                    pooled[b, ch, i, j] = square[b, ch, hs:he, ws:we].sum() / pool_size
    assert pooled.shape == x.shape
    return x * (1.0 + alpha * pooled) ** -beta


WITHIN_CASES = [
    ("norm_region: WITHIN_CHANNEL", (2, 3, 5, 6), 5, 1.0, 0.75),
    ("norm_region: WITHIN_CHANNEL local_size: 3 alpha: 5e-05 beta: 0.75", (2, 4, 8, 8), 3, 5e-5, 0.75),
    ("norm_region: WITHIN_CHANNEL local_size: 3 alpha: 2 beta: 0.6 k: 7", (1, 2, 4, 3), 3, 2.0, 0.6),  # k unused
    ("norm_region: WITHIN_CHANNEL local_size: 7 alpha: 1.5 beta: 1.2", (2, 2, 3, 5), 7, 1.5, 1.2),  # window > input
    ("norm_region: WITHIN_CHANNEL local_size: 1 alpha: 0.5", (1, 3, 2, 2), 1, 0.5, 0.75),
]


@pytest.mark.parametrize("param,shape,size,alpha,beta", WITHIN_CASES)
def test_lrn_within_channel_forward_matches_caffe(param, shape, size, alpha, beta):
    x = np.random.default_rng(13).standard_normal(shape) * 2
    layer = make_layer(lrn_text(param), [shape])
    assert layer.keeps_bottoms == (0,) and layer.keeps_tops == () and layer.saved == {}
    y = LayerRun(layer).forward([x])[0]
    np.testing.assert_allclose(y, caffe_lrn_within_channel(x, size, alpha, beta), rtol=1e-12)


@pytest.mark.parametrize("param,shape,size,alpha,beta", WITHIN_CASES)
def test_lrn_within_channel_gradients(param, shape, size, alpha, beta):
    layer = make_layer(lrn_text(param), [shape])
    check_gradients(layer, [np.random.default_rng(14).standard_normal(shape)])


@pytest.mark.parametrize("chunk_samples", [1, 2, 3])
def test_lrn_within_channel_chunks_in_place(chunk_samples):
    """Chunk-sized workspaces, y over x and gx over gy: the out-of-place bits, the same
    workspace bytes as ACROSS_CHANNELS (the plan needs nothing more)."""
    shape = (5, 3, 4, 5)
    rng = np.random.default_rng(15)
    x, gy = rng.standard_normal(shape), rng.standard_normal(shape)
    text = lrn_text("norm_region: WITHIN_CHANNEL local_size: 3 alpha: 0.7 beta: 0.4")
    layer = make_layer(text, [shape])
    layer.chunk_bytes = chunk_samples * 3 * 4 * 5 * 8
    assert layer.stream_chunk() == chunk_samples
    across = make_layer(lrn_text("local_size: 3"), [shape])
    across.chunk_bytes = layer.chunk_bytes
    for phase in ("forward", "backward"):
        assert layer.workspace(phase) == across.workspace(phase)
    reference = LayerRun(make_layer(text, [shape]))
    ref_y = assert_in_place_gives_the_bits_of(layer, reference, x, gy)


def test_lrn_within_channel_float32_agrees_with_float64():
    shape = (2, 3, 6, 6)
    rng = np.random.default_rng(16)
    x, gy = rng.standard_normal(shape), rng.standard_normal(shape)
    text = lrn_text("norm_region: WITHIN_CHANNEL local_size: 3 alpha: 0.5 beta: 0.75")
    results = []
    for dtype in (np.float64, np.float32):
        run = LayerRun(make_layer(text, [shape], dtype=dtype))
        y = run.forward([x.astype(dtype)])[0]
        results.append((y, run.backward([gy.astype(dtype)])[0][0]))
    for a64, a32 in zip(*results):
        np.testing.assert_allclose(a32, a64, rtol=1e-5, atol=1e-6)


# ---- parameter errors --------------------------------------------------------------------

@pytest.mark.parametrize("text,shapes", [
    (lrn_text("local_size: 4"), [(2, 6, 3, 3)]),
    (lrn_text("local_size: 0"), [(2, 6, 3, 3)]),
    (lrn_text("norm_region: WITHIN_CHANNEL"), [(2, 6, 9)]),      # needs (N, C, H, W)
    (lrn_text(), [(6,)]),
    ('name: "sc" type: "Scale" bottom: "x" bottom: "s" top: "y"', [(2, 3, 4, 4), (3,)]),
    (scale_text("axis: 4"), [(2, 3, 4, 4)]),
    (scale_text("axis: -5"), [(2, 3, 4, 4)]),
    (scale_text("axis: 2 num_axes: 3"), [(2, 3, 4, 4)]),
    (scale_text("num_axes: -2"), [(2, 3, 4, 4)]),
    (bn_text("batch_norm_param { eps: -1 }"), [(2, 3)]),
    (bn_text("batch_norm_param { moving_average_fraction: 1.5 }"), [(2, 3)]),
    (bn_text("param { lr_mult: 1 }"), [(2, 3)]),
])
def test_parameter_errors(text, shapes):
    with pytest.raises(LayerSetupError):
        make_layer(text, shapes)


def test_batchnorm_accepts_zero_lr_mult_params():
    layer = make_layer(bn_text("param { lr_mult: 0 } param { lr_mult: 0 } param { lr_mult: 0 }"),
                       [(2, 3)])
    assert all(p.lr_mult == 0 for p in layer.params)


@pytest.mark.parametrize("chunk_samples", [1, 2, 5])
@pytest.mark.parametrize("kind", ["bn", "scale"])
def test_bn_and_scale_chunks_in_place(kind, chunk_samples):
    """Chunk-sized workspaces; y over x and gx over gy give the whole-batch results."""
    shape = (5, 3, 2, 4)
    rng = np.random.default_rng(17)
    x, gy = rng.standard_normal(shape), rng.standard_normal(shape)
    text = bn_text() if kind == "bn" else scale_text("bias_term: true")
    reference = LayerRun(make_layer(text, [shape]))
    ref_y = reference.forward([x])[0]
    (ref_gx,), ref_gp = reference.backward([gy])
    layer = make_layer(text, [shape])
    layer.chunk_bytes = chunk_samples * 3 * 2 * 4 * 8
    assert layer.stream_chunk() == chunk_samples and layer.inplace_safe(0, 0)
    ws = {phase: {k: np.empty(d.shape, d.dtype or np.float64) for k, d in layer.workspace(phase).items()}
          for phase in ("forward", "backward")}
    params = [p.copy() for p in reference.params]
    params_before = [p.copy() for p in LayerRun(make_layer(text, [shape])).params]
    if kind == "bn":
        params = params_before
    saved = {k: np.empty(d.shape, d.dtype or np.float64) for k, d in layer.saved.items()}
    inplace = x.copy()
    layer.forward(np, [inplace], [inplace], params, saved, ws["forward"])
    np.testing.assert_allclose(inplace, ref_y, rtol=1e-12, atol=1e-12)
    if kind == "bn":
        for got, want in zip(params, reference.params):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    grad = gy.copy()
    gp = [np.empty_like(p) if d.trained else None for p, d in zip(params, layer.params)]
    keep_x = [x] if layer.keeps_bottoms else [None]
    keep_y = [ref_y] if layer.keeps_tops else [None]
    layer.backward(np, keep_x, keep_y, [grad], [grad], params, gp, saved, ws["backward"])
    np.testing.assert_allclose(grad, ref_gx, rtol=1e-12, atol=1e-12)
    for got, want in zip(gp, ref_gp):
        if want is not None:
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
