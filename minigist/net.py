"""Net: the user's handle on a model file, its weights, and its compiled programs.

    net = Net("models/vgg_small.prototxt", batch_size=32, seed=0)
    net.solver.lr = 0.01
    loss = net.train_step(images, labels)      # forward, backward, SGD update (TRAIN phase)
    outputs = net.evaluate(images, labels)    # forward only (TEST phase): {"accuracy": ..}

The model is a Caffe .prototxt or an ONNX .onnx file (minigist/onnx_import.py). An ONNX file's
initializers are its starting weights; `initializers=False` starts from the layers' fillers
instead.

One arena holds everything: the persistent part (weights, their gradients, momentum) first,
then the per-iteration part, which the training and the evaluation program share because they
never run at the same time.

Data parallelism: given `comm`, a communicator of several ranks (minigist.comm: MPI through
mpi4py, NCCL on GPUs, threads), every rank builds the same Net: `batch_size` is the global
batch, each rank trains on its share (`net.batch_size`) and feeds `train_step` its own
images; gradients are summed across the ranks and every rank ends each step with the same
weights. `shard` keeps the optimizer state, the gradients or the weights in pieces, one per
rank (passes/reduce.py). `state()` and `restore()` then gather and scatter the pieces: every
rank calls them together.

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
import inspect
import os

import numpy as np

from . import blas
from .backend import get_xp, is_gpu, to_numpy
from .cli_args import budget_bytes
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
from .passes.reduce import DEFAULT_BUCKET_BYTES
from .pipeline import Options, build, compile, per_rank, report_extra, set_chunks, with_evaluation
from .program import param_buffer_names
from .sgd import SGD

# the default thread count never exceeds this: the nets here are small, and beyond a few
# threads oneDNN's per-thread split of a 32-image batch gains little while a shared machine's
# other work loses its cores
MAX_DEFAULT_THREADS = 8
# the most threads a step runs on: a run on 100,000 OpenMP threads ended in a segmentation
# fault as they started, one on 4,096 had not finished a step after 2 minutes on 2 cores (a
# plan from shapes alone takes any count: the workspaces grow with it, nothing starts)
MAX_THREADS = 1024
PHASES = {"train": "TRAIN", "eval": "TEST"}     # the programs a Net runs, and their phases


class Net:
    def __init__(self, model, batch_size=None, input_size=None, device="cpu", dtype=np.float32,
                 seed=0, solver=None, alloc="static", memory_budget=None, gist="none", dpr="fp16",
                 binarize="fused", gist_overrides=None, ssdc_density=None, update="separate",
                 conv="im2col", add_loss=False, input_channels=None, threads=None, recompute=(),
                 recompute_shared=(), comm=None, shard="none", bucket_bytes=DEFAULT_BUCKET_BYTES, initializers=True,
                 plan=None, microbatch=(), spans=()):
        self.comm = comm
        memory_budget = budget_bytes(memory_budget)
        ranks = comm.size if comm is not None else 1
        if shard != "none" and comm is None:
            raise MinigistError(f"--shard {shard}: sharding splits the state among ranks; it needs a communicator "
                                f"(comm=...), as a run under mpiexec has")
        if plan is not None and comm is not None:
            raise MinigistError("plan: minigist.optimize plans one process's program, not a rank's share of a "
                                "data-parallel batch")
        self.options = per_rank(model, Options(
            batch_size=batch_size, input_size=input_size, input_channels=input_channels, device=device, dtype=dtype,
            conv=conv, alloc=alloc, gist=gist, dpr=dpr, binarize=binarize, overrides=gist_overrides, update=update,
            budget=memory_budget, densities=ssdc_density, add_loss=add_loss, recompute=recompute,
            recompute_shared=recompute_shared, ranks=ranks, shard=shard, bucket_bytes=bucket_bytes,
            microbatch=microbatch, spans=spans))
        if plan is not None:    # minigist.optimize's plan: its settings and decisions win
            if not hasattr(plan, "options"):
                raise MinigistError(f"plan: expected what minigist.optimize returns, got {plan!r}")
            given = dict(batch_size=batch_size, input_size=input_size, input_channels=input_channels, conv=conv,
                         alloc=alloc, gist=gist, dpr=dpr, binarize=binarize, update=update, add_loss=add_loss,
                         microbatch=microbatch, spans=tuple(tuple(span) for span in spans))
            _refuse_plan_conflicts(plan.options, given)
            owned = dict(gist_overrides=gist_overrides, ssdc_density=ssdc_density, recompute=recompute,
                         recompute_shared=recompute_shared)
            for name, value in owned.items():   # what a plan chooses itself
                if value:
                    raise MinigistError(f"plan: it chooses {name} itself; leave {name} out, or compile without a "
                                        f"plan")
            self.options = plan.options.replace(device=device, dtype=dtype, budget=memory_budget)
        self.optimized = plan if hasattr(plan, "decisions") else None
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
            raise MinigistError(f"seed: a non-negative integer, not {seed!r}")
        self.xp = get_xp(device)
        self.dtype = self.options.dtype
        self.seed = seed
        self.initializers = bool(initializers)     # start from the file's weights where it gives them (ONNX)
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
    batch_size = property(lambda self: self.train_graph.batch_size)     # this rank's share of the batch
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
        self.options = self.options.replace(budget=budget_bytes(budget))
        self._build()

    def apply_plan(self, plan):
        """Train with a plan of minigist.optimize from now on (its Gist overrides, recomputed
        tensors, densities, batch chunks, micro-batched front and spans and SGD update; re-plans, weights
        and momentum kept)."""
        if plan.options.chunk_bytes != self.options.chunk_bytes:
            for graph in self.graphs.values():
                set_chunks(graph, self.options.replace(chunk_bytes=plan.options.chunk_bytes))
        self.options = self.options.replace(gist=plan.options.gist, dpr=plan.options.dpr,
                                            overrides=plan.options.overrides, recompute=plan.options.recompute,
                                            recompute_shared=plan.options.recompute_shared,
                                            densities=plan.options.densities, chunk_bytes=plan.options.chunk_bytes,
                                            microbatch=plan.options.microbatch, update=plan.options.update,
                                            spans=plan.options.spans)
        self.optimized = plan if hasattr(plan, "decisions") else None
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
        if self.comm is not None and measured:   # every rank plans for the densest batch any rank saw
            names = sorted(measured)
            seen = self.comm.gather_values([measured[name] for name in names], "measured densities").max(axis=0)
            measured = {name: float(value) for name, value in zip(names, seen)}
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
                                                      self.arrays, self.xp, self.solver, self.pool, self.stats,
                                                      self.comm)
            return
        self.pool = None
        for key, program in self.programs.items():
            plan = self.plans[key]
            arrays = {name: self.arrays[name] if buffer.persistent else
                      views(self.persistent_bytes + plan.offset(name), buffer.shape, buffer.dtype)
                      for name, buffer in program.buffers.items()}
            self.executors[key] = Executor(program, arrays, self.xp, self.solver, self.stats, self.comm)

    def _set_layer_rng(self, rng):
        for graph in self.graphs.values():
            for layer in graph.layers:
                layer.rng = rng

    def _make_rng(self, seed):
        if self.comm is not None:   # each rank its own stream (Dropout's masks), rank 0 a single process's
            seed += 1000003 * self.comm.rank
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
        """The file's initial values (ONNX initializers, unless `initializers=False`) or the
        fillers' values, drawn in layer order whether this rank keeps a tensor whole or a piece
        of it; gradients and momentum zero."""
        rng = np.random.default_rng(seed)
        weights = {key: (array, slot) for key, array, _, slot in self._tensors() if not key.startswith("momentum:")}
        for layer in self._param_layers():
            for decl in layer.params:
                key = f"{layer.name}.{decl.name}"
                if key in weights:
                    if decl.initial is not None and self.initializers:
                        value = np.asarray(decl.initial, dtype=self.dtype)
                    else:
                        value = fill(decl.filler, decl.shape, rng, self.dtype)
                    self._put(*weights[key], value)
        for name, array in self.arrays.items():
            if name.split(":")[0] in ("pgrad", "momentum", "mshard", "gshard"):
                array.fill(0)

    @property
    def distribution(self):
        """How the ranks split the parameters (passes/reduce.py's Distribution), or None."""
        return self.compiled["train"].program.distributed

    def _tensors(self):
        """(state key, live array, the whole tensor's shape, Slot or None) of every tensor
        `state()` holds: weights ("layer.param"), then momentum ("momentum:layer.param"); a
        Slot when the array is this rank's piece of the tensor."""
        slots = self.distribution.slots if self.distribution is not None else {}
        weights, momenta = [], []
        for layer in self._param_layers():
            for index, decl in enumerate(layer.params):
                key = f"{layer.name}.{decl.name}"
                weight, _, momentum = param_buffer_names(layer, index)
                for out, label, whole, piece in ((weights, key, weight, f"wshard:{key}"),
                                                 (momenta, f"momentum:{key}", momentum, f"mshard:{key}")):
                    if whole in self.arrays:
                        out.append((label, self.arrays[whole], decl.shape, None))
                    elif piece in self.arrays:
                        out.append((label, self.arrays[piece], decl.shape, slots[key]))
        return weights + momenta

    def _put(self, array, slot, value):
        """Write the whole tensor `value` (host) into `array`, or this rank's piece of it."""
        if slot is None:
            array[...] = self.xp.asarray(value, dtype=array.dtype)
            return
        start, stop = slot.span(self.comm.rank)
        array[:stop - start] = self.xp.asarray(np.ravel(value)[start:stop], dtype=array.dtype)
        array[stop - start:].fill(0)

    def _whole(self, array, shape, slot):
        """A numpy copy of the whole tensor: the array itself, or every rank's piece gathered
        (a collective: every rank calls it)."""
        if slot is None:
            return to_numpy(array).copy()
        ranks = self.comm.size
        counts = [slot.span(rank)[1] - slot.span(rank)[0] for rank in range(ranks)]
        mine = to_numpy(array[:counts[self.comm.rank]])
        return self.comm.allgather_pieces(mine, counts, f"the state ({slot.key})").reshape(shape)

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

        def feed(arrays, rows=None):
            """Each input the arrays name (an input the front reads a micro-batch at a time is
            fed by the program's feed steps, its rows first:end as `rows` says)."""
            for top, value in zip(tops, inputs):
                target = arrays.get(f"blob:{top}")
                if target is None:
                    continue
                if rows is not None:
                    value = value[rows[0]:rows[1]]
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
        if self.comm is not None and self.comm.size > 1:     # the global batch's: every rank the same
            loss = self.comm.mean_of(loss)
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
        """{"layer.param": array} of every parameter (learned and state), live views. With the
        weights sharded (shard="weights") no rank holds them whole: `state()` gathers them."""
        out = {}
        for key, array, _, slot in self._tensors():
            if key.startswith("momentum:"):
                continue
            if slot is not None:
                raise MinigistError("the weights are sharded among the ranks (shard='weights'): no rank holds them "
                                    "whole; net.state() gathers them")
            out[key] = array
        return out

    def grads(self):
        """{"layer.param": gradient array} of the trained parameters after a backward pass
        (summed over the ranks, in a data-parallel net)."""
        if self.update != "separate":
            raise MinigistError(f"weight gradients are not kept with update={self.update!r} (each is freed as "
                                "soon as it is applied); build the Net with update='separate' to read them")
        if self.distribution is not None and self.distribution.shard in ("gradients", "weights"):
            raise MinigistError(f"the reduced weight gradients are kept in pieces, one per rank "
                                f"(shard='{self.distribution.shard}'); shard='none' or 'optimizer' keeps them whole")
        out = {}
        for layer in self._param_layers():
            for index, decl in enumerate(layer.params):
                name = param_buffer_names(layer, index)[1]
                if name in self.arrays:
                    out[f"{layer.name}.{decl.name}"] = self.arrays[name]
        return out

    def state(self):
        """Weights and momentum as numpy arrays: what a checkpoint needs to resume exactly.
        Pieces kept by the ranks are gathered whole: every rank calls it, and every rank gets it."""
        return {key: self._whole(array, shape, slot) for key, array, shape, slot in self._tensors()}

    def save(self, path, with_momentum=False):
        """Write the weights (and momentum) to a .npz file atomically, with a digest of the
        arrays that `load` checks (every rank calls it in a data-parallel net; call it on one)."""
        arrays = {key: value for key, value in self.state().items()
                  if with_momentum or not key.startswith("momentum:")}
        save_npz_atomic(path, with_digest(arrays))

    def load(self, path):
        """Read weights (and momentum, if present) from a .npz written by `save` (its digest
        checked) or by np.savez."""
        values = read_npz(path, "weights file")
        targets = {key: shape for key, _, shape, _ in self._tensors()}
        missing = [k for k in targets if not k.startswith("momentum:") and k not in values]
        if missing:
            raise MinigistError(f"{path}: no values for {', '.join(missing[:5])}")
        for key, value in values.items():
            if key not in targets:
                raise MinigistError(f"{path}: '{key}' is not a parameter of {self.model}")
            if tuple(value.shape) != tuple(targets[key]):
                raise MinigistError(f"{path}: '{key}' has shape {value.shape}, the net needs {tuple(targets[key])}")
        self.restore(values)

    def restore(self, values):
        """Write {key: array} as `state()` gives it (weights, running statistics, momentum)
        back into the net: each rank takes its piece of what it keeps in pieces."""
        tensors = {key: (array, slot) for key, array, _, slot in self._tensors()}
        for key, value in values.items():
            self._put(*tensors[key], value)

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
    lines.append(f"parameters: {graph.param_count():,}")
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


def _refuse_plan_conflicts(options, given):
    """A setting given beside a plan that differs from the plan's own would be silently
    overruled by it (a batch of 8 against a plan for 32 failed only at the first step). One
    left at Net's default takes the plan's (a default given explicitly cannot be told apart)."""
    defaults = inspect.signature(Net.__init__).parameters
    for name, value in given.items():
        planned = getattr(options, name)
        if value != defaults[name].default and value != planned:
            raise MinigistError(f"plan: it was made for {name}={planned!r}, not {name}={value!r}; leave {name} "
                                f"out (the plan's settings apply) or optimize for {name}={value!r}")


def _thread_count(threads):
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 1:
        raise MinigistError(f"--threads: expected a positive integer, got {threads!r}")
    if threads > MAX_THREADS:
        raise MinigistError(f"--threads: a step runs on at most {MAX_THREADS:,} threads, got {int(threads):,}")
    return int(threads)
