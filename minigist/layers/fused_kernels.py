"""Compiled CPU kernels (numba; see minigist/jit.py for the switch) that do in one pass over
memory what BatchNorm, Scale and ReLU do as a chain of numpy ufuncs, each ufunc a pass of its
own, and the convolution's layout copies between NCHW and its GEMM's (O, b, OH, Wc), which
numpy runs as transposed copies with 8-32 float inner loops. Every element goes through the same float operations in the same order as in the ufunc
chain (no fused multiply-add: numba leaves LLVM's default, which does not contract), so the
results are the same bytes (tests/test_fused_kernels.py); the per-channel sums stay with
BLAS in both paths. Arrays are C-contiguous: (N, C, S) for the per-channel ones, any shape
(taken flat) for ReLU.

Each kernel has a loop for an output apart from its input and one for the output written
over the input (`same`; the layers run in place): LLVM vectorises a loop only when it can
rule out overlap at run time, and an output that is its input always overlaps, so a single
loop would run scalar exactly in the in-place case, the common one.

BatchNorm's and Scale's backward kernels also take the stashed x_hat as IEEE binary16 bits (a
uint16 view of the float16 array Gist hands them: its fp16 stash, read without a decoded
float32 copy; numba has no float16 type). Each value is widened to its exact float32 value
(`half_to_float`, numpy's float16 -> float32 cast bit for bit for every code DPR writes), so
the results are the bytes the same kernels give on the decoded copy.
"""
import numpy as np

from .. import jit
from ..jit import numba


def same_memory(a, b):
    """Whether b is a written over in place (the same first byte): the kernels' `same`."""
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0]


if numba is not None:
    from numba.extending import overload

    _jit = numba.njit(cache=True, nogil=True, boundscheck=False)
    _U32 = np.uint32

    @_jit
    def half_bits_to_float(h):
        """The float32 value of the binary16 bits h in integer arithmetic, exactly as numpy
        casts float16 to float32: Inf and NaN keep their sign and payload, subnormals become
        normals."""
        w = _U32(h)
        a = w & _U32(0x7FFF)
        special = _U32(0x7F800000) | ((a & _U32(0x3FF)) << _U32(13))
        normal = (a << _U32(13)) + _U32(112 << 23)           # exponent rebias 15 -> 127
        # a subnormal (or zero) is a * 2**-24, exact in float32
        small = np.float32(np.float32(a) * np.float32(2.0 ** -24)).view(np.uint32)
        bits = _U32(special if a >= _U32(0x7C00) else (normal if a >= _U32(0x400) else small))
        return _U32(bits | ((w & _U32(0x8000)) << _U32(16))).view(np.float32)

    @_jit
    def half_f16c_to_float(h):
        """half_bits_to_float through F16C's conversion, which vectorises, for the codes DPR
        fp16 writes: every one but a signalling NaN, which DPR never writes
        (jit.float_bits_of_dpr_half). BatchNorm's backward product on AVX2, in cache: 1.9-2.8x
        as fast as with the select that kept such a NaN signalling."""
        return _U32(jit.float_bits_of_dpr_half(h)).view(np.float32)

    half_to_float = half_f16c_to_float if jit.HALF else half_bits_to_float

    def widen(v):
        """v as float32: itself, or binary16 bits (uint16) widened by half_to_float."""

    @overload(widen)
    def _widen(v):
        if isinstance(v, numba.types.Float):
            return lambda v: v
        if v == numba.types.uint16:
            return lambda v: half_to_float(v)

    @_jit
    def product(gy, y, out):
        """out = gy * y, y float32 or binary16 bits (BatchNorm backward's gy * x_hat). Flat
        arrays."""
        for i in range(gy.size):
            out[i] = gy[i] * widen(y[i])

    @_jit
    def center_square(x, mean, y, square, same):
        """y = x - mean[c]; square = y * y (BatchNorm forward); `same`: y is x."""
        n, c, s = x.shape
        for a in range(n):
            for ch in range(c):
                m = mean[ch]
                if same:
                    for i in range(s):
                        v = x[a, ch, i] - m
                        x[a, ch, i] = v
                        square[a, ch, i] = v * v
                else:
                    for i in range(s):
                        v = x[a, ch, i] - m
                        y[a, ch, i] = v
                        square[a, ch, i] = v * v

    @_jit
    def scale_channels(y, inv_std):
        """y *= inv_std[c] (BatchNorm forward's last pass), the products numpy's multiply
        gives, in one compiled pass over (n, c, s)."""
        n, c, s = y.shape
        for a in range(n):
            for ch in range(c):
                r = inv_std[ch]
                for i in range(s):
                    y[a, ch, i] = y[a, ch, i] * r

    @_jit
    def batchnorm_input_grad(gy, y, mean_gy_y, mean_gy, inv_std, gx, same):
        """gx = ((gy - y * mean_gy_y[c]) - mean_gy[c]) * inv_std[c], y float32 or binary16
        bits; `same`: gx is gy."""
        n, c, s = gy.shape
        for a in range(n):
            for ch in range(c):
                p, q, r = mean_gy_y[ch], mean_gy[ch], inv_std[ch]
                if same:
                    for i in range(s):
                        gy[a, ch, i] = ((gy[a, ch, i] - widen(y[a, ch, i]) * p) - q) * r
                else:
                    for i in range(s):
                        gx[a, ch, i] = ((gy[a, ch, i] - widen(y[a, ch, i]) * p) - q) * r

    @_jit
    def scale_bias(x, scale, bias, y, same):
        """y = x * scale[c] + bias[c], rounded after the product as two ufuncs do; `same`:
        y is x."""
        n, c, s = x.shape
        for a in range(n):
            for ch in range(c):
                w, b = scale[ch], bias[ch]
                if same:
                    for i in range(s):
                        t = x[a, ch, i] * w
                        x[a, ch, i] = t + b
                else:
                    for i in range(s):
                        t = x[a, ch, i] * w
                        y[a, ch, i] = t + b

    @_jit
    def scale_grads(gy, x, scale, product, gx, same):
        """product = gy * x (for the scale's gradient), x float32 or binary16 bits;
        gx = gy * scale[c]; `same`: gx is gy."""
        n, c, s = gy.shape
        for a in range(n):
            for ch in range(c):
                w = scale[ch]
                if same:
                    for i in range(s):
                        g = gy[a, ch, i]
                        product[a, ch, i] = g * widen(x[a, ch, i])
                        gy[a, ch, i] = g * w
                else:
                    for i in range(s):
                        g = gy[a, ch, i]
                        product[a, ch, i] = g * widen(x[a, ch, i])
                        gx[a, ch, i] = g * w

    @_jit
    def relu(x, y, nil, same):
        """y = max(x, 0) as numpy's maximum(x, 0) gives it: x where x > 0 or x is NaN (its
        payload kept), else +0 (so -0 becomes +0). Flat arrays; `same`: y is x, and only
        the elements that change are written."""
        if same:
            for i in range(x.size):
                if not (x[i] > 0 or x[i] != x[i]):
                    x[i] = nil
        else:
            for i in range(x.size):
                v = x[i]
                y[i] = v if (v > 0 or v != v) else nil

    @_jit
    def relu_in_place_bits(u):
        """relu(x, x, +0, True) on float32 x's bit patterns u (uint32): the same bytes, each
        element stored as an integer AND (all ones, or zero for a negative non-NaN), which
        LLVM cannot turn into a masked store: for CPUs without cheap ones (jit.MASKED_STORES),
        where the select ran 4x slower than this."""
        for i in range(u.size):
            b = np.int64(u[i])
            negative = b >> 31
            nan = ((np.int64(0x7F800000) - (b & 0x7FFFFFFF)) >> 63) & 1     # |x| above Inf's bits
            u[i] = np.uint32(b & ((negative & (1 - nan)) - 1))

    @_jit
    def relu_grad(y, gy, gx, one, nil, same):
        """gx = gy * (y > 0), the mask as the ufunc path multiplies it (1 or 0 in gy's
        dtype). Flat arrays; `same`: gx is gy."""
        if same:
            for i in range(y.size):
                gy[i] = gy[i] * (one if y[i] > 0 else nil)
        else:
            for i in range(y.size):
                gx[i] = gy[i] * (one if y[i] > 0 else nil)

    @_jit
    def unfold(fold, y, bias, add_bias):
        """y (b, O, OH, OW) = fold (O, b, OH, Wc)[..., :OW] (+ bias[o]): Convolution's GEMM
        output back to NCHW, the wide columns dropped. numpy's transposed, broadcast add does
        this 4-6x slower: its inner loops are the 8-32 float rows."""
        o, b, oh, wc = fold.shape
        ow = y.shape[3]
        for n in range(b):
            for ch in range(o):
                if add_bias:
                    w = bias[ch]
                    for r in range(oh):
                        for q in range(ow):
                            y[n, ch, r, q] = fold[ch, n, r, q] + w
                else:
                    for r in range(oh):
                        for q in range(ow):
                            y[n, ch, r, q] = fold[ch, n, r, q]

    @_jit
    def fold(gy, view):
        """view (O, b, OH, Wc)[..., :OW] = gy (b, O, OH, OW): the inverse of unfold (the
        wide columns are left as they are)."""
        b, o, oh, ow = gy.shape
        for ch in range(o):
            for n in range(b):
                for r in range(oh):
                    for q in range(ow):
                        view[ch, n, r, q] = gy[n, ch, r, q]
