"""The kernels on a CPU with AVX2 and no AVX-512, emulated on any x86-64 machine through
minigist.jit.avx2_environment (numba compiles for Haswell with the host's features less
AVX-512's): the feature checks that choose each kernel's instructions see what numba compiles
for, not the host, and the kernels give the ufunc path's bytes there."""
import os
import platform
import subprocess
import sys

import pytest

from minigist import jit

pytestmark = [pytest.mark.skipif(not jit.available(), reason="numba is not installed"),
              pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 only")]

ROOT = os.path.join(os.path.dirname(__file__), "..")


def run_emulated(script, tmp_path):
    env = dict(os.environ, **jit.avx2_environment(), NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_features_are_numbas_target_features(monkeypatch):
    """NUMBA_CPU_FEATURES, where set, is the whole feature list (numba's rule): '+name' on."""
    monkeypatch.setattr(jit.numba.config, "CPU_FEATURES", "+avx2,+f16c,-avx512f,-avx512bw")
    assert jit.target_features() == {"avx2", "f16c"}
    assert jit._host_has("f16c", "avx2") and not jit._host_has("avx512f")
    monkeypatch.setattr(jit.numba.config, "CPU_FEATURES", "")
    assert jit.target_features() == frozenset()


def test_the_avx2_environment_drops_avx512_only():
    from llvmlite import binding
    host = {name for name, on in binding.get_host_cpu_features().items() if on}
    features = jit.avx2_environment()["NUMBA_CPU_FEATURES"].split(",")
    on = {f[1:] for f in features if f.startswith("+")}
    assert on == {f for f in host if not f.startswith(("avx512", "evex512", "avx10", "amx"))}


@pytest.mark.slow
def test_kernels_under_avx2_emulation_take_the_avx2_forms(tmp_path):
    """Under the emulation F16C stays on (every AVX2 CPU has it), AVX-512's compress/expand is
    off, and the compiled code uses no 512-bit registers."""
    from llvmlite import binding
    if not binding.get_host_cpu_features().get("avx2"):
        pytest.skip("the host has no AVX2")
    out = run_emulated(
        "import numpy as np\n"
        "from minigist import jit\n"
        "from minigist.codecs import kernels\n"
        "u = np.arange(4096, dtype=np.uint32); c = np.empty_like(u)\n"
        "kernels.dpr_encode(u, c, kernels.dpr_params(__import__('minigist.codecs.dpr', fromlist=['DPR']).DPR('fp16')), 1)\n"
        "asm = ''.join(kernels.dpr_encode.inspect_asm().values())\n"
        "print(jit.HALF, kernels.VECTOR, 'ymm' in asm, 'zmm' in asm)\n", tmp_path)
    assert out.split() == ["True", "False", "True", "False"]
