"""train.py end to end: data loading, exact evaluation, checkpoints and bitwise resume, the
memory pictures, and one-line errors. Kept small: tiny models, tiny images, a few iterations."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

import minigist
from minigist.errors import MemoryBudgetError
from minigist import datasets, jit, trainer
from minigist.checkpoint import CHECKPOINT_NAME, read_checkpoint
from minigist.errors import MinigistError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")
sys.path.insert(0, ROOT)
import train  # noqa: E402

# a tiny net with every kind of state a checkpoint must carry: BatchNorm running sums,
# momentum, and a Dropout that draws from the net's random generator
TINY = """
name: "tiny"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "scale" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "drop" type: "Dropout" bottom: "pool" top: "pool" dropout_param { dropout_ratio: 0.3 } }
layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc"
  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "fc" bottom: "label" top: "acc" include { phase: TEST } }
"""


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, TRAIN, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny.prototxt"
    path.write_text(TINY)
    return str(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """3 classes of real PNG and JPEG files: RGB and grayscale, different sizes."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    sizes = [(12, 9), (20, 31), (8, 8), (40, 16)]
    for label, name in enumerate(["bird", "cat", "dog"]):
        (root / name).mkdir()
        for i, (w, h) in enumerate(sizes):
            base = np.zeros((h, w, 3), dtype=np.uint8)
            base[..., label] = 200
            pixels = np.clip(base + rng.integers(0, 40, size=(h, w, 3)), 0, 255).astype(np.uint8)
            if i % 2:
                Image.fromarray(pixels).convert("L").save(root / name / f"{i}.jpg", quality=90)
            else:
                Image.fromarray(pixels).save(root / name / f"{i}.png")
    (root / "cat" / "notes.txt").write_text("not an image: ignored")
    return str(root)


def one_line_error(result, *words):
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    # a cold numba cache adds its one compile notice (jit.COMPILE_NOTICE) before the error
    lines = [line for line in result.stderr.strip().splitlines() if line != jit.COMPILE_NOTICE]
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# ---- data ---------------------------------------------------------------------------------
def test_folder_loading_png_jpeg_gray_rgb(folder):
    data = datasets.load_dataset(folder, (3, 10, 10), classes=10)
    assert data.class_names == ["bird", "cat", "dog"]
    assert len(data.train) + len(data.heldout) == 12
    assert len(data.heldout) == 3 and sorted(data.heldout.labels) == [0, 1, 2]   # stratified
    assert data.train.images.shape[1:] == (3, 10, 10) and data.train.images.dtype == np.uint8
    assert data.flip_default and data.crop_pad_default == 1
    everything = np.concatenate([data.train.images, data.heldout.images])
    labels = np.concatenate([data.train.labels, data.heldout.labels])
    gray = [np.array_equal(img[0], img[1]) and np.array_equal(img[1], img[2]) for img in everything]
    assert 0 < sum(gray) < len(gray)            # JPEGs were gray: three equal channels
    # the dominant channel is the class colour for the RGB images
    for img, label in zip(everything, labels):
        if not np.array_equal(img[0], img[1]):
            assert img.reshape(3, -1).mean(axis=1).argmax() == label
    assert data.mean.shape == (3,) and np.all(data.std > 0)
    images, batch_labels = data.train_batch(np.arange(4), np.random.default_rng(0), crop_pad=1, flip=True)
    assert images.shape == (4, 3, 10, 10) and images.dtype == np.float32
    one = datasets.load_dataset(folder, (1, 6, 6), classes=3)
    assert one.train.images.shape[1:] == (1, 6, 6)


def test_mnist5k_split_and_padding():
    data = datasets.load_dataset("mnist5k", (3, 32, 32), classes=10, seed=5)
    assert (len(data.train), len(data.heldout)) == (4000, 1000)
    counts = np.bincount(data.heldout.labels, minlength=10)
    total = counts + np.bincount(data.train.labels, minlength=10)
    assert np.all(np.abs(counts - total * 0.2) <= 0.5)            # stratified
    assert np.array_equal(data.train.images[:, 0], data.train.images[:, 2])
    assert not data.train.images[:, :, :2].any() and not data.train.images[:, :, -2:].any()  # zero padding
    assert not data.flip_default
    again = datasets.load_dataset("mnist5k", (1, 20, 20), classes=10, seed=9)     # resized, same split
    assert np.array_equal(again.heldout.labels, data.heldout.labels)
    assert again.train.images.shape[1:] == (1, 20, 20)


def test_eval_pads_the_last_batch_and_counts_only_real_samples(tiny, folder):
    data = datasets.load_dataset(folder, (3, 8, 8), classes=3, holdout=0.5)
    assert len(data.heldout) % 4 != 0
    net4 = minigist.Net(tiny, seed=3)
    net1 = minigist.Net(tiny, batch_size=1, seed=3)
    names = trainer._output_names(net4)
    padded = trainer.evaluate(net4, data, data.heldout, 4, names)
    single = trainer.evaluate(net1, data, data.heldout, 1, names)
    assert padded["samples"] == single["samples"] == len(data.heldout)
    assert padded["correct"] == single["correct"]
    assert padded["loss"] == pytest.approx(single["loss"], rel=1e-4)


# ---- end to end ---------------------------------------------------------------------------
def test_help_explains_every_flag(train_help):
    result = train_help
    assert result.returncode == 0
    for flag in ("--model", "--data", "--input-size", "--batch-size", "--epochs", "--iters", "--lr",
                 "--momentum", "--weight-decay", "--lr-step", "--lr-gamma", "--alloc", "--device", "--seed",
                 "--checkpoint", "--resume", "--eval-every", "--plan-only", "--report-json", "--memory-budget",
                 "--log", "--plot", "--trace", "--summary", "--flip", "--holdout"):
        assert flag in result.stdout, flag
    assert "4,000 training / 1,000 held-out" in result.stdout
    assert "--gist" in result.stdout and "--dpr" in result.stdout


def test_folder_run_with_log_plot_trace_report(tiny, folder, tmp_path):
    log, plot, trace, report = (tmp_path / n for n in ("log.jsonl", "mem.png", "mem.json", "report.json"))
    result = run_cli("--model", tiny, "--data", folder, "--iters", 4, "--log", log, "--plot", plot,
                     "--trace", trace, "--report-json", report, "--train-eval-size", 4)
    assert result.returncode == 0, result.stderr
    assert "held-out accuracy" in result.stdout and "footprint" in result.stdout
    assert "without Gist" in result.stdout
    records = [json.loads(line) for line in log.read_text().splitlines()]
    events = [r["event"] for r in records]
    assert events[0] == "start" and events[-1] == "end" and events.count("iter") == 4
    epochs = [r for r in records if r["event"] == "epoch"]
    assert epochs and {"loss", "heldout_accuracy", "train_accuracy", "footprint_bytes"} <= set(epochs[-1])
    with Image.open(plot) as image:
        image.verify()
    with Image.open(plot) as image:
        assert image.format == "PNG" and image.size[0] > 600
    stored = json.loads(report.read_text())
    assert stored["footprint_bytes"] > 0 and stored["training"]["iterations"] == 4
    check_trace(json.loads(trace.read_text()), stored)


def check_trace(trace, report):
    assert isinstance(trace["traceEvents"], list)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == report["buffers"]
    assert len({e["name"] for e in complete}) == len(complete)
    for event in complete:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= set(event)
        assert event["dur"] >= 1 and 0 <= event["ts"] < report["steps"]
        assert event["args"]["bytes"] > 0 and event["args"]["offset"] is not None
    names = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert {e["args"]["name"].split(" (")[0] for e in names} <= set(minigist.program.CATEGORIES)
    # complete events on one thread nest or are disjoint
    by_thread = {}
    for event in complete:
        by_thread.setdefault(event["tid"], []).append((event["ts"], event["ts"] + event["dur"]))
    for spans in by_thread.values():
        open_ends = []
        for start, stop in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or stop <= open_ends[-1]
            open_ends.append(stop)


def test_plan_only_plot_and_trace(tmp_path):
    plot, trace = tmp_path / "p.png", tmp_path / "t.json"
    result = run_cli("--plan-only", "--model", "inception_small", "--batch-size", 2, "--plot", plot, "--trace", trace)
    assert result.returncode == 0, result.stderr
    with Image.open(plot) as image:
        assert image.format == "PNG"
    trace_data = json.loads(trace.read_text())
    report = trainer.plan_for(trainer.resolve_model("inception_small"),
                            make_args(batch_size=2, input_size=None, alloc="static"))
    check_trace(trace_data, report)
    counters = [e for e in trace_data["traceEvents"] if e["ph"] == "C"]
    assert max(sum(e["args"].values()) for e in counters) == report["live_peak_bytes"]


def make_args(**values):
    args = train.make_parser().parse_args([])
    for key, value in values.items():
        setattr(args, key, value)
    return args


@pytest.mark.slow
@pytest.mark.parametrize("model", ["vgg_small", "resnet20", "inception_small"])
def test_small_models_train_through_train_py(model, folder):
    result = run_cli("--model", model, "--data", folder, "--iters", 2, "--batch-size", 2, "--input-size", 16,
                     "--train-eval-size", 0, "--lr", 0.01)
    assert result.returncode == 0, result.stderr
    assert "epoch 1/1 (partial)" in result.stdout and "held-out acc" in result.stdout


def test_synthetic_data_and_eval_every(tiny):
    # a whole epoch in 19 steps of 50 rather than 238 of the file's 4: the same epoch end
    result = run_cli("--model", tiny, "--data", "synthetic", "--epochs", 1, "--holdout", 0.05,
                     "--train-eval-size", 8, "--eval-every", 0, "--batch-size", 50)
    assert result.returncode == 0, result.stderr
    assert "epoch 1/1 " in result.stdout


# ---- checkpoints --------------------------------------------------------------------------
def final_weights(folder):
    with np.load(os.path.join(folder, CHECKPOINT_NAME), allow_pickle=False) as stored:
        return {k: stored[k] for k in stored.files if not k.startswith("__")}


def test_trainer_from_python_trains_as_train_py_does(tiny, tmp_path):
    """minigist.trainer.run takes the flags' names as keywords: the same lines, the same weights."""
    settings = {"data": "synthetic", "holdout": 0.02, "iters": 3, "train_eval_size": 0, "conv": "im2col"}
    lines = []
    report = trainer.run(model=tiny, checkpoint=str(tmp_path / "python"), out=lines.append, **settings)
    assert report["training"]["iterations"] == 3
    flags = [arg for key, value in settings.items() for arg in ("--" + key.replace("_", "-"), value)]
    result = run_cli("--model", tiny, "--checkpoint", tmp_path / "cli", *flags)
    assert result.returncode == 0, result.stderr
    timing = re.compile(r"[0-9,.]+ (img/s|s this run|training images/s)")
    shown = [timing.sub("", line.replace(str(tmp_path / "python"), "DIR"))
             for entry in lines for line in entry.split("\n")]
    printed = [timing.sub("", line.replace(str(tmp_path / "cli"), "DIR")) for line in result.stdout.splitlines()]
    assert shown == [line for line in printed if line != jit.COMPILE_NOTICE]
    python_weights, cli_weights = final_weights(tmp_path / "python"), final_weights(tmp_path / "cli")
    assert python_weights.keys() == cli_weights.keys()
    assert all(np.array_equal(python_weights[key], cli_weights[key]) for key in python_weights)


@pytest.mark.slow
def test_resume_is_bitwise_identical(tiny, folder, tmp_path):
    common = ["--model", tiny, "--data", folder, "--train-eval-size", 0, "--lr-step", 1, "--lr-gamma", 0.5]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert run_cli(*common, "--iters", 7, "--checkpoint", whole).returncode == 0
    # stop mid-epoch (9 training images, batch 4: 3 iterations per epoch), then at an epoch end
    first = run_cli(*common, "--iters", 4, "--checkpoint", part)
    assert first.returncode == 0, first.stderr
    second = run_cli("--model", tiny, "--data", folder, "--checkpoint", part, "--resume", "--iters", 6)
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout
    third = run_cli("--checkpoint", part, "--resume", "--iters", 7, "--model", tiny)
    assert third.returncode == 0, third.stderr
    a, b = final_weights(whole), final_weights(part)
    assert a.keys() == b.keys() and any(k.startswith("momentum:") for k in a) and "bn.mean" in a
    for key in a:
        assert np.array_equal(a[key], b[key]), key
    mismatch = run_cli("--checkpoint", part, "--resume", "--momentum", 0.5)   # only the lr schedule may change
    one_line_error(mismatch, "--momentum")


@pytest.mark.slow
def test_killed_run_leaves_a_readable_checkpoint_and_resumes_exactly(tiny, tmp_path):
    common = ["--model", tiny, "--data", "synthetic", "--holdout", 0.02, "--train-eval-size", 0,
              "--checkpoint-every", 1, "--eval-every", 0]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert run_cli(*common, "--iters", 60, "--checkpoint", whole).returncode == 0
    process = subprocess.Popen([sys.executable, TRAIN, *map(str, [*common, "--iters", 60, "--checkpoint", part])],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.time() + 60
    while not (part / CHECKPOINT_NAME).exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.01)
    time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    meta, _, _ = read_checkpoint(str(part))          # readable wherever the kill landed
    assert meta["iteration"] >= 1
    resumed = run_cli("--checkpoint", part, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert not [name for name in os.listdir(part) if name.startswith(".tmp-")]
    a, b = final_weights(whole), final_weights(part)
    for key in a:
        assert np.array_equal(a[key], b[key]), key


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tiny, tmp_path):
    # the learning rate grows a million-fold every 2 iterations until the loss blows up
    result = run_cli("--model", tiny, "--data", "synthetic", "--holdout", 0.02, "--lr", 0.01, "--lr-step", 0.01,
                     "--lr-gamma", 1e6, "--iters", 50, "--checkpoint", tmp_path, "--checkpoint-every", 1,
                     "--train-eval-size", 0)
    line = one_line_error(result, "became", "--lr", "checkpoint")
    meta, _, values = read_checkpoint(str(tmp_path))
    assert meta["iteration"] >= 2 and f"iteration {meta['iteration']})" in line
    assert all(np.all(np.isfinite(v)) for v in values.values())


# ---- bad input ----------------------------------------------------------------------------
@pytest.mark.slow
def test_unknown_model_and_flag_values():
    one_line_error(run_cli("--model", "nosuchnet"), "nosuchnet", "bundled")
    one_line_error(run_cli("--alloc", "sometimes"), "--alloc")
    one_line_error(run_cli("--epochs", 2, "--iters", 3), "--iters")


@pytest.mark.slow
def test_more_flag_values():
    """The parser's other kinds of value (the quick test above has its choices) and a flag that
    needs another."""
    one_line_error(run_cli("--batch-size", "0"), "--batch-size")
    one_line_error(run_cli("--flip", "maybe"), "--flip")
    one_line_error(run_cli("--resume"), "--checkpoint")


def test_data_folder_errors(tmp_path, tiny):
    one_line_error(run_cli("--model", tiny, "--data", tmp_path / "missing"), "missing")
    broken = tmp_path / "broken"
    (broken / "a").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(broken / "a" / "good.png")
    (broken / "a" / "bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not really a jpeg")
    one_line_error(run_cli("--model", tiny, "--data", broken), "bad.jpg")


@pytest.mark.slow
def test_more_data_folder_errors(tmp_path, tiny):
    """An empty folder, a class folder without images, more class folders than classes (the
    last also in tests/test_data_input.py's quick test_fewer_classes_than_outputs_warns)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line_error(run_cli("--model", tiny, "--data", empty), "empty")
    uneven = tmp_path / "uneven"
    (uneven / "a").mkdir(parents=True)
    (uneven / "b").mkdir()
    Image.new("RGB", (8, 8)).save(uneven / "a" / "x.png")
    (uneven / "b" / "readme.txt").write_text("no images here")
    one_line_error(run_cli("--model", tiny, "--data", uneven), str(uneven / "b"), "no images")
    many = tmp_path / "many"
    for i in range(4):
        (many / f"c{i}").mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(many / f"c{i}" / "x.png")
    one_line_error(run_cli("--model", tiny, "--data", many), "4 class folders", "3 classes")


@pytest.mark.slow
def test_input_size_and_budget_errors():
    # `--plan-only --memory-budget 1MB` runs in tests/test_first_run.py, whose
    # test_the_plan_only_budget_error_lists_the_largest_buffers asserts this line and more
    one_line_error(run_cli("--model", "inception_v3", "--input-size", 32, "--iters", 1), "--input-size 32", "inception_v3")
    one_line_error(run_cli("--iters", 1, "--memory-budget", "1MB"), "--memory-budget")


def test_dataset_errors_in_process(tmp_path):
    with pytest.raises(MinigistError, match="no such folder"):
        datasets.load_dataset(str(tmp_path / "nope"), (3, 8, 8), 10)
    with pytest.raises(MinigistError, match="channel"):
        datasets.load_dataset("mnist5k", (4, 8, 8), 10)


def test_timeline_series_add_up_to_the_live_bytes_and_split_the_stash():
    from minigist import visualize
    from minigist.memory.report import footprint_report, live_by_step
    for gist in ("none", "all"):
        for alloc in ("none", "static", "dynamic"):
            args = make_args(batch_size=4, input_size=None, alloc=alloc)
            args.gist, args.dpr = gist, "fp16"
            plan = trainer.shapes_only_plan(trainer.resolve_model("vgg_small"), args)
            keys, matrix = visualize.live_series(plan, footprint_report(plan))
            assert np.array_equal(matrix.sum(axis=0), live_by_step(plan))
            labels = [visualize.series_label(key) for key in keys]
            if gist == "all":
                assert "encoded: fp16" in labels and "stash: decoded for backward" in labels
            else:      # no Gist: nothing encoded (max-pool argmax indices may still show as their dtype)
                assert not [label for label in labels if label.startswith("encoded") or "decoded" in label]


def test_lr_schedule_and_epoch_batches():
    args = make_args(lr=0.1, lr_step=1.5, lr_gamma=0.5)
    assert [trainer.lr_at(args, i, 10) for i in (0, 14, 15, 29, 30)] == [0.1, 0.1, 0.05, 0.05, 0.025]
    args.lr_step = 0
    assert trainer.lr_at(args, 1000, 10) == 0.1
    data = datasets.load_dataset("synthetic", (1, 4, 4), classes=2, holdout=0.0, synthetic_size=10)
    order = data.epoch_order(np.random.default_rng(0))
    batches = [data.epoch_batch(order, i, 4) for i in range(data.iters_per_epoch(4))]
    assert len(batches) == 3 and all(len(b) == 4 for b in batches)
    assert sorted(set(np.concatenate(batches))) == list(range(10))
    assert list(batches[-1][2:]) == list(order[:2])


# five 3x3 convolutions, each over the ReLU output of the one before: SSDC candidates whose
# stashes are all alive at the backward peak
SPARSE = "\n".join(
    ['name: "sparse"',
     'layer { name: "data" type: "Input" top: "data" top: "label"\n'
     '  input_param { shape { dim: 4 dim: 3 dim: 32 dim: 32 } shape { dim: 4 } } }']
    + [f'layer {{ name: "conv{i}" type: "Convolution" bottom: "{"data" if i == 1 else f"conv{i - 1}"}" '
       f'top: "conv{i}"\n  convolution_param {{ num_output: 32 kernel_size: 3 pad: 1 '
       f'weight_filler {{ type: "msra" }} }} }}\n'
       f'layer {{ name: "relu{i}" type: "ReLU" bottom: "conv{i}" top: "conv{i}" }}' for i in range(1, 6)]
    + ['layer { name: "fc" type: "InnerProduct" bottom: "conv5" top: "fc"\n'
       '  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }',
       'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }']) + "\n"


@pytest.mark.slow
def test_memory_budget_is_held_against_the_calibrated_plan(tmp_path):
    """With SSDC the plan shrinks once densities are measured: train.py checks its budget after
    calibration, so a budget that only the calibrated plan meets trains, and one below it fails
    with a one-line error."""
    path = tmp_path / "sparse.prototxt"
    path.write_text(SPARSE)
    net = minigist.Net(str(path), gist="lossless")
    uncalibrated = net.report()["footprint_bytes"]
    rng = np.random.default_rng(0)
    net.calibrate([(rng.standard_normal((4, 3, 32, 32)).astype(np.float32), rng.integers(0, 3, 4))])
    calibrated = net.report()["footprint_bytes"]
    assert calibrated < uncalibrated
    with pytest.raises(MemoryBudgetError):
        minigist.Net(str(path), gist="lossless", memory_budget=calibrated)   # uncalibrated: refused
    weights = {k: v.copy() for k, v in net.params().items()}
    with pytest.raises(MemoryBudgetError):
        net.set_memory_budget(calibrated - 1)
    net.set_memory_budget(calibrated)
    assert all(np.array_equal(v, net.params()[k]) for k, v in weights.items())
    # the CLI calibrates on mnist-like synthetic data, so give it room between its own two plans
    between = (calibrated + uncalibrated) // 2
    report_path = tmp_path / "report.json"
    result = run_cli("--model", path, "--data", "synthetic", "--gist", "lossless", "--iters", 1,
                     "--memory-budget", between, "--eval-every", 0, "--train-eval-size", 0,
                     "--report-json", report_path)
    assert result.returncode == 0, result.stderr
    # the run says it met the budget, and by how much
    report = json.loads(report_path.read_text())
    assert report["memory_budget_bytes"] == between
    spare = between - report["footprint_bytes"]
    assert spare >= 0
    assert f"memory budget    {between:>16,} B" in result.stdout and f"{spare:,} B to spare" in result.stdout
    planned = run_cli("--model", path, "--gist", "lossless", "--plan-only", "--memory-budget", 10 * uncalibrated)
    assert planned.returncode == 0, planned.stderr
    footprint = int(re.search(r"footprint +([\d,]+) B", planned.stdout).group(1).replace(",", ""))
    assert f"{10 * uncalibrated - footprint:,} B to spare" in planned.stdout
    one_line_error(run_cli("--model", path, "--data", "synthetic", "--gist", "lossless", "--iters", 1,
                           "--memory-budget", 10_000), "--memory-budget", "weights and optimizer state")


# ---- deploy files -------------------------------------------------------------------------
TINY_DEPLOY = os.path.join(ROOT, "tests", "data", "tiny_deploy.prototxt")


def test_training_a_deploy_file_is_a_one_line_error_naming_add_loss():
    line = one_line_error(run_cli("--model", TINY_DEPLOY, "--data", "synthetic", "--iters", 2),
                          "no loss layer to train", "--add-loss")
    assert TINY_DEPLOY in line


def test_plan_only_of_a_deploy_file_says_forward_only_or_plans_the_added_loss(tmp_path, capsys):
    report_path = tmp_path / "report.json"
    assert train.main(["--model", TINY_DEPLOY, "--plan-only", "--gist", "none",
                       "--report-json", str(report_path)]) == 0
    out = capsys.readouterr().out
    assert "forward only: no loss layer" in out
    report = json.loads(report_path.read_text())
    assert report["forward_only"] is True and report["backward_peak_bytes"] == 0
    assert train.main(["--model", TINY_DEPLOY, "--plan-only", "--gist", "none", "--add-loss",
                       "--report-json", str(report_path)]) == 0
    out = capsys.readouterr().out
    assert "forward only" not in out
    assert "added loss: SoftmaxWithLoss 'loss' on 'fc', the scores that feed the final Softmax 'prob'" in out
    report = json.loads(report_path.read_text())
    assert report["forward_only"] is False and report["backward_peak_bytes"] > 0
    assert report["footprint_bytes"] == minigist.plan_footprint(TINY_DEPLOY, add_loss=True, update="fused",
                                                                    conv=report["conv"])["footprint_bytes"]


@pytest.mark.parametrize("data", ["synthetic", "mnist5k"])
def test_deploy_file_trains_with_add_loss(data, capsys):
    assert train.main(["--model", TINY_DEPLOY, "--add-loss", "--data", data, "--iters", "2", "--gist", "none",
                       "--train-eval-size", "0", "--holdout", "0.02"]) == 0
    out = capsys.readouterr().out
    assert "added loss: SoftmaxWithLoss 'loss' on 'fc'" in out
    assert "epoch 1/1 (partial)" in out and "held-out acc" in out


def test_a_bottom_from_a_phase_excluded_layer_is_a_one_line_error():
    model = os.path.join(ROOT, "tests", "data", "phase_excluded.prototxt")
    one_line_error(run_cli("--model", model, "--data", "synthetic", "--iters", 1),
                   "phase_excluded.prototxt:19: layer 'accuracy': bottom 'scores' comes only from layer 'fc' "
                   "(line 10), which its include rule leaves out of the TEST phase")


def checkpoint_config(folder):
    with np.load(os.path.join(folder, CHECKPOINT_NAME), allow_pickle=False) as stored:
        return json.loads(stored["__meta__"].tobytes().decode("utf-8"))["config"]


@pytest.mark.slow
def test_conv_auto_names_and_records_the_engine_it_chose(tiny, tmp_path):
    """--conv auto (the default) runs oneDNN where it is installed and im2col otherwise; the
    printed lines, the report and the checkpoint name the engine chosen (never "auto"), and the
    checkpoint holds the thread count, so that a resume runs the same engine on the same threads."""
    from minigist import onednn
    common = ["--model", tiny, "--data", "synthetic", "--holdout", 0.02, "--train-eval-size", 0, "--eval-every", 0,
              "--iters", 2]
    env = dict(os.environ, MINIGIST_ONEDNN_LIB=str(tmp_path / "missing" / "libdnnl.so.3"))
    env.pop("OPENBLAS_NUM_THREADS", None)
    report = tmp_path / "r.json"
    without = subprocess.run([sys.executable, TRAIN, *map(str, common), "--checkpoint", tmp_path / "a",
                              "--report-json", report], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert without.returncode == 0, without.stderr
    assert "conv im2col)" in without.stdout.splitlines()[0]
    assert "conv: im2col, minigist's own (numpy + BLAS) (--conv auto: oneDNN unavailable:" in without.stdout
    assert ", 1 thread during the steps (the default for --conv im2col)" in without.stdout
    assert json.loads(report.read_text())["conv"] == "im2col"
    assert "conv im2col" in without.stdout.split("memory: ", 1)[1].splitlines()[0]
    config = checkpoint_config(tmp_path / "a")
    assert (config["conv"], config["threads"]) == ("im2col", 1)
    # a resume trains with the checkpoint's engine and says so, whatever --conv auto would pick now
    resumed = run_cli("--checkpoint", tmp_path / "a", "--resume", "--iters", 3)
    assert resumed.returncode == 0, resumed.stderr
    line = next(line for line in resumed.stdout.splitlines() if line.startswith("conv: "))
    assert line == "conv: im2col, minigist's own (numpy + BLAS) (the checkpoint's engine)"
    if not onednn.available():
        return
    run = run_cli(*common, "--checkpoint", tmp_path / "b", "--report-json", report)
    assert run.returncode == 0, run.stderr
    assert "conv onednn)" in run.stdout.splitlines()[0]
    config = checkpoint_config(tmp_path / "b")
    assert config["conv"] == json.loads(report.read_text())["conv"] == "onednn"
    assert config["threads"] == minigist.default_threads("onednn")
    resumed = run_cli("--checkpoint", tmp_path / "b", "--resume", "--conv", "auto", "--iters", 3)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{minigist.default_threads('onednn')} OpenMP thread" in resumed.stdout
    one_line_error(run_cli("--checkpoint", tmp_path / "b", "--resume", "--conv", "im2col"), "--conv")


# ---- calibration and random streams -------------------------------------------------------
@pytest.mark.slow
def test_lossless_trains_bit_for_bit_like_none_on_a_net_with_dropout(tiny, tmp_path):
    """Calibration (lossless measures SSDC's densities on a few batches first) leaves every
    random stream as it found it: Dropout's masks, and so the losses and the weights, are those
    of --gist none."""
    runs = {}
    for gist in ("none", "lossless"):
        log, folder = tmp_path / f"{gist}.jsonl", tmp_path / gist
        result = run_cli("--model", tiny, "--data", "synthetic", "--holdout", 0.02, "--train-eval-size", 0,
                         "--eval-every", 0, "--iters", 6, "--gist", gist, "--conv", "im2col",
                         "--log", log, "--checkpoint", folder)
        assert result.returncode == 0, result.stderr
        assert ("densities: measured on 3 training batches" in result.stdout) == (gist == "lossless")
        losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()
                  if json.loads(line)["event"] == "iter"]
        runs[gist] = losses, final_weights(folder)
    (losses_none, weights_none), (losses_lossless, weights_lossless) = runs["none"], runs["lossless"]
    assert len(losses_none) == 6 and losses_none == losses_lossless
    assert weights_none.keys() == weights_lossless.keys()
    for key in weights_none:
        assert np.array_equal(weights_none[key], weights_lossless[key]), key


# ---- the densities a plan from shapes alone assumes ----------------------------------------
def _plan_report(tmp_path, capsys, *argv):
    report_path = tmp_path / "plan.json"
    assert train.main(["--plan-only", "--conv", "im2col", "--report-json", str(report_path), *map(str, argv)]) == 0
    return json.loads(report_path.read_text()), capsys.readouterr().out


@pytest.mark.slow
def test_plan_only_takes_the_bundled_densities_as_the_gist_table_does(tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import gist_table
    bundled = os.path.join(ROOT, "models", "densities", "googlenet.json")
    report, out = _plan_report(tmp_path, capsys, "--model", "googlenet", "--batch-size", 64, "--gist", "all")
    table = minigist.plan_footprint(os.path.join(ROOT, "models", "googlenet.prototxt"), batch_size=64,
                                        gist="all", ssdc_density=gist_table.densities("googlenet"),
                                        update="fused", conv="im2col")
    assert report["footprint_bytes"] == table["footprint_bytes"] == 596_653_312
    assert report["densities"] == bundled and f"densities: {bundled} (44 tensors measured" in out
    report, out = _plan_report(tmp_path, capsys, "--model", "googlenet", "--batch-size", 64, "--gist", "all",
                               "--densities", "none")
    assert report["footprint_bytes"] == minigist.plan_footprint(
        os.path.join(ROOT, "models", "googlenet.prototxt"), batch_size=64, gist="all", update="fused",
        conv="im2col")["footprint_bytes"] == 685_181_440
    assert report["densities"] is None and "densities: none (--densities none)" in out
    # another input size than the measurement's: none, and the line says why
    report, out = _plan_report(tmp_path, capsys, "--model", "googlenet", "--batch-size", 2, "--gist", "lossless",
                               "--input-size", 192)
    assert report["densities"] is None and "for input size 224, not 192" in out
    # a file of the user's is read as it is
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"input_size": 224, "density": {"inception_3a/output": 0.5}}))
    report, out = _plan_report(tmp_path, capsys, "--model", "googlenet", "--batch-size", 2, "--gist", "lossless",
                               "--densities", mine)
    assert report["densities"] == str(mine) and "(1 tensors measured" in out


@pytest.mark.parametrize("content, words", [
    ("{not json", "is not JSON"),
    # each its own check in minigist.densities.read_densities, made one line by the same code: the
    # quick subset runs one
    pytest.param('{"density": [1, 2]}', 'no "density" object', marks=pytest.mark.slow),
    pytest.param('{"density": {"no_such_blob": 0.5}}', "'no_such_blob', which is no blob of", marks=pytest.mark.slow),
    pytest.param('{"density": {"inception_3a/output": 1.5}}', "not a fraction", marks=pytest.mark.slow),
    pytest.param('{"input_size": 299, "density": {}}', "measured at input size 299, this plan's is 224",
                 marks=pytest.mark.slow),
])
def test_a_bad_densities_file_is_one_line_naming_it(content, words, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    line = one_line_error(run_cli("--plan-only", "--model", "googlenet", "--batch-size", 2, "--gist", "all",
                                  "--densities", bad), "--densities", words)
    assert str(bad) in line


# ---- a TEST phase with its own batch size -------------------------------------------------
PHASE_BATCHES = """
name: "phase_batches"
layer { name: "data" type: "Input" top: "data" top: "label" include { phase: TRAIN }
  input_param { shape { dim: 2 dim: 1 dim: 8 dim: 8 } shape { dim: 2 } } }
layer { name: "data" type: "Input" top: "data" top: "label" include { phase: TEST }
  input_param { shape { dim: 7 dim: 1 dim: 8 dim: 8 } shape { dim: 7 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 16 kernel_size: 3 pad: 1 weight_filler { type: "msra" } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "fc" type: "InnerProduct" bottom: "conv" top: "fc"
  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "fc" bottom: "label" top: "acc" include { phase: TEST } }
"""


def test_evaluation_runs_at_the_test_batch_counting_a_padded_last_batch_exactly(tmp_path):
    path = tmp_path / "phase_batches.prototxt"
    path.write_text(PHASE_BATCHES)
    net = minigist.Net(str(path), alloc="static", conv="im2col")
    assert net.graphs["TEST"].batch_size == 7 and net.train_graph.batch_size == 2
    data = minigist.datasets.load_dataset("synthetic", (1, 8, 8), 3, holdout=0.2, synthetic_size=120)
    heldout = data.heldout          # 24 images: three batches of 7 and a padded one of 3
    assert len(heldout) % 7
    names = trainer._output_names(net)
    batched = trainer.evaluate(net, data, heldout, 7, names)
    # the reference: each image alone, through a TEST net of batch 1 with the same weights
    single = minigist.Net(str(path), batch_size=1, alloc="static", conv="im2col")
    single.restore(net.state())
    correct, loss = 0, 0.0
    for images, labels, real in data.eval_batches(heldout, 1):
        outputs = single.evaluate(images, labels)
        correct += int(outputs["acc"])
        loss += float(outputs["loss"])
    assert batched["samples"] == len(heldout) and batched["correct"] == correct
    assert batched["loss"] == pytest.approx(loss / len(heldout), rel=1e-6)
    # the arena holds the larger of training's and evaluation's per-iteration parts, and the
    # report, the plan from shapes alone and the arena agree on it to the byte
    report = net.report()
    assert report["evaluation"]["batch_size"] == 7
    assert report["footprint_with_evaluation_bytes"] > report["footprint_bytes"]
    assert report["footprint_with_evaluation_bytes"] == net.arena_bytes
    planned = minigist.plan_footprint(str(path), alloc="static", conv="im2col")
    assert planned["footprint_with_evaluation_bytes"] == net.arena_bytes
    assert planned["footprint_bytes"] == report["footprint_bytes"]
    assert "evaluation at batch 7 needs more than training" in minigist.memory.report.format_report(
        dict(report, model="phase_batches"))
    # a budget is held against the arena, evaluation's larger part included
    minigist.Net(str(path), alloc="static", conv="im2col", memory_budget=net.arena_bytes)
    with pytest.raises(minigist.errors.MemoryBudgetError, match="budget"):
        minigist.Net(str(path), alloc="static", conv="im2col", memory_budget=net.arena_bytes - 1)
    assert report["footprint_bytes"] < net.arena_bytes - 1
    # the library reads a size string as --memory-budget does, and refuses what is no size
    sized = minigist.Net(str(path), alloc="static", conv="im2col", memory_budget=f"{net.arena_bytes}B")
    assert sized.memory_budget == net.arena_bytes
    for bad in ("lots", -1, 2.5, True):
        with pytest.raises(minigist.errors.MinigistError, match="budget"):
            minigist.Net(str(path), alloc="static", conv="im2col", memory_budget=bad)
    # --batch-size sets both phases, as Caffe's own batch override would
    both = minigist.plan_footprint(str(path), batch_size=5, alloc="static", conv="im2col")
    assert both["evaluation"]["batch_size"] == both["batch_size"] == 5


@pytest.mark.slow
def test_a_resumed_run_keeps_evaluating_at_the_test_batch(tmp_path):
    """The checkpoint records the batch size as given (none here), so that a resume builds the
    TEST phase at its own batch size again, not at the training one."""
    path = tmp_path / "phase_batches.prototxt"
    path.write_text(PHASE_BATCHES)
    common = ["--model", path, "--data", "synthetic", "--holdout", 0.2, "--train-eval-size", 0, "--eval-every", 0,
              "--gist", "none"]
    first = run_cli(*common, "--iters", 2, "--checkpoint", tmp_path / "run")
    assert first.returncode == 0, first.stderr
    assert checkpoint_config(tmp_path / "run")["batch_size"] is None
    resumed = run_cli("--checkpoint", tmp_path / "run", "--resume", "--iters", 3)
    assert resumed.returncode == 0, resumed.stderr
    assert "held-out accuracy" in resumed.stdout
