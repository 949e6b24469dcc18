"""NVRTC, CUDA's run-time compiler, through ctypes: compiles minigist's kernels for a GPU
architecture on a machine without one (tests/test_gpu_kernels.py, tools/gpu_check.py).

The library comes from NVIDIA's PyPI wheels (`nvidia-cuda-nvrtc-cu12`, or for CUDA 13
`nvidia-cuda-nvrtc`), installed as `nvidia/cuda_nvrtc/lib/libnvrtc.so.*` under a
site-packages folder; a system CUDA's libnvrtc is found too (ctypes' own search).
"""
import ctypes
import glob
import os
import site
import sys


def _candidates():
    folders = list(sys.path) + site.getsitepackages() + [site.getusersitepackages()]
    for folder in dict.fromkeys(folders):
        for name in sorted(glob.glob(os.path.join(folder, "nvidia", "cu*", "lib", "libnvrtc.so*"))
                           + glob.glob(os.path.join(folder, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")),
                           reverse=True):
            if "builtins" not in name and ".alt." not in name:
                yield name
    yield from ("libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12")


def load():
    """The NVRTC library (a ctypes.CDLL), or None with no NVRTC installed."""
    for path in _candidates():
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def version(lib):
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


class CompileError(Exception):
    pass


def compile_source(lib, source, options, name="minigist_kernels.cu", expressions=()):
    """Compile `source` with `options` (NVRTC's, e.g. --gpu-architecture=sm_90); returns
    (cubin size in bytes, the compiler's log). Raises CompileError with the log on failure."""
    program = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        for expression in expressions:
            _check(lib, lib.nvrtcAddNameExpression(program, expression.encode()), "nvrtcAddNameExpression")
        raw = [o.encode() for o in options]
        array = (ctypes.c_char_p * len(raw))(*raw)
        result = lib.nvrtcCompileProgram(program, len(raw), array)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(program, log)
        text = log.value.decode(errors="replace")
        if result != 0:
            raise CompileError(f"{_error(lib, result)}:\n{text}")
        cubin = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(program, ctypes.byref(cubin)), "nvrtcGetCUBINSize")
        return cubin.value, text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


def _error(lib, code):
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib.nvrtcGetErrorString(code).decode()


def _check(lib, code, what):
    if code != 0:
        raise CompileError(f"{what}: {_error(lib, code)}")


def compile_ptx(lib, source, options, name="minigist_kernels.cu"):
    """The PTX text of `source` (options with a virtual architecture, e.g. compute_90)."""
    program = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        raw = [o.encode() for o in options]
        _check(lib, lib.nvrtcCompileProgram(program, len(raw), (ctypes.c_char_p * len(raw))(*raw)),
               "nvrtcCompileProgram")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetPTXSize(program, ctypes.byref(size)), "nvrtcGetPTXSize")
        ptx = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetPTX(program, ptx), "nvrtcGetPTX")
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))
