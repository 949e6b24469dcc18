"""The optimizer's cost model: a predicted time, in seconds, for every step of a program.

Two kinds, and the report names which one a plan was made with:

- `FlopModel` (plan-only): a step takes flops / GEMM rate + bytes / memory bandwidth, where
  flops are a convolution's or an inner product's multiply-adds (twice: one multiply, one
  add; a backward step counts the input gradient and the weight gradient it computes) and
  bytes are the sizes of every buffer the step names (each once; not its workspace, batch
  chunks sized to stay in the caches: a smaller chunk is predicted neither faster nor slower,
  which only a profiling run can tell). The two rates are the
  reference ones (`reference_model`: fixed, so that a plan does not depend on the machine or
  its load) or come from a micro-benchmark of about a second on this machine
  (`measure_rates`): a float32 GEMM of the shape a convolution's im2col product has, and a
  copy of an array much larger than the caches. A replay (passes/recompute.py) costs what its
  forward step costs.
- `MeasuredModel` (a training run): the times of the steps measured on this machine by a
  short profiling run (`profile`: a few iterations of the programs the optimizer chooses
  from and of one that recomputes every stash, each step timed on its own, the median kept),
  looked up by what the step runs (a replay apart from its forward step: its inputs were just
  rebuilt, and it ran 11% faster on inception_small; its forward's time where no replay of
  it was profiled); a step that was not profiled falls back to the FLOP model, scaled by how
  the profiled steps compared with it: GEMM steps by how the profiled GEMM steps did, the
  rest (decodes, elementwise steps) by how the profiled rest did, since a CPU misses the
  reference rates by different factors for the two. A forward step that writes over its input (the in-place
  pass pairs them when nothing later reads the input, as when it is recomputed) moves fewer
  bytes than the same step out of place (a replay always runs out of place); when only the
  other form was profiled, its time less (or plus) the time its output's bytes take at the
  profiled memory rate, never less than half.

Either way the predicted time of a program is the sum of its steps' times, so that a plan's
prediction is read off its real, compiled program; but a program the profiling run timed is
predicted at its own time (the sum of its steps' medians as timed in it): the unoptimized
plan's steps took up to 4% longer in it than their medians over every program profiled.
"""
import math
import time
import weakref

import numpy as np

from .program import WORKSPACE, names_in

# the step kinds a layer's own code runs (a replay is its forward once more)
_LAYER_KINDS = ("forward", "backward", "recompute")


def step_flops(step):
    """Multiply-adds x 2 of a convolution or inner-product step (0 for every other step)."""
    layer = step.layer
    if layer is None or step.kind not in _LAYER_KINDS:
        return 0
    if layer.type == "Convolution":
        kh, kw = layer.kernel
        one_pass = 2 * math.prod(layer.top_shapes[0]) * (layer.bottom_shapes[0][1] // layer.group) * kh * kw
    elif layer.type == "InnerProduct":
        one_pass = 2 * math.prod(layer.top_shapes[0]) * layer.features
    else:
        return 0
    if step.kind != "backward":
        return one_pass
    rows = step.args.get("rows")
    if rows is not None:        # a block of the weight gradient's rows (passes/backward.py)
        return one_pass * (rows[1] - rows[0]) // layer.params[0].shape[0]
    gp = step.args.get("gp") or ()
    passes = int(any(name is not None for name in step.args.get("gx") or ())) + int(bool(gp) and gp[0] is not None)
    return one_pass * passes


def step_bytes(step, buffers):
    """Bytes of every buffer the step names, each counted once, but its workspace: scratch of
    a batch chunk, sized to stay in the caches (the same traffic to memory whatever the chunk)."""
    if "rows" in step.args:
        return _rows_bytes(step, buffers)
    if "sample_range" in step.args:     # a micro-batch's rows of a code, decoded (passes/gist.py)
        first, end = step.args["sample_range"]
        return sum(buffers[name].nbytes * (end - first) // step.args["batch"] if name != step.args["out"]
                   else buffers[name].nbytes for name in set(step.buffer_names())
                   if name in buffers and buffers[name].category != WORKSPACE)
    whole = set(step.args.get("whole", ()))     # a micro-batch reads rows of these
    first, end = step.args.get("samples", (0, 0))
    return sum(buffers[name].nbytes * (end - first) // buffers[name].shape[0] if name in whole else buffers[name].nbytes
               for name in set(step.buffer_names()) if name in buffers and buffers[name].category != WORKSPACE)


def _rows_bytes(step, buffers):
    """Bytes a step of the blocked update (passes/backward.py) touches: a block of rows of the
    weights, their momentum and the gradient block, the same columns of gy, and x whole."""
    first, end = step.args["rows"]
    rows = step.layer.params[0].shape[0]
    total = 0
    for role, value in step.args.items():
        for name in set(names_in(value)):
            buffer = buffers.get(name)
            if buffer is None or buffer.category == WORKSPACE:
                continue
            if role == "x":
                total += buffer.nbytes
            elif role in ("grad", "gp"):    # the block's own buffer, its first rows used
                total += buffer.nbytes * min(end - first, buffer.shape[0]) // buffer.shape[0]
            else:                           # the block's rows of the weights and momentum, its columns of gy
                total += buffer.nbytes * (end - first) // rows
    return total


def _output_bytes(step, buffers):
    return sum(buffers[name].nbytes for name in names_in(step.args.get("y")) if name in buffers)


IN_PLACE = "in place"       # the last entry of an in-place step's signature
_inplace_sets = weakref.WeakKeyDictionary()     # program -> its in-place pairs, as a set


def runs_in_place(step, program):
    """Whether a forward step writes its output over its input (an in-place pair of `program`)."""
    if step.kind != "forward" or not program.inplace:
        return False
    pairs = _inplace_sets.get(program)
    if pairs is None:
        pairs = _inplace_sets[program] = frozenset(program.inplace)
    return any((x, y) in pairs for x in names_in(step.args.get("x")) for y in names_in(step.args.get("y")))


def signature(step, program=None):
    """What a step runs, as a key that holds across programs: a replay ("recompute") runs its
    layer's forward, keyed apart (its inputs were just rebuilt or decoded); a chunked layer's
    key names its chunk size; given its program, a forward step that runs in place says so."""
    kind = step.kind
    name = step.layer.name if step.layer is not None else (step.note or str(step.args.get("target", "")))
    if step.kind == "update":     # a layer's weights and bias are updated by two steps
        name = f"{name}:{step.args.get('param')}"
    if "samples" in step.args:    # a micro-batch of the front (passes/microbatch.py): its own work
        first, end = step.args["samples"]
        name = f"{name}:micro-batch of {end - first}"
    if "rows" in step.args:       # a block of a weight gradient's rows, made or applied
        name = f"{name}:rows {step.args['rows'][0]}-{step.args['rows'][1]}"
    elif kind == "backward" and _weight_grad_apart(step):  # the blocked update's: its input gradient alone
        name = f"{name}:weight gradient in blocks"
    op = "" if step.op is None or step.kind == "recompute" else type(step.op).__name__
    chunk = getattr(step.layer, "chunk_bytes", None)    # a layer's time depends on its batch chunks
    key = (kind, name, op) if chunk is None else (kind, name, op, chunk)
    if program is not None and runs_in_place(step, program):
        key += (IN_PLACE,)
    return key


def _weight_grad_apart(step):
    """Whether a layer's backward step leaves its trained weights' gradient to the blocked
    update's steps of rows (passes/backward.py)."""
    params = step.layer.params if step.layer is not None else ()
    gp = step.args.get("gp") or ()
    return bool(params) and params[0].trained and bool(gp) and gp[0] is None


# The reference rates: what measure_rates found, with one BLAS thread, on the machine the
# README's figures come from (a 2-core AMD EPYC with AVX-512). A plan-only run takes them unless
# asked to measure: the same model file and budget then give the same plan on every machine and
# every run (a measurement moves with the machine's load, and decisions near a tie with it).
REFERENCE_GEMM_FLOPS = 75e9
REFERENCE_BANDWIDTH = 34e9


class FlopModel:
    """Step time = flops / gemm_flops + bytes / bandwidth (both per second); `source` says
    where the rates come from ("reference", "measured" or "given")."""
    kind = "flops"

    def __init__(self, gemm_flops, bandwidth, source="given"):
        self.gemm_flops = float(gemm_flops)
        self.bandwidth = float(bandwidth)
        self.source = source

    def step_seconds(self, step, program):
        return step_flops(step) / self.gemm_flops + step_bytes(step, program.buffers) / self.bandwidth

    def program_seconds(self, program):
        return sum(self.step_seconds(step, program) for step in program.steps)

    def bytes_seconds(self, nbytes):
        """The time of a pass over `nbytes` (a step the model has no program for)."""
        return nbytes / self.bandwidth

    def describe(self):
        where = {"reference": "the reference", "measured": "this machine's measured"}.get(self.source, "the given")
        return (f"flops: FLOPs and bytes at {where} GEMM rate {self.gemm_flops / 1e9:.1f} GFLOP/s "
                f"and memory bandwidth {self.bandwidth / 1e9:.1f} GB/s")

    def to_json(self):
        return {"kind": self.kind, "rates": self.source, "gemm_flops": self.gemm_flops,
                "bandwidth_bytes_per_s": self.bandwidth}


def program_key(program):
    """What a program runs, step by step, as a key that holds across compiles of it."""
    return tuple(signature(step, program) for step in program.steps)


class MeasuredModel:
    """Step times measured by `profile`, by `signature`; the FLOP model, scaled, elsewhere.
    `own`: {program_key: seconds} of the programs profiled, each its steps' medians as timed in
    it: such a program is predicted at its own time."""
    kind = "measured"

    def __init__(self, seconds, fallback, programs_profiled, own=None):
        self.seconds = dict(seconds)
        self.fallback = fallback
        self.programs_profiled = programs_profiled
        self.own = dict(own or {})
        self.gemm_scale = self.bytes_scale = 1.0

    def calibrate(self, programs):
        """Scale the fallback by measured / predicted over the profiled steps of `programs`: one
        scale for the steps with GEMM flops, one for the others (each 1 where none was profiled)."""
        measured, predicted = [0.0, 0.0], [0.0, 0.0]
        for program in programs:
            for step in program.steps:
                key = signature(step, program)
                if key in self.seconds:
                    gemm = int(step_flops(step) > 0)
                    measured[gemm] += self.seconds[key]
                    predicted[gemm] += self.fallback.step_seconds(step, program)
        self.bytes_scale, self.gemm_scale = (m / p if p > 0 else 1.0 for m, p in zip(measured, predicted))

    def step_seconds(self, step, program):
        key = signature(step, program)
        seconds = self.seconds.get(key)
        if seconds is not None:
            return seconds
        if key[0] == "recompute":     # a replay not profiled as one: its forward's time
            key = ("forward",) + key[1:]
            seconds = self.seconds.get(key)
            if seconds is not None:
                return seconds
        output = self.bytes_seconds(_output_bytes(step, program.buffers))
        if key[-1] == IN_PLACE:
            # its output's write no longer streams to a buffer of its own: at most half the time saved
            out_of_place = self.seconds.get(key[:-1])
            if out_of_place is None:
                out_of_place = self._scaled(step, program)
            return max(out_of_place - output, out_of_place / 2)
        if key + (IN_PLACE,) in self.seconds:       # a replay of a step profiled in place
            return self.seconds[key + (IN_PLACE,)] + output
        return self._scaled(step, program)

    def _scaled(self, step, program):
        scale = self.gemm_scale if step_flops(step) > 0 else self.bytes_scale
        return scale * self.fallback.step_seconds(step, program)

    def program_seconds(self, program):
        """A profiled program's own time (a step shared with the other programs profiled can
        run slower in this one: on inception_small, `none`'s steps took 0-4% longer in it than
        their medians over every program said); the sum of its steps' times elsewhere."""
        own = self.own.get(program_key(program)) if self.own else None
        if own is not None:
            return own
        return sum(self.step_seconds(step, program) for step in program.steps)

    def bytes_seconds(self, nbytes):
        return self.bytes_scale * self.fallback.bytes_seconds(nbytes)

    def describe(self):
        return (f"measured: each step timed on this machine ({self.programs_profiled} programs profiled, "
                f"{len(self.seconds)} distinct steps); steps not profiled from FLOPs and bytes")

    def to_json(self):
        return {"kind": self.kind, "steps_profiled": len(self.seconds), "programs_profiled": self.programs_profiled,
                "gemm_flops": self.fallback.gemm_flops, "bandwidth_bytes_per_s": self.fallback.bandwidth}


def _quantize(rate):
    """A measured rate rounded to an eighth of an octave: reruns on one machine usually measure
    the same model (the optimizer is deterministic for a given model)."""
    return 2.0 ** (round(math.log2(rate) * 8) / 8)


def measure_rates(seconds=1.0):
    """(GEMM FLOP/s, memory bytes/s) of this machine, each the best of repeated runs within
    about seconds / 2: a (512 x 1152) @ (1152 x 3136) float32 product (a 3x3 convolution's
    im2col GEMM over one 56x56 image chunk) and a copy of a 64 MiB array (read and write)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((512, 1152), dtype=np.float32)
    b = rng.standard_normal((1152, 3136), dtype=np.float32)
    out = np.empty((512, 3136), np.float32)
    gemm = _best_rate(lambda: np.matmul(a, b, out=out), 2 * 512 * 1152 * 3136, seconds / 2)
    source = np.ones(16 << 20, np.float32)
    target = np.empty_like(source)
    copy = _best_rate(lambda: np.copyto(target, source), 2 * source.nbytes, seconds / 2)
    return _quantize(gemm), _quantize(copy)


def _best_rate(run, work, budget):
    run()
    best, start = math.inf, time.perf_counter()
    while time.perf_counter() - start < budget:
        tick = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - tick)
    return work / best


def flop_model(seconds=1.0):
    """The FLOP model at this machine's measured rates."""
    return FlopModel(*measure_rates(seconds), source="measured")


def reference_model():
    """The FLOP model at the reference rates (deterministic: no measurement)."""
    return FlopModel(REFERENCE_GEMM_FLOPS, REFERENCE_BANDWIDTH, source="reference")


def profile(nets, inputs, repeats=5):
    """{signature: median seconds} of every step of the training programs of `nets`, each run
    `repeats` + 1 times on `inputs` (the first a warm-up), the nets taking turns run by run
    (a machine's drift then reaches every net alike), no update steps' effects kept out: the
    profiled nets are throwaway copies, not the one that trains."""
    return profile_programs(nets, inputs, repeats)[0]


def profile_programs(nets, inputs, repeats=5):
    """`profile`'s {signature: median seconds} over all of `nets`, and {program_key: seconds}
    of each net's training program: the sum of its steps' medians as timed in it."""
    samples, own = {}, []
    for net in nets:
        program = net.compiled["train"].program
        own.append((program_key(program), [[] for _ in program.steps]))
    for run in range(repeats + 1):
        for net, (_, per_step) in zip(nets, own):
            executor = net.executors["train"]
            program = net.compiled["train"].program
            with net._threads():
                executor.load(net._feeder("train", inputs))
                for index, (step, bound) in enumerate(zip(program.steps, executor.steps)):
                    tick = time.perf_counter()
                    bound()
                    spent = time.perf_counter() - tick
                    if run:
                        samples.setdefault(signature(step, program), []).append(spent)
                        per_step[index].append(spent)
    return ({key: float(np.median(values)) for key, values in samples.items()},
            {key: float(sum(np.median(values) for values in per_step)) for key, per_step in own})
