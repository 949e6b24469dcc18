"""The benches run: each is a script nobody imports, so a change elsewhere can break one
unnoticed (bench/microbatch_overhead.py did when side_by_side began returning a pair). The
smallest run of each cheap one; the figures themselves are not checked, only that the run
finishes and prints its row."""
import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def run_bench(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", args[0]), *args[1:]],
                          capture_output=True, text=True, timeout=600)


def test_microbatch_overhead_prints_a_row_and_the_front_keeps_the_weights():
    result = run_bench("microbatch_overhead.py", "--fronts", "pool2:4", "--repeats", "1")
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("| pool2:4 |")]
    assert len(rows) == 1
    assert re.match(r"\| pool2:4 \| \d+\.\d\dx \| [+-]\d+\.\d% \| [+-]\d+\.\d% \| identical \|$", rows[0])


def test_frontier_table_prints_each_cell_on_stderr_as_it_is_found():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "frontier_table.py"), "--models", "alexnet",
                             "--columns", "lossless bound", "fp16 bound"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    row = [line for line in result.stdout.splitlines() if line.startswith("| alexnet |")]
    assert len(row) == 1
    table_cells = [cell.strip() for cell in row[0].strip("|").split("|")[2:]]
    found = re.findall(r"^alexnet (lossless bound|fp16 bound): (\d+\.\d\dx) after \d+ s$", result.stderr, re.M)
    assert found == [("lossless bound", table_cells[0]), ("fp16 bound", table_cells[1])]
