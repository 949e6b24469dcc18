"""Time a data-parallel training step: one process against N ranks under mpiexec, side by side.

    python bench/ddp_step.py [--model resnet20] [--batch-size 32] [--ranks 2] [--steps 12]
                             [--rounds 3] [--shard none] [--conv im2col|onednn]

Each round runs three jobs one after the other on the same global batch: one process with
all the cores' threads, one process with one thread, and `mpiexec -n RANKS` with the cores
shared among the ranks; a job builds its net, takes 2 untimed steps and then times --steps
steps (train_step, the reduction included). Rounds alternate so that machine noise hits every
job alike. The table gives, per job, the median over rounds of each job's median step time,
images per second, and for the ranks the share of the step spent inside the collectives
(reduce-scatter and all-gather of the buckets, the loss's exchange; waiting for the slower rank
included: the communicator's own clock, minigist.comm.Communicator.seconds).

Needs mpi4py and an mpiexec (pip install minigist[mpi]). Not a test: nothing runs it in CI.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def worker(args):
    """One job: time --steps steps; rank 0 prints one JSON line."""
    import numpy as np
    import minigist
    from minigist.comm import launched_size, mpi_world
    comm = mpi_world() if (launched_size() or 1) > 1 else None
    path = os.path.join(ROOT, "models", args.model + ".prototxt")
    net = minigist.Net(path, batch_size=args.batch_size, comm=comm, shard=args.shard if comm else "none",
                       update="fused", conv=args.conv, threads=args.threads, gist="none",
                       solver=minigist.SGD(lr=0.01))
    rng = np.random.default_rng(0)
    shape = (net.batch_size,) + tuple(net.train_graph.input_shape)
    images = rng.standard_normal(shape).astype(np.float32)
    labels = rng.integers(0, 10, net.batch_size).astype(np.float32)
    for _ in range(2):
        net.train_step(images, labels)
    times, collective = [], []
    for _ in range(args.steps):
        before = comm.seconds if comm is not None else 0.0
        start = time.perf_counter()
        net.train_step(images, labels)
        times.append(time.perf_counter() - start)
        collective.append((comm.seconds if comm is not None else 0.0) - before)
    if comm is None or comm.rank == 0:
        step = statistics.median(times)
        share = statistics.median(c / t for c, t in zip(collective, times))
        print(json.dumps({"step": step, "share": share, "footprint": net.report()["footprint_bytes"]}), flush=True)


def run_job(command, env):
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"ddp_step: a job failed: {' '.join(command)}\n{done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--batch-size", type=int, default=32, help="the global batch (default 32)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shard", default="none", choices=["none", "optimizer", "gradients", "weights"])
    parser.add_argument("--conv", default="im2col", choices=["im2col", "onednn"])
    parser.add_argument("--threads", type=int, help=argparse.SUPPRESS)      # a job's own
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if mpiexec is None:
        sys.exit("ddp_step: no mpiexec found (pip install minigist[mpi])")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    common = [sys.executable, os.path.abspath(__file__), "--worker", "--model", args.model, "--batch-size",
              str(args.batch_size), "--steps", str(args.steps), "--shard", args.shard, "--conv", args.conv]
    per_rank = max(1, cores // args.ranks)
    jobs = {f"1 process, {cores} threads": (common + ["--threads", str(cores)], cores),
            "1 process, 1 thread": (common + ["--threads", "1"], 1),
            f"{args.ranks} ranks, {per_rank} thread{'s' if per_rank > 1 else ''} each":
                ([mpiexec, "-n", str(args.ranks)] + common + ["--threads", str(per_rank)], per_rank)}
    results = {label: [] for label in jobs}
    for _ in range(args.rounds):
        for label, (command, threads) in jobs.items():
            env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
            results[label].append(run_job(command, env))
    print(f"{args.model}, global batch {args.batch_size}, conv {args.conv}, shard {args.shard}, {cores} cores; "
          f"medians over {args.rounds} rounds of {args.steps} steps")
    print("| job | step ms | images/s | in collectives | footprint MiB (per rank) |")
    print("|---|---:|---:|---:|---:|")
    for label, runs in results.items():
        step = statistics.median(r["step"] for r in runs)
        share = statistics.median(r["share"] for r in runs)
        print(f"| {label} | {step * 1e3:.1f} | {args.batch_size / step:,.0f} | "
              f"{f'{share:.1%}' if 'ranks' in label else '-'} | {runs[0]['footprint'] / 2**20:.1f} |")


if __name__ == "__main__":
    main()
