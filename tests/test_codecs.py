"""Gist's data codecs: BitMask / PackedCodes (lossless bits), DPR (reduced precision), SSDC (sparse).

DPR is checked against independent references: numpy's float16 cast for fp16, ml_dtypes'
float8_e4m3fn / float8_e5m2 casts for fp8, and a float64 model (round half to even on the
mantissa, with subnormals) written here for all formats (the only reference fp10 has).

Every test here runs twice: on the ufunc path and on the compiled kernels (numba; skipped when
it is not installed). tests/test_kernels.py compares the two paths byte for byte.
"""
import tracemalloc

import numpy as np
import pytest

from minigist.codecs.base import Codec
from minigist.codecs.bits import BitMask, PackedCodes
from minigist.codecs import dpr as dpr_mod
from minigist.codecs.dpr import DPR, FORMATS
from minigist.codecs.ssdc import SSDC

ml_dtypes = pytest.importorskip("ml_dtypes")


pytestmark = pytest.mark.usefixtures("kernel_path")     # the ufunc path and the kernels

RNG = np.random.default_rng(1234)
GUARD = 64                      # sentinel elements on each side of every handed array


# ---- harness ---------------------------------------------------------------------------------
def _garbage(dtype):
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return np.nan
    if dtype.kind == "b":
        return True
    return np.iinfo(dtype).max // 3          # a recognisable non-zero pattern


class Guarded:
    """Arrays for declared buffers, each the middle of a bigger array whose ends are sentinels,
    so a write outside the handed array is caught."""

    def __init__(self, decls):
        self.full, self.arrays = {}, {}
        for name, decl in decls.items():
            dtype = np.dtype(decl.dtype if decl.dtype is not None else np.float32)
            n = int(np.prod(decl.shape))
            full = np.full(n + 2 * GUARD, _garbage(dtype), dtype)
            self.full[name] = full
            self.arrays[name] = full[GUARD:GUARD + n].reshape(decl.shape)
        self.snapshot = {k: v.copy() for k, v in self.full.items()}

    def check_guards(self):
        for name, full in self.full.items():
            ref = self.snapshot[name]
            for part in (slice(0, GUARD), slice(len(full) - GUARD, None)):
                assert full[part].tobytes() == ref[part].tobytes(), f"write outside {name!r}"


def guarded_out(shape, dtype):
    from minigist.layers.base import TensorDecl
    g = Guarded({"out": TensorDecl(tuple(shape), dtype)})
    return g, g.arrays["out"]


def roundtrip(codec, x, enc=None):
    """encode then decode with guarded, garbage-filled buffers; returns (ok, enc, out)."""
    enc = enc or Guarded(codec.encoded(x.shape))
    x_before = x.copy()
    ws_e = Guarded(codec.workspace(x.shape, "encode"))
    with np.errstate(all="raise"):           # no floating-point flags from the codecs
        ok = codec.encode(np, x, enc.arrays, ws_e.arrays)
    assert x.tobytes() == x_before.tobytes(), "encode wrote into its input"
    ws_d = Guarded(codec.workspace(x.shape, "decode"))
    og, out = guarded_out(x.shape, codec.decoded_dtype(x.dtype))
    if ok is not False:
        with np.errstate(all="raise"):
            codec.decode(np, enc.arrays, out, ws_d.arrays)
    for g in (enc, ws_e, ws_d, og):
        g.check_guards()
    return ok, enc, out


def same_bits(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


def relu_like(shape, density, rng=RNG):
    x = np.abs(rng.standard_normal(shape)).astype(np.float32) + np.float32(1e-3)
    x[rng.random(shape) >= density] = 0
    return x


# ---- BitMask ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1,), (7,), (1000,), (3, 5, 7, 11), (2, 3, 120, 301)])
def test_bitmask_relu_roundtrip(shape):
    x = RNG.standard_normal(shape).astype(np.float32)
    x = np.maximum(x, 0)
    x.reshape(-1)[:3] = [-0.0, 0.0, np.nan][:x.size]
    ok, enc, out = roundtrip(BitMask(), x)
    assert out.dtype == np.bool_ and out.shape == x.shape
    np.testing.assert_array_equal(out, x > 0)
    # bit order: numpy.packbits' default, unused bits zero
    np.testing.assert_array_equal(enc.arrays["bits"], np.packbits(x.reshape(-1) > 0))


def test_bitmask_bool_input():
    mask = RNG.random((4, 3, 17, 13)) < 0.3
    ok, enc, out = roundtrip(BitMask(), mask)
    np.testing.assert_array_equal(out, mask)
    np.testing.assert_array_equal(enc.arrays["bits"], np.packbits(mask.reshape(-1)))


# ---- PackedCodes ------------------------------------------------------------------------------
def reference_pack(codes, bits):
    per = 8 // bits
    c = np.zeros(-(-codes.size // per) * per, np.int64)
    c[:codes.size] = codes.reshape(-1)
    c = c.reshape(-1, per)
    shifts = bits * (per - 1 - np.arange(per))
    return (c << shifts).sum(axis=1).astype(np.uint8)


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("n", [1, 3, 7, 13, 1001, 65536 * 2 + 5])
def test_packed_codes_roundtrip(bits, n):
    codes = RNG.integers(0, 1 << bits, n).astype(np.uint8)
    ok, enc, out = roundtrip(PackedCodes(bits), codes)
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, codes)
    np.testing.assert_array_equal(enc.arrays["codes"], reference_pack(codes, bits))


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_packed_codes_every_byte(bits):
    """Every combination of codes in a byte packs and unpacks right (no carries)."""
    per = 8 // bits
    combos = np.array(np.meshgrid(*[np.arange(1 << bits)] * per, indexing="ij"))
    codes = combos.reshape(per, -1).T.reshape(-1).astype(np.uint8)   # 256 bytes' worth
    ok, enc, out = roundtrip(PackedCodes(bits), codes.reshape(16, -1))
    np.testing.assert_array_equal(out.reshape(-1), codes)
    np.testing.assert_array_equal(enc.arrays["codes"], np.arange(256, dtype=np.uint8))


def test_packed_codes_4d_maxpool_index():
    idx = RNG.integers(0, 9, (3, 4, 7, 5)).astype(np.uint8)          # 3x3 window index
    ok, enc, out = roundtrip(PackedCodes(4), idx)
    np.testing.assert_array_equal(out, idx)


# ---- DPR: references -------------------------------------------------------------------------
def params(fmt):
    E, M, bias, has_inf = FORMATS[fmt][:4]
    return E, M, bias, has_inf


def ref_decode(codes, fmt):
    """Value of each code, from the format's definition (float64)."""
    E, M, bias, has_inf = params(fmt)
    codes = np.asarray(codes, np.int64)
    s, e, m = codes >> (E + M), (codes >> M) & ((1 << E) - 1), codes & ((1 << M) - 1)
    val = np.where(e == 0, m * 2.0 ** (1 - bias - M), (1 + m / 2.0 ** M) * 2.0 ** (e - bias))
    top = e == (1 << E) - 1
    if has_inf:
        val = np.where(top, np.where(m == 0, np.inf, np.nan), val)
    else:
        val = np.where(top & (m == (1 << M) - 1), np.nan, val)
    return np.where(s == 1, -val, val)


def max_finite(fmt):
    E, M, bias, has_inf = params(fmt)
    if has_inf:
        return (2 - 2.0 ** -M) * 2.0 ** ((1 << E) - 2 - bias)
    return (2 - 2.0 ** (1 - M)) * 2.0 ** ((1 << E) - 1 - bias)


def ref_round(x, fmt):
    """float64 model of float32 -> fmt -> float32: round half to even on the M-bit mantissa at the
    value's own exponent (the subnormal quantum below the smallest normal), overflow past the max
    finite to Inf (IEEE-like formats) or NaN (E4M3FN), Inf -> NaN for E4M3FN, signs kept."""
    E, M, bias, has_inf = params(fmt)
    with np.errstate(all="ignore"):                   # the cast of a signalling NaN flags
        x = np.asarray(x, np.float64)
        a = np.abs(x)
        _, ex = np.frexp(a)                           # a = f * 2**ex, f in [0.5, 1)
        e = np.maximum(ex - 1, 1 - bias)
        q = np.ldexp(1.0, e - M)
        r = np.rint(a / q) * q                        # exact scaling; rint: half to even
        r = np.where(r > max_finite(fmt), np.inf if has_inf else np.nan, r)
        r = np.where(np.isinf(a), np.inf if has_inf else np.nan, r)
        r = np.where(np.isnan(a), np.nan, r)
    return np.copysign(r, x).astype(np.float32)


def oracle(fmt, x):
    """The independent library cast, where one exists."""
    with np.errstate(all="ignore"):
        if fmt == "fp16":
            return x.astype(np.float16).astype(np.float32)
        if fmt == "fp8-e4m3":
            return x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        if fmt == "fp8-e5m2":
            return x.astype(ml_dtypes.float8_e5m2).astype(np.float32)
    return None


def all_codes(fmt):
    E, M = params(fmt)[:2]
    return np.arange(1 << (1 + E + M), dtype=np.int64)


def dpr_encode(fmt, x):
    codec = DPR(fmt)
    enc = Guarded(codec.encoded(x.shape))
    ws = Guarded(codec.workspace(x.shape, "encode"))
    with np.errstate(all="raise"):           # Inf, NaN, float32 subnormals raise no flags
        codec.encode(np, x, enc.arrays, ws.arrays)
    enc.check_guards(), ws.check_guards()
    codes = enc.arrays["codes"]
    if fmt == "fp10":
        codes = ((codes[:, None] >> np.array([0, 10, 20], np.uint32)) & 0x3FF).reshape(-1)[:x.size]
    return codes.astype(np.int64)


def dpr_decode(fmt, codes):
    codec = DPR(fmt)
    n = codes.size
    if fmt == "fp10":
        c = np.zeros(-(-n // 3) * 3, np.uint32)
        c[:n] = codes
        c = c.reshape(-1, 3)
        packed = c[:, 0] | (c[:, 1] << 10) | (c[:, 2] << 20)
    else:
        packed = codes.astype(codec.code_dtype)
    ws = Guarded(codec.workspace((n,), "decode"))
    og, out = guarded_out((n,), np.float32)
    with np.errstate(all="raise"):
        codec.decode(np, {"codes": packed}, out, ws.arrays)
    ws.check_guards(), og.check_guards()
    return out


def probe_values(fmt):
    """Every representable positive value, the midpoints between neighbours (ties), one float32
    ulp either side of each midpoint, the smallest subnormal and half of it, the normal/subnormal
    boundary, max finite and just above, huge values, Inf, NaN, float32 subnormals: both signs."""
    E, M, bias, has_inf = params(fmt)
    vals = ref_decode(all_codes(fmt), fmt)
    vals = np.unique(vals[np.isfinite(vals) & (vals >= 0)])
    mids = (vals[:-1] + vals[1:]) / 2
    top = max_finite(fmt)
    ulp_top = 2.0 ** ((1 << E) - 2 - bias - M) if has_inf else 2.0 ** ((1 << E) - 1 - bias - M)
    sub = 2.0 ** (1 - bias - M)
    extra = np.array([0.0, sub / 2, sub / 4, 3 * sub / 2, 2.0 ** (1 - bias), 2.0 ** (1 - bias) - sub / 2,
                      top, top + ulp_top / 2, top + ulp_top, top * 1.0001, 1e30, 3.4e38, 1e-45,
                      1e-40, np.inf, np.nan])
    base = np.concatenate([vals, mids, extra]).astype(np.float32)
    finite = base[np.isfinite(base)]
    near = np.concatenate([np.nextafter(finite, np.float32(np.inf)),
                           np.nextafter(finite, np.float32(0))])
    snan = np.array([0x7F800001, 0x7FA00000], np.uint32).view(np.float32)   # signalling NaNs
    pos = np.concatenate([base, near, snan])
    return np.concatenate([pos, -pos]).astype(np.float32)


def random_values(n=20000, rng=RNG):
    mag = 10.0 ** rng.uniform(-10, 6, n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    return (mag * sign).astype(np.float32)


# ---- DPR: tests ------------------------------------------------------------------------------
def test_reference_model_agrees_with_library_casts():
    """The float64 model used for fp10 reproduces numpy / ml_dtypes on the fp16 / fp8 probes."""
    for fmt in ("fp16", "fp8-e4m3", "fp8-e5m2"):
        x = np.concatenate([probe_values(fmt), random_values(5000)])
        assert same_bits(ref_round(x, fmt), oracle(fmt, x)).all(), fmt


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dpr_probes_and_random(fmt):
    x = np.concatenate([probe_values(fmt), random_values()])
    got = dpr_decode(fmt, dpr_encode(fmt, x))
    want = ref_round(x, fmt)
    bad = ~same_bits(got, want)
    assert not bad.any(), (fmt, x[bad][:8], got[bad][:8], want[bad][:8])
    lib = oracle(fmt, x)
    if lib is not None:
        bad = ~same_bits(got, lib)
        assert not bad.any(), (fmt, x[bad][:8], got[bad][:8], lib[bad][:8])


def test_dpr_fp16_codes_match_numpy_bit_for_bit():
    x = np.concatenate([probe_values("fp16"), random_values()])
    codes = dpr_encode("fp16", x)
    with np.errstate(all="ignore"):
        ref = x.astype(np.float16).view(np.uint16).astype(np.int64)
    nan = np.isnan(x)
    np.testing.assert_array_equal(codes[~nan], ref[~nan])
    assert np.isnan(dpr_decode("fp16", codes)[nan]).all()


@pytest.mark.parametrize("fmt,dtype", [("fp8-e4m3", "float8_e4m3fn"), ("fp8-e5m2", "float8_e5m2")])
def test_dpr_fp8_codes_match_ml_dtypes(fmt, dtype):
    x = np.concatenate([probe_values(fmt), random_values()])
    codes = dpr_encode(fmt, x)
    with np.errstate(all="ignore"):
        ref = x.astype(getattr(ml_dtypes, dtype)).view(np.uint8).astype(np.int64)
    nan = np.isnan(ref_round(x, fmt))
    np.testing.assert_array_equal(codes[~nan], ref[~nan])
    # NaN keeps its sign; E4M3FN's NaN is S.1111.111
    if fmt == "fp8-e4m3":
        np.testing.assert_array_equal(codes[nan] & 0x7F, 0x7F)
    np.testing.assert_array_equal(codes[nan] >> 7, np.signbit(x[nan]))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dpr_every_code(fmt):
    """Every code decodes to its value; every non-NaN code re-encodes to itself."""
    codes = all_codes(fmt)
    got = dpr_decode(fmt, codes)
    assert same_bits(got, ref_decode(codes, fmt)).all()
    if fmt == "fp16":
        assert same_bits(got, codes.astype(np.uint16).view(np.float16).astype(np.float32)).all()
    elif fmt.startswith("fp8"):
        lib = ml_dtypes.float8_e4m3fn if fmt == "fp8-e4m3" else ml_dtypes.float8_e5m2
        assert same_bits(got, codes.astype(np.uint8).view(lib).astype(np.float32)).all()
    keep = ~np.isnan(got)
    np.testing.assert_array_equal(dpr_encode(fmt, got[keep]), codes[keep])


def test_dpr_specific_behaviour():
    """The documented edge cases, spelled out."""
    def rt(fmt, values):
        return dpr_decode(fmt, dpr_encode(fmt, np.array(values, np.float32)))
    # overflow: Inf for IEEE-like formats, NaN for E4M3FN; the tie at max + half ulp
    np.testing.assert_array_equal(rt("fp16", [65504, 65519, 65520, -1e6]), [65504, 65504, np.inf, -np.inf])
    np.testing.assert_array_equal(rt("fp8-e5m2", [57344, 61439, 61440]), [57344, 57344, np.inf])
    np.testing.assert_array_equal(rt("fp10", [63488, 64511, 64512, 65535]), [63488, 63488, np.inf, np.inf])
    got = rt("fp8-e4m3", [448, 464, 465, np.inf, -np.inf, -500])
    np.testing.assert_array_equal(got[:2], [448, 448])
    assert np.isnan(got[2:]).all()
    # subnormals and signed zero (fp10: smallest subnormal 2**-18)
    s = 2.0 ** -18
    got = rt("fp10", [s, s / 2, 3 * s / 2, -s / 2, -0.0, 0.0, 2 ** -14 - s / 2])
    np.testing.assert_array_equal(got, [s, 0.0, 2 * s, -0.0, -0.0, 0.0, 2 ** -14])
    assert list(np.signbit(got[3:6])) == [True, True, False]
    # NaN stays NaN
    for fmt in FORMATS:
        assert np.isnan(rt(fmt, [np.nan, -np.nan])).all()


@pytest.mark.parametrize("fmt", ["fp16", "fp10", "fp8-e4m3"])
def test_dpr_chunked_tensor(fmt):
    """A tensor spanning several chunks, of a size that leaves a partial fp10 word."""
    n = 2 * dpr_mod.CHUNK + 7
    x = (RNG.standard_normal(n) * 10.0 ** RNG.uniform(-6, 4, n)).astype(np.float32).reshape(1, -1)
    ok, enc, out = roundtrip(DPR(fmt), x)
    assert same_bits(out, ref_round(x, fmt)).all()
    if fmt == "fp10":
        last = int(enc.arrays["codes"][-1])
        assert last >> 10 == 0 and n % 3 == 1        # unused slots and the top 2 bits are zero


def test_dpr_rejects_other_dtypes():
    with pytest.raises(TypeError):
        roundtrip(DPR("fp16"), np.zeros(4, np.float64))
    with pytest.raises(ValueError):
        DPR("fp12")


# ---- SSDC --------------------------------------------------------------------------------------
SHAPES = [(1000,), (3, 5, 7, 11), (2, 3, 120, 301)]        # the last spans 4 chunks


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["csr", "bitmap"])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 0.95, 1.0])
@pytest.mark.parametrize("shape", SHAPES)
def test_ssdc_exact_roundtrip(shape, density, fmt):
    x = relu_like(shape, density)
    flat = x.reshape(-1)
    if flat.size > 10 and density > 0:          # odd non-zeros come back bit-exact too
        flat[[1, 5, 9]] = [-0.0, np.nan, 1e-42]
    codec = SSDC(x.size, formats=(fmt,))
    ok, enc, out = roundtrip(codec, x)
    assert ok is True
    assert out.tobytes() == x.tobytes()
    nnz = int(np.count_nonzero(x.view(np.uint32)))
    assert SSDC.header(enc.arrays) == (fmt, nnz)
    assert codec.stored_nbytes(enc.arrays, shape) == 8 + SSDC.nbytes_for(x.size, nnz, 4)[fmt]


def test_ssdc_picks_the_smaller_format():
    n = 256 * 64                                 # bitmap 2048 + V bytes, csr nnz + 260 + V
    assert SSDC.nbytes_for(n, 1787, 4) == {"csr": 1787 * 5 + 260, "bitmap": 2048 + 1787 * 4}
    codec = SSDC(n)
    for nnz, want in [(0, "csr"), (1786, "csr"), (1787, "csr"), (1788, "bitmap"), (9000, "bitmap")]:
        x = np.zeros(n, np.float32)
        x[RNG.choice(n, nnz, replace=False)] = 1.5
        ok, enc, out = roundtrip(codec, x)
        assert ok and SSDC.header(enc.arrays) == (want, nnz), nnz
        assert out.tobytes() == x.tobytes()
        sizes = SSDC.nbytes_for(n, nnz, 4)
        assert codec.stored_nbytes(enc.arrays, x.shape) == 8 + min(sizes.values())


@pytest.mark.parametrize("fmt", ["csr", "bitmap"])
def test_ssdc_over_capacity(fmt):
    shape = (2, 3, 50, 50)
    good = relu_like(shape, 0.05)
    cap = int(np.count_nonzero(good)) + 3
    codec = SSDC(cap, formats=(fmt,))
    ok, enc, out = roundtrip(codec, good)
    assert ok is True and out.tobytes() == good.tobytes()
    before = {k: v.copy() for k, v in enc.full.items()}
    dense = relu_like(shape, 0.5)
    ws = Guarded(codec.workspace(shape, "encode"))
    assert codec.encode(np, dense, enc.arrays, ws.arrays) is False
    for k, v in enc.full.items():                 # nothing written, inside enc or out of it
        assert v.tobytes() == before[k].tobytes()
    ws.check_guards()
    og, out = guarded_out(shape, np.float32)
    codec.decode(np, enc.arrays, out, Guarded(codec.workspace(shape, "decode")).arrays)
    assert out.tobytes() == good.tobytes()        # the previous encoding is still there
    # exactly at capacity fits, one more does not
    edge = np.zeros(shape, np.float32)
    edge.reshape(-1)[RNG.choice(edge.size, cap + 1, replace=False)] = 2.0
    assert codec.encode(np, edge, enc.arrays, ws.arrays) is False
    edge.reshape(-1)[np.flatnonzero(edge)[0]] = 0.0
    ok, enc, out = roundtrip(codec, edge)
    assert ok is True and out.tobytes() == edge.tobytes()


@pytest.mark.slow
@pytest.mark.parametrize("vf", list(FORMATS))
@pytest.mark.parametrize("fmt", ["csr", "bitmap"])
def test_ssdc_dpr_values(vf, fmt):
    """With DPR values, decode equals the DPR-rounded tensor (zeros stay zeros)."""
    shape = (2, 3, 120, 301)
    x = relu_like(shape, 0.3) * np.float32(100.0)
    x.reshape(-1)[7] = 1e6                        # overflows the fp8 formats
    codec = SSDC(x.size, vf, formats=(fmt,))
    assert codec.lossless is False and codec.name == f"ssdc-{vf}"
    ok, enc, out = roundtrip(codec, x)
    assert ok is True
    assert same_bits(out, ref_round(x, vf)).all()
    nnz = int(np.count_nonzero(x))
    assert codec.stored_nbytes(enc.arrays, shape) == 8 + SSDC.nbytes_for(x.size, nnz, vf)[fmt]


def test_ssdc_rejects():
    with pytest.raises(TypeError):
        roundtrip(SSDC(10), np.zeros(4, np.float64))
    with pytest.raises(ValueError):
        SSDC(10, "fp7")
    with pytest.raises(ValueError):
        SSDC(10, formats=("coo",))


# ---- sizes, workspace, temporaries ------------------------------------------------------------
def test_encoded_sizes():
    assert BitMask().encoded_nbytes((1000,)) == 125
    assert BitMask().encoded_nbytes((1001,)) == 126
    assert BitMask().encoded_nbytes((32, 64, 32, 32)) == 32 * 64 * 32 * 32 // 8
    assert [PackedCodes(b).encoded_nbytes((13,)) for b in (1, 2, 4)] == [2, 4, 7]
    assert DPR("fp10").encoded_nbytes((10,)) == 16
    assert DPR("fp10").encoded_nbytes((9,)) == 12
    assert DPR("fp16").encoded_nbytes((10,)) == 20
    assert DPR("fp8-e4m3").encoded_nbytes((2, 5)) == 10
    assert DPR("fp8-e5m2").encoded_nbytes((10,)) == 10
    # SSDC, 1000 elements (4 rows), capacity 100: header 2 words + values 100 words +
    # max(csr: 5 row pointers + 25 words of columns, bitmap: 32 words) = 134 words
    assert SSDC(100).encoded_nbytes((1000,)) == 536
    assert SSDC(100, "fp16").encoded_nbytes((1000,)) == 4 * (2 + 50 + 32)
    assert SSDC(100, "fp10").encoded_nbytes((1000,)) == 4 * (2 + 34 + 32)
    assert SSDC(100, formats=("csr",)).encoded_nbytes((1000,)) == 4 * (2 + 100 + 30)
    assert SSDC(100, formats=("bitmap",)).encoded_nbytes((1000,)) == 4 * (2 + 100 + 32)
    assert SSDC(5000).encoded_nbytes((1000,)) == 4 * (2 + 1000 + 5 + 250)   # capacity clipped
    assert SSDC.nbytes_for(1000, 100, 4) == {"csr": 520, "bitmap": 525}
    assert SSDC.nbytes_for(1000, 100, "fp10") == {"csr": 100 + 136 + 20, "bitmap": 125 + 136}
    assert SSDC.nbytes_for(1000, 100, "fp8-e4m3") == {"csr": 200 + 20, "bitmap": 225}


ALL_CODECS = ([BitMask(), PackedCodes(1), PackedCodes(2), PackedCodes(4)]
              + [DPR(f) for f in FORMATS] + [SSDC(10 ** 9), SSDC(10 ** 9, "fp10")])


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: c.name)
def test_codec_contract(codec):
    assert isinstance(codec, Codec)
    big = (64, 256, 56, 56)
    for phase in ("encode", "decode"):
        ws = codec.workspace(big, phase)
        nbytes = sum(int(np.prod(d.shape)) * np.dtype(d.dtype).itemsize for d in ws.values())
        assert nbytes <= 2 << 20, (phase, nbytes)             # bounded by the chunk
    for decl in codec.encoded(big).values():
        assert len(decl.shape) == 1
        assert np.dtype(decl.dtype) in (np.uint8, np.uint16, np.uint32, np.int32, np.float32)


def _input_for(codec, shape):
    if isinstance(codec, PackedCodes):
        return RNG.integers(0, 1 << codec.bits, shape).astype(np.uint8)
    x = RNG.standard_normal(shape).astype(np.float32)
    return np.maximum(x, 0) if isinstance(codec, (BitMask, SSDC)) else x


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: c.name)
def test_no_tensor_sized_temporaries(codec):
    """Peak numpy allocation inside encode / decode stays far below the tensor's size."""
    shape = (8, 64, 64, 64)                                    # 2M elements, 8 MiB as float32
    x = _input_for(codec, shape)
    if isinstance(codec, SSDC):
        x = np.abs(x) + np.float32(1)                          # the worst case: all non-zero
    enc = {k: np.empty(d.shape, d.dtype) for k, d in codec.encoded(shape).items()}
    wse = {k: np.empty(d.shape, d.dtype) for k, d in codec.workspace(shape, "encode").items()}
    wsd = {k: np.empty(d.shape, d.dtype) for k, d in codec.workspace(shape, "decode").items()}
    out = np.empty(shape, codec.decoded_dtype(x.dtype))
    tracemalloc.start()
    try:
        codec.encode(np, x, enc, wse)
        peak_enc = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        codec.decode(np, enc, out, wsd)
        peak_dec = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert max(peak_enc, peak_dec) < 1.5 * 2 ** 20, (peak_enc, peak_dec)
    if codec.lossless:
        want = x > 0 if isinstance(codec, BitMask) else x
        np.testing.assert_array_equal(out, want)


def test_small_chunks():
    """Many chunk boundaries: a tensor walked in small steps gives the same result."""
    shape = (3, 7, 41, 13)
    x = relu_like(shape, 0.3)
    ok, enc, out = roundtrip(BitMask(chunk=64), x)
    np.testing.assert_array_equal(out, x > 0)
    for bits in (1, 2, 4):
        codes = RNG.integers(0, 1 << bits, shape).astype(np.uint8)
        ok, enc, out = roundtrip(PackedCodes(bits, chunk=64), codes)
        np.testing.assert_array_equal(out, codes)
    for fmt in FORMATS:
        ok, enc, out = roundtrip(DPR(fmt, chunk=96), x)
        assert same_bits(out, ref_round(x, fmt)).all()
    for vf in ("fp32", "fp10", "fp16"):
        for fmt in ("csr", "bitmap"):
            for density in (0.02, 0.3):
                y = relu_like(shape, density)
                ok, enc, out = roundtrip(SSDC(y.size, vf, formats=(fmt,), chunk=512), y)
                want = y if vf == "fp32" else ref_round(y, vf)
                assert ok and same_bits(out, want).all(), (vf, fmt, density)
    with pytest.raises(ValueError):
        SSDC(10, chunk=100)
    with pytest.raises(ValueError):
        DPR("fp10", chunk=100)


def test_ssdc_refuses_a_header_it_did_not_write():
    """A header claiming more non-zeros than the capacity (or a format the codec does not
    reserve) is refused before anything is read past the values: decode raises."""
    shape = (3, 700)
    x = relu_like(shape, 0.3)
    codec = SSDC(int(np.count_nonzero(x)), formats=("bitmap",))
    ok, enc, out = roundtrip(codec, x)
    assert ok is True and out.tobytes() == x.tobytes()
    data = enc.arrays["data"]
    data[1] = codec.capacity + 1
    with pytest.raises(ValueError, match="capacity"):
        codec.decode(np, enc.arrays, np.empty(shape, np.float32), {})
    data[1] = 5
    data[0] = 1                                  # csr, which this codec reserves no room for
    with pytest.raises(ValueError, match="capacity"):
        codec.decode(np, enc.arrays, np.empty(shape, np.float32), {})


def test_half_stash_holds_dpr_fp16_codes_as_float16_of_the_tensor_shape():
    from minigist.codecs.dpr import HalfStash
    shape = (3, 5, 7, 2)
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32) * 1e3
    x.reshape(-1)[:4] = [np.inf, -0.0, 1e-7, 7e4]
    plain, half = DPR("fp16"), HalfStash()
    assert half.name == "fp16" and half.encoded_nbytes(shape) == plain.encoded_nbytes(shape)
    decl = half.encoded(shape)["codes"]
    assert tuple(decl.shape) == shape and np.dtype(decl.dtype) == np.float16
    results = []
    for codec in (plain, half):
        enc = {k: np.zeros(d.shape, d.dtype) for k, d in codec.encoded(shape).items()}
        codec.encode(np, x, enc, {k: np.empty(d.shape, d.dtype) for k, d in codec.workspace(shape, "encode").items()})
        out = np.empty(shape, np.float32)
        codec.decode(np, enc, out, {k: np.empty(d.shape, d.dtype) for k, d in codec.workspace(shape, "decode").items()})
        results.append((enc["codes"].tobytes(), out))
    assert results[0][0] == results[1][0]
    np.testing.assert_array_equal(results[0][1], results[1][1])
    # the codes read as float16 are the decoded values
    enc = {"codes": np.zeros(shape, np.float16)}
    half.encode(np, x, enc, {k: np.empty(d.shape, d.dtype) for k, d in half.workspace(shape, "encode").items()})
    np.testing.assert_array_equal(enc["codes"].astype(np.float32), results[1][1])
