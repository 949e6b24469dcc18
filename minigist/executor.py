"""The executor: binds each step of a program to array views, then runs them in a plain loop."""
from .memory.arena import Views
from .memory.plan import schedule
from .sgd import bind_update


def arrays_for(arrays, names):
    """The arrays of one step argument: a list of names (None stays None) or a dict of them."""
    if isinstance(names, dict):
        return {key: arrays[name] for key, name in names.items()}
    return [arrays[name] if name is not None else None for name in names]


class Feeding:
    """The batch a run is on: `feed(arrays, rows=None)` writes the net's inputs (rows first:end
    of them where `rows` is given) into the named arrays. A run sets it before its first step;
    an op that names "feeding" in its `needs` (passes/microbatch.py's Feed: a micro-batch's rows
    of the input, fed again where the front replays it) calls it in the middle of the run."""

    def __init__(self):
        self.feed = None


def bind_step(step, arrays, xp, solver, stats=None, comm=None, feeding=None):
    """A no-argument callable that runs `step` on `arrays` (buffer name -> array). A step that
    carries an `op` (a kind some pass added, e.g. Gist's) is bound by it; `stats` is handed to
    those ops as it is, and the solver and the ranks' communicator `comm` to those whose
    `needs` name them, and `feeding` (the batch of the run) to those that feed an input."""
    args = step.args
    layer = step.layer
    if "samples" in args:     # a micro-batch: rows first:end of the whole-batch buffers (passes/microbatch.py)
        first, end = args["samples"]
        arrays = {**arrays, **{name: arrays[name][first:end] for name in args["whole"]}}
    if step.op is not None:
        wanted = {"solver": solver, "comm": comm, "feeding": feeding}
        return step.op.bind(step, arrays, xp, stats, **{name: wanted[name] for name in getattr(step.op, "needs", ())})
    if step.kind == "forward":
        x, y, p, saved, ws = (arrays_for(arrays, args[role]) for role in ("x", "y", "p", "saved", "ws"))
        return lambda: layer.forward(xp, x, y, p, saved, ws)
    if step.kind == "backward" and "rows" in args:     # a block of a weight gradient's rows
        x, gy, (gw,) = (arrays_for(arrays, args[role]) for role in ("x", "gy", "gp"))
        first, end = args["rows"]
        gw = gw[:end - first]
        return lambda: layer.weight_grad_rows(xp, x, gy, gw, first, end)
    if step.kind == "backward":
        bound = [arrays_for(arrays, args[role]) for role in ("x", "y", "gy", "gx", "p", "gp", "saved", "ws")]
        if args.get("accumulate"):      # a later micro-batch adds into the parameter gradients
            return lambda: layer.backward(xp, *bound, accumulate=True)
        return lambda: layer.backward(xp, *bound)
    if step.kind == "seed":
        target, value = arrays[args["target"]], args["value"]
        return lambda: target.fill(value)
    if step.kind == "zero":
        target = arrays[args["target"]]
        return lambda: target.fill(0)
    if step.kind == "accumulate":
        target, source = arrays[args["target"]], arrays[args["source"]]
        return lambda: xp.add(target, source, out=target)
    if step.kind == "update":
        weight, grad, momentum = (arrays[args[role]] for role in ("param", "grad", "momentum"))
        if "rows" in args:     # rows first:end of the weights, their gradient in a block of its own
            first, end = args["rows"]
            weight, grad, momentum = weight[first:end], grad[:end - first], momentum[first:end]
        return bind_update(xp, solver, weight, grad, momentum, arrays[args["ws"]], args["lr_mult"],
                           args["decay_mult"])
    raise ValueError(f"unknown step kind {step.kind!r}")


class Executor:
    """Runs a program whose buffers all have fixed places (none and static modes):
    every step is bound once, then `for step in steps: step()`."""

    def __init__(self, program, arrays, xp, solver=None, stats=None, comm=None):
        self.program = program
        self.arrays = arrays
        self.feeding = Feeding()
        self.steps = [bind_step(step, arrays, xp, solver, stats, comm, self.feeding) for step in program.steps]
        self.no_update = [bound for bound, step in zip(self.steps, program.steps) if step.kind != "update"]

    def load(self, feed):
        """Write the inputs the program holds whole, and hand `feed` to its feed steps (a caller
        that runs `steps` one by one loads first)."""
        self.feeding.feed = feed
        feed(self.arrays)

    def run(self, feed, collect, update=True):
        """feed(arrays, rows=None) writes the inputs (Feeding); collect(arrays) reads the
        outputs, which it returns. update=False skips the SGD update steps (wherever they sit)."""
        self.load(feed)
        for step in (self.steps if update else self.no_update):
            step()
        return collect(self.arrays)


class DynamicExecutor:
    """Runs a program through a live Pool: before each step it allocates the storages that
    start there, after it frees those that end there. A step is re-bound only when the pool
    hands its buffers other offsets than last time."""

    def __init__(self, program, plan, arena, base, persistent_arrays, xp, solver, pool, stats=None, comm=None):
        self.program = program
        self.plan = plan
        self.arena = arena
        self.base = base
        self.persistent_arrays = persistent_arrays
        self.xp = xp
        self.solver = solver
        self.stats = stats
        self.comm = comm
        self.pool = pool
        self.allocs, self.frees = schedule(plan.groups, len(program.steps))
        self.step_groups = [sorted({plan.group_of[name] for name in step.buffer_names()
                                    if name in plan.group_of}) for step in program.steps]
        self.bound = [None] * len(program.steps)
        self.views = Views(arena)
        self.feeding = Feeding()

    def _array(self, name, offsets):
        if name in self.persistent_arrays:
            return self.persistent_arrays[name]
        buffer = self.program.buffers[name]
        return self.views(self.base + offsets[self.plan.group_of[name]], buffer.shape, buffer.dtype)

    def _arrays(self, names, offsets):
        return {name: self._array(name, offsets) for name in names}

    def run(self, feed, collect, update=True):
        groups = self.plan.groups
        offsets = [None] * len(groups)
        program_steps = self.program.steps
        end = len(program_steps)
        # a micro-batch's rows of an input are its feed step's, not the run's first
        inputs = [n for n, b in self.program.buffers.items() if b.category == "input" and not b.micro]
        self.feeding.feed = feed
        for index in range(end):
            for group in self.allocs[index]:
                offsets[group] = self.pool.malloc(groups[group].nbytes, groups[group].long_lived)
            if index == 0:
                feed(self._arrays(inputs, offsets))
            if update or program_steps[index].kind != "update":
                key = tuple(offsets[g] for g in self.step_groups[index])
                if self.bound[index] is None or self.bound[index][0] != key:
                    step = program_steps[index]
                    arrays = self._arrays(step.buffer_names(), offsets)
                    self.bound[index] = (key, bind_step(step, arrays, self.xp, self.solver, self.stats,
                                                                   self.comm, self.feeding))
                self.bound[index][1]()
            if index < end - 1:
                for group in self.frees[index]:
                    self.pool.free(offsets[group])
                    offsets[group] = None
        result = collect(self._arrays(self.program.outputs.values(), offsets))
        for group, offset in enumerate(offsets):
            if offset is not None:
                self.pool.free(offset)
        return result
