"""The GPU kernels' Python side: which calls they serve, and one launcher per kernel.

The kernels (minigist/gpu/cuda_source.py, one RawModule per device) serve a call when `xp` is
cupy, or the checker's stand-in (minigist/gpu/rules.py), and they are switched on (the
default; `use_gpu_kernels(False)` runs the `xp` ufunc code instead, which the GPU tests compare
them with). Each launcher takes the arrays the step was handed and a `reference`: the numpy
code, as (function, arguments), that writes the kernel's bytes; under the checker that is what
runs, on numpy's views of the same arrays, counted as one launch. On cupy the reference is never
called.

The codecs and layers call these where their numba kernels would serve on a CPU:
DPR (codecs/dpr.py), the bit packings (codecs/bits.py, codecs/fused.py), SSDC (codecs/ssdc.py),
MAX pooling (layers/pooling.py), ReLU and Dropout (layers/activation.py), BatchNorm and Scale
(layers/normalization.py).
"""
import contextlib

import numpy as np

from .cuda_source import OPTIONS, SOURCE

THREADS = 256
MAX_BLOCKS = 1 << 16          # the kernels loop over the grid (MG_EACH): enough blocks for any GPU
_enabled = [True]
_modules = {}


def _is_rules(xp):
    return getattr(xp, "name", None) == "cupy-rules"


def serves(xp):
    """Whether the GPU kernels run this call: xp is cupy or the checker, and they are on."""
    return _enabled[0] and (_is_rules(xp) or getattr(xp, "__name__", None) == "cupy")


@contextlib.contextmanager
def use_gpu_kernels(on):
    """Switch the GPU kernels on or off inside the block (off: the `xp` ufunc code runs)."""
    previous, _enabled[0] = _enabled[0], bool(on)
    try:
        yield
    finally:
        _enabled[0] = previous


def module(xp):
    """The compiled RawModule of the current device (compiled once; CuPy caches the binary)."""
    device = xp.cuda.Device().id
    if device not in _modules:
        _modules[device] = xp.RawModule(code=SOURCE, options=OPTIONS)
    return _modules[device]


def _raw(value):
    from .rules import _raw as raw
    return raw(value)


def _launch(xp, name, count, args, writes, reads, reference):
    """Run kernel `name` over `count` items (one thread each, grid-stride), or under the checker
    its reference (function, arguments), called as function(numpy, *raw arguments)."""
    if _is_rules(xp):
        function, arguments = reference
        return xp.kernel(name, lambda: function(np, *_raw(arguments)), writes, reads)
    for array in args:
        if hasattr(array, "flags") and not array.flags.c_contiguous:
            raise ValueError(f"GPU kernel {name}: an array of shape {array.shape} is not C-contiguous")
    blocks = max(1, min(MAX_BLOCKS, -(-int(count) // THREADS)))
    module(xp).get_function(name)((blocks,), (THREADS,), args)


def _i64(n):
    return np.int64(n)


# ---- DPR -----------------------------------------------------------------------------------------
def dpr_args(dpr):
    """DPR's 14 integers (minigist.codecs.kernels.dpr_params, the integer path) as uint32."""
    from ..codecs.kernels import _dpr_params
    return tuple(np.uint32(v) for v in _dpr_params(dpr)[:14])


_CODE_KERNELS = {1: "u8", 2: "u16"}


def dpr_encode(xp, dpr, src, codes, reference):
    """codes <- DPR codes of the float32 1-D src (fp10: words of three)."""
    n = src.size
    kind = "fp10" if dpr.per == 3 else _CODE_KERNELS[dpr.code_dtype.itemsize]
    _launch(xp, f"dpr_encode_{kind}", n, (src, codes, _i64(n)) + dpr_args(dpr), [codes], [src], reference)


def dpr_decode(xp, dpr, codes, out, reference):
    """out (float32, 1-D) <- the values of its len(out) first codes."""
    n = out.size
    kind = "fp10" if dpr.per == 3 else _CODE_KERNELS[dpr.code_dtype.itemsize]
    _launch(xp, f"dpr_decode_{kind}", n, (codes, out, _i64(n)) + dpr_args(dpr), [out], [codes], reference)


# ---- bit packing ------------------------------------------------------------------------------
def pack_positive(xp, x, bits, reference):
    n = x.size
    _launch(xp, "pack_positive", -(-n // 8), (x, bits, _i64(n)), [bits], [x], reference)


def pack_codes(xp, codes, dst, width, reference):
    n = codes.size
    _launch(xp, "pack_codes", -(-n * width // 8), (codes, dst, _i64(n), np.int32(width)), [dst], [codes], reference)


def unpack_codes(xp, src, dst, width, reference):
    n = dst.size
    _launch(xp, "unpack_codes", n, (src, dst, _i64(n), np.int32(width)), [dst], [src], reference)


def relu_pool_pack(xp, argmax, pooled, dst, reserved, reference):
    n = argmax.size
    _launch(xp, "relu_pool_pack", -(-n // 2), (argmax, pooled, dst, _i64(n), np.uint32(reserved)), [dst],
            [argmax, pooled], reference)


# ---- SSDC ---------------------------------------------------------------------------------------
FORMAT_FLAGS = {("csr",): 1, ("bitmap",): 2, ("csr", "bitmap"): 3, ("bitmap", "csr"): 3}


def _value_bytes(codec):
    if codec.dpr is None:
        return 4
    return 0 if codec.dpr.per == 3 else codec.dpr.code_dtype.itemsize


def ssdc_encode(xp, codec, u, data, views, stats, slot, reference):
    """SSDC's encode on the device (cuda_source's protocol): u (uint32 bits, 1-D) into the
    `data` buffer and its views; the densest count and the overflows go to stats[2 * slot],
    stats[2 * slot + 1] (int32, on the device). No host sync."""
    n = u.size
    rows = -(-n // 256)
    tail = views["tail"]
    counts = tail[:rows + 1].view(np.int32)
    params = dpr_args(codec.dpr) if codec.dpr is not None else (np.uint32(0),) * 14
    values = views["values"]
    if not _is_rules(xp):
        _launch(xp, "ssdc_count_rows", rows, (u, _i64(n), counts), None, None, None)
        _launch(xp, "ssdc_scan", 1, (counts, _i64(n), data, _i64(min(codec.capacity, n)),
                                     np.int32(FORMAT_FLAGS[codec.formats]), stats, np.int32(slot),
                                     values.view(np.uint32) if _value_bytes(codec) == 0 else data,
                                     np.int32(3 if _value_bytes(codec) == 0 else 1)), None, None, None)
        _launch(xp, "ssdc_write_values", rows, (u, _i64(n), data, counts, values, np.int32(_value_bytes(codec)),
                                                tail[rows + 1:].view(np.uint8), np.int32(codec.dpr is not None))
                + params, None, None, None)
        _launch(xp, "ssdc_write_bitmap", -(-n // 8), (u, _i64(n), data, tail.view(np.uint8)), None, None, None)
        return
    _launch(xp, "ssdc_encode", n, None, [data, stats], [u], reference)


def ssdc_decode(xp, codec, data, views, out_u, scratch, reference):
    """SSDC's decode on the device into out_u (uint32 bits, 1-D); `scratch` (int32, at least
    rows + 1) takes the bitmap format's row offsets. The header is read by the kernels."""
    n = out_u.size
    rows = -(-n // 256)
    if not _is_rules(xp):
        tail = views["tail"]
        bitmap = tail.view(np.uint8)
        params = dpr_args(codec.dpr) if codec.dpr is not None else (np.uint32(0),) * 14
        offsets = scratch[:rows + 1]
        _launch(xp, "ssdc_bitmap_rows", rows, (bitmap, _i64(n), data, offsets), None, None, None)
        _launch(xp, "ssdc_scan_rows", 1, (offsets, _i64(n), data), None, None, None)
        _launch(xp, "ssdc_decode_rows", rows, (data, tail[:rows + 1].view(np.int32), tail[rows + 1:].view(np.uint8),
                                               bitmap, offsets, views["values"], np.int32(_value_bytes(codec)),
                                               out_u, _i64(n), np.int32(codec.dpr is not None)) + params,
                None, None, None)
        return
    _launch(xp, "ssdc_decode", n, None, [out_u], [data], reference)


# ---- MAX pooling --------------------------------------------------------------------------------
def _pool_geometry(layer, shape):
    n, c, h, w = shape
    (kh, kw), (sh, sw), (ph, pw), (oh, ow) = layer.kernel, layer.stride, layer.pad, layer.out_hw
    return tuple(np.int32(v) for v in (c, h, w, oh, ow, kh, kw, sh, sw, ph, pw))


def max_forward(xp, layer, x, y, argmax, reference):
    _launch(xp, "max_forward", y.size, (x, y, argmax, _i64(y.size)) + _pool_geometry(layer, x.shape)
            + (np.int32(layer.empty_windows),), [y, argmax], [x], reference)


def max_backward(xp, layer, argmax, gy, gx, reference):
    _launch(xp, "max_backward", gx.size, (argmax, gy, gx, _i64(gx.size)) + _pool_geometry(layer, gx.shape)
            + (np.int32(layer.disjoint),), [gx], [argmax, gy], reference)


# ---- ReLU, Dropout, BatchNorm, Scale ------------------------------------------------------------
def relu_forward(xp, x, y, reference):
    _launch(xp, "relu_forward", x.size, (x, y, _i64(x.size)), [y], [x], reference)


def relu_backward(xp, y, gy, gx, reference):
    _launch(xp, "relu_backward", gy.size, (y, gy, gx, _i64(gy.size)), [gx], [y, gy], reference)


def mask_backward(xp, mask, gy, gx, reference):
    _launch(xp, "mask_backward", gy.size, (mask, gy, gx, _i64(gy.size)), [gx], [mask, gy], reference)


def _channels(shape3):
    n, c, s = shape3
    return _i64(n * c * s), np.int32(c), _i64(s)


def bn_center_square(xp, x, mean, y, square, reference):
    _launch(xp, "bn_center_square", x.size, (x, mean, y, square) + _channels(x.shape), [y, square], [x, mean],
            reference)


def scale_channels(xp, y, scale, reference):
    _launch(xp, "scale_channels", y.size, (y, scale) + _channels(y.shape), [y], [scale], reference)


def bn_input_grad(xp, gy, y, mean_gy_y, mean_gy, inv_std, gx, reference):
    _launch(xp, "bn_input_grad", gy.size, (gy, y, np.int32(y.dtype == np.float16), mean_gy_y, mean_gy, inv_std, gx)
            + _channels(gy.shape), [gx], [gy, y], reference)


def product(xp, gy, x, out, reference):
    _launch(xp, "product", gy.size, (gy, x, np.int32(x.dtype == np.float16), out, _i64(gy.size)), [out], [gy, x],
            reference)


def scale_bias(xp, x, scale, bias, y, reference):
    _launch(xp, "scale_bias", x.size, (x, scale, bias, y) + _channels(x.shape), [y], [x], reference)


def scale_grads(xp, gy, x, scale, out, gx, reference):
    _launch(xp, "scale_grads", gy.size, (gy, x, np.int32(x.dtype == np.float16), scale, out, gx)
            + _channels(gy.shape), [out, gx], [gy, x], reference)


class CounterRNG:
    """Dropout's random stream on the GPU: splitmix64 of (seed, position) computed in the kernel,
    so its whole state is two integers (JSON in a checkpoint, exact on resume) and drawing
    allocates nothing. `bit_generator.state` reads and writes them, as numpy's does its own."""

    NAME = "minigist-splitmix64"

    def __init__(self, seed):
        self.seed = int(np.random.SeedSequence(seed).generate_state(1, np.uint64)[0])
        self.counter = 0
        self.bit_generator = self

    @property
    def state(self):
        return {"bit_generator": self.NAME, "seed": self.seed, "counter": self.counter}

    @state.setter
    def state(self, value):
        if value.get("bit_generator") != self.NAME:
            raise ValueError(f"not a {self.NAME} state")
        self.seed, self.counter = int(value["seed"]), int(value["counter"])

    def take(self, count):
        """The stream position of `count` numbers drawn now."""
        position = self.counter
        self.counter += int(count)
        return position


def keep_threshold(ratio):
    """Dropout keeps an element when its 24-bit draw, as a fraction of 2**24, is >= ratio."""
    return int(np.ceil(ratio * (1 << 24)))


def mix(z):
    """splitmix64's finaliser on uint64 numpy arrays (cuda_source's mg_mix)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def dropout_keep(seed, position, count, threshold):
    """The kernel's mask for `count` elements from stream `position`, in numpy (uint8 0/1)."""
    with np.errstate(over="ignore"):
        index = np.arange(count, dtype=np.uint64) + np.uint64(position) + np.uint64(1)
        z = mix(np.uint64(seed) + np.uint64(0x9E3779B97F4A7C15) * index)
    return ((z >> np.uint64(40)) >= np.uint64(threshold)).astype(np.uint8)


def _dropout_reference(xp, x, y, mask, seed, position, threshold, scale):
    keep = dropout_keep(seed, position, x.size, threshold).reshape(x.shape)
    np.copyto(mask.view(np.uint8), keep)
    np.multiply(x, mask, out=y)
    np.multiply(y, np.float32(scale), out=y)


def dropout_forward(xp, x, y, mask, ratio, scale, rng):
    """y = x * mask * scale, mask (bool) drawn from the CounterRNG `rng`."""
    n = x.size
    position, threshold = rng.take(n), keep_threshold(ratio)
    _launch(xp, "dropout_forward", n, (x, y, mask, _i64(n), np.uint64(rng.seed), np.uint64(position),
                                       np.uint32(threshold), np.float32(scale)), [y, mask], [x],
            (_dropout_reference, (x, y, mask, rng.seed, position, threshold, scale)))


# ---- strided batched GEMM (layers/gemm.py) -----------------------------------------------------
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_ONE, _ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)     # alpha and beta, host pointers
_strided_checked = {}      # device id -> whether cuBLAS's strided batched GEMM gave matmul's values


def _cublas(xp):
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError:
        cublas = xp.cuda.cublas
    return cublas


def strided_gemm(xp, a, b, out, batch):
    """out[j] = a[j] @ b[j] for the `count` matrices of `batch` = (count, stride of a, of b, of
    out, in elements: 0 where an operand is broadcast), one cuBLAS call; each operand's last
    two axes row- or column-major (layers/gemm.py: batched_plan), out's row-major. Under the
    checker numpy's matmul of the stack, counted as one launch."""
    from ..layers.gemm import matrix_layout
    if _is_rules(xp):
        return xp.strided_gemm(a, b, out)
    count, stride_a, stride_b, stride_out = batch
    rows, inner = a.shape[-2:]
    cols = b.shape[-1]
    layout_a, ld_a = matrix_layout(a.shape[-2:], a.strides[-2:])
    layout_b, ld_b = matrix_layout(b.shape[-2:], b.strides[-2:])
    ld_out = matrix_layout(out.shape[-2:], out.strides[-2:])[1]
    # cuBLAS is column-major: a row-major out is out^T there, and out^T = b^T a^T; a row-major
    # operand read column-major is its transpose already
    _cublas(xp).sgemmStridedBatched(
        xp.cuda.device.get_cublas_handle(),
        _CUBLAS_OP_N if layout_b == "row" else _CUBLAS_OP_T, _CUBLAS_OP_N if layout_a == "row" else _CUBLAS_OP_T,
        int(cols), int(rows), int(inner), _ONE.ctypes.data,
        b.data.ptr, int(ld_b), int(stride_b), a.data.ptr, int(ld_a), int(stride_a),
        _ZERO.ctypes.data, out.data.ptr, int(ld_out), int(stride_out), int(count))


def strided_gemm_usable(xp):
    """Whether strided_gemm serves on this device: under the checker always; on cupy once per
    device, by computing small transposed and broadcast stacks both ways (one host sync, at
    the first use; a CuPy whose cuBLAS binding reads alpha and beta otherwise falls back to
    one product per matrix)."""
    if _is_rules(xp):
        return True
    device = xp.cuda.Device().id
    if device not in _strided_checked:
        _strided_checked[device] = _strided_gives_matmul(xp)
    return _strided_checked[device]


def _strided_gives_matmul(xp):
    """strided_gemm against numpy's matmul on a transposed stack and on a broadcast transposed
    matrix, the two forms layers/conv_im2col.py's pointwise backward hands it."""
    from ..layers.gemm import batched_plan
    rng = np.random.default_rng(0)

    def draw(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    cases = [(draw(3, 5, 4), draw(3, 6, 4), lambda x: x, lambda x: x.transpose(0, 2, 1)),
             (draw(4, 5), draw(3, 4, 6), lambda x: x.T[None], lambda x: x)]
    try:
        for a_host, b_host, view_a, view_b in cases:
            a, b = view_a(xp.asarray(a_host)), view_b(xp.asarray(b_host))
            expected = np.matmul(view_a(a_host), view_b(b_host))
            out = xp.empty(expected.shape, dtype=np.float32)
            plan = batched_plan(a, b, out)
            if plan is None or plan[0]:
                return False
            strided_gemm(xp, a, b, out, plan[1])
            if not np.allclose(xp.asnumpy(out), expected, rtol=1e-4, atol=1e-4):
                return False
    except Exception:        # noqa: BLE001 (a binding this code does not know: the per-matrix path serves)
        return False
    return True
