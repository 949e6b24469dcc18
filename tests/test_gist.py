"""Gist's schedule builder: encodings chosen, lifetimes shortened, lossless training
bit-identical to no encoding, the SSDC fallback, overrides and registered codecs."""
import os

import numpy as np
import pytest

import minigist
from minigist.memory import align
from minigist.codecs import register_codec, unregister_codec
from minigist.codecs.dpr import DPR
from minigist.errors import MinigistError
from minigist.passes.gist import apply_gist
from minigist.passes.gist_steps import StreamedBackward, WriteCodes
from minigist.codecs import GistConfig

MODELS_DIR = os.path.join(os.path.dirname(__file__), "..", "models")
SMALL_MODELS = ["vgg_small", "resnet20", "inception_small"]


def model(name):
    return os.path.join(MODELS_DIR, name + ".prototxt")


def batches(count, batch_size=4, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((batch_size, 3, 32, 32)).astype(np.float32),
             rng.integers(0, 10, batch_size)) for _ in range(count)]


def train(name, gist, alloc, steps=5, **kwargs):
    net = minigist.Net(model(name), batch_size=4, seed=1, gist=gist, alloc=alloc,
                       solver=minigist.SGD(lr=0.01, momentum=0.9, weight_decay=5e-4), **kwargs)
    data = batches(steps)
    if gist != "none":
        net.calibrate(data[:2])
    losses = [net.train_step(*batch) for batch in data]
    return net, losses


@pytest.mark.slow
@pytest.mark.parametrize("name", SMALL_MODELS)
@pytest.mark.parametrize("alloc", ["static", "dynamic"])
def test_lossless_training_is_bit_identical(name, alloc):
    reference, expected = train(name, "none", alloc)
    net, losses = train(name, "lossless", alloc)
    assert losses == expected
    for key, value in reference.params().items():
        np.testing.assert_array_equal(net.params()[key], value, err_msg=key)
    encodings = {row["encoding"] for row in net.report()["stash"]}
    assert encodings & {"relu-pool-4bit", "mask-1bit", "ssdc", "index-4bit"}


@pytest.mark.slow
@pytest.mark.parametrize("name", SMALL_MODELS)
@pytest.mark.parametrize("alloc", ["static", "dynamic"])
@pytest.mark.parametrize("gist", ["lossless", "all"])
def test_streamed_stashes_train_like_whole_ones(name, alloc, gist, monkeypatch):
    """Every stash streamed (decoded a chunk at a time by each reader, as the big nets' are):
    lossless stays bit-identical to none; all (lossy) gives the same bits as decoding whole."""
    from minigist.layers.conv import Convolution
    from minigist.layers.normalization import LRN, BatchNorm, Scale
    for layer_class in (Convolution, LRN, BatchNorm, Scale):    # chunks of 1 sample of 4
        monkeypatch.setattr(layer_class, "chunk_bytes", 1)
    whole, whole_losses = train(name, gist if gist == "all" else "none", alloc)
    monkeypatch.setattr(minigist.passes.gist, "STREAM_MIN_BYTES", 0)
    net, losses = train(name, gist, alloc)
    streamed = [s for s in net.programs["train"].steps if isinstance(s.op, StreamedBackward)]
    assert streamed
    assert losses == whole_losses
    for key, value in whole.params().items():
        np.testing.assert_array_equal(net.params()[key], value, err_msg=key)


@pytest.mark.parametrize("gist", ["none", "all"])
def test_relu_masks_a_sample_at_a_time_train_like_whole_ones(gist, monkeypatch):
    """ReLU's backward mask one sample at a time, the ufunc path, and (under all) a ReLU whose
    SSDC-coded top its backward reads a slice at a time, handed a mask of fewer rows than the
    slice: the same losses and weights as the whole batch's mask."""
    from minigist import jit
    from minigist.layers.activation import ReLU
    monkeypatch.setattr(minigist.passes.gist, "STREAM_MIN_BYTES", 0)
    with jit.use_kernels(False):
        whole, whole_losses = train("vgg_small", gist, "static", steps=3)
        monkeypatch.setattr(ReLU, "chunk_bytes", 1)
        net, losses = train("vgg_small", gist, "static", steps=3)
    steps = net.programs["train"].steps
    buffers = net.programs["train"].buffers
    relus = [s for s in steps if s.kind == "backward" and isinstance(s.layer, ReLU) and "mask" in s.args["ws"]]
    assert relus and all(buffers[s.args["ws"]["mask"]].shape[0] == 1 for s in relus)
    if gist == "all":
        assert any(isinstance(s.op, StreamedBackward) for s in relus)
    assert losses == whole_losses
    for key, value in whole.params().items():
        np.testing.assert_array_equal(net.params()[key], value, err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "ufuncs"])
@pytest.mark.parametrize("alloc", ["static", "dynamic"])
@pytest.mark.parametrize("name,gist", [("resnet20", "lossy"), ("resnet20", "all"), ("inception_small", "all")])
def test_fp16_stashes_read_as_they_are_train_like_decoded_ones(name, gist, alloc, kernels, monkeypatch):
    """BatchNorm's x_hat (read by its own backward and Scale's) is kept as DPR fp16 codes,
    written by BatchNorm's forward, that both backward steps read as float16, with no encode
    or decode step: the same bits as encoding and decoding it to float32."""
    from minigist import jit
    with jit.use_kernels(kernels):
        net, losses = train(name, gist, alloc, steps=3)
        program = net.programs["train"]
        direct = [e for e in program.encodings.values() if type(e.codec).__name__ == "HalfStash"]
        assert direct and all(e.name == "fp16" and e.decoded == "" for e in direct)
        decoded = {name for s in program.steps if s.kind == "decode" for name in s.args["enc"].values()}
        readers = [s for s in program.steps if s.kind == "backward" and s.layer.type in ("BatchNorm", "Scale")]
        for encoding in direct:
            codes = encoding.encoded[0]
            assert codes not in decoded and program.buffers[codes].dtype == np.float16
            assert any(codes in s.args["x"] + s.args["y"] for s in readers)
        # BatchNorm's slices are encoded as it emits them (emits_top_slices): no encode step
        # reads x_hat again
        written = {s.args["enc"]["codes"] for s in program.steps if s.kind == "forward" and isinstance(s.op, WriteCodes)}
        assert written == {e.encoded[0] for e in direct}
        assert not [s for s in program.steps if s.kind == "encode" and type(s.op.codec).__name__ == "HalfStash"]
        # stashes read by other layers are still decoded (the input, read by conv1's backward)
        assert any(s.note == "data" for s in program.steps if s.kind == "decode")
        monkeypatch.setattr(minigist.passes.gist._Builder, "read_as_half", lambda self, name, codec: False)
        reference, expected = train(name, gist, alloc, steps=3)
    assert not [e for e in reference.programs["train"].encodings.values() if type(e.codec).__name__ == "HalfStash"]
    assert losses == expected
    for key, value in reference.params().items():
        np.testing.assert_array_equal(net.params()[key], value, err_msg=key)


def test_paper_binarize_form_is_bit_identical_too():
    reference, expected = train("vgg_small", "none", "static")
    net, losses = train("vgg_small", "lossless", "static", binarize="paper")
    assert losses == expected
    encodings = {row["encoding"] for row in net.report()["stash"]}
    assert {"mask-1bit", "index-4bit"} <= encodings and "relu-pool-4bit" not in encodings


def stash_table(net):
    return {row["tensor"]: row for row in net.report()["stash"]}


def test_encodings_and_shortened_lifetimes_on_vgg_small():
    net = minigist.Net(model("vgg_small"), batch_size=4, gist="lossless")
    net.calibrate(batches(2))
    table = stash_table(net)
    # ReLU -> MaxPool: the ReLU output is not kept; the pool keeps one 4-bit code per output
    assert table["conv1_2@relu1_2"]["encoding"] == "dropped"
    pool = table["pool1.argmax"]
    assert pool["encoding"] == "relu-pool-4bit"
    assert pool["stored_bytes"] == 4 * 64 * 16 * 16 // 2      # 4 bits per pool output
    # ReLU -> Conv: SSDC, sized from the measured density
    relu = table["conv1_1@relu1_1"]
    assert relu["encoding"] == "ssdc" and relu["stored_bytes"] < relu["raw_bytes"]
    program = net.programs["train"]
    kinds = [step.kind for step in program.steps]
    first_backward = kinds.index("seed")
    for step_index, step in enumerate(program.steps):
        if step.kind == "encode":
            assert step_index < first_backward
        if step.kind == "decode":
            assert step_index > first_backward
    # the FP32 ReLU output now dies in the forward pass
    assert program.buffers["blob:conv1_1@relu1_1"].last_use < first_backward


@pytest.mark.slow
def test_gist_shrinks_the_static_footprint():
    sizes = {}
    for gist in ("none", "lossless", "lossy", "all"):
        net = minigist.Net(model("vgg_small"), batch_size=16, gist=gist)
        if gist != "none":
            net.calibrate(batches(2, batch_size=16))
        sizes[gist] = net.report()["footprint_bytes"]
    assert sizes["all"] < sizes["lossless"] < sizes["none"]
    assert sizes["lossy"] < sizes["none"]


def test_ssdc_fallback_keeps_results_exact():
    """Plan SSDC for 1% density: every batch overflows; the fallback keeps training exact."""
    reference, expected = train("resnet20", "none", "static", steps=2)
    net = minigist.Net(model("resnet20"), batch_size=4, seed=1, gist="lossless",
                       solver=minigist.SGD(lr=0.01, momentum=0.9, weight_decay=5e-4))
    densities = net.calibrate(batches(1))
    net.set_densities({name: 0.01 for name in densities})
    losses = [net.train_step(*batch) for batch in batches(2)]
    assert losses == expected
    report = net.report()
    assert report["gist"]["ssdc_fallbacks"] > 0 and report["gist"]["ssdc_fallback_bytes"] > 0


def test_ssdc_is_skipped_where_it_does_not_pay():
    graph = minigist.build_graph(model("vgg_small"), batch_size=2)
    program = minigist.build_program(graph)
    dense = apply_gist(program, GistConfig("lossless", ssdc_density={"conv1_1@relu1_1": 0.99}))
    assert "blob:conv1_1@relu1_1" not in dense.encodings
    sparse = apply_gist(program, GistConfig("lossless", ssdc_density={"conv1_1@relu1_1": 0.3}))
    assert sparse.encodings["blob:conv1_1@relu1_1"].name == "ssdc"


def test_lossy_modes_use_the_chosen_format():
    for fmt in ("fp16", "fp10", "fp8-e4m3", "fp8-e5m2"):
        net = minigist.Net(model("resnet20"), batch_size=2, gist="lossy", dpr=fmt)
        encodings = {row["encoding"] for row in net.report()["stash"]}
        assert fmt in encodings
        loss = net.train_step(*batches(1, batch_size=2)[0])
        assert np.isfinite(loss)


def test_overrides_by_layer_and_tensor():
    net = minigist.Net(model("vgg_small"), batch_size=2, gist="lossless",
                       gist_overrides={"conv1_1@relu1_1": "fp16", "pool2": "fp32"})
    table = stash_table(net)
    assert table["conv1_1@relu1_1"]["encoding"] == "fp16"
    assert table["pool2.argmax"]["encoding"] == "uint8"            # kept as it is
    assert table["conv2_2@relu2_2"]["encoding"] == "mask-1bit"     # no fused code then
    assert table["pool1.argmax"]["encoding"] == "relu-pool-4bit"


def test_registered_codec_takes_precedence():
    register_codec("ReLU", "Convolution", lambda shape, dtype: DPR("fp10"))
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_codec("ReLU", "Convolution", lambda shape, dtype: DPR("fp16"))
        net = minigist.Net(model("vgg_small"), batch_size=2, gist="lossless")
        assert stash_table(net)["conv1_1@relu1_1"]["encoding"] == "fp10"
    finally:
        unregister_codec("ReLU", "Convolution")


def test_bad_gist_values_are_one_line_errors():
    with pytest.raises(MinigistError, match="--gist"):
        minigist.Net(model("vgg_small"), batch_size=2, gist="sometimes")
    with pytest.raises(MinigistError, match="--dpr"):
        minigist.Net(model("vgg_small"), batch_size=2, gist="lossy", dpr="fp7")


def test_plan_only_footprint_with_densities():
    none = minigist.compile(model("vgg_small"), minigist.Options(batch_size=64)).plan.footprint_bytes
    report = minigist.plan_footprint(model("vgg_small"), batch_size=64, gist="all",
                                     ssdc_density={"conv1_1@relu1_1": 0.5})
    assert report["footprint_bytes"] < none
    assert report["gist"]["mode"] == "all"


@pytest.mark.slow
def test_conv_inputs_are_decoded_a_slice_at_a_time():
    """An SSDC-encoded ReLU output read by a convolution and its ReLU is encoded per sample and
    decoded one backward chunk at a time: no decode step, and no full-size FP32 copy. A stash
    under STREAM_MIN_BYTES is decoded whole, once."""
    net = minigist.Net(model("vgg_small"), batch_size=32, gist="lossless")
    net.calibrate(batches(2, batch_size=32))
    program = net.programs["train"]
    tensor = "conv1_1@relu1_1"
    decoded = program.buffers[f"dec:{tensor}"]
    conv = net.train_graph.node_of("conv1_2").layer
    assert program.buffers[f"blob:{tensor}"].nbytes >= minigist.passes.gist.STREAM_MIN_BYTES
    assert decoded.shape == (conv.stream_chunk(), 64, 32, 32) and decoded.shape[0] < 32
    assert not [s for s in program.steps if s.kind == "decode" and s.note == tensor]
    readers = [s for s in program.steps if isinstance(s.op, StreamedBackward) and f"dec:{tensor}" in s.op.streams]
    assert [s.layer.name for s in readers] == ["conv1_2", "relu1_1"]
    small = minigist.Net(model("vgg_small"), batch_size=8, gist="lossless")
    small.calibrate(batches(2, batch_size=8))
    steps = small.programs["train"].steps
    assert small.programs["train"].buffers[f"blob:{tensor}"].nbytes < minigist.passes.gist.STREAM_MIN_BYTES
    assert len([s for s in steps if s.kind == "decode" and s.note == tensor]) == 1
    assert not [s for s in steps if isinstance(s.op, StreamedBackward) and f"dec:{tensor}" in s.op.streams]


@pytest.mark.slow
def test_the_issue_targets_hold_on_exact_plans():
    """The README's Gist table claims (static allocation, batch 64, fused update, measured
    SSDC densities + 5%): all + FP16 averages >= 2.0x over the paper's five networks with a
    maximum >= 2.5x, and all + FP8 reaches >= 4.1x on Inception-v3. Plans are exact bytes, so
    a change that costs memory shows here."""
    import json
    from minigist.densities import planned

    def ratio(name, dpr):
        with open(os.path.join(MODELS_DIR, "densities", name + ".json")) as handle:
            density = planned(json.load(handle)["density"])
        sizes = [minigist.plan_footprint(model(name), batch_size=64, gist=gist, dpr=dpr, update="fused",
                                             ssdc_density=density)["footprint_bytes"] for gist in ("none", "all")]
        return sizes[0] / sizes[1]

    paper = [ratio(name, "fp16") for name in ("alexnet", "nin", "overfeat", "vgg16", "googlenet")]
    assert sum(paper) / len(paper) >= 2.0 and max(paper) >= 2.5, paper
    assert ratio("inception_v3", "fp8-e4m3") >= 4.1


LEAKY_POOL = """
name: "leaky_pool"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 } } }
layer { name: "c1" type: "Convolution" bottom: "data" top: "c1"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "r1" type: "ReLU" bottom: "c1" top: "c1" relu_param { negative_slope: 0.3 } }
layer { name: "p1" type: "Pooling" bottom: "c1" top: "p1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "fc" type: "InnerProduct" bottom: "p1" top: "out"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "out" bottom: "label" top: "loss" }
"""


@pytest.mark.parametrize("binarize", ["fused", "paper"])
def test_leaky_relu_before_a_max_pool_keeps_its_negative_gradient(tmp_path, binarize):
    """The fused ReLU->MaxPool code drops the gradient where the pool output is <= 0, which a
    leaky ReLU must not: it keeps a 1-bit mask instead, and lossless stays exact."""
    path = tmp_path / "leaky_pool.prototxt"
    path.write_text(LEAKY_POOL)
    rng = np.random.default_rng(0)
    data, label = rng.standard_normal((4, 3, 8, 8)).astype(np.float32), rng.integers(0, 5, 4)
    grads = {}
    for gist in ("none", "lossless"):
        net = minigist.Net(path, batch_size=4, seed=1, gist=gist, binarize=binarize)
        net.forward_backward(data, label)
        grads[gist] = {k: v.copy() for k, v in net.grads().items()}
    table = stash_table(net)
    assert table["c1@r1"]["encoding"] == "mask-1bit"
    for key, value in grads["none"].items():
        np.testing.assert_array_equal(grads["lossless"][key], value, err_msg=key)


def test_a_fused_program_says_so_even_when_its_updates_come_last(tmp_path):
    path = tmp_path / "one_layer.prototxt"
    path.write_text("""
layer { name: "data" type: "Input" top: "data" top: "label" input_param { shape { dim: 2 dim: 3 } shape { dim: 2 } } }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "out" inner_product_param { num_output: 2 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "out" bottom: "label" top: "loss" }
""")
    assert minigist.Net(path, update="fused").programs["train"].fused_update
    assert not minigist.Net(path, update="separate").programs["train"].fused_update


BN_READ_BY_A_CONV = '''name: "bn_read_by_a_conv"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 } } }
layer { name: "conv0" type: "Convolution" bottom: "data" top: "c0"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "bn" type: "BatchNorm" bottom: "c0" top: "b0" }
layer { name: "sc" type: "Scale" bottom: "b0" top: "s0" scale_param { bias_term: true } }
layer { name: "convb" type: "Convolution" bottom: "b0" top: "cb"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "sum" type: "Eltwise" bottom: "s0" bottom: "cb" top: "e" }
layer { name: "bn2" type: "BatchNorm" bottom: "e" top: "b2" }
layer { name: "sc2" type: "Scale" bottom: "b2" top: "s2" }
layer { name: "fc" type: "InnerProduct" bottom: "s2" top: "fc"
  inner_product_param { num_output: 5 weight_filler { type: "msra" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
'''


def test_an_fp16_stash_with_a_reader_that_needs_float32_is_decoded(tmp_path):
    """x_hat read by BatchNorm's and Scale's backward and a convolution's: decoded as before;
    the second BatchNorm's, read by BatchNorm and Scale alone, as fp16 as it is."""
    path = tmp_path / "bn_read_by_a_conv.prototxt"
    path.write_text(BN_READ_BY_A_CONV)
    rng = np.random.default_rng(3)
    data, label = rng.standard_normal((4, 3, 8, 8)).astype(np.float32), rng.integers(0, 5, 4)
    net = minigist.Net(path, batch_size=4, seed=1, gist="lossy")
    net.forward_backward(data, label)
    encodings = {e.tensor: e for e in net.programs["train"].encodings.values()}
    direct = {t for t, e in encodings.items() if type(e.codec).__name__ == "HalfStash"}
    assert direct == {"blob:b2"}
    assert type(encodings["blob:b0"].codec) is DPR and encodings["blob:b0"].decoded


@pytest.mark.parametrize("name,batch", [("resnet20", 4), pytest.param("resnet50", 2, marks=pytest.mark.slow)])
def test_dpr_encodes_feature_maps_of_4_kib_and_more(name, batch):
    """Under `lossy`, BatchNorm's per-channel inv_std stays float32, small (ResNet-20's 16-64
    floats) or not (ResNet-50's up to 2048), and so does a feature map under 4 KiB (ResNet-20's
    class probabilities; ResNet-50's, 8000 bytes, are fp16); every other float stash is a
    feature map and fp16 (the max pool's argmax stays uint8)."""
    net = minigist.Net(model(name), batch_size=batch, gist="lossy")
    table = stash_table(net)
    kept = {t: r for t, r in table.items() if r["tensor"].endswith(".inv_std")
            or r["raw_bytes"] < minigist.passes.gist.DPR_MIN_BYTES}
    assert any(r["raw_bytes"] >= 8192 for t, r in kept.items() if t.endswith(".inv_std")) == (name == "resnet50")
    assert ("loss.prob" in kept) == (name == "resnet20")
    assert all(r["encoding"] == "fp32" and r["stored_bytes"] == align(r["raw_bytes"]) for r in kept.values())
    others = [r for t, r in table.items() if t not in kept and not t.endswith(".argmax")]
    assert others and all(r["encoding"] == "fp16" and r["shape"][0] == batch for r in others)


CIFAR_FULL_LIKE = '''name: "cifar_full_like"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 3 dim: 16 dim: 16 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 32 pad: 2 kernel_size: 5 stride: 1 weight_filler { type: "gaussian" std: 0.01 } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "relu1" type: "ReLU" bottom: "pool1" top: "pool1" }
layer { name: "norm1" type: "LRN" bottom: "pool1" top: "norm1"
  lrn_param { local_size: 3 alpha: 5e-05 beta: 0.75 norm_region: REGION } }
layer { name: "conv2" type: "Convolution" bottom: "norm1" top: "conv2"
  convolution_param { num_output: 32 pad: 2 kernel_size: 5 stride: 1 weight_filler { type: "gaussian" std: 0.01 } } }
layer { name: "fc" type: "InnerProduct" bottom: "conv2" top: "fc"
  inner_product_param { num_output: 10 weight_filler { type: "gaussian" std: 0.01 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
'''


def test_within_channel_lrn_gets_the_across_channels_treatment(tmp_path):
    """cifar10_full's WITHIN_CHANNEL LRN: the same stashes, encodings and footprint as an
    ACROSS_CHANNELS one (its input, a ReLU output, in SSDC or DPR; its own output read by a
    convolution), and lossless training bit-identical to none."""
    rng = np.random.default_rng(4)
    data, label = rng.standard_normal((4, 3, 16, 16)).astype(np.float32), rng.integers(0, 10, 4)
    tables, footprints = {}, {}
    for region in ("ACROSS_CHANNELS", "WITHIN_CHANNEL"):
        path = tmp_path / f"{region}.prototxt"
        path.write_text(CIFAR_FULL_LIKE.replace("REGION", region))
        for gist in ("lossless", "all"):
            net = minigist.Net(path, batch_size=4, seed=1, gist=gist)
            net.calibrate([(data, label)])
            tables[region, gist] = {t: row["encoding"] for t, row in stash_table(net).items()}
            footprints[region, gist] = net.report()["footprint_bytes"]
        grads = {}
        for gist in ("none", "lossless"):
            net = minigist.Net(path, batch_size=4, seed=1, gist=gist)
            net.forward_backward(data, label)
            grads[gist] = {k: v.copy() for k, v in net.grads().items()}
        for key, value in grads["none"].items():
            np.testing.assert_array_equal(grads["lossless"][key], value, err_msg=f"{region} {key}")
    for gist in ("lossless", "all"):
        assert tables["WITHIN_CHANNEL", gist] == tables["ACROSS_CHANNELS", gist]
        assert footprints["WITHIN_CHANNEL", gist] == footprints["ACROSS_CHANNELS", gist]
    # under `all` the LRN's input (the ReLU output) and output are encoded, not kept as fp32
    assert tables["WITHIN_CHANNEL", "all"]["pool1@relu1"] != "fp32"
    assert tables["WITHIN_CHANNEL", "all"]["norm1"] != "fp32"
