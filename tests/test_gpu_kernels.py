"""minigist's CUDA kernels (minigist/gpu/cuda_source.py) without a GPU, and with one.

- NVRTC from NVIDIA's PyPI wheel (.ci/run installs nvidia-cuda-nvrtc-cu12) compiles the whole
  source for sm_90, and every kernel is in it;
- gcc compiles the same text's element functions for the CPU (MG_HOST), which the tests run
  over every index with the CPU's flush-to-zero and denormals-are-zero modes on, as CUDA's
  -ftz=true: DPR's codes, the bit packings, the fused ReLU-pool code, SSDC's encode and decode,
  MAX pooling and ReLU write the numpy path's bytes. (The one-line float chains of BatchNorm,
  Scale and Dropout's product are checked on a GPU only, below.)
- on a GPU (marked `gpu`, skipped without CUDA): every kernel against the numpy path.
"""
import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest

from minigist import jit
from minigist.codecs.bits import BitMask, PackedCodes
from minigist.codecs.dpr import DPR, FORMATS
from minigist.codecs.fused import FusedReluPool
from minigist.codecs.kernels import _dpr_params
from minigist.codecs.ssdc import SSDC
from minigist.gpu import cuda_source, kernels as gpu_kernels, nvrtc
from minigist.testing import codes_dpr_writes, make_layer

RNG = np.random.default_rng(7)


# ---- NVRTC ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nvrtc_lib():
    lib = nvrtc.load()
    if lib is None:
        pytest.skip("NVRTC is not installed (pip install nvidia-cuda-nvrtc-cu12; .ci/run does)")
    return lib


@pytest.mark.slow
def test_every_kernel_compiles_for_sm_90(nvrtc_lib):
    size, log = nvrtc.compile_source(nvrtc_lib, cuda_source.SOURCE,
                                     cuda_source.OPTIONS + ("--gpu-architecture=sm_90",))
    assert size > 0, log
    ptx = nvrtc.compile_ptx(nvrtc_lib, cuda_source.SOURCE, cuda_source.OPTIONS + ("--gpu-architecture=compute_90",))
    entries = {line.split()[2].split("(")[0] for line in ptx.splitlines() if line.startswith(".visible .entry")}
    assert entries == set(cuda_source.KERNELS)


@pytest.mark.slow
def test_a_broken_kernel_fails_with_the_compiler_log(nvrtc_lib):
    with pytest.raises(nvrtc.CompileError, match="undefined"):
        nvrtc.compile_source(nvrtc_lib, cuda_source.SOURCE + "\nextern \"C\" __global__ void broken() { nothing(); }",
                             cuda_source.OPTIONS + ("--gpu-architecture=sm_90",))


# ---- the element functions on the CPU, with FTZ and DAZ on ---------------------------------------------
HARNESS = r"""
#define FTZ unsigned int saved = __builtin_ia32_stmxcsr(); __builtin_ia32_ldmxcsr(saved | 0x8040u);
#define DONE __builtin_ia32_ldmxcsr(saved);
void h_dpr_encode(const u32 *x, u32 *out, i64 n, const u32 *p) { FTZ for (i64 i = 0; i < n; i++) out[i] = mg_dpr_encode(x[i], p); DONE }
void h_dpr_decode(const u32 *c, u32 *out, i64 n, const u32 *p) { FTZ for (i64 i = 0; i < n; i++) out[i] = mg_dpr_decode(c[i], p); DONE }
void h_fp10(const u32 *x, u32 *words, i64 n, const u32 *p) { FTZ for (i64 k = 0; k < (n + 2) / 3; k++) words[k] = mg_fp10_word(x, n, k, p); DONE }
void h_pack_positive(const u32 *x, u8 *bits, i64 n) { FTZ for (i64 b = 0; b < (n + 7) / 8; b++) bits[b] = mg_pack_positive(x, n, b); DONE }
void h_pack_codes(const u8 *c, u8 *dst, i64 n, int bits) { for (i64 b = 0; b < (n * bits + 7) / 8; b++) dst[b] = mg_pack_codes(c, n, b, bits); }
void h_unpack(const u8 *src, u8 *dst, i64 n, int bits) { for (i64 i = 0; i < n; i++) dst[i] = mg_unpack_code(src, i, bits); }
void h_relu_pool(const u8 *am, const u32 *pooled, u8 *dst, i64 n, u32 k) { FTZ for (i64 b = 0; b < (n + 1) / 2; b++) dst[b] = mg_relu_pool_byte(am, pooled, n, b, k); DONE }
void h_relu(const u32 *x, u32 *y, i64 n) { FTZ for (i64 i = 0; i < n; i++) y[i] = mg_relu(x[i]); DONE }
void h_masked(const u32 *g, const u8 *keep, u32 *out, i64 n) { FTZ for (i64 i = 0; i < n; i++) out[i] = mg_masked(g[i], keep[i]); DONE }
void h_half(const u16 *h, float *out, i64 n) { FTZ for (i64 i = 0; i < n; i++) out[i] = mg_half(h[i]); DONE }
void h_keep(u64 seed, u64 position, u32 threshold, u8 *out, i64 n) { for (i64 i = 0; i < n; i++) out[i] = (u8)mg_keep(seed, position + (u64)i, threshold); }
void h_max_forward(const float *x, float *y, u8 *am, i64 n, int C, int H, int W, int OH, int OW, int kh, int kw,
                   int sh, int sw, int ph, int pw, int clamp) {
    FTZ for (i64 o = 0; o < n; o++) mg_max_forward(x, y, am, o, C, H, W, OH, OW, kh, kw, sh, sw, ph, pw, clamp); DONE }
void h_max_backward(const u8 *am, const float *gy, float *gx, i64 n, int C, int H, int W, int OH, int OW, int kh,
                    int kw, int sh, int sw, int ph, int pw, int disjoint) {
    FTZ for (i64 e = 0; e < n; e++) mg_max_backward(am, gy, gx, e, C, H, W, OH, OW, kh, kw, sh, sw, ph, pw, disjoint); DONE }
/* SSDC: the kernels' sequence, one thread after another */
void h_ssdc_encode(const u32 *u, i64 n, u32 *data, i64 vw, i64 capacity, int formats, int value_bytes, int rounded,
                   const u32 *p, int *stats) {
    FTZ
    i64 rows = (n + 255) / 256;
    u32 *values = data + 2, *tail = data + 2 + vw;
    int *counts = (int *)tail;
    for (i64 r = 0; r < rows; r++) mg_ssdc_count_row(u, n, r, counts);
    i64 nnz = mg_scan(counts, rows);
    mg_ssdc_header(data, nnz, n, capacity, formats, stats, 0, value_bytes == 0 && nnz ? values + (nnz - 1) / 3 : 0);
    for (i64 r = 0; r < rows; r++)
        mg_ssdc_write_row(u, n, r, data, counts, values, value_bytes, (u8 *)(tail + rows + 1), rounded, p);
    for (i64 b = 0; b < (n + 7) / 8; b++) mg_ssdc_bitmap_byte(u, n, b, data, (u8 *)tail);
    DONE
}
void h_ssdc_decode(const u32 *data, i64 vw, i64 n, int value_bytes, int rounded, const u32 *p, u32 *out, int *scratch) {
    FTZ
    i64 rows = (n + 255) / 256;
    const u32 *tail = data + 2 + vw;
    for (i64 r = 0; r < rows; r++) mg_ssdc_bitmap_row((const u8 *)tail, n, r, data, scratch);
    if (data[0] == 2u) mg_scan(scratch, rows);
    for (i64 r = 0; r < rows; r++)
        mg_ssdc_decode_row(data, (const int *)tail, (const u8 *)(tail + rows + 1), (const u8 *)tail, scratch,
                           data + 2, value_bytes, out, n, r, rounded, p);
    DONE
}
"""


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler for the host check of the kernels' element functions")
    folder = tmp_path_factory.mktemp("kernels")
    source = folder / "kernels.c"
    source.write_text("#define MG_HOST 1\n" + cuda_source.SOURCE + HARNESS)
    library = folder / "kernels.so"
    subprocess.run([compiler, "-O2", "-ffp-contract=off", "-fPIC", "-shared", "-Wall", "-Werror", "-o",
                    str(library), str(source)], check=True, capture_output=True)
    return ctypes.CDLL(str(library))


def ptr(array):
    return array.ctypes.data_as(ctypes.c_void_p)


def i64(n):
    return ctypes.c_longlong(int(n))


def params(dpr):
    return np.array(_dpr_params(dpr)[:14], np.uint32)


def float_patterns(n):
    """float32 bit patterns of every kind: random bits (all exponents, subnormals, Inf, NaN),
    values near 1, zeros of both signs."""
    bits = RNG.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    bits[: n // 4] = RNG.standard_normal(n // 4).astype(np.float32).view(np.uint32)
    bits[n // 4: n // 4 + 50] = 0
    bits[n // 4 + 50: n // 4 + 100] = 0x80000000
    return bits


@pytest.fixture
def ufunc_path():
    with jit.use_kernels(False):
        yield


@pytest.mark.parametrize("fmt", FORMATS)
def test_dpr_element_functions_write_the_numpy_codes_and_values(host, fmt, ufunc_path):
    dpr, n = DPR(fmt), 30001
    x = float_patterns(n)
    codes = np.zeros(-(-n // dpr.per), dpr.code_dtype)
    ws = {k: np.empty(d.shape, d.dtype) for k, d in dpr.flat_workspace(n, "encode").items()}
    dpr.encode_flat(np, x.view(np.float32), codes, ws)
    got = np.zeros(codes.size, np.uint32)
    if dpr.per == 3:
        host.h_fp10(ptr(x), ptr(got), i64(n), ptr(params(dpr)))
    else:
        host.h_dpr_encode(ptr(x), ptr(got), i64(n), ptr(params(dpr)))
    np.testing.assert_array_equal(got, codes.astype(np.uint32))
    every = codes_dpr_writes(dpr.fmt, np.arange(1 << (dpr.E + dpr.M + 1), dtype=np.uint32))
    want = np.empty(every.size, np.float32)
    if dpr.per == 3:
        words = np.zeros(-(-every.size // 3), np.uint32)
        for k in range(3):
            words[:every[k::3].size] |= every[k::3] << np.uint32(10 * k)
        dpr.decode_flat(np, words, want, {k: np.empty(d.shape, d.dtype)
                                          for k, d in dpr.flat_workspace(every.size, "decode").items()})
    else:
        dpr.decode_flat(np, every.astype(dpr.code_dtype), want,
                        {k: np.empty(d.shape, d.dtype) for k, d in dpr.flat_workspace(every.size, "decode").items()})
    decoded = np.empty(every.size, np.uint32)
    host.h_dpr_decode(ptr(every), ptr(decoded), i64(every.size), ptr(params(dpr)))
    np.testing.assert_array_equal(decoded, want.view(np.uint32))


def test_bit_packings_and_the_relu_pool_code(host, ufunc_path):
    n = 1237
    x = float_patterns(n)
    bits = np.empty(-(-n // 8), np.uint8)
    BitMask().encode(np, x.view(np.float32), {"bits": bits}, {"words": np.empty(-(-n // 8), np.uint64)})
    got = np.empty_like(bits)
    host.h_pack_positive(ptr(x), ptr(got), i64(n))
    np.testing.assert_array_equal(got, bits)
    for width in (1, 2, 4):
        codec = PackedCodes(width)
        codes = RNG.integers(0, 1 << width, n).astype(np.uint8)
        enc = {k: np.empty(d.shape, d.dtype) for k, d in codec.encoded((n,)).items()}
        ws = {k: np.empty(d.shape, d.dtype) for k, d in codec.workspace((n,), "encode").items()}
        codec.encode(np, codes, enc, ws)
        packed = np.empty_like(enc["codes"])
        host.h_pack_codes(ptr(codes), ptr(packed), i64(n), width)
        np.testing.assert_array_equal(packed, enc["codes"])
        unpacked = np.empty(n, np.uint8)
        host.h_unpack(ptr(packed), ptr(unpacked), i64(n), width)
        np.testing.assert_array_equal(unpacked, codes)
    fused = FusedReluPool(PackedCodes(4), 9)
    argmax = RNG.integers(0, 9, n).astype(np.uint8)
    pooled = x.view(np.float32)
    enc = {k: np.empty(d.shape, d.dtype) for k, d in fused.encoded((n,)).items()}
    fused.encode(np, (argmax, pooled), enc, {k: np.empty(d.shape, d.dtype) for k, d in fused.workspace((n,), "encode").items()})
    packed = np.empty_like(enc["codes"])
    host.h_relu_pool(ptr(argmax), ptr(x), ptr(packed), i64(n), ctypes.c_uint32(9))
    np.testing.assert_array_equal(packed, enc["codes"])


@pytest.mark.parametrize("value_format", ["fp32", "fp16", "fp10", "fp8-e4m3"])
@pytest.mark.parametrize("n, density", [(1000, 0.5), (70000, 0.02), (70000, 0.4)])
def test_ssdc_element_functions_write_the_numpy_encoding(host, value_format, n, density, ufunc_path):
    x = np.abs(RNG.standard_normal(n)).astype(np.float32)
    x[RNG.random(n) >= density] = 0
    nnz = int(np.count_nonzero(x))
    codec = SSDC(nnz + 5, value_format)
    want = {"data": np.zeros(codec.encoded((n,))["data"].shape, np.uint32)}
    ws = {k: np.empty(d.shape, d.dtype) for k, d in codec.workspace((n,), "encode").items()}
    assert codec.encode(np, x, want, ws)
    fmt, _ = codec.header(want)
    cap, rows, vw, _ = codec._layout(n)
    got = np.zeros_like(want["data"])
    stats = np.zeros(2, np.int32)
    value_bytes = gpu_kernels._value_bytes(codec)
    p = params(codec.dpr) if codec.dpr is not None else np.zeros(14, np.uint32)
    host.h_ssdc_encode(ptr(x.view(np.uint32)), i64(n), ptr(got), i64(vw), i64(codec.capacity), 3, value_bytes,
                       int(codec.dpr is not None), ptr(p), ptr(stats))
    assert stats.tolist() == [nnz, 0]
    np.testing.assert_array_equal(got[:2], want["data"][:2])
    value_words = -(-nnz * (4 if value_bytes == 0 else value_bytes) // (12 if value_bytes == 0 else 4)) \
        if value_bytes else -(-nnz // 3)
    used = {"csr": rows + 1 + -(-nnz // 4), "bitmap": -(-n // 32)}[fmt]
    values_got = got[2:2 + vw].view(np.uint8)[:nnz * value_bytes] if value_bytes else got[2:2 + value_words]
    values_want = want["data"][2:2 + vw].view(np.uint8)[:nnz * value_bytes] if value_bytes else \
        want["data"][2:2 + value_words]
    np.testing.assert_array_equal(values_got, values_want)
    tail_got, tail_want = got[2 + vw:].view(np.uint8), want["data"][2 + vw:].view(np.uint8)
    if fmt == "csr":
        end = 4 * (rows + 1) + nnz
    else:
        end = -(-n // 8)
    assert used * 4 >= end
    np.testing.assert_array_equal(tail_got[:end], tail_want[:end])
    out = np.empty(n, np.uint32)
    scratch = np.empty(rows + 1, np.int32)
    host.h_ssdc_decode(ptr(got), i64(vw), i64(n), value_bytes, int(codec.dpr is not None), ptr(p), ptr(out),
                       ptr(scratch))
    decoded = np.empty(n, np.float32)
    codec.decode(np, want, decoded, {k: np.empty(d.shape, d.dtype) for k, d in codec.workspace((n,), "decode").items()})
    np.testing.assert_array_equal(out, decoded.view(np.uint32))


def test_ssdc_over_capacity_stores_nothing_and_counts_it(host):
    x = np.ones(600, np.float32)
    codec = SSDC(10)
    data = np.full(codec.encoded(x.shape)["data"].shape, 7, np.uint32)
    stats = np.zeros(2, np.int32)
    cap, rows, vw, _ = codec._layout(x.size)
    host.h_ssdc_encode(ptr(x.view(np.uint32)), i64(x.size), ptr(data), i64(vw), i64(10), 3, 4, 0,
                       ptr(np.zeros(14, np.uint32)), ptr(stats))
    assert data[:2].tolist() == [0, 600] and stats.tolist() == [600, 1]
    out = np.full(x.size, 5, np.uint32)
    host.h_ssdc_decode(ptr(data), i64(vw), i64(x.size), 4, 0, ptr(np.zeros(14, np.uint32)), ptr(out),
                       ptr(np.empty(rows + 1, np.int32)))
    assert not out.any()


POOLS = ["kernel_size: 2 stride: 2", "kernel_size: 3 stride: 2 pad: 1", "kernel_size: 3 stride: 1 pad: 1",
         "kernel_size: 3 stride: 3"]


@pytest.mark.parametrize("geometry", POOLS)
def test_max_pooling_element_functions_match_the_layer(host, geometry, ufunc_path):
    shape = (2, 3, 11, 11)
    layer = make_layer(f'name: "p" type: "Pooling" bottom: "x" top: "y" pooling_param {{ pool: MAX {geometry} }}',
                       [shape], dtype=np.float32)
    x = RNG.standard_normal(shape).astype(np.float32)
    x[0, 0, :3, :3] = 0.5                          # ties: the first maximum wins
    x[0, 1, 0, 0] = np.float32(1e-40)              # a subnormal, compared as IEEE does
    y = np.empty(layer.top_shapes[0], np.float32)
    argmax = np.empty(layer.top_shapes[0], np.uint8)
    ws = {k: np.empty(d.shape, d.dtype or np.float32) for k, d in layer.workspace("forward").items()}
    layer.forward(np, [x], [y], [], {"argmax": argmax}, ws)
    geom = [ctypes.c_int(int(v)) for v in (shape[1], shape[2], shape[3]) + layer.out_hw + layer.kernel
            + layer.stride + layer.pad]
    y2, argmax2 = np.empty_like(y), np.empty_like(argmax)
    host.h_max_forward(ptr(x), ptr(y2), ptr(argmax2), i64(y.size), *geom, int(layer.empty_windows))
    np.testing.assert_array_equal(y2.view(np.uint32), y.view(np.uint32))
    np.testing.assert_array_equal(argmax2, argmax)
    gy = RNG.standard_normal(y.shape).astype(np.float32)
    gx = np.empty(shape, np.float32)
    ws = {k: np.empty(d.shape, d.dtype or np.float32) for k, d in layer.workspace("backward").items()}
    layer.backward_from_index(np, argmax, gy, gx, ws)
    gx2 = np.empty_like(gx)
    host.h_max_backward(ptr(argmax), ptr(gy), ptr(gx2), i64(gx.size), *geom, int(layer.disjoint))
    np.testing.assert_array_equal(gx2.view(np.uint32), gx.view(np.uint32))


def test_relu_masks_halves_and_dropout_draws(host):
    x = float_patterns(5000)
    y = np.empty_like(x)
    host.h_relu(ptr(x), ptr(y), i64(x.size))
    want = np.maximum(x.view(np.float32), np.float32(0))
    nan = np.isnan(want)
    np.testing.assert_array_equal(y[~nan], want.view(np.uint32)[~nan])
    np.testing.assert_array_equal(y[nan], x[nan])        # NaN kept, payload and all
    keep = RNG.integers(0, 2, x.size).astype(np.uint8)
    out = np.empty_like(x)
    host.h_masked(ptr(x), ptr(keep), ptr(out), i64(x.size))
    with np.errstate(invalid="ignore"):
        product = x.view(np.float32) * keep.astype(np.float32)
    same = ~np.isnan(product)
    np.testing.assert_array_equal(out[same], product.view(np.uint32)[same])
    assert np.isnan(out.view(np.float32)[~same]).all()
    halves = np.arange(1 << 16, dtype=np.uint16)
    read = np.empty(halves.size, np.float32)
    host.h_half(ptr(halves), ptr(read), i64(halves.size))
    exact = halves.view(np.float16).astype(np.float32)
    finite = ~np.isnan(exact)
    np.testing.assert_array_equal(read[finite].view(np.uint32), exact[finite].view(np.uint32))
    assert np.isnan(read[~finite]).all()
    kept = np.empty(4096, np.uint8)
    threshold = gpu_kernels.keep_threshold(0.3)
    host.h_keep(ctypes.c_uint64(12345), ctypes.c_uint64(777), ctypes.c_uint32(threshold), ptr(kept), i64(kept.size))
    np.testing.assert_array_equal(kept, gpu_kernels.dropout_keep(12345, 777, kept.size, threshold))
    assert abs(kept.mean() - 0.7) < 0.03


# ---- on a GPU -------------------------------------------------------------------------------------------
def cupy_or_skip():
    import minigist
    if not minigist.gpu_available():
        pytest.skip("no CUDA device (cupy and a GPU)")
    import cupy
    return cupy


@pytest.mark.gpu
def test_every_codec_writes_the_numpy_bytes_on_the_gpu():
    cupy = cupy_or_skip()
    from minigist.gpu.check import codec_bytes
    results = codec_bytes(cupy)
    assert all(row["same"] for row in results), [row for row in results if not row["same"]]


@pytest.mark.gpu
def test_layer_kernels_match_the_numpy_path_on_the_gpu():
    cupy = cupy_or_skip()
    from minigist.gpu.check import layer_kernels
    results = layer_kernels(cupy)
    assert all(row["same"] for row in results), [row for row in results if not row["same"]]


@pytest.mark.gpu
def test_dropout_keeps_its_fraction_on_the_gpu():
    cupy = cupy_or_skip()
    from minigist.gpu.check import dropout_fraction
    result = dropout_fraction(cupy)
    assert abs(result["kept"] - result["expected"]) < 0.01 and result["matches_numpy_stream"]


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["vgg_small", "resnet20", "inception_small"])
def test_gpu_training_matches_the_cpu_and_lossless_is_exact(model):
    cupy_or_skip()
    from minigist.gpu.check import train_cpu_and_gpu
    result = train_cpu_and_gpu(model, steps=3, batch_size=8, modes=("none", "lossless"))
    assert result["lossless_bit_identical_on_gpu"]
    assert result["worst_relative_difference"] <= 1e-5, result
