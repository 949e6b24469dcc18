"""The bundled models (models/*.prototxt): each builds in TRAIN and TEST with the expected
blob shapes and learned-parameter count, takes a batch size and input size at load time, and
is exactly what tools/make_models.py writes.

The expected parameter counts are computed here a second way, by per-layer arithmetic from
the published architectures (not from the model files), and checked against the published
totals where one exists.
"""
import os
import subprocess
import sys

import pytest

from minigist.errors import ModelFileError
from minigist.graph import build_graph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS_DIR = os.path.join(ROOT, "models")


def model_path(name):
    return os.path.join(MODELS_DIR, name + ".prototxt")


# ---- parameter counts by arithmetic -----------------------------------------------------

def conv(cin, cout, kernel, group=1, bias=True):
    """Learned parameters of a convolution (kernel: int or (h, w))."""
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    return cout * (cin // group) * kh * kw + (cout if bias else 0)


def conv_bn(cin, cout, kernel):
    """A bias-free convolution + BatchNorm (no learned parameters) + Scale (scale and bias)."""
    return conv(cin, cout, kernel, bias=False) + 2 * cout


def fc(fan_in, fan_out):
    return fan_in * fan_out + fan_out


def alexnet_params():
    return (conv(3, 96, 11) + conv(96, 256, 5, group=2) + conv(256, 384, 3)
            + conv(384, 384, 3, group=2) + conv(384, 256, 3, group=2)
            + fc(256 * 6 * 6, 4096) + fc(4096, 4096) + fc(4096, 1000))


def nin_params():
    def mlpconv(cin, cout, kernel, last=None):
        return conv(cin, cout, kernel) + conv(cout, cout, 1) + conv(cout, last or cout, 1)
    return (mlpconv(3, 96, 11) + mlpconv(96, 256, 5) + mlpconv(256, 384, 3)
            + mlpconv(384, 1024, 3, last=1000))


def overfeat_params():
    return (conv(3, 96, 11) + conv(96, 256, 5) + conv(256, 512, 3) + conv(512, 1024, 3)
            + conv(1024, 1024, 3) + fc(1024 * 6 * 6, 3072) + fc(3072, 4096) + fc(4096, 1000))


def vgg16_params():
    widths = [64, 64, 128, 128, 256, 256, 256, 512, 512, 512, 512, 512, 512]
    convs = sum(conv(cin, cout, 3) for cin, cout in zip([3] + widths, widths))
    return convs + fc(512 * 7 * 7, 4096) + fc(4096, 4096) + fc(4096, 1000)


def inception_v1(cin, c1, c3r, c3, c5r, c5, cp, unit=conv):
    """GoogLeNet's module; returns (parameters, output channels)."""
    params = (unit(cin, c1, 1) + unit(cin, c3r, 1) + unit(c3r, c3, 3) + unit(cin, c5r, 1)
              + unit(c5r, c5, 5) + unit(cin, cp, 1))
    return params, c1 + c3 + c5 + cp


def googlenet_params(with_aux):
    # Szegedy et al. 2015, table 1: #1x1, #3x3 reduce, #3x3, #5x5 reduce, #5x5, pool proj
    table = [(64, 96, 128, 16, 32, 32), (128, 128, 192, 32, 96, 64),
             (192, 96, 208, 16, 48, 64), (160, 112, 224, 24, 64, 64), (128, 128, 256, 24, 64, 64),
             (112, 144, 288, 32, 64, 64), (256, 160, 320, 32, 128, 128),
             (256, 160, 320, 32, 128, 128), (384, 192, 384, 48, 128, 128)]
    total = conv(3, 64, 7) + conv(64, 64, 1) + conv(64, 192, 3)
    channels, aux_inputs = 192, []
    for i, row in enumerate(table):
        params, channels = inception_v1(channels, *row)
        total += params
        if i in (2, 5):             # after 4a and 4d
            aux_inputs.append(channels)
    total += fc(1024, 1000)
    if with_aux:                    # 1x1 conv 128 on the 4x4 pooled map, fc 1024, fc 1000
        total += sum(conv(c, 128, 1) + fc(128 * 4 * 4, 1024) + fc(1024, 1000) for c in aux_inputs)
    return total


def inception_v3_params():
    cb = conv_bn
    stem = cb(3, 32, 3) + cb(32, 32, 3) + cb(32, 64, 3) + cb(64, 80, 1) + cb(80, 192, 3)

    def block_a(cin, pool_features):
        return (cb(cin, 64, 1) + cb(cin, 48, 1) + cb(48, 64, 5)
                + cb(cin, 64, 1) + cb(64, 96, 3) + cb(96, 96, 3) + cb(cin, pool_features, 1))
    block_b = cb(288, 384, 3) + cb(288, 64, 1) + cb(64, 96, 3) + cb(96, 96, 3)

    def block_c(c7):
        return (cb(768, 192, 1)
                + cb(768, c7, 1) + cb(c7, c7, (1, 7)) + cb(c7, 192, (7, 1))
                + cb(768, c7, 1) + cb(c7, c7, (7, 1)) + cb(c7, c7, (1, 7)) + cb(c7, c7, (7, 1))
                + cb(c7, 192, (1, 7)) + cb(768, 192, 1))
    block_d = (cb(768, 192, 1) + cb(192, 320, 3) + cb(768, 192, 1) + cb(192, 192, (1, 7))
               + cb(192, 192, (7, 1)) + cb(192, 192, 3))

    def block_e(cin):
        return (cb(cin, 320, 1) + cb(cin, 384, 1) + cb(384, 384, (1, 3)) + cb(384, 384, (3, 1))
                + cb(cin, 448, 1) + cb(448, 384, 3) + cb(384, 384, (1, 3)) + cb(384, 384, (3, 1))
                + cb(cin, 192, 1))
    return (stem + block_a(192, 32) + block_a(256, 64) + block_a(288, 64) + block_b
            + block_c(128) + block_c(160) + block_c(160) + block_c(192) + block_d
            + block_e(1280) + block_e(2048) + fc(2048, 1000))


def resnet50_params():
    total, cin = conv_bn(3, 64, 7), 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for i in range(blocks):
            total += conv_bn(cin, width, 1) + conv_bn(width, width, 3) + conv_bn(width, 4 * width, 1)
            if i == 0:
                total += conv_bn(cin, 4 * width, 1)      # projection shortcut
            cin = 4 * width
    return total + fc(2048, 1000)


def resnet20_params(projection=True):
    total, cin = conv_bn(3, 16, 3), 16
    for width in (16, 32, 64):
        for _ in range(3):
            total += conv_bn(cin, width, 3) + conv_bn(width, width, 3)
            if cin != width and projection:
                total += conv_bn(cin, width, 1)
            cin = width
    return total + fc(64, 10)


def vgg_small_params():
    widths = [64, 64, 128, 128, 256, 256]
    return sum(conv(cin, cout, 3) for cin, cout in zip([3] + widths, widths)) + fc(256 * 4 * 4, 10)


def inception_small_params():
    total, channels = conv_bn(3, 64, 3), 64
    for row in [(32, 48, 64, 8, 16, 16), (64, 64, 96, 16, 32, 32),
                (64, 96, 128, 16, 32, 32), (96, 96, 128, 24, 64, 64)]:
        params, channels = inception_v1(channels, *row, unit=conv_bn)
        total += params
    return total + fc(channels, 10)


def test_arithmetic_matches_published_counts():
    assert alexnet_params() == 60_965_224             # Caffe's bvlc_alexnet
    assert vgg16_params() == 138_357_544              # VGG-16 (configuration D)
    assert resnet50_params() == 25_557_032            # ResNet-50 (torchvision's count)
    # torchvision's inception_v3 without its auxiliary head: 27,161,264 in all, of which the
    # AuxLogits take conv 768->128 1x1 + BN, conv 128->768 5x5 + BN, fc 768->1000
    aux_logits = conv_bn(768, 128, 1) + conv_bn(128, 768, 5) + fc(768, 1000)
    assert inception_v3_params() == 27_161_264 - aux_logits == 23_834_568
    assert googlenet_params(with_aux=False) == 6_998_552   # bvlc_googlenet deploy
    # ResNet-20 with the paper's option A (parameter-free shortcuts) has 0.27M parameters
    assert resnet20_params(projection=False) == 269_722
    assert resnet20_params() - resnet20_params(projection=False) == conv_bn(16, 32, 1) + conv_bn(32, 64, 1)
    assert round(overfeat_params() / 1e6) == 146      # Sermanet et al.: "145M" for the fast model


# ---- the models ---------------------------------------------------------------------------

# name: (batch, input size, classes, learned parameters (TRAIN, TEST), score blob,
#        {blob: shape without the batch axis})
MODELS = {
    "alexnet": (64, 227, 1000, alexnet_params(), "fc8", {
        "conv1": (96, 55, 55), "pool1": (96, 27, 27), "conv2": (256, 27, 27),
        "pool2": (256, 13, 13), "conv5": (256, 13, 13), "pool5": (256, 6, 6), "fc6": (4096,)}),
    "nin": (64, 224, 1000, nin_params(), "pool4", {
        "conv1": (96, 54, 54), "pool0": (96, 27, 27), "pool2": (256, 13, 13),
        "pool3": (384, 6, 6), "conv4": (1024, 6, 6), "cccp8": (1000, 6, 6),
        "pool4": (1000, 1, 1)}),
    "overfeat": (64, 231, 1000, overfeat_params(), "fc8", {
        "conv1": (96, 56, 56), "pool1": (96, 28, 28), "conv2": (256, 24, 24),
        "pool2": (256, 12, 12), "conv5": (1024, 12, 12), "pool5": (1024, 6, 6), "fc6": (3072,)}),
    "vgg16": (64, 224, 1000, vgg16_params(), "fc8", {
        "conv1_2": (64, 224, 224), "pool1": (64, 112, 112), "pool2": (128, 56, 56),
        "pool3": (256, 28, 28), "pool4": (512, 14, 14), "pool5": (512, 7, 7), "fc7": (4096,)}),
    "googlenet": (64, 224, 1000, (googlenet_params(True), googlenet_params(False)),
                  "loss3/classifier", {
        "conv1/7x7_s2": (64, 112, 112), "pool1/3x3_s2": (64, 56, 56),
        "conv2/3x3": (192, 56, 56), "pool2/3x3_s2": (192, 28, 28),
        "inception_3a/output": (256, 28, 28), "inception_3b/output": (480, 28, 28),
        "pool3/3x3_s2": (480, 14, 14), "inception_4a/output": (512, 14, 14),
        "inception_4d/output": (528, 14, 14), "inception_4e/output": (832, 14, 14),
        "pool4/3x3_s2": (832, 7, 7), "inception_5b/output": (1024, 7, 7),
        "pool5/7x7_s1": (1024, 1, 1)}),
    "inception_v3": (64, 299, 1000, inception_v3_params(), "fc", {
        "conv1_3x3_s2": (32, 149, 149), "conv2_3x3": (32, 147, 147), "conv3_3x3": (64, 147, 147),
        "pool1_3x3_s2": (64, 73, 73), "conv4_1x1": (80, 73, 73), "conv5_3x3": (192, 71, 71),
        "pool2_3x3_s2": (192, 35, 35), "mixed_5b/output": (256, 35, 35),
        "mixed_5d/output": (288, 35, 35), "mixed_6a/output": (768, 17, 17),
        "mixed_6e/output": (768, 17, 17), "mixed_7a/output": (1280, 8, 8),
        "mixed_7c/output": (2048, 8, 8), "pool_8x8": (2048, 1, 1)}),
    "resnet50": (64, 224, 1000, resnet50_params(), "fc1000", {
        "conv1": (64, 112, 112), "pool1": (64, 56, 56), "res2c": (256, 56, 56),
        "res3a_branch2a": (128, 28, 28), "res3d": (512, 28, 28), "res4f": (1024, 14, 14),
        "res5c": (2048, 7, 7), "pool5": (2048, 1, 1)}),
    "vgg_small": (32, 32, 10, vgg_small_params(), "fc", {
        "conv1_2": (64, 32, 32), "pool1": (64, 16, 16), "conv2_2": (128, 16, 16),
        "pool2": (128, 8, 8), "conv3_2": (256, 8, 8), "pool3": (256, 4, 4)}),
    "resnet20": (32, 32, 10, resnet20_params(), "fc", {
        "conv1": (16, 32, 32), "res1c": (16, 32, 32), "res2a_branch1": (32, 16, 16),
        "res2a": (32, 16, 16), "res2c": (32, 16, 16), "res3a": (64, 8, 8), "res3c": (64, 8, 8),
        "pool": (64, 1, 1)}),
    "inception_small": (32, 32, 10, inception_small_params(), "classifier", {
        "conv1/3x3": (64, 32, 32), "pool1/3x3_s2": (64, 16, 16),
        "inception_2a/output": (128, 16, 16), "inception_2b/output": (224, 16, 16),
        "pool2/3x3_s2": (224, 8, 8), "inception_3a/output": (256, 8, 8),
        "inception_3b/output": (352, 8, 8), "pool3/global": (352, 1, 1)}),
}

# The learned-parameter count of each model, as computed (also in models/README.md).
EXPECTED_COUNTS = {
    "alexnet": 60_965_224, "nin": 7_595_176, "overfeat": 145_920_872, "vgg16": 138_357_544,
    "googlenet": (13_378_280, 6_998_552), "inception_v3": 23_834_568, "resnet50": 25_557_032,
    "vgg_small": 1_186_378, "resnet20": 272_474, "inception_small": 526_826,
}

PHASES = ("TRAIN", "TEST")


def _by_phase(value, phase):
    return value[PHASES.index(phase)] if isinstance(value, tuple) else value


def test_every_model_file_is_listed():
    files = sorted(f[:-len(".prototxt")] for f in os.listdir(MODELS_DIR) if f.endswith(".prototxt"))
    assert files == sorted(MODELS)


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_builds_with_expected_shapes_and_parameters(name, phase):
    batch, size, classes, params, scores, shapes = MODELS[name]
    graph = build_graph(model_path(name), phase)
    assert graph.batch_size == batch
    assert graph.input_shape == (3, size, size)
    assert graph.blobs["data"].shape == (batch, 3, size, size)
    assert graph.blobs["label"].shape == (batch,)
    for blob, shape in shapes.items():
        assert graph.blobs[blob].shape == (batch,) + shape, blob
    score_shape = graph.blobs[scores].shape
    assert score_shape[:2] == (batch, classes) and all(d == 1 for d in score_shape[2:])
    assert graph.param_count() == _by_phase(params, phase) == _by_phase(EXPECTED_COUNTS[name], phase)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_conventions(name):
    """Input layer with data and label; SoftmaxWithLoss on the label; Accuracy in TEST only;
    every weight initialized from a random filler; BatchNorm state not counted as learned."""
    for phase in PHASES:
        graph = build_graph(model_path(name), phase)
        first = graph.nodes[0]
        assert first.layer.type == "Input" and first.tops == ["data", "label"]
        types = [layer.type for layer in graph.layers]
        assert types.count("Accuracy") == (1 if phase == "TEST" else 0)
        losses = [node for node in graph.nodes if node.layer.type == "SoftmaxWithLoss"]
        assert losses and all(node.bottoms[1] == "label" for node in losses)
        assert set(graph.loss_weights) == {node.tops[0] for node in losses}
        for layer in graph.layers:
            for param in layer.params:
                if param.name == "weight":
                    assert param.filler["type"] in ("msra", "xavier", "gaussian"), layer.name
            if layer.type == "BatchNorm":
                assert not any(param.learnable for param in layer.params)
        state = sum(int(layer.params[0].shape[0]) * 2 + 1
                    for layer in graph.layers if layer.type == "BatchNorm")
        assert graph.param_count(learned_only=False) - graph.param_count() == state


def test_googlenet_auxiliary_heads_only_in_train():
    train = build_graph(model_path("googlenet"), "TRAIN")
    test = build_graph(model_path("googlenet"), "TEST")
    assert train.loss_weights == {"loss1/loss1": 0.3, "loss2/loss1": 0.3, "loss3/loss3": 1.0}
    assert test.loss_weights == {"loss3/loss3": 1.0}
    for head, channels in (("loss1", 512), ("loss2", 528)):
        assert train.blobs[f"{head}/ave_pool"].shape == (64, channels, 4, 4)
        assert train.blobs[f"{head}/classifier"].shape == (64, 1000)
        assert f"{head}/classifier" not in test.blobs
    assert sum(1 for layer in train.layers if layer.type == "LRN") == 2


def test_alexnet_is_grouped_with_lrn():
    graph = build_graph(model_path("alexnet"), "TRAIN")
    weights = {layer.name: layer.params[0].shape for layer in graph.layers
               if layer.type == "Convolution"}
    assert weights["conv2"] == (256, 48, 5, 5)
    assert weights["conv4"] == (384, 192, 3, 3)
    assert weights["conv5"] == (256, 192, 3, 3)
    assert [layer.name for layer in graph.layers if layer.type == "LRN"] == ["norm1", "norm2"]
    assert sum(1 for layer in graph.layers if layer.type == "Dropout") == 2


def test_batch_norm_nets_are_kaiming_style():
    for name in ("resnet50", "resnet20", "inception_v3", "inception_small"):
        graph = build_graph(model_path(name), "TRAIN")
        types = [layer.type for layer in graph.layers]
        convs = [layer for layer in graph.layers if layer.type == "Convolution"]
        assert all(len(layer.params) == 1 for layer in convs), "convolutions have no bias"
        assert types.count("BatchNorm") == types.count("Scale") == len(convs)
        for layer in graph.layers:
            if layer.type == "Scale":
                assert [p.name for p in layer.params] == ["scale", "bias"]
        # BatchNorm, Scale and ReLU work in place: their top is a new version of their bottom
        for node in graph.nodes:
            if node.layer.type in ("BatchNorm", "Scale", "ReLU"):
                assert graph.blobs[node.tops[0]].base == graph.blobs[node.bottoms[0]].base
    resnet50 = build_graph(model_path("resnet50"), "TRAIN")
    assert sum(1 for layer in resnet50.layers if layer.type == "Eltwise") == 16
    assert sum(1 for layer in resnet50.layers if layer.type == "Convolution") == 53
    resnet20 = build_graph(model_path("resnet20"), "TRAIN")
    assert sum(1 for layer in resnet20.layers if layer.type == "Eltwise") == 9
    assert sum(1 for layer in resnet20.layers if layer.type == "Convolution") == 21


def test_vgg_small_is_exactly_the_benchmark_net():
    graph = build_graph(model_path("vgg_small"), "TRAIN")
    layers = [(layer.type, tuple(p.shape for p in layer.params)) for layer in graph.layers]
    c = lambda cin, cout: ("Convolution", ((cout, cin, 3, 3), (cout,)))  # noqa: E731
    relu, pool = ("ReLU", ()), ("Pooling", ())
    assert layers == [
        ("Input", ()),
        c(3, 64), relu, c(64, 64), relu, pool,
        c(64, 128), relu, c(128, 128), relu, pool,
        c(128, 256), relu, c(256, 256), relu, pool,
        ("InnerProduct", ((10, 256 * 4 * 4), (10,))),
        ("SoftmaxWithLoss", ()),
    ]
    for layer in graph.layers:
        if layer.type == "Convolution":
            assert layer.pad == (1, 1) and layer.stride == (1, 1)
        if layer.type == "Pooling":     # 2x2 max pooling halves the map
            n, c, h, w = layer.bottom_shapes[0]
            assert layer.top_shapes[0] == (n, c, h // 2, w // 2)


# Every model takes a batch size and an input size at load time; Inception-v3's reductions
# need at least 75x75, the others take 64x64.
OVERRIDE_SIZES = {name: 64 for name in MODELS}
OVERRIDE_SIZES["inception_v3"] = 139


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_batch_and_input_size_override(name, phase):
    _, _, classes, params, scores, _ = MODELS[name]
    size = OVERRIDE_SIZES[name]
    graph = build_graph(model_path(name), phase, batch_size=8, input_size=size)
    assert graph.blobs["data"].shape == (8, 3, size, size)
    assert graph.blobs["label"].shape == (8,)
    assert graph.batch_size == 8 and graph.input_shape == (3, size, size)
    assert graph.blobs[scores].shape[:2] == (8, classes)
    # nets that end in global average pooling keep their parameters at any input size
    # (GoogLeNet's auxiliary heads, in TRAIN, end in fully connected layers)
    if name in ("nin", "inception_v3", "resnet50", "resnet20", "inception_small") or (
            name == "googlenet" and phase == "TEST"):
        assert graph.param_count() == _by_phase(params, phase)


def test_inception_v3_too_small_input_is_a_model_file_error():
    with pytest.raises(ModelFileError, match="inception_v3.prototxt"):
        build_graph(model_path("inception_v3"), "TEST", batch_size=2, input_size=64)


def test_make_models_reproduces_the_committed_files(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_models.py"),
                             "--out", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    generated = sorted(os.listdir(tmp_path))
    committed = sorted(f for f in os.listdir(MODELS_DIR) if f.endswith(".prototxt"))
    assert generated == committed
    for filename in generated:
        with open(tmp_path / filename, "rb") as f:
            new = f.read()
        with open(os.path.join(MODELS_DIR, filename), "rb") as f:
            old = f.read()
        assert new == old, f"models/{filename} differs from tools/make_models.py's output"
    check = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_models.py"),
                            "--check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
