"""The GPU path: CuPy kernels for the hot steps and the CPU-side checker of CuPy's rules.

- `cuda_source.py`: the CUDA C text of every kernel, one place that CuPy (RawModule) and the
  compile test (NVRTC through ctypes, `nvrtc.py`) read alike;
- `kernels.py`: the Python side: which steps the kernels serve (`serves(xp)`), and one
  function per kernel that launches it on CuPy, or, under the checker, runs the numpy code
  that writes the same bytes;
- `rules.py`: `xp` for the checker, a stand-in for cupy over numpy that enforces CuPy's rules
  on a real training step (tools/cupy_rules.py);
- `nvrtc.py`: NVRTC from NVIDIA's PyPI wheel, through ctypes: compiles the kernels for sm_90
  without a GPU (tests/test_gpu_kernels.py).

Nothing here imports cupy unless a GPU is asked for.
"""
