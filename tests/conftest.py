"""Shared fixtures."""
import os
import subprocess
import sys

import pytest

from minigist import jit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(params=["xp", "kernels"])
def kernel_path(request):
    """Run a test on the xp (ufunc) code and, with numba installed, on the compiled kernels
    (minigist/jit.py switches them all)."""
    if request.param == "kernels" and not jit.available():
        pytest.skip("numba is not installed (pip install minigist[fast])")
    with jit.use_kernels(request.param == "kernels"):
        yield request.param


@pytest.fixture(scope="session")
def train_help():
    """`python train.py --help`, run once for the tests that read it."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--help"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
