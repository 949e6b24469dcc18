"""The static planner: offsets for buffers with known sizes and lifetimes, on integers only.

    planner = StaticPlanner()
    a = planner.add_buffer(1024, first_use=0, last_use=2)
    b = planner.add_buffer(512, first_use=3, last_use=4)
    planner.plan()
    planner.offset(a), planner.offset(b), planner.arena_size()    # 0, 0, 1024

Two buffers may share bytes only if their lifetimes [first_use, last_use] are disjoint.
Placement is greedy (each buffer in turn at the best-fitting or the lowest gap between the
buffers already placed that are live at the same time, else on top), tried under several
orderings (largest first, longest first, largest area first, greedy by breadth, the buffers
live at the busiest steps stacked first, a skyline packing's); the smallest arena wins. Where
that arena is above the lower bound, a repair follows: from each greedy placement in turn,
smallest first, a buffer that ends at the top is moved to the front of its order and the
buffers placed again, kept when the top is no higher; where that stops lowering the top, a
buffer resting on a hole at a step that reaches the top is moved instead, so that it may drop
into the hole (an optimized plan with several peaks of nearly one height: ResNet-50's fp16
plan within 15%, 54.7 MB above the bound greedily, 31.5 MB after moving top buffers alone, 3.2
MB with the holes). `lower_bound()` is the most bytes live at any one step: no plan can be
smaller.
"""
import numpy as np

from . import align

# the busy steps the nested orders are anchored at, at most, and how far apart (steps)
ANCHORS, ANCHOR_GAP = 4, 3
# the repair of a plan above the lower bound (plan()): placements at most, and buffers placed in
# all (300 placements of an optimized ResNet-50 plan's 2,000 buffers, 181 of Inception-v3's
# 3,300), and how many tries in a row may fail to lower one start's top before moving buffers
# above holes instead, and how many of those before the next start (0: no moves above holes).
# Enough to repair from every start: which one repairs best is not the lowest greedy one
# (GoogLeNet's lossless plan within 15%, with top moves alone: 16.1 MB above its bound after 120
# placements, 3.2 MB after 300, from the order that placed it highest). Five hole moves: on
# eighteen optimized and Gist plans above their bounds, ten left 25.6 MB above them in all,
# five 24.4 MB (the placements go to later starts instead). A plan of so many buffers that
# REPAIR_WORK leaves it no more than REPAIR_STALL placements past its starts gets top moves only
REPAIR_PLACEMENTS, REPAIR_WORK, REPAIR_STALL, REPAIR_HOLE_STALL = 300, 600_000, 10, 5
# arenas whose every byte an int64 offset can name (the array placement's range)
_INT64_SAFE = 1 << 62


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

    def _live(self):
        """The (aligned) bytes live at each step."""
        steps = max(self.lasts) + 2
        delta = [0] * steps
        for size, first, last in zip(self.sizes, self.firsts, self.lasts):
            delta[first] += size
            delta[last + 1] -= size
        live, totals = 0, []
        for change in delta:
            live += change
            totals.append(live)
        return totals

    def lower_bound(self):
        """The largest sum of (aligned) sizes of the buffers live at one step."""
        return max(self._live()) if self.sizes else 0

    def _place(self, order, first_fit=False, give_up_at=None):
        """Offsets for the buffers in `order`, each in turn: in the smallest gap between the
        buffers already placed and live at the same time that holds it (best fit), or in the
        lowest such gap (first fit); on top when no gap holds it. None as soon as the top
        reaches `give_up_at` (the size of a plan already found: this one cannot be smaller)."""
        if sum(self.sizes) < _INT64_SAFE:
            return self._place_arrays(order, first_fit, give_up_at)
        return self._place_lists(order, first_fit, give_up_at)

    def _place_arrays(self, order, first_fit, give_up_at):
        """_place on int64 arrays (the same offsets as _place_lists, several times faster on
        the large nets' thousands of buffers: the repair places them many times): the placed
        buffers live at the same time are found by comparing lifetimes, and the gaps between
        them, sorted as (offset, end), are the offsets less the highest end below each."""
        firsts, lasts, starts_at, ends_at = np.zeros((4, len(order)), dtype=np.int64)
        offsets = [None] * len(self.sizes)
        top = 0
        for placed, index in enumerate(order):
            first, last, size = self.firsts[index], self.lasts[index], self.sizes[index]
            together = (firsts[:placed] <= last) & (lasts[:placed] >= first)
            starts, ends = starts_at[:placed][together], ends_at[:placed][together]
            offset = 0
            if starts.size:
                ranked = np.lexsort((ends, starts))
                starts, ends = starts[ranked], ends[ranked]
                highest = np.maximum.accumulate(ends)
                cursors = np.concatenate(([0], highest[:-1]))
                fits = np.flatnonzero(starts - cursors >= size)
                if fits.size == 0:
                    offset = int(highest[-1])
                elif first_fit:
                    offset = int(cursors[fits[0]])
                else:
                    offset = int(cursors[fits[np.argmin((starts - cursors)[fits])]])
            offsets[index] = offset
            firsts[placed], lasts[placed], starts_at[placed], ends_at[placed] = first, last, offset, offset + size
            top = max(top, offset + size)
            if give_up_at is not None and top >= give_up_at:
                return None
        return offsets, top

    def _place_lists(self, order, first_fit, give_up_at):
        """_place on Python integers (sizes past what int64 holds)."""
        offsets = [None] * len(self.sizes)
        steps = max(self.lasts) + 1
        # the placed buffers' (offset, end) by the steps they are live at and by their first
        # use: those live at the same time as [first, last] are the ones live at `first` and
        # the ones first used in (first, last], each found once, without a scan of every buffer
        live_at = [[] for _ in range(steps)]
        starting_at = [[] for _ in range(steps)]
        top = 0
        for index in order:
            first, last, size = self.firsts[index], self.lasts[index], self.sizes[index]
            busy = live_at[first] + [span for step in range(first + 1, last + 1) for span in starting_at[step]]
            busy.sort()
            best_offset, best_gap = None, None
            cursor = 0
            for start, end in busy:
                gap = start - cursor
                if gap >= size and (best_gap is None or gap < best_gap):
                    best_offset, best_gap = cursor, gap
                    if first_fit:
                        break
                cursor = max(cursor, end)
            offset = best_offset if best_offset is not None else cursor
            offsets[index] = offset
            span = (offset, offset + size)
            for step in range(first, last + 1):
                live_at[step].append(span)
            starting_at[first].append(span)
            top = max(top, offset + size)
            if give_up_at is not None and top >= give_up_at:
                return None
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
        """The buffers live at a busy step first, then the rest by size. Those buffers (a
        stash kept from the forward pass into the backward) are mostly nested: made in one
        order, freed in the reverse. Stacked by first use they leave no holes; by size,
        another tie-break; by last use, the last freed at the bottom, which also leaves none
        where the nesting is broken (a stash freed early in the backward pass above one made
        before it). Anchored at the busiest step, and the last order at the next busiest
        ones too (up to ANCHORS steps, at least ANCHOR_GAP steps apart): an optimized plan has
        several peaks of nearly the same height, whose buffers the other orders stack
        against each other (13% above the lower bound on VGG-16's smallest fp8 plan)."""
        if not self.sizes:
            return []
        totals = self._live()
        anchors = []
        for step in sorted(range(len(totals)), key=lambda s: (-totals[s], s)):
            if all(abs(step - anchor) > ANCHOR_GAP for anchor in anchors):
                anchors.append(step)
                if len(anchors) == ANCHORS:
                    break
        count = range(len(self.sizes))
        at_peak = [self.firsts[i] <= anchors[0] <= self.lasts[i] for i in count]
        orders = [sorted(count, key=lambda i: (0, self.firsts[i], -self.sizes[i]) if at_peak[i]
                         else (1, -self.sizes[i], self.firsts[i])),
                  sorted(count, key=lambda i: (0 if at_peak[i] else 1, -self.sizes[i], self.firsts[i]))]
        for anchor in anchors:
            at = [self.firsts[i] <= anchor <= self.lasts[i] for i in count]
            orders.append(sorted(count, key=lambda i: (0, -self.lasts[i], -self.sizes[i]) if at[i]
                                 else (1, -self.sizes[i], self.firsts[i])))
        return orders

    def _skyline_order(self):
        """The order a skyline packing places the buffers in (bottom-left strip packing with the
        steps across): at the steps where the placed buffers reach least high (the lowest run
        of steps, the earliest of equals), the largest buffer not yet placed whose lifetime lies
        within them (the earliest of equals) goes on top of them; where none does, those steps
        are raised to the lower of their neighbours, the bytes in between left unused. Placed
        greedily in this order, each buffer lands where the skyline put it. It packs some plans
        that every order above leaves far above the bound, at the bound (GoogLeNet's lossless plan
        with 5-replay chains within 15%: 13.6 MB above after a repair of top moves alone, at the
        bound with it)."""
        sizes = np.array(self.sizes, dtype=self._byte_dtype())
        firsts, lasts = np.array(self.firsts), np.array(self.lasts)
        rank = np.empty(len(sizes), dtype=np.int64)
        rank[self._largest_first()] = np.arange(len(sizes))
        heights = np.zeros(int(lasts.max()) + 1, dtype=sizes.dtype)
        left = np.ones(len(sizes), dtype=bool)
        order = []
        while len(order) < len(sizes):
            low = heights.min()
            start = int(np.argmax(heights == low))
            end = start
            while end + 1 < len(heights) and heights[end + 1] == low:
                end += 1
            fits = np.flatnonzero(left & (firsts >= start) & (lasts <= end))
            if fits.size:
                index = int(fits[np.argmin(rank[fits])])
                heights[firsts[index]:lasts[index] + 1] = low + sizes[index]
                left[index] = False
                order.append(index)
            else:
                beside = [heights[step] for step in (start - 1, end + 1) if 0 <= step < len(heights)]
                heights[start:end + 1] = min(beside)
        return order

    def _byte_dtype(self):
        """The array dtype for byte counts and offsets: int64 where the arena's every byte fits
        in one, Python integers past that."""
        return np.int64 if sum(self.sizes) < _INT64_SAFE else object

    def _largest_first(self):
        """The buffers largest first, the earliest first use among equals."""
        return sorted(range(len(self.sizes)), key=lambda i: (-self.sizes[i], self.firsts[i]))

    def _orders(self):
        """The orders plan() places the buffers in, each tried with best fit, then first fit
        (made one at a time: the search ends at the first that reaches the lower bound)."""
        count = range(len(self.sizes))
        yield self._largest_first()
        yield sorted(count, key=lambda i: (-(self.lasts[i] - self.firsts[i]), -self.sizes[i], self.firsts[i]))
        yield sorted(count, key=lambda i: (-self.sizes[i] * (self.lasts[i] - self.firsts[i] + 1), self.firsts[i]))
        yield self._breadth_order()
        yield from self._nested_orders()
        yield self._skyline_order()

    def plan(self):
        if not self.sizes:
            self.offsets, self._arena_size = [], 0
            return self
        # the first smallest arena wins: a trial stops once it reaches the best one's size, an
        # order tried before is not tried again, and a plan at the lower bound ends the search
        bound, best, tried = self.lower_bound(), None, []
        for order in self._orders():
            if best is not None and best[1] == bound:
                break
            if order in tried:
                continue
            tried.append(order)
            for first_fit in (False, True):
                if best is not None and best[1] == bound:
                    break
                placed = self._place(order, first_fit, give_up_at=None if best is None else best[1])
                if placed is not None:
                    best = placed
        if best[1] > bound:
            best = self._repair([(order, first_fit) for order in tried for first_fit in (False, True)], best, bound)
        self.offsets, self._arena_size = best
        return self

    def _repair(self, starts, best, bound):
        """The best of `best` and the placements a repair reaches from each start (order,
        first_fit), the lowest greedy placements first, within REPAIR_PLACEMENTS placements
        and REPAIR_WORK buffers placed (the starts' own placements among them). A move puts
        one buffer at the front of the order and places them all again, kept where the top is
        no higher. The move is of a buffer that ends at the top (the first such buffer in the
        order, then the next, round robin); after REPAIR_STALL tries in a row that do not
        lower the top, of a buffer resting on a hole (_above_holes, round robin), until one
        lowers the top (then top buffers again) or REPAIR_HOLE_STALL tries in a row do not,
        which ends the start. Moving top buffers alone leaves the holes that peaks of nearly
        one height force on each other; a buffer above a hole, placed first, can drop into it.
        A heuristic: the hole moves spend placements the top moves spent on later starts, and
        a few plans pack worse for it (NiN's fp16 plan within 15%: 0.65 MB above its bound
        with top moves alone, 2.66 MB with both)."""
        budget = max(min(REPAIR_PLACEMENTS, REPAIR_WORK // len(self.sizes)), len(starts) + REPAIR_STALL)
        greedy = []
        for index, (order, first_fit) in enumerate(starts):
            offsets, top = self._place(order, first_fit)
            greedy.append((top, index, order, first_fit, offsets))
        budget -= len(starts)
        for top, _, order, first_fit, offsets in sorted(greedy, key=lambda start: start[:2]):
            stalled, top_turn, hole_turn, holes = 0, 0, 0, False
            while budget > 0 and best[1] > bound:
                if not holes and stalled >= REPAIR_STALL:
                    stalled, holes = 0, True
                if holes and stalled >= REPAIR_HOLE_STALL:
                    break
                budget -= 1
                if holes:
                    above = self._above_holes(offsets, top)
                    moved = above[hole_turn % len(above)]
                    hole_turn += 1
                else:
                    at_top = [i for i in order if offsets[i] + self.sizes[i] == top]
                    moved = at_top[top_turn % len(at_top)]
                    top_turn += 1
                trial = [moved] + [i for i in order if i != moved]
                placed = self._place(trial, first_fit, give_up_at=top + 1)
                if placed is None:
                    stalled += 1
                    continue
                lowered = placed[1] < top
                stalled = 0 if lowered else stalled + 1
                holes = holes and not lowered
                order, (offsets, top) = trial, placed
                if top < best[1]:
                    best = placed
            if budget <= 0 or best[1] == bound:
                break
        return best

    def _above_holes(self, offsets, top):
        """The buffers that rest on a hole (bytes free below them, above the buffers under
        them) at a step where some buffer reaches `top`, the largest hole first (the largest
        one under it at any such step; the first index among equals). Above the lower bound,
        every such step has one. Empty buffers are left out: they fill no hole, and one
        sharing an offset with a buffer would take that buffer's hole."""
        dtype = self._byte_dtype()
        sizes, firsts, lasts = np.array(self.sizes, dtype=dtype), np.array(self.firsts), np.array(self.lasts)
        starts = np.array(offsets, dtype=dtype)
        ends = starts + sizes
        steps = set()
        for index in np.flatnonzero(ends == top):
            steps.update(range(firsts[index], lasts[index] + 1))
        hole_under = {}
        for step in sorted(steps):
            live = np.flatnonzero((firsts <= step) & (lasts >= step) & (sizes > 0))
            live = live[np.argsort(starts[live], kind="stable")]
            below = np.concatenate(([0], np.maximum.accumulate(ends[live])[:-1]))
            for index, hole in zip(live, starts[live] - below):
                if hole > hole_under.get(int(index), 0):
                    hole_under[int(index)] = hole
        return sorted(hole_under, key=lambda index: (-hole_under[index], index))

    def offset(self, index):
        if self.offsets is None:
            self.plan()
        return self.offsets[index]

    def arena_size(self):
        if self.offsets is None:
            self.plan()
        return self._arena_size
