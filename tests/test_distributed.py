"""Data parallelism: one rank's exact plan (no MPI), training over ranks that are threads of
this process (LocalGroup runs the same reduction code as MPI), the NCCL code with stand-ins,
and real runs under `mpiexec -n 2` (skipped, with the reason, where mpi4py is missing)."""
import ctypes
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import minigist
from minigist import datasets, trainer
from minigist.checkpoint import CHECKPOINT_NAME, arrays_digest, read_checkpoint
from minigist.comm import LocalGroup, RankTimeoutError
from minigist.errors import MinigistError
from minigist.memory import ALIGNMENT, align
from minigist.nccl import NCCLCommunicator
from minigist.passes.reduce import SHARDS, piece_elements
from minigist.pipeline import Options, compile, per_rank, plan_footprint
from test_train import TINY as TRAIN_TINY, one_line_error, train as train_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")
WORKER = os.path.join(ROOT, "tests", "mpi_worker.py")
MODELS = os.path.join(ROOT, "models")

# test_train's tiny net, at batch 12 (which 2, 3, 4 and 6 ranks divide): every kind of state,
# BatchNorm's running sums (averaged over the ranks), Scale, a Dropout drawing from each rank's
# own stream, momentum
TINY = TRAIN_TINY.replace("shape { dim: 4 dim: 3", "shape { dim: 12 dim: 3").replace("shape { dim: 4 }",
                                                                                     "shape { dim: 12 }")
# the same without batch statistics and randomness: N ranks compute what one process computes,
# up to the order of the additions
PLAIN = "\n".join(line for line in TINY.splitlines() if not any(kind in line for kind in ("BatchNorm", "Scale",
                                                                                           "Dropout")))
GLOBAL_BATCH = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    out = {}
    for name, text in (("tiny", TINY), ("plain", PLAIN)):
        (folder / f"{name}.prototxt").write_text(text)
        out[name] = str(folder / f"{name}.prototxt")
    return out


def batches(count=3, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((GLOBAL_BATCH, 3, 8, 8)).astype(np.float32),
             rng.integers(0, 3, GLOBAL_BATCH).astype(np.float32)) for _ in range(count)]


def train(model, comm, steps=3, check_every_step=False, **settings):
    """Train a few steps on this rank's part of fixed global batches; returns (losses, state,
    the arena's bytes, the rank's plan report)."""
    settings.setdefault("solver", minigist.SGD(lr=0.1, momentum=0.9, weight_decay=1e-3))
    net = minigist.Net(model, batch_size=GLOBAL_BATCH, comm=comm, conv="im2col", **settings)
    rank = comm.rank if comm is not None else 0
    mine = slice(rank * net.batch_size, (rank + 1) * net.batch_size)
    losses, digests = [], []
    for x, y in batches(steps):
        losses.append(net.train_step(x[mine], y[mine]))
        if check_every_step:
            digests.append(arrays_digest(net.state()))
    return losses, net.state(), net.arena_bytes, net.report(), digests


def same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[key], b[key]) for key in a)


# ---- one rank's plan, exact, without MPI ---------------------------------------------------
def whole_and_pieces(model, ranks, itemsize=4):
    """{key: (bytes of the whole tensor, bytes of one rank's piece)} of every trained parameter."""
    graph = compile(model, Options(batch_size=1)).graph
    out = {}
    for layer in graph.layers:
        for decl in layer.params:
            if decl.trained:
                size = math.prod(decl.shape)
                out[f"{layer.name}.{decl.name}"] = (align(size * itemsize),
                                                    piece_elements(size, ranks, itemsize) * itemsize)
    return out


@pytest.mark.parametrize("ranks", [3, pytest.param(2, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)])
def test_each_sharded_category_is_one_nth_of_the_whole_to_the_alignment(ranks):
    alexnet = os.path.join(MODELS, "alexnet.prototxt")
    sizes = whole_and_pieces(alexnet, ranks)
    whole = sum(w for w, _ in sizes.values())
    pieces = sum(p for _, p in sizes.values())
    # a piece is ceil(size / ranks) elements rounded up to the 256-byte alignment, exactly
    assert all(p == align(math.ceil(w // 4 / ranks) * 4) for w, p in sizes.values())
    assert whole <= ranks * pieces <= whole + ranks * ALIGNMENT * len(sizes)
    for update in ("fused", "separate"):
        kept = {shard: plan_footprint(alexnet, batch_size=2 * ranks, gist="none", update=update, ranks=ranks,
                                      shard=shard)["distributed"]["persistent_by_category"] for shard in SHARDS}
        grads = 0 if update == "fused" else whole
        assert kept["none"] == {"weights": whole, "weight_grads": grads, "optimizer_state": whole}
        assert kept["optimizer"] == {"weights": whole, "weight_grads": grads, "optimizer_state": pieces}
        assert kept["gradients"] == {"weights": whole, "weight_grads": grads and pieces, "optimizer_state": pieces}
        assert kept["weights"] == {"weights": pieces, "weight_grads": grads and pieces, "optimizer_state": pieces}


def test_running_statistics_stay_whole_and_buckets_are_counted(models):
    report = plan_footprint(models["tiny"], batch_size=GLOBAL_BATCH, update="fused", ranks=3, shard="weights")
    sizes = whole_and_pieces(models["tiny"], 3)
    state = align(4 * 4) * 2 + align(4)      # BatchNorm's mean, variance (4 channels) and factor, whole
    assert report["distributed"]["persistent_by_category"]["weights"] == sum(p for _, p in sizes.values()) + state
    buckets = report["distributed"]["buckets"]
    assert [b["name"] for b in buckets] == ["bucket:0", "bucket:state"]
    assert report["total_by_category"]["communication"] == sum(align(b["bytes"]) for b in buckets)
    assert report["batch_size"] == GLOBAL_BATCH // 3


def test_alexnet_per_rank_targets():
    """AlexNet at 64 images per rank on 8 ranks (a global batch of 512)."""
    alexnet = os.path.join(MODELS, "alexnet.prototxt")
    for gist in ("none", "lossless"):
        plans = {shard: plan_footprint(alexnet, batch_size=512, gist=gist, update="fused", ranks=8,
                                       shard=shard)["footprint_bytes"] for shard in SHARDS}
        single = plan_footprint(alexnet, batch_size=64, gist=gist, update="fused")["footprint_bytes"]
        assert plans["none"] == single      # AlexNet's buckets are reduced before its peak
        assert plans["gradients"] <= 0.8 * plans["none"]
        assert plans["weights"] <= 0.7 * plans["none"]


def test_the_pass_places_packs_reductions_updates_and_gathers():
    alexnet = os.path.join(MODELS, "alexnet.prototxt")
    options = per_rank(alexnet, Options(batch_size=16, update="fused", ranks=2, shard="weights",
                                        bucket_bytes=8 * 2**20))
    program = compile(alexnet, options).program
    steps, buffers = program.steps, program.buffers
    labels = [step.label for step in steps]
    spread = program.distributed
    assert program.graph.batch_size == 8
    for bucket, keys in spread.buckets.items():
        nbytes = buffers[bucket].nbytes
        assert nbytes <= 8 * 2**20 or len(keys) == 1
        reduce_at = labels.index(f"reduce:{bucket}")
        packs = [labels.index(f"pack:{key}") for key in keys]
        assert max(packs) == reduce_at - 1      # reduced as soon as its last gradient is packed
        for key in keys:
            layer = key.split(".")[0]
            assert labels.index(f"pack:{key}") > labels.index(f"backward:{layer}")
            assert labels.index(f"update:{key}") > reduce_at     # fused: right after the reduction
    # a layer's whole weights exist only from their gather to the step that reads them
    for name, buffer in buffers.items():
        if buffer.kind == "param":
            assert not buffer.persistent and name in steps[buffer.last_use].args["p"]
            assert {step.kind for step in steps[buffer.first_use:buffer.last_use]} == {"gather"}
    assert {b.kind for b in buffers.values() if b.persistent} == {"wshard", "mshard"}
    seeds = [step for step in steps if step.kind == "seed"]
    assert [step.args["value"] for step in seeds] == [0.5]


# ---- ranks as threads: the reduction code MPI runs, without MPI -----------------------------
@pytest.mark.parametrize("update", ["fused", "separate"])
def test_every_rank_holds_the_same_weights_after_every_step_in_every_shard_mode(models, update):
    reference = None
    for shard in SHARDS:
        # a small bucket: every parameter alone in its own, sharing its gradient's storage
        results = LocalGroup(2).run(lambda comm: train(models["tiny"], comm, update=update, shard=shard,
                                                       bucket_bytes=256, check_every_step=True))
        losses, state, arena, report, digests = results[0]
        assert results[1][4] == digests and results[1][0] == losses and same(results[1][1], state)
        assert arena == report["footprint_with_evaluation_bytes"]      # the plan is what a rank allocates
        reference = reference or state
        assert same(state, reference), shard     # every shard mode: the same weights, bit for bit


@pytest.mark.slow
def test_three_ranks_other_allocations_and_gist(models):
    for settings in ({"alloc": "none", "shard": "weights"}, {"alloc": "dynamic", "shard": "gradients"},
                     {"gist": "all", "shard": "weights"}, {"gist": "lossless", "shard": "optimizer",
                                                           "update": "separate"}):
        plain = LocalGroup(3).run(lambda comm: train(models["tiny"], comm, gist=settings.get("gist", "none")))
        results = LocalGroup(3).run(lambda comm: train(models["tiny"], comm, **settings))
        for result in results:
            assert same(result[1], results[0][1]), settings
        if settings.get("gist", "none") != "all":       # lossless encodings train bit for bit as none
            assert same(results[0][1], plain[0][1]), settings


def test_two_ranks_against_one_process_with_the_same_global_batch(models):
    single = train(models["plain"], None, steps=4)
    for shard in ("none", "weights"):
        ranks = LocalGroup(2).run(lambda comm: train(models["plain"], comm, steps=4, shard=shard))
        for key, value in single[1].items():
            np.testing.assert_allclose(ranks[0][1][key], value, rtol=1e-5, atol=1e-6, err_msg=key)
        np.testing.assert_allclose(ranks[0][0], single[0], rtol=1e-6)     # the global batch's loss


def test_gradients_are_summed_in_rank_order(models):
    """update=separate keeps the reduced gradients readable: ((g0 + g1) + g2) + g3, each g the
    gradient of one rank's part of the batch under the loss seed 1 / 4 (exact: a power of 2)."""
    x, y = batches(1)[0]

    def gradients(comm):
        net = minigist.Net(models["plain"], batch_size=GLOBAL_BATCH, comm=comm, conv="im2col", update="separate")
        mine = slice(comm.rank * 3, comm.rank * 3 + 3)
        net.forward_backward(x[mine], y[mine])
        return {key: value.copy() for key, value in net.grads().items()}

    def alone(rank):
        net = minigist.Net(models["plain"], batch_size=3, conv="im2col", update="separate")
        net.forward_backward(x[rank * 3:rank * 3 + 3], y[rank * 3:rank * 3 + 3])
        return {key: value * np.float32(0.25) for key, value in net.grads().items()}

    reduced = LocalGroup(4).run(gradients)
    parts = [alone(rank) for rank in range(4)]
    for key in parts[0]:
        expected = ((parts[0][key] + parts[1][key]) + parts[2][key]) + parts[3][key]
        for rank in range(4):
            assert np.array_equal(reduced[rank][key], expected), key


def test_nccl_code_with_stand_ins_gives_the_mpi_order_bits(models):
    group = LocalGroup(2)
    exchange = _Exchange(2)

    def run(comm):
        fake = FakeNccl(exchange)
        return train(models["tiny"], NCCLCommunicator(comm, nccl=fake, cupy=FakeCupy), shard="weights")

    through_nccl = group.run(run)
    plain = LocalGroup(2).run(lambda comm: train(models["tiny"], comm, shard="weights"))
    assert same(through_nccl[0][1], plain[0][1]) and same(through_nccl[1][1], plain[0][1])
    assert exchange.calls["reduceScatter"] and exchange.calls["allGather"]


def test_a_rank_that_stops_answering_ends_the_run_in_one_line(models):
    group = LocalGroup(2, timeout=0.5)

    def run(comm):
        net = minigist.Net(models["plain"], batch_size=GLOBAL_BATCH, comm=comm, conv="im2col")
        if comm.rank == 1:
            return None      # gone before the first step
        x, y = batches(1)[0]
        return net.train_step(x[:6], y[:6])

    start = time.monotonic()
    with pytest.raises(RankTimeoutError, match=r"^rank 0: no answer from the other ranks within 0.5 s"):
        group.run(run)
    assert time.monotonic() - start < 30


def test_each_rank_reads_its_part_of_the_global_batch():
    data = datasets.load_dataset("synthetic", (3, 8, 8), 3, holdout=0.1, synthetic_size=40)
    indices = data.epoch_batch(np.random.default_rng(1).permutation(len(data.train)), 0, 12)
    rngs = [np.random.default_rng(5) for _ in range(4)]
    whole = data.train_batch(indices, rngs[0], crop_pad=2, flip=True)
    parts = [data.train_batch(indices, rng, crop_pad=2, flip=True, part=slice(4 * r, 4 * r + 4))
             for r, rng in enumerate(rngs[1:])]
    assert np.array_equal(np.concatenate([p[0] for p in parts]), whole[0])
    assert np.array_equal(np.concatenate([p[1] for p in parts]), whole[1])
    assert all(rng.bit_generator.state == rngs[0].bit_generator.state for rng in rngs[1:])


def test_shared_evaluation_counts_exactly(models):
    data = datasets.load_dataset("synthetic", (3, 8, 8), 3, holdout=0.5, synthetic_size=58)
    names = ("acc", "loss")
    single = minigist.Net(models["tiny"], batch_size=4, conv="im2col")
    expected = trainer.evaluate(single, data, data.heldout, 4, names)

    def run(comm):     # weights sharded: every evaluation gathers them, so the ranks must run as often
        from minigist.distributed import evaluate_shared
        net = minigist.Net(models["tiny"], batch_size=12, comm=comm, conv="im2col", shard="weights")
        return evaluate_shared(trainer.evaluate, net, data, data.heldout, 4, names, comm)

    for result in LocalGroup(3).run(run):
        assert result["samples"] == expected["samples"] == len(data.heldout)
        assert result["correct"] == expected["correct"]
        assert result["loss"] == pytest.approx(expected["loss"], rel=1e-6)


def test_bad_input_is_one_line(models, capsys):
    with pytest.raises(MinigistError, match=r"^--shard weights: splits the training state among ranks"):
        trainer.run(model=models["tiny"], data="synthetic", iters=1, shard="weights", out=lambda *a: None)
    with pytest.raises(MinigistError, match=r"^--ranks 4: a training run has as many ranks as processes"):
        trainer.run(model=models["tiny"], data="synthetic", iters=1, ranks=4, out=lambda *a: None)
    with pytest.raises(MinigistError, match=r"^--batch-size: the global batch of 12 cannot be split evenly among 8"):
        trainer.run(model=models["tiny"], plan_only=True, ranks=8, out=lambda *a: None)
    with pytest.raises(MinigistError, match=r"^--shard weights: sharding splits the state among ranks"):
        minigist.Net(models["tiny"], shard="weights")
    with pytest.raises(MinigistError, match=r"^--shard: expected one of none, optimizer, gradients, weights"):
        Options(shard="zero3")
    with pytest.raises(MinigistError, match=r"^--batch-size: the global batch of 12 cannot be split evenly among 5"):
        LocalGroup(5).run(lambda comm: minigist.Net(models["tiny"], comm=comm))
    capsys.readouterr()
    assert train_cli.main(["--shard", "optimizer", "--iters", "1"]) == 2
    printed = capsys.readouterr()
    assert printed.err.startswith("train.py: error: --shard optimizer: splits the training state") and \
        printed.err.count("\n") == 1 and "mpiexec -n N" in printed.err


def test_plan_only_prints_one_ranks_footprint(capsys):
    report = trainer.run(model="alexnet", plan_only=True, ranks=8, batch_size=512, shard="weights", gist="none",
                         conv="im2col")
    printed = capsys.readouterr().out
    assert "one of 8 ranks (batch 64 each), shard weights" in printed
    assert f"{report['footprint_bytes']:,} B" in printed
    assert report["footprint_bytes"] == plan_footprint(os.path.join(MODELS, "alexnet.prototxt"), batch_size=512,
                                                       update="fused", ranks=8, shard="weights")["footprint_bytes"]


# ---- stand-ins for NCCL and CuPy: the NCCL code on host memory ------------------------------
class _Exchange:
    """What the stand-in communicators of one group share."""

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.posted = [None] * size
        self.calls = {"reduceScatter": 0, "allGather": 0}


class FakeNccl:
    """cupy.cuda.nccl's names, on host addresses, adding in rank order (as NCCL does in ring
    order)."""
    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_SUM = 6, 7, 8, 0
    TYPES = {6: np.float16, 7: np.float32, 8: np.float64}

    def __init__(self, exchange):
        self.exchange = exchange

    def get_unique_id(self):
        return tuple(range(128))

    def NcclCommunicator(self, size, unique_id, rank):      # noqa: N802  (cupy's name)
        assert size == self.exchange.size and unique_id == tuple(range(128))
        return _FakeNcclComm(self, rank)


class _FakeNcclComm:
    def __init__(self, nccl, rank):
        self.nccl, self.rank, self.exchange = nccl, rank, nccl.exchange

    def _array(self, address, count, datatype):
        dtype = np.dtype(self.nccl.TYPES[datatype])
        return np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(address), dtype)

    def _all(self, value):
        self.exchange.posted[self.rank] = value
        self.exchange.barrier.wait(10)
        return list(self.exchange.posted)

    def reduceScatter(self, send, receive, count, datatype, op, stream):    # noqa: N802
        assert op == FakeNccl.NCCL_SUM and receive == send + self.rank * count * 4
        self.exchange.calls["reduceScatter"] += 1
        everyone = self._all(self._array(send, count * self.exchange.size, datatype))
        total = everyone[0][self.rank * count:(self.rank + 1) * count].copy()
        for other in everyone[1:]:
            total += other[self.rank * count:(self.rank + 1) * count]
        self.exchange.barrier.wait(10)
        self._array(receive, count, datatype)[...] = total
        self.exchange.barrier.wait(10)

    def allGather(self, send, receive, count, datatype, stream):    # noqa: N802
        assert send == receive + self.rank * count * 4
        self.exchange.calls["allGather"] += 1
        everyone = self._all(self._array(receive, count * self.exchange.size, datatype))
        mine = everyone[self.rank]
        for rank, other in enumerate(everyone):
            if rank != self.rank:
                mine[rank * count:(rank + 1) * count] = other[rank * count:(rank + 1) * count]
        self.exchange.barrier.wait(10)


class FakeCupy:
    class cuda:     # noqa: N801  (cupy's name)
        class Event:
            done = True

            def record(self):
                pass

        @staticmethod
        def get_current_stream():
            return type("Stream", (), {"ptr": 0})()


# ---- real MPI ------------------------------------------------------------------------------
def mpiexec():
    """The mpiexec beside this Python (the mpich wheel's), or a skip with the reason."""
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install minigist[mpi])")
    found = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec found (pip install minigist[mpi] installs MPICH's)")
    return found


def run_ranks(ranks, *args, timeout=120):
    return subprocess.run([mpiexec(), "-n", str(ranks), sys.executable, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_mpiexec_two_ranks_train_alike_through_the_library(models, tmp_path):
    done = run_ranks(2, WORKER, models["tiny"], tmp_path, "none", "weights")
    assert done.returncode == 0, done.stderr
    rank0, rank1 = (dict(np.load(tmp_path / f"rank{r}.npz")) for r in (0, 1))
    assert same(rank0, rank1)
    for key, value in rank0.items():
        if key.startswith("weights/"):
            assert np.array_equal(value, rank0["none/" + key[len("weights/"):]]), key


CLI = ["--data", "synthetic", "--holdout", 0.1, "--train-eval-size", 0, "--crop-pad", 1, "--flip", "on", "--conv",
       "im2col", "--batch-size", GLOBAL_BATCH, "--gist", "none"]


def final_state(folder):
    return read_checkpoint(str(folder))[2]


@pytest.mark.slow
def test_mpiexec_checkpoint_and_resume(models, tmp_path):
    common = [TRAIN, "--model", models["tiny"], *CLI]
    whole, part, other = tmp_path / "whole", tmp_path / "part", tmp_path / "other"
    done = run_ranks(2, *common, "--iters", 9, "--checkpoint", whole)
    assert done.returncode == 0, done.stderr
    assert "ranks: all 2 hold the same weights and momentum, bit for bit" in done.stdout
    assert done.stdout.count("done:") == 1      # rank 0 alone prints
    first = run_ranks(2, *common, "--iters", 4, "--checkpoint", part, "--checkpoint-every", 2)
    assert first.returncode == 0, first.stderr
    shutil.copytree(part, other)
    # the same ranks, another shard mode: bit for bit the uninterrupted run
    resumed = run_ranks(2, TRAIN, "--checkpoint", part, "--resume", "--iters", 9, "--shard", "weights")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr
    assert same(final_state(part), final_state(whole))
    # another number of ranks: one process
    alone = subprocess.run([sys.executable, TRAIN, "--checkpoint", str(other), "--resume", "--iters", "9"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert alone.returncode == 0 and "resumed from" in alone.stdout, alone.stderr
    assert final_state(other).keys() == final_state(whole).keys()


@pytest.mark.slow
def test_mpiexec_two_ranks_against_one_process(models, tmp_path):
    common = [TRAIN, "--model", models["plain"], *CLI, "--iters", 6]
    two = run_ranks(2, *common, "--checkpoint", tmp_path / "two")
    one = subprocess.run([sys.executable, *map(str, common), "--checkpoint", tmp_path / "one"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert two.returncode == 0 and one.returncode == 0, two.stderr + one.stderr
    a, b = final_state(tmp_path / "two"), final_state(tmp_path / "one")
    for key in b:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.slow
def test_mpiexec_bad_input_is_one_line(models):
    done = run_ranks(2, TRAIN, "--model", models["tiny"], "--data", "synthetic", "--batch-size", 13, "--iters", 1)
    one_line_error(done, "--batch-size: the global batch of 13 cannot be split evenly among 2 ranks")


def rank_pid(marker, rank):
    """The pid of the rank `rank` whose command line holds `marker`, from /proc."""
    for pid in os.listdir("/proc"):
        try:
            command = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            environment = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except (OSError, ValueError):
            continue
        if marker.encode() in command and f"PMI_RANK={rank}".encode() in environment:
            return int(pid)
    return None


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the ranks' pids in /proc")
@pytest.mark.parametrize("stop", ["SIGSTOP", "SIGKILL"])
def test_mpiexec_a_rank_that_stops_or_dies_ends_the_run(models, tmp_path, stop):
    marker = str(tmp_path / "run")
    command = [mpiexec(), "-n", "2", sys.executable, TRAIN, "--model", models["tiny"], *CLI, "--iters", 100000,
               "--eval-every", 0, "--rank-timeout", 3, "--checkpoint", marker]
    process = subprocess.Popen(list(map(str, command)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60      # into the training loop: the first epoch's checkpoint
        while not os.path.exists(os.path.join(marker, CHECKPOINT_NAME)) and time.monotonic() < deadline \
                and process.poll() is None:
            time.sleep(0.05)
        pid = rank_pid(marker, 1)
        assert pid is not None, "rank 1 never trained"
        os.kill(pid, getattr(signal, stop))
        stopped = time.monotonic()
        out, err = process.communicate(timeout=60)
        assert time.monotonic() - stopped < 30
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        left = rank_pid(marker, 1)      # a stopped rank its launcher did not take down
        if left is not None:
            os.kill(left, signal.SIGKILL)
    if stop == "SIGSTOP":       # rank 0 waits 3 s, then says so in one line
        lines = [line for line in err.strip().splitlines() if line.startswith("train.py:")]
        assert process.returncode == 2 and len(lines) == 1, err
        assert lines[0].startswith("train.py: error: rank 0: no answer from the other ranks within 3 s")
    else:                       # MPICH's launcher stops the others at once and reports the death
        assert process.returncode != 0
        assert "BAD TERMINATION" in out + err
