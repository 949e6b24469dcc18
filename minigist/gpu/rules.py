"""The CPU-side checker of CuPy's rules: an `xp` over numpy that behaves as cupy would.

A net built with device="cupy-rules" gets `XP` as its array module: its arena is a
`DeviceArray` (a numpy subclass standing for a cupy.ndarray), so every view the executor
hands a layer is one too, and every ufunc, array function and method on them passes through
here. The layers, codecs and passes then run the code path CuPy would run: `xp` is not numpy,
so numba's and oneDNN's CPU-only paths are off, and the GPU kernels of minigist/gpu/kernels.py
serve as on CuPy, each run here by the numpy code that writes its bytes (`XP.kernel`).

Inside `XP.checking()` it records, with the file and line of minigist's code that did it:

- **overlap**: a ufunc, `copyto`, `take` or `cumsum` whose output overlaps an input without
  being the same array object: CuPy copies such an input first (cupy/_core/_kernel.pyx,
  `_copy_in_args_if_needed`: `inp is not out and may_share_bounds(inp, out)`), a temporary
  outside the arena;
- **matmul**: a matmul whose operands CuPy would copy (cupy/_core/_routines_linalg.pyx: with
  3+ dimensions every operand that is not C-contiguous, with 2 an operand neither C- nor
  F-contiguous) or whose output it would compute into a temporary (not C-contiguous, another
  dtype, or overlapping an operand);
- **sync**: a host synchronisation: `int()`, `float()`, `bool()`, `operator.index` of an
  array, `.item()`, `.tolist()`, `.get()`, a Python loop over elements, or a function whose
  output size depends on the data (`flatnonzero`, boolean-mask indexing: CuPy reads the
  count on the host);
- **allocation**: an array made outside the arena (a ufunc without `out=`, an array
  function's new result, `asarray` of host data, a gather by index arrays); allocations
  that `ALLOWANCE` lists are reported but are no violations;
- **subnormal**: float32 arithmetic whose result changes when float32 subnormals are flushed
  to zero, inputs (DAZ) and result (FTZ), as CUDA's `-ftz=true` does;
- **api**: a cupy call that does not do what numpy's does (Generator.random with `out=` but
  no `size` draws one number for the whole array).

`Report.summary()` counts per step; tools/cupy_rules.py runs real training steps under it.
"""
import contextlib
import os
import sys

import numpy as np

TINY32 = np.float32(np.finfo(np.float32).tiny)
_HERE = os.path.abspath(__file__)
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))
_NUMPY_DIR = os.path.dirname(np.__file__)

# allocations outside the arena that are no violations: (file of the call, what, why)
ALLOWANCE = (
    ("minigist/layers/loss.py", "SoftmaxWithLoss / Accuracy",
     "vectors of one entry per sample (labels, the picked probabilities) and 0-d results"),
    ("minigist/passes/gist_steps.py", "GistStats", "one 0-d counter per SSDC tensor, made once"),
    ("minigist/executor.py", "the loss", "0-d results"),
    ("cuBLAS pointer arrays", "batched matmul", "8 bytes per matrix of a broadcast batch"),
)


class Report:
    """What the checker saw: violations (rule, site, detail), host syncs, allocations."""

    def __init__(self):
        self.violations = []
        self.syncs = []
        self.allocations = []
        self.calls = 0
        self.kernels = 0
        self.steps = 0

    def allowed(self, site):
        return any(site.startswith(entry[0]) or entry[0] in site for entry in ALLOWANCE)

    def all_violations(self):
        """The rule violations, allocations outside the allowance included."""
        extra = [("allocation", site, f"{nbytes:,} bytes: {what}") for nbytes, site, what in self.allocations
                 if not self.allowed(site)]
        return self.violations + extra

    def summary(self):
        steps = max(1, self.steps)
        return {"steps": self.steps, "violations": len(self.all_violations()),
                "host_syncs_per_step": len(self.syncs) / steps,
                "calls_per_step": self.calls / steps, "kernels_per_step": self.kernels / steps,
                "allowed_bytes_per_step": sum(n for n, site, _ in self.allocations if self.allowed(site)) / steps}

    def lines(self, limit=20):
        """The first violations and syncs, one line each, grouped by site."""
        seen, out = {}, []
        for rule, site, detail in self.all_violations():
            key = (rule, site)
            seen[key] = seen.get(key, 0) + 1
            if seen[key] == 1:
                out.append((rule, site, detail))
        for what, site in self.syncs:
            key = ("sync", site)
            seen[key] = seen.get(key, 0) + 1
            if seen[key] == 1:
                out.append(("sync", site, what))
        return [f"  {rule}: {site}: {detail} (x{seen[(rule, site)]})" for rule, site, detail in (out[:limit] if limit else out)]


_active = []      # the Report being recorded into (one at a time), or nothing
_inside = []      # non-empty while a kernel's stand-in runs: nothing is recorded


def _report():
    return _active[0] if _active and not _inside else None


def _site():
    """file:line (function) of the innermost caller outside this file and numpy."""
    frame = sys._getframe(2)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if name != _HERE and not name.startswith(_NUMPY_DIR):
            return f"{os.path.relpath(name, _ROOT)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


def _violation(rule, detail):
    report = _report()
    if report is not None:
        report.violations.append((rule, _site(), detail))


def _sync(what):
    report = _report()
    if report is not None:
        report.syncs.append((what, _site()))


def _allocation(nbytes, what):
    report = _report()
    if report is not None and nbytes:
        report.allocations.append((int(nbytes), _site(), what))


def _count():
    report = _report()
    if report is not None:
        report.calls += 1


# ---- the device array -------------------------------------------------------------------------
def _raw(value):
    """numpy's own view of a DeviceArray (containers walked); anything else as it is."""
    if isinstance(value, DeviceArray):
        return value.view(np.ndarray)
    if isinstance(value, tuple):
        return tuple(_raw(v) for v in value)
    if isinstance(value, list):
        return [_raw(v) for v in value]
    if isinstance(value, dict):
        return {k: _raw(v) for k, v in value.items()}
    return value


def _device(value):
    """A numpy result as the device array cupy would return (scalars as 0-d arrays)."""
    if isinstance(value, DeviceArray):
        return value
    if isinstance(value, np.ndarray):
        return value.view(DeviceArray)
    if isinstance(value, (np.generic, bool, int, float)):
        return np.asarray(value).view(DeviceArray)
    if isinstance(value, tuple):
        return tuple(_device(v) for v in value)
    return value


def _arrays_in(values):
    for value in values:
        if isinstance(value, np.ndarray):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from _arrays_in(value)


def _check_overlap(inputs, outs, what):
    for out in outs:
        if not isinstance(out, np.ndarray):
            continue
        for a in _arrays_in(inputs):
            if a is not out and np.may_share_memory(a, out):
                _violation("overlap", f"{what}: an input shares memory with out= without being the same "
                                      f"array object (CuPy copies it first: {a.nbytes:,} bytes)")


def _subnormal(a):
    return a.dtype == np.float32 and a.size and bool(np.any((np.abs(a) < TINY32) & (a != 0)))


def _flushed(a):
    return np.where((np.abs(a) < TINY32) & (a != 0), np.copysign(np.float32(0), a), a).astype(np.float32)


# sign changes and moves keep subnormals under -ftz too; cuBLAS is not CUDA C arithmetic
_NOT_ARITHMETIC = {np.copysign, np.negative, np.absolute, np.positive, np.matmul}


def _subnormal_inputs(ufunc, method, raw_inputs):
    """Copies of the inputs when a float32 one holds subnormals (else None): only then can
    flushing change a value of normal size (a subnormal result flushed to 0 moves by less
    than the smallest normal). Copied before the call, which may write over them."""
    if ufunc in _NOT_ARITHMETIC or method != "__call__" or ufunc.nout != 1:
        return None
    if not any(isinstance(a, np.ndarray) and _subnormal(a) for a in raw_inputs):
        return None
    return [a.copy() if isinstance(a, np.ndarray) else a for a in raw_inputs]


def _check_subnormals(ufunc, inputs, raw_kwargs, result):
    """Compute again from `inputs` (_subnormal_inputs) with float32 subnormals flushed to zero,
    and the result flushed: a float result that then moves by the smallest normal or more is
    arithmetic that relies on subnormals (CUDA flushes them under -ftz=true). A subnormal that
    becomes 0 moves less: a tiny value staying tiny (a softmax's exp of a large negative)."""
    kwargs = {k: v for k, v in raw_kwargs.items() if k != "out"}
    again = ufunc(*[_flushed(a) if isinstance(a, np.ndarray) and a.dtype == np.float32 else a
                    for a in inputs], **kwargs)
    if isinstance(again, np.ndarray) and again.dtype == np.float32:
        again = _flushed(again)
    first = result[0] if isinstance(result, tuple) else result
    if not isinstance(first, np.ndarray) or first.dtype.kind != "f" or first.shape != np.shape(again):
        return     # a mask or an index: the arithmetic's value, not its bits, is what counts
    ieee, flushed = first.astype(np.float64), np.asarray(again, np.float64)
    with np.errstate(invalid="ignore"):
        moved = np.abs(ieee - flushed) >= TINY32
    moved |= np.isnan(ieee) != np.isnan(flushed)
    if np.any(moved):
        _violation("subnormal", f"{ufunc.__name__} gives a value of normal size that changes when float32 "
                                f"subnormals are flushed to zero (CUDA -ftz=true)")


def _check_matmul(a, b, out):
    """CuPy's matmul copies (cupy/_core/_routines_linalg.pyx: matmul, dot, tensordot_core)."""
    ndim = max(a.ndim, b.ndim)
    if ndim <= 2:
        for name, operand in (("a", a), ("b", b)):
            contiguous = operand.flags.c_contiguous or (operand.ndim == 2 and operand.flags.f_contiguous)
            if not contiguous:
                _violation("matmul", f"operand {name} {operand.shape} strides {operand.strides} is neither C- nor "
                                     f"F-contiguous: CuPy copies it ({operand.nbytes:,} bytes)")
    else:
        for name, operand in (("a", a), ("b", b)):
            if not operand.flags.c_contiguous:
                _violation("matmul", f"{operand.ndim}-D operand {name} {operand.shape} is not C-contiguous: CuPy's "
                                     f"batched matmul copies it ({operand.nbytes:,} bytes)")
        batch_a, batch_b = (1,) * (ndim - a.ndim) + a.shape[:-2], (1,) * (ndim - b.ndim) + b.shape[:-2]
        if batch_a != batch_b:
            count = int(np.prod([max(p, q) for p, q in zip(batch_a, batch_b)]))
            report = _report()
            if report is not None:
                report.allocations.append((3 * 8 * count, "cuBLAS pointer arrays", f"{count} matrices"))
    if out is not None:
        if not out.flags.c_contiguous:
            _violation("matmul", f"out {out.shape} is not C-contiguous: CuPy computes into a temporary")
        elif np.may_share_memory(out, a) or np.may_share_memory(out, b):
            _violation("matmul", "out overlaps an operand: CuPy computes into a temporary")


class DeviceArray(np.ndarray):
    """A numpy array standing for a cupy.ndarray under the checker."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        _count()
        out = kwargs.get("out")
        outs = out if isinstance(out, tuple) else ((out,) if out is not None else ())
        where = kwargs.get("where")
        checked = list(inputs) + ([where] if isinstance(where, np.ndarray) else [])
        if outs and method in ("__call__", "accumulate"):
            _check_overlap(checked, outs, f"{ufunc.__name__}")
        if ufunc is np.matmul and method == "__call__":
            _check_matmul(inputs[0], inputs[1], outs[0] if outs else None)
        raw_inputs = [_raw(a) for a in inputs]
        raw_kwargs = {k: _raw(v) for k, v in kwargs.items()}
        before = _subnormal_inputs(ufunc, method, raw_inputs) if _report() is not None else None
        result = getattr(ufunc, method)(*raw_inputs, **raw_kwargs)
        if before is not None:
            _check_subnormals(ufunc, before, raw_kwargs, result)
        if outs:
            return outs[0] if len(outs) == 1 else outs
        if isinstance(result, np.ndarray) and result.ndim:
            _allocation(result.nbytes, f"{ufunc.__name__}.{method} without out=")
        return _device(result)

    def __array_function__(self, func, types, args, kwargs):
        return _function(func, args, kwargs)

    # ---- what reads a device value on the host ---------------------------------------------
    def _host_value(self, what):
        _sync(what)
        return self.view(np.ndarray)

    def __int__(self):
        return int(self._host_value("int() of an array"))

    def __float__(self):
        return float(self._host_value("float() of an array"))

    def __bool__(self):
        return bool(self._host_value("bool() of an array"))

    def __index__(self):
        return self._host_value("an array used as a Python index").__index__()

    def __complex__(self):
        return complex(self._host_value("complex() of an array"))

    def item(self, *args):
        return self._host_value(".item()").item(*args)

    def tolist(self):
        return self._host_value(".tolist()").tolist()

    def __iter__(self):
        _sync("a Python loop over the elements of an array")
        return (self[i] for i in range(len(self)))

    def get(self):
        """The device-to-host copy (cupy.ndarray.get): a sync."""
        return np.array(self._host_value(".get()"))

    def set(self, host):
        """The host-to-device copy into this array (cupy.ndarray.set)."""
        if isinstance(host, DeviceArray):
            raise TypeError("set() takes a host (numpy) array")
        if self.shape != np.shape(host) or self.dtype != np.asarray(host).dtype:
            raise ValueError("set(): shape and dtype must match")
        self.view(np.ndarray)[...] = host

    def __getitem__(self, key):
        advanced = _advanced(key)
        if advanced and _mask_index(key):
            _sync("boolean-mask indexing (the result's size is read on the host)")
        result = np.ndarray.__getitem__(self.view(np.ndarray), _raw(key))
        if advanced and isinstance(result, np.ndarray) and result.ndim:
            _count()
            _allocation(result.nbytes, "a gather by index arrays")
        return _device(result)

    def __setitem__(self, key, value):
        if _advanced(key):
            _count()
            if _mask_index(key):
                _sync("boolean-mask assignment")
        if isinstance(value, np.ndarray) and not isinstance(value, DeviceArray) and value.size > 1:
            _allocation(value.nbytes, "a host array assigned into a device array (a device temporary)")
        np.ndarray.__setitem__(self.view(np.ndarray), _raw(key), _raw(value))

    def copy(self, order="C"):
        _count()
        _allocation(self.nbytes, ".copy()")
        return np.ndarray.copy(self.view(np.ndarray), order).view(DeviceArray)

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        _count()
        if _report() is not None and self.dtype == np.float32 and _subnormal(self.view(np.ndarray)) \
                and np.dtype(dtype).kind == "f":
            _violation("subnormal", f"astype({np.dtype(dtype).name}) of float32 subnormals")
        _allocation(self.size * np.dtype(dtype).itemsize, f".astype({np.dtype(dtype).name})")
        return np.ndarray.astype(self.view(np.ndarray), dtype, order, casting).view(DeviceArray)

    def fill(self, value):
        _count()
        np.ndarray.fill(self.view(np.ndarray), _raw(value))

    def __repr__(self):
        return "DeviceArray(" + repr(self._host_value("repr of an array")) + ")"

    __str__ = __repr__


def _advanced(key):
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, (np.ndarray, list)) for k in keys)


def _mask_index(key):
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, np.ndarray) and k.dtype == np.bool_ for k in keys)


# array functions whose output size the data decides: CuPy counts on the device and reads the
# count back before it allocates the result
_SIZE_FROM_DATA = {np.flatnonzero, np.nonzero, np.argwhere, np.unique, np.extract, np.compress}
_METADATA = {np.shape, np.ndim, np.size, np.may_share_memory, np.shares_memory, np.result_type, np.can_cast}
_COPY_RULE = {np.copyto, np.take, np.cumsum, np.putmask}


def _function(func, args, kwargs):
    if func in _METADATA:
        return func(*_raw(args), **_raw(kwargs))
    _count()
    if func in _SIZE_FROM_DATA:
        _sync(f"{func.__name__} (its result's size is read on the host)")
    if func in _COPY_RULE:
        if func is np.copyto:
            dst = args[0] if args else kwargs["dst"]
            inputs = [a for a in list(args[1:]) + [kwargs.get("src"), kwargs.get("where")] if a is not None]
            _check_overlap(inputs, (dst,), "copyto")
            if _report() is not None:
                source = inputs[0] if inputs else None
                if isinstance(source, np.ndarray) and np.asarray(dst).dtype.kind == "f" and \
                        source.dtype == np.float32 and dst.dtype != np.float32 and _subnormal(_raw(source)):
                    _violation("subnormal", "copyto casting float32 subnormals")
        elif kwargs.get("out") is not None:
            _check_overlap([a for a in args if isinstance(a, np.ndarray)], (kwargs["out"],), func.__name__)
    result = func(*_raw(args), **_raw(kwargs))
    out = kwargs.get("out")
    if func is np.copyto:
        return None
    if out is not None:
        return out
    if isinstance(result, np.ndarray) and result.ndim:
        inputs = list(_arrays_in(args)) + list(_arrays_in(kwargs.values()))
        if not any(np.may_share_memory(result, a) for a in inputs):
            _allocation(result.nbytes, f"{func.__name__} (a new array)")
    return _device(result)


# ---- the module ---------------------------------------------------------------------------------
class _Namespace:
    def __init__(self, **members):
        self.__dict__.update(members)


def _as_strided(x, shape=None, strides=None, subok=False, writeable=True):
    _count()
    view = np.lib.stride_tricks.as_strided(_raw(x), shape, strides, writeable=writeable)
    return view.view(DeviceArray)


def _creator(func, what):
    def create(*args, **kwargs):
        _count()
        result = func(*_raw(args), **_raw(kwargs))
        _allocation(result.nbytes, what)
        return result.view(DeviceArray)
    create.__name__ = func.__name__
    return create


class Generator:
    """CuPy's random.Generator as it behaves (cupy/random/_generator_api.pyx): the numbers are
    numpy's, the rules CuPy's: `random` draws into a new array of shape `size` (one number
    when size is None) and copies it into `out`."""

    def __init__(self, seed):
        self._numpy = np.random.default_rng(seed)

    def random(self, size=None, dtype=np.float64, out=None):
        _count()
        if out is not None and size is None and out.size != 1:
            _violation("api", "Generator.random(out=...) without size draws ONE number and broadcasts it into "
                              "out on CuPy (the whole mask kept or dropped)")
        drawn = self._numpy.random(size if size is not None else (), dtype=dtype)
        _allocation(drawn.nbytes, "Generator.random's own array (copied into out= after)")
        if out is not None:
            np.copyto(_raw(out), drawn)
            return out
        return drawn.view(DeviceArray)


class RulesXP:
    """The checker's array module: numpy's names, cupy's rules (see the module docstring)."""

    name = "cupy-rules"

    def __init__(self):
        self.ndarray = DeviceArray
        self.lib = _Namespace(stride_tricks=_Namespace(as_strided=_as_strided))
        self.random = _Namespace(default_rng=Generator)
        for name in ("empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like", "eye",
                     "linspace"):
            setattr(self, name, _creator(getattr(np, name), f"{name}"))

    def __getattr__(self, name):
        return getattr(np, name)

    def asarray(self, value, dtype=None):
        if isinstance(value, DeviceArray) and (dtype is None or np.dtype(dtype) == value.dtype):
            return value
        _count()
        result = np.array(_raw(value), dtype=dtype)
        _allocation(result.nbytes, "asarray (a new device array)")
        return result.view(DeviceArray)

    array = asarray

    def ascontiguousarray(self, value, dtype=None):
        if isinstance(value, DeviceArray) and value.flags.c_contiguous and (dtype is None or value.dtype == dtype):
            return value
        return self.asarray(np.ascontiguousarray(_raw(value), dtype), dtype)

    def kernel(self, name, run, outputs, inputs=()):
        """Run a GPU kernel's stand-in: `run()` computes on numpy's own views what the kernel
        writes into `outputs`. Counted as one launch; every array must be device memory."""
        report = _report()
        if report is not None:
            report.kernels += 1
            report.calls += 1
            for array in list(outputs) + list(inputs):
                if isinstance(array, np.ndarray) and not isinstance(array, DeviceArray):
                    _violation("api", f"kernel {name}: a host array passed to a device kernel")
                elif isinstance(array, np.ndarray) and not array.flags.c_contiguous:
                    _violation("api", f"kernel {name}: a {array.shape} array that is not C-contiguous (the "
                                      f"kernels index their arrays as flat and contiguous)")
        _inside.append(name)
        try:
            return run()
        finally:
            _inside.pop()

    def strided_gemm(self, a, b, out):
        """cuBLAS's strided batched GEMM's stand-in (gpu/kernels.py: strided_gemm): numpy's
        matmul of the stacks, one launch. cuBLAS reads strides as they are, so no operand need
        be contiguous; each must be device memory, and out must not overlap an operand."""
        report = _report()
        if report is not None:
            report.kernels += 1
            report.calls += 1
            for array in (a, b, out):
                if not isinstance(array, DeviceArray):
                    _violation("api", "strided GEMM: a host array passed to cuBLAS")
            if np.may_share_memory(_raw(out), _raw(a)) or np.may_share_memory(_raw(out), _raw(b)):
                _violation("overlap", "strided GEMM: out overlaps an operand")
        _inside.append("strided_gemm")
        try:
            np.matmul(_raw(a), _raw(b), out=_raw(out))
        finally:
            _inside.pop()

    @staticmethod
    def asnumpy(array):
        _sync("asnumpy")
        return np.array(_raw(array))

    @contextlib.contextmanager
    def checking(self, report=None):
        """Record into `report` (a new Report) inside the block; yields it."""
        report = report or Report()
        _active.insert(0, report)
        try:
            yield report
        finally:
            _active.remove(report)

    @staticmethod
    def address(array):
        return _raw(array).ctypes.data


XP = RulesXP()


# ---- real training steps under the rules ---------------------------------------------------------
def relu_like_batch(shape, classes, seed=0):
    """A batch of images (standard normal) and labels, made on the host."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(np.float32), rng.integers(0, classes, shape[0])


def check_training(model, gist="none", batch_size=4, steps=2, dpr="fp16", update="fused", seed=0, recompute=(),
                   recompute_shared=(), microbatch=(), spans=()):
    """Build `model` on the checker, calibrate SSDC (for lossless / all, outside the record),
    take one step, then `steps` steps recorded; returns the Report. The steps are real: the
    weights change, and the losses are the numpy path's (tests compare them). `recompute`,
    `recompute_shared`: stashes dropped and rebuilt by replays (passes/recompute.py);
    `microbatch`, `spans`: a front and spans run a micro-batch at a time (passes/microbatch.py)."""
    from ..net import Net
    net = Net(model, batch_size=batch_size, device="cupy-rules", gist=gist, dpr=dpr, conv="im2col",
              update=update, seed=seed, recompute=recompute, recompute_shared=recompute_shared,
              microbatch=microbatch, spans=spans)
    data_shape = net.train_graph.blobs[net.train_graph.nodes[0].tops[0]].shape
    classes = int(net.train_graph.nodes[-1].layer.bottom_shapes[0][1])
    batches = [relu_like_batch(data_shape, classes, seed + k) for k in range(steps + 2)]
    if net.gist.lossless:
        # every batch the steps train on: a batch denser than the calibration's plus its margin
        # is stored as zeros on the device (docs/gpu.md), where the numpy path keeps an exact
        # copy, and the losses would no longer be the numpy path's
        net.calibrate(batches)
    net.train_step(*batches[1])
    report = Report()
    report.losses = []
    with XP.checking(report):
        for images, labels in batches[2:]:
            report.losses.append(net.train_step(images, labels))
            report.steps += 1
    report.net = net
    report.overflows = net.stats.overflows
    return report
