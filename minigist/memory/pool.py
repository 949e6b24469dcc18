"""The dynamic pool: allocates as the program runs, on integers only.

The pool hands out aligned blocks of one address range that grows at its top when no free
block fits (like an expandable segment). A request takes the best-fitting free block (the
smallest that holds it; a request marked long-lived, the lowest) and splits off the rest; a
freed block merges with free neighbours.
The pool measures what a dynamic allocator costs:

- `in_use` / `peak_in_use`: bytes in allocated blocks now / at most (the live peak);
- `high_water`: the top of the range at most, the memory the pool really needed;
- `high_water - peak_in_use`: the fragmentation.

`limit` caps the high-water mark; a request that would pass it raises MemoryBudgetError with
the request, the bytes in use and the limit.
"""
import bisect

from ..errors import MemoryBudgetError
from . import align


class Pool:
    def __init__(self, alignment=256, limit=None, limit_note=""):
        self.alignment = alignment
        self.limit = limit
        self.limit_note = limit_note      # where the limit comes from, for the error message
        self.top = 0                 # end of the range used so far
        self.free_blocks = []        # sorted list of (offset, size)
        self.allocated = {}          # offset -> size
        self.in_use = 0
        self.peak_in_use = 0
        self.high_water = 0
        self.mallocs = 0

    def malloc(self, nbytes, long_lived=False):
        """Return the offset of a new block of at least `nbytes` bytes. `long_lived` (a hint:
        an encoded stash, kept from the forward pass into the backward) takes the lowest free block that
        holds it instead of the best-fitting one: such blocks then pile up at the bottom
        instead of splitting the holes that the next large short-lived buffer needs."""
        size = align(max(int(nbytes), 1), self.alignment)
        best = None
        for position, (offset, block_size) in enumerate(self.free_blocks):
            if block_size >= size and (best is None or block_size < self.free_blocks[best][1]):
                best = position
                if block_size == size or long_lived:
                    break
        if best is not None:
            offset, block_size = self.free_blocks.pop(best)
            if block_size > size:   # split: the rest stays free
                bisect.insort(self.free_blocks, (offset + size, block_size - size))
        else:
            offset = self.top
            # a free block that ends at the top is extended instead of left behind
            if self.free_blocks and sum(self.free_blocks[-1]) == self.top:
                offset = self.free_blocks[-1][0]
            new_top = offset + size
            if self.limit is not None and new_top > self.limit:
                raise MemoryBudgetError(
                    f"memory pool: a request of {nbytes:,} bytes does not fit: {self.in_use:,} bytes "
                    f"in use, the pool would grow to {new_top:,} bytes, the limit is {self.limit:,} bytes{self.limit_note}")
            if offset != self.top:
                self.free_blocks.pop()
            self.top = new_top
            self.high_water = max(self.high_water, self.top)
        self.allocated[offset] = size
        self.in_use += size
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        self.mallocs += 1
        return offset

    def free(self, offset):
        size = self.allocated.pop(offset)
        self.in_use -= size
        position = bisect.bisect_left(self.free_blocks, (offset, 0))
        # merge with the free neighbour after, then the one before
        if position < len(self.free_blocks) and self.free_blocks[position][0] == offset + size:
            size += self.free_blocks.pop(position)[1]
        if position > 0 and sum(self.free_blocks[position - 1]) == offset:
            offset, before = self.free_blocks.pop(position - 1)
            size += before
            position -= 1
        self.free_blocks.insert(position, (offset, size))

    @property
    def fragmentation(self):
        return self.high_water - self.peak_in_use

    def block_size(self, offset):
        return self.allocated[offset]
