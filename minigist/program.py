"""The data the passes exchange: a Program is a flat list of Steps over typed Buffers.

A buffer's id is typed: `kind` (blob, saved, grad, zero, param, pgrad, momentum, ws, the
Gist pass's enc and dec, and the reduce pass's bucket, gather and shards), `tensor` (the blob, or "layer.name" of what a layer owns) and
`part`; its `name` is the label reports and array maps use, never parsed. Every buffer
carries its shape, dtype and category, and after `compute_liveness` its first_use and
last_use step, which is all a memory planner needs. The passes (minigist/passes/) build and
rewrite programs; the planner and the executor only read them.
"""
import math
from dataclasses import dataclass, field

import numpy as np

# the footprint categories, in report order
WEIGHTS = "weights"
WEIGHT_GRADS = "weight_grads"
OPTIMIZER_STATE = "optimizer_state"
INPUT = "input"
STASH = "stash"
FEATURE = "feature"
GRADIENT = "gradient"
WORKSPACE = "workspace"
ENCODED = "encoded"
COMMUNICATION = "communication"     # buckets the ranks reduce gradients in (passes/reduce.py)
CATEGORIES = (WEIGHTS, WEIGHT_GRADS, OPTIMIZER_STATE, INPUT, STASH, FEATURE, GRADIENT,
              WORKSPACE, ENCODED, COMMUNICATION)
PERSISTENT_CATEGORIES = (WEIGHTS, WEIGHT_GRADS, OPTIMIZER_STATE)
UPDATE_CHUNK = 1 << 18      # elements the SGD update handles at a time
# a weight gradient larger than this, under --update blocked on one process, is made and
# applied a block of rows of about this size at a time (passes/backward.py): OverFeat's fc6
# gradient (453 MB) would otherwise be live whole between its backward step and its update
WEIGHT_GRAD_BLOCK_BYTES = 16 << 20


@dataclass
class Buffer:
    name: str
    shape: tuple
    dtype: np.dtype
    category: str
    layer: str = ""           # the layer that owns or produces it
    first_use: int = -1
    last_use: int = -1
    pinned: bool = None       # lives the whole run; None: as its category says
    kind: str = ""            # the typed id: what it holds (see the module docstring) ...
    tensor: str = ""          # ... of which tensor ...
    part: str = ""            # ... which part (a saved tensor's, a workspace's, a code's name)
    micro: str = ""           # the micro-batch whose rows it holds alone (passes/microbatch.py); "" for the batch

    @property
    def nbytes(self):
        return math.prod(int(d) for d in self.shape) * np.dtype(self.dtype).itemsize   # exact: no int64 wrap

    @property
    def persistent(self):
        if self.pinned is not None:
            return self.pinned
        return self.category in PERSISTENT_CATEGORIES


def of_micro(name, micro):
    """`name` for micro-batch `micro`'s part (passes/microbatch.py names a micro-batch's
    buffers so): `name` itself for the whole batch ("")."""
    return f"{name}#{micro}" if micro else name


def stash_key(buffer):
    """The name a stashed buffer is chosen by (Gist's overrides, the optimizer's decisions): its
    tensor, and for a micro-batch's part of one (passes/microbatch.py: a span's stashes) the
    micro-batch too."""
    return of_micro(buffer.tensor, buffer.micro)


def names_in(value):
    """The buffer names in one step argument: a name, a list of names or a dict of names
    (None entries are absent buffers; numbers are not names)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, str)]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, str)]
    return []


def renamed_in(value, renames):
    """One step argument with each buffer name in `renames` replaced by what it maps to, in
    the shapes names_in reads (a name, a list or tuple of names, a dict of names); what is not a
    name is left as it is."""
    if not renames:
        return value
    if isinstance(value, str):
        return renames.get(value, value)
    if isinstance(value, dict):
        return {key: renames.get(v, v) if isinstance(v, str) else v for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(renames.get(v, v) if isinstance(v, str) else v for v in value)
    return value


@dataclass
class Step:
    """One step. `kind` is forward, backward, seed, zero, accumulate or update, or a kind a
    pass adds (Gist's encode and decode); `args` maps each role (x, y, gy, gx, p, gp, saved,
    ws, ...) to buffer names (lists, dicts or None). A step with an `op` runs as the op binds
    it (`op.bind(step, arrays, xp, stats)`): how a pass changes what a step does without the
    executor knowing the pass. An op that also needs the solver or the ranks' communicator
    names them in `op.needs` ("solver", "comm") and gets them as keywords of `bind`."""
    kind: str
    layer: object = None
    args: dict = field(default_factory=dict)
    op: object = None
    note: str = ""            # a step without a layer: the tensor it works on (for labels)

    def buffer_names(self, roles=None):
        for role, value in self.args.items():
            if roles is None or role in roles:
                yield from names_in(value)

    @property
    def label(self):
        name = self.layer.name if self.layer is not None else self.args.get("target", "")
        if self.note:
            name = self.note
        return f"{self.kind}:{name}"


class Program:
    def __init__(self, graph, buffers, steps, outputs, loss_weights):
        self.graph = graph
        self.buffers = buffers          # name -> Buffer
        self.steps = steps
        self.outputs = outputs          # blob id -> buffer name, read after the run
        self.loss_weights = loss_weights  # buffer name -> weight
        self.encodings = {}             # stashed buffer -> Encoding (filled by the Gist pass)
        self.inplace = None             # (input, output) pairs sharing storage (the in-place pass)
        self.distributed = None         # how the ranks split the parameters (the reduce pass)
        self.compute_liveness()

    @property
    def fused_update(self):
        """Whether update steps run inside the backward pass (each right after the backward
        of its layer): its weight gradients are then per-iteration buffers."""
        return any(b.category == WEIGHT_GRADS and not b.persistent for b in self.buffers.values())

    def compute_liveness(self):
        """first_use / last_use of every buffer; persistent buffers and outputs span it all."""
        for buffer in self.buffers.values():
            buffer.first_use = buffer.last_use = -1
        for index, step in enumerate(self.steps):
            for name in step.buffer_names():
                buffer = self.buffers[name]
                if buffer.first_use < 0:
                    buffer.first_use = index
                buffer.last_use = index
        end = len(self.steps) - 1
        for buffer in self.buffers.values():
            if buffer.persistent:
                buffer.first_use, buffer.last_use = 0, end
        for name in self.outputs.values():
            self.buffers[name].last_use = end
        for buffer in self.buffers.values():
            if buffer.category == INPUT and not buffer.micro:
                buffer.first_use = 0    # written by the executor before the first step (a micro-batch's rows: by a feed step)
        unused = [b.name for b in self.buffers.values() if b.first_use < 0]
        for name in unused:
            del self.buffers[name]


def param_buffer_names(layer, index):
    key = f"{layer.name}.{layer.params[index].name}"
    return f"param:{key}", f"pgrad:{key}", f"momentum:{key}"
