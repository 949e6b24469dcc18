"""The convolution engine and the thread policy of a Net: conv="auto" is resolved to the
engine a plan is made for (oneDNN where it runs, im2col otherwise), and every step runs on
minigist.default_threads, the policy train.py applies too, whatever the process's counts."""
import os

import numpy as np
import pytest

import minigist
from minigist import blas, onednn
from minigist.errors import MinigistError
from minigist.pipeline import plan_footprint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "vgg_small.prototxt")
needs_onednn = pytest.mark.skipif(not onednn.available(), reason=f"oneDNN: {onednn.unavailable_reason()}")
needs_openblas = pytest.mark.skipif(blas.get_threads() is None, reason="numpy's BLAS is not OpenBLAS")


def small_net(**kwargs):
    return minigist.Net(MODEL, batch_size=4, seed=0, solver=minigist.SGD(lr=0.01, momentum=0.9), **kwargs)


def one_batch(net):
    rng = np.random.default_rng(0)
    shape = (4,) + tuple(net.train_graph.input_shape)
    return rng.standard_normal(shape).astype(np.float32), rng.integers(0, 10, 4)


def test_auto_is_im2col_without_onednn(monkeypatch):
    monkeypatch.setattr(onednn, "available", lambda: False)
    net = small_net(conv="auto")
    assert net.conv == net.report()["conv"] == "im2col"
    assert all(layer.engine == "im2col" for layer in net.train_graph.layers if layer.type == "Convolution")
    assert plan_footprint(MODEL, batch_size=4, conv="auto")["conv"] == "im2col"
    assert "conv im2col" in minigist.memory.report.format_report(net.report()).splitlines()[0]


@needs_onednn
def test_auto_is_onednn_where_it_runs():
    net = small_net(conv="auto")
    assert net.conv == net.report()["conv"] == "onednn"
    assert "conv onednn" in minigist.memory.report.format_report(net.report()).splitlines()[0]
    assert plan_footprint(MODEL, batch_size=4, conv="auto")["conv"] == "onednn"
    assert small_net(conv="auto", dtype=np.float64).conv == "im2col"     # oneDNN runs float32 only
    assert small_net().conv == "im2col"        # the library's default stays im2col


def test_default_threads_policy(monkeypatch):
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert minigist.default_threads("im2col") == 1
    cpus = len(os.sched_getaffinity(0))
    assert minigist.default_threads("onednn") == min(cpus, minigist.net.MAX_DEFAULT_THREADS)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "2")
    assert minigist.default_threads("onednn") == 3
    assert minigist.default_threads("im2col") == 2
    with pytest.raises(MinigistError, match="--threads: expected a positive integer, got 0"):
        small_net(threads=0)


def threads_in_a_step(monkeypatch, net):
    """(BLAS threads, oneDNN OpenMP threads) inside the net's training step (at its classifier)."""
    layer_type = type(next(layer for layer in net.train_graph.layers if layer.type == "InnerProduct"))
    original, seen = layer_type.forward, []

    def spy(self, *args):
        seen.append((blas.get_threads(), onednn.max_threads()))
        return original(self, *args)
    monkeypatch.setattr(layer_type, "forward", spy)
    net.train_step(*one_batch(net))
    monkeypatch.setattr(layer_type, "forward", original)
    return seen


@needs_openblas
@pytest.mark.parametrize("conv", ["im2col", pytest.param("onednn", marks=needs_onednn)])
def test_a_step_runs_on_the_policy_not_the_process_count(monkeypatch, conv):
    """With OpenBLAS left at two threads by the process, a Net's step runs BLAS on the policy's
    count (im2col: 1; onednn: 1, its OpenMP threads on default_threads), or on threads=N; the
    process's counts are back after the step."""
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    outside_omp = onednn.max_threads()
    policy = minigist.default_threads(conv)
    with blas.threads(2):
        plain = threads_in_a_step(monkeypatch, small_net(conv=conv))
        asked = threads_in_a_step(monkeypatch, small_net(conv=conv, threads=3))
        assert (blas.get_threads(), onednn.max_threads()) == (2, outside_omp)
    if conv == "im2col":
        assert plain == [(1, outside_omp)] and asked == [(3, outside_omp)]
    else:
        assert plain == [(1, policy)] and asked == [(1, 3)]
