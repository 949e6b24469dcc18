"""The data a model is fed: channel counts from the file or the data, every Pillow mode a
folder may hold decoded to the right 8-bit values (or refused by name), truncated PNGs
refused, class-count mismatches, the training-accuracy sample, per-model learning rates."""
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from PIL import Image

import minigist
from minigist import datasets, trainer
from minigist.errors import MinigistError, ModelFileError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")
LENET = os.path.join(ROOT, "tests", "data", "lenet_data_layer.prototxt")
sys.path.insert(0, ROOT)
import train  # noqa: E402


def run_cli(*args, timeout=180):
    return subprocess.run([sys.executable, TRAIN, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def one_line_error(result, *words):
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def lenet_count(channels):
    """LeNet's published layout, counted by hand: conv1 20 5x5, conv2 50 5x5 on 20, ip1 500 on
    50x4x4, ip2 10 (weights + biases)."""
    return (20 * channels * 25 + 20) + (50 * 20 * 25 + 50) + (500 * 800 + 500) + (10 * 500 + 10)


def small_model(tmp_path, data_layer, outputs=10):
    path = tmp_path / "small.prototxt"
    path.write_text(data_layer + f"""
layer {{ name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param {{ num_output: 2 kernel_size: 3 weight_filler {{ type: "msra" }} }} }}
layer {{ name: "fc" type: "InnerProduct" bottom: "conv" top: "fc"
  inner_product_param {{ num_output: {outputs} weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }}
layer {{ name: "acc" type: "Accuracy" bottom: "fc" bottom: "label" top: "acc" include {{ phase: TEST }} }}
""")
    return str(path)


def conv1_weights(graph):
    return graph.node_of("conv1").layer.params[0].shape


# ---- channels -----------------------------------------------------------------------------
def test_lenet_data_layer_takes_mnist5ks_one_channel():
    assert lenet_count(1) == 431_080 and lenet_count(3) == 432_080
    graph = minigist.build_graph(LENET, input_size=28, input_channels=1)
    assert graph.param_count() == 431_080
    assert graph.input_shape == (1, 28, 28) and conv1_weights(graph) == (20, 1, 5, 5)
    shapes = {node.layer.name: node.layer.top_shapes[0] for node in graph.nodes}
    assert shapes["conv1"] == (64, 20, 24, 24) and shapes["pool1"] == (64, 20, 12, 12)
    assert shapes["conv2"] == (64, 50, 8, 8) and shapes["pool2"] == (64, 50, 4, 4)
    assert shapes["ip1"] == (64, 500) and shapes["ip2"] == (64, 10)
    result = run_cli("--model", LENET, "--input-size", 28, "--data", "mnist5k", "--summary")
    assert result.returncode == 0, result.stderr
    assert "parameters: 431,080" in result.stdout
    assert "input channels: 1, those of --data mnist5k" in result.stdout


def test_data_layer_without_data_assumes_three_and_says_so():
    graph = minigist.build_graph(LENET, input_size=28)
    assert graph.param_count() == lenet_count(3)
    assert not graph.nodes[0].layer.channels_stated
    result = run_cli("--model", LENET, "--input-size", 28, "--plan-only")
    assert result.returncode == 0, result.stderr
    assert "input channels: 3 assumed" in result.stdout and "no --data given" in result.stdout
    assert "input (3, 28, 28)" in result.stdout
    given = run_cli("--model", LENET, "--input-size", 28, "--input-channels", 1, "--summary")
    assert "parameters: 431,080" in given.stdout


def test_the_files_stated_channels_win(tmp_path):
    gray_input = small_model(tmp_path, """
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 2 dim: 1 dim: 8 dim: 8 } shape { dim: 2 } } }""")
    graph = minigist.build_graph(gray_input, input_channels=None)
    assert graph.input_shape == (1, 8, 8)
    with pytest.raises(ModelFileError, match="the file gives 1 input channel"):
        minigist.build_graph(gray_input, input_channels=3)
    one_line_error(run_cli("--model", gray_input, "--input-channels", 3, "--summary"),
                   "small.prototxt:2", "1 input channel", "--input-channels")
    legacy = small_model(tmp_path, """
input: "data"
input_dim: 2 input_dim: 1 input_dim: 8 input_dim: 8
input: "label"
input_dim: 2 input_dim: 1 input_dim: 1 input_dim: 1""")
    assert minigist.build_graph(legacy).input_shape == (1, 8, 8)
    with pytest.raises(ModelFileError, match="the file gives 1 input channel"):
        minigist.build_graph(legacy, input_channels=3)
    # an RGB folder is still fed to the file's 1 channel (and mnist5k's gray to a 3-channel model)
    memory = small_model(tmp_path, """
layer { name: "data" type: "MemoryData" top: "data" top: "label"
  memory_data_param { batch_size: 2 channels: 1 height: 8 width: 8 } }""")
    assert minigist.build_graph(memory, input_channels=1).input_shape == (1, 8, 8)
    with pytest.raises(ModelFileError, match="the file gives 1 input channel"):
        minigist.build_graph(memory, input_channels=3)


def test_image_data_is_color(tmp_path):
    def image_data(extra):
        return small_model(tmp_path, f"""
layer {{ name: "data" type: "ImageData" top: "data" top: "label"
  image_data_param {{ source: "list.txt" batch_size: 2 new_height: 8 new_width: 8 {extra} }} }}""")
    assert minigist.build_graph(image_data("is_color: false")).input_shape == (1, 8, 8)
    assert minigist.build_graph(image_data("is_color: true")).input_shape == (3, 8, 8)
    with pytest.raises(ModelFileError):
        minigist.build_graph(image_data("is_color: false"), input_channels=3)
    unstated = image_data("")
    assert minigist.build_graph(unstated).input_shape == (3, 8, 8)
    assert minigist.build_graph(unstated, input_channels=1).input_shape == (1, 8, 8)


def test_native_channels_of_the_data(tmp_path):
    assert datasets.native_channels("mnist5k") == 1
    assert datasets.native_channels("synthetic") is None
    for name, mode in (("gray", "L"), ("rgb", "RGB")):
        (tmp_path / name / "a").mkdir(parents=True)
        Image.new(mode, (4, 4)).save(tmp_path / name / "a" / "x.png")
        Image.new("L", (4, 4)).save(tmp_path / name / "a" / "y.png")
    assert datasets.native_channels(str(tmp_path / "gray")) == 1
    assert datasets.native_channels(str(tmp_path / "rgb")) == 3


# ---- image modes ----------------------------------------------------------------------------
def png_bytes(width, height, depth, colour_type, rows):
    """A PNG written by hand (Pillow cannot write 16-bit RGB): filter byte 0 before each row."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    raw = b"".join(b"\x00" + row for row in rows)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, depth, colour_type, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def decode(path, channels, size):
    return datasets.decode_image(str(path), channels, size, size)


def test_16bit_gray_png_decodes_to_its_high_byte(tmp_path):
    gradient = (np.arange(64, dtype=np.uint32).reshape(8, 8) * 1040).astype(np.uint16)   # 0..65520
    Image.fromarray(gradient).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    expected = (gradient >> 8).astype(np.uint8)
    assert np.array_equal(decode(tmp_path / "g16.png", 1, 8)[0], expected)
    rgb = decode(tmp_path / "g16.png", 3, 8)
    assert all(np.array_equal(rgb[c], expected) for c in range(3))


def test_16bit_rgb_png(tmp_path):
    pixels = (np.arange(4 * 4 * 3, dtype=np.uint32).reshape(4, 4, 3) * 1300).astype(">u2")
    (tmp_path / "rgb16.png").write_bytes(png_bytes(4, 4, 16, 2, [pixels[y].tobytes() for y in range(4)]))
    got = decode(tmp_path / "rgb16.png", 3, 4)
    assert np.array_equal(got, (pixels.astype(np.uint32) >> 8).astype(np.uint8).transpose(2, 0, 1))


def test_palette_with_transparency_la_and_cmyk(tmp_path):
    palette = [10, 20, 30, 200, 100, 50] + [0] * (256 * 3 - 6)
    indices = np.array([[0, 1], [1, 0]], dtype=np.uint8)
    image = Image.fromarray(indices, "P")
    image.putpalette(palette)
    image.save(tmp_path / "p.png", transparency=bytes([0, 255]))     # index 0 fully transparent
    assert "transparency" in Image.open(tmp_path / "p.png").info
    got = decode(tmp_path / "p.png", 3, 2)
    colours = np.array([[10, 20, 30], [200, 100, 50]], dtype=np.uint8)
    assert np.array_equal(got, colours[indices].transpose(2, 0, 1))      # alpha dropped, colours kept

    gray_alpha = np.stack([np.array([[0, 77], [150, 255]], np.uint8), np.full((2, 2), 9, np.uint8)], axis=-1)
    Image.fromarray(gray_alpha, "LA").save(tmp_path / "la.png")
    assert np.array_equal(decode(tmp_path / "la.png", 1, 2)[0], gray_alpha[..., 0])

    cmyk = np.zeros((16, 16, 4), dtype=np.uint8)
    cmyk[..., 0], cmyk[..., 2], cmyk[..., 3] = 40, 200, 60       # flat: JPEG keeps it to +-2
    Image.fromarray(cmyk, "CMYK").save(tmp_path / "cmyk.jpg", quality=100)
    assert Image.open(tmp_path / "cmyk.jpg").mode == "CMYK"
    got = decode(tmp_path / "cmyk.jpg", 3, 16).astype(int)
    c, m, y, k = 40, 0, 200, 60
    expected = [round((255 - v) * (255 - k) / 255) for v in (c, m, y)]
    assert np.all(np.abs(got - np.array(expected)[:, None, None]) <= 3), got[:, 0, 0]


def test_float_images_are_refused_by_mode(tmp_path):
    (tmp_path / "a").mkdir()
    Image.fromarray(np.ones((4, 4), np.float32), "F").save(tmp_path / "a" / "f.tif")
    with pytest.raises(MinigistError, match="mode F"):
        decode(tmp_path / "a" / "f.tif", 1, 4)


def test_truncated_png_is_refused(tmp_path):
    rows = [bytes([9] * 8)] * 3                        # 3 of the 8 rows the header promises
    root = tmp_path / "data"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    (root / "a" / "short.png").write_bytes(png_bytes(8, 8, 8, 0, rows))
    Image.new("L", (8, 8)).save(root / "b" / "fine.png")
    Image.new("L", (8, 8)).save(root / "a" / "fine.png")
    with pytest.raises(MinigistError, match="cut short"):
        decode(root / "a" / "short.png", 1, 8)
    assert decode(root / "a" / "fine.png", 1, 8).shape == (1, 8, 8)
    interlaced = Image.fromarray(np.arange(63, dtype=np.uint8).reshape(7, 9))
    interlaced.save(root / "b" / "adam7.png", interlace=1)
    assert np.array_equal(decode(root / "b" / "adam7.png", 1, 7)[0], np.asarray(interlaced)[:, 1:8])
    one_line_error(run_cli("--data", root, "--model", "resnet20", "--iters", 1),
                   "short.png", "cut short")


# ---- classes, train accuracy, learning rate ---------------------------------------------------
def test_fewer_classes_than_outputs_warns(tmp_path):
    model = small_model(tmp_path, """
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 } } }""", outputs=5)
    root = tmp_path / "three"
    for name in "abc":
        (root / name).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (8, 8), (40 * i, 80, 120)).save(root / name / f"{i}.png")
    result = run_cli("--model", model, "--data", root, "--iters", 1, "--gist", "none", "--holdout", 0)
    assert result.returncode == 0, result.stderr
    assert "warning: --data" in result.stdout and "has 3 classes, the model predicts 5" in result.stdout
    four = small_model(tmp_path, """
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 } } }""", outputs=2)
    one_line_error(run_cli("--model", four, "--data", root, "--iters", 1), "3 class folders", "2 classes")


def test_train_accuracy_sample_is_stratified():
    data = datasets.load_dataset("mnist5k", (1, 32, 32), classes=10)
    assert set(np.unique(data.train.labels[:1000])) <= {0, 1, 2}     # why the first 1,000 mislead
    sample = data.train_sample(1000)
    assert len(sample) == 1000
    share = np.bincount(data.train.labels, minlength=10) * 1000 / len(data.train)
    assert np.all(np.abs(np.bincount(sample.labels, minlength=10) - share) < 1)
    again = datasets.load_dataset("mnist5k", (1, 32, 32), classes=10, seed=7).train_sample(1000)
    assert np.array_equal(again.labels, sample.labels) and np.array_equal(again.images, sample.images)
    assert len(data.train_sample(10**6)) == len(data.train)


@pytest.mark.slow
def test_train_py_measures_train_accuracy_on_the_sample(monkeypatch):
    seen = []
    real = trainer.evaluate

    def spy(net, data, split, batch_size, names, limit=None):
        labels = split.labels if limit is None else split.labels[:limit]
        seen.append(np.bincount(labels, minlength=10)[:10])
        return real(net, data, split, batch_size, names, limit)
    monkeypatch.setattr(trainer, "evaluate", spy)
    code = train.main(["--model", "resnet20", "--iters", "1", "--gist", "none", "--train-eval-size", "100",
                       "--batch-size", "4", "--holdout", "0"])
    assert code == 0
    assert len(seen) == 1 and np.all(seen[0] >= 8)      # all ten digits, about 10 each


@pytest.mark.slow
def test_a_train_accuracy_sample_larger_than_the_split_says_it_takes_all(capsys):
    code = train.main(["--model", "resnet20", "--iters", "1", "--gist", "none", "--train-eval-size", "5000",
                       "--batch-size", "4", "--holdout", "0.5", "--eval-every", "0"])
    assert code == 0
    assert ("training accuracy: on all 2,500 training images (--train-eval-size 5,000 asks for more than the "
            "training split holds)") in capsys.readouterr().out


def test_warm_up_schedule():
    args = train.make_parser().parse_args(["--lr", "0.01", "--warmup", "4", "--lr-step", "1", "--lr-gamma", "0.5"])
    rates = [trainer.lr_at(args, i, 5) for i in range(7)]
    assert np.allclose(rates, [0.0025, 0.005, 0.0075, 0.01, 0.01, 0.005, 0.005])
    args.warmup = 0
    assert trainer.lr_at(args, 0, 5) == 0.01


def test_per_model_default_lr():
    assert trainer.default_lr("vgg_small") == trainer.MODEL_LR["vgg_small"] < 0.1
    assert trainer.default_lr("resnet20") == trainer.DEFAULT_LR == 0.1
    assert trainer.default_lr("models/vgg_small.prototxt") == trainer.DEFAULT_LR    # a user's file: no guess


@pytest.mark.slow
def test_vgg_small_trains_at_its_default_lr():
    """At lr 0.1 its loss becomes NaN at iteration 5 on mnist5k (and at 0.01 without warm-up
    its loss jumps from 2.5 to 15.8 at the second step)."""
    result = run_cli("--model", "vgg_small", "--iters", 8, "--gist", "none", "--holdout", 0,
                     "--train-eval-size", 0)
    assert result.returncode == 0, result.stderr
    assert "lr 0.01 x0.5 every 1 epochs, warm-up 100 iterations" in result.stdout
    given = run_cli("--model", "vgg_small", "--iters", 8, "--gist", "none", "--holdout", 0,
                    "--train-eval-size", 0, "--lr", 0.1, "--warmup", 0)
    one_line_error(given, "lr 0.1")


def test_lenet_trains_on_mnist5k_with_its_own_test_batch():
    """Its TEST Data layer says batch_size 100, the TRAIN one 64: evaluation feeds 100s."""
    result = run_cli("--model", LENET, "--input-size", 28, "--iters", 3, "--lr", 0.01, "--gist", "none",
                     "--train-eval-size", 200)
    assert result.returncode == 0, result.stderr
    assert "431,080 parameters, batch (64, 1, 28, 28)" in result.stdout
    assert "held-out accuracy" in result.stdout


def padded_crop(images, pad, dy, dx):
    """The random crop as its definition says: a window of the zero-padded image."""
    n, c, h, w = images.shape
    padded = np.zeros((n, c, h + 2 * pad, w + 2 * pad), dtype=images.dtype)
    padded[:, :, pad:pad + h, pad:pad + w] = images
    return np.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])


@pytest.mark.parametrize("pad", [1, 4, 7, 8])
def test_random_crop_is_a_window_of_the_padded_image(pad):
    images = np.random.default_rng(pad).integers(1, 256, size=(64, 3, 8, 7), dtype=np.uint8)
    draws = np.random.default_rng(5)
    dy, dx = draws.integers(0, 2 * pad + 1, size=64), draws.integers(0, 2 * pad + 1, size=64)
    got = datasets.random_crop(images, pad, np.random.default_rng(5))
    assert np.array_equal(got, padded_crop(images, pad, dy, dx))
    part = slice(16, 40)          # a rank's part: the offsets drawn for the whole batch
    got = datasets.random_crop(images[part], pad, np.random.default_rng(5), drawn=64, part=part)
    assert np.array_equal(got, padded_crop(images[part], pad, dy[part], dx[part]))


def test_a_crop_pad_beyond_the_image_is_one_line():
    one_line_error(run_cli("--crop-pad", 100000, "--iters", 1), "--crop-pad", "100000", "32")
