"""The arena: the one uint8 allocation that planned memory lives in (`new_arena`), and the
typed arrays at byte offsets of it (`view`)."""
import numpy as np


def view(arena, offset, shape, dtype):
    """An array of `shape`/`dtype` at byte `offset` of the uint8 `arena`."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return arena[offset:offset + nbytes].view(dtype).reshape(shape)


class Views:
    """`view` that hands out one array object per (offset, shape, dtype): buffers that the plan
    puts on the same bytes in the same form (an in-place step's input and output) are then the
    same object. CuPy copies a ufunc input that overlaps its output unless the two are the same
    object (cupy/_core/_kernel.pyx), so separate views of one buffer would each cost a
    temporary outside the arena; numpy does not mind either way."""

    def __init__(self, arena, limit=1 << 14):
        self.arena, self.limit, self.kept = arena, limit, {}

    def __call__(self, offset, shape, dtype):
        key = (int(offset), tuple(int(d) for d in shape), np.dtype(dtype).str)
        array = self.kept.get(key)
        if array is None:
            if len(self.kept) >= self.limit:     # a dynamic plan's offsets come and go
                self.kept.clear()
            array = self.kept[key] = view(self.arena, offset, shape, dtype)
        return array


PAGE = 4096


def new_arena(xp, nbytes):
    """An uninitialised uint8 arena of `nbytes` whose first byte sits on a page boundary, so
    every planned buffer (at multiples of 256 bytes) starts on a cache line. numpy's own
    allocation starts 16 bytes past one: each 64-byte vector load or store of the kernels and
    of oneDNN's reorders then spans two cache lines, and training steps took about 5% longer
    (ResNet-20, Inception-small and VGG-small alike, with and without Gist: bench/README)."""
    raw = xp.empty(nbytes + PAGE, dtype=np.uint8)
    address = raw.ctypes.data if xp is np else xp.address(raw) if hasattr(xp, "address") else raw.data.ptr
    start = (-address) % PAGE
    return raw[start:start + nbytes]
