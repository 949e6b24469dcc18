"""The benchmarks' --isa flag: `--isa avx2` reruns the script in a new process whose libraries
run as on an x86-64 CPU with AVX2 and no AVX-512 (minigist.jit.avx2_environment: numba's
kernels compiled for Haswell with the host's features less AVX-512's, oneDNN's and torch's
kernels stopped at AVX2, numpy's OpenBLAS on its Haswell kernels), so that an AVX-512 machine
measures the code paths an AVX2 machine takes. The libraries read these settings when they
start, hence the new process."""
import os
import sys

CHOICES = ("native", "avx2")
_MARK = "MINIGIST_BENCH_ISA"


def add_argument(parser):
    parser.add_argument("--isa", default="native", choices=CHOICES,
                        help="native: the CPU as it is; avx2: emulate a CPU without AVX-512 (reruns the "
                             "script with minigist.jit.avx2_environment())")


def rerun_if_emulating(isa):
    """Reruns this script under the AVX2 environment unless it already runs there."""
    if isa == "native" or os.environ.get(_MARK) == isa:
        return
    from minigist import jit
    env = dict(os.environ, **jit.avx2_environment(), **{_MARK: isa})
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


def describe():
    """One line on the instruction set the run emulates."""
    if os.environ.get(_MARK) == "avx2":
        return ("emulated AVX2 CPU (no AVX-512): NUMBA_CPU_NAME=haswell without AVX-512 features, "
                "ONEDNN_MAX_CPU_ISA=AVX2, OPENBLAS_CORETYPE=Haswell, ATEN_CPU_CAPABILITY=avx2")
    return "native"
