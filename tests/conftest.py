"""Shared fixtures."""
import pytest

from minigist import jit


@pytest.fixture(params=["xp", "kernels"])
def kernel_path(request):
    """Run a test on the xp (ufunc) code and, with numba installed, on the compiled kernels
    (minigist/jit.py switches them all)."""
    if request.param == "kernels" and not jit.available():
        pytest.skip("numba is not installed (pip install minigist[fast])")
    with jit.use_kernels(request.param == "kernels"):
        yield request.param
