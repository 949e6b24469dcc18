"""Bad input ends in one line and exit status 2, and no run loses or misreads a checkpoint:
damaged checkpoints and weight files, sizes beyond the machine's memory, bad budgets and
output paths, deep nesting in a model file, decompression bombs, an edited model, a fresh run
over a checkpoint, a mistyped --resume folder, a NaN loss and Ctrl-C (issue #17)."""
import json
import os
import shlex
import signal
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
from PIL import Image

import minigist
from minigist import datasets, prototxt
from minigist.checkpoint import CHECKPOINT_NAME, arrays_digest, read_checkpoint
from minigist.cli_args import byte_size
from minigist.errors import MemoryBudgetError, MinigistError, ModelFileError
from minigist.memory.available import ENV_OVERRIDE

from test_train import ROOT, TINY, TRAIN, one_line_error, run_cli, tiny, train  # noqa: F401  (tiny: the fixture)

SYNTH = ["--data", "synthetic", "--holdout", 0.02, "--train-eval-size", 0, "--eval-every", 0]


@pytest.fixture(scope="module")
def checkpoint_file(tiny, tmp_path_factory):
    """A mid-epoch checkpoint (so it holds an epoch order too) and its bytes."""
    folder = tmp_path_factory.mktemp("ckpt")
    result = run_cli("--model", tiny, *SYNTH, "--iters", 2, "--checkpoint", folder)
    assert result.returncode == 0, result.stderr
    path = folder / CHECKPOINT_NAME
    return path, path.read_bytes()


def same_checkpoint(a, b):
    (meta_a, order_a, values_a), (meta_b, order_b, values_b) = a, b
    assert meta_a == meta_b
    assert (order_a is None and order_b is None) or np.array_equal(order_a, order_b)
    assert values_a.keys() == values_b.keys()
    for key in values_a:
        assert values_a[key].dtype == values_b[key].dtype and np.array_equal(values_a[key], values_b[key]), key


def damaged_copy(tmp_path, data):
    folder = tmp_path / "damaged"
    folder.mkdir(exist_ok=True)
    (folder / CHECKPOINT_NAME).write_bytes(data)
    return str(folder)


# ---- 1. damaged checkpoints, malformed metadata, Net.load --------------------------------
@pytest.mark.slow
def test_damaged_checkpoints_are_one_error_or_read_exactly(checkpoint_file, tmp_path):
    """Truncations at many offsets and single-byte flips all over the file: each is a
    MinigistError naming the file, or (a flip where neither zip nor the digest looks, e.g. a
    timestamp) a checkpoint read back exactly as written."""
    path, data = checkpoint_file
    original = read_checkpoint(str(path.parent))
    cuts = sorted(set([0, 1, 10, 22, 100, len(data) // 2, len(data) - 1]
                      + list(range(0, len(data), max(1, len(data) // 150)))))
    rng = np.random.default_rng(0)
    flips = sorted(set(rng.integers(0, len(data), 400).tolist() + list(range(0, 120)) + list(range(len(data) - 120, len(data)))))
    damaged, intact = 0, 0
    cases = [data[:cut] for cut in cuts]
    for offset in flips:
        flipped = bytearray(data)
        flipped[offset] ^= 0xFF if offset % 2 else 0x01
        cases.append(bytes(flipped))
    for case in cases:
        folder = damaged_copy(tmp_path, case)
        try:
            read = read_checkpoint(folder)
        except MinigistError as exc:
            assert CHECKPOINT_NAME in str(exc) and "\n" not in str(exc)
            damaged += 1
        else:
            same_checkpoint(read, original)
            intact += 1
    assert damaged > len(cuts) and intact > 0


# each cut fails in its own way inside zipfile (test_damaged_checkpoints_are_one_error_or_read_exactly
# checks read_checkpoint on every one); train.py turns each into the same line
@pytest.mark.parametrize("cut", [pytest.param(10, marks=pytest.mark.slow), pytest.param(100, marks=pytest.mark.slow),
                                 "middle"])
def test_truncated_checkpoint_on_resume_is_one_line(checkpoint_file, tmp_path, cut):
    path, data = checkpoint_file
    folder = damaged_copy(tmp_path, data[:len(data) // 2 if cut == "middle" else cut])
    one_line_error(run_cli("--checkpoint", folder, "--resume"), CHECKPOINT_NAME, "damaged")


def rewrite_meta(path, folder, change):
    """A copy of the checkpoint with its metadata edited by `change` (digest still valid)."""
    with np.load(path, allow_pickle=False) as stored:
        arrays = {k: stored[k] for k in stored.files}
    meta = json.loads(arrays.pop("__meta__").tobytes())
    change(meta)
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    os.makedirs(folder, exist_ok=True)
    np.savez(os.path.join(folder, CHECKPOINT_NAME), **arrays)
    return str(folder)


@pytest.mark.parametrize("change, words", [
    (lambda m: m.update(iteration="seven"), "iteration"),
    (lambda m: m.pop("config"), "config"),
    (lambda m: m["config"].pop("lr"), "lr"),
    (lambda m: m["config"].update(lr=-1), "lr"),
    (lambda m: m["config"].update(gist="sometimes"), "gist"),
    (lambda m: m["config"].update(batch_size=[4]), "batch_size"),
    (lambda m: m.update(data_rng={"bit_generator": "PCG64", "state": 3}), "metadata"),
    (lambda m: m.update(epoch_losses=["x"]), "epoch_losses"),
    (lambda m: m.update(digest="0" * 64), "digest"),
    (lambda m: m.update(batch_in_epoch=10**6), "epoch position"),
])
def test_malformed_metadata_is_one_error(checkpoint_file, tmp_path, change, words, capsys):
    path, _ = checkpoint_file
    folder = rewrite_meta(path, tmp_path / "meta", change)
    assert train.main(["--checkpoint", folder, "--resume", "--iters", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and CHECKPOINT_NAME in err[0] and words in err[0], err


def test_net_load_damaged_files(tiny, tmp_path):
    net = minigist.Net(tiny, seed=1)
    target = tmp_path / "w.npz"
    net.save(target, with_momentum=True)
    data = target.read_bytes()
    other = minigist.Net(tiny, seed=2)
    for cut in (10, 100, len(data) // 2, len(data) - 1):
        target.write_bytes(data[:cut])
        with pytest.raises(MinigistError, match="w.npz"):
            other.load(target)
    rng = np.random.default_rng(1)
    for offset in rng.integers(0, len(data), 150):
        flipped = bytearray(data)
        flipped[offset] ^= 0x5A
        target.write_bytes(bytes(flipped))
        try:
            other.load(target)
        except MinigistError as exc:
            assert "w.npz" in str(exc)
        else:
            for key, value in net.params().items():
                assert np.array_equal(other.params()[key], value), (offset, key)


# ---- 2. sizes beyond memory ---------------------------------------------------------------
@pytest.mark.slow
def test_sizes_beyond_memory_are_one_line_before_anything_is_allocated(tiny):
    line = one_line_error(run_cli("--model", tiny, "--data", "synthetic", "--input-size", 100000, "--iters", 1),
                          "needs at least", "bytes", "available")
    assert "input 3x100000x100000" in line and "iB)" in line
    line = one_line_error(run_cli("--model", tiny, "--data", "synthetic", "--batch-size", 100000000, "--iters", 1),
                          "batch 100000000", "bytes", "--batch-size")
    assert "--memory-budget" not in line      # no budget was given: the machine is the limit
    # with a budget too: one line, whichever limit is met first
    one_line_error(run_cli("--model", tiny, "--data", "synthetic", "--batch-size", 100000000, "--iters", 1,
                           "--memory-budget", "1MB"), "batch 100000000", "bytes")
    # the plan itself still works: shapes only, nothing allocated
    plan = run_cli("--model", tiny, "--batch-size", 100000000, "--plan-only")
    assert plan.returncode == 0, plan.stderr
    assert "footprint" in plan.stdout


def test_a_small_machine_refuses_in_one_line(tiny, monkeypatch):
    # half of what the net needs: its arena holds oneDNN's scratchpads, whose size depends on
    # the CPU's instruction set (a fixed 50,000 bytes was enough on an AVX2 CPU)
    needed = minigist.Net(tiny).arena_bytes
    env = dict(os.environ, **{ENV_OVERRIDE: str(needed // 2)})
    result = subprocess.run([sys.executable, TRAIN, "--model", tiny, *map(str, SYNTH), "--iters", "1"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    one_line_error(result, f"{needed // 2:,} bytes", ENV_OVERRIDE)
    monkeypatch.setenv(ENV_OVERRIDE, str(needed - 1))
    with pytest.raises(MemoryBudgetError, match=f"needs {needed:,} bytes"):
        minigist.Net(tiny)
    monkeypatch.setenv(ENV_OVERRIDE, str(needed))
    minigist.Net(tiny)


def test_integer_fields_are_bounded_as_in_caffe_proto(tmp_path):
    huge = TINY.replace("num_output: 3", "num_output: 1000000000000")
    with pytest.raises(ModelFileError, match="uint32") as caught:
        prototxt.parse(huge, "huge.prototxt")
    assert caught.value.line == TINY.splitlines().index(
        next(l for l in TINY.splitlines() if "num_output: 3" in l)) + 1
    path = tmp_path / "huge.prototxt"
    path.write_text(huge)
    one_line_error(run_cli("--model", path, "--data", "synthetic", "--iters", 1), "huge.prototxt:", "uint32")
    with pytest.raises(ModelFileError, match="int32"):
        prototxt.parse('layer { name: "a" type: "Flatten" flatten_param { axis: 2147483648 } }')
    prototxt.parse('input: "data" input_shape { dim: 3000000000 }')      # BlobShape's dims are int64
    big = TINY.replace("num_output: 3", "num_output: 4000000000")       # fits uint32, not the machine
    path.write_text(big)
    one_line_error(run_cli("--model", path, "--data", "synthetic", "--iters", 1), "needs at least", "bytes")


# ---- 3. memory budgets ---------------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (["--memory-budget=-5GB"], "must be positive"),
    (["--memory-budget", "-5GB"], "must be positive"),
    (["--memory-budget", "0"], "must be positive"),
    (["--memory-budget", "1.5"], "a whole number"),
    (["--memory-budget", "1e999"], "too large"),
    (["--memory-budget", "1e999GiB"], "too large"),
])
def test_memory_budget_values(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        train.main(["--plan-only", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--memory-budget" in err[0] and words in err[0], err
    assert byte_size("1.5GiB") == 3 * 2**29 and byte_size("2e-3GB") == 2 * 10**6


# ---- 4. output paths -----------------------------------------------------------------------
# one loop checks the four paths (minigist.trainer.check_output_paths): the quick subset runs one
@pytest.mark.parametrize("flag", ["--report-json"] + [pytest.param(flag, marks=pytest.mark.slow)
                                                      for flag in ("--plot", "--trace", "--log")])
def test_output_paths_are_checked_before_training(flag, tiny, tmp_path):
    start = time.perf_counter()
    result = run_cli("--model", tiny, *SYNTH, "--iters", 1, flag, tmp_path / "no" / "such" / "out.x")
    one_line_error(result, flag, "does not exist")
    assert "epoch" not in result.stdout
    one_line_error(run_cli("--model", tiny, *SYNTH, "--iters", 1, flag, tmp_path), flag, "is a folder")
    if os.geteuid() != 0:       # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        one_line_error(run_cli("--model", tiny, *SYNTH, "--iters", 1, flag, locked / "x"), flag, "Permission denied")
    assert time.perf_counter() - start < 60


@pytest.mark.parametrize("flag", ["--plan-only", "--summary"])
def test_a_missing_data_folder_is_refused_where_no_image_is_read(flag, tmp_path):
    """--data names nothing: refused as a training run refuses it, though the plan reads
    no image (it ran and exited 0)."""
    one_line_error(run_cli(flag, "--model", "vgg_small", "--data", tmp_path / "missing"), "--data",
                   "no such folder or bundled dataset")
    (tmp_path / "file").write_text("x")
    one_line_error(run_cli(flag, "--model", "vgg_small", "--data", tmp_path / "file"), "--data", "is not a folder")


def test_plan_only_output_paths_too(tmp_path):
    one_line_error(run_cli("--plan-only", "--model", "vgg_small", "--report-json", tmp_path / "none" / "r.json"),
                   "--report-json", "does not exist")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="no /proc: a folder that refuses new files is needed")
@pytest.mark.parametrize("flag", ["--report-json", "--plot"])
def test_a_folder_that_refuses_new_files_is_named_before_the_plan(flag):
    """/proc has write permission for root but takes no new file: the path is tried, not
    only its permission bits (the report used to print, then a traceback)."""
    result = run_cli("--plan-only", "--model", "vgg_small", flag, "/proc/minigist-out.png")
    one_line_error(result, flag, "cannot write /proc/minigist-out.png")
    assert "footprint" not in result.stdout


def test_a_folder_or_a_malformed_number_for_a_model_is_one_line(tmp_path):
    one_line_error(run_cli("--model", tmp_path, "--plan-only"), "--model", "is a folder")
    with pytest.raises(ModelFileError, match="malformed number '3x'") as caught:
        prototxt.parse('name: "n"\nlayer { name: "c" type: "Convolution"\n convolution_param { kernel_size: 3x } }')
    assert caught.value.line == 3
    with pytest.raises(ModelFileError, match="malformed number '0x10'"):
        prototxt.parse("a: 0x10")
    assert prototxt.parse('input_dim: 1 input_dim: 3').all("input_dim") == [1, 3]


# ---- 5. nesting ------------------------------------------------------------------------------
def test_deep_nesting_is_one_model_file_error(tmp_path):
    deep = 'name: "deep"\nlayer { name: "p" type: "Python"\n python_param ' + "{ a " * 10000 + "}" * 10001 + " }\n"
    with pytest.raises(ModelFileError, match="nested more than") as caught:
        prototxt.parse(deep, "deep.prototxt")
    assert caught.value.line == 3
    path = tmp_path / "deep.prototxt"
    path.write_text(deep)
    one_line_error(run_cli("--model", path, "--summary"), "deep.prototxt:3:", "nested")
    prototxt.parse("layer { python_param { " + "a { " * 90 + "b: 1 " + "} " * 90 + "} }")      # deep but legal


# ---- 6. decompression bombs ----------------------------------------------------------------
def png_claiming(path, width, height):
    """A real PNG whose IHDR header claims width x height pixels (CRC fixed up)."""
    Image.new("RGB", (4, 4)).save(path)
    data = bytearray(path.read_bytes())
    ihdr = data.index(b"IHDR")
    data[ihdr + 4:ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17:ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr:ihdr + 17])))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("side", [20000, 10000])     # above Pillow's refusal, and above its warning
def test_decompression_bomb_is_one_line_naming_the_image(side, tmp_path, tiny):
    root = tmp_path / "bombs"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    Image.new("RGB", (8, 8)).save(root / "a" / "fine.png")
    png_claiming(root / "b" / "bomb.png", side, side)
    with pytest.raises(MinigistError, match="bomb.png"):
        datasets.decode_image(str(root / "b" / "bomb.png"), 3, 8, 8)
    one_line_error(run_cli("--model", tiny, "--data", root, "--iters", 1), "bomb.png")


# ---- 8. an edited model ----------------------------------------------------------------------
@pytest.mark.slow
def test_edited_model_is_refused_on_resume_naming_what_changed(tmp_path):
    model = tmp_path / "net.prototxt"
    model.write_text(TINY)
    folder = tmp_path / "run"
    assert run_cli("--model", model, *SYNTH, "--iters", 2, "--checkpoint", folder).returncode == 0
    model.write_text("# a comment changes nothing\n" + TINY.replace("pool: MAX", "pool: AVE"))
    line = one_line_error(run_cli("--checkpoint", folder, "--resume", "--iters", 3), "layer 'pool'",
                          "pooling_param.pool", "MAX", "AVE", "--allow-model-change")
    assert "net.prototxt" in line
    allowed = run_cli("--checkpoint", folder, "--resume", "--iters", 3, "--allow-model-change")
    assert allowed.returncode == 0, allowed.stderr
    meta, _, _ = read_checkpoint(str(folder))
    assert meta["iteration"] == 3 and "pooling_param.pool" in meta["changes"][-1]["model"]
    model.write_text(TINY.replace("pool: MAX", "pool: AVE").replace('layer { name: "drop"', 'layer { name: "drop2"'))
    one_line_error(run_cli("--checkpoint", folder, "--resume", "--iters", 4), "layer 'drop' was removed")


# ---- 11, 12. fresh runs over a checkpoint, --resume without one ------------------------------
@pytest.mark.slow
def test_fresh_run_over_a_checkpoint_is_refused(checkpoint_file, tiny, tmp_path):
    (tmp_path / CHECKPOINT_NAME).write_bytes(checkpoint_file[1])      # train.py's, at iteration 2
    one_line_error(run_cli("--model", tiny, *SYNTH, "--iters", 3, "--checkpoint", tmp_path),
                   "iteration 2", "--resume", "--overwrite")
    assert read_checkpoint(str(tmp_path))[0]["iteration"] == 2
    replaced = run_cli("--model", tiny, *SYNTH, "--iters", 3, "--checkpoint", tmp_path, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert read_checkpoint(str(tmp_path))[0]["iteration"] == 3
    one_line_error(run_cli("--checkpoint", tmp_path, "--resume", "--overwrite"), "--overwrite")


@pytest.mark.slow
def test_resume_needs_a_checkpoint_unless_asked_if_present(tiny, tmp_path):
    mistyped = tmp_path / "rnus"
    line = one_line_error(run_cli("--model", tiny, *SYNTH, "--iters", 2, "--checkpoint", mistyped, "--resume"),
                          str(mistyped), "--resume-if-present")
    assert not mistyped.exists() and "no checkpoint" in line
    first = run_cli("--model", tiny, *SYNTH, "--iters", 2, "--checkpoint", mistyped, "--resume-if-present")
    assert first.returncode == 0 and "starting from scratch" in first.stdout
    again = run_cli("--model", tiny, *SYNTH, "--iters", 3, "--checkpoint", mistyped, "--resume-if-present")
    assert again.returncode == 0 and "resumed from" in again.stdout
    assert read_checkpoint(str(mistyped))[0]["iteration"] == 3


# ---- 13. a NaN loss, then the advice followed ------------------------------------------------
@pytest.mark.slow
def test_nan_loss_advice_resumes_with_a_lower_lr(tiny, tmp_path):
    """A resume with a much higher lr blows up; the message names the checkpoint it keeps (the
    iteration-3 one, finite) and the command to resume it with a lower lr, which now works."""
    assert run_cli("--model", tiny, *SYNTH, "--lr", 0.01, "--iters", 3, "--checkpoint", tmp_path).returncode == 0
    result = run_cli("--checkpoint", tmp_path, "--resume", "--lr", 1e10, "--iters", 30)
    line = one_line_error(result, "became", "iteration 3)", "every value in it finite", "--resume --lr 1e+09")
    assert "good" not in line
    command = shlex.split(line.split("learning rate: ", 1)[1])
    assert command[0] == "python" and os.path.basename(command[1]) == "train.py" and command[-2:] == ["--lr", "1e+09"]
    resumed = run_cli(*command[2:-1], 0.001)
    assert resumed.returncode == 0, resumed.stderr
    assert "--lr 0.001 from iteration 3 on (was 0.01" in resumed.stdout
    after, _, _ = read_checkpoint(str(tmp_path))
    assert after["iteration"] == 30 and after["config"]["lr"] == 0.001
    assert after["changes"] == [{"lr": [0.01, 0.001], "iteration": 3}]


def test_checkpoint_holding_nan_is_never_resumed(checkpoint_file, tmp_path):
    path, _ = checkpoint_file
    with np.load(path, allow_pickle=False) as stored:
        arrays = {k: stored[k] for k in stored.files}
    meta = json.loads(arrays.pop("__meta__").tobytes())
    arrays["conv.weight"] = arrays["conv.weight"].copy()
    arrays["conv.weight"].flat[0] = np.nan
    meta["digest"] = arrays_digest(arrays)
    arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(tmp_path / CHECKPOINT_NAME, **arrays)
    one_line_error(run_cli("--checkpoint", tmp_path, "--resume"), "conv.weight", "NaN")


# ---- 14. Ctrl-C --------------------------------------------------------------------------------
@pytest.mark.slow
def test_ctrl_c_names_the_iteration_and_the_resume_command(tiny, tmp_path):
    argv = ["--model", tiny, *map(str, SYNTH), "--iters", "100000", "--checkpoint", str(tmp_path),
            "--checkpoint-every", "1"]
    # SIGINT at its default in the child, so that Python installs its handler there: a shell's
    # background job (nohup, `pytest &` in a script) starts with SIGINT ignored, and the child
    # would inherit that and never see the Ctrl-C
    process = subprocess.Popen([sys.executable, TRAIN, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, cwd=ROOT, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 60
        while not (tmp_path / CHECKPOINT_NAME).exists() and time.time() < deadline and process.poll() is None:
            time.sleep(0.02)
        time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:                                  # a run that ignored the Ctrl-C would train on (100,000 iterations)
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, err
    line = err.strip().splitlines()[-1]
    held = read_checkpoint(str(tmp_path))[0]["iteration"]
    assert f"holds iteration {held};" in line, line
    command = shlex.split(line.split("resume with: ", 1)[1])
    assert command[2:] == argv + ["--resume"]
    resumed = run_cli(*[a.replace("100000", str(held + 1)) for a in command[2:]])
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr


# ---- a model whose input is no image --------------------------------------------------------
def test_a_model_whose_input_is_no_image_is_one_line(tmp_path):
    mlp = tmp_path / "mlp.prototxt"
    mlp.write_text('name: "mlp"\n'
                   'layer { name: "data" type: "Input" top: "data" top: "label"\n'
                   '        input_param { shape { dim: 4 dim: 6 } shape { dim: 4 } } }\n'
                   'layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc"\n'
                   '        inner_product_param { num_output: 3 } }\n'
                   'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }\n')
    one_line_error(run_cli("--model", mlp, *SYNTH, "--iters", 1), "--data", "feeds images")


# ---- a new user's trial: flags that were ignored or crashed ---------------------------------
@pytest.mark.parametrize("extra,flag,words", [
    (["--seed", "-1"], "--seed", "non-negative"),
    (["--checkpoint-every", "5"], "--checkpoint-every", "needs --checkpoint"),
    (["--report-json", ""], "--report-json", "an empty file name"),
    (["--plot", "out.jpg"], "--plot", "ending in .png"),
])
def test_flags_that_cannot_work_are_one_line(extra, flag, words, tiny, tmp_path):
    one_line_error(run_cli("--model", tiny, *SYNTH, "--iters", 1, *extra), flag, words)


def test_net_refuses_a_negative_seed(tiny):
    with pytest.raises(MinigistError, match="seed: a non-negative integer"):
        minigist.Net(tiny, batch_size=2, seed=-1)


def test_a_link_to_nothing_in_an_image_folder_is_one_line(tmp_path, tiny):
    root = tmp_path / "images"
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(root / name / "one.png")
    (root / "b" / "gone.png").symlink_to(tmp_path / "nowhere.png")
    one_line_error(run_cli("--model", tiny, "--data", root, "--iters", 1), "gone.png", "a link to nothing")


def test_a_pickled_file_is_no_checkpoint_and_gets_no_advice_to_unpickle(tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    np.savez(folder / CHECKPOINT_NAME, x=np.array([{"a": 1}], dtype=object))
    with pytest.raises(MinigistError) as error:
        read_checkpoint(str(folder))
    message = str(error.value)
    assert "would unpickle Python objects, which is never done" in message and "allow_pickle" not in message
    (folder / CHECKPOINT_NAME).write_bytes(b"garbage\n")      # numpy takes any other file for a pickle
    with pytest.raises(MinigistError) as error:
        read_checkpoint(str(folder))
    assert "is not an .npz file (it does not begin as a zip archive does)" in str(error.value)
    assert "unpickle" not in str(error.value)


def test_a_dpr_format_without_a_lossy_mode_is_named():
    result = run_cli("--plan-only", "--model", "vgg_small", "--gist", "lossless", "--dpr", "fp8-e5m2")
    assert result.returncode == 0 and "note: --dpr fp8-e5m2 changes nothing under --gist lossless" in result.stdout
    result = run_cli("--plan-only", "--model", "vgg_small", "--gist", "all", "--dpr", "fp8-e5m2")
    assert result.returncode == 0 and "note: --dpr" not in result.stdout


# ---- a second new user's trial ---------------------------------------------------------------
@pytest.mark.parametrize("argv, words", [
    (["--batch-size", "99999999999999999999"], "at most 4,294,967,295"),     # was an OverflowError
    (["--batch-size", str(2**50)], "at most 4,294,967,295"),                  # was minutes of factoring
    (["--input-size", str(2**32)], "at most 4,294,967,295"),
    (["--seed", str(2**64)], "at most 18,446,744,073,709,551,615"),
    (["--shard", "weights"], "give --ranks N"),          # a plan for one process shards nothing
])
def test_plan_only_flags_beyond_what_a_plan_means_are_one_line(argv, words):
    result = run_cli("--plan-only", "--model", "vgg_small", *argv)
    one_line_error(result, argv[0], words)


def test_the_largest_batch_and_seed_still_plan():
    result = run_cli("--plan-only", "--model", "vgg_small", "--batch-size", 2**32 - 1, "--seed", 2**64 - 1,
                     "--conv", "im2col", timeout=60)
    assert result.returncode == 0, result.stderr
    assert "batch 4294967295" in result.stdout


def test_a_convolution_onednn_cannot_make_is_one_line_naming_the_layer(tmp_path):
    from minigist import onednn
    if not onednn.available():
        pytest.skip("oneDNN is not installed")
    model = tmp_path / "wide.prototxt"
    model.write_text('name: "wide"\n'
                     'layer { name: "data" type: "Input" top: "data" top: "label"\n'
                     '        input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 } } }\n'
                     'layer { name: "wide" type: "Convolution" bottom: "data" top: "wide"\n'
                     '        convolution_param { num_output: 4294967295 kernel_size: 3 } }\n'
                     'layer { name: "pool" type: "Pooling" bottom: "wide" top: "pool"\n'
                     '        pooling_param { pool: AVE global_pooling: true } }\n'
                     'layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip"\n'
                     '        inner_product_param { num_output: 2 } }\n'
                     'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }\n')
    one_line_error(run_cli("--plan-only", "--model", model, "--conv", "onednn"), "layer 'wide'",
                   "oneDNN cannot make this convolution", "--conv im2col")


def test_an_output_path_under_a_file_says_it_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    one_line_error(run_cli("--plan-only", "--model", "vgg_small", "--plot", tmp_path / "afile" / "x.png"),
                   "--plot", "afile is a file, not a folder")


def test_one_class_is_named_in_the_singular():
    data = type("Data", (), {"classes": 1})()
    from minigist.trainer import class_count_note
    assert class_count_note(data, 10, "d") == ("warning: --data d has 1 class, the model predicts 10: 9 outputs "
                                               "are never a label (use a model with 1 output)")


def test_resuming_a_finished_run_says_nothing_is_left(checkpoint_file, tmp_path):
    path, data = checkpoint_file
    folder = tmp_path / "finished"
    folder.mkdir()
    (folder / CHECKPOINT_NAME).write_bytes(data)
    result = run_cli("--checkpoint", folder, "--resume")           # the run's own 2 iterations
    assert result.returncode == 0, result.stderr
    assert "the checkpoint holds iteration 2 of 2: nothing is left to train" in result.stdout
    assert "done: 2 iterations (" in result.stdout and "; resumed at 2) in " in result.stdout


def test_a_run_on_more_threads_than_openmp_can_start_is_one_line(tiny):
    """100,000 OpenMP threads ended in a segmentation fault as they started; a plan from
    shapes alone still takes the count (its workspaces grow with it)."""
    one_line_error(run_cli("--model", tiny, *SYNTH, "--iters", 1, "--threads", 100000), "--threads",
                   "at most 1,024 threads", "100,000")
    with pytest.raises(MinigistError, match="at most 1,024 threads, got 1,025"):
        minigist.Net(tiny, batch_size=2, threads=1025)
    planned = run_cli("--plan-only", "--model", tiny, "--threads", 100000)
    assert planned.returncode == 0, planned.stderr


# ---- a third trial: the optimizer's and ONNX's paths -------------------------------------------
@pytest.mark.parametrize("argv, flag, words", [
    (["--optimize", "--report-json", "fr.json"], "--report-json", "prints the frontier and writes no report"),
    (["--optimize", "--trace", "fr.json"], "--trace", "prints the frontier and writes no trace"),
    (["--log", "x.log"], "--log", "--plan-only trains nothing"),
])
def test_plan_only_outputs_that_would_not_be_written_are_refused(argv, flag, words, tmp_path):
    argv = [str(tmp_path / a) if a.endswith((".json", ".log")) else a for a in argv]
    result = run_cli("--plan-only", "--model", "resnet20", *argv)
    one_line_error(result, flag, words)
    assert not any(tmp_path.iterdir())


def test_an_empty_onnx_file_is_named_as_no_model(tmp_path):
    pytest.importorskip("onnx")
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    one_line_error(run_cli("--model", empty, "--add-loss", "--plan-only"), "empty.onnx", "holds no graph")


def test_a_size_in_scientific_notation_is_exact():
    assert byte_size("1e30") == 10**30 and byte_size("2.5e3KiB") == 2_560_000
