"""The switch for minigist's optional compiled CPU kernels (numba).

Kernels live beside the code they speed up (minigist/codecs/kernels.py: Gist's codecs;
minigist/layers/pool_kernels.py: MAX pooling; minigist/layers/fused_kernels.py: BatchNorm's,
Scale's and ReLU's element-wise chains) and give the same bytes as the `xp` code they
replace. They serve a call when numba is importable (`pip install minigist[fast]`), they are
switched on (the default; MINIGIST_KERNELS=numpy in the environment, `set_kernels(False)` or
`use_kernels(False)` switch them off), xp is numpy, and the arrays are C-contiguous.
"""
import contextlib
import os
import sys

import numpy as np

try:
    import numba
    import numba.core.event
except ImportError:        # the xp code serves
    numba = None

_enabled = numba is not None and os.environ.get("MINIGIST_KERNELS", "numba") != "numpy"


def available():
    """True when numba is installed (whether or not the kernels are switched on)."""
    return numba is not None


def active(xp, *arrays):
    """Whether the kernels serve this call: on, xp is numpy and every array is C-contiguous."""
    return _enabled and xp is np and all(a.flags.c_contiguous for a in arrays)


def off_reason(xp):
    """Why the kernels do not serve this xp (for the one-line path descriptions)."""
    return "numba not installed" if numba is None else "switched off" if xp is np else "not on a GPU"


def describe(xp=np):
    """One line on which path the layers take with this xp (the codecs have their own:
    minigist.codecs.kernels.describe)."""
    if not active(xp):
        return f"xp ufuncs ({off_reason(xp)})"
    return (f"numba {numba.__version__} kernels for MAX pooling, BatchNorm/Scale/ReLU and the "
            f"convolution's layout copies")


COMPILE_NOTICE = "compiling minigist's numba kernels (once each, the first time a run needs them: numba caches them) ..."
_announcing = []


class _CompileNotice(numba.core.event.Listener if numba is not None else object):
    """Writes COMPILE_NOTICE once, as the first of minigist's kernels starts compiling (numba
    raises "numba:compile" for a compile, not for a load from its cache)."""

    def __init__(self, stream):
        self.stream, self.done = stream, False

    def on_start(self, event):
        dispatcher = event.data.get("dispatcher") if isinstance(event.data, dict) else None
        module = getattr(getattr(dispatcher, "py_func", None), "__module__", "") or ""
        if self.done or not module.startswith(__name__.split(".")[0] + "."):
            return
        self.done = True
        stream = self.stream or sys.stderr
        stream.write(COMPILE_NOTICE + "\n")
        stream.flush()

    def on_end(self, event):
        pass


def announce_compiles(stream=None):
    """Say so, in one line on `stream` (sys.stderr), when minigist's kernels are compiled
    rather than loaded from numba's cache: on a machine's first run (or after an edit to a
    kernel's file) that takes 10-25 s before the first step. Once per process; nothing
    without numba."""
    if numba is None or _announcing:
        return
    _announcing.append(_CompileNotice(stream))
    numba.core.event.register("numba:compile", _announcing[0])


def set_kernels(on):
    """Switch the kernels on or off for the whole process; returns the previous setting.
    Switching on without numba raises ImportError."""
    global _enabled
    if on and numba is None:
        raise ImportError("minigist's compiled kernels need numba: pip install minigist[fast]")
    previous, _enabled = _enabled, bool(on)
    return previous


@contextlib.contextmanager
def use_kernels(on):
    previous = set_kernels(on)
    try:
        yield
    finally:
        set_kernels(previous)


def target_features():
    """The CPU features numba compiles for, as a set of LLVM feature names: the host's, or
    exactly the '+name' entries of NUMBA_CPU_FEATURES where that is set (numba's own rule:
    NUMBA_CPU_NAME alone keeps the host's features, NUMBA_CPU_NAME=generic has none)."""
    if numba is None:
        return frozenset()
    if numba.config.CPU_FEATURES is not None:
        return frozenset(f[1:] for f in numba.config.CPU_FEATURES.split(",") if f.startswith("+"))
    from llvmlite import binding
    return frozenset(name for name, on in binding.get_host_cpu_features().items() if on)


def _host_has(*features):
    """Whether the CPU numba compiles for has every one of `features`: the kernels choose
    their instructions by this, so that an emulated target (avx2_environment) gets the
    forms its CPU would."""
    return all(f in target_features() for f in features)


# LLVM's names of the features an AVX2-only x86-64 CPU lacks (AVX-512 and its successors)
_AFTER_AVX2 = ("avx512", "evex512", "avx10", "amx")


def avx2_environment():
    """The environment that makes this process's libraries run as on a CPU with AVX2 but no
    AVX-512 (for tests and benchmarks on an AVX-512 machine): numba compiles for Haswell with
    the host's features less AVX-512's, oneDNN and torch's kernels stop at AVX2, numpy's
    OpenBLAS runs its Haswell kernels. Read when each library starts, so it is for a new
    process (bench/ scripts: --isa avx2)."""
    from llvmlite import binding
    host = binding.get_host_cpu_features()
    features = ",".join(("-" if name.startswith(_AFTER_AVX2) or not on else "+") + name
                        for name, on in sorted(host.items()))
    return {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": features,
            "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
            "OPENBLAS_CORETYPE": "Haswell", "ATEN_CPU_CAPABILITY": "avx2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


# F16C's conversions between float32 and IEEE binary16 (vcvtps2ph / vcvtph2ps: LLVM's fptrunc
# and fpext to half, 8 or 16 lanes per instruction), as uint32 bit patterns: half_from_bits
# rounds to nearest even; bits_from_half is exact. dpr_half_code adds DPR fp16's NaN rule, on
# which float_bits_of_dpr_half relies (the codecs' kernels and the layers' use them). Without
# F16C LLVM would lower the conversions to a library call the JIT cannot link (the process
# aborts), so there they are stand-ins returning 0, for branches that are never taken.
HALF = _host_has("f16c")

# masked vector stores that cost what plain ones do (AVX-512's); AVX2's vmaskmovps store is
# slow (microcoded on AMD's cores), and LLVM makes one of `x[i] = x[i] if c else 0`
MASKED_STORES = _host_has("avx512f")

if numba is not None:
    from llvmlite import ir as _ir
    from numba.extending import intrinsic as _intrinsic

    if HALF:
        @_intrinsic
        def half_from_bits(typingctx, bits):
            def codegen(context, builder, signature, args):
                half = builder.fptrunc(builder.bitcast(args[0], _ir.FloatType()), _ir.HalfType())
                return builder.zext(builder.bitcast(half, _ir.IntType(16)), _ir.IntType(32))
            return numba.types.uint32(bits), codegen

        @_intrinsic
        def bits_from_half(typingctx, code):
            def codegen(context, builder, signature, args):
                half = builder.bitcast(builder.trunc(args[0], _ir.IntType(16)), _ir.HalfType())
                return builder.bitcast(builder.fpext(half, _ir.FloatType()), _ir.IntType(32))
            return numba.types.uint32(code), codegen
    else:
        @numba.njit(cache=True)
        def half_from_bits(bits):
            return np.uint32(0)

        @numba.njit(cache=True)
        def bits_from_half(code):
            return np.uint32(0)

    def _int32(builder, value):
        """An integer of any width as i32 (truncated or zero-extended)."""
        width = value.type.width
        if width > 32:
            return builder.trunc(value, _ir.IntType(32))
        return builder.zext(value, _ir.IntType(32)) if width < 32 else value

    if HALF:
        # DPR's NaN rules as 32-bit IR: written in Python, numba widens uint32 shifts and
        # masks to 64 bits, and a loop of them vectorises 4 lanes wide on AVX2 (half
        # BatchNorm's backward and the fp16 decode ran twice as slow there as on AVX-512)
        @_intrinsic
        def dpr_half_code(typingctx, bits):
            """DPR fp16's code of the float32 bits (as uint32): IEEE binary16 rounded to
            nearest even, and a NaN as the quiet NaN 0x7E00 with its sign (the hardware keeps
            payloads)."""
            # A NaN becomes float32's quiet NaN of its sign before the conversion, which
            # converts to exactly that code: the select stays on 32-bit lanes (a select on the
            # 16-bit codes made AVX2's vectorised loops pack and unpack them, 2x as slow), and
            # an unordered float compare finds the NaNs in one instruction (AVX2 has no
            # unsigned 32-bit compare: the integer test took three).
            def codegen(context, builder, signature, args):
                i32 = _ir.IntType(32)
                b = _int32(builder, args[0])
                quiet = builder.or_(builder.and_(b, i32(0xFF800000)), i32(0x00400000))
                value = builder.bitcast(b, _ir.FloatType())
                b = builder.select(builder.fcmp_unordered("uno", value, value), quiet, b)
                half = builder.fptrunc(builder.bitcast(b, _ir.FloatType()), _ir.HalfType())
                return builder.zext(builder.bitcast(half, _ir.IntType(16)), i32)
            return numba.types.uint32(bits), codegen

        @_intrinsic
        def float_bits_of_dpr_half(typingctx, code):
            """The float32 bits (as uint32) of the binary16 code (its low 16 bits) that DPR
            fp16 wrote: numpy's cast, bit for bit, for every such code. The conversion alone:
            the hardware quiets a signalling NaN where numpy keeps it, but DPR writes none
            (every NaN becomes the quiet 0x7E00 with its sign), and the select that kept one
            signalling made AVX2's decode loops twice as slow."""
            def codegen(context, builder, signature, args):
                code16 = builder.trunc(_int32(builder, args[0]), _ir.IntType(16))
                half = builder.bitcast(code16, _ir.HalfType())
                return builder.bitcast(builder.fpext(half, _ir.FloatType()), _ir.IntType(32))
            return numba.types.uint32(code), codegen
    else:
        _U32 = np.uint32

        @numba.njit(cache=True, nogil=True)
        def dpr_half_code(bits):
            """The stand-in: never called without F16C (the codecs take the integer path)."""
            nan = ((bits >> _U32(16)) & _U32(0x8000)) | _U32(0x7E00)
            return nan if (bits & _U32(0x7FFFFFFF)) > _U32(0x7F800000) else half_from_bits(bits)

        @numba.njit(cache=True, nogil=True)
        def float_bits_of_dpr_half(code):
            """The stand-in: never called without F16C (the kernels take the integer path)."""
            return bits_from_half(_U32(code))
