"""Recomputation (passes/recompute.py): dropped stashes rebuilt by replaying forward steps train
bit for bit like kept ones, alone and with lossless Gist, under static and dynamic allocation;
BatchNorm's running sums are updated once and Dropout's mask is reused; the plan shrinks by
what is no longer kept; and the errors name the tensor."""
import functools

import numpy as np
import pytest

import minigist
from minigist import onednn
from minigist.errors import MinigistError
from minigist.layers.activation import ReLU
from minigist.memory import align
from minigist.memory.report import live_by_step
from minigist.passes.recompute import apply_recompute
from minigist.pipeline import Options, compile, plan_report
from minigist.testing import LayerRun, make_layer
from test_gist import SMALL_MODELS, batches, model


DROPOUT_NET = """
layer { name: "data" type: "Input" top: "data" top: "label" input_param { shape { dim: 4 dim: 6 } shape { dim: 4 } } }
layer { name: "fc1" type: "InnerProduct" bottom: "data" top: "fc1" inner_product_param { num_output: 8 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "fc1" top: "fc1" }
layer { name: "drop1" type: "Dropout" bottom: "fc1" top: "fc1" }
layer { name: "fc2" type: "InnerProduct" bottom: "fc1" top: "fc2" inner_product_param { num_output: 8 weight_filler { type: "xavier" } } }
layer { name: "drop2" type: "Dropout" bottom: "fc2" top: "fc2" dropout_param { dropout_ratio: 0.3 } }
layer { name: "fc3" type: "InnerProduct" bottom: "fc2" top: "fc3" inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc3" bottom: "label" top: "loss" }
"""


@functools.lru_cache(maxsize=None)
def stashed_blobs(path, batch_size=4):
    """The stashed tops of the training program, in forward order (a tuple; compiled once per
    model and batch)."""
    program = compile(path, Options(batch_size=batch_size)).program
    return tuple(b.tensor for b in program.buffers.values() if b.kind == "blob" and b.category == "stash")


def train(path, data, alloc="static", gist="none", recompute=(), batch_size=4, update="separate", conv="im2col",
          shared=()):
    net = minigist.Net(path, batch_size=batch_size, seed=1, gist=gist, alloc=alloc, recompute=recompute,
                       recompute_shared=shared, update=update, conv=conv,
                       solver=minigist.SGD(lr=0.01, momentum=0.9, weight_decay=5e-4))
    if gist != "none":
        net.calibrate(data[:2])
    losses = [net.train_step(*batch) for batch in data]
    return net, losses


def assert_same_training(reference, expected, net, losses):
    assert losses == expected
    for key, value in reference.params().items():    # BatchNorm's running sums among them
        np.testing.assert_array_equal(net.params()[key], value, err_msg=key)
    state = net.state()
    for key, value in reference.state().items():
        np.testing.assert_array_equal(state[key], value, err_msg=key)


_references = {}


def reference(name, alloc, steps):
    key = (name, alloc, steps)
    if key not in _references:
        _references[key] = train(model(name), batches(steps), alloc)
    return _references[key]


def recompute_steps(net):
    return [step for step in net.programs["train"].steps if step.kind == "recompute"]


# ---- the layers' facts --------------------------------------------------------------------
def replay(run, layer, saved):
    """The replay of `run`'s last forward into fresh tops (the saved tensors as given)."""
    tops = [np.full(shape, np.nan, layer.dtype) for shape in layer.top_shapes]
    ws = {name: np.full(d.shape, np.nan, d.dtype or layer.dtype) for name, d in layer.replay_workspace().items()}
    layer.replay_forward(np, run.bottoms, tops, run.params, saved, ws)
    return tops


@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (7, 4)])
def test_batchnorm_replays_without_touching_its_running_sums(shape):
    layer = make_layer('name: "bn" type: "BatchNorm" bottom: "x" top: "y"', [shape], np.float32)
    assert layer.forward_updates_state and not layer.forward_draws_random and layer.recomputable
    run = LayerRun(layer)
    y = run.forward([np.random.default_rng(0).standard_normal(shape).astype(np.float32)])[0].copy()
    sums = [p.copy() for p in run.params]
    scratch = {"inv_std": np.full(layer.saved["inv_std"].shape, np.nan, np.float32)}
    np.testing.assert_array_equal(replay(run, layer, scratch)[0], y)
    np.testing.assert_array_equal(scratch["inv_std"], run.saved["inv_std"])
    for before, after in zip(sums, run.params):
        np.testing.assert_array_equal(after, before)
    assert float(run.params[2][0]) == 1.0      # the forward updated them, once


def test_batchnorm_with_global_stats_declares_no_state_effect():
    layer = make_layer('name: "bn" type: "BatchNorm" bottom: "x" top: "y" batch_norm_param { use_global_stats: true }',
                       [(2, 3)], np.float32)
    assert not layer.forward_updates_state


def test_dropout_replays_the_mask_it_saved():
    layer = make_layer('name: "drop" type: "Dropout" bottom: "x" top: "y"', [(6, 50)], np.float32)
    assert layer.forward_draws_random and not layer.forward_updates_state
    assert layer.replay_workspace() == {}       # nothing to draw into
    run = LayerRun(layer)
    y = run.forward([np.random.default_rng(0).standard_normal((6, 50)).astype(np.float32)])[0].copy()
    state = layer.rng.bit_generator.state
    np.testing.assert_array_equal(replay(run, layer, run.saved)[0], y)
    assert layer.rng.bit_generator.state == state
    test_layer = make_layer('name: "drop" type: "Dropout" bottom: "x" top: "y"', [(6, 50)], np.float32, "TEST")
    assert not test_layer.forward_draws_random


def test_data_and_loss_layers_cannot_be_replayed():
    data = make_layer('name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } }', [])
    loss = make_layer('name: "loss" type: "SoftmaxWithLoss" bottom: "x" bottom: "label" top: "loss"', [(2, 3), (2,)])
    relu = make_layer('name: "relu" type: "ReLU" bottom: "x" top: "x"', [(2, 3)])
    assert not data.recomputable and not loss.recomputable and relu.recomputable


# ---- training ------------------------------------------------------------------------------
def test_resnet20_recomputing_some_stashes_trains_bit_identically():
    """A quick one: every third stash of resnet20 dropped (BatchNorm replays among them)."""
    tensors = stashed_blobs(model("resnet20"))[::3]
    expected_net, expected = reference("resnet20", "static", 2)
    net, losses = train(model("resnet20"), batches(2), recompute=tensors)
    assert any(step.layer.type == "BatchNorm" for step in recompute_steps(net))
    assert_same_training(expected_net, expected, net, losses)


@pytest.mark.skipif(not onednn.available(), reason="oneDNN is not available")
def test_onednn_replays_train_bit_identically():
    """oneDNN's convolutions replayed with their own scratchpads give the same bits."""
    tensors = stashed_blobs(model("resnet20"))[::2]
    expected_net, expected = train(model("resnet20"), batches(2), conv="onednn")
    net, losses = train(model("resnet20"), batches(2), recompute=tensors, conv="onednn")
    assert any(step.layer.type == "Convolution" for step in recompute_steps(net))
    assert_same_training(expected_net, expected, net, losses)


def test_fused_updates_follow_the_replays():
    """With update="fused" each layer's weights change right after its backward step: every
    replay of a layer runs before that step, so it sees the iteration's weights."""
    tensors = stashed_blobs(model("resnet20"))[1::3]
    expected_net, expected = train(model("resnet20"), batches(2), update="fused")
    net, losses = train(model("resnet20"), batches(2), recompute=tensors, update="fused")
    assert recompute_steps(net)
    assert_same_training(expected_net, expected, net, losses)


@pytest.mark.slow
@pytest.mark.parametrize("name", SMALL_MODELS)
@pytest.mark.parametrize("alloc", ["static", "dynamic"])
@pytest.mark.parametrize("gist", ["none", "lossless"])
@pytest.mark.parametrize("which", ["every other", "all"])
def test_recomputation_is_bit_identical(name, alloc, gist, which):
    """Every other stash dropped (replays read kept stashes and rebuild unkept maps on the way),
    or all of them (every chain replayed from the net's input, each copy rebuilt once)."""
    tensors = stashed_blobs(model(name))
    tensors = tensors[::2] if which == "every other" else tensors
    # two steps, as the quick tests above: the second replays with the first's updated weights,
    # running sums and momentum
    expected_net, expected = reference(name, alloc, 2)
    net, losses = train(model(name), batches(2), alloc, gist, tensors)
    assert recompute_steps(net)
    assert_same_training(expected_net, expected, net, losses)
    rows = {row["tensor"]: row for row in net.report()["stash"]}
    for tensor in tensors:
        assert rows[tensor]["encoding"] == "recomputed" and rows[tensor]["stored_bytes"] == 0
    if gist == "lossless" and which == "every other":
        # the stashes replays start from are encoded too, with codes that hold their values,
        # and the replays read decoded copies
        program = net.programs["train"]
        decoded = {name for step in recompute_steps(net) for name in step.buffer_names() if name.startswith("dec:")}
        assert decoded
        by_tensor = {program.buffers[name].tensor: encoding.name for name, encoding in program.encodings.items()}
        assert {by_tensor[program.buffers[name].tensor] for name in decoded} == {"ssdc"}
        for step in recompute_steps(net):
            for name in step.buffer_names(("x",)):
                assert name not in program.encodings, f"{step.label} reads the encoded {name}"


def replays_per_layer(net):
    counts = {}
    for step in recompute_steps(net):
        counts[step.layer.name] = counts.get(step.layer.name, 0) + 1
    return counts


def test_shared_recomputation_trains_bit_identically_and_replays_each_step_once():
    """A quick one: every other stash of resnet20 dropped and shared."""
    tensors = stashed_blobs(model("resnet20"))[::2]
    expected_net, expected = reference("resnet20", "static", 2)
    net, losses = train(model("resnet20"), batches(2), recompute=tensors, shared=tensors)
    assert_same_training(expected_net, expected, net, losses)
    assert recompute_steps(net) and max(replays_per_layer(net).values()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", SMALL_MODELS)
@pytest.mark.parametrize("alloc", ["static", "dynamic"])
@pytest.mark.parametrize("gist", ["none", "lossless"])
@pytest.mark.parametrize("which", ["every other", "all"])
def test_shared_recomputation_is_bit_identical(name, alloc, gist, which):
    """Shared: a segment that rebuilds a dropped source keeps its copy for the source's own
    backward readers, so no forward step is replayed twice in a step."""
    tensors = stashed_blobs(model(name))
    tensors = tensors[::2] if which == "every other" else tensors
    expected_net, expected = reference(name, alloc, 2)
    net, losses = train(model(name), batches(2), alloc, gist, tensors, shared=tensors)
    assert_same_training(expected_net, expected, net, losses)
    assert recompute_steps(net) and max(replays_per_layer(net).values()) == 1


def test_shared_and_private_footprints():
    """ResNet-20 at batch 32, static (docs/memory.md): dropping tensors privately keeps the
    least and replays the most; shared, each dropped tensor's chain runs once, and with every
    stash dropped all are rebuilt together at the start of the backward pass, as many bytes as
    keeping them."""
    path = model("resnet20")
    tensors = stashed_blobs(path, 32)
    assert len(tensors) == 41
    found = {}
    for which, chosen in (("every other", tensors[::2]), ("all", tensors)):
        for kind, shared in (("private", ()), ("shared", chosen)):
            compiled = compile(path, Options(batch_size=32, recompute=chosen, recompute_shared=shared))
            replays = sum(step.kind == "recompute" for step in compiled.program.steps)
            found[which, kind] = (compiled.plan.footprint_bytes, replays)
    assert compile(path, Options(batch_size=32)).plan.footprint_bytes == 61_764_096
    assert found == {("every other", "private"): (38_833_920, 74), ("every other", "shared"): (41_979_648, 45),
                     ("all", "private"): (21_803_520, 1821), ("all", "shared"): (61_764_096, 92)}


def test_shared_tensors_must_be_recomputed():
    for recompute in (["res1a@res1a_relu"], []):
        with pytest.raises(MinigistError, match=r"recompute_shared: 'conv1@conv1/relu' is not among the "
                                                r"recomputed tensors \(recompute\)$"):
            compile(model("resnet20"), Options(batch_size=4, recompute=recompute,
                                               recompute_shared=["conv1@conv1/relu"]))


def test_replays_decode_their_sources_into_copies_of_their_own():
    """Lossless, every other stash of inception_small dropped: a stash that replays read is kept
    encoded, and each run of replays decodes it into a copy that dies with the run, so the
    decoded copy of its own backward readers is not made until they come."""
    path = model("inception_small")
    tensors = stashed_blobs(path, 8)[::2]
    program = compile(path, Options(batch_size=8, gist="lossless", densities={t: 0.5 for t in stashed_blobs(path, 8)},
                                    recompute=tensors)).program
    own = [b for b in program.buffers.values() if b.kind == "dec" and b.part]
    assert own
    for buffer in own:
        run = program.steps[buffer.first_use:buffer.last_use + 1]
        assert run[0].kind == "decode" and all(step.kind in ("decode", "recompute") for step in run), buffer.name
        assert program.steps[buffer.last_use].kind == "recompute"
    for name, encoding in program.encodings.items():
        decoded = program.buffers.get(encoding.decoded) if encoding.decoded else None
        if decoded is not None:     # made right before its first backward reader (or that reader's replays)
            after = program.steps[decoded.first_use + 1:]
            first = next(step for step in after if step.kind not in ("decode", "recompute"))
            assert first.kind == "backward" and encoding.decoded in first.buffer_names(), name


@pytest.mark.parametrize("name,alloc,shared", [("resnet20", "static", False), ("resnet20", "dynamic", True),
                                               ("vgg_small", "static", True)])
def test_replayed_convolutions_read_their_coded_sources_a_slice_at_a_time(name, alloc, shared, monkeypatch):
    """Lossless, every other stash dropped, one sample per convolution chunk: a replayed
    convolution whose source is SSDC-coded reads it a decoded slice at a time (StreamedReplay)
    into a one-sample buffer of its run, which no decode step writes; training stays bit for bit
    that of none at the same chunks."""
    from minigist.layers.conv import Convolution
    from minigist.passes.gist_steps import StreamedReplay
    monkeypatch.setattr(Convolution, "chunk_bytes", 1)
    monkeypatch.setattr(minigist.passes.gist, "STREAM_MIN_BYTES", 0)
    tensors = stashed_blobs(model(name))[::2]
    expected_net, expected = train(model(name), batches(2), alloc)
    net, losses = train(model(name), batches(2), alloc, "lossless", tensors, shared=tensors if shared else ())
    assert_same_training(expected_net, expected, net, losses)
    program = net.programs["train"]
    streamed = [step for step in program.steps if isinstance(step.op, StreamedReplay)]
    assert streamed
    decoded = {step.args["out"] for step in program.steps if step.kind == "decode"}
    for step in streamed:
        source = program.buffers[step.args["x"][0]]
        assert isinstance(step.layer, Convolution) and source.kind == "dec" and source.part, step.label
        assert source.shape[0] == 1 and source.name not in decoded, step.label


@pytest.mark.parametrize("alloc", ["static", "dynamic"])
@pytest.mark.parametrize("gist", ["none", "lossless"])
def test_dropout_replays_its_mask(tmp_path, alloc, gist):
    """Both Dropout outputs rebuilt (one from a kept ReLU output, one through an unkept map):
    the same losses and weights, and the net's random stream is where it would be (the replays
    drew nothing)."""
    path = tmp_path / "dropout.prototxt"
    path.write_text(DROPOUT_NET)
    rng = np.random.default_rng(3)
    data = [(rng.standard_normal((4, 6)).astype(np.float32), rng.integers(0, 3, 4)) for _ in range(4)]
    expected_net, expected = train(str(path), data, alloc, gist)
    tensors = ["fc1@drop1", "fc2@drop2"]
    net, losses = train(str(path), data, alloc, gist, tensors)
    replayed = {step.layer.name for step in recompute_steps(net)}
    assert {"drop1", "drop2", "fc2"} <= replayed
    assert_same_training(expected_net, expected, net, losses)
    assert net.rng.random() == expected_net.rng.random()


def test_batchnorm_replay_leaves_running_sums_alone():
    """The running sums of resnet20's BatchNorm layers after two steps with every other stash
    rebuilt equal those of a run without recomputation (updated once per step, not twice)."""
    expected_net, _ = reference("resnet20", "static", 2)
    net, _ = train(model("resnet20"), batches(2), recompute=stashed_blobs(model("resnet20"))[::2])
    replayed = {step.layer.name for step in recompute_steps(net) if step.layer.type == "BatchNorm"}
    assert replayed
    for layer in replayed:
        for part in ("mean", "variance", "scale_factor"):
            key = f"{layer}.{part}"
            np.testing.assert_array_equal(net.params()[key], expected_net.params()[key], err_msg=key)
    assert net.params()[f"{sorted(replayed)[0]}.scale_factor"][0] > 1.0    # updated, but once a step


def test_dropping_the_first_stash_saves_its_bytes_at_the_peak():
    """vgg_small at batch 32: the first ReLU's output is read in the backward pass only at its
    very end, so at the live peak (early in the backward pass) it is no longer live and nothing
    rebuilt is live yet: the bytes live there drop by exactly its aligned size, and so do the
    live peak and the static footprint (whose plan reaches the live peak)."""
    path = model("vgg_small")
    tensor = stashed_blobs(path, 32)[0]
    plain = compile(path, Options(batch_size=32))
    dropped = compile(path, Options(batch_size=32, recompute=[tensor]))
    live_plain, live_dropped = live_by_step(plain.plan), live_by_step(dropped.plan)
    peak = int(np.argmax(live_plain))
    assert plain.program.steps[peak].kind == "backward"
    assert dropped.program.steps[peak].label == plain.program.steps[peak].label    # replays come later
    saving = align(plain.program.buffers[f"blob:{tensor}"].nbytes, plain.plan.alignment)
    assert saving == 32 * 64 * 32 * 32 * 4
    assert int(live_plain[peak]) - int(live_dropped[peak]) == saving
    assert plain.plan.live_peak_bytes - dropped.plan.live_peak_bytes == saving
    assert plain.plan.footprint_bytes == plain.plan.live_peak_bytes
    assert plain.plan.footprint_bytes - dropped.plan.footprint_bytes == saving
    report = plan_report(path, Options(batch_size=32, recompute=[tensor]))
    row = next(row for row in report["stash"] if row["tensor"] == tensor)
    assert row["encoding"] == "recomputed" and row["stored_bytes"] == 0


def test_maps_rebuilt_on_the_way_are_freed_with_their_segment():
    """resnet20 at batch 8, dynamic: only each dropped tensor's own copy outlives its segment (the maps
    rebuilt on the way are read by replays alone), so dropping every stash keeps less than
    dropping every other one, which keeps less than dropping none."""
    path = model("resnet20")
    tensors = stashed_blobs(path, 8)
    plans = {which: compile(path, Options(batch_size=8, alloc="dynamic", recompute=chosen))
             for which, chosen in (("none", []), ("every other", tensors[::2]), ("all", tensors))}
    program = plans["all"].program
    private = [b for b in program.buffers.values() if b.kind == "rec" and b.part]
    assert private
    for buffer in private:
        assert program.steps[buffer.last_use].kind == "recompute", buffer.name
    footprint = {which: compiled.plan.footprint_bytes for which, compiled in plans.items()}
    assert footprint["all"] < footprint["every other"] < footprint["none"]


def test_plan_footprint_and_the_net_report_agree():
    """plan_footprint(recompute=...) plans what a Net with the same tensors allocates."""
    tensors = stashed_blobs(model("resnet20"))[::2]
    planned = minigist.plan_footprint(model("resnet20"), batch_size=4, recompute=tensors)
    net = minigist.Net(model("resnet20"), batch_size=4, recompute=tensors)
    assert net.report()["footprint_bytes"] == planned["footprint_bytes"]
    assert planned["footprint_bytes"] < minigist.plan_footprint(model("resnet20"), batch_size=4)["footprint_bytes"]
    assert planned["stash_by_encoding"]["recomputed"] == 0


def test_no_recomputation_leaves_the_program_alone():
    program = compile(model("vgg_small"), Options(batch_size=4)).program
    assert apply_recompute(program, ()) is program
    assert not any(step.kind == "recompute" for step in program.steps)


@pytest.mark.parametrize("tensor,message", [
    ("nonesuch", r"recompute: 'nonesuch' is no top of this net$"),
    ("res1a", r"recompute: 'res1a' is not stashed \(no backward step reads it\); stashed under that name: "
              r"res1a@res1a_relu$"),
    ("conv1.weight", r"recompute: 'conv1.weight' is no top of this net$"),
    ("conv1", r"recompute: 'conv1' is not stashed \(no backward step reads it\); stashed under that name: "
              r"conv1@conv1/bn, conv1@conv1/relu$"),
    ("data", r"recompute: 'data' is the net's input; it cannot be recomputed$"),
    ("res1a_branch2a/bn.inv_std",
     r"recompute: 'res1a_branch2a/bn.inv_std' is a layer's saved tensor; only tops can be recomputed$"),
])
def test_errors_name_the_tensor(tensor, message):
    with pytest.raises(MinigistError, match=message):
        compile(model("resnet20"), Options(batch_size=4, recompute=[tensor]))


def test_a_layer_that_cannot_be_replayed_is_refused(monkeypatch):
    monkeypatch.setattr(ReLU, "recomputable", False)
    with pytest.raises(MinigistError, match=r"recompute: 'conv1@conv1/relu' cannot be recomputed: it needs a replay "
                                            r"of 'conv1/relu' \(ReLU\), which cannot be replayed$"):
        compile(model("resnet20"), Options(batch_size=4, recompute=["conv1@conv1/relu"]))


@pytest.mark.parametrize("value", ["conv1@conv1/relu", 5, [5]])
@pytest.mark.parametrize("field", ["recompute", "recompute_shared"])
def test_one_name_is_not_a_list(field, value):
    with pytest.raises(MinigistError, match=f"^{field}: expected a list of tensor names"):
        Options(**{field: value})


def test_a_replay_writes_its_output_over_its_input_where_the_forward_step_does():
    """ResNet-20 with every stash dropped privately: each replay of a layer that allows it
    (layer.inplace_safe) whose input no later step reads writes over that input, as the forward
    pass does, so a segment holds one map per in-place run, not one per replay (the footprint
    above: 21,803,520 bytes, where a copy per replay took 23,900,672)."""
    path = model("resnet20")
    program = compile(path, Options(batch_size=32, recompute=stashed_blobs(path, 32))).program
    replays = [step for step in program.steps if step.kind == "recompute"]
    in_place = {(x, y) for x, y in program.inplace if program.buffers[x].kind == "rec"}
    over_input = [step for step in replays if (step.args["x"][0], step.args["y"][0]) in in_place]
    assert {step.layer.type for step in over_input} == {"Convolution", "BatchNorm", "Scale", "ReLU", "Eltwise"}
    assert len(replays) == 1821 and len(in_place) == len(over_input) == 1579
    for step in over_input:
        assert program.buffers[step.args["x"][0]].nbytes == program.buffers[step.args["y"][0]].nbytes
