"""The step kinds the reduce pass (passes/reduce.py) inserts, and how each one runs.

Each op is bound with the ranks' communicator (`needs`), and the update with the solver too;
it works out its rank's part from `comm.rank` when it is bound, so every rank runs the same
program. A parameter's `Slot` says where it lies: rank j holds elements
[j * piece, (j + 1) * piece) of the flattened tensor (the last ranks' pieces shorter or empty),
and in a bucket of `ranks` chunks of `chunk` elements its piece j sits at
j * chunk + offset (rank-major: chunk j is what rank j reduces).

- PackGradient: a weight gradient into its bucket (a no-op copy where the plan gave both one
  storage), the padding zeroed;
- ReduceBucket: the bucket reduce-scattered (and all-gathered where every rank needs every
  piece of the sum);
- UnpackGradient / KeepPiece: the reduced gradient out of the bucket: whole, or this rank's piece;
- Update: Caffe's SGD step on every piece, or on this rank's piece only (sgd.bind_update);
- GatherWeights: each rank's updated piece to every rank, through a bucket;
- GatherParam: a sharded parameter's whole tensor, around the step that reads it;
- AverageState: the state a forward writes (BatchNorm's running sums), averaged over the ranks.
"""
from ..sgd import bind_update


def _data_pointer(array):
    return array.ctypes.data if hasattr(array, "ctypes") else array.data.ptr


def same_storage(a, b):
    """Whether two arrays start at the same address (the plan gave them one storage)."""
    return _data_pointer(a) == _data_pointer(b)


def _flat(array):
    return array.reshape(-1)


def _piece_views(slot, flat, bucket, ranks):
    """[(slice of the flat tensor, where it lies in the bucket)] for every non-empty piece, as
    at most two copies: the full pieces as one (count, piece) block, then the short one."""
    full = slot.size // slot.piece
    rows = bucket.reshape(ranks, slot.chunk)
    views = []
    if full:
        views.append((flat[:full * slot.piece].reshape(full, slot.piece),
                      rows[:full, slot.offset:slot.offset + slot.piece]))
    rest = slot.size - full * slot.piece
    if rest:
        start = full * slot.chunk + slot.offset
        views.append((flat[full * slot.piece:], bucket[start:start + rest]))
    return views


def _padding(slot, bucket, ranks):
    """The bucket's parts within this slot's pieces that no element of the tensor fills."""
    out = []
    for rank in range(ranks):
        start, stop = slot.span(rank)
        filled = stop - start
        if filled < slot.piece:
            begin = rank * slot.chunk + slot.offset
            out.append(bucket[begin + filled:begin + slot.piece])
    return out


class _Op:
    needs = ("comm",)

    def __init__(self, slot=None, slots=()):
        self.slot, self.slots = slot, tuple(slots)


class PackGradient(_Op):
    def bind(self, step, arrays, xp, stats, comm):
        slot, ranks = self.slot, comm.size
        grad, bucket = arrays[step.args["grad"]], arrays[step.args["bucket"]]
        padding = _padding(slot, bucket, ranks)
        # a bucket of this one parameter, sharing its storage: the gradient is in place already
        copies = [] if same_storage(grad, bucket) else _piece_views(slot, _flat(grad), bucket, ranks)

        def pack():
            for source, target in copies:
                xp.copyto(target, source)
            for part in padding:
                part.fill(0)
        return pack


class ReduceBucket(_Op):
    """Reduce-scatter a bucket; with `gather`, all-gather the sums too (every rank then holds
    every piece of the reduced gradient)."""

    def __init__(self, gather):
        super().__init__()
        self.gather = gather

    def bind(self, step, arrays, xp, stats, comm):
        bucket, what = arrays[step.args["bucket"]], f"gradients ({step.args['bucket']})"

        def reduce():
            comm.reduce_scatter(bucket, what)
            if self.gather:
                comm.allgather(bucket, what)
        return reduce


class UnpackGradient(_Op):
    """The whole reduced gradient from the bucket back into the weight gradient buffer."""

    def bind(self, step, arrays, xp, stats, comm):
        grad, bucket = arrays[step.args["grad"]], arrays[step.args["bucket"]]
        copies = [] if same_storage(grad, bucket) else _piece_views(self.slot, _flat(grad), bucket, comm.size)

        def unpack():
            for target, source in copies:
                xp.copyto(target, source)
        return unpack


class KeepPiece(_Op):
    """This rank's piece of the reduced gradient, kept (in a piece-sized buffer) for an update
    that runs after the whole backward pass."""

    def bind(self, step, arrays, xp, stats, comm):
        slot = self.slot
        start, stop = slot.span(comm.rank)
        begin = comm.rank * slot.chunk + slot.offset
        source = arrays[step.args["bucket"]][begin:begin + stop - start]
        target = arrays[step.args["piece"]][:stop - start]
        return lambda: xp.copyto(target, source)


class Update(_Op):
    """SGD on the pieces of one parameter: every piece (`every`: the weights and momentum are
    whole on every rank) or this rank's. `weight` and `momentum` are "whole" (the tensor) or
    "piece" (this rank's piece); `grad` is "bucket" (the reduced bucket), "whole" or "piece"."""
    needs = ("comm", "solver")

    def __init__(self, slot, every, weight, momentum, grad):
        super().__init__(slot)
        self.every, self.weight, self.momentum, self.grad = every, weight, momentum, grad

    def bind(self, step, arrays, xp, stats, comm, solver):
        slot, args = self.slot, step.args
        weight, grad, momentum = (_flat(arrays[args[role]]) for role in ("param", "grad", "momentum"))
        scratch = arrays[args["ws"]]
        updates = []
        for rank in (range(comm.size) if self.every else (comm.rank,)):
            start, stop = slot.span(rank)
            if stop == start:
                continue
            length = stop - start
            begin = rank * slot.chunk + slot.offset

            def part(array, layout):
                if layout == "whole":
                    return array[start:stop]
                if layout == "piece":
                    return array[:length]
                return array[begin:begin + length]      # the bucket
            updates.append(bind_update(xp, solver, part(weight, self.weight), part(grad, self.grad),
                                       part(momentum, self.momentum), scratch, args["lr_mult"], args["decay_mult"]))

        def update():
            for run in updates:
                run()
        return update


class GatherWeights(_Op):
    """After this rank updated its pieces of the whole weights in `params` (slots in the same
    order): every rank's pieces to every rank, through the bucket."""

    def bind(self, step, arrays, xp, stats, comm):
        bucket = arrays[step.args["bucket"]]
        outgoing, incoming, padding = [], [], []
        for slot, name in zip(self.slots, step.args["params"]):
            flat = _flat(arrays[name])
            for rank in range(comm.size):
                start, stop = slot.span(rank)
                begin = rank * slot.chunk + slot.offset
                if rank == comm.rank:
                    outgoing.append((flat[start:stop], bucket[begin:begin + stop - start]))
                    padding.append(bucket[begin + stop - start:begin + slot.piece])
                elif stop > start:
                    incoming.append((bucket[begin:begin + stop - start], flat[start:stop]))
        what = f"weights ({step.args['bucket']})"

        def gather():
            for source, target in outgoing:
                xp.copyto(target, source)
            for part in padding:
                part.fill(0)
            comm.allgather(bucket, what)
            for source, target in incoming:
                xp.copyto(target, source)
        return gather


class GatherParam(_Op):
    """A sharded parameter's whole tensor for the next step: this rank's piece into its place,
    all-gathered; copied into the tensor's own buffer where the plan did not give them one
    storage (the "none" plan)."""

    def bind(self, step, arrays, xp, stats, comm):
        slot = self.slot
        piece, gathered, param = (arrays[step.args[role]] for role in ("piece", "gather", "param"))
        own = gathered[comm.rank * slot.piece:(comm.rank + 1) * slot.piece]
        copy = None if same_storage(param, gathered) else (gathered[:slot.size], _flat(param))
        what = f"weights ({slot.key})"

        def gather():
            xp.copyto(own, piece)
            comm.allgather(gathered, what)
            if copy is not None:
                xp.copyto(copy[1], copy[0])
        return gather


class AverageState(_Op):
    """The state tensors in `params` (the forward's running sums) replaced by their mean over
    the ranks, so that every rank evaluates with the same statistics."""

    def bind(self, step, arrays, xp, stats, comm):
        bucket = arrays[step.args["bucket"]]
        ranks = comm.size
        copies, padding = [], []
        for slot, name in zip(self.slots, step.args["params"]):
            copies.extend(_piece_views(slot, _flat(arrays[name]), bucket, ranks))
            padding.extend(_padding(slot, bucket, ranks))
        scale = 1.0 / ranks

        def average():
            for source, target in copies:
                xp.copyto(target, source)
            for part in padding:
                part.fill(0)
            comm.reduce_scatter(bucket, "running statistics")
            comm.allgather(bucket, "running statistics")
            for target, source in copies:
                xp.multiply(source, scale, out=target)
        return average
