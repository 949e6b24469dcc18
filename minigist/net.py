"""Net: the user's handle on a model file, its weights, and its compiled programs.

    net = Net("models/vgg_small.prototxt", batch_size=32, seed=0)
    net.solver.lr = 0.01
    loss = net.train_step(images, labels)      # forward, backward, SGD update (TRAIN phase)
    outputs = net.evaluate(images, labels)    # forward only (TEST phase): {"accuracy": ..}

One arena holds everything: the persistent part (weights, their gradients, momentum) first,
then the per-iteration part, which the training and the evaluation program share because they
never run at the same time.

The convolution engine: `conv="im2col"` (the library's default: minigist's own, numpy + BLAS,
so that a plan and its footprint do not depend on what is installed or on the blocked layouts
oneDNN picks for a CPU), `"onednn"` (oneDNN's direct kernels, float32 on the CPU) or `"auto"`
(oneDNN where it can run, im2col otherwise; train.py's default). `net.conv` is the engine
chosen, never "auto", and so is the report's "conv" field.

Threads: every step (and the planning, since oneDNN's scratchpads depend on it) runs under
`threads` (None: `default_threads(engine)`, the policy train.py applies too), and the
process's own settings are put back after it. With im2col that is numpy's BLAS thread count;
with oneDNN it is oneDNN's OpenMP threads and the codec kernels', while BLAS runs on one.
"""
import contextlib
import os

import numpy as np

from . import blas
from .backend import get_xp, is_gpu, to_numpy
from .checkpoint import read_npz, save_npz_atomic, with_digest
from .errors import MinigistError
from .layers.loss import check_labels
from .densities import MARGIN
from .codecs import kernels as codec_kernels
from .executor import DynamicExecutor, Executor
from .fillers import fill
from .gpu.kernels import CounterRNG
from . import onednn
from .memory import plan_none
from .memory.arena import Views, new_arena
from .memory.available import check_fits
from .memory.pool import Pool
from .memory.report import footprint_report
from .passes.gist_steps import GistStats
from .pipeline import Options, build, compile, report_extra, set_chunks, with_evaluation
from .program import param_buffer_names
from .sgd import SGD

# the default thread count never exceeds this: the nets here are small, and beyond a few
# threads oneDNN's per-thread split of a 32-image batch gains little while a shared machine's
# other work loses its cores
MAX_DEFAULT_THREADS = 8
PHASES = {"train": "TRAIN", "eval": "TEST"}     # the programs a Net runs, and their phases


class Net:
    def __init__(self, model, batch_size=None, input_size=None, device="cpu", dtype=np.float32,
                 seed=0, solver=None, alloc="static", memory_budget=None, gist="none", dpr="fp16",
                 binarize="fused", gist_overrides=None, ssdc_density=None, update="separate",
                 conv="im2col", add_loss=False, input_channels=None, threads=None, recompute=(), plan=None):
        self.options = Options(batch_size=batch_size, input_size=input_size, input_channels=input_channels,
                               device=device, dtype=dtype, conv=conv, alloc=alloc, gist=gist, dpr=dpr,
                               binarize=binarize, overrides=gist_overrides, update=update, budget=memory_budget,
                               densities=ssdc_density, add_loss=add_loss, recompute=recompute)
        if plan is not None:    # minigist.optimize's plan: its settings and decisions win
            self.options = plan.options.replace(device=device, dtype=dtype, budget=memory_budget)
        self.optimized = plan if hasattr(plan, "decisions") else None
        self.xp = get_xp(device)
        self.dtype = self.options.dtype
        self.seed = seed
        self.model = str(model)
        built = {phase: build(model, self.options, phase) for phase in ("TRAIN", "TEST")}
        self.graphs = {phase: graph for phase, (graph, _) in built.items()}
        self.train_graph = self.graphs["TRAIN"]
        self.conv = built["TRAIN"][1]
        self.threads = default_threads(self.conv) if threads is None else _thread_count(threads)
        # oneDNN's OpenMP threads take the cores; OpenBLAS's idle threads spin for about 0.1 s
        # after each call and would take them back (resnet20's step: 266 ms with two BLAS
        # threads, 39 ms with one). Its few BLAS calls run on one thread during a step, and
        # Gist's codec kernels on the OpenMP threads (numba's OpenMP layer shares them).
        onednn_engine = self.conv == "onednn"
        self.blas_threads = (1 if onednn_engine else self.threads) if self.xp is np else None
        self.omp_threads = self.threads if onednn_engine else None
        self.codec_threads = self.threads if onednn_engine else None
        self.solver = solver or SGD()
        self.stats = GistStats()
        self.arena = None
        self._build()
        self._init_params(seed)
        self.rng = self._make_rng(seed + 1)
        self._set_layer_rng(self.rng)

    # the compiled programs and their plans, by key of PHASES
    programs = property(lambda self: {key: compiled.program for key, compiled in self.compiled.items()})
    plans = property(lambda self: {key: compiled.plan for key, compiled in self.compiled.items()})

    # the settings, as the options hold them
    gist = property(lambda self: self.options.gist_config())
    alloc = property(lambda self: self.options.alloc)
    update = property(lambda self: self.options.update)
    memory_budget = property(lambda self: self.options.budget)

    @contextlib.contextmanager
    def _threads(self):
        """The BLAS, OpenMP and codec-kernel threads of this net's steps and of its planning
        (the process's own outside)."""
        with blas.threads(self.blas_threads), onednn.threads(self.omp_threads), \
                codec_kernels.threads(self.codec_threads):
            yield

    # ---- construction -------------------------------------------------------------------
    def _build(self, calibrating=False):
        """Compile both programs (minigist.pipeline), plan the arena and bind the executors. A
        rebuild (after calibration, or with new options) carries the persistent state
        (weights, momentum) over."""
        old_arena, old_persistent = self.arena, getattr(self, "persistent_bytes", 0)
        # the calibration pass plans every SSDC candidate at full capacity: a measurement, not
        # the training plan, so the budget is not held against it; oneDNN sizes its scratchpads
        # for the thread count its primitives are made under
        with self._threads():
            self.compiled = {key: compile(self.model, self.options, phase, graph=self.graphs[phase],
                                          calibrating=calibrating and key == "train")
                             for key, phase in PHASES.items()}
            self._allocate(self.alloc, None if calibrating else self.memory_budget)
        if old_arena is not None:
            assert old_persistent == self.persistent_bytes
            self.arena[:old_persistent] = old_arena[:old_persistent]
            del old_arena
            if is_gpu(self.xp) and hasattr(self.xp, "get_default_memory_pool"):
                # CuPy's pool would keep the old arena cached, held from the device for good
                self.xp.get_default_memory_pool().free_all_blocks()

    def set_memory_budget(self, budget):
        """Hold the training plan to `budget` bytes from now on (None: no limit): re-plans and
        raises MemoryBudgetError if the plan does not fit (static / none), or limits the pool
        (dynamic). Weights and momentum are kept. train.py sets its budget this way after
        calibration, so that the plan it checks is the one SSDC's measured densities give."""
        self.options = self.options.replace(budget=budget)
        self._build()

    def apply_plan(self, plan):
        """Train with a plan of minigist.optimize from now on (its Gist overrides, recomputed
        tensors, densities and batch chunks; re-plans, weights and momentum kept)."""
        if plan.options.chunk_bytes != self.options.chunk_bytes:
            for graph in self.graphs.values():
                set_chunks(graph, self.options.replace(chunk_bytes=plan.options.chunk_bytes))
        self.options = self.options.replace(gist=plan.options.gist, dpr=plan.options.dpr,
                                            overrides=plan.options.overrides, recompute=plan.options.recompute,
                                            densities=plan.options.densities, chunk_bytes=plan.options.chunk_bytes)
        self.optimized = plan
        self._build()

    def set_densities(self, densities):
        """Plan SSDC for {tensor: fraction of non-zeros} from now on (re-plans; weights and
        momentum are kept): what `calibrate` does with the densities it measures."""
        self.options = self.options.replace(densities=densities)
        self._build()

    def calibrate(self, batches, margin=MARGIN):
        """Measure each SSDC candidate's density on `batches` (tuples of net inputs) through
        forward and backward passes, then plan SSDC for `margin` above the densest batch seen.
        Weights, running statistics, momentum and the net's random stream (Dropout's masks)
        are left as they were: a calibrated net trains bit for bit like one that never was.
        Returns the densities."""
        if not self.gist.lossless:
            return {}
        keep = self.state()
        self.stats = GistStats()
        self._build(calibrating=True)
        # calibration draws its Dropout masks from a stream of its own, so that training's
        # stream starts where it would have started without a calibration
        self._set_layer_rng(self._make_rng(self.seed + 2))
        try:
            for inputs in batches:
                self.forward_backward(*inputs)
        finally:
            self._set_layer_rng(self.rng)
        measured = dict(self.stats.density)
        self.stats = GistStats()
        self.set_densities({name: min(1.0, density * (1.0 + margin)) for name, density in measured.items()})
        self.restore(keep)
        return measured

    def _allocate(self, alloc, memory_budget):
        """Carve every array of both plans out of one arena: the persistent part first."""
        persistent = {}
        for program in self.programs.values():
            for name, buffer in program.buffers.items():
                if buffer.persistent:
                    known = persistent.setdefault(name, buffer)
                    if known.shape != buffer.shape:
                        raise MinigistError(f"{self.model}: parameter {name} has shape {buffer.shape} "
                                            f"in TEST but {known.shape} in TRAIN")
        persistent_offsets, self.persistent_bytes = plan_none({n: b.nbytes for n, b in persistent.items()})
        if memory_budget is not None and alloc != "dynamic":   # the pool checks as it runs
            self.plans["train"].check_budget(memory_budget, self.persistent_bytes - self.plans["train"].persistent_bytes)
        if alloc == "dynamic":
            # address space the pool may grow into: no plan can need more than no sharing
            transient = max(plan_none({i: g.nbytes for i, g in enumerate(plan.groups)})[1]
                            for plan in self.plans.values())
        else:
            transient = max(plan.transient_bytes for plan in self.plans.values())
        self.arena_bytes = self.persistent_bytes + transient
        if memory_budget is not None and alloc != "dynamic":
            # the evaluation program (the TEST phase at its own batch size) shares the arena's
            # per-iteration part: where it needs more than training, the budget holds it too
            self.plans["eval"].check_budget(memory_budget, self.arena_bytes - self.plans["eval"].footprint_bytes)
        if self.xp is np:   # before the arena and the weights exist: one line, not numpy's MemoryError
            check_fits(self.arena_bytes, f"{self.model}: the {alloc} arena (weights, their gradients, momentum "
                                         f"and the per-iteration buffers at batch {self.train_graph.batch_size})")
        self.arena = new_arena(self.xp, self.arena_bytes)
        views = Views(self.arena)      # one object per buffer place and form (in-place steps)
        self.arrays = {name: views(persistent_offsets[name], buffer.shape, buffer.dtype)
                       for name, buffer in persistent.items()}
        self.executors = {}
        if alloc == "dynamic":
            limit = None if memory_budget is None else memory_budget - self.persistent_bytes
            note = "" if limit is None else (f" (the memory budget {memory_budget:,} less {self.persistent_bytes:,} "
                                             f"bytes of weights, their gradients and momentum)")
            self.pool = Pool(limit=limit, limit_note=note)
            for key, program in self.programs.items():
                self.executors[key] = DynamicExecutor(program, self.plans[key], self.arena, self.persistent_bytes,
                                                      self.arrays, self.xp, self.solver, self.pool, self.stats)
            return
        self.pool = None
        for key, program in self.programs.items():
            plan = self.plans[key]
            arrays = {name: self.arrays[name] if buffer.persistent else
                      views(self.persistent_bytes + plan.offset(name), buffer.shape, buffer.dtype)
                      for name, buffer in program.buffers.items()}
            self.executors[key] = Executor(program, arrays, self.xp, self.solver, self.stats)

    def _set_layer_rng(self, rng):
        for graph in self.graphs.values():
            for layer in graph.layers:
                layer.rng = rng

    def _make_rng(self, seed):
        if self.xp is np:
            return np.random.default_rng(seed)
        # Dropout's masks on the GPU: a counter-based stream drawn inside its kernel, whose
        # state (two integers) a checkpoint keeps (minigist/gpu/kernels.py)
        return CounterRNG(seed)

    def _param_layers(self):
        """Every layer with parameters, each name once, TRAIN graph first."""
        seen = {}
        for graph in (self.graphs["TRAIN"], self.graphs["TEST"]):
            for layer in graph.layers:
                if layer.params and layer.name not in seen:
                    seen[layer.name] = layer
        return list(seen.values())

    def _init_params(self, seed):
        rng = np.random.default_rng(seed)
        for layer in self._param_layers():
            for index, decl in enumerate(layer.params):
                weight, grad, momentum = param_buffer_names(layer, index)
                if weight in self.arrays:
                    self.arrays[weight][...] = self.xp.asarray(fill(decl.filler, decl.shape, rng, self.dtype))
                for name in (grad, momentum):
                    if name in self.arrays:
                        self.arrays[name].fill(0)

    # ---- running ------------------------------------------------------------------------
    def _feeder(self, key, inputs):
        graph = self.compiled[key].program.graph
        tops = [top for node in graph.nodes if node.layer.is_data for top in node.tops]
        if len(inputs) > len(tops):
            raise MinigistError(f"{len(inputs)} inputs given, the net takes {len(tops)} ({', '.join(tops)})")
        for top, value in zip(tops, inputs):
            want = graph.blobs[top].shape
            if tuple(np.shape(value)) != want:
                raise MinigistError(f"input '{top}' must have shape {want}, got {tuple(np.shape(value))}")

        labels = self._label_tops(graph)
        for top, value in zip(tops, inputs):
            if top in labels:      # checked here, on the host: a check on the device is a sync
                check_labels(value, labels[top])
        device = is_gpu(self.xp)

        def feed(arrays):
            for top, value in zip(tops, inputs):
                target = arrays[f"blob:{top}"]
                if device:   # one host-to-device copy into the arena (no device temporary)
                    target.set(np.ascontiguousarray(to_numpy(value), dtype=target.dtype))
                else:
                    target[...] = self.xp.asarray(value, dtype=target.dtype)
        return feed

    @staticmethod
    def _label_tops(graph):
        """{input top: (the loss or accuracy layer reading it as labels)} of `graph`."""
        tops = {top for node in graph.nodes if node.layer.is_data for top in node.tops}
        found = {}
        for node in graph.nodes:
            layer = node.layer
            if hasattr(layer, "label_range") and len(node.bottoms) > 1 and node.bottoms[1] in tops:
                found.setdefault(node.bottoms[1], layer)
        return found

    def _weighted_loss(self, key):
        weights = self.compiled[key].program.loss_weights

        def collect(arrays):
            return float(sum(weight * float(arrays[name]) for name, weight in weights.items()))
        return collect

    def forward_backward(self, *inputs):
        """Forward and backward on one batch, no update; returns the weighted loss. The weight
        gradients stay readable (`grads()`) only with update="separate"."""
        with self._threads():
            return self.executors["train"].run(self._feeder("train", inputs), self._weighted_loss("train"),
                                               update=False)

    def input_gradients(self, *inputs):
        """Forward and backward on one batch, no update; returns {input blob: the gradient of
        the weighted loss with respect to it} as numpy arrays. Needs `force_backward: true`
        in the model file (Caffe computes input gradients only then)."""
        program = self.compiled["train"].program
        names = {program.buffers[name].tensor: name for name in program.outputs.values()
                 if program.buffers[name].kind == "grad"}
        if not names:
            raise MinigistError(f"{self.model}: no input gradients are computed; the model file needs "
                                "'force_backward: true' (and a loss layer)")

        def collect(arrays):
            return {blob: to_numpy(arrays[name]).copy() for blob, name in names.items()}
        with self._threads():
            return self.executors["train"].run(self._feeder("train", inputs), collect, update=False)

    def train_step(self, *inputs):
        """One SGD iteration on one batch (data, label); returns the weighted loss."""
        if not self.train_graph.loss_weights:
            raise MinigistError(f"{self.model}: no loss layer, nothing to train (a deploy file); build the Net "
                                "with add_loss=True to append a SoftmaxWithLoss on its scores")
        with self._threads():
            loss = self.executors["train"].run(self._feeder("train", inputs), self._weighted_loss("train"))
        self._check_ssdc_fit()
        return loss

    def _check_ssdc_fit(self):
        """On the GPU, SSDC's encodes check their capacity on the device; once per step (one host
        sync) the net asks whether a batch was denser than planned. That step's over-capacity
        tensors were stored as zeros (counted in the report's ssdc_overflows); the plan is then
        refitted to what was seen, plus the calibration margin, for the steps after it."""
        stats = self.stats
        if stats.counts is None or not stats.overflowed():
            return
        planned, seen = dict(self.gist.ssdc_density), stats.density
        self.set_densities({tensor: min(1.0, max(density, seen.get(tensor, 0.0)) * (1.0 + MARGIN))
                            for tensor, density in planned.items()})

    def evaluate(self, *inputs):
        """TEST-phase forward; returns {output blob: value} for the blobs no layer consumes
        (scalars as floats, other blobs as numpy arrays)."""
        outputs = self.compiled["eval"].program.outputs

        def collect(arrays):
            result = {}
            for blob, name in outputs.items():
                value = to_numpy(arrays[name])
                result[blob] = float(value) if value.ndim == 0 else value.copy()
            return result
        with self._threads():
            return self.executors["eval"].run(self._feeder("eval", inputs), collect)

    def report(self):
        """The footprint report (a dict) of the training program under this net's mode, with
        what the Gist encoders measured so far."""
        config = self.gist
        extra = report_extra(config, self.update, self.conv, self.train_graph)
        extra["gist"].update({"ssdc_density_planned": dict(config.ssdc_density),
                              "ssdc_density_seen": dict(self.stats.density),
                              "ssdc_fallbacks": self.stats.fallbacks,
                              "ssdc_overflows": self.stats.overflows,
                              "ssdc_fallback_bytes": self.stats.fallback_bytes})
        report = footprint_report(self.plans["train"], model=self.model,
                                  parameters=self.train_graph.param_count(), extra=extra)
        if self.optimized is not None:
            report["optimizer"] = self.optimized.to_json()
        return with_evaluation(report, self.plans["train"], self.plans["eval"], self.graphs["TEST"])

    # ---- parameters ---------------------------------------------------------------------
    def params(self):
        """{"layer.param": array} of every parameter (learned and state), live views."""
        out = {}
        for layer in self._param_layers():
            for index, decl in enumerate(layer.params):
                out[f"{layer.name}.{decl.name}"] = self.arrays[param_buffer_names(layer, index)[0]]
        return out

    def grads(self):
        """{"layer.param": gradient array} of the trained parameters after a backward pass."""
        if self.update == "fused":
            raise MinigistError("weight gradients are not kept with update='fused' (each is freed as soon as "
                                "it is applied); build the Net with update='separate' to read them")
        out = {}
        for layer in self._param_layers():
            for index, decl in enumerate(layer.params):
                name = param_buffer_names(layer, index)[1]
                if name in self.arrays:
                    out[f"{layer.name}.{decl.name}"] = self.arrays[name]
        return out

    def state(self):
        """Weights and momentum as numpy arrays: what a checkpoint needs to resume exactly."""
        out = {key: to_numpy(value).copy() for key, value in self.params().items()}
        for layer in self._param_layers():
            for index, decl in enumerate(layer.params):
                name = param_buffer_names(layer, index)[2]
                if name in self.arrays:
                    out[f"momentum:{layer.name}.{decl.name}"] = to_numpy(self.arrays[name]).copy()
        return out

    def save(self, path, with_momentum=False):
        """Write the weights (and momentum) to a .npz file atomically, with a digest of the
        arrays that `load` checks."""
        arrays = self.state() if with_momentum else {k: to_numpy(v) for k, v in self.params().items()}
        save_npz_atomic(path, with_digest(arrays))

    def load(self, path):
        """Read weights (and momentum, if present) from a .npz written by `save` (its digest
        checked) or by np.savez."""
        values = read_npz(path, "weights file")
        targets = self._state_targets()
        missing = [k for k in self.params() if k not in values]
        if missing:
            raise MinigistError(f"{path}: no values for {', '.join(missing[:5])}")
        for key, value in values.items():
            if key not in targets:
                raise MinigistError(f"{path}: '{key}' is not a parameter of {self.model}")
            if tuple(value.shape) != tuple(targets[key].shape):
                raise MinigistError(f"{path}: '{key}' has shape {value.shape}, the net needs {targets[key].shape}")
            targets[key][...] = self.xp.asarray(value)

    def _state_targets(self):
        """{key: live array} for every key that `state()` writes."""
        targets = dict(self.params())
        for layer in self._param_layers():
            for index, decl in enumerate(layer.params):
                name = param_buffer_names(layer, index)[2]
                if name in self.arrays:
                    targets[f"momentum:{layer.name}.{decl.name}"] = self.arrays[name]
        return targets

    def restore(self, values):
        """Write {key: array} as `state()` gives it (weights, running statistics, momentum)
        back into the net."""
        targets = self._state_targets()
        for key, value in values.items():
            targets[key][...] = self.xp.asarray(value)

    # ---- description --------------------------------------------------------------------
    def summary(self):
        return summary(self.train_graph)


def summary(graph):
    """One row per layer (name, type, output shape, parameters), then `parameters: N`."""
    rows = [("layer", "type", "output shape", "parameters")]
    for node in graph.nodes:
        layer = node.layer
        shapes = ", ".join("x".join(str(d) for d in shape) or "scalar" for shape in layer.top_shapes)
        count = sum(int(np.prod(p.shape)) for p in layer.params if p.learnable)
        rows.append((layer.name, layer.type, shapes, f"{count:,}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"parameters: {graph.param_count()}")
    if graph.added_loss:
        lines.append(f"added loss: {graph.added_loss}")
    elif not graph.loss_weights:
        lines.append("forward only: no loss layer (add_loss=True, train.py --add-loss, appends a SoftmaxWithLoss)")
    return "\n".join(lines)


def usable_cpus():
    """The CPUs this process may run on (its affinity mask, where the OS tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _env_count(name):
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def default_threads(conv):
    """The thread count a step of engine `conv` runs on when none is asked for (Net and
    train.py apply the same policy). oneDNN: OMP_NUM_THREADS if set, else the CPUs this
    process may use, at most MAX_DEFAULT_THREADS. im2col: OPENBLAS_NUM_THREADS if set, else 1:
    OpenBLAS's idle threads spin-wait after each call, and on a small machine shared with other
    work a multi-threaded BLAS made a step several times slower (vgg_small 3.7 s against 0.7)."""
    if conv == "onednn":
        return _env_count("OMP_NUM_THREADS") or min(usable_cpus(), MAX_DEFAULT_THREADS)
    return _env_count("OPENBLAS_NUM_THREADS") or 1


def _thread_count(threads):
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise MinigistError(f"--threads: expected a positive integer, got {threads!r}")
    return int(threads)
