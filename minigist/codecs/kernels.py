"""Optional compiled CPU kernels for the DPR and SSDC codecs (numba), one pass per tensor.

The codecs' reference path is `xp` ufuncs (numpy or cupy): about twenty passes over a chunk for
a DPR encode, 1.3 ns per element on this project's CPUs (numpy's own float16 cast is no
faster), and a dozen more for SSDC's bitmap, compaction and rounding. On a ResNet-20 step that
was 30-40 ms of 110-150. These kernels do the same integer arithmetic element by element in
one compiled loop that LLVM vectorises, and use the CPU's instructions where it has them: F16C
for fp16 (HALF), AVX-512's compress and expand for SSDC's bitmap and csr formats (VECTOR).
`python bench/codec_kernels.py` times each codec both ways (fp16 encode about 20x, the
others 3-7x). SSDC's non-zeros are still counted first, in a pass of their own (a kernel 3x
as fast as numpy's count_nonzero on 32-bit words), so that an over-capacity tensor is refused
before anything is written.

They write exactly the bytes the ufunc path writes (tests/test_kernels.py compares the two
bit for bit, specials included, with and without HALF / VECTOR; tests/test_codecs.py runs on
both paths), so footprints, plans and results do not depend on which path ran; the planned
workspaces are declared either way (the kernels leave them unused). One exception: with the
CPU's flush-to-zero / denormals-are-zero modes on (torch.set_flush_denormal(True), say), the
ufunc DPR decode turns the target format's subnormals into 0 (it computes them as float32
denormals, see minigist/codecs/dpr.py), while the kernels decode them exactly. A decode checks
the encoding against its header first (the bitmap's set bits, or csr's row pointers), since
the kernels read one value per non-zero without bounds checks.

They run when numba is importable (`pip install minigist[fast]`), `xp` is numpy and the arrays
are contiguous; otherwise the codecs take the ufunc path. MINIGIST_KERNELS=numpy in the
environment, or `use_kernels(False)`, forces the ufunc path (the benchmarks time both).
Compiled code is cached next to this file (numba's `cache=True`), so only the first run on a
machine pays the compile time (about 4 s for a train.py run under --gist all; later runs
load them from the cache, numba's import adds about 0.4 s).

The bit-packing codecs (mask-1bit, index-{1,2,4}bit, and relu-pool-4bit, whose codes are
selected in one loop before they are packed) pack and unpack in one loop too. SSDC with fp10
values (3 per word) stays on the ufunc path.
The kernels run on one thread by default: with the im2col convolutions the codecs run between
BLAS calls, and OpenBLAS's threads keep spinning for a while after each; split over two threads
(numba's prange, with the OpenMP and the workqueue layers) they made a ResNet-20 step under
all + fp16 slower, 1.2x to 4.4x of no Gist instead of 1.13x. With `--conv onednn` numpy's BLAS
runs on one thread and the convolutions on oneDNN's OpenMP threads, which numba's OpenMP layer
shares: there Net sets `threads` to oneDNN's thread count during its steps, and the DPR (one
code per word) and SSDC bitmap kernels split a tensor of at least 2 * PARALLEL_MIN elements
into parts of whole 256-element blocks, one per thread, which write the bytes one thread
writes (an SSDC part's values start at the non-zeros before it, counted per part first). A
2 MiB ReLU map's SSDC-fp16 encode, count included, takes 0.054 ms on two threads against
0.086 on one, its decode 0.053 against 0.077 (in cache, AVX-512; with the memory forms of
compress and expand, 16 lanes at a time: 0.069 / 0.119 and 0.060 / 0.096). In six
alternating runs of ResNet-20's step under all + fp16 (as a ratio to no Gist, before the
counting kernel), two threads won four (1.064-1.093 against 1.113-1.131) and lost two
(1.199 against 1.154 in the machine's slow state, 1.093 against 1.053); Inception-small's
three went to 1.045-1.061 from 1.062-1.069 (bench/README, session 6).
"""
import contextlib

import numpy as np

from .. import jit
from ..backend import scoped
from ..jit import _host_has, available, numba, set_kernels, use_kernels  # noqa: F401

_codecs_on = True


def active(xp, *arrays):
    """Whether the codec kernels serve this call: minigist's kernels are (jit.active) and the
    codecs' own switch (use_codec_kernels) is on."""
    return _codecs_on and jit.active(xp, *arrays)


@contextlib.contextmanager
def use_codec_kernels(on):
    """Switch the codecs' kernels alone (not pooling's) on or off inside the block: the
    benchmarks time Gist's codecs on their ufunc path this way."""
    global _codecs_on
    previous, _codecs_on = _codecs_on, bool(on)
    try:
        yield
    finally:
        _codecs_on = previous


def describe(xp=np):
    """One line on which path the codecs take with this xp."""
    if not active(xp):
        return f"ufunc path ({jit.off_reason(xp)})"
    extras = [name for name, on in (("F16C fp16", _half), ("AVX-512 compress/expand", _vector),
                                    ("SSSE3 shuffle compress/expand", _shuffle and not _vector),
                                    ("AVX2 permute for fp32", _shuffle and PERMUTE and not _vector)) if on]
    return f"numba {numba.__version__} kernels" + (f" ({', '.join(extras)})" if extras else "")


_params = {}


def dpr_params(dpr):
    """The integers a DPR kernel needs, as one tuple (see minigist.codecs.dpr); made once per
    format and F16C setting, since the codecs ask on every call."""
    key = (dpr.fmt, _half)
    if key not in _params:
        _params[key] = _dpr_params(dpr)
    return _params[key]


def _dpr_params(dpr):
    return (dpr.shift, dpr.round_add, int(dpr.has_inf), dpr.clamp if not dpr.has_inf else dpr.inf_code,
            dpr.min_normal_bits, dpr.sign_bit, 31 - dpr.E - dpr.M, 151 - dpr.bias - dpr.M, dpr.M,
            dpr.abs_mask, dpr.special, (127 - dpr.bias) << 23, dpr.E + dpr.M,
            ((1 - dpr.bias - dpr.M) << 23) % (1 << 32), int(_half and dpr.fmt == "fp16"))


FP32_PARAMS = (0,) * 15    # values kept as float32 bits (SSDC "fp32"): the kernels copy them

# The CPU's features, as numba compiles for them (a generic target, NUMBA_CPU_NAME=generic, has
# none): the compress/expand kernels need AVX-512 F, BW, VL and VBMI2 (set_vector(False)
# selects the scalar ones; the tests run both); fp16 goes through F16C's conversions where it
# has them.
VECTOR = _host_has("avx512f", "avx512bw", "avx512vl", "avx512vbmi2")
_vector = VECTOR
HALF = jit.HALF
_half = HALF
# Without AVX-512 the bitmap format's kernels compress and expand with SSSE3's byte shuffle
# (set_shuffle(False) selects the scalar ones); where VECTOR holds, the AVX-512 ones serve.
SHUFFLE = _host_has("ssse3")
_shuffle = SHUFFLE
# There, fp32 values (SSDC's lossless form) move 8 at a time with AVX2's lane permute (vpermd).
PERMUTE = _host_has("avx2")


def _shuffle_tables(itemsize):
    """pshufb's control bytes per bitmap pattern of a group (8 values of 1 or 2 bytes, 4 of
    4: 16 bytes or fewer), flattened: (compress, expand), row m at 16 * m. Pattern bit
    group - 1 - j is lane j (numpy.packbits order); 0x80 writes a zero byte."""
    group = 4 if itemsize == 4 else 8
    compress = np.full((1 << group, 16), 0x80, np.uint8)
    expand = np.full((1 << group, 16), 0x80, np.uint8)
    for m in range(1 << group):
        lanes = [j for j in range(group) if (m >> (group - 1 - j)) & 1]
        for k, j in enumerate(lanes):
            for b in range(itemsize):
                compress[m, k * itemsize + b] = j * itemsize + b
                expand[m, j * itemsize + b] = k * itemsize + b
    return compress.ravel(), expand.ravel()


_SHUFFLE_TABLES = {itemsize: _shuffle_tables(itemsize) for itemsize in (1, 2, 4)}


if numba is not None:
    from llvmlite import ir as _ir
    from numba.core import cgutils as _cgutils
    from numba.extending import intrinsic as _intrinsic
    _jit = numba.njit(cache=True, nogil=True, boundscheck=False)
    _U32 = np.uint32

    # fp16 through the CPU's own conversion where it has F16C (minigist.jit.HALF): 5x faster
    # than the integer arithmetic below for encode, 2.6x for decode. Round to nearest even,
    # subnormals, overflow to Inf and signed zeros are IEEE's, as in the integer path; NaNs are
    # fixed up to the integer path's codes (the hardware keeps payloads: encode writes the
    # canonical quiet NaN instead). Decode is the conversion alone, exact for every code
    # encode writes (no signalling NaN among them).
    _dpr_half_code, _float_bits_of_dpr_half = jit.dpr_half_code, jit.float_bits_of_dpr_half

    @_jit
    def _encode_one(x, p):
        """float32 bits x -> DPR code (as uint32), exactly as DPR._encode_core."""
        if p[14]:                         # fp16 on F16C
            return _dpr_half_code(x)
        shift, round_add, has_inf, top = _U32(p[0]), _U32(p[1]), p[2], _U32(p[3])
        min_normal, sign_bit, sign_shift = _U32(p[4]), _U32(p[5]), _U32(p[6])
        a = x & _U32(0x7FFFFFFF)
        # normal range: round to nearest even at bit `shift`, rebias (uint32 wrap-around)
        v = _U32(a + ((a >> shift) & _U32(1)) + round_add) >> shift
        if has_inf:                       # overflow -> Inf, NaN -> quiet NaN
            t = top + ((_U32(a + _U32(0x7FFFFF)) >> _U32(31)) << _U32(p[8] - 1))
        else:                             # E4M3FN: overflow and NaN -> S.1111.111
            t = top
        v = min(v, t)
        # below the smallest normal: the significand shifted right by r, ties to even
        e = np.int32(a >> _U32(23))
        m = (a & _U32(0x7FFFFF)) | (_U32(0x800000) if e > 0 else _U32(0))
        r = _U32(max(min(np.int32(p[7]) - e, np.int32(31)), np.int32(1)))
        sub = _U32(m + (_U32(1) << (r - _U32(1))) - _U32(1) + ((m >> r) & _U32(1))) >> r
        v = v if a >= min_normal else sub
        return v | ((x >> sign_shift) & sign_bit)

    @_jit
    def _decode_one(c, p):
        """DPR code c -> float32 bits, exactly as DPR._decode_core."""
        if p[14]:                         # fp16 on F16C
            return _float_bits_of_dpr_half(c)
        shift, abs_mask, special, adj = _U32(p[0]), _U32(p[9]), _U32(p[10]), _U32(p[11])
        mantissa_bits = _U32(p[8])
        w = _U32(c) & abs_mask
        # all three forms computed, one selected: no branches, so the loop vectorises
        special_bits = _U32(0x7F800000) | ((w & ((_U32(1) << mantissa_bits) - _U32(1))) << shift)
        normal_bits = _U32((w << shift) + adj)
        # subnormal: float32(w) is exact, scaled by 2**(1 - bias - M) in its exponent field
        sub_bits = _U32(np.float32(w).view(np.uint32) + _U32(p[13]))
        sub_bits = sub_bits if w != _U32(0) else _U32(0)
        bits = normal_bits if w >= (_U32(1) << mantissa_bits) else sub_bits
        bits = special_bits if w >= special else bits
        return bits | ((_U32(c) >> _U32(p[12])) << _U32(31))

    @_jit
    def scale_channels_encode(y, scale, codes, p):
        """y (n, c, s) *= scale[c], the products numpy's multiply gives, and codes (uint16, y's
        shape) <- their fp16 DPR codes, in one pass: a layer's last step handed to the codec
        (Layer.emits_top_slices), so that the stash costs no second pass over the tensor."""
        n, c, s = y.shape
        for a in range(n):
            for ch in range(c):
                r = scale[ch]
                for i in range(s):
                    v = y[a, ch, i] * r
                    y[a, ch, i] = v
                    codes[a, ch, i] = np.uint16(_encode_one(np.float32(v).view(np.uint32), p))

    @_jit
    def dpr_encode(u, codes, p, per):
        """float32 bits u -> codes (per = 1: one code per unit; 3: fp10, three per word)."""
        if per == 1:
            for i in range(u.size):
                codes[i] = _encode_one(u[i], p)
            return
        n = u.size
        full = n // 3
        for k in range(full):
            codes[k] = (_encode_one(u[3 * k], p) | (_encode_one(u[3 * k + 1], p) << _U32(10))
                        | (_encode_one(u[3 * k + 2], p) << _U32(20)))
        if n > 3 * full:
            word = _U32(0)
            for j in range(n - 3 * full):
                word |= _encode_one(u[3 * full + j], p) << _U32(10 * j)
            codes[full] = word

    @_jit
    def dpr_decode(codes, out_u, p, per):
        """codes -> float32 bits out_u (len(out_u) values)."""
        if per == 1:
            for i in range(out_u.size):
                out_u[i] = _decode_one(codes[i], p)
            return
        n = out_u.size
        full = n // 3
        for k in range(full):
            word = codes[k]
            out_u[3 * k] = _decode_one(word & _U32(0x3FF), p)
            out_u[3 * k + 1] = _decode_one((word >> _U32(10)) & _U32(0x3FF), p)
            out_u[3 * k + 2] = _decode_one(word >> _U32(20), p)
        for j in range(n - 3 * full):
            out_u[3 * full + j] = _decode_one((codes[full] >> _U32(10 * j)) & _U32(0x3FF), p)

    @_jit
    def _value(x, p, rounded):
        return _encode_one(x, p) if rounded else x

    @_jit
    def _dense(c, p, rounded):
        return _decode_one(c, p) if rounded else _U32(c)

    # The SSDC kernels go through a tensor in blocks of BLOCK elements; the loops over a block
    # have a constant trip count, which is what lets LLVM vectorise the value and flag loops
    # (with a variable count the kernels ran 2-3 times slower). The last, partial block goes
    # element by element.
    BLOCK = 64

    @_jit
    def _ssdc_encode_bitmap(u, bitmap, values, off, end, p, rounded):
        """SSDC's bitmap format in one pass: bit i of `bitmap` (numpy.packbits order) says
        u[i] != 0, and the non-zeros go, in order, to `values` (float32 bits, or DPR codes
        when `rounded`) from values[off] on; `end` is where the values of the next part of
        the tensor start (the caller counted the non-zeros). Returns the new off.

        Within a block each code is written at the next free slot and the slot advances only
        for a non-zero, so a zero's code lands where the next non-zero goes (no branches);
        near `end` only the non-zeros are written."""
        n = u.size
        codes = np.empty(BLOCK, np.uint32)
        nonzero = np.empty(BLOCK, np.uint8)
        for block in range(n // BLOCK):
            base = block * BLOCK
            for j in range(BLOCK):
                x = u[base + j]
                codes[j] = _value(x, p, rounded)
                nonzero[j] = x != _U32(0)
            for b in range(BLOCK // 8):
                byte = _U32(0)
                for j in range(8):
                    byte |= _U32(nonzero[8 * b + j]) << _U32(7 - j)
                bitmap[base // 8 + b] = byte
            if off + BLOCK <= end:
                for j in range(BLOCK):
                    values[off] = codes[j]
                    off += nonzero[j]
            else:
                for j in range(BLOCK):
                    if nonzero[j]:
                        values[off] = codes[j]
                        off += 1
        tail = n - n % BLOCK
        for b in range(tail // 8, (n + 7) // 8):
            byte = _U32(0)
            for j in range(min(8, n - 8 * b)):
                x = u[8 * b + j]
                if x != _U32(0):
                    byte |= _U32(1) << _U32(7 - j)
                    values[off] = _value(x, p, rounded)
                    off += 1
            bitmap[b] = byte
        return off

    @_jit
    def _ssdc_encode_csr(u, rowptr, cols, values, off, end, p, rounded):
        """SSDC's csr format in one pass: rows of 256 elements, per non-zero its column (uint8)
        and value, rowptr[r + 1] = off + non-zeros in rows 0..r (rowptr[0] is the caller's).
        Values and columns are written as _ssdc_encode_bitmap writes its values."""
        n = u.size
        codes = np.empty(BLOCK, np.uint32)
        nonzero = np.empty(BLOCK, np.uint8)
        for block in range(n // BLOCK):
            base = block * BLOCK
            col0 = base % 256
            for j in range(BLOCK):
                x = u[base + j]
                codes[j] = _value(x, p, rounded)
                nonzero[j] = x != _U32(0)
            if off + BLOCK <= end:
                for j in range(BLOCK):
                    values[off] = codes[j]
                    cols[off] = col0 + j
                    off += nonzero[j]
            else:
                for j in range(BLOCK):
                    if nonzero[j]:
                        values[off] = codes[j]
                        cols[off] = col0 + j
                        off += 1
            if (base + BLOCK) % 256 == 0:
                rowptr[(base + BLOCK) // 256] = off
        for i in range(n - n % BLOCK, n):
            x = u[i]
            if x != _U32(0):
                values[off] = _value(x, p, rounded)
                cols[off] = i % 256
                off += 1
        if n % 256:
            rowptr[(n + 255) // 256] = off
        return off

    @_jit
    def _ssdc_decode_bitmap(bitmap, values, off, out_u, p, rounded):
        """Inverse of _ssdc_encode_bitmap into the float32 bits out_u, from values[off] on."""
        n = out_u.size
        codes = np.zeros(BLOCK, values.dtype)
        nonzero = np.empty(BLOCK, np.uint8)
        last_slot = values.size - 1
        for block in range(n // BLOCK):
            base = block * BLOCK
            for j in range(BLOCK):
                nonzero[j] = (bitmap[base // 8 + j // 8] >> (7 - j % 8)) & 1
            for j in range(BLOCK):        # gather: the slot advances past each non-zero
                codes[j] = values[min(off, last_slot)]
                off += nonzero[j]
            for j in range(BLOCK):
                v = _dense(codes[j], p, rounded)
                out_u[base + j] = v if nonzero[j] else _U32(0)
        for i in range(n - n % BLOCK, n):
            if (bitmap[i // 8] >> (7 - i % 8)) & 1:
                out_u[i] = _dense(values[off], p, rounded)
                off += 1
            else:
                out_u[i] = 0

    @_intrinsic
    def _set_bits64(typingctx, bytes_, index):
        """The set bits of the 8 bytes bytes_[index:index + 8] (one load and popcnt)."""
        def codegen(context, builder, signature, args):
            word = _ir.IntType(64)
            at = context.cast(builder, args[1], signature.args[1], numba.types.intp)
            value = builder.load(_pointer(context, builder, signature.args[0], args[0], at, word), align=1)
            fn = _cgutils.get_or_insert_function(builder.module, _ir.FunctionType(word, [word]), "llvm.ctpop.i64")
            return builder.call(fn, [value])
        return numba.types.int64(bytes_, index), codegen

    @_jit
    def _bitmap_count(bitmap, n):
        """Set bits among the first n of the bitmap (numpy.packbits order): 8 bytes per popcnt
        (a byte at a time took 15 us for a 2 MiB map's bitmap on AVX2)."""
        count = 0
        for w in range(n // 64):
            count += _set_bits64(bitmap, 8 * w)
        for b in range(n // 64 * 8, n // 8):
            count += _popcount(_U64(bitmap[b]))
        for j in range(n % 8):
            count += (bitmap[n // 8] >> (7 - j)) & 1
        return count

    @_jit
    def _rowptr_ok(rowptr, nnz):
        """Whether the row pointers go from 0 to nnz without stepping back."""
        if rowptr[0] != 0 or rowptr[rowptr.size - 1] != nnz:
            return False
        for r in range(rowptr.size - 1):
            if rowptr[r + 1] < rowptr[r]:
                return False
        return True

    @_jit
    def _ssdc_decode_csr(rowptr, cols, values, out_u, p, rounded):
        """Inverse of _ssdc_encode_csr into the float32 bits out_u (rows of rowptr's slice)."""
        out_u[:] = 0
        for r in range(rowptr.size - 1):
            for k in range(rowptr[r], rowptr[r + 1]):
                out_u[256 * r + cols[k]] = _dense(values[k], p, rounded)


    # ---- SSDC with AVX-512 compress / expand ------------------------------------------------
    # AVX-512's compress moves the flagged lanes of a vector to its low lanes, in order; expand
    # spreads consecutive values to the flagged lanes (VBMI2 for 8- and 16-bit lanes). The
    # kernels below take a whole 512-bit vector of values per instruction (16 fp32 values, 32
    # fp16, 64 fp8: `lanes`, from the values' dtype) and use the register forms, then store or
    # load the whole vector: on AMD's Zen cores the memory forms (LLVM's masked.compressstore /
    # expandload) are microcoded and made a 2 MiB map's fp16 encode 1.6x and its decode 1.4x
    # as slow. A compressed vector is stored whole, so its lanes past the non-zeros land where
    # the next vector's go; only near `end` (the next part's first value, or the capacity) do
    # the memory forms write exactly the non-zeros. Elsewhere than on AVX-512 LLVM would expand
    # these into scalar code, so they are used only where the host has those instructions
    # (VECTOR, below).

    def _vector_type(context, array_type, like_type):
        """The <lanes x array dtype> vector for values of like_type's dtype (512 bits of them)."""
        lanes = 512 // like_type.dtype.bitwidth
        return _ir.VectorType(context.get_data_type(array_type.dtype), lanes), lanes

    def _pointer(context, builder, array_type, array, index, vector):
        data = context.make_array(array_type)(context, builder, array).data
        return builder.bitcast(builder.gep(data, [index]), vector.as_pointer())

    def _lane_mask(builder, mask, lanes):
        return builder.bitcast(builder.trunc(mask, _ir.IntType(lanes)), _ir.VectorType(_ir.IntType(1), lanes))

    def _x86(builder, name, vector, lanes, value, mask):
        """AVX-512's register-form compress or expand of value (zeros in the other lanes)."""
        fn = _cgutils.get_or_insert_function(
            builder.module, _ir.FunctionType(vector, [vector, vector, mask.type]),
            f"llvm.x86.avx512.mask.{name}.v{lanes}i{vector.element.width}")
        return builder.call(fn, [value, _ir.Constant(vector, None), mask])

    @_intrinsic
    def _lanes_of(typingctx, like):
        """The lanes of one vector of like's values (a constant)."""
        def codegen(context, builder, signature, args):
            return context.get_constant(numba.types.intp, 512 // signature.args[0].dtype.bitwidth)
        return numba.types.intp(like), codegen

    @_intrinsic
    def _nonzero(typingctx, src, src_index, like):
        """The mask of src[src_index:src_index + lanes] != 0 (bit j = element j) as a uint64,
        lanes from like's dtype."""
        def codegen(context, builder, signature, args):
            vector, lanes = _vector_type(context, signature.args[0], signature.args[2])
            value = builder.load(_pointer(context, builder, signature.args[0], args[0], args[1], vector), align=1)
            flags = builder.icmp_unsigned("!=", value, _ir.Constant(vector, None))
            return builder.zext(builder.bitcast(flags, _ir.IntType(lanes)), _ir.IntType(64))
        return numba.types.uint64(src, src_index, like), codegen

    @_intrinsic
    def _compress(typingctx, src, src_index, mask, dst, dst_index, like, exact):
        """dst[dst_index:] <- the lanes of src[src_index:src_index + lanes] whose bit is set in
        mask, in order. exact False: stores the whole vector (lanes elements, the rest zeros);
        True: writes popcount(mask) elements only."""
        def codegen(context, builder, signature, args):
            vector, lanes = _vector_type(context, signature.args[0], signature.args[5])
            value = builder.load(_pointer(context, builder, signature.args[0], args[0], args[1], vector), align=1)
            target = _pointer(context, builder, signature.args[3], args[3], args[4], vector)
            mask = _lane_mask(builder, args[2], lanes)
            with builder.if_else(_cgutils.as_bool_bit(builder, args[6])) as (exactly, whole):
                with exactly:
                    fn = _cgutils.get_or_insert_function(
                        builder.module, _ir.FunctionType(_ir.VoidType(), [vector, target.type.pointee.element.as_pointer(), mask.type]),
                        f"llvm.masked.compressstore.v{lanes}i{vector.element.width}")
                    builder.call(fn, [value, builder.bitcast(target, vector.element.as_pointer()), mask])
                with whole:
                    builder.store(_x86(builder, "compress", vector, lanes, value, mask), target, align=1)
            return context.get_dummy_value()
        return numba.types.void(src, src_index, mask, dst, dst_index, like, exact), codegen

    @_intrinsic
    def _expand(typingctx, src, src_index, mask, dst, dst_index, exact):
        """dst[dst_index:dst_index + lanes] <- src[src_index:] spread to the lanes whose bit is
        set in mask, 0 elsewhere (lanes from dst's dtype). exact False: loads a whole vector
        from src; True: reads popcount(mask) elements only."""
        def codegen(context, builder, signature, args):
            vector, lanes = _vector_type(context, signature.args[3], signature.args[3])
            source = _pointer(context, builder, signature.args[0], args[0], args[1], vector)
            target = _pointer(context, builder, signature.args[3], args[3], args[4], vector)
            mask = _lane_mask(builder, args[2], lanes)
            with builder.if_else(_cgutils.as_bool_bit(builder, args[5])) as (exactly, whole):
                with exactly:
                    element = builder.bitcast(source, vector.element.as_pointer())
                    fn = _cgutils.get_or_insert_function(
                        builder.module, _ir.FunctionType(vector, [element.type, mask.type, vector]),
                        f"llvm.masked.expandload.v{lanes}i{vector.element.width}")
                    builder.store(builder.call(fn, [element, mask, _ir.Constant(vector, None)]), target, align=1)
                with whole:
                    value = builder.load(source, align=1)
                    builder.store(_x86(builder, "expand", vector, lanes, value, mask), target, align=1)
            return context.get_dummy_value()
        return numba.types.void(src, src_index, mask, dst, dst_index, exact), codegen

    @_intrinsic
    def _popcount(typingctx, mask):
        """The set bits of a uint64 (one popcnt instruction)."""
        def codegen(context, builder, signature, args):
            fn = _cgutils.get_or_insert_function(
                builder.module, _ir.FunctionType(_ir.IntType(64), [_ir.IntType(64)]), "llvm.ctpop.i64")
            return builder.call(fn, [args[0]])
        return numba.types.int64(mask), codegen

    _U64 = np.uint64

    @_jit
    def _reverse_bytes_bits(m):
        """The bits of each byte of m reversed: lane masks have element 0 in bit 0, the bitmap
        (numpy.packbits order) has it in the top bit of its byte."""
        m = ((m >> _U64(1)) & _U64(0x5555555555555555)) | ((m & _U64(0x5555555555555555)) << _U64(1))
        m = ((m >> _U64(2)) & _U64(0x3333333333333333)) | ((m & _U64(0x3333333333333333)) << _U64(2))
        return ((m >> _U64(4)) & _U64(0x0F0F0F0F0F0F0F0F)) | ((m & _U64(0x0F0F0F0F0F0F0F0F)) << _U64(4))

    WIDE = 256             # elements per step of the vector kernels: whole csr rows

    @_jit
    def _ssdc_encode_bitmap_vector(u, bitmap, values, off, end, p, rounded):
        n = u.size
        lanes = _lanes_of(values)
        codes = np.empty(WIDE, values.dtype)
        for block in range(n // WIDE):
            base = block * WIDE
            for j in range(WIDE):
                codes[j] = _value(u[base + j], p, rounded)
            for k in range(WIDE // lanes):
                m = _nonzero(u, base + lanes * k, values)
                _compress(codes, lanes * k, m, values, off, values, off + lanes > end)
                bits = _reverse_bytes_bits(m)
                for b in range(lanes // 8):
                    bitmap[(base + lanes * k) // 8 + b] = np.uint8((bits >> _U64(8 * b)) & _U64(0xFF))
                off += _popcount(m)
        tail = n - n % WIDE
        return _ssdc_encode_bitmap(u[tail:], bitmap[tail // 8:], values, off, end, p, rounded)

    _COLUMNS = np.arange(WIDE).astype(np.uint8)

    @_jit
    def _ssdc_encode_csr_vector(u, rowptr, cols, values, nnz, p, rounded):
        n = u.size
        lanes = _lanes_of(values)
        codes = np.empty(WIDE, values.dtype)
        off = 0
        for row in range(n // WIDE):
            base = row * WIDE
            for j in range(WIDE):
                codes[j] = _value(u[base + j], p, rounded)
            for k in range(WIDE // lanes):
                m = _nonzero(u, base + lanes * k, values)
                exact = off + lanes > nnz
                _compress(codes, lanes * k, m, values, off, values, exact)
                _compress(_COLUMNS, lanes * k, m, cols, off, values, exact)
                off += _popcount(m)
            rowptr[row + 1] = off
        tail = n - n % WIDE
        return _ssdc_encode_csr(u[tail:], rowptr[tail // WIDE:], cols, values, off, nnz, p, rounded)

    @_jit
    def _ssdc_decode_bitmap_vector(bitmap, values, off, out_u, p, rounded):
        n = out_u.size
        lanes = _lanes_of(values)
        codes = np.empty(WIDE, values.dtype)
        for block in range(n // WIDE):
            base = block * WIDE
            for k in range(WIDE // lanes):
                bits = _U64(0)
                for b in range(lanes // 8):
                    bits |= _U64(bitmap[(base + lanes * k) // 8 + b]) << _U64(8 * b)
                m = _reverse_bytes_bits(bits)
                _expand(values, off, m, codes, lanes * k, off + lanes > values.size)
                off += _popcount(m)
            for j in range(WIDE):         # a zero lane holds code 0, which decodes to +0.0
                out_u[base + j] = _dense(codes[j], p, rounded)
        tail = n - n % WIDE
        _ssdc_decode_bitmap(bitmap[tail // 8:], values, off, out_u[tail:], p, rounded)

    # ---- SSDC with SSSE3's byte shuffle (pshufb), for CPUs without AVX-512 ----------------
    # pshufb picks each byte of a 16-byte vector from any byte of another (or zero). One
    # vector holds 8 fp16 or fp8 values, or 4 fp32 ones (a group); a table row per bitmap
    # pattern of a group gives the bytes that compress its non-zeros to the low lanes, in
    # order, or expand consecutive values to its non-zero lanes (zeros elsewhere). The whole
    # 16 bytes are stored, as the AVX-512 kernels store whole vectors: the lanes past the
    # non-zeros land where the next group's go, and a block goes element by element where a
    # whole store could pass `end` (or a whole load the values' end). The rows are indexed by
    # the bitmap's own bytes (numpy.packbits order: element 0 in the top bit), so a group's
    # row is its bitmap byte, or each half-byte for fp32. Every x86-64 CPU since 2006 has
    # SSSE3 (AVX2 ones run it with VEX encoding); LLVM cannot lower pshufb without it.

    def _splat(vector, value):
        return _ir.Constant(vector, [value] * vector.count)

    def _index(context, builder, signature, args, k):
        return context.cast(builder, args[k], signature.args[k], numba.types.intp)

    def _pshufb(builder, value, control):
        """pshufb(value, control) on two 16-byte vectors (SSSE3)."""
        byte16 = _ir.VectorType(_ir.IntType(8), 16)
        fn = _cgutils.get_or_insert_function(
            builder.module, _ir.FunctionType(byte16, [byte16, byte16]), "llvm.x86.ssse3.pshuf.b.128")
        return builder.call(fn, [value, control])

    @_intrinsic
    def _shuffle16(typingctx, src, src_index, table, table_index, dst, dst_index):
        """dst's 16 bytes from element dst_index <- pshufb(src's 16 bytes from element
        src_index, table[table_index:table_index + 16])."""
        def codegen(context, builder, signature, args):
            byte16 = _ir.VectorType(_ir.IntType(8), 16)
            index = [context.cast(builder, args[i], signature.args[i], numba.types.intp) for i in (1, 3, 5)]
            source = _pointer(context, builder, signature.args[0], args[0], index[0], byte16)
            control = _pointer(context, builder, signature.args[2], args[2], index[1], byte16)
            target = _pointer(context, builder, signature.args[4], args[4], index[2], byte16)
            value = _pshufb(builder, builder.load(source, align=1), builder.load(control, align=1))
            builder.store(value, target, align=1)
            return context.get_dummy_value()
        return numba.types.void(src, src_index, table, table_index, dst, dst_index), codegen

    @_intrinsic
    def _nonzero8(typingctx, src, src_index):
        """The mask of the 8 words src[src_index:src_index + 8] != 0 (bit j = element j): one
        compare and movemask on AVX2."""
        def codegen(context, builder, signature, args):
            vector = _ir.VectorType(_ir.IntType(32), 8)
            value = builder.load(_pointer(context, builder, signature.args[0], args[0], args[1], vector), align=1)
            flags = builder.icmp_unsigned("!=", value, _ir.Constant(vector, None))
            return builder.zext(builder.bitcast(flags, _ir.IntType(8)), _ir.IntType(64))
        return numba.types.uint64(src, src_index), codegen

    _REVERSED_BITS = np.array([int(f"{m:08b}"[::-1], 2) for m in range(256)], np.uint8)

    @_jit
    def _ssdc_encode_bitmap_shuffle(u, bitmap, values, off, end, p, rounded, table):
        """_ssdc_encode_bitmap with each group's non-zeros compressed by one shuffle (table:
        _SHUFFLE_TABLES[values' itemsize][0])."""
        n = u.size
        group = 4 if values.itemsize == 4 else 8
        codes = np.empty(BLOCK, values.dtype)
        pattern = np.empty(BLOCK // 8, np.uint8)
        for block in range(n // BLOCK):
            base = block * BLOCK
            for j in range(BLOCK):
                codes[j] = _value(u[base + j], p, rounded)
            for b in range(BLOCK // 8):
                byte = _REVERSED_BITS[_nonzero8(u, base + 8 * b)]
                pattern[b] = byte
                bitmap[base // 8 + b] = byte
            if off + BLOCK + 16 <= end:
                for b in range(BLOCK // 8):
                    byte = np.int64(pattern[b])
                    if group == 8:
                        _shuffle16(codes, 8 * b, table, 16 * byte, values, off)
                        off += _popcount(_U64(byte))
                    else:
                        _shuffle16(codes, 8 * b, table, 16 * (byte >> 4), values, off)
                        off += _popcount(_U64(byte >> 4))
                        _shuffle16(codes, 8 * b + 4, table, 16 * (byte & 15), values, off)
                        off += _popcount(_U64(byte & 15))
            else:
                for j in range(BLOCK):
                    if (pattern[j // 8] >> (7 - j % 8)) & 1:
                        values[off] = codes[j]
                        off += 1
        tail = n - n % BLOCK
        return _ssdc_encode_bitmap(u[tail:], bitmap[tail // 8:], values, off, end, p, rounded)

    @_jit
    def _ssdc_decode_bitmap_shuffle(bitmap, values, off, out_u, p, rounded, table):
        """_ssdc_decode_bitmap with each group's values expanded by one shuffle (table:
        _SHUFFLE_TABLES[values' itemsize][1])."""
        n = out_u.size
        group = 4 if values.itemsize == 4 else 8
        codes = np.zeros(BLOCK + 16, values.dtype)     # room for a last whole 16-byte store
        for block in range(n // BLOCK):
            base = block * BLOCK
            if off + BLOCK + 16 <= values.size:
                for b in range(BLOCK // 8):
                    byte = np.int64(bitmap[base // 8 + b])
                    if group == 8:
                        _shuffle16(values, off, table, 16 * byte, codes, 8 * b)
                        off += _popcount(_U64(byte))
                    else:
                        _shuffle16(values, off, table, 16 * (byte >> 4), codes, 8 * b)
                        off += _popcount(_U64(byte >> 4))
                        _shuffle16(values, off, table, 16 * (byte & 15), codes, 8 * b + 4)
                        off += _popcount(_U64(byte & 15))
                for j in range(BLOCK):    # a zero lane holds code 0, which decodes to +0.0
                    out_u[base + j] = _dense(codes[j], p, rounded)
            else:
                for i in range(base, base + BLOCK):
                    if (bitmap[i // 8] >> (7 - i % 8)) & 1:
                        out_u[i] = _dense(values[off], p, rounded)
                        off += 1
                    else:
                        out_u[i] = 0
        tail = n - n % BLOCK
        _ssdc_decode_bitmap(bitmap[tail // 8:], values, off, out_u[tail:], p, rounded)

    # ---- the same kernels over parts of a tensor on several threads (`threads`) -------------
    # Each part is a run of whole 256-element blocks (the last part takes the rest) and
    # writes exactly the bytes the one-thread kernel writes there: an SSDC part's values go
    # from the offset the non-zeros before it give (counted first, per part), a bitmap
    # part's bytes from its first element / 8. numba's OpenMP layer runs the parts on the
    # OpenMP threads that oneDNN's convolutions use (`--conv onednn`), not on threads of
    # their own.
    _pjit = numba.njit(parallel=True, cache=True, nogil=True, boundscheck=False)

    @_intrinsic
    def _zeros256(typingctx, u, index):
        """The zero words among u[index:index + 256]: 32 compares of 8 lanes summed into four
        vectors of 32-bit counts. (LLVM's own loop over the block widened its count to 64-bit
        lanes on AVX2: 47 us for a 2 MiB map against 25 here; 21 us on AVX-512 either way.)"""
        def codegen(context, builder, signature, args):
            word8 = _ir.VectorType(_ir.IntType(32), 8)
            start = context.cast(builder, args[1], signature.args[1], numba.types.intp)
            sums = [_ir.Constant(word8, None)] * 4
            for k in range(32):
                at = builder.add(start, _ir.Constant(_ir.IntType(64), 8 * k))
                value = builder.load(_pointer(context, builder, signature.args[0], args[0], at, word8), align=1)
                zero = builder.sext(builder.icmp_unsigned("==", value, _ir.Constant(word8, None)), word8)
                sums[k % 4] = builder.sub(sums[k % 4], zero)
            total = builder.add(builder.add(sums[0], sums[1]), builder.add(sums[2], sums[3]))
            fn = _cgutils.get_or_insert_function(
                builder.module, _ir.FunctionType(_ir.IntType(32), [word8]), "llvm.vector.reduce.add.v8i32")
            return builder.zext(builder.call(fn, [total]), _ir.IntType(64))
        return numba.types.int64(u, index), codegen

    @_jit
    def _count(u):
        """The non-zero words of u: 3x as fast as numpy's count_nonzero on 32-bit words (its
        loop for 4-byte integers is not SIMD)."""
        n = u.size
        zeros = 0
        for block in range(n // 256):
            zeros += _zeros256(u, 256 * block)
        for i in range(n - n % 256, n):
            zeros += u[i] == _U32(0)
        return n - zeros

    @_jit
    def _bitmap_count_parts(bitmap, bounds, counts):
        for k in range(bounds.size - 1):
            counts[k] = _bitmap_count(bitmap[bounds[k] // 8:], bounds[k + 1] - bounds[k])

    @_pjit
    def _count_parts_threaded(u, bounds, counts):
        for k in numba.prange(bounds.size - 1):
            counts[k] = _count(u[bounds[k]:bounds[k + 1]])

    @_pjit
    def _dpr_encode_parts(u, codes, p, bounds):
        for k in numba.prange(bounds.size - 1):
            dpr_encode(u[bounds[k]:bounds[k + 1]], codes[bounds[k]:bounds[k + 1]], p, 1)

    @_pjit
    def _dpr_decode_parts(codes, out_u, p, bounds):
        for k in numba.prange(bounds.size - 1):
            dpr_decode(codes[bounds[k]:bounds[k + 1]], out_u[bounds[k]:bounds[k + 1]], p, 1)

    @_pjit
    def _ssdc_encode_bitmap_parts(u, bitmap, values, bounds, offs, p, rounded):
        for k in numba.prange(bounds.size - 1):
            lo, hi = bounds[k], bounds[k + 1]
            _ssdc_encode_bitmap(u[lo:hi], bitmap[lo // 8:], values, offs[k], offs[k + 1], p, rounded)

    @_pjit
    def _ssdc_encode_bitmap_vector_parts(u, bitmap, values, bounds, offs, p, rounded):
        for k in numba.prange(bounds.size - 1):
            lo, hi = bounds[k], bounds[k + 1]
            _ssdc_encode_bitmap_vector(u[lo:hi], bitmap[lo // 8:], values, offs[k], offs[k + 1], p, rounded)

    @_pjit
    def _ssdc_encode_bitmap_shuffle_parts(u, bitmap, values, bounds, offs, p, rounded, table):
        for k in numba.prange(bounds.size - 1):
            lo, hi = bounds[k], bounds[k + 1]
            _ssdc_encode_bitmap_shuffle(u[lo:hi], bitmap[lo // 8:], values, offs[k], offs[k + 1], p, rounded, table)

    @_pjit
    def _ssdc_decode_bitmap_shuffle_parts(bitmap, values, out_u, bounds, offs, p, rounded, table):
        for k in numba.prange(bounds.size - 1):
            lo, hi = bounds[k], bounds[k + 1]
            _ssdc_decode_bitmap_shuffle(bitmap[lo // 8:], values, offs[k], out_u[lo:hi], p, rounded, table)

    @_pjit
    def _ssdc_decode_bitmap_parts(bitmap, values, out_u, bounds, offs, p, rounded):
        for k in numba.prange(bounds.size - 1):
            lo, hi = bounds[k], bounds[k + 1]
            _ssdc_decode_bitmap(bitmap[lo // 8:], values, offs[k], out_u[lo:hi], p, rounded)

    @_pjit
    def _ssdc_decode_bitmap_vector_parts(bitmap, values, out_u, bounds, offs, p, rounded):
        for k in numba.prange(bounds.size - 1):
            lo, hi = bounds[k], bounds[k + 1]
            _ssdc_decode_bitmap_vector(bitmap[lo // 8:], values, offs[k], out_u[lo:hi], p, rounded)

    # ---- fp16 SSDC on AVX2 machines: a group of 8 in registers ---------------------------
    # The shuffle kernels above convert a block's values into a buffer, then compress it group
    # by group: 102 us for a 2 MiB map at density 0.5 on AVX2 (decode 95 us; a copy 43 us).
    # Where fp16 goes through F16C the whole group stays in registers: one 32-byte load, the
    # non-zero mask, vcvtps2ph and one pshufb: 72 us (decode 67 us). DPR fp16's NaN rule (the
    # quiet NaN 0x7E00 with its sign) is applied before the conversion, on the float32 lanes:
    # a NaN becomes the quiet float32 NaN of its sign, which converts to exactly that code.
    if HALF:
        @_intrinsic
        def _compress_half8(typingctx, u, u_index, table, values, off):
            """values[off:off + 8] <- the fp16 codes of u[u_index:u_index + 8]'s non-zero words
            in order, then zeros (16 bytes stored); returns the non-zero mask (bit j = element
            j), which also picks the table's row (_HALF_COMPRESS)."""
            def codegen(context, builder, signature, args):
                word8 = _ir.VectorType(_ir.IntType(32), 8)
                byte16 = _ir.VectorType(_ir.IntType(8), 16)
                x = builder.load(_pointer(context, builder, signature.args[0], args[0],
                                          _index(context, builder, signature, args, 1), word8), align=1)
                flags = builder.icmp_unsigned("!=", x, _ir.Constant(word8, None))
                mask = builder.zext(builder.bitcast(flags, _ir.IntType(8)), _ir.IntType(64))
                quiet = builder.or_(builder.and_(x, _splat(word8, 0xFF800000)), _splat(word8, 0x00400000))
                values8 = builder.bitcast(x, _ir.VectorType(_ir.FloatType(), 8))
                x = builder.select(builder.fcmp_unordered("uno", values8, values8), quiet, x)   # as dpr_half_code
                half = builder.fptrunc(builder.bitcast(x, _ir.VectorType(_ir.FloatType(), 8)),
                                       _ir.VectorType(_ir.HalfType(), 8))
                row = builder.mul(mask, _ir.Constant(_ir.IntType(64), 16))
                control = builder.load(_pointer(context, builder, signature.args[2], args[2], row, byte16), align=1)
                target = _pointer(context, builder, signature.args[3], args[3],
                                  _index(context, builder, signature, args, 4), byte16)
                builder.store(_pshufb(builder, builder.bitcast(half, byte16), control), target, align=1)
                return mask
            return numba.types.uint64(u, u_index, table, values, off), codegen

        @_intrinsic
        def _expand_half8(typingctx, values, off, table, byte, out_u, out_index):
            """out_u[out_index:out_index + 8] <- the float32 bits of the fp16 codes from
            values[off:] spread to the lanes set in the bitmap byte `byte` (0 elsewhere),
            as float_bits_of_dpr_half gives them (16 bytes of values loaded)."""
            def codegen(context, builder, signature, args):
                word8 = _ir.VectorType(_ir.IntType(32), 8)
                byte16 = _ir.VectorType(_ir.IntType(8), 16)
                source = builder.load(_pointer(context, builder, signature.args[0], args[0],
                                               _index(context, builder, signature, args, 1), byte16), align=1)
                row = builder.mul(_index(context, builder, signature, args, 3), _ir.Constant(_ir.IntType(64), 16))
                control = builder.load(_pointer(context, builder, signature.args[2], args[2], row, byte16), align=1)
                codes = builder.bitcast(_pshufb(builder, source, control), _ir.VectorType(_ir.IntType(16), 8))
                bits = builder.bitcast(builder.fpext(builder.bitcast(codes, _ir.VectorType(_ir.HalfType(), 8)),
                                                     _ir.VectorType(_ir.FloatType(), 8)), word8)
                target = _pointer(context, builder, signature.args[4], args[4],
                                  _index(context, builder, signature, args, 5), word8)
                builder.store(bits, target, align=1)
                return context.get_dummy_value()
            return numba.types.void(values, off, table, byte, out_u, out_index), codegen

        @_jit
        def _ssdc_encode_bitmap_half(u, bitmap, values, off, end, p, table):
            """_ssdc_encode_bitmap for fp16 values on F16C (table: _HALF_COMPRESS); a group
            whose whole 16-byte store could pass `end` and the rest go element by element."""
            groups = u.size // 8
            g = 0
            while g < groups and off + 8 <= end:
                m = _compress_half8(u, 8 * g, table, values, off)
                bitmap[g] = _REVERSED_BITS[m]
                off += _popcount(m)
                g += 1
            return _ssdc_encode_bitmap(u[8 * g:], bitmap[g:], values, off, end, p, True)

        @_jit
        def _ssdc_decode_bitmap_half(bitmap, values, off, out_u, p, table):
            """_ssdc_decode_bitmap for fp16 values on F16C (table: _SHUFFLE_TABLES[2][1])."""
            groups = out_u.size // 8
            g = 0
            while g < groups and off + 8 <= values.size:
                byte = bitmap[g]
                _expand_half8(values, off, table, byte, out_u, 8 * g)
                off += _popcount(_U64(byte))
                g += 1
            _ssdc_decode_bitmap(bitmap[g:], values, off, out_u[8 * g:], p, True)

        @_pjit
        def _ssdc_encode_bitmap_half_parts(u, bitmap, values, bounds, offs, p, table):
            for k in numba.prange(bounds.size - 1):
                lo, hi = bounds[k], bounds[k + 1]
                _ssdc_encode_bitmap_half(u[lo:hi], bitmap[lo // 8:], values, offs[k], offs[k + 1], p, table)

        @_pjit
        def _ssdc_decode_bitmap_half_parts(bitmap, values, out_u, bounds, offs, p, table):
            for k in numba.prange(bounds.size - 1):
                lo, hi = bounds[k], bounds[k + 1]
                _ssdc_decode_bitmap_half(bitmap[lo // 8:], values, offs[k], out_u[lo:hi], p, table)

    # ---- fp32 SSDC on AVX2 machines: 8 words per lane permute ------------------------------
    # SSDC's lossless values are the float32 words themselves; a byte shuffle moves 4 of them
    # (two per bitmap byte), AVX2's vpermd moves 8: its index row per mask compresses the
    # non-zero words to the low lanes, or spreads consecutive words to the set lanes. The loops
    # are the fp16 ones with the other group form: one loop choosing the form by the values'
    # dtype measured slower on both (fp32's decode 60 -> 80 us on a 2 MiB map).
    if PERMUTE:
        def _permd(builder, value, control):
            word8 = _ir.VectorType(_ir.IntType(32), 8)
            fn = _cgutils.get_or_insert_function(
                builder.module, _ir.FunctionType(word8, [word8, word8]), "llvm.x86.avx2.permd")
            return builder.call(fn, [value, control])

        @_intrinsic
        def _compress_word8(typingctx, u, u_index, table, values, off):
            """values[off:off + 8] <- u[u_index:u_index + 8]'s non-zero words in order, then
            whatever the row's other lanes pick (32 bytes stored; the next group's store, or
            the element-wise tail, writes over them); returns the non-zero mask (bit j =
            element j), which picks the table's row (_WORD_COMPRESS)."""
            def codegen(context, builder, signature, args):
                word8 = _ir.VectorType(_ir.IntType(32), 8)
                x = builder.load(_pointer(context, builder, signature.args[0], args[0],
                                          _index(context, builder, signature, args, 1), word8), align=1)
                flags = builder.icmp_unsigned("!=", x, _ir.Constant(word8, None))
                mask = builder.zext(builder.bitcast(flags, _ir.IntType(8)), _ir.IntType(64))
                row = builder.mul(mask, _ir.Constant(_ir.IntType(64), 8))
                control = builder.load(_pointer(context, builder, signature.args[2], args[2], row, word8), align=1)
                target = _pointer(context, builder, signature.args[3], args[3],
                                  _index(context, builder, signature, args, 4), word8)
                builder.store(_permd(builder, x, control), target, align=1)
                return mask
            return numba.types.uint64(u, u_index, table, values, off), codegen

        @_intrinsic
        def _expand_word8(typingctx, values, off, table, byte, out_u, out_index):
            """out_u[out_index:out_index + 8] <- the words from values[off:] spread to the lanes
            set in the bitmap byte `byte` (numpy.packbits order), 0 elsewhere (32 bytes of
            values loaded)."""
            def codegen(context, builder, signature, args):
                word8 = _ir.VectorType(_ir.IntType(32), 8)
                source = builder.load(_pointer(context, builder, signature.args[0], args[0],
                                               _index(context, builder, signature, args, 1), word8), align=1)
                byte = _index(context, builder, signature, args, 3)
                row = builder.mul(byte, _ir.Constant(_ir.IntType(64), 8))
                control = builder.load(_pointer(context, builder, signature.args[2], args[2], row, word8), align=1)
                spread = builder.insert_element(_ir.Constant(word8, None), builder.trunc(byte, _ir.IntType(32)),
                                                _ir.Constant(_ir.IntType(32), 0))
                spread = builder.shuffle_vector(spread, spread, _ir.Constant(word8, [0] * 8))
                bits = _ir.Constant(word8, [128 >> j for j in range(8)])
                lanes = builder.icmp_unsigned("!=", builder.and_(spread, bits), _ir.Constant(word8, None))
                words = builder.select(lanes, _permd(builder, source, control), _ir.Constant(word8, None))
                target = _pointer(context, builder, signature.args[4], args[4],
                                  _index(context, builder, signature, args, 5), word8)
                builder.store(words, target, align=1)
                return context.get_dummy_value()
            return numba.types.void(values, off, table, byte, out_u, out_index), codegen

        @_jit
        def _ssdc_encode_bitmap_word(u, bitmap, values, off, end, p, table):
            """_ssdc_encode_bitmap for fp32 values (table: _WORD_COMPRESS); a group whose whole
            32-byte store could pass `end` and the rest go element by element."""
            groups = u.size // 8
            g = 0
            while g < groups and off + 8 <= end:
                m = _compress_word8(u, 8 * g, table, values, off)
                bitmap[g] = _REVERSED_BITS[m]
                off += _popcount(m)
                g += 1
            return _ssdc_encode_bitmap(u[8 * g:], bitmap[g:], values, off, end, p, False)

        @_jit
        def _ssdc_decode_bitmap_word(bitmap, values, off, out_u, p, table):
            """_ssdc_decode_bitmap for fp32 values (table: _WORD_EXPAND)."""
            groups = out_u.size // 8
            g = 0
            while g < groups and off + 8 <= values.size:
                byte = bitmap[g]
                _expand_word8(values, off, table, byte, out_u, 8 * g)
                off += _popcount(_U64(byte))
                g += 1
            _ssdc_decode_bitmap(bitmap[g:], values, off, out_u[8 * g:], p, False)

        @_pjit
        def _ssdc_encode_bitmap_word_parts(u, bitmap, values, bounds, offs, p, table):
            for k in numba.prange(bounds.size - 1):
                lo, hi = bounds[k], bounds[k + 1]
                _ssdc_encode_bitmap_word(u[lo:hi], bitmap[lo // 8:], values, offs[k], offs[k + 1], p, table)

        @_pjit
        def _ssdc_decode_bitmap_word_parts(bitmap, values, out_u, bounds, offs, p, table):
            for k in numba.prange(bounds.size - 1):
                lo, hi = bounds[k], bounds[k + 1]
                _ssdc_decode_bitmap_word(bitmap[lo // 8:], values, offs[k], out_u[lo:hi], p, table)

    # the fp16 compress table's rows in lane-mask order (bit j = element j)
    _HALF_COMPRESS = _SHUFFLE_TABLES[2][0].reshape(256, 16)[_REVERSED_BITS].ravel()
    # vpermd's index rows: compress by lane mask (bit j = element j), expand by bitmap byte
    # (numpy.packbits order); the lanes past the non-zeros, or not set, pick lane 0
    _WORD_COMPRESS = np.zeros((256, 8), np.int32)
    _WORD_EXPAND = np.zeros((256, 8), np.int32)
    for _m in range(256):
        _lanes = [j for j in range(8) if (_m >> j) & 1]
        _WORD_COMPRESS[_m, :len(_lanes)] = _lanes
        for _k, _j in enumerate(_lanes):
            _WORD_EXPAND[_REVERSED_BITS[_m], _j] = _k
    _WORD_COMPRESS, _WORD_EXPAND = _WORD_COMPRESS.ravel(), _WORD_EXPAND.ravel()

    # ---- bit packing (mask-1bit, index-{1,2,4}bit): bytes in numpy.packbits order, the
    # first element in the top bits; a last partial byte has its low bits 0 ----------------
    @_intrinsic
    def _positive8(typingctx, x, index):
        """The mask of x[index:index + 8] > 0 (bit j = element j; NaN is not > 0): one
        compare and movemask."""
        def codegen(context, builder, signature, args):
            vector = _ir.VectorType(_ir.FloatType(), 8)
            at = context.cast(builder, args[1], signature.args[1], numba.types.intp)
            value = builder.load(_pointer(context, builder, signature.args[0], args[0], at, vector), align=1)
            flags = builder.fcmp_ordered(">", value, _ir.Constant(vector, None))
            return builder.zext(builder.bitcast(flags, _ir.IntType(8)), _ir.IntType(64))
        return numba.types.uint64(x, index), codegen

    @_jit
    def pack_positive(x, dst):
        """dst <- 1 bit per element of x: x > 0 (a float32 ReLU output; NaN gives 0). A
        group's mask in one compare, its bit order by table (a loop over the 8 bits ran at
        81 us for a 2 MiB map on AVX2, 2.5x AVX-512's time)."""
        n = x.size
        for b in range(n // 8):
            if x.itemsize == 4:
                dst[b] = _REVERSED_BITS[_positive8(x, 8 * b)]
            else:
                byte = 0
                for j in range(8):
                    byte |= (1 if x[8 * b + j] > 0 else 0) << (7 - j)
                dst[b] = byte
        if n % 8:
            byte = 0
            for j in range(n % 8):
                byte |= (1 if x[n - n % 8 + j] > 0 else 0) << (7 - j)
            dst[n // 8] = byte

    @_jit
    def relu_pool_codes(argmax, pool_out, positions, codes):
        """codes <- argmax where pool_out > 0, else `positions` (Gist's relu-pool-4bit codes
        before packing; NaN is not > 0). One pass instead of fill, compare and a masked copy.
        Arithmetic on the comparison, not a select: the byte select under a float compare
        ran as a branch on AVX2 CPUs, mispredicted half the time (40x slower than AVX-512's)."""
        base = np.int32(positions)
        for i in range(codes.size):
            positive = np.int32(pool_out[i] > 0)
            codes[i] = np.uint8(base + (np.int32(argmax[i]) - base) * positive)

    @_jit
    def pack_codes(codes, dst, bits):
        """dst <- codes (uint8, each below 2**bits; bits 1, 2 or 4), 8 // bits per byte."""
        per = 8 // bits
        n = codes.size
        if bits == 1:
            for b in range(n // 8):
                byte = 0
                for j in range(8):
                    byte |= (codes[8 * b + j] & 1) << (7 - j)
                dst[b] = byte
        elif bits == 4:
            for b in range(n // 2):
                dst[b] = (codes[2 * b] << 4) | codes[2 * b + 1]
        else:
            for b in range(n // per):
                byte = 0
                for j in range(per):
                    byte |= codes[per * b + j] << (bits * (per - 1 - j))
                dst[b] = byte
        if n % per:
            byte = 0
            for j in range(n % per):
                byte |= codes[n - n % per + j] << (bits * (per - 1 - j))
            dst[n // per] = byte

    @_intrinsic
    def _spread_bits32(typingctx, src, index, out, out_index):
        """out[out_index:out_index + 32] <- the bits of the 4 bytes src[index:index + 4], each
        byte's top bit first, as bytes 0 or 1: one vector test (a loop over the bits ran at
        24 us for a 2 MiB map's mask on AVX2, this at 9)."""
        def codegen(context, builder, signature, args):
            byte4, byte32 = _ir.VectorType(_ir.IntType(8), 4), _ir.VectorType(_ir.IntType(8), 32)
            at = context.cast(builder, args[1], signature.args[1], numba.types.intp)
            packed = builder.load(_pointer(context, builder, signature.args[0], args[0], at, byte4), align=1)
            spread = builder.shuffle_vector(packed, packed, _ir.Constant(_ir.VectorType(_ir.IntType(32), 32),
                                                                           [j // 8 for j in range(32)]))
            set_ = builder.icmp_unsigned(
                "!=", builder.and_(spread, _ir.Constant(byte32, [128 >> (j % 8) for j in range(32)])),
                _ir.Constant(byte32, None))
            target = _pointer(context, builder, signature.args[2], args[2],
                              context.cast(builder, args[3], signature.args[3], numba.types.intp), byte32)
            builder.store(builder.zext(set_, byte32), target, align=1)
            return context.get_dummy_value()
        return numba.types.void(src, index, out, out_index), codegen

    @_jit
    def unpack_codes(src, out, bits):
        """out (uint8, or bool viewed as uint8) <- the codes packed in src."""
        per = 8 // bits
        mask = (1 << bits) - 1
        n = out.size
        if bits == 1:
            for b in range(n // 32):
                _spread_bits32(src, 4 * b, out, 32 * b)
            for b in range(n // 32 * 4, n // 8):
                byte = src[b]
                for j in range(8):
                    out[8 * b + j] = (byte >> (7 - j)) & 1
        elif bits == 4:
            for b in range(n // 2):
                byte = src[b]
                out[2 * b] = byte >> 4
                out[2 * b + 1] = byte & 15
        else:
            for b in range(n // per):
                byte = src[b]
                for j in range(per):
                    out[per * b + j] = (byte >> (bits * (per - 1 - j))) & mask
        for j in range(n % per):
            out[n - n % per + j] = (src[n // per] >> (bits * (per - 1 - j))) & mask


# ---- what the codecs call ----------------------------------------------------------------
def set_half(on):
    """Encode and decode fp16 with F16C (only where HALF); returns the previous setting. Takes
    effect for the calls made after it (the DPR parameters are read at each call)."""
    global _half
    previous, _half = _half, bool(on) and HALF
    return previous


def set_shuffle(on):
    """Use the byte-shuffle SSDC bitmap kernels where the AVX-512 ones are not in use (only
    where SHUFFLE); returns the previous setting."""
    global _shuffle
    previous, _shuffle = _shuffle, bool(on) and SHUFFLE
    return previous


def set_vector(on):
    """Use the compress/expand SSDC kernels (only where VECTOR); returns the previous setting."""
    global _vector
    previous, _vector = _vector, bool(on) and VECTOR
    return previous


PARALLEL_MIN = 1 << 16      # elements per part at least: a parallel region costs microseconds
_PART_ALIGN = 256           # parts are whole 256-element blocks (whole csr rows, whole bitmap bytes)
_threads = 1


def set_threads(count):
    """Run the DPR (one code per word) and SSDC bitmap kernels on `count` threads, each on a
    part of the tensor, for tensors of at least 2 * PARALLEL_MIN elements; the bytes are the
    same as on one. Returns the previous count. Net(conv="onednn") sets it to oneDNN's OpenMP
    threads during its steps: with the im2col engine OpenBLAS's threads keep spinning between
    calls and a second thread made the step slower (see the module docstring)."""
    global _threads
    previous, _threads = _threads, max(1, int(count))
    return previous


def threads(count):
    """The codec kernels on `count` threads inside a `with` block (None: as they are)."""
    return scoped(set_threads, count)


def _bounds(n):
    """The parts of an n-element tensor as an int64 array of bounds, or None for one part."""
    parts = min(_threads, n // PARALLEL_MIN)
    if parts <= 1:
        return None
    step = -(-n // parts)
    step = -(-step // _PART_ALIGN) * _PART_ALIGN
    return np.array([min(k * step, n) for k in range(parts)] + [n], np.int64)


def count_nonzero(u):
    """(u's non-zero words, split): `split` is None, or with several threads the parts'
    bounds and value offsets, which ssdc_encode_bitmap takes instead of counting again."""
    bounds = _bounds(u.size)
    if bounds is None:
        return int(_count(u)), None
    offsets = np.zeros(bounds.size, np.int64)
    _count_parts_threaded(u, bounds, offsets[1:])
    np.cumsum(offsets, out=offsets)
    return int(offsets[-1]), (bounds, offsets)


def _dpr(one, parts, src, dst, p, per, values):
    """A DPR kernel on one thread, or its parts on several where `threads` and the `values`
    count allow (one code per unit only: fp10's words hold three)."""
    bounds = _bounds(values) if per == 1 else None
    if bounds is None:
        one(src, dst, p, per)
    else:
        parts(src, dst, p, bounds)


def dpr_encode_flat(u, codes, p, per):
    """dpr_encode, on several threads where `threads` and the size allow."""
    _dpr(dpr_encode, _dpr_encode_parts, u, codes, p, per, u.size)


def dpr_decode_flat(codes, out_u, p, per):
    """dpr_decode, on several threads where `threads` and the size allow."""
    _dpr(dpr_decode, _dpr_decode_parts, codes, out_u, p, per, out_u.size)


def _shuffle_word(values, rounded):
    """Whether the lane-permute form of the shuffle kernels serves (fp32 values, AVX2)."""
    return _shuffle and PERMUTE and not rounded and values.itemsize == 4


def _shuffle_half(values, p, rounded):
    """Whether the shuffle kernels' fp16-on-F16C form serves (fp16 values, p from dpr_params
    with F16C on: its last entry)."""
    return _shuffle and rounded and values.itemsize == 2 and bool(p[14])


def ssdc_encode_bitmap(u, bitmap, values, nnz, p, rounded, split=None):
    """SSDC's bitmap format (see _ssdc_encode_bitmap); nnz: u's non-zeros; `split`: from
    count_nonzero (parts on several threads), or None (one)."""
    half = _shuffle_half(values, p, rounded)
    word = _shuffle_word(values, rounded)
    if split is not None:
        bounds, offsets = split
        if _vector:
            _ssdc_encode_bitmap_vector_parts(u, bitmap, values, bounds, offsets, p, rounded)
        elif half:
            _ssdc_encode_bitmap_half_parts(u, bitmap, values, bounds, offsets, p, _HALF_COMPRESS)
        elif word:
            _ssdc_encode_bitmap_word_parts(u, bitmap, values, bounds, offsets, p, _WORD_COMPRESS)
        elif _shuffle:
            table = _SHUFFLE_TABLES[values.itemsize][0]
            _ssdc_encode_bitmap_shuffle_parts(u, bitmap, values, bounds, offsets, p, rounded, table)
        else:
            _ssdc_encode_bitmap_parts(u, bitmap, values, bounds, offsets, p, rounded)
    elif _vector:
        _ssdc_encode_bitmap_vector(u, bitmap, values, 0, nnz, p, rounded)
    elif half:
        _ssdc_encode_bitmap_half(u, bitmap, values, 0, nnz, p, _HALF_COMPRESS)
    elif word:
        _ssdc_encode_bitmap_word(u, bitmap, values, 0, nnz, p, _WORD_COMPRESS)
    elif _shuffle:
        _ssdc_encode_bitmap_shuffle(u, bitmap, values, 0, nnz, p, rounded, _SHUFFLE_TABLES[values.itemsize][0])
    else:
        _ssdc_encode_bitmap(u, bitmap, values, 0, nnz, p, rounded)


def ssdc_encode_csr(u, rowptr, cols, values, nnz, p, rounded):
    """SSDC's csr format (see _ssdc_encode_csr); nnz: u's non-zeros."""
    rowptr[0] = 0
    if _vector:
        _ssdc_encode_csr_vector(u, rowptr, cols, values, nnz, p, rounded)
    else:
        _ssdc_encode_csr(u, rowptr, cols, values, 0, nnz, p, rounded)


def _corrupt(what, nnz):
    return ValueError(f"SSDC: the encoding's {what} disagrees with its header ({nnz} non-zeros)")


def ssdc_decode_bitmap(bitmap, values, out_u, nnz, p, rounded):
    """Checks that the bitmap holds nnz set bits first: the kernels read one value per set bit."""
    bounds = _bounds(out_u.size)
    if bounds is not None:
        offsets = np.zeros(bounds.size, np.int64)
        _bitmap_count_parts(bitmap, bounds, offsets[1:])
        np.cumsum(offsets, out=offsets)
        if offsets[-1] != nnz:
            raise _corrupt("bitmap", nnz)
        if _vector:
            _ssdc_decode_bitmap_vector_parts(bitmap, values, out_u, bounds, offsets, p, rounded)
        elif _shuffle_half(values, p, rounded):
            _ssdc_decode_bitmap_half_parts(bitmap, values, out_u, bounds, offsets, p, _SHUFFLE_TABLES[2][1])
        elif _shuffle_word(values, rounded):
            _ssdc_decode_bitmap_word_parts(bitmap, values, out_u, bounds, offsets, p, _WORD_EXPAND)
        elif _shuffle:
            table = _SHUFFLE_TABLES[values.itemsize][1]
            _ssdc_decode_bitmap_shuffle_parts(bitmap, values, out_u, bounds, offsets, p, rounded, table)
        else:
            _ssdc_decode_bitmap_parts(bitmap, values, out_u, bounds, offsets, p, rounded)
        return
    if _bitmap_count(bitmap, out_u.size) != nnz:
        raise _corrupt("bitmap", nnz)
    if _vector:
        _ssdc_decode_bitmap_vector(bitmap, values, 0, out_u, p, rounded)
    elif _shuffle_half(values, p, rounded):
        _ssdc_decode_bitmap_half(bitmap, values, 0, out_u, p, _SHUFFLE_TABLES[2][1])
    elif _shuffle_word(values, rounded):
        _ssdc_decode_bitmap_word(bitmap, values, 0, out_u, p, _WORD_EXPAND)
    elif _shuffle:
        _ssdc_decode_bitmap_shuffle(bitmap, values, 0, out_u, p, rounded, _SHUFFLE_TABLES[values.itemsize][1])
    else:
        _ssdc_decode_bitmap(bitmap, values, 0, out_u, p, rounded)


def ssdc_decode_csr(rowptr, cols, values, out_u, nnz, p, rounded):
    """Checks the row pointers first (0 .. nnz, never decreasing): they index values and cols."""
    if not _rowptr_ok(rowptr, nnz):
        raise _corrupt("row pointers", nnz)
    _ssdc_decode_csr(rowptr, cols, values, out_u, p, rounded)
