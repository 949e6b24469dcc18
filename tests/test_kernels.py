"""The compiled codec kernels (minigist.codecs.kernels) against the ufunc path, byte for byte.

The ufunc path is itself checked against numpy's float16 cast, ml_dtypes and a float64 model
(tests/test_codecs.py, which also runs its whole suite on both paths). Here the two paths encode
the same tensors and must write the same bytes: every code, and for SSDC the header and every
used byte of the chosen format. Every test runs with the plain kernels (integer fp16, scalar
SSDC) and, on a CPU that has the instructions, with the fast ones (fp16 through F16C,
kernels.HALF; SSDC through AVX-512 compress/expand, kernels.VECTOR), and with the forms a CPU
without AVX-512 takes (F16C, SSDC's bitmap through SSSE3's byte shuffle), each on one thread and
split into parts on three (kernels.threads).
"""
import os
import platform
import re
import subprocess
import sys

import numpy as np
import pytest

from minigist.codecs import kernels
from minigist.codecs.dpr import DPR, FORMATS, code_units
from minigist.codecs.ssdc import SSDC
from minigist.testing import codes_dpr_writes

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba is not installed")

RNG = np.random.default_rng(77)


# the variant this CPU runs by default (kernels.VECTOR, else SHUFFLE, else HALF): the quick
# subset (-m "not slow") runs that one, the full suite all three
DEFAULT_VARIANT = ("fast" if kernels.VECTOR else "shuffle" if kernels.SHUFFLE else
                   "fast" if kernels.HALF else "plain")


@pytest.fixture(params=[v if v == DEFAULT_VARIANT else pytest.param(v, marks=pytest.mark.slow)
                        for v in ("plain", "fast", "shuffle")])
def kernel_variant(request):
    """plain: integer fp16, scalar SSDC; fast: F16C and AVX-512 compress/expand where the CPU
    has them; shuffle: F16C with SSDC's bitmap through SSSE3's byte shuffle, the forms a CPU
    without AVX-512 runs (tested on every x86-64 CPU, AVX-512 or not)."""
    if request.param == "fast" and not (kernels.VECTOR or kernels.HALF):
        pytest.skip("this CPU has neither F16C nor AVX-512 VBMI2: only the plain kernels are used")
    if request.param == "shuffle" and not kernels.SHUFFLE:
        pytest.skip("this CPU has no SSSE3: the byte-shuffle kernels are not used")
    fast, shuffle = request.param == "fast", request.param == "shuffle"
    previous = kernels.set_vector(fast), kernels.set_half(fast or shuffle), kernels.set_shuffle(shuffle)
    yield request.param
    kernels.set_vector(previous[0])
    kernels.set_half(previous[1])
    kernels.set_shuffle(previous[2])


@pytest.fixture(params=[1, 3], ids=["1 thread", "3 threads"])
def kernel_threads(request, monkeypatch):
    """The DPR and SSDC bitmap kernels on one thread, and split into parts of whole 256-element
    blocks on three (parts of at least 256 elements here, so that small tensors split too):
    the same bytes either way."""
    monkeypatch.setattr(kernels, "PARALLEL_MIN", 256)
    with kernels.threads(request.param):
        yield request.param


# the variant matrix, for the tests whose kernels read the variant and thread settings
VARIANTS = pytest.mark.usefixtures("kernel_threads", "kernel_variant")


def awkward_floats(n, rng=RNG):
    """Normal values over many binades, the targets' subnormal ranges, float32 subnormals,
    overflow, +-0, +-Inf, NaNs with payloads, and random bit patterns."""
    parts = [rng.standard_normal(n // 4).astype(np.float32) * np.float32(10.0) ** rng.integers(-9, 6, n // 4).astype(np.float32),
             (rng.standard_normal(n // 8) * 1e-6).astype(np.float32),
             (rng.standard_normal(n // 16) * 1e-40).astype(np.float32),
             (rng.standard_normal(n // 16) * 1e5).astype(np.float32),
             rng.integers(0, 2 ** 32, n // 4, dtype=np.uint64).astype(np.uint32).view(np.float32),
             np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 65504, 65520, 448, 464, 57344,
                       61440, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -9, 2.0 ** -10], np.float32)]
    x = np.concatenate(parts)
    x = np.concatenate([x, rng.standard_normal(max(0, n - x.size)).astype(np.float32)])
    return rng.permutation(x)[:n]


def ufunc_then_kernel(fn):
    with kernels.use_kernels(False):
        a = fn()
    with kernels.use_kernels(True):
        b = fn()
    return a, b


@VARIANTS
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 1000, 98305, 200003])
def test_dpr_encode_same_codes(fmt, n):
    dpr = DPR(fmt)
    x = awkward_floats(n)

    def encode():
        codes = np.full(code_units(fmt, n) + 3, 0x5A5A5A5A, np.uint32).astype(dpr.code_dtype)
        ws = {k: np.empty(d.shape, d.dtype) for k, d in dpr.flat_workspace(n, "encode").items()}
        dpr.encode_flat(np, x, codes, ws)
        return codes

    ufunc, kernel = ufunc_then_kernel(encode)
    assert ufunc.tobytes() == kernel.tobytes()


@VARIANTS
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dpr_decode_every_code(fmt):
    """Every code the encoder can write (minigist.testing.codes_dpr_writes)."""
    dpr = DPR(fmt)
    if dpr.per == 1:
        codes = codes_dpr_writes(fmt, np.arange(1 << (8 * dpr.code_dtype.itemsize)).astype(dpr.code_dtype))
        n = codes.size
    else:                                     # fp10: every 10-bit code in each of the 3 slots
        c = np.arange(1024, dtype=np.uint32)
        codes = np.concatenate([c, c << 10, c << 20, RNG.integers(0, 1 << 30, 5000).astype(np.uint32)])
        n = 3 * codes.size - 2                # a partial last word as well

    def decode():
        out = np.full(n, 7.0, np.float32)
        ws = {k: np.empty(d.shape, d.dtype) for k, d in dpr.flat_workspace(n, "decode").items()}
        dpr.decode_flat(np, codes, out, ws)
        return out

    ufunc, kernel = ufunc_then_kernel(decode)
    assert ufunc.tobytes() == kernel.tobytes()


def ssdc_input(n, density, rng=RNG):
    x = np.abs(awkward_floats(n, rng))
    x[x == 0] = 1.0
    x[rng.random(n) >= density] = 0.0
    if n > 8 and density > 0:
        x[[0, 3]] = [-0.0, np.nan]            # non-zero bit patterns, kept bit for bit
    return x


def used_bytes(codec, enc, n):
    """The header and the bytes the held format uses: the values, then csr's row pointers and
    columns or the bitmap."""
    fmt, nnz = SSDC.header(enc)
    views = codec._views(np, enc["data"], n)
    values = views["values"].view(np.uint8)[:SSDC.nbytes_for(n, nnz, codec.value_format)["bitmap"] - -(-n // 8)]
    if fmt == "csr":
        rows = -(-n // 256)
        tail = views["rowptr"][:rows + 1].tobytes() + views["cols"][:nnz].tobytes()
    else:
        tail = views["bitmap"][:-(-n // 8)].tobytes()
    return enc["data"][:2].tobytes() + values.tobytes() + tail


@VARIANTS
@pytest.mark.parametrize("values", ["fp32", "fp16", "fp8-e4m3", "fp8-e5m2"])
@pytest.mark.parametrize("fmt", ["csr", "bitmap"])
@pytest.mark.parametrize("n,density", [(1, 1.0), (7, 0.5), (256, 0.0), (257, 1.0), (1000, 0.05),
                                       (65536 + 300, 0.5), (70001, 0.97), (4099, 0.004)])
@pytest.mark.slow
def test_ssdc_same_bytes_and_roundtrip(values, fmt, n, density):
    x = ssdc_input(n, density)
    nnz = int(np.count_nonzero(x.view(np.uint32)))
    for capacity in (nnz, n):                 # exactly full, and room to spare
        codec = SSDC(capacity, values, formats=(fmt,))
        shape = (n,)

        def encode_decode():
            enc = {k: np.full(d.shape, 0xA5A5A5A5, d.dtype) for k, d in codec.encoded(shape).items()}
            ws = {k: np.empty(d.shape, d.dtype) for k, d in codec.workspace(shape, "encode").items()}
            assert codec.encode(np, x, enc, ws) is True
            out = np.full(n, 3.0, np.float32)
            ws = {k: np.empty(d.shape, d.dtype) for k, d in codec.workspace(shape, "decode").items()}
            codec.decode(np, enc, out, ws)
            return used_bytes(codec, enc, n), out

        (ufunc_bytes, ufunc_out), (kernel_bytes, kernel_out) = ufunc_then_kernel(encode_decode)
        assert ufunc_bytes == kernel_bytes
        assert ufunc_out.tobytes() == kernel_out.tobytes()


def test_kernels_serve_only_numpy_and_contiguous_arrays():
    a = np.zeros(10, np.float32)
    with kernels.use_kernels(True):
        assert kernels.active(np, a, a[2:5])
        assert not kernels.active(np, a[::2])
        assert not kernels.active(object(), a)
    with kernels.use_kernels(False):
        assert not kernels.active(np, a)


@VARIANTS
def test_the_codecs_switch_leaves_the_other_kernels_on():
    from minigist import jit
    a = np.zeros(10, np.float32)
    with kernels.use_kernels(True), kernels.use_codec_kernels(False):
        assert not kernels.active(np, a)
        assert jit.active(np, a)
        assert kernels.describe().startswith("ufunc path")
    with kernels.use_kernels(True):
        assert kernels.active(np, a)


@VARIANTS
def test_the_kernels_run_when_on(monkeypatch):
    """The codecs take the kernel path when it is on (and the ufunc path when it is off)."""
    calls = []
    real = kernels.dpr_encode
    monkeypatch.setattr(kernels, "dpr_encode", lambda *args: calls.append(1) or real(*args))
    dpr = DPR("fp16")
    x = np.ones(100, np.float32)
    codes = np.empty(100, np.uint16)
    ws = {k: np.empty(d.shape, d.dtype) for k, d in dpr.flat_workspace(100, "encode").items()}
    with kernels.use_kernels(True):
        dpr.encode_flat(np, x, codes, ws)
    with kernels.use_kernels(False):
        dpr.encode_flat(np, x, codes, ws)
    assert calls == [1]


@VARIANTS
def test_describe_names_the_path():
    with kernels.use_kernels(True):
        assert kernels.describe(np).startswith(f"numba {kernels.numba.__version__} kernels")
        assert kernels.describe(object()) == "ufunc path (not on a GPU)"
    with kernels.use_kernels(False):
        assert kernels.describe(np) == "ufunc path (switched off)"


def _train_two_steps(model, gist, on):
    import minigist
    path = os.path.join(os.path.dirname(__file__), "..", "models", model + ".prototxt")
    rng = np.random.default_rng(5)
    batches = [(rng.standard_normal((4, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, 4)) for _ in range(2)]
    with kernels.use_kernels(on):
        net = minigist.Net(path, batch_size=4, seed=0, gist=gist, dpr="fp16")
        if gist != "none":
            net.calibrate(batches)
        losses = [net.train_step(*batch) for batch in batches]
        return losses, {k: v.copy() for k, v in net.params().items()}


# the ufunc path's run of each (model, gist): with the kernels off no variant or thread
# setting is read, so every variant and thread count is compared with the same reference
_WITHOUT_KERNELS = {}


def train_with_and_without_kernels(model, gist):
    """Two SGD steps without Gist or under Gist `all` (DPR and SSDC stashes; mask and
    ReLU->pool codes): the same losses and weights, bit for bit, with every kernel (codecs,
    pooling, BatchNorm/Scale/ReLU, the convolution's layout copies) on and off."""
    if (model, gist) not in _WITHOUT_KERNELS:
        _WITHOUT_KERNELS[model, gist] = _train_two_steps(model, gist, on=False)
    losses_off, weights_off = _WITHOUT_KERNELS[model, gist]
    losses_on, weights_on = _train_two_steps(model, gist, on=True)
    assert losses_on == losses_off
    assert all(weights_on[k].tobytes() == weights_off[k].tobytes() for k in weights_off)


@pytest.mark.slow
@VARIANTS
@pytest.mark.parametrize("model", ["resnet20", "vgg_small", "inception_small"])
def test_training_is_the_same_with_and_without_kernels(model):
    """Under Gist `all` the codecs' kernels run, so every variant and thread count."""
    train_with_and_without_kernels(model, "all")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["resnet20", "vgg_small", "inception_small"])
def test_training_without_gist_is_the_same_with_and_without_kernels(model):
    """Without Gist no codec runs: pooling's, BatchNorm/Scale/ReLU's and the layout copies'
    kernels read none of the codec variant or thread settings, so one run each."""
    train_with_and_without_kernels(model, "none")


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 65536 * 2 + 13])
def test_bit_packing_same_bytes(n):
    """mask-1bit (float and bool inputs) and index-{1,2,4}bit: the kernels pack the bytes the
    ufunc path packs, and unpack them back the same."""
    from minigist.codecs.bits import BitMask, PackedCodes
    x = RNG.standard_normal(n).astype(np.float32)
    x[:min(n, 4)] = [np.nan, -0.0, 0.0, np.inf][:min(n, 4)]
    cases = [(BitMask(), x, np.bool_), (BitMask(), x > 0.5, np.bool_)]
    cases += [(PackedCodes(bits), RNG.integers(0, 1 << bits, n).astype(np.uint8), np.uint8) for bits in (1, 2, 4)]
    for codec, value, out_dtype in cases:
        def roundtrip():
            enc = {k: np.full(d.shape, 0x5A, d.dtype) for k, d in codec.encoded(value.shape).items()}
            ws = {k: np.empty(d.shape, d.dtype) for k, d in codec.workspace(value.shape, "encode").items()}
            codec.encode(np, value, enc, ws)
            out = np.zeros(value.shape, out_dtype)
            ws = {k: np.empty(d.shape, d.dtype) for k, d in codec.workspace(value.shape, "decode").items()}
            codec.decode(np, enc, out, ws)
            return b"".join(a.tobytes() for a in enc.values()), out.tobytes()
        ufunc, kernel = ufunc_then_kernel(roundtrip)
        assert ufunc == kernel


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 5, 7), (4, 8, 16, 16)])
def test_relu_pool_codes_same_bytes(shape):
    """relu-pool-4bit: the kernel selects the codes (argmax where the pool output is > 0,
    else the reserved code; NaN, +-0 and negatives get the reserved one) that the ufunc path
    selects, so the packed bytes and what decodes from them are the same."""
    from minigist.codecs.bits import PackedCodes
    from minigist.codecs.fused import FusedReluPool
    codec = FusedReluPool(PackedCodes(4), 9)
    n = int(np.prod(shape))
    pool_out = awkward_floats(max(n, 32))[:n].reshape(shape)
    argmax = RNG.integers(0, 9, shape).astype(np.uint8)

    def roundtrip():
        enc = {k: np.full(d.shape, 0x5A, d.dtype) for k, d in codec.encoded(shape).items()}
        ws = {k: np.full(d.shape, 7, d.dtype) for k, d in codec.workspace(shape, "encode").items()}
        codec.encode(np, (argmax, pool_out), enc, ws)
        out = np.zeros(shape, np.uint8)
        ws = {k: np.empty(d.shape, d.dtype) for k, d in codec.workspace(shape, "decode").items()}
        codec.decode(np, enc, out, ws)
        return enc["codes"].tobytes(), out
    (ufunc, ufunc_out), (kernel, kernel_out) = ufunc_then_kernel(roundtrip)
    assert ufunc == kernel
    np.testing.assert_array_equal(kernel_out, np.where(pool_out > 0, argmax, 9))


@VARIANTS
@pytest.mark.parametrize("fmt", ["bitmap", "csr"])
def test_ssdc_kernels_refuse_a_corrupt_encoding(fmt):
    """A bitmap or row pointers that disagree with the header are refused (ValueError) before
    any value is read: the kernels read one value per set bit / per row-pointer step."""
    n = 4096
    x = ssdc_input(n, 0.05)
    codec = SSDC(n, "fp16", formats=(fmt,))
    enc = {k: np.zeros(d.shape, d.dtype) for k, d in codec.encoded((n,)).items()}
    assert codec.encode(np, x, enc, {}) is True
    views = codec._views(np, enc["data"], n)
    if fmt == "bitmap":
        views["bitmap"][:n // 8] = 0xFF
    else:
        views["rowptr"][3] = views["rowptr"][4] + 1
    with pytest.raises(ValueError):
        codec.decode(np, enc, np.empty(n, np.float32), {})


@pytest.mark.slow
def test_kernels_compile_for_a_generic_cpu(tmp_path):
    """With numba compiling for a CPU without F16C or AVX-512 (NUMBA_CPU_NAME=generic), the
    kernels take their plain forms and give the ufunc path's bytes (the half conversions must
    not even be compiled there: LLVM would abort the process)."""
    import subprocess
    import sys
    script = (
        "import numpy as np\n"
        "from minigist.codecs import kernels\n"
        "from minigist.codecs.dpr import DPR\n"
        "from minigist.codecs.ssdc import SSDC\n"
        "assert not kernels.HALF and not kernels.VECTOR\n"
        "x = np.maximum(np.random.default_rng(0).standard_normal(5000).astype(np.float32), 0)\n"
        "for codec in (DPR('fp16'), DPR('fp8-e4m3'), SSDC(5000, 'fp32'), SSDC(5000, 'fp16')):\n"
        "    got = []\n"
        "    for on in (False, True):\n"
        "        with kernels.use_kernels(on):\n"
        "            enc = {k: np.zeros(d.shape, d.dtype) for k, d in codec.encoded(x.shape).items()}\n"
        "            ws = {k: np.zeros(d.shape, d.dtype) for k, d in codec.workspace(x.shape, 'encode').items()}\n"
        "            codec.encode(np, x, enc, ws)\n"
        "            out = np.zeros_like(x)\n"
        "            ws = {k: np.zeros(d.shape, d.dtype) for k, d in codec.workspace(x.shape, 'decode').items()}\n"
        "            codec.decode(np, enc, out, ws)\n"
        "            got.append(out.tobytes())\n"
        "    assert got[0] == got[1], codec.name\n"
        "print('ok')\n")
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path),
               PYTHONPATH=os.path.join(os.path.dirname(__file__), ".."))
    env.pop("NUMBA_CPU_FEATURES", None)       # a generic CPU's features, not an emulated one's (avx2_environment)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_the_layers_line_names_their_path():
    from minigist import jit
    with kernels.use_kernels(True):
        assert jit.describe(np).startswith(f"numba {kernels.numba.__version__} kernels for MAX pooling")
        assert jit.describe(object()) == "xp ufuncs (not on a GPU)"
    with kernels.use_kernels(False):
        assert jit.describe(np) == "xp ufuncs (switched off)"


def test_the_blas_line_names_the_kernels_openblas_runs():
    """minigist.blas asks the loaded OpenBLAS which kernels it runs: forced through
    OPENBLAS_CORETYPE in a fresh process, the line names them and says who chose."""
    from minigist import blas
    if blas.openblas_info() is None:
        assert blas.describe().startswith("not OpenBLAS")
        return
    # the parenthesis says who chose the kernels, not the thread count (one thread is "1 thread")
    assert re.fullmatch(r"OpenBLAS \S+, \S+ kernels \((set by OPENBLAS_CORETYPE=\S+|"
                        r"OpenBLAS's choice for this CPU)\), (1 thread|\d+ threads)", blas.describe()), blas.describe()
    with blas.threads(1):
        assert blas.describe().endswith(", 1 thread")
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            avx2 = " avx2" in cpuinfo.read()
    except OSError:
        avx2 = False
    if platform.machine() not in ("x86_64", "AMD64") or not avx2:
        pytest.skip("the forced kernels below are x86-64 ones that need AVX2")
    script = "from minigist import blas; print(blas.describe())"
    root = os.path.join(os.path.dirname(__file__), "..")
    for forced in ("Sandybridge", "Haswell"):
        env = dict(os.environ, OPENBLAS_CORETYPE=forced, PYTHONPATH=root)
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                                timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        assert f", {forced} kernels (set by OPENBLAS_CORETYPE={forced}), " in result.stdout
