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
stash kept): the bytes live at each step (the static planner reaches that lower bound on the
bundled models' unoptimized plans; where it packs a choice above it, the model cannot see it),
and, per stashed tensor and choice, the intervals of bytes the choice takes away or adds, read
off real compiled programs (one with Gist's lossless rules applied everywhere, one with the
lossy encoding everywhere) mapped back onto those steps, with the in-place steps and workspace a
code frees credited to it; a recomputation's rebuilt copy, the chain of forward steps it
replays from kept tensors and the maps that chain rebuilds on the way come from the program
itself. Time added per choice comes from the cost model (minigist/costmodel.py). A
recomputation is shared (passes/recompute.py: a segment that rebuilds a dropped source on the
way keeps its copy, so the source's chain runs once per step, and a run of dropped tensors
between two kept ones is rebuilt together, as in Chen et al.'s checkpointing) or, for a chain
without convolutions or inner products, private (the segment's own copy, the chain's time
again). A segment may reach back up to SHORT_CHAIN dropped tensors deep (a derived term per
segment and source says the segment rebuilds it); LONG_CHAIN where short chains fit nothing,
and for the smallest plan (searched with both, the smaller kept); a time cap (within()) is
searched with WITHIN_CHAINS, the smaller plan kept. That is a mixed 0-1 program:
minimize the time added such that the bytes at every step stay under the budget, solved by
HiGHS's MILP solver (scipy.optimize.milp; the choices are binary, the derived terms continuous
and at their bounds). The choice is then
compiled; where the model was below the exact plan, the model learns the difference step by
step and solves again, a few times, until the exact plan fits. Deterministic for a given cost model: the solver stops at an
optimality gap or a node count, never on a clock, on one thread; train.py --plan-only uses
fixed reference rates.

Under lossy modes, where short chains fit nothing at the layers' own batch chunks, the same
search runs again with smaller chunks (SMALL_CHUNK_BYTES: less im2col workspace). Not under
lossless: a GEMM over a chunk of another size rounds differently, so the weights would no longer
match --gist none bit for bit.

Lower bounds: `floor()` (the most bytes one step needs whatever is chosen) and
`overhead_floor(budget)` (the least predicted overhead any plan within a budget needs, from one
step at a time) bound every plan from below; the README's frontier table gives the first.
"""
import contextlib
import ctypes
import os
import sys
import warnings
from dataclasses import dataclass, field

import numpy as np

from .cli_args import budget_bytes
from .costmodel import step_flops
from .errors import MinigistError
from .memory import align
from .memory.report import footprint_report, live_by_step
from .passes import gist as gist_pass
from .passes.gist import dpr_applies
from .passes.microbatch import front_candidates, span_after
from .pipeline import Options, compile
from .program import INPUT, STASH, WEIGHT_GRAD_BLOCK_BYTES, of_micro, stash_key

KEEP = "fp32"
# recomputed (Options.recompute), shared (also in Options.recompute_shared: a segment that rebuilds
# it on the way keeps it) or private (rebuilt on the way into a segment's own copy, replayed again)
RECOMPUTE = "recompute-shared"
PRIVATE = "recompute-private"
ROUNDS = 5              # compiles of candidate plans per solve, at most
# replays one segment chains, at most (its own tensor's, then its sources'): a budget is first
# fitted with short chains (a smaller model, solved in seconds), with long ones only where short
# ones cannot fit it, and the smallest plan is searched with both (long ones reach further in the
# model, but within its node limit the solver can stop above what short ones reach: GoogLeNet
# lossless at batch 64, 583,667,968 B with long chains, 576,693,248 with short)
SHORT_CHAIN, LONG_CHAIN = 4, 8
# the chains within() searches a time cap with, the smaller plan kept: one replay more than short
# chains reaches where long ones cost the cap too much (GoogLeNet lossless within 15%: 557,163,520 B
# live at the peak with 4, 551,534,336 with 5; ResNet-50's model is larger and stops its search
# with 5 above what 4 reach: 1,505,640,704 B against 1,502,942,976)
WITHIN_CHAINS = (SHORT_CHAIN, SHORT_CHAIN + 1)
# the batch chunks of the chunked layers (im2col's columns, pooling, BatchNorm, Scale, LRN)
# where nothing fits at their own: one sample at a time for most convolutions
SMALL_CHUNK_BYTES = 256 << 10
# the solver's stopping rules, all deterministic (no time limit): a solution within these
# fractions of the best possible one, or the best found after NODE_LIMIT branch-and-bound nodes
PEAK_GAP = 5e-3
TIME_GAP = 1e-2
NODE_LIMIT = 3000
# where short chains fit nothing, a fit asks whether long ones reach its budget at all with one
# solve of the smallest plan at this node count: the answer (and the error's smallest footprint
# when they do not) in under two minutes where three at NODE_LIMIT took 20 on ResNet-50 under
# --gist all. Its bound decides: a budget below it is refused, one above it is searched in
# full. smallest() and within() (the frontier) keep NODE_LIMIT
FIT_CHECK_NODE_LIMIT = 200
# the share of its work HiGHS gives its primal heuristics when it minimizes time (its default
# 0.05): a fit's search is mostly spent finding a good plan, not proving one. Inception-v3's
# fp16 fit at 1400 MiB: at the node limit 8.5% from the bound, its plan adding 0.58 s, -> within
# the 1% gap, 0.54 s; ResNet-50's lossless fit at 1.8 GiB: the same plan (the peak's solves keep
# the default)
TIME_HEURISTIC_EFFORT = 0.2
_MIB = float(1 << 20)   # the solver works in MiB


def _require_scipy():
    try:
        from scipy.optimize import milp  # noqa: F401
    except ImportError:
        raise MinigistError("--optimize needs scipy (HiGHS's MILP solver): pip install -e '.[optimize]' in minigist's "
                           "folder, or pip install scipy") from None


@contextlib.contextmanager
def _solver_output_dropped():
    """File descriptor 1 pointed at the null device while HiGHS solves: the HiGHS in scipy 1.17
    writes a debugging line, `HighsMipSolverData::transformNewIntegerFeasibleSolution
    tmpSolver.run();`, to the process's standard output whatever its output options say
    (ERGO-Code/HiGHS#2783), and it landed in the middle of printed tables. Python's and C's
    buffered output are flushed before fd 1 moves and C's again before it is restored, so nothing
    else is lost. fd 1 is the process's: two solves in two threads at once could leave it at the
    null device (the optimizer solves in one thread; train.py refuses --optimize with ranks)."""
    sys.stdout.flush()
    _flush_c_stdio()
    try:
        saved = os.dup(1)
    except OSError:         # no fd 1 to redirect
        saved = None
    if saved is None:
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        _flush_c_stdio()
        os.dup2(saved, 1)
        os.close(saved)


def _flush_c_stdio():
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):     # no C library to reach (not a POSIX build)
        pass


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


class Settings:
    """Options in the form Net(plan=...) takes: a plan's settings without its decisions (the
    profiling run's variants, a check's hand-made choices)."""

    def __init__(self, options):
        self.options = options


class RecordedPlan(Settings):
    """An optimized plan's choices read back from its JSON (OptimizedPlan.to_json, as a
    checkpoint holds it) over `options`: Net applies them and reports the record."""

    def __init__(self, options, record):
        super().__init__(options.replace(gist="lossless", overrides=record["overrides"],
                                         recompute=tuple(record["recompute"]),
                                         recompute_shared=tuple(record["recompute_shared"]),
                                         chunk_bytes=record["chunk_bytes"],
                                         microbatch=tuple(record["microbatch"] or ()) if "microbatch" in record
                                         else options.microbatch, update=record.get("update", options.update),
                                         spans=tuple(tuple(span) for span in record.get("spans", options.spans))))
        self.record = dict(record)
        self.decisions = list(record.get("decisions", []))

    def to_json(self):
        return dict(self.record)


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
                "recompute_shared": list(self.options.recompute_shared), "chunk_bytes": self.options.chunk_bytes,
                "microbatch": list(self.options.microbatch) or None, "update": self.options.update,
                "spans": [list(span) for span in self.options.spans],
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
    slices: bool = False       # a replay may decode it a slice at a time (a decoded copy, not read as fp16)
    shared: bool = False       # recomputed, and kept once a segment for another tensor rebuilds it


@dataclass(eq=False)
class _Aux:
    """A derived 0-1 term of the model: it holds when every term of one of its `groups` holds
    (a term: a (tensor, option) pair, chosen, or another _Aux); when it holds it adds its
    intervals of bytes and its seconds."""
    groups: list
    intervals: list = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class _Segment:
    """One recomputation segment's peak, at step `at`: the bytes modelled live there plus
    `bytes` for each (term, bytes) of `entries` that holds (the copy a replay writes, its
    scratch and the private copies it reads)."""
    at: int
    entries: list


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
    source_readers: dict = field(default_factory=dict)   # source -> the chain's steps that read it
    chain_seconds: float = 0.0
    chain_bytes: int = 0      # maps a replay rebuilds on the way (its own, freed when done)
    in_place: bool = False    # not kept in fp32, its bytes go to its last forward reader's output
    micro: bool = False       # a micro-batch's part of a span's stash (passes/microbatch.py): never recomputed


def _positions(program, base_labels):
    """Each step of `program` as the index of a step of the unoptimized program: its own, or
    (a step a pass inserted) the next one (an encode runs after its producer, where that
    step's input may be gone already, and before that next step, which holds all it holds
    but its scratch; a decode or a replay: the reader it runs before)."""
    original = ("forward", "backward", "seed", "zero", "accumulate", "update")
    positions, j, last = [], 0, len(base_labels) - 1
    for step in program.steps:
        # a micro-batched front's re-runs (passes/microbatch.py) are in every program
        if j <= last and (step.kind in original or "samples" in step.args) and step.label == base_labels[j]:
            positions.append(j)
            j += 1
        else:
            positions.append(min(j, last))
    if j != len(base_labels):
        raise AssertionError(f"program steps do not follow the unoptimized program's (matched {j} of {len(base_labels)})")
    return positions


def _on_base(values, positions, size):
    """Per step of the unoptimized program: the largest of `values` at the steps mapped to it."""
    out = np.zeros(size, dtype=np.float64)
    np.maximum.at(out, np.asarray(positions), np.asarray(values, dtype=np.float64))
    return out


def lossy_overrides(graph, program, lossless, dpr):
    """{stashed top or net input: the Gist override of its lossy option}: SSDC with `dpr` values
    where the lossless rules give it SSDC, else DPR in `dpr` where that applies (float32, a
    batch of maps, 4 KiB or more). `program` is the unoptimized training program, `lossless` the one
    under the lossless rules. Left out: a top named as a layer with saved tensors (a pool's
    argmax) or as a max-pool, since Gist's overrides also match layer names and the override
    would reach the layer's codes too."""
    layers = {node.layer.name: node.layer for node in graph.nodes}
    saved = {b.layer for b in program.buffers.values() if b.kind == "saved"}
    overrides = {}
    for name, buffer in program.buffers.items():
        if buffer.kind != "blob" or buffer.category not in (STASH, INPUT):
            continue
        tensor = buffer.tensor
        if tensor in layers and (tensor in saved or layers[tensor].type == "Pooling"):
            continue
        encoding = lossless.encodings.get(name)
        if encoding is not None and encoding.name == "ssdc":
            overrides[stash_key(buffer)] = f"ssdc-{dpr}"
        elif dpr_applies(buffer, graph.batch_size):
            overrides[stash_key(buffer)] = dpr
    return overrides


class NothingFits(MinigistError):
    """No plan fits the budget. `least`: the smallest footprint found, or where the search was
    not needed to tell, the bound (Optimizer.floor) that no plan reaches below."""

    def __init__(self, message, least):
        super().__init__(message)
        self.least = least


class Optimizer:
    """The model of one net under fixed settings (`options`: batch, engine, update, densities,
    chunks; its gist, overrides and recompute are ignored), for one cost model. `lossy`: DPR
    (in options.dpr) may be chosen, and, where nothing fits at the layers' own batch chunks,
    smaller ones (SMALL_CHUNK_BYTES: less workspace; a sum over a batch then rounds
    differently, so never under lossless). `reference`: the optimizer at the layers' own
    chunks, whose unoptimized plan this one's plans are compared with. `compared_with`: the
    settings whose unoptimized plan, front whole, the plans are compared with where there is no
    `reference` (None: `options` themselves; SettingsSearch compares a blocked update's plans
    with the fused update's `none`)."""

    def __init__(self, model, options, cost_model, lossy=False, reference=None, compared_with=None):
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
        nodes = {id(node.layer): i for i, node in enumerate(self.graph.nodes)}
        self.forward_step = {nodes[id(s.layer)]: i for i, s in enumerate(program.steps)
                             if s.kind == "forward" and id(s.layer) in nodes}
        # what plans are compared with: every stash kept in fp32, at the layers' own chunks
        self.reference = reference
        self.baseline_footprint = reference.baseline_footprint if reference else self._needed(self.base)
        self.baseline_seconds = reference.baseline_seconds if reference else self.base_seconds
        compared = (compared_with or options).replace(gist="none", overrides=(), recompute=(), recompute_shared=(),
                                                      budget=None, microbatch=(), spans=())
        if reference is None and compared != self.options.replace(gist="none"):
            # compared with `none` as it is: its front not micro-batched, its update as asked
            whole = compile(model, compared)
            self.baseline_footprint = self._needed(whole)
            self.baseline_seconds = self.cost.program_seconds(whole.program)
        self._chunked = None
        self.stashes = self._stashes()
        self.lossless = compile(model, self.options)
        # a layer's saved tensors (a pool's argmax, Dropout's mask) take their lossless code
        # whatever is chosen: the model counts them so from the start
        self.base_live += self._saved_codes(self.lossless)
        self._mark_in_place(self.lossless)
        self._add_codec_options(self.lossless, lossy=False)
        if lossy:
            overrides = {tensor: override for tensor, override in
                         lossy_overrides(self.graph, program, self.lossless.program, options.dpr).items()
                         if tensor in self.stashes}
            if overrides:
                self._add_codec_options(compile(model, self.options.replace(overrides=overrides)), lossy=True,
                                        overrides=overrides)
        for stash in self.stashes.values():
            if not stash.micro:     # a span's stash is in no segment: its span runs once
                self._add_recompute_option(stash)
        self._drop_idle_private()
        self.chain = None
        # what the last peak-minimizing solve proved of the modelled peak (bytes; 0: nothing)
        self.peak_bound = 0
        self._use_chain(SHORT_CHAIN)
        # the model is exact where it was measured: start from the lossless rules everywhere
        self.correction = np.zeros(self.steps)
        rules = {t: next((o for o in s.options if o.override is None and not o.recompute), s.options[0])
                 for t, s in self.stashes.items()}
        # (where the compiled program holds less than the model, the model keeps its own count:
        # a saving no option explains may not hold under another choice)
        self.initial_correction = np.maximum(0.0, self._residual(rules, self.lossless))
        self.correction = self.initial_correction

    # ---- the model ----------------------------------------------------------------------
    def _needed(self, compiled):
        """Bytes the plan needs: its footprint, and the evaluation program's part where larger."""
        plan = compiled.plan
        return plan.footprint_bytes + max(0, self.eval_transient - plan.transient_bytes)

    def _stashes(self):
        """The stashed tops, and under lossy modes the net's float inputs that a backward step
        reads (the data a first convolution's weight gradient needs), which DPR may keep too."""
        program = self.base.program
        stashes = {}
        for name, buffer in program.buffers.items():
            if buffer.kind != "blob" or not (buffer.category == STASH or (
                    self.lossy and buffer.category == INPUT and dpr_applies(buffer, self.graph.batch_size))):
                continue
            uses = [i for i, s in enumerate(program.steps) if name in set(s.buffer_names())]
            forward = [i for i in uses if i < self.first_backward]
            backward = [i for i in uses if i >= self.first_backward]
            if not forward or not backward:
                continue
            key = stash_key(buffer)
            stash = _Stash(key, buffer.layer, align(buffer.nbytes), buffer.nbytes, buffer.first_use,
                           max(forward), min(backward), max(backward), micro=bool(buffer.micro))
            stash.options.append(_Option(KEEP, KEEP, False, [], 0.0))
            stashes[key] = stash
        return stashes

    def _freed(self, stash):
        """The fp32 tensor no longer kept after its last forward use (from that step on where
        its last forward reader writes its output over it, in place)."""
        start = stash.last_forward + (0 if stash.in_place else 1)
        if start > stash.last_reader:
            return []
        return [(start, stash.last_reader, -stash.nbytes)]

    def _saved_codes(self, compiled):
        """Per step of the unoptimized program: the bytes `compiled` holds for the layers'
        saved tensors (their codes, decoded parts and codec scratch) less what the unoptimized
        program holds for them."""
        program, base = compiled.program, self.base.program
        positions = _positions(program, self.labels)
        delta = np.zeros(self.steps)
        for name in program.encodings:
            buffer = program.buffers[name]
            if buffer.kind != "saved":
                continue
            tensor = buffer.tensor
            for other in program.buffers.values():
                if other.tensor in (tensor, f"{tensor}.encode", f"{tensor}.decode") and other.micro == buffer.micro:
                    delta[positions[other.first_use]:positions[other.last_use] + 1] += align(other.nbytes)
            kept = base.buffers[name]
            delta[kept.first_use:kept.last_use + 1] -= align(kept.nbytes)
        return delta

    def _mark_in_place(self, compiled):
        """Mark each stash whose fp32 bytes the compiled program gives, once encoded, to an
        output of its last forward reader (an in-place step the unoptimized program cannot
        take, the tensor being kept): dropped or encoded, the tensor frees its bytes one step
        earlier."""
        program, plan = compiled.program, compiled.plan
        for group in plan.groups:
            for name in group.members:
                buffer = program.buffers[name]
                stash = self.stashes.get(stash_key(buffer)) if buffer.kind == "blob" else None
                if stash is not None and name in program.encodings and any(
                        program.buffers[other].first_use == buffer.last_use for other in group.members if other != name):
                    stash.in_place = True

    def _add_codec_options(self, compiled, lossy, overrides=None):
        """An option per stash that `compiled` encodes (its encoding's buffers and steps), from
        the lossless rules' program or, `lossy`, the program with `overrides`."""
        program = compiled.program
        positions = _positions(program, self.labels)
        owned = {}          # tensor -> [buffer names]
        for name, buffer in program.buffers.items():
            if buffer.kind in ("enc", "dec"):
                owned.setdefault(stash_key(buffer), []).append(name)
            elif buffer.kind == "ws" and buffer.tensor.endswith((".encode", ".decode")):
                tensor = buffer.tensor.rsplit(".", 1)[0]
                owned.setdefault(of_micro(tensor, buffer.micro), []).append(name)
        reverse = {n: t for t, names in owned.items() for n in names}
        seconds, workspace = {}, {}
        base = self.base.program
        for index, step in enumerate(program.steps):
            cost = self.cost.step_seconds(step, program)
            if step.kind in ("encode", "decode"):
                seconds[step.note] = seconds.get(step.note, 0.0) + cost
                continue
            if step.kind not in ("forward", "backward"):
                continue
            at = positions[index]
            readers = {reverse[n] for n in step.buffer_names() if n in reverse}
            if step.kind == "backward" and step.label == base.steps[at].label:
                # a reader whose code another layer's step decodes (a ReLU's mask in its pool's codes)
                readers |= {stash_key(base.buffers[n]) for n in base.steps[at].buffer_names(("x", "y"))
                            if n is not None and n in program.encodings and stash_key(base.buffers[n]) in self.stashes}
            if not readers:
                continue
            delta = cost - self.step_cost[at]
            # a reader of codes may need other workspace than the fp32 reader (a ReLU's
            # backward from its 1-bit mask needs no byte mask of the tensor)
            scratch = (sum(align(program.buffers[n].nbytes) for n in set(step.buffer_names(("ws",))) if n not in reverse)
                       - sum(align(base.buffers[n].nbytes) for n in set(base.steps[at].buffer_names(("ws",)))))
            for tensor in readers:
                seconds[tensor] = seconds.get(tensor, 0.0) + delta / len(readers)
                if scratch:
                    workspace.setdefault(tensor, []).append((at, at, scratch // len(readers)))
        for tensor, stash in self.stashes.items():
            encoding = program.encodings.get(f"blob:{tensor}")
            if encoding is None or encoding.name == "recomputed":
                continue
            if lossy and (overrides or {}).get(tensor) is None:
                continue
            intervals = self._freed(stash) + workspace.get(tensor, [])
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
                                         holds_values=holds_values, whole_decode=whole,
                                         slices=bool(encoding.decoded) and gist_pass.streams_values(encoding.codec)))

    def _add_recompute_option(self, stash):
        program, graph = self.base.program, self.graph
        chain, sources, seen, readers = [], set(), set(), {}

        def visit(name):
            buffer = program.buffers[name]
            if buffer.category in (STASH, INPUT) and name != f"blob:{stash.tensor}":
                if buffer.category == STASH and buffer.kind == "blob":
                    sources.add(buffer.tensor)
                return buffer.category == INPUT or buffer.kind == "blob"
            # its producer's forward step (none: a micro-batched front's, rebuilt there)
            index = self.forward_step.get(graph.blobs[buffer.tensor].producer)
            if index is None:
                return False
            if index in seen:
                return True
            seen.add(index)
            step = program.steps[index]
            if step.kind != "forward" or not step.layer.recomputable:
                return False
            if not all(visit(x) for x in step.args["x"]):
                return False
            for x in step.args["x"]:
                if program.buffers[x].category == STASH and program.buffers[x].kind == "blob":
                    readers.setdefault(program.buffers[x].tensor, []).append(index)
            chain.append(index)
            return True

        if not visit(f"blob:{stash.tensor}"):
            return
        stash.sources = tuple(sorted(s for s in sources if s in self.stashes))
        stash.source_readers = {source: tuple(readers[source]) for source in stash.sources}
        stash.chain_seconds = sum(self.step_cost[i] for i in chain)
        stash.chain_bytes = self._replay_peak(chain, f"blob:{stash.tensor}")
        intervals = self._freed(stash) + [(stash.first_reader, stash.last_reader, stash.nbytes)]
        stash.options.append(_Option(RECOMPUTE, None, True, intervals, stash.chain_seconds, shared=True))
        # replayed again where another segment needs it first: worth it for a chain without
        # convolutions or inner products alone (its replays cost a pass over memory)
        if not any(step_flops(program.steps[index]) for index in chain):
            stash.options.append(_Option(PRIVATE, None, True, list(intervals), stash.chain_seconds))

    def _replay_peak(self, chain, target):
        """The most scratch bytes live at once while `chain` (forward step indices, in order)
        is replayed to rebuild blob buffer `target`: each replayed map from its replay to its
        last reader in the chain, a replay's workspace and saved scratch at its step alone, and
        a map the next replay writes its output over (in place, as in the forward pass) one
        storage with it; the storage that ends in `target` is its copy, counted apart."""
        program = self.base.program
        storage = {}                # a replayed map -> the first map of its in-place chain
        pairs = dict(program.inplace)
        for index in chain:
            for name in program.steps[index].args["y"]:
                storage.setdefault(name, name)
            for source in program.steps[index].args["x"]:
                if pairs.get(source) in program.steps[index].args["y"] and source in storage:
                    storage[pairs[source]] = storage[source]
        own = storage.get(target, target)
        last_read = {}              # a storage -> the last replay that writes or reads it
        for position, index in enumerate(chain):
            for name in program.steps[index].args["x"] + program.steps[index].args["y"]:
                if name in storage:
                    last_read[storage[name]] = position
        live, peak = {}, 0
        for position, index in enumerate(chain):
            step = program.steps[index]
            for name in step.args["y"]:
                key = storage[name]
                if key != own:      # an in-place pair has one size
                    live[key] = align(program.buffers[name].nbytes)
            scratch = sum(align(program.buffers[name].nbytes) for name in set(step.buffer_names(("ws", "saved"))))
            peak = max(peak, sum(live.values()) + scratch)
            for key in [key for key in live if last_read[key] <= position]:
                del live[key]
        return peak

    def _drop_idle_private(self):
        """Keep the private option only where a segment for another tensor can rebuild the
        tensor before its own first backward reader: elsewhere it is the shared one again (two
        columns for one choice, which the solver would search twice)."""
        earliest = {t: stash.first_reader for t, stash in self.stashes.items()}     # when a replay of it may run
        consumers = {}
        for tensor, stash in self.stashes.items():
            if any(o.recompute for o in stash.options):
                for source in stash.sources:
                    consumers.setdefault(source, []).append(tensor)
        for tensor in sorted(self.stashes, key=lambda t: self.stashes[t].produced, reverse=True):
            stash = self.stashes[tensor]
            earliest[tensor] = min([stash.first_reader] + [earliest[c] for c in consumers.get(tensor, ())])
            if earliest[tensor] == stash.first_reader:
                stash.options = [o for o in stash.options if not (o.recompute and not o.shared)]

    def _interactions(self):
        """What one tensor's choice does to another's, as (derived terms, forbidden groups,
        segment peaks).

        A recomputed tensor T's segment replays T's chain from its sources; a source that is
        recomputed too but not rebuilt yet (its first backward reader comes after T's) is
        rebuilt on the way from its own sources, and so on up to `self.chain` tensors deep:
        a derived term per (T, source reached) says that T's segment rebuilds it. Shared, the
        source keeps that copy (its own segment then replays nothing: its chain's time counts
        once), and a term per source and step says its copy is made by then (from the first
        segment that rebuilds it to its own first reader). Private, the copy is the segment's
        own, freed with it, and the source's chain runs again (a term carries that time). The
        segment's peak counts each replay's scratch and the private copies it reads.
        A source read by a replay of T's segment in a code:
        - without values (a ReLU's 1-bit mask, its place in a pool's codes): forbidden, Gist
          gives a replay's source values;
        - with values: decoded for each run of replays that reads it, into a copy freed after
          the run (the run right before its first backward reader shares that reader's
          decode, where its readers decode it whole), or into a slice buffer where every
          replay of the run that reads it is a convolution reading it a slice at a time;
        - fp32 kept, or a copy rebuilt by an earlier segment, whose last backward reader
          comes before T's segment: it lives on until the segment."""
        aux, forbidden, segments = [], [], []
        shared = {t: o for t, s in self.stashes.items() for o in s.options if o.shared}
        private = {t: o for t, s in self.stashes.items() for o in s.options if o.recompute and not o.shared}
        keep = {t: s.options[0] for t, s in self.stashes.items()}
        readers = {}            # source -> {T: [terms: T's segment replays a step that reads it]}
        pulls = {}              # shared source -> {step: [terms: a segment there rebuilds it first]}
        for tensor, stash in self.stashes.items():
            own = [(tensor, o) for o in (shared.get(tensor), private.get(tensor)) if o is not None]
            if not own:
                continue
            at = stash.first_reader
            if len(own) == 1:
                root = own[0]
            else:               # its own segment runs (or an earlier one rebuilds it) either way
                root = _Aux([[term] for term in own])
                aux.append(root)
            # C -> "T's segment replays C" (shared: rebuilt here for good; or privately), and
            # C -> "... privately" (its chain's time again, its copy the segment's own)
            replays, copies = {tensor: root}, {}
            depth, order = {tensor: 1}, [tensor]
            for node in order:                                   # grows as sources are reached
                for source in self.stashes[node].sources:
                    sliced = self._replay_slice(self.stashes[node], self.stashes[source])
                    readers.setdefault(source, {}).setdefault(tensor, []).append((replays[node], sliced))
                    other = self.stashes[source]
                    if other.first_reader <= at or (source not in shared and source not in private):
                        continue        # kept, encoded, or rebuilt by an earlier segment
                    groups = [[replays[node], (source, option)] for option in (shared.get(source), private.get(source))
                              if option is not None]
                    if depth[node] >= self.chain:
                        forbidden.extend(groups)
                        continue
                    if source not in replays:
                        replays[source] = _Aux([])
                        aux.append(replays[source])
                        if source in private:
                            copies[source] = _Aux([], [], other.chain_seconds)
                            aux.append(copies[source])
                            replays[source].groups.append([copies[source]])
                        depth[source] = depth[node] + 1
                        order.append(source)
                    for group in groups:
                        if group[1][1].shared:
                            replays[source].groups.append(group)
                            pulls.setdefault(source, {}).setdefault(at, []).append(group)
                        else:
                            copies[source].groups.append(group)
            for node in order:
                entries = [(replays[node], self.stashes[node].chain_bytes)]
                entries += [(copies[source], self.stashes[source].nbytes) for source in self.stashes[node].sources
                            if source in copies]
                segments.append(_Segment(at, [(term, nbytes) for term, nbytes in entries if nbytes]))
        # a tensor rebuilt by an earlier segment keeps its copy from the first such segment on:
        # a term per step a segment may rebuild it at, "made by then", each at least the one before
        for source, by_step in pulls.items():
            other = self.stashes[source]
            steps = sorted(by_step) + [other.first_reader]
            made = None
            for index, step in enumerate(steps[:-1]):
                groups = [list(group) for group in by_step[step]] + ([[made]] if made is not None else [])
                made = _Aux(groups, [(step, steps[index + 1] - 1, other.nbytes)])
                aux.append(made)
        for source, by_tensor in readers.items():
            other = self.stashes[source]
            tensors = sorted(by_tensor, key=lambda t: (self.stashes[t].first_reader, self.stashes[t].produced))
            reads, sliced = {}, {}      # sliced: bytes of a slice where every such replay reads one
            for tensor in tensors:
                terms = [term for term, _ in by_tensor[tensor]]
                slices = [nbytes for _, nbytes in by_tensor[tensor]]
                sliced[tensor] = max(slices) if all(slices) else 0
                if len(terms) == 1:
                    reads[tensor] = terms[0]
                else:           # the segment reads it when any of its replays that read it runs
                    reads[tensor] = _Aux([[term] for term in terms])
                    aux.append(reads[tensor])
            for tensor in tensors:          # a copy or fp32 tensor read past its last reader
                at = self.stashes[tensor].first_reader
                if at <= other.last_reader:
                    continue
                for option in (keep[source], shared.get(source), private.get(source)):
                    if option is not None and (option.name == KEEP or other.first_reader <= at):
                        aux.append(_Aux([[reads[tensor], (source, option)]], [(other.last_reader + 1, at, other.nbytes)]))
            for option in other.options:
                if option.recompute or option.name == KEEP:
                    continue
                if not option.holds_values:
                    for tensor in tensors:
                        forbidden.append([reads[tensor], (source, option)])
                    continue
                # each run of replays (the segments before one backward step) decodes it into
                # a copy of its own, freed after the run; a run right before its first backward
                # reader reads the copy that reader's whole decode makes. A run whose replays
                # all read it a slice at a time (passes/gist.py: replay_stream_chunk) decodes
                # it into a slice buffer instead, each replay all of it: a term per segment,
                # each its own row (two that hold count the larger slice, the run's one buffer;
                # beside a whole copy, the copy)
                decode_seconds = self.cost.bytes_seconds(other.raw + sum(n for _, _, n in option.intervals if n > 0))
                runs = {}
                for tensor in tensors:
                    runs.setdefault(self.stashes[tensor].first_reader, []).append(tensor)
                for at, members in runs.items():
                    if option.whole_decode and at == other.first_reader:
                        continue
                    whole = [t for t in members if not (sliced[t] and option.slices)]
                    if whole:
                        term = _Aux([[reads[t], (source, option)] for t in whole], [], decode_seconds)
                        aux.append(term)
                        segments.append(_Segment(at, [(term, other.nbytes)]))
                    for tensor in members:
                        if tensor not in whole:
                            term = _Aux([[reads[tensor], (source, option)]], [], decode_seconds)
                            aux.append(term)
                            segments.append(_Segment(at, [(term, sliced[tensor])]))
        return aux, forbidden, segments

    def _replay_slice(self, stash, source):
        """The bytes of the slice buffer a replay in `stash`'s chain decodes `source` into, where
        every step of the chain that reads it reads it as its first input and nowhere else, a
        slice at a time (Layer.forward_stream_chunk: a convolution; passes/gist.py's
        replay_stream_chunk, with its size threshold); 0 where such a replay needs a whole
        decoded copy."""
        program = self.base.program
        name = f"blob:{source.tensor}"
        batch = self.graph.batch_size
        if not gist_pass.sliceable(program.buffers[name], batch):
            return 0
        chunk = 1
        for index in stash.source_readers.get(source.tensor, ()):
            samples = gist_pass.forward_slices(program.steps[index], name)
            if not samples:
                return 0
            chunk = max(chunk, samples)
        return align(chunk * (source.raw // batch)) if chunk < batch else 0

    def _use_chain(self, depth):
        """Model recomputation segments of up to `depth` replays."""
        if depth != self.chain:
            self.chain = depth
            self.aux, self.forbidden, self.segments = self._interactions()

    def _values(self, choice):
        """{id(term): 0 or 1} of every derived term under {tensor: option}."""
        values = {}

        def holds(term):
            if isinstance(term, tuple):
                return choice[term[0]] is term[1]
            key = id(term)
            if key not in values:
                values[key] = any(all(holds(t) for t in group) for group in term.groups)
            return values[key]
        for term in self.aux:
            holds(term)
        return values

    def _curve(self, choice):
        """The modelled bytes live per step under {tensor: option} (a segment's replays at
        their step, where they hold more than the step itself)."""
        curve = self.base_live + self.correction
        for option in choice.values():
            for first, last, nbytes in option.intervals:
                curve[first:last + 1] += nbytes
        values = self._values(choice)
        for term in self.aux:
            if values[id(term)]:
                for first, last, nbytes in term.intervals:
                    curve[first:last + 1] += nbytes
        level = curve.copy()
        for segment in self.segments:
            held = sum(n for term, n in segment.entries
                       if (choice[term[0]] is term[1] if isinstance(term, tuple) else values[id(term)]))
            curve[segment.at] = max(curve[segment.at], level[segment.at] + held)
        return curve

    def _residual(self, choice, compiled):
        """Real bytes live per step (mapped onto the unoptimized program's steps) less the
        model's, at `choice`, with the correction in force now taken out."""
        real = _on_base(live_by_step(compiled.plan), _positions(compiled.program, self.labels), self.steps)
        return real - (self._curve(choice) - self.correction)

    # ---- solving -------------------------------------------------------------------------
    def _solve(self, cap_bytes=None, cap_seconds=None, minimize_peak=False, node_limit=NODE_LIMIT):
        """{tensor: option} minimizing the time added under the peak cap (or the peak under the
        time cap, ties to the least time); None when the model has no solution."""
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_array

        columns, ranges, index_of = [], [], {}   # a column per (tensor, option); then the derived terms; then the peak
        for tensor, stash in self.stashes.items():
            start = len(columns)
            for option in stash.options:
                index_of[(tensor, id(option))] = len(columns)
                columns.append((tensor, option))
            ranges.append((start, len(columns)))
        aux_start = len(columns)
        for k, term in enumerate(self.aux):
            index_of[id(term)] = aux_start + k
        peak = aux_start + len(self.aux)
        level = peak + 1                            # then one level per segment (below)

        def column(term):
            return index_of[(term[0], id(term[1]))] if isinstance(term, tuple) else index_of[id(term)]

        items = [(c, o.intervals) for c, (_, o) in enumerate(columns)]
        items += [(aux_start + k, term.intervals) for k, term in enumerate(self.aux)]
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
        seconds = [o.seconds for _, o in columns] + [t.seconds for t in self.aux] + [0.0] * (1 + segments)
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
        for col, intervals in items:
            for first, last, nbytes in intervals:
                changes[segment_of[first]].append((col, -nbytes / _MIB))
                if segment_of[last] + 1 < segments:
                    changes[segment_of[last] + 1].append((col, nbytes / _MIB))
        for segment in range(segments):
            entries = [(level + segment, 1.0)] + changes[segment]
            step = constant[segment] - (constant[segment - 1] if segment else 0.0)
            if segment:
                entries.append((level + segment - 1, -1.0))
            add_row(entries, step / _MIB, step / _MIB)
            add_row([(level + segment, 1.0), (peak, -1.0)], -np.inf, 0.0)
        for start, end in ranges:                        # one option per tensor
            add_row([(c, 1.0) for c in range(start, end)], 1.0, 1.0)
        for k, term in enumerate(self.aux):              # a derived term holds when a group of its does
            for group in term.groups:
                add_row([(column(t), 1.0) for t in group] + [(aux_start + k, -1.0)], -np.inf, len(group) - 1)
        for group in self.forbidden:
            add_row([(column(t), 1.0) for t in group], -np.inf, len(group) - 1)
        for replay in self.segments:                     # a recomputation segment's replays
            add_row([(level + segment_of[replay.at], 1.0), (peak, -1.0)] +
                    [(column(t), n / _MIB) for t, n in replay.entries], -np.inf, 0.0)
        if cap_seconds is not None:
            add_row([(c, v) for c, v in enumerate(seconds) if v], -np.inf, cap_seconds)
        matrix = coo_array((vals, (rows, cols)), shape=(len(lower), count)).tocsr()
        integrality = np.zeros(count)
        integrality[:aux_start] = 1     # the derived terms follow the choices: at their bounds, 0 or 1
        low, high = np.zeros(count), np.ones(count)
        low[peak:], high[peak:] = -np.inf, np.inf
        if cap_bytes is not None:
            high[peak] = cap_bytes / _MIB
        constraints = LinearConstraint(matrix, lower, upper)
        if minimize_peak:       # the peak, ties to the least time (1% of the step weighs 0.1 MiB)
            objective = np.array(seconds) * (0.1 / (0.01 * self.base_seconds))
            objective[peak] = 1.0
            options = {"mip_rel_gap": PEAK_GAP, "node_limit": node_limit}
        else:
            objective = np.array(seconds)
            options = {"mip_rel_gap": TIME_GAP, "node_limit": node_limit,
                       "mip_heuristic_effort": TIME_HEURISTIC_EFFORT}
        # scipy passes HiGHS's own options on, with a warning
        with warnings.catch_warnings(), _solver_output_dropped():
            warnings.filterwarnings("ignore", "Unrecognized options", RuntimeWarning)
            result = milp(objective, integrality=integrality, bounds=Bounds(low, high), constraints=constraints,
                          options=options)
        if minimize_peak:
            # the solver's bound is on the peak plus the weighted time: less the most time any
            # choice can weigh, it bounds the modelled peak of every choice
            most = sum(max(0.0, objective[start:end].max()) for start, end in ranges)
            most += np.maximum(objective[aux_start:peak], 0.0).sum()
            found = result.mip_dual_bound
            self.peak_bound = 0 if found is None else int((found - most) * _MIB)
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
        values = self._values(choice)
        return seconds + sum(term.seconds for term in self.aux if values[id(term)])

    def options_for(self, choice):
        """The pipeline's Options that carry out {tensor: option}."""
        overrides = {t: o.override for t, o in choice.items() if o.override is not None}
        recompute = [t for t in self.stashes if choice[t].recompute]
        shared = [t for t in self.stashes if choice[t].shared]
        return self.options.replace(overrides=overrides, recompute=recompute, recompute_shared=shared)

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
                             self.baseline_footprint, seconds, self.baseline_seconds, self.cost, decisions)

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
        MinigistError naming the smallest footprint found, and the model's bound, when none
        does. Under lossy
        modes, smaller batch chunks where short recomputation chains fit nothing at the
        layers' own."""
        floor, at, parts = self.floor()
        if budget < floor:      # proven at once, where the smallest plan's search takes minutes
            largest = sorted(((n, k) for k, n in parts.items() if n > 0), reverse=True)[:3]
            listed = ", ".join(f"{k} {n:,}" for n, k in largest)
            raise NothingFits(f"--memory-budget: nothing fits {int(budget):,} bytes: no plan {self.mode_words()} "
                              f"needs less than {floor:,} bytes (at {at}: {listed}; a bound: the smallest plan "
                              f"may need more)", least=floor)
        chunked = self._chunked_optimizer()
        if chunked is None:
            return self._fit(budget)
        plan = self._fit(budget, short_only=True)
        return plan if plan is not None else chunked._fit(budget)

    def smallest(self):
        """The plan of the smallest exact footprint the model finds (the least time among
        equals), smaller chunks included under lossy modes."""
        return _smaller([o._smallest_of_both() for o in self._family()])

    def _smallest_of_both(self):
        """_smallest() searched with short chains and with long ones: the smaller plan (the
        least time among equals). The long search runs last: `peak_bound` is its bound,
        which holds for both."""
        return _smaller([self._smallest(chain=SHORT_CHAIN), self._smallest()])

    def within(self, overhead):
        """The plan of the smallest footprint whose predicted overhead is at most `overhead`
        (a fraction), searched with each of WITHIN_CHAINS (the least time among equals); None
        when the model finds none."""
        plans = []
        for optimizer in self._family():
            cap = optimizer.baseline_seconds * (1 + overhead) - optimizer.base_seconds
            if cap >= 0:
                plans += [optimizer._smallest(cap_seconds=cap, chain=chain) for chain in WITHIN_CHAINS]
        return _smaller(plans)

    def _family(self):
        chunked = self._chunked_optimizer()
        return [self] if chunked is None else [self, chunked]

    def _chunked_optimizer(self):
        """The optimizer of the same settings at SMALL_CHUNK_BYTES (lossy modes only; None
        elsewhere, or where the chunks are set already)."""
        if not self.lossy or self.reference is not None or self.options.chunk_bytes is not None:
            return None
        if self._chunked is None:
            self._chunked = Optimizer(self.model, self.options.replace(chunk_bytes=SMALL_CHUNK_BYTES), self.cost,
                                      lossy=True, reference=self)
        return self._chunked

    def _fit(self, budget, short_only=False):
        """fit() at this optimizer's chunks (`short_only`: None where short chains fit nothing)."""
        budget = int(budget)
        self._use_chain(SHORT_CHAIN)
        plan = self._fit_rounds(budget)
        if plan is not None or short_only:
            return plan
        # past what short chains reach: the smallest plan first (a solve that always has an
        # answer; proving that none fits a budget takes the solver far longer), searched in
        # full only where the quick search's bound leaves room for a plan within the budget;
        # then, where it fits, the least time with long chains
        smallest = self._smallest(node_limit=FIT_CHECK_NODE_LIMIT, rounds=1)
        bound = self.peak_bound
        if smallest.footprint_bytes > budget >= bound:
            smallest = self._smallest_of_both()
        if smallest.footprint_bytes > budget:
            raise NothingFits(f"--memory-budget: nothing fits {budget:,} bytes: the smallest footprint the optimizer "
                              f"found {self.mode_words()} is {smallest.footprint_bytes:,} bytes (none below "
                              f"{max(bound, 0):,} in its model); {dominated_by(smallest)}", least=smallest.footprint_bytes)
        plan = self._fit_rounds(budget)
        if plan is not None and plan.predicted_seconds <= smallest.predicted_seconds:
            return plan
        smallest.budget_bytes = budget
        return smallest

    def _fit_rounds(self, budget):
        """The plan of least predicted time that fits `budget` with the chains modelled now,
        in up to ROUNDS solves and compiles (None when none of them fits)."""
        self.correction = self.initial_correction      # what one call learns stays in it: deterministic
        margin = 0.0
        for round_index in range(ROUNDS):
            choice = self._solve(cap_bytes=budget - margin)
            if choice is None:
                return None
            plan = self._compiled_plan(choice, budget)
            plan.rounds = round_index + 1
            if plan.footprint_bytes <= budget:
                return plan
            self._learn(choice, plan)
            margin = max(margin, self._unplaced(plan))
        return None

    def mode_words(self):
        if not self.lossy:
            return "with fp32, lossless encodings and recomputation"
        return f"with fp32, lossless encodings, {self.options.dpr}, recomputation and smaller batch chunks"

    def _smallest(self, cap_seconds=None, node_limit=NODE_LIMIT, rounds=3, chain=None):
        """The plan of the smallest exact footprint the model finds (the least time among
        equals), within `cap_seconds` of predicted time added to this optimizer's own
        unoptimized program when given; None when the model finds none within it. Long
        recomputation chains for the smallest of all, short ones under a time cap (long chains
        cost more time than such caps allow), or the `chain` given. Up to `rounds` solves of
        `node_limit` nodes, each after learning from the plan the one before compiled; the last
        one's bound on the modelled peak (bytes) is left in `peak_bound`."""
        best, bias = None, 0.0
        self._use_chain(chain or (LONG_CHAIN if cap_seconds is None else SHORT_CHAIN))
        self.correction = self.initial_correction
        for round_index in range(rounds):
            choice = self._solve(cap_seconds=None if cap_seconds is None else cap_seconds - bias, minimize_peak=True,
                                 node_limit=node_limit)
            if choice is None:
                break
            plan = self._compiled_plan(choice, None)
            plan.rounds = round_index + 1
            added = plan.predicted_seconds - self.base_seconds
            within = cap_seconds is None or added <= cap_seconds * (1 + 1e-9)
            if within and (best is None or plan.footprint_bytes < best.footprint_bytes):
                best = plan
            before = (self.correction, bias)
            self._learn(choice, plan)
            # the compiled plan's own time is the prediction; where the model's sum missed it
            # (decodes a replay's sources need), the next solve asks for that much less
            bias = max(bias, added - self._model_seconds(choice))
            if bias == before[1] and np.array_equal(self.correction, before[0]):
                break       # the model was right at this choice: the next solve would repeat it
        return best

    def floor(self):
        """A lower bound on the footprint of every plan this optimizer can choose: the most
        bytes one step of the unoptimized program needs whatever is chosen. At each step:
        the persistent bytes (weights, momentum), the net's inputs, every other buffer the
        step names that no choice changes (its gradients, weight gradient and workspace, in
        place where the plan shares them), each stashed top it names in the smallest form any
        option gives it there (fp32 in the forward pass; in the backward pass kept, its
        encoding's codes and decoded part, or the copy a recomputation rebuilds), and 0 for a
        layer's saved tensors; the evaluation program's need too. Everything else live at
        that step (stashes of other steps, other branches' gradients) counts 0, so no plan
        reaches below it. Under lossy modes the smaller of this bound and the one at smaller
        batch chunks. Returns (bytes, the step's label, {category: bytes})."""
        chunked = self._chunked_optimizer()
        own = self._floor()
        return own if chunked is None else min(own, chunked._floor(), key=lambda found: found[0])

    def _floor(self):
        program, plan = self.base.program, self.base.plan
        group_of = {name: index for index, group in enumerate(plan.groups) for name in group.members}
        inputs = {group_of[n] for n, b in program.buffers.items() if b.category == INPUT and n in group_of}
        best = (plan.persistent_bytes + self.eval_transient, "the evaluation program", {})
        for index, step in enumerate(program.steps):
            parts, ending, starting = {}, 0, 0
            named = {}
            for name in set(step.buffer_names()):
                buffer = program.buffers[name]
                if not buffer.persistent and (buffer.category != STASH or stash_key(buffer) in self.stashes):
                    named.setdefault(group_of[name], []).append(buffer)
            for g in inputs - set(named):
                if plan.groups[g].first_use <= index <= plan.groups[g].last_use:
                    named[g] = [program.buffers[plan.groups[g].members[0]]]
            for g, buffers in named.items():
                group = plan.groups[g]
                held, category, last = 0, None, group.last_use
                for buffer in buffers:      # in place: the members share the group's bytes
                    stash = self.stashes.get(stash_key(buffer)) if buffer.kind == "blob" else None
                    if stash is None:
                        nbytes = align(group.nbytes)
                    elif index <= stash.last_forward:
                        nbytes, last = stash.nbytes, stash.last_forward
                    else:
                        nbytes = min(stash.nbytes + sum(n for first, end, n in option.intervals if first <= index <= end)
                                     for option in stash.options)
                        last = stash.last_reader
                    if nbytes > held:
                        held, category = nbytes, (STASH if stash is not None else buffer.category)
                    category = category or (STASH if stash is not None else buffer.category)
                parts[category] = parts.get(category, 0) + held
                if group.first_use < index == last:
                    ending += held
                elif group.first_use == index < last:
                    starting += held
            # an output may take the bytes of an input read for the last time (a layer in place
            # where the plan has none yet: Gist's codes can free an fp32 stash for it)
            shared = min(ending, starting)
            total = plan.persistent_bytes + sum(parts.values()) - shared
            if total > best[0]:
                best = (total, step.label, dict(parts, persistent=plan.persistent_bytes, shared=-shared))
        return best

    def overhead_floor(self, budget):
        """A lower bound on the predicted overhead (a fraction) of every plan within `budget`
        bytes, from one step at a time: at a backward step the bytes no choice changes (the
        persistent ones, the inputs, gradients, workspace) plus, for every stashed top live
        there, what its option holds at that step (kept, its codes and decoded part, 0 when
        dropped and rebuilt later) must fit `budget`, and each option adds at least its own
        time (a recomputation its own chain's replays; a layer's saved tensors count 0 bytes,
        the interactions nothing). The least time added that meets that at one step, over
        fractional choices (a linear program), bounds every plan; the largest over the steps is
        returned (None: no choice fits some step, whatever the time)."""
        from scipy.optimize import linprog
        program, plan = self.base.program, self.base.plan
        stash_groups = [g for g in plan.groups if any(
            program.buffers[m].category == STASH or (program.buffers[m].kind == "blob" and stash_key(program.buffers[m])
                                                     in self.stashes) for m in g.members)]
        worst = 0.0
        for index in range(self.first_backward, self.steps):
            fixed = self.base_live[index] - sum(align(g.nbytes) for g in stash_groups
                                                if g.first_use <= index <= g.last_use)
            costs, held, rows = [], [], []
            for stash in self.stashes.values():
                if not stash.produced <= index <= stash.last_reader:
                    continue
                first = len(costs)
                for option in stash.options:
                    costs.append(option.seconds)
                    held.append(stash.nbytes + sum(n for a, b, n in option.intervals if a <= index <= b))
                rows.append((first, len(costs)))
            if not costs:
                continue
            equality = np.zeros((len(rows), len(costs)))
            for row, (first, end) in enumerate(rows):
                equality[row, first:end] = 1.0
            result = linprog(costs, A_ub=[np.array(held) / _MIB], b_ub=[(budget - fixed) / _MIB],
                             A_eq=equality, b_eq=np.ones(len(rows)), bounds=(0, 1), method="highs")
            if result.status == 2:
                return None
            worst = max(worst, result.fun)
        return worst / self.base_seconds



class SettingsSearch:
    """The optimizers of one net under each setting chosen beside the per-stash choices: the
    front whole and micro-batched through each of `fronts` (train.py --microbatch auto, where
    `choose_front`; None: passes/microbatch.front_candidates), under `options`' SGD update and
    each of `updates` (--update auto: "blocked", where it makes some weight gradient in
    blocks). fit, smallest and within ask each and take the best plan. Every plan is compared with `none`
    under `options`, its front whole. `dropped`: {(update, front): why} of the settings that
    could not be planned (an evaluation program or smaller chunks the pass refuses): the search
    goes on without them."""

    def __init__(self, model, options, cost_model, lossy=False, fronts=None, updates=(), choose_front=True):
        self.whole = Optimizer(model, options.replace(microbatch=(), spans=()), cost_model, lossy=lossy)
        self.choose_front = choose_front
        if not choose_front:
            fronts = ()
        self.fronts = front_candidates(self.whole.base.program) if fronts is None else list(fronts)
        self.layouts = layouts(self.whole.base.program, self.fronts)
        self.updates = [options.update]
        self.unblocked = [u for u in updates if u == "blocked" and not makes_blocks(model, options)]
        self.updates += [u for u in updates if u != options.update and u not in self.unblocked]
        self.optimizers, self.dropped = [self.whole], {}
        for update in self.updates:
            for front, spans in [((), ())] + self.layouts:
                if (update, front, spans) == (options.update, (), ()):
                    continue
                try:
                    self.optimizers.append(Optimizer(model, options.replace(update=update, microbatch=front,
                                                                            spans=spans),
                                                     cost_model, lossy=lossy, compared_with=options))
                except MinigistError as exc:
                    self.dropped[(update, front, spans)] = str(exc)
        self.baseline_footprint = self.whole.baseline_footprint
        self.baseline_seconds = self.whole.baseline_seconds

    def floor(self):
        """The lowest of the optimizers' bounds (Optimizer.floor)."""
        return min((optimizer.floor() for optimizer in self.optimizers), key=lambda found: found[0])

    def fit(self, budget):
        """The plan of least predicted time that fits `budget` bytes over every setting (the
        whole front and the asked update among equals); when none fits, the refusal of the
        setting that came nearest (the least of NothingFits.least: a footprint found, or a
        bound where no search was needed), naming it. A setting whose planning fails otherwise
        is left out."""
        plans, refusals = [], []
        for optimizer in list(self.optimizers):
            try:
                plans.append(optimizer.fit(budget))
            except NothingFits as exc:
                refusals.append((exc.least, len(refusals), exc, optimizer.options))
            except MinigistError as exc:
                self._drop(optimizer, exc)
        if plans:
            return min(plans, key=lambda plan: plan.predicted_seconds)
        least, _, exc, options = min(refusals)
        if len(self.optimizers) == 1:
            raise exc
        tried = "fronts" if len(self.updates) == 1 else "settings"
        raise NothingFits(f"{exc} ({self._named(options)}, the nearest of the {tried} tried: {self._tried()})", least)

    def smallest(self):
        return _smaller([self._ask(optimizer, optimizer.smallest) for optimizer in list(self.optimizers)])

    def within(self, overhead):
        return _smaller([self._ask(optimizer, lambda o=optimizer: o.within(overhead))
                         for optimizer in list(self.optimizers)])

    def _ask(self, optimizer, query):
        try:
            return query()
        except MinigistError as exc:
            self._drop(optimizer, exc)
            return None

    def _drop(self, optimizer, exc):
        """Leave a setting out of the search (the whole front's errors under the asked update
        stand)."""
        if optimizer is self.whole:
            raise exc
        self.optimizers.remove(optimizer)
        options = optimizer.options
        self.dropped[(options.update, options.microbatch, options.spans)] = str(exc)

    def _named(self, options):
        front = options.microbatch
        named = "the front whole" if not front else f"the front through {front[0]}, {front[1]} at a time"
        named += "".join(f", the span {start} -> {through}, {samples} at a time"
                         for start, through, samples in options.spans)
        return named + (f", the {options.update} update" if len(self.updates) > 1 else "")

    def describe(self):
        """The settings tried, in words."""
        dropped = "".join(f"; {self._label(update, front, spans)} left out ({why})"
                          for (update, front, spans), why in self.dropped.items())
        parts = []
        if self.choose_front:
            tried = [(front, spans) for front, spans in self.layouts
                     if any((o.options.microbatch, o.options.spans) == (front, spans) for o in self.optimizers)]
            if not tried and not self.dropped:
                parts.append("--microbatch auto: no front of this net may run a micro-batch at a time (convolutions "
                             "on --conv im2col, ReLU, pooling and LRN up to a pool); the front is whole")
            else:
                parts.append("--microbatch auto: fronts tried: " + ", ".join(
                    ["whole"] + [layout_label(front, spans) for front, spans in tried]))
        if len(self.updates) > 1 or self.unblocked:
            updates = "--update auto: updates tried: " + ", ".join(self.updates)
            if self.unblocked:
                updates += (f" (blocked makes no weight gradient in blocks here: none is above "
                            f"{WEIGHT_GRAD_BLOCK_BYTES >> 20} MiB)")
            parts.append(updates)
        return "; ".join(parts) + dropped

    def _label(self, update, front, spans=()):
        return layout_label(front, spans) + (f" {update}" if len(self.updates) > 1 else "")

    def _tried(self):
        return ", ".join(self._label(o.options.update, o.options.microbatch, o.options.spans) for o in self.optimizers)


def layouts(program, fronts):
    """The (front, spans) settings --microbatch auto plans with, beside the whole net: each of
    `fronts` alone, then each with the span behind it (passes/microbatch.span_after), which
    runs the next block a micro-batch at a time keeping its stashes instead of replaying it."""
    found = [(front, ()) for front in fronts]
    for front in fronts:
        span = span_after(program, front[0])
        if span is not None:
            found.append((front, (span,)))
    return found


def layout_label(front, spans):
    """A front and its spans in a word: "pool1:1", "pool1:1+pool2:1" (the span through pool2)."""
    label = "whole" if not front else f"{front[0]}:{front[1]}"
    return label + "".join(f"+{through}:{samples}" for _, through, samples in spans)


def makes_blocks(model, options):
    """Whether the blocked update makes some weight gradient of `model` in blocks of rows
    (otherwise its program is the fused update's)."""
    program = compile(model, options.replace(gist="none", update="blocked", microbatch=())).program
    return any("rows" in step.args for step in program.steps)


def optimizer_for(model, options, cost_model, lossy=False, microbatch=None, fronts=None, update=None):
    """An Optimizer, or with microbatch "auto" or update "auto" a SettingsSearch (of `fronts`,
    None: the candidates it finds; of the fused and the blocked update, compared with the fused
    one's `none`); any other `microbatch` is the front to plan with (BLOB, SAMPLES), None or ()
    for `options`' own, and any other `update` the update (None: `options`' own)."""
    if update == "auto":
        options, updates = options.replace(update="fused"), ("blocked",)
    else:
        options, updates = options.replace(update=update or options.update), ()
    if microbatch == "auto" or updates:
        return SettingsSearch(model, options, cost_model, lossy=lossy, fronts=fronts, updates=updates,
                              choose_front=microbatch == "auto")
    if microbatch:
        options = options.replace(microbatch=tuple(microbatch))
    return Optimizer(model, options, cost_model, lossy=lossy)


def _smaller(plans):
    """The plan of the smallest footprint among `plans` (the least predicted time among equals);
    None where every one is None."""
    found = [plan for plan in plans if plan is not None]
    return min(found, key=lambda plan: (plan.footprint_bytes, plan.predicted_seconds)) if found else None


def dominated_by(plan):
    """What fills the plan's peak: the categories, largest first, and the step."""
    report = footprint_report(plan.compiled.plan)
    total = sum(report["peak_by_category"].values())
    parts = sorted(((v, k) for k, v in report["peak_by_category"].items() if v), reverse=True)[:3]
    listed = ", ".join(f"{k} {v:,} ({100.0 * v / total:.0f}%)" for v, k in parts)
    return f"its peak (at {report['peak_step_label']}) holds {listed}"


def optimize(model, budget=None, batch_size=None, input_size=None, gist="lossless", dpr="fp16", densities=None,
             update="fused", conv="im2col", cost_model=None, options=None, max_overhead=None, microbatch=None):
    """The plan that fits `budget` bytes at the least predicted step time (None: the smallest
    plan; `max_overhead`: the smallest plan whose predicted overhead is at most that fraction).
    `gist`: "lossless" (no precision lost) or "all" (DPR in `dpr` allowed). `options`, when
    given, carries the settings instead of the keywords. `cost_model`: a costmodel model (None:
    the FLOP model at the reference rates, costmodel.reference_model). Net(model, plan=...)
    trains with it. `microbatch`: (BLOB, SAMPLES), the front run a micro-batch at a time
    (train.py --microbatch), or "auto": the optimizer chooses it too (SettingsSearch); `update`
    "auto" lets it choose the fused or the blocked SGD update (train.py --update auto), every
    plan compared with the fused update's `none`."""
    from .costmodel import reference_model
    budget = budget_bytes(budget)
    if gist not in ("lossless", "all"):
        raise MinigistError(f"--gist: the optimizer chooses with lossless or all, not {gist!r}")
    if options is None:
        options = Options(batch_size=batch_size, input_size=input_size, dpr=dpr, densities=densities,
                          update="fused" if update == "auto" else update, conv=conv)
    optimizer = optimizer_for(model, options, cost_model or reference_model(), lossy=gist == "all",
                              microbatch=microbatch, update="auto" if update == "auto" else None)
    if max_overhead is not None:
        plan = optimizer.within(max_overhead)
        if plan is None:
            raise MinigistError(f"no plan within {max_overhead:.0%} predicted overhead")
        return plan
    if budget is None:
        return optimizer.smallest()
    return optimizer.fit(budget)
