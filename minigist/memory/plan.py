"""Where each buffer of a program lives, under one of three allocation modes.

- none: every buffer its own bytes (the reference, as in a framework without a planner);
- static: in-place sharing (the pairs of minigist.passes.inplace), then StaticPlanner
  offsets, all fixed before running;
- dynamic: in-place sharing, then a Pool that allocates each buffer before its first use and
  frees it after its last use, replayed here on integers (the executor replays the same calls
  on the real arena while it runs).

Persistent buffers (weights, their gradients, momentum) are laid out one after another at the
start of the arena in every mode; the plan covers the per-iteration rest.
"""
from dataclasses import dataclass

from ..errors import MemoryBudgetError
from ..program import ENCODED

# Gist's encoded stashes: made in the forward pass, kept into the backward (a pool hint).
# (FP32 stashes too was measured worse: they are the big buffers the holes are for.)
LONG_LIVED = (ENCODED,)
from . import align, plan_none
from .planner import StaticPlanner
from .pool import Pool

MODES = ("none", "static", "dynamic")


@dataclass
class Group:
    """Buffers that share one storage (a chain of in-place steps), or a single buffer."""
    members: list
    nbytes: int
    first_use: int
    last_use: int
    offset: int = 0
    long_lived: bool = False    # holds an encoded stash (kept into the backward): a pool hint


def storage_groups(program, inplace):
    """Group the per-iteration buffers into storages: in-place chains merged when `inplace`."""
    transient = [b for b in program.buffers.values() if not b.persistent]
    parent = {b.name: b.name for b in transient}

    def root(name):
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    if inplace:
        if program.inplace is None:
            raise ValueError("the in-place pass (minigist.passes.inplace.mark_inplace) has not run on this program")
        for source, target in program.inplace:
            parent[root(target)] = root(source)
    groups, by_root = [], {}
    for buffer in transient:
        key = root(buffer.name)
        if key not in by_root:
            by_root[key] = len(groups)
            groups.append(Group([], 0, buffer.first_use, buffer.last_use))
        group = groups[by_root[key]]
        group.members.append(buffer.name)
        group.nbytes = max(group.nbytes, buffer.nbytes)
        group.long_lived = group.long_lived or buffer.category in LONG_LIVED
        group.first_use = min(group.first_use, buffer.first_use)
        group.last_use = max(group.last_use, buffer.last_use)
    return groups


class MemoryPlan:
    """Offsets of every buffer of `program` relative to the start of its per-iteration region,
    and the numbers a footprint report needs."""

    def __init__(self, program, mode="static", alignment=256):
        if mode not in MODES:
            raise ValueError(f"alloc mode must be one of {MODES}, got {mode!r}")
        self.program = program
        self.mode = mode
        self.alignment = alignment
        persistent = {n: b.nbytes for n, b in program.buffers.items() if b.persistent}
        self.persistent_offsets, self.persistent_bytes = plan_none(persistent)
        self.groups = storage_groups(program, inplace=(mode != "none"))
        self.group_of = {name: index for index, group in enumerate(self.groups) for name in group.members}
        planner = StaticPlanner(alignment)
        for group in self.groups:
            planner.add_buffer(group.nbytes, group.first_use, group.last_use)
        self.lower_bound = planner.lower_bound()
        self.pool = None
        if mode == "none":
            offsets, self.transient_bytes = plan_none({i: g.nbytes for i, g in enumerate(self.groups)})
            for index, group in enumerate(self.groups):
                group.offset = offsets[index]
        elif mode == "static":
            planner.plan()
            self.transient_bytes = planner.arena_size()
            for index, group in enumerate(self.groups):
                group.offset = planner.offset(index)
        else:
            self.pool = replay_pool(self.groups, len(program.steps), Pool(alignment))
            self.transient_bytes = self.pool.high_water

    @property
    def footprint_bytes(self):
        return self.persistent_bytes + self.transient_bytes

    @property
    def live_peak_bytes(self):
        return self.persistent_bytes + self.lower_bound

    def offset(self, name):
        """Byte offset of buffer `name`: in the persistent region, or in the per-iteration one."""
        if name in self.persistent_offsets:
            return self.persistent_offsets[name]
        return self.groups[self.group_of[name]].offset

    def check_budget(self, budget, extra_bytes=0):
        """Fail before running when the plan does not fit `budget` bytes."""
        needed = self.footprint_bytes + extra_bytes
        if budget is not None and needed > budget:
            sizes = {}
            for buffer in self.program.buffers.values():
                sizes[buffer.name] = align(buffer.nbytes, self.alignment)
            top = sorted(sizes.items(), key=lambda item: -item[1])[:3]
            listed = ", ".join(f"{name} {nbytes:,}" for name, nbytes in top)
            # no flag named: the library raises it too (train.py prefixes its --memory-budget)
            raise MemoryBudgetError(f"the {self.mode} plan needs {needed:,} bytes, the budget "
                                    f"allows {budget:,} bytes; largest buffers: {listed}")


def replay_pool(groups, steps, pool):
    """Run `pool` over the program's allocation sequence: each group allocated before its first
    step and freed after its last. Returns the pool with its offsets recorded in the groups."""
    allocs, frees = schedule(groups, steps)
    for step in range(steps):
        for index in allocs[step]:
            groups[index].offset = pool.malloc(groups[index].nbytes, groups[index].long_lived)
        for index in frees[step]:
            pool.free(groups[index].offset)
    return pool


def schedule(groups, steps):
    """Per step: the groups to allocate before it and the groups to free after it."""
    allocs = [[] for _ in range(steps)]
    frees = [[] for _ in range(steps)]
    for index, group in enumerate(groups):
        allocs[group.first_use].append(index)
        frees[group.last_use].append(index)
    return allocs, frees
