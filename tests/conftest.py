"""Shared fixtures, and the environment of the test processes."""
import os
import subprocess
import sys

# By libgomp's default an OpenMP thread (oneDNN's, and numba's beside it) spins while it waits
# for the next parallel region. Where other processes want the cores too, a spinning thread is
# the one the scheduler takes its core from, and each region waits for it: 25 ResNet-20
# evaluation steps on oneDNN's two threads took 1.6-4.3 s instead of 0.13 s on a loaded
# 2-core machine. The tests check results and thread counts, never this timing: their
# processes (this one and every train.py it starts, which inherit it) wait passively, unless
# the environment says otherwise. Set before anything loads libgomp (minigist loads oneDNN,
# and libgomp with it, on first use).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

from minigist import jit  # noqa: E402

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
