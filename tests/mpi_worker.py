"""Run by tests/test_distributed.py under `mpiexec -n N`: each rank trains a small net through
the library (Net with an MPICommunicator) and writes what it ends with to OUT/rank<r>.npz.

    mpiexec -n 2 python tests/mpi_worker.py MODEL OUT SHARD [SHARD ...]
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import minigist  # noqa: E402
from minigist.comm import mpi_world  # noqa: E402

STEPS = 3
GLOBAL_BATCH = 8


def main(model, out, shards):
    comm = mpi_world(timeout=60)
    rng = np.random.default_rng(0)
    net = minigist.Net(model, batch_size=GLOBAL_BATCH, comm=comm)
    shape = (GLOBAL_BATCH,) + tuple(net.train_graph.input_shape)
    batches = [(rng.standard_normal(shape).astype(np.float32), rng.integers(0, 3, GLOBAL_BATCH).astype(np.float32))
               for _ in range(STEPS)]
    mine = slice(comm.rank * net.batch_size, (comm.rank + 1) * net.batch_size)
    arrays = {}
    for shard in shards:
        net = minigist.Net(model, batch_size=GLOBAL_BATCH, comm=comm, shard=shard, update="fused",
                           solver=minigist.SGD(lr=0.1, momentum=0.9, weight_decay=1e-3))
        losses = [net.train_step(x[mine], y[mine]) for x, y in batches]
        arrays.update({f"{shard}/{key}": value for key, value in net.state().items()})
        arrays[f"{shard}/losses"] = np.array(losses)
        arrays[f"{shard}/footprint"] = np.array(net.report()["footprint_bytes"])
    np.savez(os.path.join(out, f"rank{comm.rank}.npz"), **arrays)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
