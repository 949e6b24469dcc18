"""tools/gpu_check.py's structure without a GPU (--dry-run: the CPU's stand-in for cupy), and
its deadline. The real run needs a CUDA device: the README's GPU section gives the command."""
import json
import os
import subprocess
import sys

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
                     "05-dropout.json", "06-training.json", "07-checkpoint.json", "08-pool-peak.json",
                     "09-timing.json", "summary.json"]
    records = {name: json.loads((out / name).read_text()) for name in names if name != "summary.json"}
    status = {r["section"]: r["status"] for r in records.values()}
    assert status == {"environment": "passed", "pytest-gpu": "skipped", "codec-bytes": "passed",
                      "layer-kernels": "skipped", "dropout": "passed", "training": "passed", "checkpoint": "passed",
                      "pool-peak": "skipped", "timing": "skipped"}
    assert all(r["reason"] for r in records.values() if r["status"] == "skipped")
    assert len(records["03-codec-bytes.json"]["result"]) > 15
    assert result.stdout.strip().splitlines()[-1] == "sections: 5 passed, 0 failed, 4 skipped"


def test_no_section_starts_past_the_deadline(tmp_path):
    result, out = run(tmp_path, "--deadline", "0")
    records = [json.loads((out / name).read_text()) for name in sorted(os.listdir(out)) if name != "summary.json"]
    assert all(r["status"] == "skipped" for r in records)
    assert records[0]["reason"] == "the deadline (0 s) had passed"
    assert result.stdout.strip().splitlines()[-1] == "sections: 0 passed, 0 failed, 9 skipped"


@pytest.mark.slow
def test_without_a_gpu_the_real_run_says_so(tmp_path):
    import minigist
    if minigist.gpu_available():
        return
    result = subprocess.run([sys.executable, TOOL, "--out", str(tmp_path)], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 2 and "--dry-run" in result.stderr
