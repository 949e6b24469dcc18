"""The CUDA C text of minigist's GPU kernels: one place for CuPy (kernels.py compiles it as one
RawModule) and for the tests (NVRTC for sm_90 through ctypes; gcc for the host check).

How the text is organised, so that one text serves three compilers:
- the arithmetic of one element (one output byte, one pool output, one SSDC row, ...) is an
  `MG_FN` function taking plain pointers and an index; a `__global__` kernel runs it over a
  grid-stride loop (`MG_EACH`). With `MG_HOST` defined (gcc, tests/test_gpu_kernels.py) the
  kernels are left out and the element functions are compiled as C for the CPU, where the test
  runs them over every index, with the CPU's flush-to-zero and denormals-are-zero modes on, and
  compares the bytes with the numpy path's;
- every float product, sum and difference is an explicit round-to-nearest intrinsic
  (__fmul_rn, __fadd_rn, __fsub_rn), which the compiler never contracts into an FMA: each
  rounds once, as numpy's separate ufuncs do;
- what must be bit-exact never meets a float32 subnormal: comparisons with zero, DPR's codes
  and fp16 reads go through the integer bit pattern, so the bytes do not depend on -ftz (CuPy's
  kernels flush subnormals; these are compiled with --ftz=true on purpose, the worst case);
- no headers: NVRTC from PyPI has none, and no CUDA type beyond the built-in ones is needed.

SSDC's device-side protocol (no host sync; the ufunc path's format and bytes):
encode = count_rows (non-zeros of each 256-element row into the data's tail) -> ssdc_scan (one
thread: exclusive prefix sums in place, which is CSR's rowptr; picks the format as
SSDC.choose does and writes the header; a tensor denser than the capacity gets format 0 and
its count, and bumps the step's overflow counter; the densest count seen goes to a stats
slot) -> ssdc_write_values (values, and CSR's columns) -> ssdc_write_bitmap (bitmap format
only, over the row counts, which the values kernel has finished reading).
decode = ssdc_bitmap_rows (bitmap format: set bits per row into scratch) -> ssdc_scan_rows ->
ssdc_decode_rows (format 0: zeros; csr; bitmap), each kernel checking the header itself.
"""

SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;
typedef unsigned long long u64;

#ifdef MG_HOST
#include <string.h>
#define MG_FN static inline
static inline u32 mg_bits(float f) { u32 u; memcpy(&u, &f, 4); return u; }
static inline float mg_float(u32 u) { float f; memcpy(&f, &u, 4); return f; }
#define MG_MUL(a, b) ((a) * (b))
#define MG_ADD(a, b) ((a) + (b))
#define MG_SUB(a, b) ((a) - (b))
#define MG_ATOMIC_ADD(p, v) (*(p) += (v))
#define MG_ATOMIC_MAX(p, v) (*(p) = (*(p) > (v) ? *(p) : (v)))
#define MG_ATOMIC_AND(p, v) (*(p) &= (v))
#define MG_ATOMIC_OR(p, v) (*(p) |= (v))
#else
#define MG_FN __device__ __forceinline__
#define mg_bits(f) __float_as_uint(f)
#define mg_float(u) __uint_as_float(u)
#define MG_MUL(a, b) __fmul_rn(a, b)
#define MG_ADD(a, b) __fadd_rn(a, b)
#define MG_SUB(a, b) __fsub_rn(a, b)
#define MG_ATOMIC_ADD(p, v) atomicAdd(p, v)
#define MG_ATOMIC_MAX(p, v) atomicMax(p, v)
#define MG_ATOMIC_AND(p, v) atomicAnd(p, v)
#define MG_ATOMIC_OR(p, v) atomicOr(p, v)
#define MG_EACH(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
                           i += (i64)blockDim.x * gridDim.x)
#endif

/* ---- float32 facts from the bit pattern (exact whatever the FTZ mode) ---------------------- */
MG_FN int mg_positive(u32 b) { return (int)b > 0 && (b & 0x7FFFFFFFu) <= 0x7F800000u; }  /* x > 0 */
MG_FN int mg_is_nan(u32 b) { return (b & 0x7FFFFFFFu) > 0x7F800000u; }
/* a > b and a >= b as IEEE compares them, subnormals included (the ordered key of the bits;
   -0 == +0; NaN compares false) */
MG_FN u32 mg_key(u32 b) { return (b & 0x80000000u) ? ~b : (b | 0x80000000u); }
MG_FN int mg_zeros(u32 a, u32 b) { return ((a | b) & 0x7FFFFFFFu) == 0u; }
MG_FN int mg_gt(u32 a, u32 b) { return !mg_is_nan(a) && !mg_is_nan(b) && !mg_zeros(a, b) && mg_key(a) > mg_key(b); }
MG_FN int mg_ge(u32 a, u32 b) { return !mg_is_nan(a) && !mg_is_nan(b) && (mg_zeros(a, b) || mg_key(a) >= mg_key(b)); }
/* gy * 0.0f as numpy gives it: a zero of gy's sign, or gy itself when it is a NaN */
MG_FN u32 mg_times_zero(u32 g) { return mg_is_nan(g) ? (g | 0x00400000u) : (g & 0x80000000u); }

/* ---- DPR: p[] as minigist.codecs.kernels.dpr_params (the integer path; no F16C) ------------- */
#define MG_DPR_ARGS u32 p0, u32 p1, u32 p2, u32 p3, u32 p4, u32 p5, u32 p6, u32 p7, u32 p8, \
                    u32 p9, u32 p10, u32 p11, u32 p12, u32 p13
#define MG_DPR_PARAMS u32 p[14] = {p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13}

MG_FN u32 mg_dpr_encode(u32 x, const u32 *p) {
    u32 shift = p[0], round_add = p[1], top = p[3], min_normal = p[4], sign_bit = p[5];
    u32 a = x & 0x7FFFFFFFu;
    u32 v = (a + ((a >> shift) & 1u) + round_add) >> shift;        /* normals, wrapping */
    u32 t = p[2] ? top + (((a + 0x7FFFFFu) >> 31) << (p[8] - 1u)) : top;   /* Inf / NaN */
    if (v > t) v = t;
    int e = (int)(a >> 23);
    u32 m = (a & 0x7FFFFFu) | (e > 0 ? 0x800000u : 0u);
    int r = (int)p[7] - e;
    if (r > 31) r = 31;
    if (r < 1) r = 1;
    u32 sub = (m + (1u << (r - 1)) - 1u + ((m >> r) & 1u)) >> r;    /* ties to even */
    v = a >= min_normal ? v : sub;
    return v | ((x >> p[6]) & sign_bit);
}

MG_FN u32 mg_dpr_decode(u32 c, const u32 *p) {
    u32 shift = p[0], abs_mask = p[9], special = p[10], adj = p[11], mantissa_bits = p[8];
    u32 w = c & abs_mask;
    u32 bits;
    if (w >= special) {
        bits = 0x7F800000u | ((w & ((1u << mantissa_bits) - 1u)) << shift);
    } else if (w >= (1u << mantissa_bits)) {
        bits = (w << shift) + adj;
    } else if (w != 0u) {
        /* a subnormal code: its integer value as a float (exact, a normal float), scaled by
           adding to the exponent field: no float32 subnormal appears */
        bits = mg_bits((float)w) + p[13];
    } else {
        bits = 0u;
    }
    return bits | ((c >> p[12]) << 31);
}

#ifndef MG_HOST
extern "C" __global__ void dpr_encode_u16(const u32 *x, u16 *codes, i64 n, MG_DPR_ARGS) {
    MG_DPR_PARAMS;
    MG_EACH(i, n) codes[i] = (u16)mg_dpr_encode(x[i], p);
}
extern "C" __global__ void dpr_encode_u8(const u32 *x, u8 *codes, i64 n, MG_DPR_ARGS) {
    MG_DPR_PARAMS;
    MG_EACH(i, n) codes[i] = (u8)mg_dpr_encode(x[i], p);
}
#endif

/* fp10: three 10-bit codes per word, value i at bits 10 * (i % 3); a last word's free slots 0 */
MG_FN u32 mg_fp10_word(const u32 *x, i64 n, i64 k, const u32 *p) {
    u32 word = 0u;
    for (int j = 0; j < 3; j++) {
        i64 i = 3 * k + j;
        if (i < n) word |= mg_dpr_encode(x[i], p) << (10 * j);
    }
    return word;
}

#ifndef MG_HOST
extern "C" __global__ void dpr_encode_fp10(const u32 *x, u32 *words, i64 n, MG_DPR_ARGS) {
    MG_DPR_PARAMS;
    MG_EACH(k, (n + 2) / 3) words[k] = mg_fp10_word(x, n, k, p);
}
extern "C" __global__ void dpr_decode_u16(const u16 *codes, u32 *out, i64 n, MG_DPR_ARGS) {
    MG_DPR_PARAMS;
    MG_EACH(i, n) out[i] = mg_dpr_decode(codes[i], p);
}
extern "C" __global__ void dpr_decode_u8(const u8 *codes, u32 *out, i64 n, MG_DPR_ARGS) {
    MG_DPR_PARAMS;
    MG_EACH(i, n) out[i] = mg_dpr_decode(codes[i], p);
}
extern "C" __global__ void dpr_decode_fp10(const u32 *words, u32 *out, i64 n, MG_DPR_ARGS) {
    MG_DPR_PARAMS;
    MG_EACH(i, n) out[i] = mg_dpr_decode((words[i / 3] >> (10 * (i % 3))) & 0x3FFu, p);
}
#endif

/* ---- bit packing: the first element in the most significant bits of its byte -------------- */
MG_FN u8 mg_pack_positive(const u32 *x, i64 n, i64 b) {
    u32 byte = 0u;
    for (int j = 0; j < 8; j++) {
        i64 i = 8 * b + j;
        if (i < n && mg_positive(x[i])) byte |= 1u << (7 - j);
    }
    return (u8)byte;
}

MG_FN u8 mg_pack_codes(const u8 *codes, i64 n, i64 b, int bits) {
    int per = 8 / bits;
    u32 byte = 0u;
    for (int j = 0; j < per; j++) {
        i64 i = (i64)per * b + j;
        if (i < n) byte |= ((u32)codes[i] & ((1u << bits) - 1u)) << (8 - bits * (j + 1));
    }
    return (u8)byte;
}

MG_FN u8 mg_unpack_code(const u8 *src, i64 i, int bits) {
    int per = 8 / bits;
    return (u8)((src[i / per] >> (8 - bits * (int)(i % per + 1))) & ((1u << bits) - 1u));
}

/* the fused ReLU -> MaxPool code, packed 4 bits per output: the argmax where the pool output
   is > 0, else the reserved code `reserved` */
MG_FN u8 mg_relu_pool_byte(const u8 *argmax, const u32 *pooled, i64 n, i64 b, u32 reserved) {
    u32 byte = 0u;
    for (int j = 0; j < 2; j++) {
        i64 i = 2 * b + j;
        if (i < n) byte |= (mg_positive(pooled[i]) ? (u32)argmax[i] : reserved) << (4 - 4 * j);
    }
    return (u8)byte;
}

#ifndef MG_HOST
extern "C" __global__ void pack_positive(const u32 *x, u8 *bits, i64 n) {
    MG_EACH(b, (n + 7) / 8) bits[b] = mg_pack_positive(x, n, b);
}
extern "C" __global__ void pack_codes(const u8 *codes, u8 *dst, i64 n, int bits) {
    MG_EACH(b, (n * bits + 7) / 8) dst[b] = mg_pack_codes(codes, n, b, bits);
}
extern "C" __global__ void unpack_codes(const u8 *src, u8 *dst, i64 n, int bits) {
    MG_EACH(i, n) dst[i] = mg_unpack_code(src, i, bits);
}
extern "C" __global__ void relu_pool_pack(const u8 *argmax, const u32 *pooled, u8 *dst, i64 n, u32 reserved) {
    MG_EACH(b, (n + 1) / 2) dst[b] = mg_relu_pool_byte(argmax, pooled, n, b, reserved);
}
#endif

/* ---- SSDC (see the module docstring); rows of 256 elements -------------------------------- */
MG_FN u32 mg_ssdc_value(u32 x, int rounded, const u32 *p) { return rounded ? mg_dpr_encode(x, p) : x; }
MG_FN u32 mg_ssdc_dense(u32 c, int rounded, const u32 *p) { return rounded ? mg_dpr_decode(c, p) : c; }

MG_FN void mg_ssdc_count_row(const u32 *u, i64 n, i64 r, int *counts) {
    i64 end = 256 * r + 256 < n ? 256 * r + 256 : n;
    int count = 0;
    for (i64 i = 256 * r; i < end; i++) count += u[i] != 0u;
    counts[r] = count;
}

/* exclusive prefix sums of counts[0..rows) in place, the total at counts[rows]; returns it */
MG_FN i64 mg_scan(int *counts, i64 rows) {
    i64 running = 0;
    for (i64 r = 0; r < rows; r++) {
        int c = counts[r];
        counts[r] = (int)running;
        running += c;
    }
    counts[rows] = (int)running;
    return running;
}

/* header words: format (1 csr, 2 bitmap, 0 nothing stored: over capacity), nnz */
MG_FN void mg_ssdc_header(u32 *data, i64 nnz, i64 n, i64 capacity, int formats, int *stats, int slot,
                          u32 *last_word) {
    i64 rows = (n + 255) / 256;
    int format;
    if (formats == 3) {  /* SSDC.choose: csr when strictly smaller than the bitmap */
        format = nnz + 4 * (rows + 1) < (n + 7) / 8 ? 1 : 2;
    } else {
        format = formats;
    }
    if (nnz > capacity) {
        format = 0;
        MG_ATOMIC_ADD(&stats[2 * slot + 1], 1);
    }
    data[0] = (u32)format;
    data[1] = (u32)nnz;
    MG_ATOMIC_MAX(&stats[2 * slot], (int)nnz);
    if (format && last_word) *last_word = 0u;   /* fp10 values: the last word's free slots */
}

MG_FN void mg_ssdc_write_row(const u32 *u, i64 n, i64 r, const u32 *data, const int *rowptr, void *values,
                             int value_bytes, u8 *cols, int rounded, const u32 *p) {
    if (data[0] != 1u && data[0] != 2u) return;
    i64 end = 256 * r + 256 < n ? 256 * r + 256 : n;
    i64 slot = rowptr[r];
    for (i64 i = 256 * r; i < end; i++) {
        u32 x = u[i];
        if (x == 0u) continue;
        u32 v = mg_ssdc_value(x, rounded, p);
        if (value_bytes == 4) ((u32 *)values)[slot] = v;
        else if (value_bytes == 2) ((u16 *)values)[slot] = (u16)v;
        else if (value_bytes == 1) ((u8 *)values)[slot] = (u8)v;
        else {  /* fp10: three per word, shared with the neighbouring rows' values */
            u32 *word = (u32 *)values + slot / 3;
            u32 at = 10u * (u32)(slot % 3);
            MG_ATOMIC_AND(word, ~(0x3FFu << at));
            MG_ATOMIC_OR(word, v << at);
        }
        if (data[0] == 1u) cols[slot] = (u8)(i - 256 * r);
        slot++;
    }
}

MG_FN void mg_ssdc_bitmap_byte(const u32 *u, i64 n, i64 b, const u32 *data, u8 *bitmap) {
    if (data[0] != 2u) return;
    u32 byte = 0u;
    for (int j = 0; j < 8; j++) {
        i64 i = 8 * b + j;
        if (i < n && u[i] != 0u) byte |= 1u << (7 - j);
    }
    bitmap[b] = (u8)byte;
}

MG_FN void mg_ssdc_bitmap_row(const u8 *bitmap, i64 n, i64 r, const u32 *data, int *counts) {
    if (data[0] != 2u) return;
    i64 end = 256 * r + 256 < n ? 256 * r + 256 : n;
    int count = 0;
    for (i64 i = 256 * r; i < end; i++) count += (bitmap[i / 8] >> (7 - i % 8)) & 1;
    counts[r] = count;
}

MG_FN u32 mg_ssdc_load(const void *values, int value_bytes, i64 slot) {
    if (value_bytes == 4) return ((const u32 *)values)[slot];
    if (value_bytes == 2) return ((const u16 *)values)[slot];
    if (value_bytes == 1) return ((const u8 *)values)[slot];
    return (((const u32 *)values)[slot / 3] >> (10 * (slot % 3))) & 0x3FFu;
}

MG_FN void mg_ssdc_decode_row(const u32 *data, const int *rowptr, const u8 *cols, const u8 *bitmap,
                              const int *offsets, const void *values, int value_bytes, u32 *out, i64 n,
                              i64 r, int rounded, const u32 *p) {
    i64 start = 256 * r, end = 256 * r + 256 < n ? 256 * r + 256 : n;
    for (i64 i = start; i < end; i++) out[i] = 0u;
    if (data[0] == 1u) {
        for (i64 k = rowptr[r]; k < rowptr[r + 1]; k++)
            out[start + cols[k]] = mg_ssdc_dense(mg_ssdc_load(values, value_bytes, k), rounded, p);
    } else if (data[0] == 2u) {
        i64 slot = offsets[r];
        for (i64 i = start; i < end; i++)
            if ((bitmap[i / 8] >> (7 - i % 8)) & 1)
                out[i] = mg_ssdc_dense(mg_ssdc_load(values, value_bytes, slot++), rounded, p);
    }
}

#ifndef MG_HOST
extern "C" __global__ void ssdc_count_rows(const u32 *u, i64 n, int *counts) {
    MG_EACH(r, (n + 255) / 256) mg_ssdc_count_row(u, n, r, counts);
}
extern "C" __global__ void ssdc_scan(int *counts, i64 n, u32 *data, i64 capacity, int formats, int *stats,
                                     int slot, u32 *last_word_base, int per_word) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    i64 nnz = mg_scan(counts, (n + 255) / 256);
    u32 *last = (per_word == 3 && nnz > 0) ? last_word_base + (nnz - 1) / 3 : (u32 *)0;
    mg_ssdc_header(data, nnz, n, capacity, formats, stats, slot, last);
}
extern "C" __global__ void ssdc_write_values(const u32 *u, i64 n, const u32 *data, const int *rowptr, void *values,
                                             int value_bytes, u8 *cols, int rounded, MG_DPR_ARGS) {
    MG_DPR_PARAMS;
    MG_EACH(r, (n + 255) / 256) mg_ssdc_write_row(u, n, r, data, rowptr, values, value_bytes, cols, rounded, p);
}
extern "C" __global__ void ssdc_write_bitmap(const u32 *u, i64 n, const u32 *data, u8 *bitmap) {
    MG_EACH(b, (n + 7) / 8) mg_ssdc_bitmap_byte(u, n, b, data, bitmap);
}
extern "C" __global__ void ssdc_bitmap_rows(const u8 *bitmap, i64 n, const u32 *data, int *counts) {
    MG_EACH(r, (n + 255) / 256) mg_ssdc_bitmap_row(bitmap, n, r, data, counts);
}
extern "C" __global__ void ssdc_scan_rows(int *counts, i64 n, const u32 *data) {
    if (blockIdx.x != 0 || threadIdx.x != 0 || data[0] != 2u) return;
    mg_scan(counts, (n + 255) / 256);
}
extern "C" __global__ void ssdc_decode_rows(const u32 *data, const int *rowptr, const u8 *cols, const u8 *bitmap,
                                            const int *offsets, const void *values, int value_bytes, u32 *out,
                                            i64 n, int rounded, MG_DPR_ARGS) {
    MG_DPR_PARAMS;
    MG_EACH(r, (n + 255) / 256)
        mg_ssdc_decode_row(data, rowptr, cols, bitmap, offsets, values, value_bytes, out, n, r, rounded, p);
}
#endif

/* ---- MAX pooling (Pooling's xp code, element by element; see minigist/layers/pooling.py) ---- */
MG_FN void mg_max_forward(const float *x, float *y, u8 *argmax, i64 o, int C, int H, int W, int OH, int OW,
                          int kh, int kw, int sh, int sw, int ph, int pw, int clamp) {
    i64 q = o % OW, r = (o / OW) % OH, plane = o / ((i64)OW * OH);
    const float *xs = x + plane * H * W;
    u32 best = 0u, code = 0u;
    for (int k = 0; k < kh * kw; k++) {
        int h = (int)r * sh + k / kw - ph, w = (int)q * sw + k % kw - pw;
        u32 v = (h >= 0 && h < H && w >= 0 && w < W) ? mg_bits(xs[h * W + w]) : 0xFF800000u;   /* -inf */
        if (k == 0) { best = v; continue; }
        if (mg_gt(v, best)) code = (u32)k;
        if (mg_ge(v, best) || mg_is_nan(v)) best = v;     /* numpy's maximum(y, window): NaN propagates */
    }
    if (clamp && best == 0xFF800000u) best = 0xFF7FFFFFu;     /* an empty window: -FLT_MAX, as Caffe */
    y[o] = mg_float(best);
    argmax[o] = (u8)code;
}

/* gx at input element e: the products gy * (argmax == k) of the windows that hold it, added
   in increasing k from +0 (overlapping windows), or stored (disjoint ones; +0 where no window
   reaches) */
MG_FN void mg_max_backward(const u8 *argmax, const float *gy, float *gx, i64 e, int C, int H, int W, int OH,
                           int OW, int kh, int kw, int sh, int sw, int ph, int pw, int disjoint) {
    i64 w = e % W, h = (e / W) % H, plane = e / ((i64)W * H);
    const u8 *am = argmax + plane * OH * OW;
    const float *g = gy + plane * OH * OW;
    float acc = 0.0f;
    for (int k = 0; k < kh * kw; k++) {
        i64 hb = h + ph - k / kw, wb = w + pw - k % kw;
        if (hb < 0 || wb < 0 || hb % sh || wb % sw) continue;
        i64 r = hb / sh, q = wb / sw;
        if (r >= OH || q >= OW) continue;
        u32 gb = mg_bits(g[r * OW + q]);
        float product = mg_float(am[r * OW + q] == k ? gb : mg_times_zero(gb));
        acc = disjoint ? product : MG_ADD(acc, product);
    }
    gx[e] = acc;
}

#ifndef MG_HOST
extern "C" __global__ void max_forward(const float *x, float *y, u8 *argmax, i64 n, int C, int H, int W, int OH,
                                       int OW, int kh, int kw, int sh, int sw, int ph, int pw, int clamp) {
    MG_EACH(o, n) mg_max_forward(x, y, argmax, o, C, H, W, OH, OW, kh, kw, sh, sw, ph, pw, clamp);
}
extern "C" __global__ void max_backward(const u8 *argmax, const float *gy, float *gx, i64 n, int C, int H, int W,
                                        int OH, int OW, int kh, int kw, int sh, int sw, int ph, int pw,
                                        int disjoint) {
    MG_EACH(e, n) mg_max_backward(argmax, gy, gx, e, C, H, W, OH, OW, kh, kw, sh, sw, ph, pw, disjoint);
}
#endif

/* ---- ReLU, BatchNorm, Scale: numpy's ufunc chains, one pass (fused_kernels.py's order) ------ */
MG_FN u32 mg_relu(u32 b) { return (mg_positive(b) || mg_is_nan(b)) ? b : 0u; }
MG_FN u32 mg_masked(u32 g, int keep) { return keep ? g : mg_times_zero(g); }
/* a float16 read as its float32 value (fp16 DPR decode: exact, no subnormal arithmetic) */
MG_FN float mg_half(u16 h) {
    const u32 p[14] = {13u, 0xC8000FFFu, 1u, 0x7C00u, 0x38800000u, 0x8000u, 16u, 126u, 10u, 0x7FFFu, 0x7C00u,
                       0x38000000u, 15u, 0xF4000000u};
    return mg_float(mg_dpr_decode(h, p));
}

#ifndef MG_HOST
extern "C" __global__ void relu_forward(const u32 *x, u32 *y, i64 n) {
    MG_EACH(i, n) y[i] = mg_relu(x[i]);
}
extern "C" __global__ void relu_backward(const u32 *y, const u32 *gy, u32 *gx, i64 n) {
    MG_EACH(i, n) gx[i] = mg_masked(gy[i], mg_positive(y[i]));
}
extern "C" __global__ void mask_backward(const u8 *mask, const u32 *gy, u32 *gx, i64 n) {
    MG_EACH(i, n) gx[i] = mg_masked(gy[i], mask[i] != 0);
}
extern "C" __global__ void bn_center_square(const float *x, const float *mean, float *y, float *square, i64 n,
                                            int C, i64 S) {
    MG_EACH(i, n) {
        float v = MG_SUB(x[i], mean[(i / S) % C]);
        y[i] = v;
        square[i] = MG_MUL(v, v);
    }
}
extern "C" __global__ void scale_channels(float *y, const float *scale, i64 n, int C, i64 S) {
    MG_EACH(i, n) y[i] = MG_MUL(y[i], scale[(i / S) % C]);
}
extern "C" __global__ void bn_input_grad(const float *gy, const void *y, int half, const float *mean_gy_y,
                                         const float *mean_gy, const float *inv_std, float *gx, i64 n, int C, i64 S) {
    MG_EACH(i, n) {
        int c = (int)((i / S) % C);
        float yv = half ? mg_half(((const u16 *)y)[i]) : ((const float *)y)[i];
        float v = MG_SUB(gy[i], MG_MUL(yv, mean_gy_y[c]));
        gx[i] = MG_MUL(MG_SUB(v, mean_gy[c]), inv_std[c]);
    }
}
extern "C" __global__ void product(const float *gy, const void *x, int half, float *out, i64 n) {
    MG_EACH(i, n) out[i] = MG_MUL(gy[i], half ? mg_half(((const u16 *)x)[i]) : ((const float *)x)[i]);
}
extern "C" __global__ void scale_bias(const float *x, const float *scale, const float *bias, float *y, i64 n, int C,
                                      i64 S) {
    MG_EACH(i, n) {
        int c = (int)((i / S) % C);
        y[i] = MG_ADD(MG_MUL(x[i], scale[c]), bias[c]);
    }
}
extern "C" __global__ void scale_grads(const float *gy, const void *x, int half, const float *scale,
                                       float *product, float *gx, i64 n, int C, i64 S) {
    MG_EACH(i, n) {
        float g = gy[i];
        product[i] = MG_MUL(g, half ? mg_half(((const u16 *)x)[i]) : ((const float *)x)[i]);
        gx[i] = MG_MUL(g, scale[(i / S) % C]);
    }
}
#endif

/* ---- Dropout: a counter-based stream (splitmix64 of seed and position), checkpointed as two
   integers; kept where the top 24 bits, as a fraction of 2**24, are >= the ratio ----------- */
MG_FN u64 mg_mix(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
MG_FN int mg_keep(u64 seed, u64 position, u32 threshold) {
    return (u32)(mg_mix(seed + 0x9E3779B97F4A7C15ull * (position + 1ull)) >> 40) >= threshold;
}

#ifndef MG_HOST
extern "C" __global__ void dropout_forward(const u32 *x, u32 *y, u8 *mask, i64 n, u64 seed, u64 counter,
                                           u32 threshold, float scale) {
    MG_EACH(i, n) {
        int keep = mg_keep(seed, counter + (u64)i, threshold);
        mask[i] = (u8)keep;
        y[i] = mg_bits(MG_MUL(mg_float(mg_masked(x[i], keep)), scale));
    }
}
#endif
"""

# every kernel of SOURCE: what tests/test_gpu_kernels.py compiles for sm_90, one by one
KERNELS = ("dpr_encode_u16", "dpr_encode_u8", "dpr_encode_fp10", "dpr_decode_u16", "dpr_decode_u8",
           "dpr_decode_fp10", "pack_positive", "pack_codes", "unpack_codes", "relu_pool_pack",
           "ssdc_count_rows", "ssdc_scan", "ssdc_write_values", "ssdc_write_bitmap", "ssdc_bitmap_rows",
           "ssdc_scan_rows", "ssdc_decode_rows", "max_forward", "max_backward", "relu_forward",
           "relu_backward", "mask_backward", "bn_center_square", "scale_channels", "bn_input_grad", "product",
           "scale_bias", "scale_grads", "dropout_forward")

# NVRTC's options: the worst case for subnormals (CuPy's own kernels flush them), no FMA
# contraction (the explicit intrinsics above never contract; this keeps any other expression
# from it too), IEEE division and square root
OPTIONS = ("--std=c++14", "--ftz=true", "--fmad=false", "--prec-div=true", "--prec-sqrt=true")
