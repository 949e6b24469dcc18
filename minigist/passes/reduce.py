"""The reduce pass: data parallelism over `ranks` ranks, each running this same program on its
share of the global batch, with the weight gradients summed across the ranks and, as ZeRO
does (Rajbhandari et al., 2020), the optimizer state, the gradients or the weights sharded.

Reads: a training or inference program after passes/inplace.py (typed buffers, its update
steps and where they sit: fused into the backward pass or after it), the rank count, the
shard mode (SHARDS) and the bucket size in bytes.
Provides: a new program (the input is left as it is) that every rank runs:

- the loss seeds scaled by 1 / ranks, so that the sum over the ranks of their gradients (each
  the mean over its share of the batch) is the gradient of the global batch's mean loss;
- each trained parameter's piece per rank: rank j holds elements [j * piece, (j + 1) * piece)
  of the flattened tensor, `piece` = ceil(size / ranks) rounded up to the arena's 256-byte
  alignment (the last ranks' pieces shorter or empty);
- buckets (category "communication"): the weight gradients in the order the backward pass
  finishes them, `bucket_bytes` at most each (a larger parameter alone in its own), laid out
  rank-major (chunk j: every parameter's piece j). A "pack" step copies each gradient into its
  bucket after its layer's backward step (where a bucket holds one parameter and its gradient
  lives only for this iteration, the two share one storage and nothing is copied), and a
  "reduce" step reduce-scatters the bucket after its last gradient is packed;
- the updates: with --update fused right after their bucket's reduction, else after the
  whole backward pass; then the weights each rank updated are all-gathered where every rank
  keeps them whole;
- with `weights`, before every step that reads a sharded parameter (forward, backward, a
  recomputation), a "gather" step all-gathers it into a buffer that lives only until that step;
- at the end of a training program, an "average" step that replaces the state a forward
  writes (BatchNorm's running sums) by its mean over the ranks.

What a rank keeps, per shard mode (whole: every rank the full tensor; piece: 1 / ranks):

| shard | weights | momentum | gradients kept for a separate update | gradient reduction |
|---|---|---|---|---|
| none | whole | whole | whole | all-reduce, every rank updates every piece |
| optimizer | whole | piece | whole | all-reduce; each rank updates its piece; all-gather weights |
| gradients | whole | piece | piece | reduce-scatter; each updates its piece; all-gather weights |
| weights | piece | piece | piece | reduce-scatter; each updates its piece; gathered per step |

With the fused update a gradient lives only until its bucket is reduced and applied, so
`optimizer` and `gradients` then plan the same bytes. Every mode computes every weight from the
same reduced gradient with the same element-wise update, so all four train bit for bit alike.

`program.distributed` (a Distribution) records the layout: Net reads it to place, gather and
restore the pieces, and the footprint report shows it. Rank-specific slicing happens when a
step is bound (passes/reduce_steps.py), from the communicator's rank.
"""
import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import MinigistError
from ..memory import ALIGNMENT, align
from ..program import (COMMUNICATION, OPTIMIZER_STATE, PERSISTENT_CATEGORIES, WEIGHT_GRADS, WEIGHTS, Buffer,
                       Program, Step, param_buffer_names)
from .reduce_steps import (AverageState, GatherParam, GatherWeights, KeepPiece, PackGradient, ReduceBucket,
                           UnpackGradient, Update)

SHARDS = ("none", "optimizer", "gradients", "weights")
DEFAULT_BUCKET_BYTES = 25 * 2**20       # PyTorch DDP's bucket_cap_mb


@dataclass(frozen=True)
class Slot:
    """Where one parameter's pieces lie (see the module docstring)."""
    key: str                # "layer.param"
    size: int               # elements of the tensor
    piece: int              # elements per rank
    bucket: str = ""        # the bucket it is reduced in ("" for none)
    offset: int = 0         # where its pieces start in each chunk of the bucket
    chunk: int = 0          # the bucket's chunk length in elements

    def span(self, rank):
        """[start, stop) of the flattened tensor that rank `rank` holds."""
        start = min(rank * self.piece, self.size)
        return start, min(start + self.piece, self.size)


@dataclass
class Distribution:
    """How a program spreads over the ranks: program.distributed."""
    ranks: int
    shard: str
    bucket_bytes: int
    slots: dict = field(default_factory=dict)       # key -> Slot, every parameter placed
    buckets: dict = field(default_factory=dict)     # bucket buffer -> [keys], in reduction order
    state: tuple = ()                               # keys averaged over the ranks

    @property
    def weights_sharded(self):
        return self.shard == "weights"

    @property
    def momentum_sharded(self):
        return self.shard != "none"

    def report(self, plan):
        """The report's "distributed" entry: the layout and what each rank keeps for good."""
        buffers = plan.program.buffers
        kept = {category: 0 for category in PERSISTENT_CATEGORIES}
        for buffer in buffers.values():
            if buffer.persistent:
                kept[buffer.category] += align(buffer.nbytes, plan.alignment)
        return {"ranks": self.ranks, "shard": self.shard, "bucket_bytes": self.bucket_bytes,
                "buckets": [{"name": name, "bytes": buffers[name].nbytes, "parameters": len(keys)}
                            for name, keys in self.buckets.items() if name in buffers],
                "persistent_by_category": kept}


def piece_elements(size, ranks, itemsize):
    """Elements per rank of a tensor of `size`: ceil(size / ranks), rounded up to the alignment."""
    per_alignment = max(1, ALIGNMENT // itemsize)
    return max(per_alignment, math.ceil(size / (ranks * per_alignment)) * per_alignment)


def apply_reduce(program, ranks, shard="none", bucket_bytes=DEFAULT_BUCKET_BYTES):
    """`program` for one of `ranks` data-parallel ranks under `shard` (the module docstring);
    one rank: the program as it is."""
    if shard not in SHARDS:
        raise MinigistError(f"--shard: expected one of {', '.join(SHARDS)}, got {shard!r}")
    if int(bucket_bytes) < 1:
        raise MinigistError(f"--bucket-size: expected a positive size, got {bucket_bytes!r}")
    if ranks <= 1:
        return program
    return _Builder(program, int(ranks), shard, int(bucket_bytes)).build()


class _Builder:
    def __init__(self, program, ranks, shard, bucket_bytes):
        self.program = program
        self.ranks, self.shard = ranks, shard
        self.buffers = {name: replace(b) for name, b in program.buffers.items()}
        self.distribution = Distribution(ranks, shard, bucket_bytes)
        self.steps = []
        self.pairs = list(program.inplace or ())
        self.fused = program.fused_update
        self.updates = {program.buffers[s.args["param"]].tensor: s for s in program.steps if s.kind == "update"}
        self.uses = {}
        self.bucket_of = {}

    # ---- layout ---------------------------------------------------------------------------
    def _slot(self, key, buffer, **where):
        piece = piece_elements(math.prod(buffer.shape), self.ranks, np.dtype(buffer.dtype).itemsize)
        return Slot(key, math.prod(buffer.shape), piece, **where)

    def _plan_buckets(self):
        """Buckets over the updated parameters, in the order the backward pass finishes their
        gradients."""
        ready = []
        for step in self.program.steps:
            for name in step.args.get("gp", ()) if step.kind != "update" else ():
                if name is not None and self.buffers[name].tensor in self.updates:
                    ready.append(self.buffers[name].tensor)
        groups, current, used = [], [], 0
        for key in ready:
            buffer = self.buffers[self.updates[key].args["param"]]
            nbytes = self.ranks * piece_elements(math.prod(buffer.shape), self.ranks, buffer.dtype.itemsize) \
                * buffer.dtype.itemsize
            if current and used + nbytes > self.distribution.bucket_bytes:
                groups.append(current)
                current, used = [], 0
            current.append(key)
            used += nbytes
        if current:
            groups.append(current)
        for index, keys in enumerate(groups):
            self._add_bucket(f"bucket:{index}", str(index), keys, lambda key: self.updates[key].args["param"])
            for key in keys:
                self.bucket_of[key] = f"bucket:{index}"

    def _add_bucket(self, name, tensor, keys, buffer_of):
        offset = 0
        slots = []
        for key in keys:
            slot = self._slot(key, self.buffers[buffer_of(key)])
            slots.append(slot)
            offset += slot.piece
        chunk, offset = offset, 0
        for slot in slots:
            self.distribution.slots[slot.key] = replace(slot, bucket=name, offset=offset, chunk=chunk)
            offset += slot.piece
        dtype = self.buffers[buffer_of(keys[0])].dtype
        self.buffers[name] = Buffer(name, (self.ranks * chunk,), dtype, COMMUNICATION, kind="bucket", tensor=tensor)
        self.distribution.buckets[name] = list(keys)

    def _shard_buffers(self):
        """The per-rank pieces that replace whole weights, momentum and kept gradients."""
        graph = self.program.graph
        self.sharded_weights = set()
        if self.distribution.weights_sharded:
            for layer in graph.layers:
                for index, decl in enumerate(layer.params):
                    name = param_buffer_names(layer, index)[0]
                    if decl.trained and name in self.buffers:
                        key = self.buffers[name].tensor
                        self.sharded_weights.add(key)
                        if key not in self.distribution.slots:
                            self.distribution.slots[key] = self._slot(key, self.buffers[name])
                        self._piece_buffer("wshard", key, name, WEIGHTS)
                        del self.buffers[name]
        for key, update in self.updates.items():
            if self.distribution.momentum_sharded:
                self._piece_buffer("mshard", key, update.args["momentum"], OPTIMIZER_STATE)
                del self.buffers[update.args["momentum"]]
            if self.shard in ("gradients", "weights") and not self.fused:
                self._piece_buffer("gshard", key, update.args["grad"], WEIGHT_GRADS)
                self.buffers[update.args["grad"]].pinned = False    # the local gradient: until packed

    def _piece_buffer(self, kind, key, whole, category):
        buffer = self.buffers[whole]
        name = f"{kind}:{key}"
        self.buffers[name] = Buffer(name, (self.distribution.slots[key].piece,), buffer.dtype, category,
                                    buffer.layer, kind=kind, tensor=key, part=buffer.part)
        return name

    # ---- steps ----------------------------------------------------------------------------
    def build(self):
        program = self.program
        train = any(step.kind == "seed" for step in program.steps)
        if train:
            self._plan_buckets()
        self._shard_buffers()
        pending = {name: set(keys) for name, keys in self.distribution.buckets.items()}
        for step in program.steps:
            if step.kind == "update":
                continue
            if step.kind == "seed":
                step = Step("seed", None, dict(step.args, value=step.args["value"] / self.ranks), note=step.note)
            step = self._gathered(step)
            self.steps.append(step)
            for name in step.args.get("gp", ()) or ():
                key = self.buffers[name].tensor if name is not None else None
                if key in self.bucket_of:
                    self._pack(step, key)
                    bucket = self.bucket_of[key]
                    pending[bucket].discard(key)
                    if not pending[bucket]:
                        self._reduce(bucket)
        if train and not self.fused:
            self._separate_updates()
        if train:
            self._average_state()
        result = Program(program.graph, self.buffers, self.steps, program.outputs, program.loss_weights)
        result.encodings = dict(program.encodings)
        result.inplace = tuple(self.pairs)
        result.distributed = self.distribution
        return result

    def _gathered(self, step):
        """`step`, reading the whole tensors of its sharded parameters from gather buffers
        filled by gather steps emitted right before it."""
        names = step.args.get("p")
        if not self.sharded_weights or not names or not any(
                name is not None and name.startswith("param:") and name[len("param:"):] in self.sharded_weights
                for name in names):
            return step
        gathered = []
        for name in names:
            key = name[len("param:"):] if name is not None and name.startswith("param:") else None
            if key not in self.sharded_weights:
                gathered.append(name)
                continue
            slot = self.distribution.slots[key]
            count = self.uses[(key, step.kind)] = self.uses.get((key, step.kind), 0) + 1
            use = step.kind + (str(count) if count > 1 else "")
            whole = self.program.buffers[name]
            view = f"param:{key}@{use}"
            padded = f"gather:{key}@{use}"
            self.buffers[view] = Buffer(view, whole.shape, whole.dtype, WEIGHTS, whole.layer, pinned=False,
                                        kind="param", tensor=key, part=use)
            self.buffers[padded] = Buffer(padded, (self.ranks * slot.piece,), whole.dtype, WEIGHTS, whole.layer,
                                          pinned=False, kind="gather", tensor=key, part=use)
            self.pairs.append((padded, view))
            self.steps.append(Step("gather", step.layer, {"piece": f"wshard:{key}", "gather": padded, "param": view},
                                   op=GatherParam(slot), note=key))
            gathered.append(view)
        return Step(step.kind, step.layer, dict(step.args, p=gathered), step.op, step.note)

    def _pack(self, step, key):
        slot = self.distribution.slots[key]
        grad = self.updates[key].args["grad"]
        if slot.offset == 0 and len(self.distribution.buckets[slot.bucket]) == 1 \
                and not self.buffers[grad].persistent:
            self.pairs.append((slot.bucket, grad))     # alone in its bucket: compute it there
        self.steps.append(Step("pack", step.layer, {"grad": grad, "bucket": slot.bucket}, op=PackGradient(slot),
                               note=key))

    def _reduce(self, bucket):
        keys = self.distribution.buckets[bucket]
        every_piece = self.shard == "none" or (self.shard == "optimizer" and not self.fused)
        self.steps.append(Step("reduce", None, {"bucket": bucket}, op=ReduceBucket(gather=every_piece), note=bucket))
        if self.fused:
            for key in keys:
                self._update(key, grad=bucket, grad_layout="bucket")
            self._gather_weights(bucket, keys)
            return
        for key in keys:
            update, slot = self.updates[key], self.distribution.slots[key]
            if every_piece:
                self.steps.append(Step("unpack", update.layer, {"bucket": bucket, "grad": update.args["grad"]},
                                       op=UnpackGradient(slot), note=key))
            else:
                self.steps.append(Step("keep", update.layer, {"bucket": bucket, "piece": f"gshard:{key}"},
                                       op=KeepPiece(slot), note=key))

    def _separate_updates(self):
        """The updates after the whole backward pass, bucket by bucket."""
        if self.shard == "none":
            self.steps.extend(step for step in self.program.steps if step.kind == "update")
            return
        for bucket, keys in self.distribution.buckets.items():
            for key in keys:
                if self.shard == "optimizer":
                    self._update(key, grad=self.updates[key].args["grad"], grad_layout="whole")
                else:
                    self._update(key, grad=f"gshard:{key}", grad_layout="piece")
            if self.shard != "weights":
                staging = f"w{bucket}"
                self.buffers[staging] = replace(self.buffers[bucket], name=staging, kind="wbucket")
                self._gather_weights(staging, keys)

    def _update(self, key, grad, grad_layout):
        update, slot = self.updates[key], self.distribution.slots[key]
        weight = f"wshard:{key}" if key in self.sharded_weights else update.args["param"]
        momentum = f"mshard:{key}" if self.distribution.momentum_sharded else update.args["momentum"]
        op = Update(slot, every=self.shard == "none", weight="piece" if key in self.sharded_weights else "whole",
                    momentum="piece" if self.distribution.momentum_sharded else "whole", grad=grad_layout)
        self.steps.append(Step("update", update.layer, dict(update.args, param=weight, grad=grad, momentum=momentum),
                               op=op, note=key))

    def _gather_weights(self, bucket, keys):
        if self.shard not in ("optimizer", "gradients"):
            return      # none: every rank updated every piece; weights: each keeps its piece
        params = [self.updates[key].args["param"] for key in keys]
        self.steps.append(Step("gather", None, {"bucket": bucket, "params": params},
                               op=GatherWeights(slots=[self.distribution.slots[key] for key in keys]), note=bucket))

    def _average_state(self):
        """One bucket with the state every forward of the iteration wrote, averaged at the end."""
        keys, names = [], []
        for step in self.program.steps:
            layer = step.layer
            if step.kind != "forward" or not getattr(layer, "forward_updates_state", False):
                continue
            for index, decl in enumerate(layer.params):
                name = param_buffer_names(layer, index)[0]
                if not decl.trained and name in self.buffers and self.buffers[name].tensor not in keys:
                    keys.append(self.buffers[name].tensor)
                    names.append(name)
        if not keys:
            return
        by_key = dict(zip(keys, names))
        self._add_bucket("bucket:state", "state", keys, by_key.get)
        self.distribution.state = tuple(keys)
        self.steps.append(Step("average", None, {"bucket": "bucket:state", "params": names},
                               op=AverageState(slots=[self.distribution.slots[key] for key in keys]),
                               note="running statistics"))
