"""The static planner: offsets for buffers with known sizes and lifetimes, on integers only.

    planner = StaticPlanner()
    a = planner.add_buffer(1024, first_use=0, last_use=2)
    b = planner.add_buffer(512, first_use=3, last_use=4)
    planner.plan()
    planner.offset(a), planner.offset(b), planner.arena_size()    # 0, 0, 1024

Two buffers may share bytes only if their lifetimes [first_use, last_use] are disjoint.
Placement is greedy (each buffer in turn at the best-fitting or the lowest gap between the
buffers already placed that are live at the same time, else on top), tried under several orderings (largest
first, longest first, largest area first, greedy by breadth, the busiest step's buffers
stacked first); the smallest arena wins. `lower_bound()` is the most bytes live at any one step: no plan can be
smaller.
"""
import numpy as np

from . import align


class StaticPlanner:
    def __init__(self, alignment=256):
        self.alignment = alignment
        self.sizes, self.firsts, self.lasts = [], [], []
        self.offsets = None

    def add_buffer(self, nbytes, first_use, last_use):
        if last_use < first_use:
            raise ValueError(f"buffer ends (step {last_use}) before it starts (step {first_use})")
        self.sizes.append(align(nbytes, self.alignment))
        self.firsts.append(int(first_use))
        self.lasts.append(int(last_use))
        self.offsets = None
        return len(self.sizes) - 1

    def __len__(self):
        return len(self.sizes)

    def lower_bound(self):
        """The largest sum of (aligned) sizes of the buffers live at one step."""
        if not self.sizes:
            return 0
        steps = max(self.lasts) + 2
        delta = [0] * steps
        for size, first, last in zip(self.sizes, self.firsts, self.lasts):
            delta[first] += size
            delta[last + 1] -= size
        live, best = 0, 0
        for change in delta:
            live += change
            best = max(best, live)
        return best

    def _place(self, order, first_fit=False):
        """Offsets for the buffers in `order`, each in turn: in the smallest gap between the
        buffers already placed and live at the same time that holds it (best fit), or in the
        lowest such gap (first fit); on top when no gap holds it."""
        count = len(self.sizes)
        offsets = [None] * count
        firsts = np.asarray(self.firsts, dtype=np.int64)
        lasts = np.asarray(self.lasts, dtype=np.int64)
        sizes = np.asarray(self.sizes, dtype=np.int64)
        # the buffers placed so far, in placing order (arrays: the search is over all of them)
        placed_first, placed_last = np.empty(count, np.int64), np.empty(count, np.int64)
        placed_start, placed_end = np.empty(count, np.int64), np.empty(count, np.int64)
        top = 0
        for placed, index in enumerate(order):
            first, last, size = firsts[index], lasts[index], sizes[index]
            live = (placed_first[:placed] <= last) & (first <= placed_last[:placed])
            starts, ends = placed_start[:placed][live], placed_end[:placed][live]
            offset = 0
            if len(starts):
                by_place = np.lexsort((ends, starts))
                starts, ends = starts[by_place], ends[by_place]
                # the lowest free byte before each busy range: the highest end below it so far
                cursors = np.concatenate(([0], np.maximum.accumulate(ends)[:-1]))
                gaps = starts - cursors
                fitting = np.flatnonzero(gaps >= size)
                if len(fitting):
                    pick = fitting[0] if first_fit else fitting[np.argmin(gaps[fitting])]
                    offset = int(cursors[pick])
                else:
                    offset = max(0, int(ends.max()))
            offsets[index] = offset
            placed_first[placed], placed_last[placed] = first, last
            placed_start[placed], placed_end[placed] = offset, offset + size
            top = max(top, offset + int(size))
        return offsets, top

    def _breadth_order(self):
        """Greedy by breadth (as TFLite's arena planner): the steps with the most bytes live
        first, and at each step its live buffers, largest first."""
        steps = max(self.lasts) + 1 if self.sizes else 0
        live = [[] for _ in range(steps)]
        for index, (first, last) in enumerate(zip(self.firsts, self.lasts)):
            for step in range(first, last + 1):
                live[step].append(index)
        totals = [sum(self.sizes[i] for i in members) for members in live]
        order, seen = [], set()
        for step in sorted(range(steps), key=lambda s: -totals[s]):
            for index in sorted(live[step], key=lambda i: -self.sizes[i]):
                if index not in seen:
                    seen.add(index)
                    order.append(index)
        return order

    def _nested_orders(self):
        """The buffers live at the busiest step first, then the rest by size. Those buffers
        (a stash kept from the forward pass into the backward) are mostly nested: made in
        one order, freed in the reverse. Stacked by first use they leave no holes; by size,
        another tie-break."""
        if not self.sizes:
            return []
        steps = max(self.lasts) + 2
        delta = [0] * steps
        for size, first, last in zip(self.sizes, self.firsts, self.lasts):
            delta[first] += size
            delta[last + 1] -= size
        live, busiest, most = 0, 0, -1
        for step, change in enumerate(delta):
            live += change
            if live > most:
                busiest, most = step, live
        count = range(len(self.sizes))
        at_peak = [self.firsts[i] <= busiest <= self.lasts[i] for i in count]
        return [sorted(count, key=lambda i: (0, self.firsts[i], -self.sizes[i]) if at_peak[i]
                       else (1, -self.sizes[i], self.firsts[i])),
                sorted(count, key=lambda i: (0 if at_peak[i] else 1, -self.sizes[i], self.firsts[i]))]

    def plan(self):
        count = range(len(self.sizes))
        orders = [
            sorted(count, key=lambda i: (-self.sizes[i], self.firsts[i])),
            sorted(count, key=lambda i: (-(self.lasts[i] - self.firsts[i]), -self.sizes[i], self.firsts[i])),
            sorted(count, key=lambda i: (-self.sizes[i] * (self.lasts[i] - self.firsts[i] + 1), self.firsts[i])),
            self._breadth_order(),
        ] + self._nested_orders()
        best = None
        for order in orders:
            for first_fit in (False, True):
                offsets, top = self._place(order, first_fit)
                if best is None or top < best[1]:
                    best = (offsets, top)
        self.offsets, self._arena_size = best
        return self

    def offset(self, index):
        if self.offsets is None:
            self.plan()
        return self.offsets[index]

    def arena_size(self):
        if self.offsets is None:
            self.plan()
        return self._arena_size
