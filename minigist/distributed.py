"""Data-parallel training runs: what Trainer (and so train.py) adds when several ranks train
one model. The reduction itself is passes/reduce.py; the transports are minigist/comm.py (MPI,
threads) and minigist/nccl.py (NCCL on GPUs).

Every rank runs the same command (`mpiexec -n N python train.py ...`): the same flags, data,
seed and checks. The global batch (--batch-size, or the model file's) is split evenly: each
rank draws the global batch's indices and augmentation from the shared data stream, so the
data order is the one a single process would take, and reads only its own part. Rank 0 prints,
logs and writes the checkpoint; every rank reads it on a resume (a file system they share).
"""
import json
import os

import numpy as np

from .checkpoint import arrays_digest
from .comm import launched_size, local_ranks, mpi_world
from .datasets import Split
from .errors import MinigistError
from .passes.reduce import SHARDS

RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def launched_rank():
    """This process's rank as its MPI launcher says (0 when none started it)."""
    for name in RANK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def open_ranks(args, plan_only):
    """Settle args.ranks and return the run's communicator (None for one process). Training
    ranks are the processes an MPI launcher started (MPI on the CPU, NCCL with --device gpu);
    --ranks N is for --plan-only (the footprint of one of N ranks, no MPI needed). Bad
    combinations are one-line errors, the same on every rank."""
    if args.shard not in SHARDS:
        raise MinigistError(f"--shard: expected one of {', '.join(SHARDS)}, got {args.shard!r}")
    if not args.rank_timeout > 0:
        raise MinigistError(f"--rank-timeout: expected a positive number of seconds, got {args.rank_timeout!r}")
    launched = launched_size() or 1
    if plan_only:
        args.ranks = args.ranks or launched
        if args.ranks == 1 and args.shard != "none":
            raise MinigistError(f"--shard {args.shard}: splits the training state among ranks, and this plan is "
                                f"for one process: give --ranks N to see one of N ranks' footprint")
        return None
    if args.ranks is not None and args.ranks != launched:
        raise MinigistError(f"--ranks {args.ranks}: a training run has as many ranks as processes were started "
                            f"({launched}): start them with mpiexec -n {args.ranks} python train.py ..., or plan "
                            f"for {args.ranks} ranks with --plan-only --ranks {args.ranks}")
    args.ranks = launched
    if launched == 1:
        if args.shard != "none":
            raise MinigistError(f"--shard {args.shard}: splits the training state among ranks, and this run is one "
                                f"process (no MPI launcher started it): run it as mpiexec -n N python train.py ..., "
                                f"or see one rank's footprint with --plan-only --ranks N")
        return None
    if args.device == "gpu":
        from .nccl import nccl_world
        return nccl_world(mpi_world(args.rank_timeout), args.rank_timeout)
    return mpi_world(args.rank_timeout)


def threads_per_rank(threads):
    """A default thread count shared among the ranks an MPI launcher put on this machine."""
    if (launched_size() or 1) > 1:
        return max(1, threads // local_ranks())
    return threads


def rank_part(comm, local_batch):
    """The slice of a global batch that this rank reads (None: the whole batch, one process)."""
    if comm is None:
        return None
    return slice(comm.rank * local_batch, (comm.rank + 1) * local_batch)


def _calls(count, batch_size):
    """net.evaluate calls minigist.trainer.evaluate makes over `count` samples: one per batch,
    and one more for the correction of a padded last batch."""
    return -(-count // batch_size) + (1 if count % batch_size else 0)


def evaluate_shared(evaluate, net, data, split, batch_size, names, comm):
    """`evaluate(net, data, split, batch_size, names)` (minigist.trainer.evaluate) over the
    ranks: rank j evaluates the j-th of `size` contiguous parts of `split`, and the counts and
    loss sums are added up (accuracy exactly, the loss in rank order). Ranks with fewer
    evaluation calls make idle ones, so that every rank runs the TEST program as often (with
    sharded weights each run gathers them: a collective)."""
    size, rank = comm.size, comm.rank
    share = -(-len(split) // size)
    bounds = [(min(j * share, len(split)), min((j + 1) * share, len(split))) for j in range(size)]
    start, stop = bounds[rank]
    mine = Split(split.images[start:stop], split.labels[start:stop])
    result = evaluate(net, data, mine, batch_size, names) if stop > start else {"samples": 0}
    most = max(_calls(b - a, batch_size) for a, b in bounds)
    if most > _calls(stop - start, batch_size):
        shape = (batch_size,) + tuple(net.graphs["TEST"].input_shape)
        idle = (np.zeros(shape, np.float32), np.zeros(batch_size, np.float32))
        for _ in range(most - _calls(stop - start, batch_size)):
            net.evaluate(*idle)
    samples = result["samples"]
    rows = comm.gather_values([samples, result.get("correct", 0), result.get("loss", 0.0) * samples],
                              "evaluation results")
    total = int(rows[:, 0].sum())
    out = {"samples": total}
    accuracy, loss = names
    if accuracy is not None and total:
        out["correct"] = int(rows[:, 1].sum())
        out["accuracy"] = out["correct"] / total
    if loss is not None and total:
        added = 0.0
        for row in rows:
            added += float(row[2])
        out["loss"] = added / total
    return out


def same_state(net, comm):
    """The SHA-256 of the net's whole state (weights, running statistics, momentum), checked to
    be the same on every rank (a collective); a MinigistError naming the ranks that differ."""
    digest = arrays_digest(net.state())
    digests = gather_json(comm, digest, "state digests")
    differ = [rank for rank, other in enumerate(digests) if other != digests[0]]
    if differ:
        raise MinigistError(f"the ranks' weights differ (ranks {', '.join(map(str, differ))} against rank 0): "
                            f"a reduction went wrong; please report it")
    return digest


def gather_json(comm, value, what):
    """Every rank's JSON-ready `value`, in rank order, on every rank."""
    text = np.frombuffer(json.dumps(value).encode("utf-8"), dtype=np.uint8)
    counts = [int(row[0]) for row in comm.gather_values([text.size], what)]
    joined = comm.allgather_pieces(text, counts, what).tobytes()
    out, start = [], 0
    for count in counts:
        out.append(json.loads(joined[start:start + count].decode("utf-8")))
        start += count
    return out


def checkpoint_entry(comm, shard, net_rng_state):
    """The checkpoint's "distributed" entry: the rank count, the shard mode and every rank's
    random stream (Dropout's masks), gathered from the ranks (a collective)."""
    return {"ranks": comm.size, "shard": shard, "net_rngs": gather_json(comm, net_rng_state, "random streams")}


def rank_stream(meta, comm):
    """This rank's random stream state from a checkpoint (None: it had no such rank, or was
    written by one process; rank 0 then takes the single stream)."""
    entry = meta.get("distributed")
    rank = comm.rank if comm is not None else 0
    if isinstance(entry, dict) and isinstance(entry.get("net_rngs"), list):
        streams = entry["net_rngs"]
        return streams[rank] if rank < len(streams) else None
    return meta["net_rng"] if rank == 0 else None

