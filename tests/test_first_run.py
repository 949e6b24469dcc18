"""What a new user meets on a first run: a line while the kernels compile, help that points
to the README instead of quoting measurements."""
import os
import subprocess
import sys

import pytest

from minigist import jit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = ("import numpy as np; from minigist import jit; from minigist.layers import fused_kernels; "
          "jit.announce_compiles(); print(fused_kernels.half_bits_to_float(np.uint16(0x3C00)))")


def run_with_cache(cache):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)


@pytest.mark.slow
@pytest.mark.skipif(not jit.available(), reason="numba is not installed")
def test_a_compile_is_announced_in_one_line_and_a_cache_load_is_not(tmp_path):
    first = run_with_cache(tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.strip() == "1.0"
    assert first.stderr.splitlines() == [jit.COMPILE_NOTICE]
    again = run_with_cache(tmp_path)          # the same kernel, now loaded from numba's cache
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stderr == ""


def test_help_quotes_no_measured_figures(train_help):
    """Run times and accuracies live in the README, measured; --help points there."""
    result = train_help
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "README" in text
    for figure in ("123 s", "135 s", "98.3%", "1.4-2x", "2.6x", "< 3 min"):
        assert figure not in text, figure
    assert "default auto" in text or "auto (the default" in text


def test_the_datasets_docstring_calls_what_exists():
    import re
    from minigist import datasets
    called = set(re.findall(r"data\.(\w+)\(", datasets.__doc__))
    assert called and all(hasattr(datasets.Dataset, name) for name in called), called


def test_a_budget_from_python_names_no_cli_flag():
    import minigist
    from minigist.errors import MemoryBudgetError
    net = minigist.Net(os.path.join(ROOT, "models", "vgg_small.prototxt"), batch_size=2)
    with pytest.raises(MemoryBudgetError) as caught:
        net.set_memory_budget(1000)
    assert "--memory-budget" not in str(caught.value) and "largest buffers" in str(caught.value)


def test_the_plan_only_budget_error_lists_the_largest_buffers():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--plan-only", "--memory-budget",
                             "1MB"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line != jit.COMPILE_NOTICE]
    assert len(lines) == 1 and lines[0].startswith("train.py: error: --memory-budget: the static plan needs")
    assert "largest buffers:" in lines[0]


def test_the_plot_marks_an_update_phase_only_for_the_separate_update(tmp_path):
    import minigist
    from minigist import visualize
    from minigist.memory.plan import MemoryPlan
    from minigist.passes.inplace import mark_inplace
    graph = minigist.build_graph(os.path.join(ROOT, "models", "resnet20.prototxt"), "TRAIN", 4)
    fused = minigist.build_program(graph, train=True, fused_update=True)
    separate = minigist.build_program(graph, train=True, fused_update=False)
    assert fused.steps[-1].kind == "update"          # a fused update still ends the program...
    assert visualize._separate_update_starts(fused) is None    # ...but it is no phase of its own
    start = visualize._separate_update_starts(separate)
    assert start is not None and {s.kind for s in separate.steps[start:]} == {"update"}
    assert separate.steps[start - 1].kind != "update"
    visualize.plot_timeline(MemoryPlan(mark_inplace(fused), "static"), {"gist": {"mode": "all", "dpr": "fp8-e4m3"}},
                            tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0
