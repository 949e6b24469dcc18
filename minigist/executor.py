"""The executor: binds each step of a program to array views, then runs them in a plain loop."""
import numpy as np


class SGD:
    """Caffe's SGD with momentum: g += decay * decay_mult * w; v = momentum * v +
    lr * lr_mult * g; w -= v. The learning rate may change between steps."""

    def __init__(self, lr=0.01, momentum=0.9, weight_decay=0.0):
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)


def view(arena, offset, shape, dtype):
    """An array of `shape`/`dtype` at byte `offset` of the uint8 `arena`."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return arena[offset:offset + nbytes].view(dtype).reshape(shape)


def _arrays(arrays, names):
    if isinstance(names, dict):
        return {key: arrays[name] for key, name in names.items()}
    return [arrays[name] if name is not None else None for name in names]


def bind_step(step, arrays, xp, solver):
    """A no-argument callable that runs `step` on `arrays` (buffer name -> array)."""
    args = step.args
    layer = step.layer
    if step.kind == "forward":
        x, y, p = _arrays(arrays, args["x"]), _arrays(arrays, args["y"]), _arrays(arrays, args["p"])
        saved, ws = _arrays(arrays, args["saved"]), _arrays(arrays, args["ws"])
        return lambda: layer.forward(xp, x, y, p, saved, ws)
    if step.kind == "backward":
        bound = [_arrays(arrays, args[role]) for role in ("x", "y", "gy", "gx", "p", "gp", "saved", "ws")]
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
        weight, grad = arrays[args["param"]], arrays[args["grad"]]
        momentum, scratch = arrays[args["momentum"]], arrays[args["ws"]]
        lr_mult, decay_mult = args["lr_mult"], args["decay_mult"]

        def update():
            decay = solver.weight_decay * decay_mult
            if decay:
                xp.multiply(weight, decay, out=scratch)
                xp.add(grad, scratch, out=grad)
            xp.multiply(grad, solver.lr * lr_mult, out=scratch)
            xp.multiply(momentum, solver.momentum, out=momentum)
            xp.add(momentum, scratch, out=momentum)
            xp.subtract(weight, momentum, out=weight)
        return update
    raise ValueError(f"unknown step kind {step.kind!r}")


class Executor:
    """Runs a program whose buffers are all bound: `for step in steps: step()`."""

    def __init__(self, program, arrays, xp, solver=None):
        self.program = program
        self.arrays = arrays
        self.steps = [bind_step(step, arrays, xp, solver) for step in program.steps]
        self.update_start = program.update_start

    def run(self, update=True):
        for step in (self.steps if update else self.steps[:self.update_start]):
            step()
