"""The arena: the one uint8 allocation that planned memory lives in (`new_arena`), and the
typed arrays at byte offsets of it (`view`)."""
import numpy as np


def view(arena, offset, shape, dtype):
    """An array of `shape`/`dtype` at byte `offset` of the uint8 `arena`."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return arena[offset:offset + nbytes].view(dtype).reshape(shape)


PAGE = 4096


def new_arena(xp, nbytes):
    """An uninitialised uint8 arena of `nbytes` whose first byte sits on a page boundary, so
    every planned buffer (at multiples of 256 bytes) starts on a cache line. numpy's own
    allocation starts 16 bytes past one: each 64-byte vector load or store of the kernels and
    of oneDNN's reorders then spans two cache lines, and training steps took about 5% longer
    (ResNet-20, Inception-small and VGG-small alike, with and without Gist: bench/README)."""
    raw = xp.empty(nbytes + PAGE, dtype=np.uint8)
    address = raw.ctypes.data if xp is np else raw.data.ptr
    start = (-address) % PAGE
    return raw[start:start + nbytes]
