"""Lossless bit packing: Gist's binarize encodings.

`BitMask` ("mask-1bit") keeps 1 bit per element for `x > 0` (what ReLU's backward needs, and
the form of Dropout's bool mask); decode writes a bool tensor. `PackedCodes(bits)`
("index-{bits}bit") packs small uint8 codes (MaxPool's window index, the fused ReLU->MaxPool
code) 8/bits to a byte; decode writes uint8.

Bit order, for all packings here: the first element goes to the most significant bits of its
byte (for 1 bit per element this is `numpy.packbits`' default, bitorder="big"). Bits past the
last element in the last byte are zero.

Packing uses one integer multiply per output byte: the 8/bits codes of a lane (uint64 for 1 bit,
uint32 for 2, uint16 for 4; one code per byte) times a constant with one bit per code
(0x8040201008040201, 0x40100401, 0x1001) land, without overlaps or carries, side by side in the
lane's top byte. The same constant spreads a byte back into a lane (then shift and mask). Only
ufuncs with `out=` are used, so the code runs unchanged on numpy and cupy; big tensors go in
chunks of `CHUNK` elements so the workspace stays small. (Constants are typed numpy scalars:
numpy 2 runs ufuncs with Python-int scalars on a slower path.)
"""
import numpy as np

from ..gpu import kernels as gpu_kernels
from ..layers.base import TensorDecl
from . import kernels
from .base import Codec

CHUNK = 1 << 16            # elements per chunk: a multiple of 256 (SSDC rows) and of 8
_SPREAD = np.uint64(0x8040201008040201)
_HIGH = np.uint64(0x8080808080808080)
_SHIFT56 = np.uint64(56)
U8 = np.uint8


def nelements(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def packed_nbytes(n, bits=1):
    """Bytes for n codes of `bits` bits (bits divides 8)."""
    per = 8 // bits
    return (int(n) + per - 1) // per


def chunks(n, size=None):
    """(start, stop) pairs covering range(n) in steps of `size` (default CHUNK)."""
    size = size or CHUNK
    return [(c, min(c + size, n)) for c in range(0, n, size)]


# ---- helpers on uint64 words (used by BitMask and by SSDC's bitmap format) -------------------
def bool_bytes(xp, words, m):
    """The first m bytes of the uint64 workspace `words`, as a bool array to write a mask into."""
    return words.view(xp.uint8)[:m].view(xp.bool_)


def pack_words(xp, words, m, dst):
    """Pack m mask bytes (each 0 or 1) held in `words` into ceil(m/8) bytes of `dst` (uint8).

    The bytes past m in the last word are cleared first; `words` is overwritten."""
    nb = (m + 7) // 8
    w = words[:nb]
    if m % 8:
        w.view(xp.uint8)[m:].fill(0)
    xp.multiply(w, _SPREAD, out=w)
    xp.right_shift(w, _SHIFT56, out=w)
    xp.copyto(dst[:nb], w, casting="unsafe")


def unpack_words(xp, src, words, m):
    """Spread the first ceil(m/8) bytes of `src` into `words`: afterwards byte i of
    words.view(uint8) is 0x80 where bit i is set, else 0 (i < m; bytes past m are garbage)."""
    nb = (m + 7) // 8
    w = words[:nb]
    xp.copyto(w, src[:nb], casting="safe")
    xp.multiply(w, _SPREAD, out=w)
    xp.bitwise_and(w, _HIGH, out=w)
    return words.view(xp.uint8)[:m]


def check_chunk(chunk, granule, who):
    chunk = CHUNK if chunk is None else int(chunk)
    if chunk <= 0 or chunk % granule:
        raise ValueError(f"{who}: chunk must be a positive multiple of {granule}, got {chunk}")
    return chunk


def pack_mask(xp, mask, dst, words, chunk=None):
    """Pack a bool/0-1 array (1-D, length m) into dst (ceil(m/8) uint8), chunked through the
    uint64 workspace `words` (length >= ceil(min(m, chunk)/8); chunk a multiple of 8)."""
    m = mask.size
    for c0, c1 in chunks(m, chunk):
        xp.copyto(bool_bytes(xp, words, c1 - c0), mask[c0:c1], casting="unsafe")
        pack_words(xp, words, c1 - c0, dst[c0 // 8:])


def unpack_mask(xp, src, out, words, chunk=None):
    """Inverse of pack_mask: write bools (or 0/1) into the 1-D array `out`."""
    m = out.size
    for c0, c1 in chunks(m, chunk):
        spread = unpack_words(xp, src[c0 // 8:], words, c1 - c0)
        xp.not_equal(spread, U8(0), out=out[c0:c1])


class BitMask(Codec):
    """1 bit per element for `x > 0` (float input) or `x` (bool input); decodes to bool.

    encoded(shape): {"bits": uint8[ceil(n/8)]}; workspace: {"words": uint64[ceil(min(n,chunk)/8)]}
    for both phases. chunk: elements per step (default CHUNK; a multiple of 8).
    """
    name = "mask-1bit"
    lossless = True

    def __init__(self, chunk=None):
        self.chunk = check_chunk(chunk, 8, "BitMask")

    def encoded(self, shape):
        return {"bits": TensorDecl((packed_nbytes(nelements(shape)),), np.uint8)}

    def workspace(self, shape, phase):
        n = min(nelements(shape), self.chunk)
        return {"words": TensorDecl(((n + 7) // 8,), np.uint64)}

    def decoded_dtype(self, dtype):
        return np.dtype(np.bool_)

    def encode(self, xp, x, enc, ws):
        flat = x.reshape(-1)
        bits, words = enc["bits"], ws["words"]
        is_bool = flat.dtype == np.bool_
        if gpu_kernels.serves(xp) and (is_bool or flat.dtype == np.float32):
            reference = (self.encode, (x, enc, ws))
            if is_bool:
                gpu_kernels.pack_codes(xp, flat.view(xp.uint8), bits, 1, reference)
            else:
                gpu_kernels.pack_positive(xp, flat, bits, reference)
            return
        if kernels.active(xp, flat, bits):      # one compiled pass (minigist/codecs/kernels.py)
            if is_bool:
                kernels.pack_codes(flat.view(np.uint8), bits, 1)
            else:
                kernels.pack_positive(flat, bits)
            return
        for c0, c1 in chunks(flat.size, self.chunk):
            target = bool_bytes(xp, words, c1 - c0)
            if is_bool:
                xp.copyto(target, flat[c0:c1])
            else:
                xp.greater(flat[c0:c1], flat.dtype.type(0), out=target)
            pack_words(xp, words, c1 - c0, bits[c0 // 8:])

    def decode(self, xp, enc, out, ws):
        flat = out.reshape(-1)
        if flat.dtype == np.bool_ and gpu_kernels.serves(xp):
            gpu_kernels.unpack_codes(xp, enc["bits"], flat.view(xp.uint8), 1, (self.decode, (enc, out, ws)))
            return
        if flat.dtype == np.bool_ and kernels.active(xp, enc["bits"], flat):
            kernels.unpack_codes(enc["bits"], flat.view(np.uint8), 1)
            return
        unpack_mask(xp, enc["bits"], flat, ws["words"], self.chunk)


# gathering 8/bits codes (one per byte of a lane) into one byte is one multiply: lane dtype,
# constant; the constant also spreads a byte back into a lane (see the module docstring)
_LANES = {1: (np.uint64, 0x8040201008040201), 2: (np.uint32, 0x40100401), 4: (np.uint16, 0x1001)}


class PackedCodes(Codec):
    """uint8 codes below 2**bits (bits in 1, 2, 4), 8/bits per byte; decodes to uint8.

    encoded(shape): {"codes": uint8[ceil(n*bits/8)]}; workspace (both phases):
    {"lanes": uint{64,32,16}[ceil(min(n, chunk)*bits/8)]} (one lane per output byte); chunk:
    elements per step (default CHUNK; a multiple of 8).
    Codes must fit in `bits` bits (a larger code would spill into its neighbours; encode does
    not check).
    """
    lossless = True

    def __init__(self, bits, chunk=None):
        self.chunk = check_chunk(chunk, 8, "PackedCodes")
        if bits not in (1, 2, 4):
            raise ValueError(f"PackedCodes: bits must be 1, 2 or 4, got {bits!r}")
        self.bits = bits
        self.per = 8 // bits
        self.name = f"index-{bits}bit"
        lane, k = _LANES[bits]
        self.lane = np.dtype(lane)
        self.k = lane(k)
        self.gather_shift = lane(8 * (self.per - 1))
        self.spread_shift = lane(8 - bits)
        self.lane_mask = lane(int.from_bytes(bytes([(1 << bits) - 1]) * self.per, "little"))

    def encoded(self, shape):
        return {"codes": TensorDecl((packed_nbytes(nelements(shape), self.bits),), np.uint8)}

    def workspace(self, shape, phase):
        n = min(nelements(shape), self.chunk)
        return {"lanes": TensorDecl((packed_nbytes(n, self.bits),), self.lane)}

    def decoded_dtype(self, dtype):
        return np.dtype(np.uint8)

    def encode(self, xp, x, enc, ws):
        codes, dst, lanes = x.reshape(-1), enc["codes"], ws["lanes"]
        bits, per = self.bits, self.per
        n = codes.size
        if codes.dtype == np.uint8 and gpu_kernels.serves(xp):
            gpu_kernels.pack_codes(xp, codes, dst, bits, (self.encode, (x, enc, ws)))
            return
        if codes.dtype == np.uint8 and kernels.active(xp, codes, dst):
            kernels.pack_codes(codes, dst, bits)
            return
        full = n - n % per
        direct = codes.dtype == np.uint8
        for c0, c1 in chunks(full, self.chunk):       # chunk is a multiple of per
            nl = (c1 - c0) // per
            t = lanes[:nl]
            if direct:
                xp.multiply(codes[c0:c1].view(self.lane), self.k, out=t)
            else:
                xp.copyto(t.view(xp.uint8), codes[c0:c1], casting="unsafe")
                xp.multiply(t, self.k, out=t)
            xp.right_shift(t, self.gather_shift, out=t)
            xp.copyto(dst[c0 // per:c0 // per + nl], t, casting="unsafe")
        rest = n - full
        if rest:                              # the last, partial byte
            e = dst[full // per:full // per + 1]
            xp.copyto(e, codes[full:full + 1], casting="unsafe")
            for j in range(1, rest):
                xp.left_shift(e, U8(bits), out=e)
                xp.bitwise_or(e, codes[full + j:full + j + 1], out=e, casting="unsafe")
            xp.left_shift(e, U8(bits * (per - rest)), out=e)

    def decode(self, xp, enc, out, ws):
        src, flat, lanes = enc["codes"], out.reshape(-1), ws["lanes"]
        bits, per = self.bits, self.per
        n = flat.size
        if flat.dtype == np.uint8 and gpu_kernels.serves(xp):
            gpu_kernels.unpack_codes(xp, src, flat, bits, (self.decode, (enc, out, ws)))
            return
        if flat.dtype == np.uint8 and kernels.active(xp, src, flat):
            kernels.unpack_codes(src, flat, bits)
            return
        full = n - n % per
        direct = flat.dtype == np.uint8
        for c0, c1 in chunks(full, self.chunk):
            nl = (c1 - c0) // per
            t = lanes[:nl]
            xp.copyto(t, src[c0 // per:c0 // per + nl], casting="safe")
            xp.multiply(t, self.k, out=t)
            xp.right_shift(t, self.spread_shift, out=t)
            if direct:
                xp.bitwise_and(t, self.lane_mask, out=flat[c0:c1].view(self.lane))
            else:
                xp.bitwise_and(t, self.lane_mask, out=t)
                xp.copyto(flat[c0:c1], t.view(xp.uint8), casting="unsafe")
        mask = U8((1 << bits) - 1)
        for j in range(n - full):
            view = flat[full + j:full + j + 1]
            e = src[full // per:full // per + 1]
            xp.right_shift(e, U8(bits * (per - 1 - j)), out=view, casting="unsafe")
            xp.bitwise_and(view, mask, out=view, casting="unsafe")
