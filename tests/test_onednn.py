"""The oneDNN convolution engine (--conv onednn): the same results as minigist's im2col engine
to float32 rounding, on every convolution geometry; in place; partial backward; whole nets
(deterministic, Gist lossless bit-exact, planned bytes); and its errors. The whole module
needs the oneDNN library (`pip install minigist[fast]`, which CI installs)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import minigist
from minigist import blas, onednn
from minigist.errors import MinigistError
from minigist.layers.conv_onednn import OneDNNEngine
from minigist.testing import LayerRun, make_layer

from test_layers_conv_pool import CONV_CASES, CONV_IDS, conv_text

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
pytestmark = pytest.mark.skipif(not onednn.available(), reason=f"oneDNN: {onednn.unavailable_reason()}")


def onednn_layer(text, shape, dtype=np.float32):
    return make_layer(text, [shape], dtype=dtype, engine="onednn")


def relative(got, want):
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / max(np.linalg.norm(want), 1e-30))


@pytest.mark.parametrize("case", CONV_CASES, ids=CONV_IDS)
def test_onednn_matches_the_im2col_engine(case):
    """Forward and full backward in float32 against the im2col engine in float64, from the same
    weights; outputs and workspaces are handed in full of NaN (LayerRun), so anything the
    engine leaves unwritten fails."""
    body, shape, *_ = case
    rng = np.random.default_rng(5)
    x = rng.standard_normal(shape)
    reference = LayerRun(make_layer(conv_text(body), [shape], dtype=np.float64), seed=1)
    ref_y = reference.forward([x])[0]
    gy = rng.standard_normal(ref_y.shape)
    (ref_gx,), ref_gp = reference.backward([gy])
    layer = onednn_layer(conv_text(body), shape)
    run = LayerRun(layer, seed=1)
    run.params = [p.astype(np.float32) for p in reference.params]
    y = run.forward([x.astype(np.float32)])[0]
    (gx,), gp = run.backward([gy.astype(np.float32)])
    assert y.dtype == gx.dtype == np.float32
    assert relative(y, ref_y) < 1e-6
    assert relative(gx, ref_gx) < 1e-6
    for got, want in zip(gp, ref_gp):
        assert relative(got, want) < 1e-5
    kernels = layer.conv_engine().primitives().implementations()
    assert set(kernels) == {"forward", "backward_data", "backward_weights"}


@pytest.mark.parametrize("body", ["num_output: 16 kernel_size: 3 pad: 1", "num_output: 16 kernel_size: 1",
                                  "num_output: 16 kernel_size: 3 pad: 1 group: 2"])
def test_onednn_in_place_gives_the_out_of_place_bits(body):
    """Where the layer says y may overwrite x (gx gy), the blocked copies make it so."""
    shape = (4, 16, 6, 5)
    rng = np.random.default_rng(8)
    x, gy = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    layer = onednn_layer(conv_text(body), shape)
    assert layer.inplace_safe(0, 0) and layer.stream_chunk() == 0
    reference = LayerRun(layer, seed=2)
    ref_y = reference.forward([x])[0]
    (ref_gx,), ref_gp = reference.backward([gy])
    ws = {phase: {k: np.empty(d.shape, d.dtype or np.float32) for k, d in layer.workspace(phase).items()}
          for phase in ("forward", "backward")}
    inplace = x.copy()
    layer.forward(np, [inplace], [inplace], reference.params, {}, ws["forward"])
    np.testing.assert_array_equal(inplace, ref_y)
    grad = gy.copy()
    gp = [np.empty_like(p) for p in reference.params]
    layer.backward(np, [x], [None], [grad], [grad], reference.params, gp, {}, ws["backward"])
    np.testing.assert_array_equal(grad, ref_gx)
    for got, want in zip(gp, ref_gp):
        np.testing.assert_array_equal(got, want)


def test_onednn_partial_backward_and_frozen_weights():
    """No gx asked: no backward-data copies; frozen weights: gb summed from gy alone, and no
    copies of x for a weight gradient."""
    shape = (3, 4, 6, 6)
    rng = np.random.default_rng(9)
    x = rng.standard_normal(shape)
    body = "num_output: 8 kernel_size: 3 pad: 1"
    reference = LayerRun(make_layer(conv_text(body), [shape], dtype=np.float64), seed=4)
    gy = rng.standard_normal(reference.forward([x])[0].shape)
    (ref_gx,), ref_gp = reference.backward([gy])

    layer = onednn_layer(conv_text(body), shape)
    assert {"gx_blk", "w_blk"}.isdisjoint(layer.workspace("backward", gx_needed=(False,)))
    run = LayerRun(layer, seed=4)
    run.params = [p.astype(np.float32) for p in reference.params]
    run.forward([x.astype(np.float32)])
    (gx,), gp = run.backward([gy.astype(np.float32)], need_bottoms=[False])
    assert gx is None
    assert relative(gp[0], ref_gp[0]) < 1e-5 and relative(gp[1], ref_gp[1]) < 1e-5

    frozen = conv_text(body).replace("convolution_param", "param { lr_mult: 0 } param { lr_mult: 1 } convolution_param")
    layer = onednn_layer(frozen, shape)
    assert layer.keeps_bottoms == ()
    assert {"x_blk", "gw_blk"}.isdisjoint(layer.workspace("backward"))
    run = LayerRun(layer, seed=4)
    run.params = [p.astype(np.float32) for p in reference.params]
    run.forward([x.astype(np.float32)])
    (gx,), gp = run.backward([gy.astype(np.float32)])
    assert gp[0] is None
    assert relative(gx, ref_gx) < 1e-6 and relative(gp[1], ref_gp[1]) < 1e-6


@pytest.mark.parametrize("frozen_bias", [False, True])
def test_onednn_batch_chunks_give_the_whole_batch_results(monkeypatch, frozen_bias):
    """A batch larger than chunk_bytes allows runs in chunks of samples (the largest divisor of
    the batch that fits): the same y and gx as one call, and dW, db summed over the chunks to
    float32 rounding; the later chunks' dW and db are declared workspace."""
    shape = (6, 4, 6, 6)
    body = "num_output: 8 kernel_size: 3 pad: 1"
    text = conv_text(body)
    if frozen_bias:
        text = text.replace("convolution_param", "param { lr_mult: 1 } param { lr_mult: 0 } convolution_param")
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape)
    reference = LayerRun(make_layer(text, [shape], dtype=np.float64), seed=2)
    gy = rng.standard_normal(reference.forward([x])[0].shape)
    (ref_gx,), ref_gp = reference.backward([gy])
    results = {}
    for per_call in (6, 2):
        # the larger of x's and y's per-sample bytes (8 x 6 x 6 floats) times the samples wanted
        monkeypatch.setattr(OneDNNEngine, "chunk_bytes", per_call * 8 * 36 * 4)
        layer = onednn_layer(text, shape)
        engine = layer.conv_engine()
        assert engine.samples_per_call() == per_call
        assert engine.stream_chunk() == (0 if per_call == 6 else per_call)
        ws = layer.workspace("backward")
        assert ("gw_part" in ws) == (per_call < 6) and ("gb_part" in ws) == (per_call < 6 and not frozen_bias)
        run = LayerRun(layer, seed=2)
        run.params = [p.astype(np.float32) for p in reference.params]
        y = run.forward([x.astype(np.float32)])[0]
        (gx,), gp = run.backward([gy.astype(np.float32)])
        assert relative(y, reference.forward([x])[0]) < 1e-6 and relative(gx, ref_gx) < 1e-6
        for got, want in zip(gp, ref_gp):
            if got is not None:
                assert relative(got, want) < 1e-5
        results[per_call] = y, gx
    np.testing.assert_array_equal(results[2][1], results[6][1])   # each sample's gx alone
    np.testing.assert_allclose(results[2][0], results[6][0], rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_onednn_chunks_keep_the_plan_exact_and_gist_lossless(monkeypatch):
    """Chunked (one sample per call here) the plan is still the declared bytes, Gist hands the
    stash chunk by chunk, and lossless trains to the plain net's bits."""
    monkeypatch.setattr(OneDNNEngine, "chunk_bytes", 1)
    plain = small_net("vgg_small", conv="onednn")
    planned = minigist.plan_footprint(os.path.join(ROOT, "models", "vgg_small.prototxt"), batch_size=4,
                                      update="separate", conv="onednn")
    assert planned["footprint_bytes"] == plain.report()["footprint_bytes"]
    data = batches(plain)
    _, want = train(plain, data)
    lossless = small_net("vgg_small", conv="onednn", gist="lossless")
    lossless.calibrate(data)
    _, got = train(lossless, data)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
    # stashes of 4 MiB and more (batch 32) in fp16, encoded per sample: each convolution's
    # chunk (4 samples here) decoded as its call reads it
    monkeypatch.setattr(OneDNNEngine, "chunk_bytes", 4 * 64 * 32 * 32 * 4)

    def net_of_32():
        return minigist.Net(os.path.join(ROOT, "models", "vgg_small.prototxt"), batch_size=32, seed=0, conv="onednn",
                            gist="all", solver=minigist.SGD(lr=0.01, momentum=0.9))

    def streamed(net):
        return [step.label for step in net.compiled["train"].program.steps
                if type(step.op).__name__ == "StreamedBackward" and step.layer.type == "Convolution"]
    chunked = net_of_32()
    assert streamed(chunked)
    monkeypatch.setattr(OneDNNEngine, "chunk_bytes", 1 << 30)
    whole = net_of_32()
    assert not streamed(whole)
    rng = np.random.default_rng(1)
    data = [(rng.standard_normal((32, 3, 32, 32)).astype(np.float32), rng.integers(0, 10, 32)) for _ in range(2)]
    (chunked_losses, got), (whole_losses, want) = train(chunked, data), train(whole, data)
    np.testing.assert_allclose(chunked_losses, whole_losses, rtol=1e-5)
    # the weight gradient summed chunk by chunk rounds otherwise than in one call
    assert relative(np.concatenate([got[k].ravel() for k in want]),
                    np.concatenate([want[k].ravel().astype(np.float64) for k in want])) < 1e-5


def test_onednn_copies_do_not_fill_a_gist_peak():
    """VGG-16 at batch 64 under `all`: whole-batch blocked copies made the plan 1.05x smaller
    than none (2.47 GB of copies at the peak); in chunks it is the im2col engine's plan to 1%."""
    path = os.path.join(ROOT, "models", "vgg16.prototxt")
    plans = {conv: minigist.plan_footprint(path, batch_size=64, gist="all", update="fused", conv=conv)
             for conv in ("onednn", "im2col")}
    assert plans["onednn"]["footprint_bytes"] <= 1.01 * plans["im2col"]["footprint_bytes"]
    assert plans["onednn"]["peak_by_category"]["workspace"] < 128 << 20


def small_net(model, **kwargs):
    return minigist.Net(os.path.join(ROOT, "models", model + ".prototxt"), batch_size=4, seed=0,
                        solver=minigist.SGD(lr=0.01, momentum=0.9, weight_decay=5e-4), **kwargs)


def batches(net, count=2, seed=0):
    rng = np.random.default_rng(seed)
    shape = (4,) + tuple(net.train_graph.input_shape)
    return [(rng.standard_normal(shape).astype(np.float32), rng.integers(0, 10, 4)) for _ in range(count)]


def train(net, data, steps=3):
    losses = [net.train_step(*data[step % len(data)]) for step in range(steps)]
    return losses, {k: np.array(v) for k, v in net.params().items()}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["resnet20", "vgg_small"])
def test_onednn_nets_train_like_im2col_and_repeat_bit_for_bit(model):
    ours = small_net(model, conv="onednn")
    data = batches(ours)
    losses, weights = train(ours, data)
    again_losses, again = train(small_net(model, conv="onednn"), data)
    assert losses == again_losses
    for key in weights:
        np.testing.assert_array_equal(weights[key], again[key])
    theirs_losses, theirs = train(small_net(model, conv="im2col"), data)
    np.testing.assert_allclose(losses, theirs_losses, rtol=1e-4)
    assert relative(np.concatenate([w.ravel() for w in weights.values()]),
                    np.concatenate([w.ravel() for w in theirs.values()])) < 1e-4


_STATIC = {}


def static_runs():
    """The plain static net's weights after training, and the lossless one's: the same for every
    allocation mode below, so trained once."""
    if not _STATIC:
        plain = small_net("vgg_small", conv="onednn")
        data = batches(plain)
        _, _STATIC["plain"] = train(plain, data)
        lossless = small_net("vgg_small", conv="onednn", gist="lossless")
        lossless.calibrate(data)
        _, _STATIC["lossless"] = train(lossless, data)
        _STATIC["data"] = data
    return _STATIC


@pytest.mark.slow
@pytest.mark.parametrize("alloc", ["none", "dynamic"])
def test_onednn_lossless_gist_and_allocation_modes_keep_the_bits(alloc):
    """Gist lossless and every allocation mode train to the same bits as the plain static net."""
    runs = static_runs()
    want, got, data = runs["plain"], runs["lossless"], runs["data"]
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
    _, got = train(small_net("vgg_small", conv="onednn", alloc=alloc), data)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])


def test_onednn_plan_is_the_declared_bytes():
    """The shapes-only plan equals the built net's, and each convolution's workspace buffers
    are exactly the blocked copies and scratchpad oneDNN asked for."""
    net = small_net("resnet20", conv="onednn", update="fused")
    planned = minigist.plan_footprint(os.path.join(ROOT, "models", "resnet20.prototxt"), batch_size=4,
                                          update="fused", conv="onednn")
    assert planned["footprint_bytes"] == net.report()["footprint_bytes"]
    assert net.report()["conv"] == "onednn"
    program = net.programs["train"]
    checked = 0
    for layer in net.train_graph.layers:
        if layer.type != "Convolution":
            continue
        wanted = layer.conv_engine().primitives().workspace("forward")
        found = {name.rsplit(".", 1)[1]: buffer.nbytes for name, buffer in program.buffers.items()
                 if name.startswith(f"ws:{layer.name}.forward.")}
        assert found == wanted
        assert "col" not in found
        checked += 1
    assert checked == 21


def test_onednn_runs_blas_on_one_thread_during_steps():
    if blas.get_threads() is None:
        pytest.skip("numpy's BLAS is not OpenBLAS")
    net = small_net("resnet20", conv="onednn")
    assert net.blas_threads == 1
    seen = []
    layer = next(layer for layer in net.train_graph.layers if layer.type == "InnerProduct")
    original = type(layer).forward

    def spy(self, *args):
        seen.append(blas.get_threads())
        return original(self, *args)
    with blas.threads(2):
        type(layer).forward = spy
        try:
            net.train_step(*batches(net)[0])
        finally:
            type(layer).forward = original
        assert blas.get_threads() == 2
    assert seen == [1]


def test_onednn_runs_the_codec_kernels_on_its_openmp_threads(monkeypatch):
    from minigist.codecs import kernels
    if not kernels.available():
        pytest.skip("numba is not installed")
    seen = []
    original = kernels.dpr_encode_flat
    monkeypatch.setattr(kernels, "dpr_encode_flat", lambda *args: seen.append(kernels._threads) or original(*args))
    net = small_net("vgg_small", conv="onednn", gist="lossy")
    assert net.codec_threads == onednn.max_threads() >= 1
    net.train_step(*batches(net)[0])
    assert seen and set(seen) == {onednn.max_threads()}
    assert kernels._threads == 1          # the process's own setting again after the step
    seen.clear()
    plain = small_net("vgg_small", gist="lossy")
    plain.train_step(*batches(plain)[0])
    assert seen and set(seen) == {1}


def test_onednn_errors():
    with pytest.raises(MinigistError, match="--conv: expected one of auto, im2col, onednn, got 'fast'"):
        small_net("vgg_small", conv="fast")
    with pytest.raises(MinigistError, match="--conv onednn runs float32 only, not float64"):
        small_net("vgg_small", conv="onednn", dtype=np.float64)


def test_train_py_without_the_library_is_a_one_line_error(tmp_path):
    env = dict(os.environ, MINIGIST_ONEDNN_LIB=str(tmp_path / "libdnnl.so.3"))
    result = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--conv", "onednn", "--iters", "1"],
                            capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "--conv onednn:" in result.stderr and "libdnnl.so.3" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_train_py_resumes_bit_for_bit_and_keeps_its_engine(tmp_path):
    """An interrupted --conv onednn --threads 2 run resumes (with neither flag: the
    checkpoint's engine and thread count) to the weights of an uninterrupted one; a resume
    cannot switch engines or thread counts (the bits would differ)."""
    from test_train import TINY, final_weights, one_line_error, run_cli
    model = tmp_path / "tiny.prototxt"
    model.write_text(TINY)
    common = ["--model", model, "--data", "synthetic", "--holdout", 0.02, "--train-eval-size", 0,
              "--eval-every", 0, "--conv", "onednn", "--threads", 2]
    whole, part = tmp_path / "whole", tmp_path / "part"
    result = run_cli(*common, "--iters", 6, "--checkpoint", whole)
    assert result.returncode == 0, result.stderr
    assert "conv: onednn, oneDNN 3." in result.stdout and ", 2 OpenMP threads (--threads)" in result.stdout
    assert ", 1 thread during the steps (--conv onednn" in result.stdout
    assert run_cli(*common, "--iters", 3, "--checkpoint", part).returncode == 0
    resumed = run_cli("--checkpoint", part, "--resume", "--iters", 6)
    assert resumed.returncode == 0, resumed.stderr
    a, b = final_weights(whole), final_weights(part)
    for key in a:
        assert np.array_equal(a[key], b[key]), key
    one_line_error(run_cli("--checkpoint", part, "--resume", "--conv", "im2col"), "--conv")
    one_line_error(run_cli("--checkpoint", part, "--resume", "--threads", 1), "--threads")
