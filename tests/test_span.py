"""Spans (passes/microbatch.py): the layers after one blob through another run a few samples at
a time in the forward and the backward pass, each micro-batch's stashes kept (encoded by Gist
or as they are) for its own backward, no replay, bit for bit."""
import json

import numpy as np
import pytest

import minigist
from minigist.checkpoint import check_optimized_plan
from minigist.errors import MinigistError
from minigist.optimize import Optimizer, RecordedPlan, Settings
from minigist.pipeline import Options, compile
from minigist.program import names_in
from test_gist import batches, model

VGG = model("vgg_small")
# one sample per convolution chunk: a micro-batch is then any whole number of them
BASE = Options(batch_size=8, update="fused", chunk_bytes=1)
SPAN = ("pool1", "pool2", 2)


def train(options, data):
    net = minigist.Net(VGG, seed=1, plan=Settings(options), solver=minigist.SGD(lr=0.01, momentum=0.9, weight_decay=5e-4))
    if options.gist != "none":
        net.calibrate(data[:2])
    return net, [net.train_step(*batch) for batch in data]


def same_training(options, changed, data):
    reference, expected = train(options, data)
    net, losses = train(changed, data)
    assert losses == expected
    for key, value in reference.params().items():
        np.testing.assert_array_equal(net.params()[key], value, err_msg=key)
    return net


@pytest.mark.parametrize("alloc", ["static", "dynamic"])
@pytest.mark.parametrize("gist", ["none", "lossless"])
@pytest.mark.parametrize("spans, front", [((SPAN,), ()), ((("pool2", "pool3", 4),), ("pool1", 2)),
                                          ((SPAN, ("pool2", "pool3", 1)), ()), ((("data", "pool1", 2),), ()),
                                          ((SPAN,), ("pool1", 2))])
def test_a_span_trains_bit_identically(alloc, gist, spans, front):
    options = BASE.replace(alloc=alloc, gist=gist)
    net = same_training(options, options.replace(spans=spans, microbatch=front), batches(2, batch_size=8))
    program = net.programs["train"]
    for start, through, samples in spans:
        graph = net.train_graph
        first = graph.nodes[graph.blobs[start].consumers[0][0]].layer.name
        runs = [s for s in program.steps if s.kind == "forward" and s.layer.name == first]
        assert [s.args["samples"] for s in runs] == [(k, k + samples) for k in range(0, 8, samples)]
        backward = [s for s in program.steps if s.kind == "backward" and s.layer.name == first]
        assert [bool(s.args.get("accumulate")) for s in backward] == [False] + [True] * (8 // samples - 1)
        # no replay: each micro-batch's backward reads what its forward kept
        assert not any(s.kind == "recompute" and s.layer.name == first for s in program.steps)


def test_a_span_behind_the_front_runs_each_micro_batch_inside_the_fronts_backward():
    """A span from the front's last top at the front's micro-batch: each micro-batch's backward
    of the span runs right after the front's replays of that micro-batch and reads their copy
    of pool1, so pool1 is no stash; the span's updates follow its last micro-batch."""
    options = BASE.replace(gist="lossless", spans=(SPAN,), microbatch=("pool1", 2))
    program = compile(VGG, options).program
    assert program.buffers["blob:pool1"].category == "feature"
    assert "blob:pool1" not in program.encodings
    labels = [s.label + (f"#{s.args['samples'][0]}" if "samples" in s.args else "") for s in program.steps]
    for k in range(0, 8, 2):
        replay = labels.index(f"recompute:pool1#{k}")
        span = labels.index(f"backward:conv2_1#{k}")
        assert replay < span < labels.index(f"backward:pool1#{k}")
        step = program.steps[span]
        assert f"blob:pool1#r{k // 2}" in step.args["x"] and "blob:pool1" not in step.args["whole"]
    assert labels.index("backward:conv2_1#6") < labels.index("update:conv2_1") < labels.index("backward:pool1#6")
    whole = compile(VGG, BASE.replace(gist="lossless", microbatch=("pool1", 2))).plan.footprint_bytes
    assert compile(VGG, options).plan.footprint_bytes < whole


def test_each_micro_batch_keeps_its_own_stashes_and_the_plan_is_exact():
    whole = compile(VGG, BASE)
    span = compile(VGG, BASE.replace(spans=(("pool2", "pool3", 4),), microbatch=("pool1", 2)))
    stashes = [b for b in span.program.buffers.values() if b.category == "stash" and b.layer == "relu3_1"]
    assert sorted((b.name, b.shape[0]) for b in stashes) == [("blob:conv3_1@relu3_1#m0", 4),
                                                             ("blob:conv3_1@relu3_1#m1", 4)]
    assert span.program.buffers["blob:pool3"].shape[0] == 8 and not span.program.buffers["blob:pool3"].micro
    assert (whole.plan.footprint_bytes, span.plan.footprint_bytes) == (24669952, 21165824)
    net, _ = train(BASE.replace(spans=(("pool2", "pool3", 4),), microbatch=("pool1", 2)), batches(1, batch_size=8))
    assert net.report()["footprint_bytes"] == span.plan.footprint_bytes


def test_the_spans_input_is_decoded_a_micro_batch_at_a_time_bit_for_bit():
    # at batch 64 pool1 (4 MiB) is large enough to decode in parts: each micro-batch of the
    # span after it decodes its own rows of pool1's SSDC code
    options = Options(batch_size=64, update="fused", chunk_bytes=1, gist="lossless")
    data = batches(2, batch_size=64)
    net = same_training(options, options.replace(spans=(("pool1", "pool2", 16),)), data)
    program = net.programs["train"]
    decodes = [s for s in program.steps if s.kind == "decode" and s.note == "pool1"]
    assert [s.args["sample_range"] for s in decodes] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    assert {program.buffers[s.args["out"]].shape[0] for s in decodes} == {16}
    assert program.encodings["blob:pool1"].name == "ssdc"


@pytest.mark.parametrize("span, message", [
    (("pool9", "pool2", 2), r"^--microbatch-span: 'pool9' is no top of this net$"),
    (("pool2", "pool1", 2), r"^--microbatch-span: 'pool1' is not made after 'pool2'$"),
    (("pool1", "pool2", 3), r"^--microbatch-span: a micro-batch of 3 samples must divide the batch of 8"),
    (("pool2", "fc", 2), r"^--microbatch-span: 'fc' \(InnerProduct\) cannot run a micro-batch at a time"),
])
def test_a_span_that_cannot_be_micro_batched_is_refused_in_one_line(span, message):
    with pytest.raises(MinigistError, match=message):
        compile(VGG, BASE.replace(spans=(span,)))


def test_a_span_may_not_overlap_the_front_or_a_recomputation():
    with pytest.raises(MinigistError, match=r"^--microbatch-span: the span after 'pool1' overlaps the front"):
        compile(VGG, BASE.replace(microbatch=("pool2", 2), spans=(SPAN,)))
    with pytest.raises(MinigistError, match=r"^--microbatch-span: the span after 'pool1' overlaps the front"):
        compile(VGG, BASE.replace(recompute=("conv2_1@relu2_1",), spans=(SPAN,)))


def test_the_optimizer_chooses_per_micro_batch_and_its_plan_is_the_compiled_one():
    options = BASE.replace(spans=(SPAN,))
    optimizer = Optimizer(VGG, options, minigist.costmodel.reference_model())
    plain = Optimizer(VGG, BASE, minigist.costmodel.reference_model())
    assert optimizer.baseline_footprint == plain.baseline_footprint     # compared with the whole none
    # each micro-batch's part of a stash is a choice of its own, never recomputed
    parts = [t for t in optimizer.stashes if t.startswith("conv2_1@relu2_1#")]
    assert parts == [f"conv2_1@relu2_1#m{k}" for k in range(4)]
    assert not any(o.recompute for t in parts for o in optimizer.stashes[t].options)
    plan = optimizer.smallest()
    assert plan.footprint_bytes == compile(VGG, plan.options).plan.footprint_bytes + max(
        0, optimizer.eval_transient - compile(VGG, plan.options).plan.transient_bytes)
    record = json.loads(json.dumps(plan.to_json()))      # as a checkpoint holds it
    check_optimized_plan(record)
    assert RecordedPlan(BASE, record).options.spans == (SPAN,)
    with pytest.raises(ValueError, match=r"'spans' is \[\['pool1', 'pool2', 0\]\], not a list"):
        check_optimized_plan(dict(record, spans=[["pool1", "pool2", 0]]))
    # lossless: whatever it chose per micro-batch trains as --gist none does
    data = batches(2, batch_size=8)
    reference, expected = train(BASE, data)
    net = minigist.Net(VGG, seed=1, plan=RecordedPlan(BASE, record),
                       solver=minigist.SGD(lr=0.01, momentum=0.9, weight_decay=5e-4))
    assert [net.train_step(*batch) for batch in data] == expected
    for key, value in reference.params().items():
        np.testing.assert_array_equal(net.params()[key], value, err_msg=key)


TWO_POOLS = """
layer { name: "data" type: "Input" top: "data" top: "label" input_param { shape { dim: 4 dim: 3 dim: 224 dim: 224 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1" convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "conv2" type: "Convolution" bottom: "pool1" top: "conv2" convolution_param { num_output: 8 kernel_size: 3 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "relu2" type: "ReLU" bottom: "conv2" top: "conv2" }
layer { name: "pool2" type: "Pooling" bottom: "conv2" top: "pool2" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool2" top: "fc" inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
"""


def test_auto_offers_the_span_behind_each_front_and_a_training_run_times_it(tmp_path, monkeypatch):
    """--microbatch auto plans each front alone and with the span through the next pool behind
    it; a training run's profiling run times the `none` program of each of those settings."""
    from minigist import optimize_cli
    from minigist.optimize import layouts
    from minigist.passes.microbatch import front_candidates
    from test_microbatch import recorded_profiles
    path = tmp_path / "two_pools.prototxt"
    path.write_text(TWO_POOLS)
    options = Options(batch_size=4, update="fused", conv="im2col")
    program = compile(str(path), options).program
    fronts = front_candidates(program)
    # conv2's chunks hold two samples: the span through pool2 runs two at a time
    assert fronts == [("pool1", 1), ("pool2", 2)]
    assert layouts(program, fronts) == [(("pool1", 1), ()), (("pool2", 2), ()),
                                        (("pool1", 1), (("pool1", "pool2", 2),))]
    profiled = recorded_profiles(monkeypatch)
    rng = np.random.default_rng(0)
    batch = (rng.standard_normal((4, 3, 224, 224)).astype(np.float32), rng.integers(0, 3, 4))
    optimize_cli.profiled_model(str(path), options, batch, lossy=False, threads=1, out=lambda line: None,
                                fronts=fronts)
    spanned = [p for p in profiled if any(s.layer is not None and s.layer.name == "conv2" and "samples" in s.args
                                          and s.kind == "forward" for s in p.steps)
               and not any(s.kind == "recompute" and s.layer.name == "conv2" for s in p.steps)]
    assert len(spanned) == 1      # the span's none program: conv2 two samples at a time, not replayed


@pytest.mark.parametrize("flags, message", [
    (["--microbatch-span", "pool1:pool2"], "argument --microbatch-span: expected START:THROUGH:SAMPLES"),
    (["--microbatch-span", "pool1:fc:2", "--conv", "im2col"], "--microbatch-span: 'fc' is no top of this net"),
    (["--microbatch-span", "pool2:pool3:1", "--microbatch", "auto", "--optimize"],
     "--microbatch-span: --microbatch auto chooses the spans with the front; give one or the other"),
])
def test_the_command_line_refuses_a_bad_span_in_one_line(flags, message):
    import os
    import subprocess
    import sys
    root = os.path.join(os.path.dirname(__file__), "..")
    done = subprocess.run([sys.executable, os.path.join(root, "train.py"), "--model", "vgg16", "--batch-size", "8",
                           "--plan-only"] + flags, capture_output=True, text=True, cwd=root)
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) <= 2, done.stderr


def test_the_command_lines_span_is_the_libraries(tmp_path):
    import train as cli
    report_path = tmp_path / "r.json"
    flags = ["--model", "vgg16", "--batch-size", "8", "--conv", "im2col", "--plan-only", "--gist", "lossless",
             "--densities", "none", "--microbatch", "pool1:1", "--microbatch-span", "pool1:pool2:1,pool2:pool3:1"]
    assert cli.main(flags + ["--report-json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    with_spans = compile(model("vgg16"), Options(batch_size=8, conv="im2col", gist="lossless", update="fused",
                                                 microbatch=("pool1", 1),
                                                 spans=(("pool1", "pool2", 1), ("pool2", "pool3", 1))))
    assert report["footprint_bytes"] == with_spans.plan.footprint_bytes


def test_a_front_feeds_each_micro_batch_its_rows_of_the_net_input_and_never_holds_it_whole(tmp_path):
    """Behind a micro-batched front the net's input is fed a micro-batch at a time, into a
    buffer of that micro-batch's rows, and fed again where the backward replays the front: no
    whole input in the arena, nothing of it stashed (so an fp16 override of it has nothing to
    encode), and the same bits as the whole front."""
    path = tmp_path / "two_pools.prototxt"
    path.write_text(TWO_POOLS)
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((8, 3, 224, 224)).astype(np.float32), rng.integers(0, 3, 8)) for _ in range(2)]
    options = Options(batch_size=8, update="fused", chunk_bytes=1, gist="lossless")

    def run(options):
        net = minigist.Net(str(path), seed=1, plan=Settings(options), solver=minigist.SGD(lr=0.01, momentum=0.9))
        return net, [net.train_step(*batch) for batch in data]
    whole, expected = run(options)
    net, losses = run(options.replace(microbatch=("pool1", 2)))
    assert losses == expected
    _, lossy = run(options.replace(microbatch=("pool1", 2), overrides={"data": "fp16"}))
    assert lossy == expected
    program = net.programs["train"]
    assert "blob:data" in whole.programs["train"].buffers and "blob:data" not in program.buffers
    feeds = [(s.kind, s.args["samples"], program.buffers[s.args["y"][0]].shape)
             for s in program.steps if type(s.op).__name__ == "Feed"]
    assert feeds == ([("forward", (k, k + 2), (2, 3, 224, 224)) for k in range(0, 8, 2)]
                     + [("recompute", (k, k + 2), (2, 3, 224, 224)) for k in range(0, 8, 2)])
    assert not any(s.kind in ("encode", "decode") and s.note == "data" for s in program.steps)
    for step_index, step in enumerate(program.steps):
        if type(step.op).__name__ == "Feed":
            fed = program.buffers[step.args["y"][0]]
            readers = [i for i, s in enumerate(program.steps) if fed.name in names_in(s.args.get("x"))]
            assert (fed.first_use, fed.last_use) == (step_index, max(readers))
    # at the peak: the whole batch of images; with the front at most one micro-batch's rows
    # and the labels (256 bytes aligned)
    assert whole.report()["peak_by_category"]["input"] == 8 * 3 * 224 * 224 * 4
    assert net.report()["peak_by_category"]["input"] <= 2 * 3 * 224 * 224 * 4 + 256
