"""Fit a memory budget: for every tensor stashed for the backward pass, choose between keeping
it in fp32, a lossless encoding (Gist's rules: the 1-bit ReLU mask, the fused ReLU->MaxPool
code, SSDC at its measured density), a reduced precision (DPR in the --dpr format, when lossy
is allowed) and recomputation, so that the exact static plan fits the budget at the least
predicted step time.

    plan = minigist.optimize("models/resnet20.prototxt", 40_000_000, batch_size=32)
    plan.footprint_bytes, plan.predicted_overhead, plan.decisions
    net = minigist.Net("models/resnet20.prototxt", batch_size=32, plan=plan)

The optimizer chooses, the passes apply: a decision is an `Options` (Gist overrides by tensor,
the tensors to recompute), compiled by the one pipeline (minigist.pipeline.compile), and the
plan reported is that compiled plan, never an estimate.

How it decides. The model is an integer one on the steps of the unoptimized program (every
stash kept): the bytes live at each step (the static planner reaches that lower bound on every
bundled model), and, per stashed tensor and choice, the intervals of bytes the choice takes
away or adds, read off real compiled programs (one with Gist's lossless rules applied
everywhere, one with the lossy encoding everywhere) mapped back onto those steps; a
recomputation's rebuilt copy, the chain of forward steps it replays from kept tensors and the
maps that chain rebuilds on the way come from the program itself. Time added per choice comes
from the cost model (minigist/costmodel.py). Recomputing a tensor whose source is itself
dropped and rebuilt only later replays the source's chain too (a pair variable carries that
time and memory); deeper chains are not chosen. That is a 0-1 program: minimize the time added
such that the bytes at every step stay under the budget, solved by HiGHS's MILP solver
(scipy.optimize.milp). The choice is then compiled; the model's error at that choice (the
in-place pairs it frees, codes that change with their neighbours) is measured step by step
against the compiled program and carried into the next solve, a few times, until the exact
plan fits. Deterministic for a given cost model: the solver runs without a time limit on one
thread.
"""
import math
from dataclasses import dataclass, field

import numpy as np

from .costmodel import step_flops
from .errors import MinigistError
from .memory import align
from .memory.report import footprint_report, live_by_step
from .pipeline import Options, compile
from .program import INPUT, STASH

KEEP = "fp32"
RECOMPUTE = "recompute"
ROUNDS = 5              # compiles of candidate plans per solve, at most
# the solver's stopping rules, all deterministic (no time limit): a solution within these
# fractions of the best possible one, or the best found after NODE_LIMIT branch-and-bound nodes
PEAK_GAP = 1e-3
TIME_GAP = 1e-2
NODE_LIMIT = 3000
_MIB = float(1 << 20)   # the solver works in MiB


def _require_scipy():
    try:
        from scipy.optimize import milp  # noqa: F401
    except ImportError:
        raise MinigistError("--optimize needs scipy (HiGHS's MILP solver): pip install 'minigist[optimize]'") from None


@dataclass
class Decision:
    """One stashed tensor's choice, as the report's decisions table shows it."""
    tensor: str
    layer: str
    choice: str               # fp32, an encoding name (mask-1bit, ssdc, relu-pool-4bit (dropped), fp16, ...), recompute
    raw_bytes: int
    bytes_saved: int          # stash bytes no longer kept from the forward pass into the backward
    seconds_added: float      # predicted time the choice adds to a step

    def to_json(self):
        return {"tensor": self.tensor, "layer": self.layer, "choice": self.choice, "raw_bytes": self.raw_bytes,
                "bytes_saved": self.bytes_saved, "time_added_s": self.seconds_added}


@dataclass
class OptimizedPlan:
    """A plan the optimizer chose: `options` compile to `compiled` (the exact plan); the
    footprint counts the evaluation program's part where it needs more (as Net does)."""
    options: Options
    compiled: object
    budget_bytes: object          # None: the smallest plan was asked for
    footprint_bytes: int
    baseline_footprint_bytes: int  # the same settings, every stash kept in fp32 (--gist none)
    predicted_seconds: float
    baseline_seconds: float
    cost_model: object
    decisions: list = field(default_factory=list)
    rounds: int = 0               # candidate plans compiled

    @property
    def predicted_overhead(self):
        return self.predicted_seconds / self.baseline_seconds - 1.0

    @property
    def ratio(self):
        return self.baseline_footprint_bytes / self.footprint_bytes

    def to_json(self):
        return {"budget_bytes": self.budget_bytes, "footprint_bytes": self.footprint_bytes,
                "baseline_footprint_bytes": self.baseline_footprint_bytes,
                "predicted_overhead": round(self.predicted_overhead, 6),
                "predicted_step_s": self.predicted_seconds, "baseline_step_s": self.baseline_seconds,
                "cost_model": self.cost_model.describe(), "cost_model_detail": self.cost_model.to_json(),
                "overrides": dict(self.options.overrides), "recompute": list(self.options.recompute),
                "decisions": [d.to_json() for d in self.decisions]}


@dataclass(eq=False)
class _Option:
    name: str
    override: object           # the Gist override it needs (None: the lossless rule decides)
    recompute: bool
    intervals: list            # [(first step, last step, bytes)] relative to keeping the tensor
    seconds: float             # time added relative to keeping it
    holds_values: bool = True  # a replay may read it (not a 1-bit mask, not folded into a pool's codes)
    whole_decode: bool = False  # decoded whole before its first reader (not slice by slice, not read as fp16)


@dataclass
class _Extra:
    ands: list                 # [[(tensor, option), ...], ...]: holds when every pair of one group is chosen
    intervals: list
    seconds: float


@dataclass
class _Stash:
    tensor: str
    layer: str
    nbytes: int               # aligned
    raw: int
    produced: int
    last_forward: int
    first_reader: int
    last_reader: int
    options: list = field(default_factory=list)
    sources: tuple = ()       # stashed blobs a replay starts from
    chain_seconds: float = 0.0
    chain_flops: int = 0
    chain_bytes: int = 0      # maps a replay rebuilds on the way (its own, freed when done)


def _positions(program, base_labels):
    """Each step of `program` as the index of a step of the unoptimized program: its own, or
    (a step a pass inserted) the one it runs next to (an encode: its producer; a decode or a
    replay: the reader it runs before)."""
    original = ("forward", "backward", "seed", "zero", "accumulate", "update")
    positions, j, last = [], 0, len(base_labels) - 1
    for step in program.steps:
        if j <= last and step.kind in original and step.label == base_labels[j]:
            positions.append(j)
            j += 1
        else:
            positions.append(max(0, j - 1) if step.kind == "encode" else min(j, last))
    if j != len(base_labels):
        raise AssertionError(f"program steps do not follow the unoptimized program's (matched {j} of {len(base_labels)})")
    return positions


def _on_base(values, positions, size):
    """Per step of the unoptimized program: the largest of `values` at the steps mapped to it."""
    out = np.zeros(size, dtype=np.float64)
    np.maximum.at(out, np.asarray(positions), np.asarray(values, dtype=np.float64))
    return out


class Optimizer:
    """The model of one net under fixed settings (`options`: batch, engine, update, densities;
    its gist, overrides and recompute are ignored), for one cost model. `lossy`: DPR (in
    options.dpr) may be chosen."""

    def __init__(self, model, options, cost_model, lossy=False):
        _require_scipy()
        if options.alloc != "static":
            raise MinigistError(f"--optimize plans for --alloc static (the exact plan), not {options.alloc}")
        self.model = model
        self.lossy = lossy
        self.cost = cost_model
        self.options = options.replace(gist="lossless", overrides=(), recompute=(), budget=None)
        self.base = compile(model, self.options.replace(gist="none"))
        self.graph = self.base.graph
        self.eval_transient = compile(model, self.options, "TEST", graph=None).plan.transient_bytes
        program = self.base.program
        self.steps = len(program.steps)
        self.labels = [s.label for s in program.steps]
        self.base_seconds = self.cost.program_seconds(program)
        self.step_cost = [self.cost.step_seconds(s, program) for s in program.steps]
        self.base_live = live_by_step(self.base.plan).astype(np.float64)
        self.first_backward = next(i for i, s in enumerate(program.steps) if s.kind != "forward")
        self.baseline_footprint = self._needed(self.base)
        self.stashes = self._stashes()
        self.lossless = compile(model, self.options)
        self._add_codec_options(self.lossless, lossy=False)
        if lossy:
            overrides = {}
            for stash in self.stashes.values():
                if not self._may_override(stash):
                    continue
                encoding = self.lossless.program.encodings.get(f"blob:{stash.tensor}")
                if encoding is not None and encoding.name == "ssdc":
                    overrides[stash.tensor] = f"ssdc-{options.dpr}"
                elif self._dpr_applies(program.buffers[f"blob:{stash.tensor}"]):
                    overrides[stash.tensor] = options.dpr
            if overrides:
                self._add_codec_options(compile(model, self.options.replace(overrides=overrides)), lossy=True,
                                        overrides=overrides)
        for stash in self.stashes.values():
            self._add_recompute_option(stash)
        self.extras, self.forbidden = self._interactions()
        # the model is exact where it was measured: start from the lossless rules everywhere
        self.correction = np.zeros(self.steps)
        rules = {t: next((o for o in s.options if o.override is None and not o.recompute), s.options[0])
                 for t, s in self.stashes.items()}
        self.initial_correction = self._residual(rules, self.lossless)
        self.correction = self.initial_correction

    # ---- the model ----------------------------------------------------------------------
    def _needed(self, compiled):
        """Bytes the plan needs: its footprint, and the evaluation program's part where larger."""
        plan = compiled.plan
        return plan.footprint_bytes + max(0, self.eval_transient - plan.transient_bytes)

    def _dpr_applies(self, buffer):
        return (buffer.dtype == np.float32 and buffer.nbytes >= 4096 and len(buffer.shape) >= 2
                and buffer.shape[0] == self.graph.batch_size)

    def _may_override(self, stash):
        """An override by tensor name that cannot reach another tensor: Gist's overrides also
        match layer names, so a blob named as a layer with saved stashes (a pool's argmax) or
        whose codes fuse with a ReLU's (a max-pool) keeps the lossless rule."""
        node = self.graph.node_of(stash.tensor) if stash.tensor in {n.layer.name for n in self.graph.nodes} else None
        if node is None:
            return True
        layer = node.layer
        has_saved = any(b.kind == "saved" and b.layer == layer.name for b in self.base.program.buffers.values())
        return not has_saved and layer.type != "Pooling"

    def _stashes(self):
        program = self.base.program
        stashes = {}
        for name, buffer in program.buffers.items():
            if buffer.kind != "blob" or buffer.category != STASH:
                continue
            uses = [i for i, s in enumerate(program.steps) if name in set(s.buffer_names())]
            forward = [i for i in uses if i < self.first_backward]
            backward = [i for i in uses if i >= self.first_backward]
            if not forward or not backward:
                continue
            stash = _Stash(buffer.tensor, buffer.layer, align(buffer.nbytes), buffer.nbytes, buffer.first_use,
                           max(forward), min(backward), max(backward))
            stash.options.append(_Option(KEEP, KEEP, False, [], 0.0))
            stashes[buffer.tensor] = stash
        return stashes

    def _freed(self, stash):
        """The fp32 tensor no longer kept after its last forward use."""
        if stash.last_forward + 1 > stash.last_reader:
            return []
        return [(stash.last_forward + 1, stash.last_reader, -stash.nbytes)]

    def _add_codec_options(self, compiled, lossy, overrides=None):
        """An option per stash that `compiled` encodes (its encoding's buffers and steps), from
        the lossless rules' program or, `lossy`, the program with `overrides`."""
        program = compiled.program
        positions = _positions(program, self.labels)
        owned = {}          # tensor -> [buffer names]
        for name, buffer in program.buffers.items():
            if buffer.kind in ("enc", "dec"):
                owned.setdefault(buffer.tensor, []).append(name)
            elif buffer.kind == "ws" and buffer.tensor.endswith((".encode", ".decode")):
                owned.setdefault(buffer.tensor.rsplit(".", 1)[0], []).append(name)
        reverse = {n: t for t, names in owned.items() for n in names}
        seconds = {}
        for index, step in enumerate(program.steps):
            cost = self.cost.step_seconds(step, program)
            if step.kind in ("encode", "decode"):
                seconds[step.note] = seconds.get(step.note, 0.0) + cost
                continue
            if step.kind not in ("forward", "backward"):
                continue
            readers = {reverse[n] for n in step.buffer_names() if n in reverse}
            delta = cost - self.step_cost[positions[index]]
            for tensor in readers:
                seconds[tensor] = seconds.get(tensor, 0.0) + delta / len(readers)
        for tensor, stash in self.stashes.items():
            encoding = program.encodings.get(f"blob:{tensor}")
            if encoding is None or encoding.name == "recomputed":
                continue
            if lossy and (overrides or {}).get(tensor) is None:
                continue
            intervals = self._freed(stash)
            for name in owned.get(tensor, []):
                buffer = program.buffers[name]
                intervals.append((positions[buffer.first_use], positions[buffer.last_use], align(buffer.nbytes)))
            label = encoding.name
            if label == "dropped":
                label = "dropped (in the pool's codes)"
            override = overrides[tensor] if lossy else None
            decoded = program.buffers.get(encoding.decoded) if encoding.decoded else None
            holds_values = encoding.codec is not None and encoding.name not in ("mask-1bit",)
            whole = decoded is not None and decoded.nbytes >= stash.raw
            stash.options.append(_Option(label, override, False, intervals, seconds.get(tensor, 0.0),
                                         holds_values=holds_values, whole_decode=whole))

    def _add_recompute_option(self, stash):
        program, graph = self.base.program, self.graph
        chain, sources, seen = [], set(), set()

        def visit(name):
            buffer = program.buffers[name]
            if buffer.category in (STASH, INPUT) and name != f"blob:{stash.tensor}":
                if buffer.category == STASH and buffer.kind == "blob":
                    sources.add(buffer.tensor)
                return buffer.category == INPUT or buffer.kind == "blob"
            index = graph.blobs[buffer.tensor].producer
            if index in seen:
                return True
            seen.add(index)
            step = program.steps[index]
            if step.kind != "forward" or not step.layer.recomputable:
                return False
            if not all(visit(x) for x in step.args["x"]):
                return False
            chain.append(index)
            return True

        if not visit(f"blob:{stash.tensor}"):
            return
        stash.sources = tuple(sorted(s for s in sources if s in self.stashes))
        stash.chain_seconds = sum(self.step_cost[i] for i in chain)
        stash.chain_flops = sum(step_flops(program.steps[i]) for i in chain)
        scratch = 0
        for index in chain:
            step = program.steps[index]
            for role in ("y", "ws", "saved"):
                for name in set(step.buffer_names((role,))):
                    if name != f"blob:{stash.tensor}":
                        scratch += align(program.buffers[name].nbytes)
        stash.chain_bytes = scratch
        at = stash.first_reader
        intervals = self._freed(stash) + [(at, stash.last_reader, stash.nbytes)]
        if scratch:
            intervals.append((at, at, scratch))
        stash.options.append(_Option(RECOMPUTE, None, True, intervals, stash.chain_seconds))

    def _interactions(self):
        """What one tensor's choice does to another's, as (extra terms, forbidden pairs).

        An extra term holds when, for one of its `ands` groups, every (tensor, option) in it is
        chosen; it adds its intervals of bytes and its seconds:
        - a tensor recomputed from a source that is recomputed too but rebuilt only later: the
          replay rebuilds the source on the way (its chain's time, its bytes for the segment);
        - a source kept encoded and read by a replay: its decoded copy is made before the
          first replay that reads it, not before its own first reader (and is whole, where its
          readers would have decoded it slice by slice or read fp16 codes as they are).
        Forbidden: a recomputed tensor's source in a code that holds no values (a ReLU's 1-bit
        mask, or its place in a pool's codes): Gist gives a replay's source values."""
        extras, forbidden = [], []
        recompute = {t: o for t, s in self.stashes.items() for o in s.options if o.recompute}
        dependents = {}
        for tensor, stash in self.stashes.items():
            if tensor not in recompute:
                continue
            for source in stash.sources:
                dependents.setdefault(source, []).append(tensor)
                other = self.stashes[source]
                if source in recompute and other.first_reader > stash.first_reader:
                    pair = [(tensor, recompute[tensor]), (source, recompute[source])]
                    at = stash.first_reader
                    extras.append(_Extra([pair], [(at, at, other.nbytes + other.chain_bytes)], other.chain_seconds))
                    for deeper in other.sources:        # no chains of three
                        if deeper in recompute and self.stashes[deeper].first_reader > stash.first_reader:
                            forbidden.append(pair + [(deeper, recompute[deeper])])
        for source, tensors in dependents.items():
            other = self.stashes[source]
            tensors = sorted(tensors, key=lambda t: self.stashes[t].first_reader)
            for option in other.options:
                if option.recompute or option.name == KEEP:
                    continue
                if not option.holds_values:
                    for tensor in tensors:
                        forbidden.append([(tensor, recompute[tensor]), (source, option)])
                    continue
                end = other.first_reader - 1 if option.whole_decode else other.last_reader
                if not option.whole_decode:     # one decode step of the whole tensor, where none was
                    encoded = sum(n for _, _, n in option.intervals if n > 0)
                    extras.append(_Extra([[(t, recompute[t]), (source, option)] for t in tensors], [],
                                         self.cost.bytes_seconds(other.raw + encoded)))
                starts = [self.stashes[t].first_reader for t in tensors] + [end + 1]
                for index, tensor in enumerate(tensors):
                    first, last = starts[index], min(end, starts[index + 1] - 1)
                    if first > last:
                        continue
                    ands = [[(earlier, recompute[earlier]), (source, option)] for earlier in tensors[:index + 1]]
                    extras.append(_Extra(ands, [(first, last, other.nbytes)], 0.0))
        return extras, forbidden

    def _holds(self, extra, choice):
        return any(all(choice[t] is o for t, o in group) for group in extra.ands)

    def _curve(self, choice):
        """The modelled bytes live per step under {tensor: option}."""
        curve = self.base_live + self.correction
        for option in choice.values():
            for first, last, nbytes in option.intervals:
                curve[first:last + 1] += nbytes
        for extra in self.extras:
            if self._holds(extra, choice):
                for first, last, nbytes in extra.intervals:
                    curve[first:last + 1] += nbytes
        return curve

    def _residual(self, choice, compiled):
        """Real bytes live per step (mapped onto the unoptimized program's steps) less the
        model's, at `choice`, with the correction in force now taken out."""
        real = _on_base(live_by_step(compiled.plan), _positions(compiled.program, self.labels), self.steps)
        return real - (self._curve(choice) - self.correction)

    # ---- solving -------------------------------------------------------------------------
    def _solve(self, cap_bytes=None, cap_seconds=None, minimize_peak=False):
        """{tensor: option} minimizing the time added under the peak cap (or the peak under the
        time cap, ties to the least time); None when the model has no solution."""
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_array

        columns, ranges, index_of = [], [], {}   # a column per (tensor, option); then the extras; then the peak
        for tensor, stash in self.stashes.items():
            start = len(columns)
            for option in stash.options:
                index_of[(tensor, id(option))] = len(columns)
                columns.append((tensor, option))
            ranges.append((start, len(columns)))
        extra_start = len(columns)
        peak = extra_start + len(self.extras)
        level = peak + 1                            # then one level per segment (below)
        items = [(c, o.intervals) for c, (_, o) in enumerate(columns)]
        items += [(extra_start + k, e.intervals) for k, e in enumerate(self.extras)]
        # step segments over which every column's bytes are constant
        cuts = {0, self.steps}
        for _, intervals in items:
            for first, last, _ in intervals:
                cuts.update((first, last + 1))
        cuts = sorted(cuts)
        segment_of = np.zeros(self.steps + 1, dtype=np.int64)
        for index, (start, end) in enumerate(zip(cuts[:-1], cuts[1:])):
            segment_of[start:end] = index
        segments = len(cuts) - 1
        count = level + segments
        seconds = [o.seconds for _, o in columns] + [e.seconds for e in self.extras] + [0.0] * (1 + segments)
        level_of = self.base_live + self.correction
        constant = np.array([level_of[s:e].max() for s, e in zip(cuts[:-1], cuts[1:])])
        rows, cols, vals, lower, upper = [], [], [], [], []

        def add_row(entries, low, high):
            row = len(lower)
            for col, value in entries:
                rows.append(row)
                cols.append(col)
                vals.append(value)
            lower.append(low)
            upper.append(high)

        # the bytes live in each segment as a variable, each equal to the one before plus what
        # starts and less what ended there: a column takes two entries per interval, not one
        # per segment it spans (a sparse, banded matrix: the LPs solve many times faster)
        changes = [[] for _ in range(segments)]
        for column, intervals in items:
            for first, last, nbytes in intervals:
                changes[segment_of[first]].append((column, -nbytes / _MIB))
                if segment_of[last] + 1 < segments:
                    changes[segment_of[last] + 1].append((column, nbytes / _MIB))
        for segment in range(segments):
            entries = [(level + segment, 1.0)] + changes[segment]
            step = constant[segment] - (constant[segment - 1] if segment else 0.0)
            if segment:
                entries.append((level + segment - 1, -1.0))
            add_row(entries, step / _MIB, step / _MIB)
            add_row([(level + segment, 1.0), (peak, -1.0)], -np.inf, 0.0)
        for start, end in ranges:                        # one option per tensor
            add_row([(c, 1.0) for c in range(start, end)], 1.0, 1.0)
        for k, extra in enumerate(self.extras):          # an extra holds when a group of its is chosen
            for group in extra.ands:
                add_row([(index_of[(t, id(o))], 1.0) for t, o in group] + [(extra_start + k, -1.0)],
                        -np.inf, len(group) - 1)
        for group in self.forbidden:
            add_row([(index_of[(t, id(o))], 1.0) for t, o in group], -np.inf, len(group) - 1)
        if cap_seconds is not None:
            add_row([(c, v) for c, v in enumerate(seconds) if v], -np.inf, cap_seconds)
        matrix = coo_array((vals, (rows, cols)), shape=(len(lower), count)).tocsr()
        integrality = np.ones(count)
        integrality[peak:] = 0
        low, high = np.zeros(count), np.ones(count)
        low[peak:], high[peak:] = -np.inf, np.inf
        if cap_bytes is not None:
            high[peak] = cap_bytes / _MIB
        constraints = LinearConstraint(matrix, lower, upper)
        if minimize_peak:       # the peak, ties to the least time (1% of the step weighs 0.1 MiB)
            objective = np.array(seconds) * (0.1 / (0.01 * self.base_seconds))
            objective[peak] = 1.0
            options = {"mip_rel_gap": PEAK_GAP, "node_limit": NODE_LIMIT}
        else:
            objective = np.array(seconds)
            options = {"mip_rel_gap": TIME_GAP, "node_limit": NODE_LIMIT}
        result = milp(objective, integrality=integrality, bounds=Bounds(low, high), constraints=constraints,
                      options=options)
        if result.x is None:
            return self._no_answer(result)
        return {tensor: option for column, (tensor, option) in enumerate(columns) if result.x[column] > 0.5}

    @staticmethod
    def _no_answer(result):
        if result.status not in (1, 2):     # infeasible, or no solution within the node limit
            raise MinigistError(f"the optimizer's MILP solver stopped: {result.message}")
        return None

    def _model_seconds(self, choice):
        seconds = sum(option.seconds for option in choice.values())
        return seconds + sum(e.seconds for e in self.extras if self._holds(e, choice))

    def options_for(self, choice):
        """The pipeline's Options that carry out {tensor: option}."""
        overrides = {t: o.override for t, o in choice.items() if o.override is not None}
        recompute = [t for t in self.stashes if choice[t].recompute]
        return self.options.replace(overrides=overrides, recompute=recompute)

    def _plan(self, choice, compiled, budget):
        seconds = self.cost.program_seconds(compiled.program)
        report_rows = {row["tensor"]: row for row in footprint_report(compiled.plan)["stash"]}
        decisions = []
        for tensor, stash in self.stashes.items():
            option = choice[tensor]
            row = report_rows.get(tensor)
            stored = row["stored_bytes"] if row is not None else 0
            kept = stash.nbytes
            name = option.name
            if option.recompute:
                stored = 0
            elif name == KEEP:
                stored = kept
            decisions.append(Decision(tensor, stash.layer, name, stash.raw, kept - stored, option.seconds))
        return OptimizedPlan(self.options_for(choice), compiled, budget, self._needed(compiled),
                             self.baseline_footprint, seconds, self.base_seconds, self.cost, decisions)

    def _compiled_plan(self, choice, budget):
        return self._plan(choice, compile(self.model, self.options_for(choice)), budget)

    def _learn(self, choice, plan):
        """Carry the model's error at `choice`, step by step, into the next solves: from now
        on the correction at each step is at least the compiled plan's bytes less the model's
        (without correction) there, so that the model at `choice` is never below the exact
        plan and a choice that missed the budget is not chosen again. (Adding the error to the
        correction instead counted the correction in force twice: where it was negative, in
        place pairs the model cannot see, the model stayed below the plan after learning and
        the same choice came back every round.)"""
        self.correction = np.maximum(self.correction, self._residual(choice, plan.compiled))

    def _unplaced(self, plan):
        """Bytes of the exact footprint above the most bytes live at one step (or the
        evaluation program's need): what the static planner could not pack, which the model,
        counting live bytes, cannot see."""
        compiled = plan.compiled.plan
        live = max(int(live_by_step(compiled).max()), compiled.persistent_bytes + self.eval_transient)
        return max(0, plan.footprint_bytes - live)

    def fit(self, budget):
        """The plan of least predicted time whose exact footprint fits `budget` bytes; a
        MinigistError naming the smallest footprint reachable when none does."""
        budget = int(budget)
        self.correction = self.initial_correction      # what one call learns stays in it: deterministic
        margin = 0.0
        for round_index in range(ROUNDS):
            choice = self._solve(cap_bytes=budget - margin)
            if choice is None:
                break
            plan = self._compiled_plan(choice, budget)
            plan.rounds = round_index + 1
            if plan.footprint_bytes <= budget:
                return plan
            self._learn(choice, plan)
            margin = max(margin, self._unplaced(plan))
        smallest = self.smallest()
        if smallest.footprint_bytes <= budget:
            smallest.budget_bytes = budget
            return smallest
        raise MinigistError(f"--memory-budget: nothing fits {budget:,} bytes: the smallest footprint reachable "
                            f"{self.mode_words()} is {smallest.footprint_bytes:,} bytes; {dominated_by(smallest)}")

    def mode_words(self):
        return "with fp32, lossless encodings, " + (f"{self.options.dpr}, " if self.lossy else "") + "and recomputation"

    def smallest(self, cap_seconds=None):
        """The plan of the smallest exact footprint the model finds (the least time among
        equals), within `cap_seconds` of predicted time added when given; None when the model
        finds none within it."""
        best, bias = None, 0.0
        self.correction = self.initial_correction
        for round_index in range(3):
            choice = self._solve(cap_seconds=None if cap_seconds is None else cap_seconds - bias, minimize_peak=True)
            if choice is None:
                break
            plan = self._compiled_plan(choice, None)
            plan.rounds = round_index + 1
            added = plan.predicted_seconds - self.base_seconds
            within = cap_seconds is None or added <= cap_seconds * (1 + 1e-9)
            if within and (best is None or plan.footprint_bytes < best.footprint_bytes):
                best = plan
            self._learn(choice, plan)
            # the compiled plan's own time is the prediction; where the model's sum missed it
            # (decodes a replay's sources need), the next solve asks for that much less
            bias = max(bias, added - self._model_seconds(choice))
        return best

    def within(self, overhead):
        """The plan of the smallest footprint whose predicted overhead is at most `overhead`."""
        return self.smallest(cap_seconds=self.base_seconds * overhead)


def dominated_by(plan):
    """What fills the plan's peak: the categories, largest first, and the step."""
    report = footprint_report(plan.compiled.plan)
    total = sum(report["peak_by_category"].values())
    parts = sorted(((v, k) for k, v in report["peak_by_category"].items() if v), reverse=True)[:3]
    listed = ", ".join(f"{k} {v:,} ({100.0 * v / total:.0f}%)" for v, k in parts)
    return f"its peak (at {report['peak_step_label']}) holds {listed}"


def optimize(model, budget=None, batch_size=None, input_size=None, gist="lossless", dpr="fp16", densities=None,
             update="fused", conv="im2col", cost_model=None, options=None, max_overhead=None):
    """The plan that fits `budget` bytes at the least predicted step time (None: the smallest
    plan; `max_overhead`: the smallest plan whose predicted overhead is at most that fraction).
    `gist`: "lossless" (no precision lost) or "all" (DPR in `dpr` allowed). `options`, when
    given, carries the settings instead of the keywords. `cost_model`: a costmodel model (None:
    the FLOP model at this machine's measured rates). Net(model, plan=...) trains with it."""
    from .costmodel import flop_model
    if gist not in ("lossless", "all"):
        raise MinigistError(f"--gist: the optimizer chooses with lossless or all, not {gist!r}")
    if options is None:
        options = Options(batch_size=batch_size, input_size=input_size, dpr=dpr, densities=densities,
                          update=update, conv=conv)
    optimizer = Optimizer(model, options, cost_model or flop_model(), lossy=gist == "all")
    if max_overhead is not None:
        plan = optimizer.within(max_overhead)
        if plan is None:
            raise MinigistError(f"no plan within {max_overhead:.0%} predicted overhead")
        return plan
    if budget is None:
        return optimizer.smallest()
    return optimizer.fit(budget)
