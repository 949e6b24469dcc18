"""tools/accuracy_table.py, the README's accuracy tables: one row per model and mode, parsed from
train.py's own output, and a failed run named in its row and in the exit status."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "accuracy_table.py")
SHORT = ["--", "--iters", "2", "--eval-every", "0", "--train-eval-size", "0", "--holdout", "0.02"]


def run_tool(*argv):
    return subprocess.run([sys.executable, TOOL, *argv], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_a_row_per_model_and_mode_from_train_pys_output():
    run = run_tool("--models", "resnet20", "--modes", "default,none", *SHORT)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line.split(" | ") for line in run.stdout.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [("| resnet20", "default"), ("| resnet20", "none")]
    for row in rows:
        correct, total = row[2].split("(")[1].rstrip(")").split("/")
        assert 0 <= int(correct) <= int(total) == 100          # 2% of mnist5k's 5,000 images
    # the default run is lossless: less than none's footprint
    assert float(rows[0][4]) < float(rows[1][4])


def test_a_failed_run_is_named_and_the_status_is_one():
    run = run_tool("--models", "no_such_model", "--modes", "none", *SHORT)
    assert run.returncode == 1
    assert "| no_such_model | none | failed: " in run.stdout and "no_such_model" in run.stdout.split("failed: ")[1]


def test_an_unknown_mode_is_a_usage_error():
    run = run_tool("--modes", "lossy fp12")
    assert run.returncode == 2 and "unknown lossy fp12" in run.stderr
