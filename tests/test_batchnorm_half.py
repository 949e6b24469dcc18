"""BatchNorm handing over each final slice of its output (Layer.emits_top_slices), which Gist
encodes as its fp16 stash while it is in cache: the codes are DPR("fp16")'s bytes on the
kernel path (F16C) and the ufunc path, and a net without numba trains with them. These run without numba too (its kernel cases skip)."""
import os
import subprocess
import sys

import numpy as np
import pytest

from minigist import jit
from minigist.testing import make_layer

from test_fused_kernels import LAYERS, SHAPE, same_bytes, values

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def dpr_fp16_codes(y):
    """DPR("fp16")'s codes of the float32 array y, on the codec's integer ufunc path."""
    from minigist.codecs.dpr import DPR
    from minigist.codecs import kernels
    codec = DPR("fp16")
    enc = {k: np.empty(d.shape, d.dtype) for k, d in codec.encoded(y.shape).items()}
    ws = {k: np.empty(d.shape, d.dtype) for k, d in codec.workspace(y.shape, "encode").items()}
    with kernels.use_codec_kernels(False):
        codec.encode(np, y, enc, ws)
    return enc["codes"].reshape(y.shape)


def every_kind_of_float32(rng):
    """Random bit patterns (NaNs with payloads, subnormals, huge values) and fp16's edges:
    overflow, ties to even, its subnormals and the smallest values that round to zero."""
    bits = rng.integers(0, 1 << 32, size=4000, dtype=np.uint64).astype(np.uint32)
    edges = np.array([65504, 65519.99, 65520, 1e30, 2.0 ** -24, 2.0 ** -25, 2.0 ** -25 * 1.0001, 2.0 ** -26,
                      1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 6.1e-5, 0.0, np.inf], np.float32)
    edges = np.concatenate([edges, -edges]).view(np.uint32)
    quiet, signalling = np.uint32(0x7FC00001), np.uint32(0x7F800123)
    nans = np.array([quiet, signalling, quiet | 0x80000000, signalling | 0x80000000], np.uint32)
    return np.concatenate([bits, edges, nans]).view(np.float32)


def encode_slices(y, codes, scratch_fill=np.nan):
    """y's fp16 codes written by HalfStash.encode_slice, two samples at a time, with a
    scratch that starts out holding NaNs (as a reused workspace may)."""
    from minigist.codecs.dpr import HalfStash
    codec, enc = HalfStash(), {"codes": codes.view(np.float16)}
    for n0 in range(0, y.shape[0], 2):
        part = y[n0:n0 + 2]
        codec.encode_slice(np, part, enc, n0, n0 + part.shape[0], np.full(part.shape, scratch_fill, np.float32))


@pytest.mark.parametrize("path", ["kernel", "ufuncs"])
def test_fp16_codes_of_a_slice_are_dprs_for_every_kind_of_value(path):
    """What a layer's emitted slices are encoded to (HalfStash.encode_slice): DPR("fp16")'s
    bytes, on the compiled path and on the ufuncs."""
    from minigist.codecs import kernels
    if path == "kernel" and not kernels.HALF:
        pytest.skip("no numba, or a CPU without F16C: the ufunc path writes the codes")
    y = every_kind_of_float32(np.random.default_rng(35)).reshape(5, 1, -1)
    codes = np.zeros(y.shape, np.uint16)
    with kernels.use_codec_kernels(path == "kernel"):
        encode_slices(y, codes)
    assert codes.tobytes() == dpr_fp16_codes(y).tobytes()


@pytest.mark.parametrize("path", ["kernel", "ufuncs"])
def test_scaled_fp16_codes_of_a_slice_are_the_products_dpr_codes(path):
    """The last step a layer hands over (HalfStash.scale_encode_slice): x *= scale[c] as
    numpy's multiply gives it, and DPR("fp16")'s codes of the products, on both paths."""
    from minigist.codecs import kernels
    from minigist.codecs.dpr import HalfStash
    if path == "kernel" and not kernels.HALF:
        pytest.skip("no numba, or a CPU without F16C")
    rng = np.random.default_rng(38)
    x = every_kind_of_float32(rng)[-4000:].reshape(4, 2, -1)     # the edges and NaNs come last
    scale = np.array([0.75, 3.0], np.float32)
    with np.errstate(all="ignore"):
        expected = x * scale[:, None]
    codes = np.zeros(x.shape, np.float16)
    got = x.copy()
    with kernels.use_codec_kernels(path == "kernel"), np.errstate(all="ignore"):
        for n0 in (0, 2):
            HalfStash().scale_encode_slice(np, got[n0:n0 + 2], scale, {"codes": codes}, n0, n0 + 2,
                                           np.full((2, 2, x.shape[2]), np.nan, np.float32))
    same_bytes(got, expected)
    assert codes.view(np.uint16).tobytes() == dpr_fp16_codes(expected).tobytes()


@pytest.mark.parametrize("special", [False, True], ids=["normal", "special"])
@pytest.mark.parametrize("chunk_bytes", [None, 2 * 3 * 4 * 6 * 4])
@pytest.mark.parametrize("inplace", [False, True], ids=["apart", "in place"])
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "ufuncs"])
def test_batchnorm_forward_hands_over_its_last_scaling(kernels, inplace, chunk_bytes, special):
    """forward(..., emit=f): f gets each slice of y in order, covering the batch, with the
    per-channel scale to apply; scaled and encoded by the codec, y is the same bytes as
    without, and the codes are DPR("fp16")'s of that y."""
    from minigist.codecs.dpr import HalfStash
    if kernels and not jit.available():
        pytest.skip("numba is not installed")
    layer = make_layer(LAYERS["batchnorm"], [SHAPE], dtype=np.float32)
    assert layer.emits_top_slices()
    if chunk_bytes:
        layer.chunk_bytes = chunk_bytes
    rng = np.random.default_rng(36)
    x = values(rng, SHAPE, np.float32, special) * np.float32(3)
    results = []
    for emitting in (False, True):
        ws = {k: np.full(d.shape, np.nan, d.dtype or layer.dtype) for k, d in layer.workspace("forward").items()}
        saved = {k: np.empty(d.shape, d.dtype or layer.dtype) for k, d in layer.saved.items()}
        x_in = x.copy()
        y = x_in if inplace else np.empty(SHAPE, np.float32)
        codes, seen = np.zeros(SHAPE, np.float16), []

        def emit(n0, n1, scale, scratch):
            seen.append((n0, n1))
            HalfStash().scale_encode_slice(np, y[n0:n1], scale, {"codes": codes}, n0, n1, scratch)
        with jit.use_kernels(kernels), np.errstate(all="ignore"):
            layer.forward(np, [x_in], [y], [np.zeros(d.shape, np.float32) for d in layer.params], saved, ws,
                          **({"emit": emit} if emitting else {}))
        results.append((y, codes, seen))
    (reference, _, _), (y, codes, seen) = results
    same_bytes(y, reference)
    step = seen[0][1]
    assert seen == [(n0, min(n0 + step, SHAPE[0])) for n0 in range(0, SHAPE[0], step)]
    assert codes.view(np.uint16).tobytes() == dpr_fp16_codes(y).tobytes()


def test_layers_that_emit_no_slices_say_so():
    assert not make_layer(LAYERS["relu"], [SHAPE], dtype=np.float32).emits_top_slices()
    assert not make_layer(LAYERS["scale"], [SHAPE], dtype=np.float32).emits_top_slices()
    assert not make_layer('name: "bn" type: "BatchNorm" bottom: "x" top: "y" '
                          'batch_norm_param { use_global_stats: true }', [SHAPE], dtype=np.float32).emits_top_slices()
    assert not make_layer(LAYERS["batchnorm"], [SHAPE], dtype=np.float64).emits_top_slices()   # float32 stashes


def test_batchnorm_with_global_stats_refuses_to_emit():
    layer = make_layer('name: "bn" type: "BatchNorm" bottom: "x" top: "y" '
                       'batch_norm_param { use_global_stats: true }', [SHAPE])
    x = np.ones(SHAPE, np.float32)
    params = [np.ones(d.shape, np.float32) for d in layer.params]
    with pytest.raises(ValueError, match="use_global_stats"):
        layer.forward(np, [x], [x.copy()], params, {}, {}, emit=lambda n0, n1, scale, scratch: None)


NO_NUMBA_RUN = """
import sys
if sys.argv[1] == "without":
    sys.modules["numba"] = None          # import numba fails: as on an install without [fast]
import numpy as np, minigist
from minigist import jit
assert jit.available() == (sys.argv[1] == "with")
rng = np.random.default_rng(0)
net = minigist.Net(sys.argv[2], batch_size=2, seed=1, gist="lossy")
assert any(s.kind == "forward" and type(s.op).__name__ == "WriteCodes" for s in net.programs["train"].steps)
print([net.train_step(rng.standard_normal((2, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, 2))
       for _ in range(2)])
"""


@pytest.mark.slow
def test_a_net_without_numba_trains_like_one_with_it():
    """ResNet-20 under lossy (BatchNorm writing its fp16 stash) with numba's import blocked:
    the same losses, bit for bit, as with the kernels (or as itself, where numba is absent)."""
    model = os.path.join(ROOT, "models", "resnet20.prototxt")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    outputs = []
    for mode in ("without", "with" if jit.available() else "without"):
        run = subprocess.run([sys.executable, "-c", NO_NUMBA_RUN, mode, model], capture_output=True,
                             text=True, env=env, cwd=ROOT)
        assert run.returncode == 0, run.stderr
        outputs.append(run.stdout)
    assert outputs[0] == outputs[1] and outputs[0].startswith("[")
