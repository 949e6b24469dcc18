"""oneDNN's convolutions through ctypes: the optional `--conv onednn` engine.

minigist's own convolution is im2col + BLAS GEMM (minigist/layers/conv_im2col.py). oneDNN (the
library PyTorch's CPU convolutions run on) has direct, JIT-compiled, cache-blocked kernels
that are 1.5-3x faster on this machine's AVX-512 cores, but only on its blocked layouts
(nChw16c, ...): on plain NCHW it falls back to im2col + GEMM itself. So this engine keeps
minigist's NCHW tensors and, like PyTorch, reorders each operand into the layout the kernel
chose and the result back; every blocked copy and oneDNN's scratchpad are workspaces the
convolution declares (`ConvPrimitives.workspace`), planned in the arena like any other, and
handed to oneDNN as user memory (scratchpad mode "user"): oneDNN allocates no tensor memory
of its own.

The library comes from the `onednn-cpu-gomp` wheel (oneDNN 3.2, GNU OpenMP runtime; `pip
install minigist[fast]` on x86-64 Linux), found beside the running Python (sys.prefix/lib),
or named by MINIGIST_ONEDNN_LIB. No compiler is needed: the C API is called with ctypes, its
enum values fixed by oneDNN 3.x's ABI. Float32 only (oneDNN's CPU kernels have no float64).
"""
import ctypes
import ctypes.util
import os
import sys

import numpy as np

from .backend import scoped

# oneDNN 3.x C API values (dnnl_types.h, dnnl_common_types.h)
_SUCCESS = 0
_F32 = 3
_TAG_ANY, _TAG_A, _TAG_ABCD, _TAG_ABCDE = 1, 2, 5, 6
_FORWARD_TRAINING = 64
_CONVOLUTION_DIRECT = 1
_CPU = 1
_STREAM_DEFAULT = 1
_SCRATCHPAD_USER = 1
_QUERY_IMPL_INFO_STR = 8
_QUERY_SRC_MD, _QUERY_DIFF_SRC_MD, _QUERY_WEIGHTS_MD, _QUERY_DIFF_WEIGHTS_MD = 129, 130, 131, 132
_QUERY_DST_MD, _QUERY_DIFF_DST_MD, _QUERY_SCRATCHPAD_MD = 133, 134, 136
ARG_SRC, ARG_DST, ARG_WEIGHTS, ARG_BIAS, ARG_SCRATCHPAD = 1, 17, 33, 41, 80
ARG_DIFF_SRC, ARG_DIFF_DST, ARG_DIFF_WEIGHTS, ARG_DIFF_BIAS = 129, 145, 161, 169
_MAX_NDIMS = 12
_CPU_RUNTIMES = {1: "sequential", 2: "OpenMP", 4: "TBB", 8: "threadpool"}

_Dims = ctypes.c_int64 * _MAX_NDIMS
_void_p = ctypes.c_void_p


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _void_p)]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint), ("gpu_runtime", ctypes.c_uint)]


class OneDNNError(RuntimeError):
    pass


def _candidates():
    named = os.environ.get("MINIGIST_ONEDNN_LIB")
    if named:
        return [named]
    found = [os.path.join(prefix, "lib", "libdnnl.so.3") for prefix in dict.fromkeys((sys.prefix, sys.base_prefix))]
    system = ctypes.util.find_library("dnnl")
    return found + ([system] if system else [])


_state = {}


def _library():
    """(lib, None) or (None, why not)."""
    if "lib" not in _state:
        lib, reason = None, "libdnnl.so.3 not found (pip install onednn-cpu-gomp, or minigist[fast])"
        for path in _candidates():
            if not os.path.exists(path) and os.sep in path:
                continue
            try:
                lib = ctypes.CDLL(path)
            except OSError as exc:
                reason = f"{path}: {exc}"
                continue
            lib.dnnl_version.restype = ctypes.POINTER(_Version)
            if lib.dnnl_version().contents.major != 3:
                reason, lib = f"{path}: oneDNN {lib.dnnl_version().contents.major}.x, need 3.x", None
                continue
            reason = None
            _state["path"] = path
            break
        if lib is not None:
            lib.dnnl_primitive_desc_query_md.restype = _void_p
            lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
        _state["lib"], _state["reason"] = lib, reason
    return _state["lib"], _state["reason"]


def available():
    return _library()[0] is not None


def unavailable_reason():
    return _library()[1]


def describe():
    """One line: the oneDNN library the engine loads (or why none), its version and runtime."""
    lib, reason = _library()
    if lib is None:
        return f"oneDNN unavailable: {reason}"
    v = lib.dnnl_version().contents
    return (f"oneDNN {v.major}.{v.minor}.{v.patch} ({_CPU_RUNTIMES.get(v.cpu_runtime, v.cpu_runtime)} "
            f"runtime) from {_state['path']}")


def _openmp():
    """The GNU OpenMP runtime the library runs on (the process has one libgomp.so.1), or None."""
    if "omp" not in _state:
        try:
            _state["omp"] = ctypes.CDLL("libgomp.so.1") if available() else None
        except OSError:
            _state["omp"] = None
    return _state["omp"]


def max_threads():
    """The OpenMP threads oneDNN's kernels run on: omp_get_max_threads() of the OpenMP runtime
    the library loaded (OMP_NUM_THREADS, else the CPUs, unless set_threads changed it); 1
    without the library."""
    omp = _openmp()
    return max(1, int(omp.omp_get_max_threads())) if omp is not None else 1


def set_threads(count):
    """Run oneDNN's kernels on `count` OpenMP threads from now on (omp_set_num_threads on the
    calling thread); returns the previous count, or None (and changes nothing) without the
    library. Call it before the primitives are made: oneDNN splits the work by the thread
    count, and its float results depend on it."""
    omp = _openmp()
    if omp is None:
        return None
    previous = max_threads()
    omp.omp_set_num_threads(int(count))
    return previous


def threads(count):
    """oneDNN on `count` OpenMP threads inside a `with` block (None: as they are)."""
    return scoped(set_threads, count)


def _check(status, what):
    if status != _SUCCESS:
        raise OneDNNError(f"oneDNN {what} failed (status {status})")


def _runtime():
    """The library, one CPU engine and one in-order stream, created once per process."""
    lib, reason = _library()
    if lib is None:
        raise OneDNNError(f"--conv onednn: {reason}")
    if "engine" not in _state:
        engine, stream, attr = _void_p(), _void_p(), _void_p()
        _check(lib.dnnl_engine_create(ctypes.byref(engine), _CPU, 0), "engine creation")
        _check(lib.dnnl_stream_create(ctypes.byref(stream), engine, _STREAM_DEFAULT), "stream creation")
        _check(lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "attribute creation")
        _check(lib.dnnl_primitive_attr_set_scratchpad_mode(attr, _SCRATCHPAD_USER), "scratchpad mode")
        _state.update(engine=engine, stream=stream, attr=attr)
    return lib, _state["engine"], _state["stream"], _state["attr"]


def _plain_md(lib, shape, tag):
    md = _void_p()
    _check(lib.dnnl_memory_desc_create_with_tag(ctypes.byref(md), len(shape), _Dims(*shape), _F32, tag),
           "memory descriptor")
    return md


class _Operand:
    """One array a primitive reads or writes: the plain (NCHW / OIHW) layout minigist keeps and
    the layout the primitive chose. Where they differ, `blocked_bytes` of workspace hold the
    primitive's copy and a reorder primitive moves the data between them."""

    def __init__(self, lib, engine, attr, plain_md, chosen_md, to_blocked):
        self.lib = lib
        self.reorder = None
        self.blocked_bytes = 0
        self.plain = self._memory(plain_md, engine)
        if lib.dnnl_memory_desc_equal(plain_md, chosen_md):
            self.memory = self.plain
            return
        self.blocked_bytes = int(lib.dnnl_memory_desc_get_size(chosen_md))
        self.memory = self._memory(chosen_md, engine)
        source, target = (plain_md, chosen_md) if to_blocked else (chosen_md, plain_md)
        pd = _void_p()
        _check(lib.dnnl_reorder_primitive_desc_create(ctypes.byref(pd), source, engine, target, engine, attr),
               "reorder descriptor")
        self.reorder = _Primitive(lib, pd)
        src, dst = (self.plain, self.memory) if to_blocked else (self.memory, self.plain)
        self.reorder.bind([(ARG_SRC, src), (ARG_DST, dst)])

    def _memory(self, md, engine):
        memory = _void_p()
        _check(self.lib.dnnl_memory_create(ctypes.byref(memory), md, engine, None), "memory object")
        return memory


class _Primitive:
    def __init__(self, lib, pd):
        self.lib = lib
        self.pd = pd
        self.handle = _void_p()
        _check(lib.dnnl_primitive_create(ctypes.byref(self.handle), pd), "primitive creation")
        scratch_md = _void_p(lib.dnnl_primitive_desc_query_md(pd, _QUERY_SCRATCHPAD_MD, 0))
        self.scratch_bytes = int(lib.dnnl_memory_desc_get_size(scratch_md)) if scratch_md.value else 0
        self.scratch = None
        if self.scratch_bytes:
            self.scratch = _void_p()
            _check(lib.dnnl_memory_create(ctypes.byref(self.scratch), scratch_md, _state["engine"], None),
                   "scratchpad memory")
        self.args = None

    def md(self, query):
        return _void_p(self.lib.dnnl_primitive_desc_query_md(self.pd, query, 0))

    def impl(self):
        name = ctypes.c_char_p()
        self.lib.dnnl_primitive_desc_query(self.pd, _QUERY_IMPL_INFO_STR, 0, ctypes.byref(name))
        return name.value.decode()

    def bind(self, pairs):
        if self.scratch is not None:
            pairs = list(pairs) + [(ARG_SCRATCHPAD, self.scratch)]
        self.args = (_ExecArg * len(pairs))(*[_ExecArg(arg, memory) for arg, memory in pairs])

    def run(self, stream):
        _check(self.lib.dnnl_primitive_execute(self.handle, stream, len(self.args), self.args), "execution")


def _weights_shape(o, c, g, kernel):
    """The weights' dims as oneDNN reads them: OIHW, or GOIHW with groups."""
    return (o, c) + tuple(kernel) if g == 1 else (g, o // g, c // g) + tuple(kernel)


class ConvPrimitives:
    """The forward, backward-data and backward-weights primitives of one convolution for a
    fixed batch, with what they need: `workspace(phase)` gives the bytes of each blocked copy
    and of the scratchpad; `forward` and `backward` run them on the executor's arrays."""

    def __init__(self, in_shape, num_output, group, kernel, stride, pad, dilation, out_hw, bias, bias_grad):
        lib, engine, stream, attr = _runtime()
        self.lib, self.stream = lib, stream
        self._handles = {}      # memory object -> the address it points at
        n, c, h, w = in_shape
        o, g = num_output, group
        oh, ow = out_hw
        x_md = _plain_md(lib, (n, c, h, w), _TAG_ABCD)
        y_md = _plain_md(lib, (n, o, oh, ow), _TAG_ABCD)
        w_md = _plain_md(lib, _weights_shape(o, c, g, kernel), _TAG_ABCD if g == 1 else _TAG_ABCDE)
        b_md = _plain_md(lib, (o,), _TAG_A) if bias else None
        any_x = _plain_md(lib, (n, c, h, w), _TAG_ANY)
        any_y = _plain_md(lib, (n, o, oh, ow), _TAG_ANY)
        any_w = _plain_md(lib, _weights_shape(o, c, g, kernel), _TAG_ANY)
        strides = _Dims(*stride)
        dilates = _Dims(*(d - 1 for d in dilation))
        pad_l = _Dims(*pad)
        # oneDNN wants the right padding that makes its output size Caffe's floor division
        pad_r = _Dims(*((o_ - 1) * s + (k - 1) * d + 1 - i - p
                        for o_, s, k, d, i, p in zip(out_hw, stride, kernel, dilation, (h, w), pad)))
        fwd, bwd_data, bwd_weights = _void_p(), _void_p(), _void_p()
        _check(lib.dnnl_convolution_forward_primitive_desc_create(
            ctypes.byref(fwd), engine, _FORWARD_TRAINING, _CONVOLUTION_DIRECT, any_x, any_w, b_md, any_y,
            strides, dilates, pad_l, pad_r, attr), "convolution forward descriptor")
        _check(lib.dnnl_convolution_backward_data_primitive_desc_create(
            ctypes.byref(bwd_data), engine, _CONVOLUTION_DIRECT, any_x, any_w, any_y,
            strides, dilates, pad_l, pad_r, fwd, attr), "convolution backward-data descriptor")
        _check(lib.dnnl_convolution_backward_weights_primitive_desc_create(
            ctypes.byref(bwd_weights), engine, _CONVOLUTION_DIRECT, any_x, any_w, b_md if bias_grad else None, any_y,
            strides, dilates, pad_l, pad_r, fwd, attr), "convolution backward-weights descriptor")
        self.fwd = _Primitive(lib, fwd)
        self.bwd_data = _Primitive(lib, bwd_data)
        self.bwd_weights = _Primitive(lib, bwd_weights)
        f, d, wt = self.fwd, self.bwd_data, self.bwd_weights
        # bwd-weights reads gy in bwd-data's layout when the two agree: one reorder, not two
        self.gy_shared = lib.dnnl_memory_desc_equal(d.md(_QUERY_DIFF_DST_MD), wt.md(_QUERY_DIFF_DST_MD)) == 1
        gy = _Operand(lib, engine, attr, y_md, d.md(_QUERY_DIFF_DST_MD), True)
        self.ops = {
            "forward": {"x": _Operand(lib, engine, attr, x_md, f.md(_QUERY_SRC_MD), True),
                        "w": _Operand(lib, engine, attr, w_md, f.md(_QUERY_WEIGHTS_MD), True),
                        "y": _Operand(lib, engine, attr, y_md, f.md(_QUERY_DST_MD), False)},
            "backward": {"gy": gy,
                         "w": _Operand(lib, engine, attr, w_md, d.md(_QUERY_WEIGHTS_MD), True),
                         "gx": _Operand(lib, engine, attr, x_md, d.md(_QUERY_DIFF_SRC_MD), False),
                         "x": _Operand(lib, engine, attr, x_md, wt.md(_QUERY_SRC_MD), True),
                         "gy_w": gy if self.gy_shared else _Operand(lib, engine, attr, y_md,
                                                                    wt.md(_QUERY_DIFF_DST_MD), True),
                         "gw": _Operand(lib, engine, attr, w_md, wt.md(_QUERY_DIFF_WEIGHTS_MD), False)},
        }
        backward = self.ops["backward"]
        self.bias_memory = {}
        for role, present in (("b", bias), ("gb", bias and bias_grad)):
            if present:
                memory = _void_p()
                _check(lib.dnnl_memory_create(ctypes.byref(memory), b_md, engine, None), "memory object")
                self.bias_memory[role] = memory
        f.bind([(ARG_SRC, self.ops["forward"]["x"].memory), (ARG_WEIGHTS, self.ops["forward"]["w"].memory),
                (ARG_DST, self.ops["forward"]["y"].memory)]
               + ([(ARG_BIAS, self.bias_memory["b"])] if bias else []))
        d.bind([(ARG_DIFF_DST, backward["gy"].memory), (ARG_WEIGHTS, backward["w"].memory),
                (ARG_DIFF_SRC, backward["gx"].memory)])
        wt.bind([(ARG_SRC, backward["x"].memory), (ARG_DIFF_DST, backward["gy_w"].memory),
                 (ARG_DIFF_WEIGHTS, backward["gw"].memory)]
                + ([(ARG_DIFF_BIAS, self.bias_memory["gb"])] if "gb" in self.bias_memory else []))

    def implementations(self):
        """oneDNN's names of the three kernels it chose (jit:avx512_core, gemm:jit, ...)."""
        return {"forward": self.fwd.impl(), "backward_data": self.bwd_data.impl(),
                "backward_weights": self.bwd_weights.impl()}

    def _primitives(self, phase):
        return [self.fwd] if phase == "forward" else [self.bwd_data, self.bwd_weights]

    def workspace(self, phase, weight_grad=True, input_grad=True):
        """{name: bytes}: each blocked copy (`<role>_blk`) and the scratchpad the kernels and
        reorders of `phase` share (they run one after another); in backward only the copies
        of the gradients that are computed (`weight_grad`: dW, `input_grad`: gx)."""
        operands = self.ops[phase]
        roles = set(operands)
        if phase == "backward":   # backward copies gy for either gradient
            roles = set()
            if weight_grad:
                roles |= {"gy", "gy_w", "x", "gw"}
            if input_grad:
                roles |= {"gy", "w", "gx"}
            if self.gy_shared:
                roles.discard("gy_w")
        sizes = {f"{role}_blk": operands[role].blocked_bytes for role in operands
                 if role in roles and operands[role].blocked_bytes}
        scratch = [p.scratch_bytes for p in self._primitives(phase)]
        scratch += [op.reorder.scratch_bytes for op in operands.values() if op.reorder is not None]
        if max(scratch):
            sizes["scratch"] = max(scratch)
        return sizes

    def reorders_all(self, phase, roles):
        """Whether every one of `roles` goes through a blocked copy in `phase` (a result can
        then overwrite its input's bytes: the input was copied out before)."""
        return all(self.ops[phase][role].reorder is not None for role in roles)

    def _set(self, memory, array):
        """Point a memory object at an array's bytes; a foreign call only when they moved (a
        static plan hands the same views every step)."""
        address = array.ctypes.data
        if self._handles.get(memory.value) != address:
            _check(self.lib.dnnl_memory_set_data_handle(memory, _void_p(address)), "data handle")
            self._handles[memory.value] = address

    def _bind(self, phase, arrays, ws):
        scratch = ws.get("scratch")
        for role, array in arrays.items():
            op = self.ops[phase][role]
            self._set(op.plain, array)
            if op.reorder is not None:
                self._set(op.memory, ws[f"{role}_blk"])
                if op.reorder.scratch is not None:
                    self._set(op.reorder.scratch, scratch)
        for primitive in self._primitives(phase):
            if primitive.scratch is not None:
                self._set(primitive.scratch, scratch)

    def _reorder(self, phase, role):
        """Copy the operand into its blocked copy, or the result out of it (the direction the
        reorder was made for); nothing where the primitive reads the plain array."""
        op = self.ops[phase][role]
        if op.reorder is not None:
            op.reorder.run(self.stream)

    def forward(self, x, weight, bias, y, ws, weights_ready=False):
        """y from x; `weights_ready`: the blocked copy of the weights in `ws` holds them
        already (a later batch chunk of the same step)."""
        self._bind("forward", {"x": x, "w": weight, "y": y}, ws)
        if bias is not None:
            self._set(self.bias_memory["b"], bias)
        for role in ("x",) if weights_ready else ("x", "w"):
            self._reorder("forward", role)
        self.fwd.run(self.stream)
        self._reorder("forward", "y")
        _check(self.lib.dnnl_stream_wait(self.stream), "stream wait")

    def backward(self, x, weight, gy, gx, gw, gb, ws, weights_ready=False):
        """gx (None: not needed) and gw (None: frozen) from gy, with gb when the primitives
        were made with `bias_grad` and gw is computed. gx may share gy's bytes only where
        `reorders_all("backward", ("gy", "gx"))` holds. `weights_ready`: as in forward."""
        arrays = {"gy": gy}
        if gx is not None:
            arrays.update(w=weight, gx=gx)
        if gw is not None:
            arrays.update(x=x, gw=gw)
            if not self.gy_shared:
                arrays["gy_w"] = gy
        self._bind("backward", arrays, ws)
        self._reorder("backward", "gy")
        if gw is not None:
            if not self.gy_shared:
                self._reorder("backward", "gy_w")
            if "gb" in self.bias_memory:
                self._set(self.bias_memory["gb"], gb)
            self._reorder("backward", "x")
            self.bwd_weights.run(self.stream)
            self._reorder("backward", "gw")
        if gx is not None:
            if not weights_ready:
                self._reorder("backward", "w")
            self.bwd_data.run(self.stream)
            self._reorder("backward", "gx")
        _check(self.lib.dnnl_stream_wait(self.stream), "stream wait")
