"""What a new user meets on a first run: a line while the kernels compile, help that points
to the README instead of quoting measurements."""
import os
import subprocess
import sys

import pytest

from minigist import jit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = ("import numpy as np; from minigist import jit; jit.announce_compiles(); "
          "print(jit.float_bits_of_half(np.uint32(0x3C00)))")


def run_with_cache(cache):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)


@pytest.mark.skipif(not jit.available(), reason="numba is not installed")
def test_a_compile_is_announced_in_one_line_and_a_cache_load_is_not(tmp_path):
    first = run_with_cache(tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.strip() == str(0x3F800000)
    assert first.stderr.splitlines() == [jit.COMPILE_NOTICE]
    again = run_with_cache(tmp_path)          # the same kernel, now loaded from numba's cache
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stderr == ""
