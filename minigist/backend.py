"""numpy or cupy, chosen once per net: `xp` is passed to every layer.

Nothing here imports cupy unless a GPU is asked for (or `auto` looks for one), so the CPU
path runs where cupy is not installed.
"""
import contextlib

import numpy

from .errors import MinigistError

DEVICES = ("cpu", "gpu", "auto")
# the CPU-side checker of CuPy's rules (minigist/gpu/rules.py): numpy under cupy's rules, for
# tests and tools/cupy_rules.py; not a --device choice
RULES_DEVICE = "cupy-rules"


def gpu_available():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver or no device: all mean "no GPU"
        return False


def get_xp(device="cpu"):
    """Return the array module for `device` ('cpu', 'gpu' or 'auto')."""
    if device == RULES_DEVICE:
        from .gpu.rules import XP
        return XP
    if device not in DEVICES:
        raise MinigistError(f"--device: expected one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cpu" or (device == "auto" and not gpu_available()):
        return numpy
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        raise MinigistError(f"--device gpu: no usable CUDA device ({exc.__class__.__name__}: {exc})") from None
    return cupy


def is_gpu(xp):
    return xp is not numpy


@contextlib.contextmanager
def scoped(setter, value):
    """`setter(value)` inside the block and the setting it returns (the previous one) put back
    after; None: nothing changes. For the process-wide thread switches (minigist.blas,
    minigist.codecs.kernels), each a `set_...(value)` that returns the previous value or None."""
    previous = setter(value) if value is not None else None
    try:
        yield
    finally:
        if previous is not None:
            setter(previous)


def to_numpy(array):
    """A numpy copy (or the array itself) of a numpy or cupy array."""
    get = getattr(array, "get", None)     # cupy's (and the checker's) device-to-host copy
    return array if get is None else get()
