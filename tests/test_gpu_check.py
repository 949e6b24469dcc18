"""tools/gpu_check.py's structure without a GPU (--dry-run: the CPU's stand-in for cupy), and
its deadline. The real run needs a CUDA device: the README's GPU section gives the command."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
TOOL = os.path.join(ROOT, "tools", "gpu_check.py")

sys.path.insert(0, os.path.dirname(__file__))
from test_cupy_rules import TINY  # noqa: E402


# without Dropout: its GPU stream is not numpy's, and the training section compares losses
NO_DROPOUT = "\n".join(line for line in TINY.splitlines() if '"Dropout"' not in line)


def run(tmp_path, *extra):
    model = tmp_path / "tiny.prototxt"
    model.write_text(NO_DROPOUT)
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, TOOL, "--dry-run", "--out", str(out), "--models", str(model)] + list(extra),
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    return result, out


@pytest.mark.slow
def test_a_dry_run_writes_every_section_and_skips_what_needs_a_gpu(tmp_path):
    result, out = run(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    names = sorted(os.listdir(out))
    assert names == ["01-environment.json", "02-pytest-gpu.json", "03-codec-bytes.json", "04-layer-kernels.json",
                     "05-dropout.json", "06-training.json", "07-recompute.json", "08-checkpoint.json",
                     "09-pool-peak.json", "10-timing.json", "summary.json"]
    records = {name: json.loads((out / name).read_text()) for name in names if name != "summary.json"}
    status = {r["section"]: r["status"] for r in records.values()}
    assert status == {"environment": "passed", "pytest-gpu": "skipped", "codec-bytes": "passed",
                      "layer-kernels": "skipped", "dropout": "passed", "training": "passed", "recompute": "passed",
                      "checkpoint": "passed",
                      "pool-peak": "skipped", "timing": "skipped"}
    assert all(r["reason"] for r in records.values() if r["status"] == "skipped")
    assert len(records["03-codec-bytes.json"]["result"]) > 15
    assert any(c.startswith("recompute") for c in records["07-recompute.json"]["result"][0]["choices"])
    assert result.stdout.strip().splitlines()[-1] == "sections: 6 passed, 0 failed, 4 skipped"


def test_no_section_starts_past_the_deadline(tmp_path):
    result, out = run(tmp_path, "--deadline", "0")
    records = [json.loads((out / name).read_text()) for name in sorted(os.listdir(out)) if name != "summary.json"]
    assert all(r["status"] == "skipped" for r in records)
    assert records[0]["reason"] == "the deadline (0 s) had passed"
    assert result.stdout.strip().splitlines()[-1] == "sections: 0 passed, 0 failed, 10 skipped"


@pytest.mark.slow
def test_without_a_gpu_the_real_run_says_so(tmp_path):
    import minigist
    if minigist.gpu_available():
        return
    result = subprocess.run([sys.executable, TOOL, "--out", str(tmp_path)], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 2 and "--dry-run" in result.stderr


def test_ssdc_decode_workspace_holds_the_gpu_row_offsets_of_a_tensor_wider_than_its_chunk():
    # ResNet-50 at batch 64 stashes 64x256x56x56 ReLU outputs for SSDC: 200,704 rows of 256
    # against a default chunk whose int64 index holds 131,072 int32
    from minigist.codecs.ssdc import ROW, SSDC
    shape = (64, 256, 56, 56)
    decl = SSDC(1000).workspace(shape, "decode")["index"]
    rows = -(-int(np.prod(shape)) // ROW)
    assert 2 * decl.shape[0] >= rows + 1
    from minigist.codecs.bits import CHUNK
    small = SSDC(1000).workspace((8, 64, 32, 32), "decode")["index"]
    assert small.shape == (CHUNK,)      # unchanged where the chunk's room suffices


def test_the_gpu_profile_times_every_step_where_no_gpu_is(tmp_path):
    model = tmp_path / "tiny.prototxt"
    model.write_text(NO_DROPOUT)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_profile.py"), "--device", "cpu",
                             "--models", str(model), "--gist", "none,all", "--batch-size", "4", "--repeats", "2",
                             "--top", "3", "--host-profile", "5"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    heads = [line for line in result.stdout.splitlines() if not line.startswith(" ")]
    assert [h.split(":")[0] for h in heads] == [f"{model} none batch 4", f"{model} all batch 4"]
    steps = [int(h.rsplit(",", 1)[1].split()[0]) for h in heads]
    assert steps[1] > steps[0]        # Gist's encode and decode steps
    assert "tottime" in result.stdout
