"""Communicators: how the ranks of a data-parallel run exchange gradients, weights and a few
numbers. The reduce pass's steps (passes/reduce_steps.py) call the two collectives; the
trainer and Net call the host-side exchanges.

Every communicator has `rank`, `size` and:

- `reduce_scatter(buffer)`: `buffer`, a 1-D array of `size` equal chunks; afterwards chunk
  `rank` holds the sum over the ranks of their chunk `rank` (the other chunks are scratch);
- `allgather(buffer)`: afterwards chunk j of every rank's buffer holds rank j's chunk j;
- `gather_values(values)`: every rank's few numbers, a float64 array (size, k), on every rank;
- `allgather_pieces(piece, counts)`: every rank's 1-D host array, concatenated in rank order;
- `seconds`: the time spent inside collectives, waiting for the other ranks included.

The reduction order is fixed: MPI and the in-process group exchange the chunks as they are
(an all-to-all) and add them here, chunk of rank 0 + chunk of rank 1 + ... in rank order, so
a sum's bits depend on the ranks' gradients alone, not on the MPI library, its algorithms or
the network; each chunk is added by one rank and copied to the others, so every rank holds
the same bits. (NCCL, minigist/nccl.py, adds in its ring's order: fixed for a fixed set of GPUs.)

A collective that gets no answer within `timeout` seconds (a rank died, hangs or stopped)
raises RankTimeoutError, one line naming the rank and what it waited for, instead of waiting
forever.
"""
import os
import threading
import time

import numpy as np

from .errors import MinigistError

DEFAULT_TIMEOUT = 300.0     # seconds a rank waits for the others (a checkpoint write included)


class RankTimeoutError(MinigistError):
    """The other ranks did not answer in time: this rank stops (the others may be gone)."""


class Communicator:
    """What every transport shares: the fixed reduction order, the timing and the host-side
    exchanges built on `_gather_host`. A transport provides `_alltoall(buffer)` (in place:
    chunk j goes to rank j, rank j's chunk `rank` comes back into chunk j) and
    `_allgather(buffer)`, `_gather_host(array)` and `_allgatherv(piece, counts)`."""

    def __init__(self, rank, size, timeout=DEFAULT_TIMEOUT):
        self.rank, self.size = int(rank), int(size)
        self.timeout = float(timeout)
        self.seconds = 0.0
        self.calls = 0

    def describe(self):
        return f"{self.size} ranks"

    def _timed(self, function, *args):
        start = time.perf_counter()
        try:
            return function(*args)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def reduce_scatter(self, buffer, what="gradients"):
        self._timed(self._reduce_scatter, buffer, what)

    def _reduce_scatter(self, buffer, what):
        chunks = buffer.reshape(self.size, -1)
        self._alltoall(buffer, what)
        # now chunk j holds rank j's part of this rank's chunk: add them in rank order
        total = chunks[0]
        for j in range(1, self.size):
            total += chunks[j]
        if self.rank:
            chunks[self.rank][...] = total

    def allgather(self, buffer, what="weights"):
        self._timed(self._allgather, buffer, what)

    def gather_values(self, values, what="values"):
        """(size, k) float64: row j is rank j's `values`."""
        mine = np.asarray(values, dtype=np.float64).reshape(-1)
        return self._timed(self._gather_host, mine, what)

    def mean_of(self, value, what="the loss"):
        """The mean of one number over the ranks, added in rank order: the same on every rank."""
        total = 0.0
        for row in self.gather_values([value], what):
            total += float(row[0])
        return total / self.size

    def allgather_pieces(self, piece, counts, what="the state"):
        """Every rank's 1-D host array (rank j's holds counts[j] elements), concatenated."""
        return self._timed(self._allgatherv, np.ascontiguousarray(piece), list(counts), what)

    def _no_answer(self, what):
        return RankTimeoutError(f"rank {self.rank}: no answer from the other ranks within {self.timeout:g} s "
                                f"while exchanging {what} (a rank stopped, died or hangs); stopping "
                                f"(--rank-timeout sets the limit)")


class MPICommunicator(Communicator):
    """Ranks as MPI processes (mpi4py), on host arrays. Every collective is non-blocking and
    waited for with a deadline."""

    def __init__(self, mpi_comm, timeout=DEFAULT_TIMEOUT):
        super().__init__(mpi_comm.Get_rank(), mpi_comm.Get_size(), timeout)
        from mpi4py import MPI
        self.MPI = MPI
        self.mpi = mpi_comm

    def describe(self):
        version = self.MPI.Get_library_version().strip().splitlines()[0].strip()
        return f"{self.size} ranks, MPI ({version})"

    def _wait(self, request, what):
        if request.Test():
            return
        start = time.monotonic()
        pause = 0.0
        while not request.Test():
            elapsed = time.monotonic() - start
            if elapsed > self.timeout:
                raise self._no_answer(what)
            if elapsed > 1e-3:      # past a millisecond, stop spinning: the core may be shared
                pause = min(1e-3, pause * 2 or 2e-5)
                time.sleep(pause)

    def _alltoall(self, buffer, what):
        self._wait(self.mpi.Ialltoall(self.MPI.IN_PLACE, buffer), what)

    def _allgather(self, buffer, what):
        self._wait(self.mpi.Iallgather(self.MPI.IN_PLACE, buffer), what)

    def _gather_host(self, mine, what):
        out = np.empty((self.size, mine.size), dtype=np.float64)
        self._wait(self.mpi.Iallgather(mine, out), what)
        return out

    def _allgatherv(self, piece, counts, what):
        out = np.empty(sum(counts), dtype=piece.dtype)
        displacements = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
        datatype = self.MPI._typedict[piece.dtype.char]
        self._wait(self.mpi.Iallgatherv(piece, [out, counts, displacements, datatype]), what)
        return out

    def bcast_object(self, value, root=0):
        """A small picklable value from `root` (start-up only: NCCL's unique id)."""
        return self.mpi.bcast(value, root=root)


class LocalGroup:
    """Ranks as threads of one process, sharing memory: the communicators of `LocalGroup(n).
    comms`, one per rank, run the reduction code MPI runs (the fixed order above) without
    MPI. For tests, and for trying data parallelism on one machine without mpi4py.

        results = LocalGroup(2).run(lambda comm: train(comm))    # one thread per rank
    """

    def __init__(self, size, timeout=60.0):
        self.size = int(size)
        self.barrier = threading.Barrier(self.size)
        self.posted = [None] * self.size
        self.comms = [_ThreadCommunicator(self, rank, timeout) for rank in range(self.size)]

    def run(self, function):
        """function(comm) on every rank, each in its own thread; returns their results in rank
        order, or raises the first rank's exception (the others stop at their next collective)."""
        results, errors = [None] * self.size, [None] * self.size

        def body(rank):
            try:
                results[rank] = function(self.comms[rank])
            except BaseException as exc:     # noqa: BLE001  (handed to the caller below)
                errors[rank] = exc
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(rank,), name=f"rank {rank}") for rank in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)),
                     next((e for e in errors if e is not None), None))
        if first is not None:
            raise first
        return results


class _ThreadCommunicator(Communicator):
    def __init__(self, group, rank, timeout):
        super().__init__(rank, group.size, timeout)
        self.group = group

    def describe(self):
        return f"{self.size} ranks, threads of one process"

    def _meet(self, what):
        try:
            self.group.barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise self._no_answer(what) from None

    def _exchange(self, value, what):
        """Every rank's `value`, after all have posted theirs (read them before the next _meet)."""
        self.group.posted[self.rank] = value
        self._meet(what)
        return list(self.group.posted)

    def _alltoall(self, buffer, what):
        buffers = self._exchange(buffer, what)
        chunk = buffer.size // self.size
        mine = slice(self.rank * chunk, (self.rank + 1) * chunk)
        received = [other[mine].copy() for other in buffers]     # a test transport may copy
        self._meet(what)            # nobody overwrites a chunk before every rank has read it
        for j, part in enumerate(received):
            buffer[j * chunk:(j + 1) * chunk] = part
        self._meet(what)

    def _allgather(self, buffer, what):
        buffers = self._exchange(buffer, what)
        chunk = buffer.size // self.size
        for j, other in enumerate(buffers):
            if j != self.rank:      # rank j's chunk j: nobody writes it during the exchange
                buffer[j * chunk:(j + 1) * chunk] = other[j * chunk:(j + 1) * chunk]
        self._meet(what)

    def _gather_host(self, mine, what):
        rows = self._exchange(mine.copy(), what)
        out = np.stack(rows)
        self._meet(what)
        return out

    def bcast_object(self, value, root=0):
        chosen = self._exchange(value, "a broadcast")[root]
        self._meet("a broadcast")
        return chosen

    def _allgatherv(self, piece, counts, what):
        pieces = self._exchange(piece.copy(), what)
        out = np.concatenate(pieces) if pieces else piece
        self._meet(what)
        return out


# ---- launching ----------------------------------------------------------------------------
# what MPI launchers put in each process's environment: the number of processes
LAUNCHER_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")
LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
                        "SLURM_NTASKS_PER_NODE")


def _int_variable(names):
    for name in names:
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def launched_size():
    """The number of processes an MPI launcher (mpiexec, mpirun, srun with PMI) started this
    one among, from its environment; None when no launcher started it. Nothing is imported."""
    return _int_variable(LAUNCHER_SIZE_VARIABLES)


def local_ranks():
    """How many ranks share this machine (1 when the launcher does not say)."""
    return _int_variable(LOCAL_SIZE_VARIABLES) or 1


def mpi_world(timeout=DEFAULT_TIMEOUT):
    """The MPICommunicator of MPI_COMM_WORLD (imports mpi4py, which starts MPI); a one-line
    MinigistError when mpi4py is missing."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise MinigistError(f"started by an MPI launcher, but mpi4py cannot be imported ({exc}); install it: "
                            f"pip install minigist[mpi]") from None
    return MPICommunicator(MPI.COMM_WORLD, timeout)
