"""The executor: binds each step of a program to array views, then runs them in a plain loop."""
from .memory.arena import view
from .memory.plan import schedule
from .sgd import bind_update


def _arrays(arrays, names):
    if isinstance(names, dict):
        return {key: arrays[name] for key, name in names.items()}
    return [arrays[name] if name is not None else None for name in names]


class GistStats:
    """What the encode steps saw: the densest SSDC input per tensor, and the fallbacks taken
    when a batch was denser than the plan's bound (the FP32 tensor is then copied outside the
    planned memory until its decode, so nothing is corrupted; each case is counted)."""

    def __init__(self):
        self.density = {}
        self.fallbacks = 0
        self.fallback_bytes = 0
        self.fallback_tensors = set()
        self._kept = {}

    def record_density(self, tensor, density):
        self.density[tensor] = max(self.density.get(tensor, 0.0), float(density))

    def fallback(self, tensor, x):
        self.fallbacks += 1
        self.fallback_bytes += x.nbytes
        self.fallback_tensors.add(tensor)
        self._kept[tensor] = x.copy()

    def fallback_for(self, tensor):
        """The FP32 copy kept because `tensor` did not fit its plan this iteration, or None."""
        return self._kept.get(tensor)

    def drop_fallback(self, tensor):
        self._kept.pop(tensor, None)


class StreamedStash:
    """A stash encoded per sample, read by a backward step one batch slice at a time:
    `reader[n0:n1]` decodes samples n0..n1-1 into the slice buffer and returns them."""

    def __init__(self, xp, codec, enc, ws, buffer, stats, tensor):
        self.xp, self.codec, self.enc, self.ws = xp, codec, enc, ws
        self.buffer, self.stats, self.tensor = buffer, stats, tensor
        self.chunk_samples = buffer.shape[0]
        self.shape = (codec.batch,) + tuple(buffer.shape[1:])
        self.dtype = buffer.dtype

    def __getitem__(self, index):
        start, stop, step = index.indices(self.shape[0])
        if step != 1 or stop - start > self.chunk_samples:
            raise IndexError(f"{self.tensor}: read at most {self.chunk_samples} consecutive samples at a time")
        kept = self.stats.fallback_for(self.tensor) if self.stats is not None else None
        if kept is not None:
            return kept[start:stop]
        out = self.buffer[:stop - start]
        self.codec.decode_slice(self.xp, self.enc, start, stop, out, self.ws)
        return out


def bind_step(step, arrays, xp, solver, stats=None):
    """A no-argument callable that runs `step` on `arrays` (buffer name -> array)."""
    args = step.args
    layer = step.layer
    if step.kind == "forward":
        x, y, p = _arrays(arrays, args["x"]), _arrays(arrays, args["y"]), _arrays(arrays, args["p"])
        saved, ws = _arrays(arrays, args["saved"]), _arrays(arrays, args["ws"])
        if step.codec is None:
            return lambda: layer.forward(xp, x, y, p, saved, ws)
        half = arrays[args["enc"]["codes"]]     # Gist: the layer writes its top's fp16 stash too
        return lambda: layer.forward(xp, x, y, p, saved, ws, half=half)
    if step.kind == "backward":
        bound = [_arrays(arrays, args[role]) for role in ("x", "y", "gy", "gx", "p", "gp", "saved", "ws")]
        for name, (codec, tensor, encoded, ws) in (step.streams or {}).items():
            reader = StreamedStash(xp, codec, _arrays(arrays, encoded), _arrays(arrays, ws), arrays[name],
                                   stats, tensor)
            for role in (0, 1):     # x, y
                bound[role] = [reader if n == name else a for n, a in zip(args[("x", "y")[role]], bound[role])]
        if step.variant == "mask":      # Gist: the ReLU's output arrives as its 1-bit mask, decoded
            mask, gy, gx, ws = bound[1][0], bound[2][0], bound[3][0], bound[7]
            return lambda: layer.backward_from_mask(xp, mask, gy, gx, ws)
        if step.variant == "identity":  # Gist: the fused pool code already zeroed the gradient
            gy, gx = bound[2][0], bound[3][0]
            return lambda: None if gx is gy or gx is None else xp.copyto(gx, gy)
        return lambda: layer.backward(xp, *bound)
    if step.kind == "encode":
        codec, enc, ws = step.codec, _arrays(arrays, args["enc"]), _arrays(arrays, args["ws"])
        inputs = _arrays(arrays, args["x"])
        x = inputs[0] if len(inputs) == 1 else tuple(inputs)
        tensor = step.note

        def encode():
            stats.drop_fallback(tensor)
            if codec.data_dependent:          # record what its capacity had to hold
                fitted, density = codec.encode_measured(xp, x, enc, ws)
                stats.record_density(tensor, density)
            else:
                fitted = codec.encode(xp, x, enc, ws)
            if fitted is False:
                stats.fallback(tensor, x)
        return encode
    if step.kind == "decode":
        codec, enc, ws = step.codec, _arrays(arrays, args["enc"]), _arrays(arrays, args["ws"])
        out, tensor = arrays[args["out"]], step.note

        def decode():
            kept = stats.fallback_for(tensor)
            if kept is not None:
                xp.copyto(out, kept)
            else:
                codec.decode(xp, enc, out, ws)
        return decode
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
        return bind_update(xp, solver, arrays[args["param"]], arrays[args["grad"]], arrays[args["momentum"]],
                           arrays[args["ws"]], args["lr_mult"], args["decay_mult"])
    raise ValueError(f"unknown step kind {step.kind!r}")


class Executor:
    """Runs a program whose buffers all have fixed places (none and static modes):
    every step is bound once, then `for step in steps: step()`."""

    def __init__(self, program, arrays, xp, solver=None, stats=None):
        self.program = program
        self.arrays = arrays
        self.steps = [bind_step(step, arrays, xp, solver, stats) for step in program.steps]
        self.no_update = [bound for bound, step in zip(self.steps, program.steps) if step.kind != "update"]

    def run(self, feed, collect, update=True):
        """feed(arrays) writes the inputs; collect(arrays) reads the outputs, which it returns.
        update=False skips the SGD update steps (wherever they sit)."""
        feed(self.arrays)
        for step in (self.steps if update else self.no_update):
            step()
        return collect(self.arrays)


class DynamicExecutor:
    """Runs a program through a live Pool: before each step it allocates the storages that
    start there, after it frees those that end there. A step is re-bound only when the pool
    hands its buffers other offsets than last time."""

    def __init__(self, program, plan, arena, base, persistent_arrays, xp, solver, pool, stats=None):
        self.program = program
        self.plan = plan
        self.arena = arena
        self.base = base
        self.persistent_arrays = persistent_arrays
        self.xp = xp
        self.solver = solver
        self.stats = stats
        self.pool = pool
        self.allocs, self.frees = schedule(plan.groups, len(program.steps))
        self.step_groups = [sorted({plan.group_of[name] for name in step.buffer_names()
                                    if name in plan.group_of}) for step in program.steps]
        self.bound = [None] * len(program.steps)

    def _array(self, name, offsets):
        if name in self.persistent_arrays:
            return self.persistent_arrays[name]
        buffer = self.program.buffers[name]
        return view(self.arena, self.base + offsets[self.plan.group_of[name]], buffer.shape, buffer.dtype)

    def _arrays(self, names, offsets):
        return {name: self._array(name, offsets) for name in names}

    def run(self, feed, collect, update=True):
        groups = self.plan.groups
        offsets = [None] * len(groups)
        program_steps = self.program.steps
        end = len(program_steps)
        inputs = [n for n, b in self.program.buffers.items() if b.category == "input"]
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
                    self.bound[index] = (key, bind_step(step, arrays, self.xp, self.solver, self.stats))
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
