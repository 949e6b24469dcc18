"""The micro-batched front (passes/microbatch.py): the layers from the net's input through one
blob run a few samples at a time, forward and again in the backward pass, bit for bit."""
import json
import os

import numpy as np
import pytest

import minigist
from minigist.checkpoint import check_optimized_plan
from minigist.errors import MinigistError
from minigist.optimize import SettingsSearch, NothingFits, Optimizer, RecordedPlan, Settings
from minigist.passes.microbatch import front_candidates
from minigist.pipeline import Options, compile
from test_gist import batches, model

VGG = model("vgg_small")
# one sample per convolution chunk: a micro-batch is then any whole number of them (the layers'
# own chunks of 8 MB hold the whole batch of vgg_small's first convolution)
BASE = Options(batch_size=8, update="fused", chunk_bytes=1)


def train(options, data, recompute=()):
    net = minigist.Net(VGG, seed=1, plan=Settings(options.replace(recompute=recompute)),
                       solver=minigist.SGD(lr=0.01, momentum=0.9, weight_decay=5e-4))
    if options.gist != "none":
        net.calibrate(data[:2])
    return net, [net.train_step(*batch) for batch in data]


@pytest.mark.parametrize("alloc", ["static", "dynamic"])
@pytest.mark.parametrize("gist", ["none", "lossless"])
@pytest.mark.parametrize("microbatch", [("pool1", 2), ("pool2", 4), ("conv1_1", 4)])
def test_a_micro_batched_front_trains_bit_identically(alloc, gist, microbatch):
    data = batches(2, batch_size=8)
    options = BASE.replace(alloc=alloc, gist=gist)
    reference, expected = train(options, data)
    net, losses = train(options.replace(microbatch=microbatch), data)
    assert losses == expected
    for key, value in reference.params().items():
        np.testing.assert_array_equal(net.params()[key], value, err_msg=key)
    program = net.programs["train"]
    samples = microbatch[1]
    runs = [s for s in program.steps if s.kind == "forward" and s.layer.name == "conv1_1"]
    assert [s.args["samples"] for s in runs] == [(k, k + samples) for k in range(0, 8, samples)]
    # later micro-batches add into conv1_1's gradients; each re-runs the front first where its
    # backward reads more than the net's input
    backward = [s for s in program.steps if s.kind == "backward" and s.layer.name == "conv1_1"]
    assert [bool(s.args.get("accumulate")) for s in backward] == [False] + [True] * (8 // samples - 1)
    replays = sum(s.kind == "recompute" and s.layer.name == "conv1_1" for s in program.steps)
    assert replays == (0 if microbatch[0] == "conv1_1" else 8 // samples)


def test_a_micro_batched_front_with_recomputation_behind_it_trains_bit_identically():
    data = batches(2, batch_size=8)
    options = BASE.replace(gist="lossless")
    behind = ("conv3_1@relu3_1", "pool3")
    reference, expected = train(options, data, recompute=behind)
    net, losses = train(options.replace(microbatch=("pool2", 4)), data, recompute=behind)
    assert losses == expected
    for key, value in reference.params().items():
        np.testing.assert_array_equal(net.params()[key], value, err_msg=key)


def test_no_tensor_of_the_front_is_whole_and_the_plan_shrinks_exactly():
    whole = compile(VGG, BASE)
    front = compile(VGG, BASE.replace(microbatch=("pool2", 4)))
    layers = {"conv1_1", "relu1_1", "conv1_2", "relu1_2", "pool1", "conv2_1", "relu2_1", "conv2_2", "relu2_2", "pool2"}
    for name, buffer in front.program.buffers.items():
        if buffer.layer in layers and buffer.kind in ("blob", "saved", "grad") and name != "blob:pool2":
            assert buffer.shape[0] == 4, name
    assert "blob:pool2" in front.program.buffers and front.program.buffers["blob:pool2"].shape[0] == 8
    # the static plans, to the byte (and the evaluation program's part, micro-batched too)
    # (the front's plan holds no whole input batch: 8 x 3 x 32 x 32 fp32, 98,304 B less than
    # 17,657,600 B when the front read rows of it)
    assert (whole.plan.footprint_bytes, front.plan.footprint_bytes) == (24669952, 17559296)
    assert "blob:data" not in front.program.buffers
    test_whole = compile(VGG, BASE, "TEST").plan.transient_bytes
    test_front = compile(VGG, BASE.replace(microbatch=("pool2", 4)), "TEST").plan.transient_bytes
    assert (test_whole, test_front) == (5088256, 4301824)
    # the arena a step runs in is the plan
    net, _ = train(BASE.replace(microbatch=("pool2", 4)), batches(1, batch_size=8))
    assert net.report()["footprint_bytes"] == front.plan.footprint_bytes


@pytest.mark.parametrize("microbatch, message", [
    (("pool9", 4), r"^--microbatch: 'pool9' is no top of this net$"),
    (("pool2", 3), r"^--microbatch: a micro-batch of 3 samples must divide the batch of 8 and be smaller$"),
    (("pool2", 8), r"^--microbatch: a micro-batch of 8 samples must divide the batch of 8 and be smaller$"),
    (("fc", 4), r"^--microbatch: 'fc' \(InnerProduct\) cannot run a micro-batch at a time"),
    (("data", 4), r"^--microbatch: 'data' is the net's input"),
])
def test_a_front_that_cannot_be_micro_batched_is_refused_in_one_line(microbatch, message):
    with pytest.raises(MinigistError, match=message):
        compile(VGG, BASE.replace(microbatch=microbatch))


def test_a_micro_batch_must_hold_whole_convolution_chunks():
    # at the layers' own chunk sizes conv1_1's chunk is the whole batch of 8
    with pytest.raises(MinigistError, match=r"^--microbatch: 4 samples are no whole number of the batch chunks "
                                            r"of 'conv1_1' \(8 samples each\)$"):
        compile(VGG, BASE.replace(chunk_bytes=None, microbatch=("pool1", 4)))


def test_a_tensor_read_past_the_front_is_refused(tmp_path):
    path = tmp_path / "skip.prototxt"
    path.write_text("""
layer { name: "data" type: "Input" top: "data" top: "label" input_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1" convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2" convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "sum" type: "Eltwise" bottom: "conv1" bottom: "conv2" top: "sum" }
layer { name: "fc" type: "InnerProduct" bottom: "sum" top: "fc" inner_product_param { num_output: 2 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
""")
    with pytest.raises(MinigistError, match=r"^--microbatch: 'conv1' is read past the front through 'conv2' \(by 'sum'\)$"):
        compile(str(path), Options(chunk_bytes=1, microbatch=("conv2", 2)))


def test_the_front_may_not_also_be_recomputed():
    with pytest.raises(MinigistError, match=r"^--microbatch: the front through 'pool2' may not be recomputed"):
        compile(VGG, BASE.replace(recompute=("pool2",), microbatch=("pool2", 4)))


def test_the_optimizer_plans_behind_a_micro_batched_front_against_the_whole_none():
    options = Options(batch_size=8, update="fused", chunk_bytes=1)
    plain = Optimizer(VGG, options, minigist.costmodel.reference_model())
    front = Optimizer(VGG, options.replace(microbatch=("pool2", 4)), minigist.costmodel.reference_model())
    # one baseline: every stash kept, the front whole
    assert front.baseline_footprint == plain.baseline_footprint
    assert front.floor()[0] < plain.floor()[0]
    plan = front.smallest()
    assert plan.ratio > plain.smallest().ratio
    # the front's own tensors are no choices; what lies behind it is
    assert not any(d["tensor"].startswith(("conv1_", "conv2_", "pool1")) for d in plan.to_json()["decisions"])
    assert plan.options.microbatch == ("pool2", 4)


@pytest.mark.parametrize("flags, message", [
    (["--microbatch", "pool2"], "argument --microbatch: expected BLOB:SAMPLES such as pool2:4, or auto, got 'pool2'"),
    (["--microbatch", "pool2:4"], "--microbatch: 'conv1_1' runs on the onednn engine"),
    (["--microbatch", "auto"], "--microbatch auto: the optimizer chooses the front; give --optimize"),
])
def test_the_command_line_refuses_a_bad_microbatch_in_one_line(flags, message):
    import subprocess
    import sys
    from minigist import onednn
    if "onednn" in message and not onednn.available():
        pytest.skip("oneDNN is not installed: --conv auto is im2col")
    root = os.path.join(os.path.dirname(__file__), "..")
    done = subprocess.run([sys.executable, os.path.join(root, "train.py"), "--model", "vgg16", "--batch-size", "8",
                           "--plan-only"] + flags, capture_output=True, text=True, cwd=root)
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) <= 2, done.stderr


def test_auto_tries_each_pooling_front_at_its_smallest_micro_batch():
    assert front_candidates(compile(VGG, BASE.replace(gist="none")).program) == [("pool1", 1), ("pool2", 1),
                                                                                  ("pool3", 1)]
    # at the layers' own chunks conv1_1's chunk is the whole batch: no front may be micro-batched,
    # and the search is the plain optimizer's, its refusal too
    assert front_candidates(compile(VGG, BASE.replace(gist="none", chunk_bytes=None)).program) == []
    search = SettingsSearch(VGG, BASE.replace(chunk_bytes=None), minigist.costmodel.reference_model())
    assert search.describe() == ("--microbatch auto: no front of this net may run a micro-batch at a time "
                                 "(convolutions on --conv im2col, ReLU, pooling and LRN up to a pool); the front is "
                                 "whole")
    with pytest.raises(NothingFits) as refusal:
        search.fit(10_000_000)
    assert "fronts tried" not in str(refusal.value) and refusal.value.least == search.floor()[0]


def test_auto_chooses_the_front_a_budget_needs_and_the_plan_trains_bit_identically():
    search = SettingsSearch(VGG, BASE, minigist.costmodel.reference_model())
    # each front, then each with the span behind it (through the next pool, its stashes kept)
    assert search.describe() == ("--microbatch auto: fronts tried: whole, pool1:1, pool2:1, pool3:1, "
                                 "pool1:1+pool2:1, pool2:1+pool3:1")
    assert search.baseline_footprint == 24669952
    # room to spare: the whole front, at the least predicted time
    assert search.fit(30_000_000).options.microbatch == ()
    # below what the whole front reaches (18,476,800 B), the front that fits at the least time
    for budget, front, footprint in ((18_400_000, ("pool1", 1), 18181888), (18_000_000, ("pool2", 1), 17559296)):
        plan = search.fit(budget)
        assert (plan.options.microbatch, plan.footprint_bytes) == (front, footprint)
        assert plan.footprint_bytes == compile(VGG, plan.options).plan.footprint_bytes
    with pytest.raises(NothingFits, match=r"the nearest of the fronts tried: whole, pool1:1, pool2:1, pool3:1, "
                                          r"pool1:1\+pool2:1, pool2:1\+pool3:1\)$"):
        search.fit(17_000_000)
    # lossless: the chosen front and decisions train as --gist none does, bit for bit
    data = batches(2, batch_size=8)
    reference, expected = train(BASE, data)
    net = minigist.Net(VGG, seed=1, plan=plan, solver=minigist.SGD(lr=0.01, momentum=0.9, weight_decay=5e-4))
    net.calibrate(data[:2])
    assert [net.train_step(*batch) for batch in data] == expected
    for key, value in reference.params().items():
        np.testing.assert_array_equal(net.params()[key], value, err_msg=key)
    assert net.report()["footprint_with_evaluation_bytes"] == 17559296


def test_a_plan_with_a_front_is_applied_and_read_back_from_its_record():
    plan = SettingsSearch(VGG, BASE, minigist.costmodel.reference_model()).fit(18_000_000)
    net = minigist.Net(VGG, seed=1, plan=Settings(BASE))
    net.apply_plan(plan)        # what a training run's --optimize does after calibration
    assert net.options.microbatch == ("pool2", 1)
    assert net.report()["footprint_with_evaluation_bytes"] == plan.footprint_bytes
    record = json.loads(json.dumps(plan.to_json()))      # as a checkpoint holds it
    check_optimized_plan(record)
    assert RecordedPlan(BASE, record).options.microbatch == ("pool2", 1)
    with pytest.raises(ValueError, match=r"'microbatch' is \['pool2', 0\], not \[BLOB, SAMPLES\]"):
        check_optimized_plan(dict(record, microbatch=["pool2", 0]))


def test_the_command_line_lets_the_optimizer_choose_the_front(tmp_path, capsys):
    import train as cli
    report_path = tmp_path / "r.json"
    # VGG-16 at batch 8: its smallest plan with the front whole needs 1,571,050,240 B
    assert cli.main(["--model", "vgg16", "--batch-size", "8", "--conv", "im2col", "--plan-only", "--optimize",
                     "--memory-budget", "1545000000", "--microbatch", "auto", "--report-json", str(report_path)]) == 0
    out = capsys.readouterr().out
    assert "--microbatch auto: fronts tried: whole, pool1:1, pool2:1, pool3:1, pool4:1, pool5:2" in out
    optimizer = json.loads(report_path.read_text())["optimizer"]
    assert optimizer["microbatch"] and optimizer["microbatch"][0] in ("pool2", "pool3", "pool4", "pool5")
    assert optimizer["footprint_bytes"] <= 1545000000
    assert f"front: the input through {optimizer['microbatch'][0]} runs" in out


POINTWISE = """
layer { name: "data" type: "Input" top: "data" top: "label" input_param { shape { dim: 8 dim: 3 dim: 8 dim: 8 } shape { dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1" convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "cccp1" type: "Convolution" bottom: "conv1" top: "cccp1" convolution_param { num_output: 16 kernel_size: 1 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "cccp1" top: "cccp1" }
layer { name: "pool1" type: "Pooling" bottom: "cccp1" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool1" top: "fc" inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
"""
# cccp1 keeps a sample's input (16 x 8 x 8 floats, 4,096 B): chunks of 3 samples in 12,288 B;
# conv1's columns of one sample take more than half that, so its chunks are single samples
THREE = 12288


def train_pointwise(path, options, steps=2):
    rng = np.random.default_rng(3)
    data = [(rng.standard_normal((8, 3, 8, 8)).astype(np.float32), rng.integers(0, 3, 8)) for _ in range(steps)]
    net = minigist.Net(str(path), seed=1, plan=Settings(options),
                       solver=minigist.SGD(lr=0.05, momentum=0.9, weight_decay=5e-4))
    return net, [net.train_step(*batch) for batch in data]


def test_a_1x1_convolutions_weight_gradient_does_not_depend_on_its_chunks(tmp_path):
    path = tmp_path / "pointwise.prototxt"
    path.write_text(POINTWISE)
    options = Options(batch_size=8, update="fused", chunk_bytes=THREE)
    chunks = {n.layer.name: n.layer.conv_engine().chunk() for n in compile(str(path), options).graph.nodes
              if n.layer.type == "Convolution"}
    assert chunks == {"conv1": 1, "cccp1": 3}
    reference, expected = train_pointwise(path, options.replace(chunk_bytes=1))    # every chunk one sample
    net, losses = train_pointwise(path, options)
    assert losses == expected
    for key, value in reference.params().items():
        np.testing.assert_array_equal(net.params()[key], value, err_msg=key)


@pytest.mark.parametrize("samples", [1, 2, 4])
def test_a_front_through_a_1x1_convolution_takes_any_micro_batch_bit_for_bit(tmp_path, samples):
    path = tmp_path / "pointwise.prototxt"
    path.write_text(POINTWISE)
    options = Options(batch_size=8, update="fused", chunk_bytes=THREE)
    assert front_candidates(compile(str(path), options).program) == [("pool1", 1)]
    reference, expected = train_pointwise(path, options)
    net, losses = train_pointwise(path, options.replace(microbatch=("pool1", samples)))
    assert losses == expected
    for key, value in reference.params().items():
        np.testing.assert_array_equal(net.params()[key], value, err_msg=key)


def test_the_smaller_chunks_of_a_micro_batched_front_are_compared_with_the_whole_none():
    """Under lossy modes the optimizer also plans at smaller batch chunks: those plans too are
    compared with `none` with the front whole, in bytes and in time (not with the front's own
    re-run, which would hide it)."""
    path = os.path.join(os.path.dirname(__file__), "..", "models", "vgg16.prototxt")
    options = Options(batch_size=8, update="fused", conv="im2col")
    front = Optimizer(path, options.replace(microbatch=("pool2", 1)), minigist.costmodel.reference_model(), lossy=True)
    chunked = front._chunked_optimizer()
    assert chunked.baseline_seconds == front.baseline_seconds < front.base_seconds
    assert chunked.baseline_footprint == front.baseline_footprint


def test_a_front_whose_planning_fails_is_left_out_of_the_search():
    search = SettingsSearch(VGG, BASE, minigist.costmodel.reference_model())
    failing = search.optimizers[2]      # the front through pool2

    def refuse(*args, **kwargs):
        raise MinigistError("--microbatch: planned to fail")
    failing.within = failing.fit = refuse
    plan = search.within(0.5)
    assert plan.options.microbatch != ("pool2", 1) and failing not in search.optimizers
    assert search.describe().endswith("fronts tried: whole, pool1:1, pool3:1, pool1:1+pool2:1, pool2:1+pool3:1; "
                                      "pool2:1 left out (--microbatch: planned to fail)")
    search.whole.fit = refuse       # the whole front's own errors stand
    with pytest.raises(MinigistError, match="planned to fail"):
        search.fit(30_000_000)


LARGE_INPUT = """
layer { name: "data" type: "Input" top: "data" top: "label" input_param { shape { dim: 4 dim: 3 dim: 224 dim: 224 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1" convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 8 stride: 8 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool1" top: "fc" inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
"""


def recorded_profiles(monkeypatch):
    """The training programs a profiling run would time, in a list, none of them run."""
    from minigist import optimize_cli
    profiled = []

    def record(nets, batch, repeats):
        profiled.extend(net.compiled["train"].program for net in nets)
        return {}, {}
    monkeypatch.setattr(optimize_cli, "profile_programs", record)
    return profiled


def test_a_training_runs_cost_model_times_the_fronts_it_chooses_among(tmp_path, monkeypatch):
    """--optimize --microbatch auto in a training run: the profiling run times each candidate
    front's `none` program beside the whole front's, so that no front is priced from FLOPs
    alone against measured times."""
    from minigist import optimize_cli
    path = tmp_path / "large.prototxt"
    path.write_text(LARGE_INPUT)
    options = Options(batch_size=4, update="fused", conv="im2col")
    fronts = front_candidates(compile(str(path), options.replace(gist="none")).program)
    assert fronts == [("pool1", 1)]     # conv1's columns of one 224x224 sample fill a chunk
    profiled = recorded_profiles(monkeypatch)
    rng = np.random.default_rng(0)
    batch = (rng.standard_normal((4, 3, 224, 224)).astype(np.float32), rng.integers(0, 3, 4))
    optimize_cli.profiled_model(str(path), options, batch, lossy=False, threads=1, out=lambda line: None,
                                fronts=fronts)
    micro = [p for p in profiled if any("samples" in step.args for step in p.steps)]
    assert len(micro) == 1 and any(step.kind == "recompute" for step in micro[0].steps)
