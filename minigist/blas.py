"""Which BLAS numpy runs, with which kernels and threads: one line for train.py and the benches.

A convolution net's CPU training step is mostly GEMM, and OpenBLAS's kernels decide its speed:
on this project's AMD EPYC (AVX-512) machines its SkylakeX kernels run float32 GEMM 1.6-1.9x
as fast as its Haswell (AVX2) ones. OpenBLAS picks them from the CPU when it loads, unless OPENBLAS_CORETYPE
names others (some machines set it to work around old OpenBLAS builds), so the line says which
kernels run and whether the environment chose them. numpy's OpenBLAS is asked through ctypes
(Linux), without threadpoolctl.
"""
import ctypes
import os

import numpy  # noqa: F401  (loads numpy's BLAS, which the functions below inspect)

from .backend import scoped


_handle = []


def _loaded_openblas():
    """A ctypes handle on the OpenBLAS this process loaded (Linux), or None; looked up once."""
    if not _handle:
        _handle.append(_find_openblas())
    return _handle[0]


def _find_openblas():
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1].lower()}
    except OSError:
        return None
    for path in sorted(paths):
        if path.endswith(".so") or ".so." in path:
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


def _call_string(lib, names):
    for name in names:
        function = getattr(lib, name, None)
        if function is not None:
            function.restype = ctypes.c_char_p
            return function().decode(errors="replace").strip()
    return None


def openblas_info():
    """(version, kernels, threads) of the loaded OpenBLAS, or None when numpy uses another BLAS
    or it cannot be asked."""
    lib = _loaded_openblas()
    if lib is None:
        return None
    # numpy's wheels carry OpenBLAS with prefixed, 64-bit-integer symbol names
    config = _call_string(lib, ("scipy_openblas_get_config64_", "openblas_get_config64_", "openblas_get_config"))
    corename = _call_string(lib, ("scipy_openblas_get_corename64_", "openblas_get_corename64_",
                                  "openblas_get_corename"))
    if config is None or corename is None:
        return None
    version = config.split()[1] if config.startswith("OpenBLAS ") and len(config.split()) > 1 else "?"
    threads = None
    for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_", "openblas_get_num_threads"):
        function = getattr(lib, name, None)
        if function is not None:
            function.restype = ctypes.c_int
            threads = function()
            break
    return version, corename, threads


def _function(lib, names, restype):
    for name in names:
        function = getattr(lib, name, None)
        if function is not None:
            function.restype = restype
            return function
    return None


def get_threads():
    """OpenBLAS's current thread count, or None when numpy uses another BLAS."""
    lib = _loaded_openblas()
    function = lib and _function(lib, ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                                       "openblas_get_num_threads"), ctypes.c_int)
    return function() if function else None


def set_threads(count):
    """Set OpenBLAS's thread count for the process (a cheap switch: its threads stay alive);
    returns the previous count, or None (and changes nothing) for another BLAS."""
    lib = _loaded_openblas()
    function = lib and _function(lib, ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                                       "openblas_set_num_threads"), None)
    previous = get_threads()
    if function is None or previous is None:
        return None
    function(ctypes.c_int(int(count)))
    return previous


def threads(count):
    """OpenBLAS on `count` threads inside a `with` block (None: leave it as it is)."""
    return scoped(set_threads, count)


def describe(with_threads=True):
    """One line on numpy's BLAS: OpenBLAS's version, its kernels and who chose them, and (with
    `with_threads`) the thread count it runs on now."""
    info = openblas_info()
    if info is None:
        return "not OpenBLAS, or not inspectable here (kernels and threads as that BLAS chooses)"
    version, corename, threads = info
    if "OPENBLAS_CORETYPE" in os.environ:
        chosen = f"set by OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']}"
    else:
        chosen = "OpenBLAS's choice for this CPU"
    line = f"OpenBLAS {version}, {corename} kernels ({chosen})"
    if not with_threads:
        return line
    if threads is None:
        return f"{line}, ? threads"
    return f"{line}, {threads} thread{'' if threads == 1 else 's'}"
