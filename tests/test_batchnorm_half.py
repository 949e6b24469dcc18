"""BatchNorm writing Gist's fp16 stash of its output as it computes it (Layer.writes_half):
the codes are DPR("fp16")'s bytes on the kernel path (F16C) and the ufunc path, and a net
without numba trains with them. These run without numba too (its kernel cases skip)."""
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


@pytest.mark.parametrize("path", ["kernel", "ufuncs"])
def test_batchnorm_fp16_codes_are_dprs_for_every_kind_of_value(path):
    """What BatchNorm writes as Gist's fp16 stash (writes_half): DPR("fp16")'s bytes."""
    from minigist.layers import fused_kernels
    from minigist.layers.normalization import BatchNorm
    if path == "kernel" and not jit.HALF:
        pytest.skip("no numba, or a CPU without F16C: the ufunc path writes the codes")
    y = every_kind_of_float32(np.random.default_rng(35)).reshape(2, 1, -1)
    codes = np.zeros(y.shape, np.uint16)
    if path == "kernel":
        written = y.copy()
        fused_kernels.scale_channels_half(written, np.ones(1, np.float32), codes)
        # y * 1 is y, but a signalling NaN comes out quiet, as numpy's multiply makes it
        with np.errstate(invalid="ignore"):
            same_bytes(written, y * np.float32(1))
        expected = dpr_fp16_codes(written)
    else:
        BatchNorm._half_codes(np, y, codes, np.full(y.shape, np.nan, np.float32))
        expected = dpr_fp16_codes(y)
    assert codes.tobytes() == expected.tobytes()


@pytest.mark.parametrize("special", [False, True], ids=["normal", "special"])
@pytest.mark.parametrize("chunk_bytes", [None, 2 * 3 * 4 * 6 * 4])
@pytest.mark.parametrize("inplace", [False, True], ids=["apart", "in place"])
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "ufuncs"])
def test_batchnorm_forward_writes_its_fp16_stash(kernels, inplace, chunk_bytes, special):
    """forward(..., half=codes): y the same bytes as without, codes DPR("fp16")'s of that y
    (compared with the y of the same path: a NaN's sign may differ between the kernels and
    the ufuncs, as in tests/test_fused_kernels.py)."""
    if kernels and not jit.available():
        pytest.skip("numba is not installed")
    layer = make_layer(LAYERS["batchnorm"], [SHAPE], dtype=np.float32)
    assert layer.writes_half()
    if chunk_bytes:
        layer.chunk_bytes = chunk_bytes
    rng = np.random.default_rng(36)
    x = values(rng, SHAPE, np.float32, special) * np.float32(3)
    results = []
    for half in (None, np.zeros(SHAPE, np.float16)):
        ws = {k: np.full(d.shape, np.nan, d.dtype or layer.dtype) for k, d in layer.workspace("forward").items()}
        saved = {k: np.empty(d.shape, d.dtype or layer.dtype) for k, d in layer.saved.items()}
        x_in = x.copy()
        y = x_in if inplace else np.empty(SHAPE, np.float32)
        with jit.use_kernels(kernels), np.errstate(all="ignore"):
            layer.forward(np, [x_in], [y], [np.zeros(d.shape, np.float32) for d in layer.params], saved, ws, half=half)
        results.append((y, half))
    (reference, _), (y, codes) = results
    same_bytes(y, reference)
    assert codes.view(np.uint16).tobytes() == dpr_fp16_codes(y).tobytes()


def test_layers_that_cannot_write_a_float16_stash_say_so():
    assert not make_layer(LAYERS["relu"], [SHAPE], dtype=np.float32).writes_half()
    assert not make_layer(LAYERS["scale"], [SHAPE], dtype=np.float32).writes_half()
    assert not make_layer('name: "bn" type: "BatchNorm" bottom: "x" top: "y" '
                          'batch_norm_param { use_global_stats: true }', [SHAPE], dtype=np.float32).writes_half()
    assert not make_layer(LAYERS["batchnorm"], [SHAPE], dtype=np.float64).writes_half()   # DPR: float32


def test_batchnorm_with_global_stats_refuses_to_write_one():
    layer = make_layer('name: "bn" type: "BatchNorm" bottom: "x" top: "y" '
                       'batch_norm_param { use_global_stats: true }', [SHAPE])
    x = np.ones(SHAPE, np.float32)
    params = [np.ones(d.shape, np.float32) for d in layer.params]
    with pytest.raises(ValueError, match="use_global_stats"):
        layer.forward(np, [x], [x.copy()], params, {}, {}, half=np.zeros(SHAPE, np.float16))


NO_NUMBA_RUN = """
import sys
if sys.argv[1] == "without":
    sys.modules["numba"] = None          # import numba fails: as on an install without [fast]
import numpy as np, minigist
from minigist import jit
assert jit.available() == (sys.argv[1] == "with")
rng = np.random.default_rng(0)
net = minigist.Net(sys.argv[2], batch_size=2, seed=1, gist="lossy")
assert any(s.kind == "forward" and s.codec is not None for s in net.programs["train"].steps)
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
