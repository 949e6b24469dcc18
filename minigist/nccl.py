"""GPU ranks: the two collectives through NCCL (cupy.cuda.nccl), everything else through MPI.

`nccl_world(mpi)` gives each rank the GPU of its place on its machine (local rank modulo the
GPUs there), makes NCCL's unique id on rank 0 and broadcasts it over MPI, then opens the NCCL
communicator. Its reduce-scatter and all-gather work in place on the arena's device arrays,
on the current stream; NCCL adds in its ring's order (fixed for a fixed set of GPUs, not
MPI's rank order). The host then waits for each collective with the deadline, so a rank that
stops answering ends the run with RankTimeoutError as on the CPU, instead of a kernel that
never returns. Numbers (the loss, evaluation counts, the state for a checkpoint) go through
MPI.

The NCCL and CuPy modules are arguments so that tests can hand in stand-ins and run this
code on the CPU (tests/test_distributed.py).
"""
import time

import numpy as np

from .comm import Communicator
from .errors import MinigistError


def _pointer(array):
    """The device address of a CuPy array (a host address for a numpy one: the tests' stand-in)."""
    return array.ctypes.data if isinstance(array, np.ndarray) else array.data.ptr


class NCCLCommunicator(Communicator):
    def __init__(self, host, nccl=None, cupy=None, timeout=None):
        super().__init__(host.rank, host.size, host.timeout if timeout is None else timeout)
        if nccl is None:
            from cupy.cuda import nccl
        if cupy is None:
            import cupy
        self.host, self.nccl, self.cupy = host, nccl, cupy
        unique_id = nccl.get_unique_id() if self.rank == 0 else None
        unique_id = host.bcast_object(unique_id)
        self.nccl_comm = nccl.NcclCommunicator(self.size, unique_id, self.rank)
        self.datatypes = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
                          np.dtype(np.float16): nccl.NCCL_FLOAT16}

    def describe(self):
        return f"{self.size} ranks, NCCL for the collectives, MPI for the rest"

    def _args(self, buffer):
        count = buffer.size // self.size
        start = _pointer(buffer)
        return start, start + self.rank * count * buffer.dtype.itemsize, count, self.datatypes[buffer.dtype]

    def _stream(self):
        return self.cupy.cuda.get_current_stream().ptr

    def _reduce_scatter(self, buffer, what):
        start, mine, count, datatype = self._args(buffer)
        self.nccl_comm.reduceScatter(start, mine, count, datatype, self.nccl.NCCL_SUM, self._stream())
        self._drain(what)

    def _allgather(self, buffer, what):
        start, mine, count, datatype = self._args(buffer)
        self.nccl_comm.allGather(mine, start, count, datatype, self._stream())
        self._drain(what)

    def _drain(self, what):
        """Wait for the stream's work so far, at most the deadline."""
        event = self.cupy.cuda.Event()
        event.record()
        start = time.monotonic()
        while not event.done:
            if time.monotonic() - start > self.timeout:
                raise self._no_answer(what)
            time.sleep(2e-5)

    def _gather_host(self, mine, what):
        return self.host._gather_host(mine, what)

    def _allgatherv(self, piece, counts, what):
        return self.host._allgatherv(piece, counts, what)


def nccl_world(host, timeout=None):
    """The NCCLCommunicator of the MPI ranks `host` (an MPICommunicator), each on the GPU of its
    local rank; a one-line error where a machine has more ranks than GPUs (NCCL takes one GPU
    per rank)."""
    import cupy
    from mpi4py import MPI
    local = host.mpi.Split_type(MPI.COMM_TYPE_SHARED)
    devices = cupy.cuda.runtime.getDeviceCount()
    if local.Get_size() > devices:
        raise MinigistError(f"--device gpu: {local.Get_size()} ranks on this machine and {devices} GPUs; NCCL takes "
                            f"one GPU per rank: start at most {devices} ranks per machine")
    cupy.cuda.Device(local.Get_rank()).use()
    return NCCLCommunicator(host, timeout=timeout)
