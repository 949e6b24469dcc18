"""Delayed Precision Reduction: a float32 stash kept in a narrower float format (lossy).

Formats (name = the codec's `name`):

| fmt        | sign/exp/mantissa | bias | max finite | storage                                  |
|------------|-------------------|------|------------|------------------------------------------|
| "fp16"     | 1/5/10 (IEEE half)| 15   | 65504      | uint16 per value                         |
| "fp10"     | 1/5/4             | 15   | 63488      | 3 per uint32 word, value i at bits 10*(i%3); top 2 bits 0 |
| "fp8-e5m2" | 1/5/2 (IEEE-like) | 15   | 57344      | uint8 per value (= ml_dtypes.float8_e5m2) |
| "fp8-e4m3" | 1/4/3 (E4M3FN)    | 7    | 448        | uint8 per value (= ml_dtypes.float8_e4m3fn) |

Encoding float32 -> code, exactly as one correctly rounded conversion (no double rounding):

- Rounding: to nearest, ties to even, directly from the float32 value.
- Subnormals: values below the smallest normal of the target are rounded (ties to even) to its
  subnormals (gradual underflow); what rounds below half the smallest subnormal becomes a
  signed zero. Float32 subnormal inputs are handled the same way (they round to +-0).
  A value that rounds up to the smallest normal gets its code.
- Signed zero: +0 and -0 keep their sign, and so do values that round to zero.
- Overflow, fp16 / fp10 / fp8-e5m2: values that round above the max finite (|x| >= max +
  half an ulp at the top binade, ties go to "infinity" as the even neighbour) become +-Inf;
  +-Inf stays +-Inf.
- Overflow, fp8-e4m3 (E4M3FN has no Inf): as ml_dtypes' float32 -> float8_e4m3fn cast, a
  value that rounds above 448 (|x| > 464; 464 itself ties to 448) becomes NaN (S.1111.111,
  sign kept), and so does +-Inf. It does not saturate.
- NaN stays NaN, sign kept: fp16/fp10/fp8-e5m2 write the canonical quiet NaN (exponent all
  ones, top mantissa bit set, payload dropped); fp8-e4m3 writes S.1111.111.

Decoding is exact: every code decodes to its value as float32 (subnormals included; codes of
Inf / NaN give +-Inf / NaN). For every non-NaN code, encode(decode(code)) == code.

Implementation: integer operations on the float32 bit patterns for normals, and the
"magic number" addition (x + 2**k rounds x, ties to even, to a multiple of the target's smallest
subnormal) for the subnormal range (a float32 subnormal x gives the same code whether it is
flushed to zero or not); the two are blended with an all-ones mask, without branches or
`where`. Decode builds every value's float32 bit pattern with integer operations: a normal
code's shifted and rebiased, a subnormal code m's as 2**(1-bias) * (1 + m/2**M) less
2**(1-bias), a subtraction of normal floats with a normal (or zero) result. No float32
subnormal is read or written on either side, so the bytes are the same where the hardware
flushes them to zero (CUDA compiles CuPy's kernels with -ftz=true; CPUs in FTZ/DAZ mode).
Inf/NaN exponents and the sign are OR-ed in afterwards, so no float operation ever sees a NaN
or Inf (no floating-point warnings). Only ufuncs with `out=` into declared workspace, chunked
(`chunk` elements per step, default CHUNK: small enough to stay in a CPU's L2 cache); on a GPU
minigist/gpu/kernels.py runs the same arithmetic as one kernel per tensor.
"""
import numpy as np

from ..gpu import kernels as gpu_kernels
from ..layers.base import TensorDecl
from . import kernels
from .base import Codec
from .bits import check_chunk, chunks, nelements

CHUNK = 3 << 15            # elements per chunk: a multiple of 3 (fp10 words)
U32, I32 = np.uint32, np.int32

# name: (exponent bits, mantissa bits, bias, has Inf, code dtype, values per code unit)
FORMATS = {
    "fp16": (5, 10, 15, True, np.uint16, 1),
    "fp10": (5, 4, 15, True, np.uint32, 3),
    "fp8-e5m2": (5, 2, 15, True, np.uint8, 1),
    "fp8-e4m3": (4, 3, 7, False, np.uint8, 1),
}


def code_units(fmt, n):
    """Number of storage units (uint16 / uint32 word / uint8) for n values."""
    per = FORMATS[fmt][5]
    return (int(n) + per - 1) // per


def value_nbytes(fmt, n):
    """Exact bytes to store n values in `fmt` ("fp32" included)."""
    if fmt == "fp32":
        return 4 * int(n)
    return code_units(fmt, n) * np.dtype(FORMATS[fmt][4]).itemsize


class DPR(Codec):
    """float32 -> fp16 / fp10 / fp8-e5m2 / fp8-e4m3 (see the module docstring); lossy.

    encoded(shape): {"codes": uint16[n]} (fp16), {"codes": uint32[ceil(n/3)]} (fp10),
    {"codes": uint8[n]} (fp8-*). Workspace: encode {"w", "v", "t"}: 3 x uint32[min(n, chunk)];
    decode {"t": uint32[min(n, chunk)]} (+ {"v"} for fp10). chunk: elements per step (default
    CHUNK, a multiple of 3).
    """
    lossless = False

    def __init__(self, fmt, chunk=None):
        self.chunk = check_chunk(CHUNK if chunk is None else chunk, 3, "DPR")
        if fmt not in FORMATS:
            raise ValueError(f"DPR: unknown format {fmt!r} (expected one of {', '.join(FORMATS)})")
        self.fmt = self.name = fmt
        E, M, bias, has_inf, dtype, per = FORMATS[fmt]
        self.E, self.M, self.bias, self.has_inf = E, M, bias, has_inf
        self.code_dtype, self.per = np.dtype(dtype), per
        self.shift = 23 - M                               # float32 mantissa bits dropped
        self.sign_bit = 1 << (E + M)
        self.abs_mask = self.sign_bit - 1
        adj = (127 - bias) << 23                           # exponent rebias, in float32 bits
        # normals: code = (a + half-1 + lsb - adj) >> shift, in uint32 arithmetic (mod 2**32)
        self.round_add = ((1 << (self.shift - 1)) - 1 - adj) % (1 << 32)
        self.min_normal_bits = (128 - bias) << 23          # float32 bits of 2**(1-bias)
        # subnormals: |x| + 2**k rounds to a multiple of 2**(1-bias-M) (float32 ulp at 2**k)
        self.magic = np.float32(2.0 ** (24 - bias - M))
        self.magic_bits = int(np.array(self.magic).view(np.uint32))
        if has_inf:
            self.inf_code = ((1 << E) - 1) << M
            self.clamp = self.inf_code                     # NaN gets its quiet bit below
            self.special = self.inf_code                   # codes >= this are Inf/NaN
        else:                                              # E4M3FN: S.1111.111 is NaN
            self.clamp = self.special = self.abs_mask
        self.rebias = adj
        # the float32 bits of the smallest Inf/NaN code after the shift and rebias in decode
        self.special_bits = (self.special << self.shift) + adj

    # ---- sizes --------------------------------------------------------------------------
    def encoded(self, shape):
        return {"codes": TensorDecl((code_units(self.fmt, nelements(shape)),), self.code_dtype)}

    def workspace(self, shape, phase):
        return self.flat_workspace(nelements(shape), phase)

    def flat_workspace(self, n, phase):
        m = min(int(n), self.chunk)
        if self.per > 1:                                   # fp10: whole words
            m = min(self.chunk, -(-m // 3) * 3)
        if phase == "encode":
            return {k: TensorDecl((m,), np.uint32) for k in ("w", "v", "t")}
        names = ("t", "v") if self.per > 1 else ("t",)
        return {k: TensorDecl((m,), np.uint32) for k in names}

    def decoded_dtype(self, dtype):
        return np.dtype(np.float32)

    # ---- the contract -------------------------------------------------------------------
    def encode(self, xp, x, enc, ws):
        if x.dtype != np.float32:
            raise TypeError(f"DPR({self.fmt}) encodes float32, got {x.dtype}")
        self.encode_flat(xp, x.reshape(-1), enc["codes"], ws)

    def decode(self, xp, enc, out, ws):
        if out.dtype != np.float32:
            raise TypeError(f"DPR({self.fmt}) decodes to float32, got {out.dtype}")
        self.decode_flat(xp, enc["codes"], out.reshape(-1), ws)

    # ---- flat helpers (also used by SSDC for its values) ---------------------------------
    def encode_flat(self, xp, src, codes, ws):
        """Encode the 1-D float32 array src into the first code_units(len(src)) units of codes;
        for fp10 the unused slots of the last word are 0."""
        if gpu_kernels.serves(xp):
            gpu_kernels.dpr_encode(xp, self, src, codes, (self.encode_flat, (src, codes, ws)))
            return
        if kernels.active(xp, src, codes):
            kernels.dpr_encode_flat(src.view(xp.uint32), codes, kernels.dpr_params(self), self.per)
            return
        for c0, c1 in chunks(src.size, self.chunk):
            m = c1 - c0
            v = ws["v"]
            self._encode_core(xp, src[c0:c1].view(xp.uint32), ws["w"][:m], v[:m], ws["t"][:m])
            if self.per == 1:
                xp.copyto(codes[c0:c1], v[:m], casting="unsafe")
            else:
                m3 = -(-m // 3) * 3
                if m3 > m:
                    v[m:m3].fill(0)
                xp.left_shift(v[1:m3:3], U32(10), out=v[1:m3:3])
                xp.left_shift(v[2:m3:3], U32(20), out=v[2:m3:3])
                dst = codes[c0 // 3:c0 // 3 + m3 // 3]
                xp.bitwise_or(v[0:m3:3], v[1:m3:3], out=dst)
                xp.bitwise_or(dst, v[2:m3:3], out=dst)

    def decode_flat(self, xp, codes, out, ws):
        """Decode len(out) values from the start of codes into the 1-D float32 array out."""
        if gpu_kernels.serves(xp):
            gpu_kernels.dpr_decode(xp, self, codes, out, (self.decode_flat, (codes, out, ws)))
            return
        if kernels.active(xp, codes, out):
            kernels.dpr_decode_flat(codes, out.view(xp.uint32), kernels.dpr_params(self), self.per)
            return
        for c0, c1 in chunks(out.size, self.chunk):
            m = c1 - c0
            if self.per == 1:
                src = codes[c0:c1]
            else:
                m3 = -(-m // 3) * 3
                words = codes[c0 // 3:c0 // 3 + m3 // 3]
                v = ws["v"]
                for k in range(3):
                    slot = v[k:m3:3]
                    xp.right_shift(words, U32(10 * k), out=slot)
                    if k < 2:                              # slot 2: the top 2 bits are 0
                        xp.bitwise_and(slot, U32(0x3FF), out=slot)
                src = v[:m]
            self._decode_core(xp, src, out[c0:c1], ws["t"][:m])

    # ---- the arithmetic -----------------------------------------------------------------
    # Scalars are typed like the arrays they meet: numpy 2 runs ufuncs with Python-int scalars
    # (and min/max with any broadcast scalar) on a much slower path.
    def _encode_core(self, xp, u, w, v, t):
        """u: float32 bits (uint32); w, v, t: uint32 scratch of the same length. Leaves the
        codes (sign included) in v."""
        s = U32(self.shift)
        xp.bitwise_and(u, U32(0x7FFFFFFF), out=w)          # a = |x| bits
        # normal range: round to nearest even at bit `shift`, rebias
        xp.right_shift(w, s, out=v)
        xp.bitwise_and(v, U32(1), out=v)                   # lsb of the kept mantissa
        xp.add(v, w, out=v)
        xp.add(v, U32(self.round_add), out=v)
        xp.right_shift(v, s, out=v)
        # overflow / Inf / NaN: clamp to the Inf code (NaN: plus the quiet bit), or for
        # E4M3FN to its NaN code
        if self.has_inf:
            xp.add(w, U32(0x007FFFFF), out=t)              # bit 31 set iff a is a NaN
            xp.right_shift(t, U32(31), out=t)
            xp.left_shift(t, U32(self.M - 1), out=t)
            xp.add(t, U32(self.inf_code), out=t)
        else:
            t.fill(self.clamp)
        xp.minimum(v, t, out=v)
        # subnormal range (a below the bits of the smallest normal): the magic addition
        ti = t.view(xp.int32)
        xp.subtract(I32(self.min_normal_bits - 1), w.view(xp.int32), out=ti)
        xp.right_shift(ti, I32(31), out=ti)                # all ones where a is normal range
        xp.bitwise_and(v, t, out=v)
        xp.bitwise_xor(t, U32(0xFFFFFFFF), out=t)          # all ones in the subnormal range
        xp.bitwise_and(w, t, out=w)                        # elsewhere 0, giving code 0 below
        wf = w.view(xp.float32)
        xp.add(wf, self.magic, out=wf)                     # rounds, ties to even
        xp.subtract(w, U32(self.magic_bits), out=w)
        xp.bitwise_or(v, w, out=v)
        # sign
        xp.right_shift(u, U32(31 - self.E - self.M), out=t)
        xp.bitwise_and(t, U32(self.sign_bit), out=t)
        xp.bitwise_or(v, t, out=v)

    def _decode_core(self, xp, code, out, t):
        """code: codes (uint8/uint16/uint32); out: float32 result; t: uint32 scratch.

        Integer arithmetic on the float32 bit pattern, and one float subtraction whose operands
        and result are normal floats or +0: no float32 subnormal is ever read or written, so a
        device that flushes them (CUDA's -ftz=true, CPUs in FTZ/DAZ mode) decodes the same."""
        ctype = code.dtype.type
        w = out.view(xp.uint32)
        ti = t.view(xp.int32)
        xp.bitwise_and(code, ctype(self.abs_mask), out=w)             # |code|
        xp.subtract(w.view(xp.int32), I32(1 << self.M), out=ti)      # < 0: a subnormal code (or 0)
        xp.right_shift(ti, I32(31), out=ti)                           # all ones there
        xp.bitwise_and(t, U32(1 << 23), out=t)
        xp.left_shift(w, U32(self.shift), out=w)
        xp.add(w, U32(self.rebias), out=w)                            # normals: rebias the exponent
        # a subnormal code m: the bits of 2**(1-bias) * (1 + m / 2**M), the smallest normal's
        # binade, from which 2**(1-bias) is subtracted below (exact: Sterbenz), leaving
        # m * 2**(1-bias-M); elsewhere 0.0 is subtracted, which changes nothing
        xp.bitwise_or(w, t, out=w)
        xp.multiply(t, U32(128 - self.bias), out=t)                   # the bits of 2**(1-bias), or 0
        xp.subtract(out, t.view(xp.float32), out=out)
        # Inf/NaN codes (exponent all ones): float32 exponent all ones, mantissa kept
        xp.subtract(I32(self.special_bits - 1), w.view(xp.int32), out=ti)
        xp.right_shift(ti, I32(31), out=ti)
        xp.bitwise_and(t, U32(0x7F800000), out=t)
        xp.bitwise_or(w, t, out=w)
        xp.right_shift(code, ctype(self.E + self.M), out=t)
        xp.left_shift(t, U32(31), out=t)
        xp.bitwise_or(w, t, out=w)                                    # sign


class HalfStash(DPR):
    """DPR fp16 kept where a layer's backward reads it as it is (Layer.reads_half): the codes
    are IEEE binary16 values, declared as a float16 array of the stash's own shape, which the
    backward takes in place of the float32 tensor. No decode step runs and no decoded float32
    copy is planned; each element reads as its exact float32 value, which is what a decode
    would have written, so the results are the same bytes as with DPR("fp16").

    encode and decode write and read the same bytes as DPR("fp16") (the net's program never
    runs decode; the tests do)."""

    def __init__(self, chunk=None):
        super().__init__("fp16", chunk)

    def encoded(self, shape):
        return {"codes": TensorDecl(tuple(int(d) for d in shape), np.float16)}

    @staticmethod
    def _flat(xp, enc):
        return {"codes": enc["codes"].reshape(-1).view(xp.uint16)}

    def encode(self, xp, x, enc, ws):
        super().encode(xp, x, self._flat(xp, enc), ws)

    def decode(self, xp, enc, out, ws):
        super().decode(xp, self._flat(xp, enc), out, ws)

    def scale_encode_slice(self, xp, x, scale, enc, n0, n1, scratch):
        """x (samples n0:n1 of the stash, channels on axis 1) *= scale[c], and those samples'
        codes, in one pass where the kernels run (the last step a layer hands over:
        Layer.emits_top_slices), else the product and then encode_slice."""
        x3 = x.reshape(x.shape[0], x.shape[1], -1)
        codes = enc["codes"][n0:n1].reshape(x3.shape).view(xp.uint16)
        if kernels.active(xp, x3, scale, codes):
            kernels.scale_channels_encode(x3, scale, codes, kernels.dpr_params(self))
            return
        xp.multiply(x3, scale[:, None], out=x3)
        self.encode_slice(xp, x, enc, n0, n1, scratch)

    def encode_slice(self, xp, x, enc, n0, n1, scratch):
        """Encode x, samples n0:n1 of the stash, into those samples' codes, with `scratch`
        (float32, x's size) as the workspace: how a layer that emits its top slice by slice
        (Layer.emits_top_slices) has it encoded while the slice is in cache."""
        src = x.reshape(-1)
        codes = enc["codes"][n0:n1].reshape(-1).view(xp.uint16)
        if kernels.active(xp, src, codes):     # the compiled encode needs no scratch
            self.encode_flat(xp, src, codes, {})
            return
        words = scratch.reshape(-1).view(xp.uint32)
        piece = max(1, min(self.chunk, words.size // 3))    # the w, v, t scratch of one piece
        ws = {name: words[k * piece:(k + 1) * piece] for k, name in enumerate(("w", "v", "t"))}
        for start in range(0, src.size, piece):
            self.encode_flat(xp, src[start:start + piece], codes[start:start + piece], ws)
