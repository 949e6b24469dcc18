"""The CPU-side checker of CuPy's rules (minigist/gpu/rules.py): each rule catches what it is
for (the bugs it was written against included), and real training steps keep them all, with
the numpy path's losses."""
import os
import subprocess
import sys

import numpy as np
import pytest

import minigist
from minigist.codecs.dpr import DPR, FORMATS
from minigist.gpu.rules import XP, DeviceArray, Generator, check_training
from minigist.testing import codes_dpr_writes

ROOT = os.path.join(os.path.dirname(__file__), "..")
MODELS = os.path.join(ROOT, "models")

# small, but with every kernel's layer: convolution, BatchNorm, Scale, ReLU, MAX pooling,
# Dropout, a 1x1 convolution, Eltwise, InnerProduct
TINY = """
name: "tiny"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 2 dim: 3 dim: 12 dim: 12 } shape { dim: 2 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "conv1" }
layer { name: "scale1" type: "Scale" bottom: "conv1" top: "conv1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2"
        convolution_param { num_output: 8 kernel_size: 1 weight_filler { type: "msra" } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "sum" type: "Eltwise" bottom: "conv2" bottom: "pool1" top: "sum" }
layer { name: "drop" type: "Dropout" bottom: "sum" top: "sum" dropout_param { dropout_ratio: 0.25 } }
layer { name: "fc" type: "InnerProduct" bottom: "sum" top: "fc"
        inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
"""


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.prototxt"
    path.write_text(TINY)
    return str(path)


def device(array):
    return np.ascontiguousarray(array).view(DeviceArray)


def rules_of(report):
    return [rule for rule, _, _ in report.all_violations()]


# ---- each rule ------------------------------------------------------------------------------------
def test_an_output_overlapping_an_input_is_caught_unless_it_is_the_same_object():
    a = device(np.arange(8, dtype=np.float32))
    with XP.checking() as same:
        XP.maximum(a, 0, out=a)
    with XP.checking() as other:
        XP.maximum(a[:], 0, out=a.reshape(8))
    assert rules_of(same) == [] and rules_of(other) == ["overlap"]


def test_matmul_copies_are_caught_as_cupy_makes_them():
    stack = device(np.ones((2, 4, 5), np.float32))
    out = device(np.zeros((2, 5, 5), np.float32))
    with XP.checking() as transposed:
        XP.matmul(stack.transpose(0, 2, 1), stack, out=out)          # 3-D, not C-contiguous: copied
    with XP.checking() as plain:
        XP.matmul(stack[0].T, stack[1], out=out[0])                  # 2-D, F-contiguous: as it is
    assert rules_of(transposed) == ["matmul"] and rules_of(plain) == []


def test_host_syncs_allocations_and_data_sized_results_are_recorded():
    a = device(np.array([0, 1, 2, 0], np.float32))
    with XP.checking() as report:
        int(XP.count_nonzero(a))
        float(a.sum())
        a.tolist()
        XP.flatnonzero(a)
        _ = a + 1
    assert len(report.syncs) == 4
    assert [rule for rule in rules_of(report)] == ["allocation", "allocation"]


def test_the_old_dpr_decode_relied_on_subnormals_and_the_new_one_does_not():
    """The decode that shifted a code into a float32 subnormal and scaled it up (what CuPy's
    -ftz=true kernels turned into 0) is caught; DPR's decode of every code it writes is not, and writes
    the numpy path's bytes under the checker."""
    pattern = device(np.array([1 << 13], np.uint32)).view(np.float32)      # fp16's smallest subnormal, shifted
    with XP.checking() as old:
        XP.multiply(pattern, np.float32(2.0 ** 112), out=pattern)
    assert rules_of(old) == ["subnormal"]
    for fmt in FORMATS:
        dpr = DPR(fmt)
        codes = codes_dpr_writes(fmt, np.arange(1 << (dpr.E + dpr.M + 1), dtype=np.uint32))
        n = codes.size
        if dpr.per == 3:
            codes = codes[codes < 1024]
            words = np.zeros(-(-codes.size // 3), np.uint32)
            for k in range(3):
                words[:len(codes[k::3])] |= codes[k::3] << np.uint32(10 * k)
            enc, n = words, codes.size
        else:
            enc = codes.astype(dpr.code_dtype)
        ws = {k: np.empty(d.shape, d.dtype) for k, d in dpr.flat_workspace(n, "decode").items()}
        want = np.empty(n, np.float32)
        dpr.decode_flat(np, enc, want, ws)
        got = device(np.empty(n, np.float32))
        with minigist.gpu.kernels.use_gpu_kernels(False), XP.checking() as new:
            dpr.decode_flat(XP, device(enc), got, {k: device(v) for k, v in ws.items()})
        assert rules_of(new) == [], fmt
        np.testing.assert_array_equal(got.view(np.ndarray).view(np.uint32), want.view(np.uint32))


def test_the_old_dropout_draw_is_caught():
    """Generator.random(out=..., dtype=...) without size: CuPy draws one number for the whole
    array (the mask all kept or all dropped)."""
    uniform = device(np.empty(64, np.float32))
    with XP.checking() as report:
        Generator(0).random(out=uniform, dtype=uniform.dtype)
    assert "api" in rules_of(report)


def test_dropout_on_the_device_path_keeps_its_fraction(tiny):
    net = minigist.Net(tiny, device="cupy-rules", conv="im2col")
    layer = next(node.layer for node in net.train_graph.nodes if node.layer.type == "Dropout")
    x = device(np.ones((64, 256), np.float32))
    y, mask = device(np.empty_like(x)), device(np.empty(x.shape, np.bool_))
    layer.forward(XP, [x], [y], [], {"mask": mask}, {"uniform": device(np.empty_like(x))})
    kept = mask.view(np.ndarray).mean()
    assert abs(kept - 0.75) < 0.02, kept
    np.testing.assert_array_equal(y.view(np.ndarray), mask.view(np.ndarray) / np.float32(0.75))


# ---- real training steps ---------------------------------------------------------------------
def cpu_losses(model, gist, batch_size, steps, update="fused"):
    net = minigist.Net(model, batch_size=batch_size, gist=gist, conv="im2col", update=update, seed=0)
    data_shape = net.train_graph.blobs[net.train_graph.nodes[0].tops[0]].shape
    classes = int(net.train_graph.nodes[-1].layer.bottom_shapes[0][1])
    batches = [minigist.gpu.rules.relu_like_batch(data_shape, classes, k) for k in range(steps + 2)]
    if net.gist.lossless:
        net.calibrate([batches[0]])
    net.train_step(*batches[1])
    return [net.train_step(*b) for b in batches[2:]]


@pytest.mark.parametrize("gist", ["none", "all"])
def test_training_steps_keep_cupy_rules(tiny, gist):
    """A step of a small net with every kernel's layer under the rules: no violation, at most
    two host syncs (the loss; SSDC's fit), kernels launched."""
    report = check_training(tiny, gist, batch_size=2, steps=1)
    assert report.all_violations() == [], report.lines()
    assert report.summary()["host_syncs_per_step"] <= 2
    assert report.summary()["kernels_per_step"] > 0


def test_a_leaky_relu_in_chunks_of_one_sample_keeps_cupy_rules(tmp_path, monkeypatch):
    """A leaky ReLU's backward takes the ufunc path on a GPU too: with every chunk one sample,
    its mask and its in-place gradient, a chunk at a time, keep the rules."""
    from minigist.layers.activation import ReLU
    monkeypatch.setattr(minigist.pipeline, "GPU_CHUNK_BYTES", 1)
    monkeypatch.setattr(ReLU, "chunk_bytes", 1)
    path = tmp_path / "leaky.prototxt"
    path.write_text(TINY.replace('top: "conv1" }\nlayer { name: "pool1"',
                                 'top: "conv1" relu_param { negative_slope: 0.1 } }\nlayer { name: "pool1"'))
    report = check_training(str(path), "none", batch_size=2, steps=1)
    assert report.all_violations() == [], report.lines()
    program = report.net.programs["train"]
    relu1 = next(s for s in program.steps if s.kind == "backward" and s.layer.name == "relu1")
    assert relu1.layer.slope == 0.1 and program.buffers[relu1.args["ws"]["mask"]].shape[0] == 1


@pytest.mark.parametrize("gist", ["lossless", "all"])
def test_replays_keep_cupy_rules(gist):
    """resnet20 with every other stash dropped, half of them shared: the replays and the decodes
    each run of replays makes into a copy of its own keep the rules too."""
    path = os.path.join(MODELS, "resnet20.prototxt")
    program = minigist.compile(path, minigist.Options(batch_size=2)).program
    stashed = [b.tensor for b in program.buffers.values() if b.kind == "blob" and b.category == "stash"]
    dropped = stashed[::2]
    report = check_training(path, gist, batch_size=2, steps=1, recompute=dropped, recompute_shared=dropped[::2])
    assert report.all_violations() == [], report.lines()
    assert report.summary()["host_syncs_per_step"] <= 2
    steps = report.net.programs["train"].steps
    assert any(s.kind == "recompute" for s in steps)
    assert any(s.kind == "decode" and s.args["out"].partition("#")[2] for s in steps)


def test_replays_reading_coded_sources_a_slice_at_a_time_keep_cupy_rules(monkeypatch):
    """resnet20 with every other stash dropped, every chunk one sample: a replayed
    convolution decoding its SSDC-coded source one sample at a time keeps the rules."""
    from minigist.layers.conv import Convolution
    from minigist.passes.gist_steps import StreamedReplay
    monkeypatch.setattr(minigist.pipeline, "GPU_CHUNK_BYTES", 1)
    monkeypatch.setattr(Convolution, "chunk_bytes", 1)
    monkeypatch.setattr(minigist.passes.gist, "STREAM_MIN_BYTES", 0)
    path = os.path.join(MODELS, "resnet20.prototxt")
    program = minigist.compile(path, minigist.Options(batch_size=2)).program
    stashed = [b.tensor for b in program.buffers.values() if b.kind == "blob" and b.category == "stash"]
    report = check_training(path, "lossless", batch_size=2, steps=1, recompute=stashed[::2])
    assert report.all_violations() == [], report.lines()
    assert report.summary()["host_syncs_per_step"] <= 2
    assert any(isinstance(s.op, StreamedReplay) for s in report.net.programs["train"].steps)


@pytest.mark.parametrize("gist", ["lossless", "all"])
@pytest.mark.parametrize("front", [("pool1", 1), ()])
def test_a_front_and_a_span_feeding_and_decoding_their_rows_keep_cupy_rules(tmp_path, monkeypatch, gist, front):
    """The span through pool2 a sample at a time, behind a front through pool1 (the net's input
    fed a micro-batch's rows at a time, the span's backward inside the front's) or alone
    (pool1, whole, decoded a micro-batch's rows at a time under all), every chunk one sample
    and every stash large enough to decode in parts: each micro-batch's feeds, encodes,
    decodes and steps on rows of whole tensors keep the rules, with the numpy path's losses."""
    from minigist.layers.conv import Convolution
    from minigist.passes.microbatch import Feed
    from test_span import TWO_POOLS
    monkeypatch.setattr(minigist.pipeline, "GPU_CHUNK_BYTES", 1)
    monkeypatch.setattr(Convolution, "chunk_bytes", 1)
    monkeypatch.setattr(minigist.passes.gist, "STREAM_MIN_BYTES", 0)
    path = tmp_path / "two_pools.prototxt"
    path.write_text(TWO_POOLS.replace("dim: 224 dim: 224", "dim: 16 dim: 16"))
    report = check_training(str(path), gist, batch_size=2, steps=1, microbatch=front,
                            spans=(("pool1", "pool2", 1),))
    assert report.all_violations() == [], report.lines()
    assert report.summary()["host_syncs_per_step"] <= 2
    steps = report.net.programs["train"].steps
    assert any(isinstance(s.op, Feed) for s in steps) == bool(front)
    assert any(s.kind == "decode" and "sample_range" in s.args for s in steps) == (gist == "all" and not front)
    assert any(s.kind == "backward" and s.layer.name == "conv2" and "samples" in s.args for s in steps)


@pytest.mark.parametrize("gist", ["none", "all"])
def test_a_weight_gradient_made_a_block_of_rows_at_a_time_keeps_cupy_rules(tmp_path, gist):
    """fc1's gradient in blocks of rows (--update blocked, passes/backward.py): each block
    reads a block of gy's columns in place, by one GEMM where CuPy's matmul would copy it."""
    from test_memory import WIDE
    path = tmp_path / "wide.prototxt"
    path.write_text(WIDE)
    report = check_training(str(path), gist, batch_size=4, steps=1, update="blocked")
    assert report.all_violations() == [], report.lines()
    assert sum("rows" in s.args for s in report.net.programs["train"].steps) == 6      # 3 blocks x 2
    # within float32 rounding: the checker's own kernels round apart from numpy's, with or
    # without the blocks
    assert report.overflows == 0
    np.testing.assert_allclose(report.losses, cpu_losses(str(path), gist, 4, 1, "blocked"), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["vgg_small", "resnet20", "inception_small"])
@pytest.mark.parametrize("gist", ["none", "all"])     # all: SSDC as lossless has it, and DPR
def test_bundled_models_keep_cupy_rules_with_the_numpy_losses(model, gist):
    path = os.path.join(MODELS, model + ".prototxt")
    report = check_training(path, gist, batch_size=2, steps=1)
    assert report.all_violations() == [], report.lines()
    assert report.summary()["host_syncs_per_step"] <= 2
    # the same arithmetic but for the products of transposed stacks, one per matrix here
    # (layers/gemm.py) where numpy's one call runs its own loop: within float32 rounding
    np.testing.assert_allclose(report.losses, cpu_losses(path, gist, 2, 1), rtol=1e-5)


@pytest.mark.slow
def test_the_tool_prints_its_rows_and_last_line(tiny):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "cupy_rules.py"), "--models", tiny,
                             "--gist", "none,all", "--batch-size", "2", "--steps", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "violations: 0, host syncs per step: 2"
    assert lines[2].startswith(f"| {tiny} | none | 0 | 1 |") and lines[3].startswith(f"| {tiny} | all | 0 | 2 |")
