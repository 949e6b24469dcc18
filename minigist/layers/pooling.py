"""Pooling with Caffe's semantics: MAX and AVE, ceil or floor rounding, padding, global pooling.

The windows are visited one kernel offset (ki, kj) at a time: the offset's strided slice of
the input holds that element of every window, so forward and backward are kh*kw whole-tensor
operations with no Python loop over positions. Where windows reach into padding or into the
ceil-mode overhang, the input is first copied into a declared workspace buffer that covers
every window, filled with -inf (MAX: padding never wins) or 0 (AVE: padding adds nothing).

With numba installed (minigist/jit.py), MAX pooling's forward and backward run compiled
kernels instead (minigist/layers/pool_kernels.py): a pass per plane, no padded copy of the
whole chunk, the same bytes.

MAX keeps only the saved `argmax` map: the index ki*kw+kj of each output's winner inside its
window (the first maximum in row-major window order wins ties, as in Caffe), as uint8 when the
window has at most 256 elements. `backward_from_index` rebuilds gx from that map alone.

AVE divides by Caffe's pool size: the window clipped to the padded input (padding counts, the
ceil-mode overhang beyond it does not). It keeps nothing.

Caffe quirk kept: in CEIL mode with no padding and a stride larger than the kernel, the last
window can lie wholly outside the input. Caffe's MAX then outputs -FLT_MAX (and passes no
gradient); so does this layer. Caffe's AVE divides 0 by a pool size <= 0 there (0/0 = NaN or
-0); this layer outputs 0.
"""

import numpy as np

from .. import jit
from ..gpu import kernels as gpu_kernels
from ..errors import ModelFileError
from . import pool_kernels
from .base import Layer, TensorDecl, paired, register

_FLT_MAX = float(np.finfo(np.float32).max)


def _runs(values):
    """(start, stop, value) of each run of equal consecutive values."""
    runs, start = [], 0
    for index in range(1, len(values) + 1):
        if index == len(values) or values[index] != values[start]:
            runs.append((start, index, values[start]))
            start = index
    return runs


def _overlap(offset, src_len, dst_len):
    """Slices (dst, src) of the overlap when a src of length src_len sits at `offset` in dst."""
    d0 = max(offset, 0)
    d1 = max(min(offset + src_len, dst_len), d0)
    return slice(d0, d1), slice(d0 - offset, d1 - offset)


@register
class Pooling(Layer):
    type = "Pooling"
    chunk_bytes = 4 << 20       # target size of the largest workspace: batch chunks of this
    microbatchable = True
    param_field = "pooling_param"

    def _round_mode(self, p):
        """round_mode, or a fork's `ceil_mode: true|false` (DenseNet's Caffe files) for CEIL|FLOOR."""
        if not p.has("ceil_mode"):
            return p.get("round_mode", "CEIL")
        mode = "CEIL" if p.get("ceil_mode") else "FLOOR"
        if p.has("round_mode") and p.get("round_mode") != mode:
            raise ModelFileError(self.spec.path, p.line_of("ceil_mode"),
                                 f"layer '{self.name}' (Pooling): ceil_mode: {str(p.get('ceil_mode')).lower()} "
                                 f"means round_mode {mode}, but round_mode {p.get('round_mode')} is given "
                                 f"(line {p.line_of('round_mode')}); give one of them")
        return mode

    def setup(self, bottom_shapes):
        p = self.p
        shape = tuple(int(d) for d in bottom_shapes[0])
        self.method = p.get("pool", "MAX")
        if self.method not in ("MAX", "AVE"):
            self.fail(f"pool: {self.method} is not supported (only MAX and AVE)")
        if len(shape) != 4:
            self.fail(f"a {len(shape)}-D input {shape} is not supported: only 2-D pooling of 4-D "
                      f"(N, C, H, W) inputs")
        n, c, h, w = shape
        self.global_pooling = bool(p.get("global_pooling", False))
        has = p.has
        if self.global_pooling:
            if has("kernel_size") or has("kernel_h") or has("kernel_w"):
                self.fail("with global_pooling the kernel size cannot be given")
            kh, kw = h, w
        elif has("kernel_size"):
            if has("kernel_h") or has("kernel_w"):
                self.fail("give either kernel_size or kernel_h and kernel_w, not both")
            kh = kw = int(p.get("kernel_size"))
        elif has("kernel_h") and has("kernel_w"):
            kh, kw = int(p.get("kernel_h")), int(p.get("kernel_w"))
        else:
            self.fail("kernel_size (or both kernel_h and kernel_w) is required")
        ph, pw = self._pair("pad", 0)
        sh, sw = self._pair("stride", 1)
        if kh <= 0 or kw <= 0:
            self.fail(f"kernel size must be positive, got {kh}x{kw}")
        if sh <= 0 or sw <= 0:
            self.fail(f"stride must be positive, got {sh}x{sw}")
        if self.global_pooling and (ph, pw, sh, sw) != (0, 0, 1, 1):
            self.fail("with global_pooling only pad 0 and stride 1 are allowed")
        if ph >= kh or pw >= kw:
            self.fail(f"pad ({ph}, {pw}) must be smaller than the kernel ({kh}, {kw})")
        self.round_mode = self._round_mode(p)
        out = []
        for size, k, s, pd in ((h, kh, sh, ph), (w, kw, sw, pw)):
            if self.round_mode == "CEIL":
                o = -((k - size - 2 * pd) // s) + 1     # ceil((size + 2p - k) / s) + 1
            else:
                o = (size + 2 * pd - k) // s + 1
            if (ph, pw) != (0, 0) and (o - 1) * s >= size + pd:
                # the last window must start inside the input or its top/left pad; Caffe
                # applies this on both axes as soon as either has a pad
                o -= 1
            if o < 1:
                self.fail(f"kernel {k} is larger than the padded input size {size + 2 * pd}")
            out.append(o)
        oh, ow = out
        return [self._windows(shape, (kh, kw), (sh, sw), (ph, pw), (oh, ow))]

    def _windows(self, shape, kernel, stride, pad, out_hw):
        """Set the geometry every pass reads from the input shape, kernel, stride, the pad
        before each axis (windows start at -pad) and the output size; declare the argmax map
        (MAX). Returns the top shape."""
        n, c, h, w = shape
        (kh, kw), (sh, sw), (ph, pw), (oh, ow) = kernel, stride, pad, out_hw
        self.kernel, self.stride, self.pad = (kh, kw), (sh, sw), (ph, pw)
        self.in_shape, self.out_hw = shape, (oh, ow)
        # the buffer every window fits in: rows -ph .. (oh-1)*sh - ph + kh of the input
        self.buf_hw = ((oh - 1) * sh + kh, (ow - 1) * sw + kw)
        self.needs_buffer = (ph, pw) != (0, 0) or self.buf_hw[0] > h or self.buf_hw[1] > w
        # some window lies wholly outside the input (CEIL, pad 0, stride > kernel)
        self.empty_windows = (oh - 1) * sh - ph >= h or (ow - 1) * sw - pw >= w
        # every input element is in exactly one window (e.g. 2x2, stride 2 on an even size)
        self.tiles = (not self.needs_buffer and (sh, sw) == (kh, kw)
                      and self.buf_hw == (h, w))
        self.disjoint = sh >= kh and sw >= kw
        top = (n, c, oh, ow)
        if self.method == "MAX":
            windows = kh * kw
            dtype = np.uint8 if windows <= 256 else np.uint16 if windows <= 65536 else np.uint32
            self.saved = {"argmax": TensorDecl(top, dtype)}
        return top

    def _pair(self, name, default):
        """Caffe's `name` or both `name_h` and `name_w`."""
        p = self.p
        hname, wname = name + "_h", name + "_w"
        if p.has(hname) or p.has(wname):
            if p.has(name):
                self.fail(f"give either {name} or {hname} and {wname}, not both")
            if not (p.has(hname) and p.has(wname)):
                self.fail(f"{hname} and {wname} must be given together")
            return int(p.get(hname)), int(p.get(wname))
        value = int(p.get(name, default))
        return value, value

    @property
    def keeps_zeros(self):
        return self.method == "MAX"    # the max of a window of zeros and positives

    def argmax_positions(self):
        if self.method != "MAX":
            return None
        kernel_h, kernel_w = self.kernel
        return kernel_h * kernel_w

    # ---- geometry ----------------------------------------------------------------------
    @property
    def _global(self):
        """Whether one window covers the whole input exactly (global pooling, however given)."""
        return self.out_hw == (1, 1) and self.kernel == tuple(self.in_shape[2:]) and self.pad == (0, 0)

    def _offsets(self):
        kh, kw = self.kernel
        return [(k, k // kw, k % kw) for k in range(kh * kw)]

    def _slice(self, array, i, j):
        """The elements at window offset (i, j) of every window: an (N, C, OH, OW) view."""
        (sh, sw), (oh, ow) = self.stride, self.out_hw
        return array[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]

    def _regions(self):
        """(buffer rows, buffer cols, input rows, input cols) of the input inside the buffer."""
        (ph, pw), (hb, wb) = self.pad, self.buf_hw
        h, w = self.in_shape[2:]
        rows, src_rows = _overlap(ph, h, hb)
        cols, src_cols = _overlap(pw, w, wb)
        return rows, cols, src_rows, src_cols

    def _pool_sizes(self):
        """Caffe's divisor per output (rows, cols): the window clipped to the padded input."""
        sizes = []
        for size, k, s, pd, o in zip(self.in_shape[2:], self.kernel, self.stride, self.pad,
                                     self.out_hw):
            starts = np.arange(o) * s - pd
            sizes.append(np.minimum(starts + k, size + pd) - starts)
        return sizes

    def _chunk(self):
        """Samples per batch chunk: the workspaces hold one chunk, not the whole batch."""
        n, c = self.in_shape[:2]
        (hb, wb), (oh, ow) = self.buf_hw, self.out_hw
        per_sample = c * max(hb * wb if self.needs_buffer else 0, oh * ow) * np.dtype(self.dtype).itemsize
        return max(1, min(n, self.chunk_bytes // max(per_sample, 1)))

    def workspace(self, phase, gx_needed=None):
        n, c = self.in_shape[:2]
        ws = {}
        if self._global:
            if self.method == "MAX":
                if phase == "forward":
                    ws["index"] = TensorDecl((n, c), np.intp)
                else:
                    ws["mask"] = TensorDecl(self.in_shape, np.bool_)
            return ws
        b = self._chunk()
        top = (b, c) + self.out_hw
        buf = (b, c) + self.buf_hw
        if phase == "forward":
            if self.needs_buffer:
                ws["xpad"] = TensorDecl(buf)
            if self.method == "MAX":
                ws["wins"] = TensorDecl(top, self.saved["argmax"].dtype)
        else:
            if self.needs_buffer:
                ws["gxpad"] = TensorDecl(buf)
            if self.method == "MAX":
                ws["mask"] = TensorDecl(top, np.bool_)
            if self.method == "AVE" or not self.disjoint:
                ws["gtop"] = TensorDecl(top)
        return ws

    # ---- forward ------------------------------------------------------------------------
    def forward(self, xp, x, y, p, saved, ws):
        x0, y0 = x[0], y[0]
        n, c, h, w = x0.shape
        if self._global:
            x3, y2 = x0.reshape(n, c, h * w), y0.reshape(n, c)
            if self.method == "MAX":
                xp.max(x3, axis=2, out=y2)
                index = ws["index"]
                xp.argmax(x3, axis=2, out=index)     # the first maximum, as in Caffe
                xp.copyto(saved["argmax"].reshape(n, c), index, casting="unsafe")
            else:
                xp.sum(x3, axis=2, out=y2)
                xp.divide(y2, h * w, out=y2)
            return
        if self.method == "MAX" and gpu_kernels.serves(xp) and saved["argmax"].dtype == np.uint8 \
                and x0.dtype == np.float32:
            gpu_kernels.max_forward(xp, self, x0, y0, saved["argmax"], (self.forward, (x, y, p, saved, ws)))
            return
        if self.method == "MAX" and jit.active(xp, x0, y0, saved["argmax"]):
            (ph, pw), (sh, sw), (kh, kw) = self.pad, self.stride, self.kernel
            dtype = y0.dtype.type
            pool_kernels.max_forward(x0, y0, saved["argmax"], ph, pw, sh, sw, kh, kw,
                                     self.empty_windows, dtype(-np.inf), dtype(-_FLT_MAX))
            return
        chunk = ws["wins" if self.method == "MAX" else "xpad"].shape[0] if ws else n
        for n0 in range(0, n, chunk):
            self._forward_chunk(xp, x0[n0:n0 + chunk], y0[n0:n0 + chunk],
                                saved["argmax"][n0:n0 + chunk] if self.method == "MAX" else None,
                                {k: v[:min(chunk, n - n0)] for k, v in ws.items()}, n0 == 0)

    def _forward_chunk(self, xp, x0, y0, argmax, ws, first):
        src = x0
        if self.needs_buffer:
            src = ws["xpad"]
            rows, cols, src_rows, src_cols = self._regions()
            if first:   # the border stays as filled for every chunk
                src.fill(-np.inf if self.method == "MAX" else 0)
            xp.copyto(src[:, :, rows, cols], x0[:, :, src_rows, src_cols])
        if self.method == "MAX":
            wins = ws["wins"]
            for k, i, j in self._offsets():
                window = self._slice(src, i, j)
                if k == 0:
                    xp.copyto(y0, window)
                    argmax.fill(0)
                    continue
                # offsets come in increasing k, so where offset k wins (strictly: the first
                # maximum stays) argmax = max(argmax, k) = k, elsewhere max(argmax, 0) keeps it
                xp.greater(window, y0, out=wins)
                xp.maximum(y0, window, out=y0)
                xp.multiply(wins, k, out=wins)
                xp.maximum(argmax, wins, out=argmax)
            if self.empty_windows:
                xp.maximum(y0, -_FLT_MAX, out=y0)   # Caffe's value for a window with no input
        else:
            for k, i, j in self._offsets():
                window = self._slice(src, i, j)
                if k == 0:
                    xp.copyto(y0, window)
                else:
                    xp.add(y0, window, out=y0)
            self._divide(xp, y0, y0)

    def _divide(self, xp, values, out):
        """out <- values (b, C, OH, OW) / each output's pool size: one division per block of
        outputs with one size (the sizes differ only near the borders), by a number, so that
        no divisor array is made on the device. Windows with no input (see the module notes)
        divide by 1."""
        rows, cols = self._pool_sizes()
        for r0, r1, row in _runs(rows):
            for c0, c1, col in _runs(cols):
                size = int(row) * int(col)
                block = (slice(None), slice(None), slice(r0, r1), slice(c0, c1))
                source, target = paired(values, out, lambda a: a[block])
                xp.divide(source, float(size if size > 0 else 1), out=target)

    # ---- backward -----------------------------------------------------------------------
    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        if gx[0] is None:
            return
        if self.method == "MAX":
            self.backward_from_index(xp, saved["argmax"], gy[0], gx[0], ws)
            return
        gy0, gx0 = gy[0], gx[0]
        n, c, h, w = gx0.shape
        if self._global:
            xp.divide(gy0.reshape(n, c, 1), h * w, out=gx0.reshape(n, c, h * w))
            return
        chunk = ws["gtop"].shape[0]
        for n0 in range(0, n, chunk):
            gyc, gxc = gy0[n0:n0 + chunk], gx0[n0:n0 + chunk]
            cws = {k: v[:gyc.shape[0]] for k, v in ws.items()}
            scaled = cws["gtop"]
            self._divide(xp, gyc, scaled)
            target = self._grad_target(xp, gxc, cws)
            for k, i, j in self._offsets():
                dst = self._slice(target, i, j)
                if self.disjoint:
                    xp.copyto(dst, scaled)
                else:
                    xp.add(dst, scaled, out=dst)
            self._grad_finish(xp, target, gxc)

    def backward_from_index(self, xp, index, gy, gx, ws):
        """gx of MAX pooling from the argmax map alone: index holds, per output, the position
        ki*kw+kj of the winner inside its window (any integer dtype)."""
        n, c, h, w = gx.shape
        if self._global:
            mask = ws["mask"].reshape(n, c, h * w)
            fits = h * w - 1 <= np.iinfo(index.dtype).max
            positions = xp.arange(h * w, dtype=index.dtype if fits else np.int64)
            xp.equal(index.reshape(n, c, 1), positions, out=mask)
            xp.multiply(gy.reshape(n, c, 1), mask, out=gx.reshape(n, c, h * w))
            return
        if gpu_kernels.serves(xp) and index.dtype == np.uint8 and gy.dtype == np.float32:
            gpu_kernels.max_backward(xp, self, index, gy, gx, (self.backward_from_index, (index, gy, gx, ws)))
            return
        if jit.active(xp, index, gy, gx):
            (ph, pw), (sh, sw), (kh, kw) = self.pad, self.stride, self.kernel
            dtype = gy.dtype.type
            pool_kernels.max_backward(index, gy, gx, ph, pw, sh, sw, kh, kw, self.disjoint,
                                      not self.tiles or self.needs_buffer, dtype(1), dtype(0))
            return
        chunk = ws["mask"].shape[0]
        for n0 in range(0, n, chunk):
            gyc, gxc = gy[n0:n0 + chunk], gx[n0:n0 + chunk]
            self._backward_chunk(xp, index[n0:n0 + chunk], gyc, gxc, {k: v[:gyc.shape[0]] for k, v in ws.items()})

    def _backward_chunk(self, xp, index, gy, gx, ws):
        mask = ws["mask"]
        target = self._grad_target(xp, gx, ws)
        kind = index.dtype.type
        for k, i, j in self._offsets():
            dst = self._slice(target, i, j)
            xp.equal(index, kind(k), out=mask)
            if self.disjoint:
                xp.multiply(gy, mask, out=dst)
            else:
                tmp = ws["gtop"]
                xp.multiply(gy, mask, out=tmp)
                xp.add(dst, tmp, out=dst)
        self._grad_finish(xp, target, gx)

    def _grad_target(self, xp, gx, ws):
        """Where the window gradients go: gx itself or the padded buffer, zeroed unless the
        windows tile gx exactly (then every element is written once)."""
        target = ws["gxpad"] if self.needs_buffer else gx
        if not self.tiles:
            target.fill(0)
        return target

    def _grad_finish(self, xp, target, gx):
        """Copy the input part of the padded buffer to gx (zero where no window reaches)."""
        if target is gx:
            return
        rows, cols, src_rows, src_cols = self._regions()
        h, w = gx.shape[2:]
        if (src_rows.start, src_rows.stop, src_cols.start, src_cols.stop) != (0, h, 0, w):
            gx.fill(0)
        xp.copyto(gx[:, :, src_rows, src_cols], target[:, :, rows, cols])


class OnnxPooling(Pooling):
    """ONNX's MaxPool and AveragePool (2-D): `pads` may differ before and after an axis
    (windows start at -pad_begin; the end pads only add outputs), outputs are
    floor((size + pads - kernel) / stride) + 1, or with ceil_mode the ceiling, less the last
    window when it would start past the input and its begin pad (ONNX's and PyTorch's rule;
    Caffe's CEIL differs: it applies that only with a pad and has no floor mode). AveragePool
    divides by the input elements in the window (count_include_pad 0, the default) or by the
    window clipped to the padded input (1: the pads count, the ceil_mode overhang beyond them
    does not). Every pad is smaller than the kernel, so no window lies wholly in padding.
    Forward, backward, the argmax map and Gist's facts are Pooling's."""
    param_field = "onnx_pool_param"
    method_name = None

    def setup(self, bottom_shapes):
        p = self.p
        shape = tuple(int(d) for d in bottom_shapes[0])
        self.method = self.method_name
        if len(shape) != 4:
            self.fail(f"a {len(shape)}-D input {shape} is not supported: only 2-D pooling of 4-D (N, C, H, W) inputs")
        n, c, h, w = shape
        kernel = [int(k) for k in p.all("kernel_shape")]
        strides = [int(s) for s in p.all("strides")] or [1, 1]
        pads = [int(v) for v in p.all("pads")] or [0, 0, 0, 0]
        if len(kernel) != 2 or len(strides) != 2 or len(pads) != 4:
            self.fail(f"kernel_shape {kernel}, strides {strides}, pads {pads}: 2, 2 and 4 values are needed")
        if min(kernel) <= 0 or min(strides) <= 0 or min(pads) < 0:
            self.fail(f"kernel_shape {kernel} and strides {strides} must be positive, pads {pads} not negative")
        if any(pad >= k for pad, k in zip(pads, kernel + kernel)):
            self.fail(f"pads {pads} must be smaller than the kernel {kernel}")
        self.ceil_mode = bool(p.get("ceil_mode", False))
        self.count_include_pad = bool(p.get("count_include_pad", False))
        self.pads_end = (pads[2], pads[3])
        out = []
        for size, k, s, begin, end in zip((h, w), kernel, strides, pads[:2], pads[2:]):
            span = size + begin + end - k
            if span < 0:
                self.fail(f"kernel {k} is larger than the padded input size {size + begin + end}")
            o = (-(-span // s) if self.ceil_mode else span // s) + 1
            if self.ceil_mode and (o - 1) * s >= size + begin:
                o -= 1
            out.append(o)
        return [self._windows(shape, tuple(kernel), tuple(strides), (pads[0], pads[1]), tuple(out))]

    def _pool_sizes(self):
        """The divisor per output (rows, cols): the window clipped to the input, or with
        count_include_pad to the padded input."""
        sizes = []
        for size, k, s, begin, end, o in zip(self.in_shape[2:], self.kernel, self.stride, self.pad,
                                             self.pads_end, self.out_hw):
            starts = np.arange(o) * s - begin
            if self.count_include_pad:
                sizes.append(np.minimum(starts + k, size + end) - starts)
            else:
                sizes.append(np.minimum(starts + k, size) - np.maximum(starts, 0))
        return sizes


@register
class MaxPool(OnnxPooling):
    type = "MaxPool"
    caffe_type = False       # ONNX's operator: read from .onnx files only
    method_name = "MAX"


@register
class AveragePool(OnnxPooling):
    type = "AveragePool"
    caffe_type = False       # ONNX's operator: read from .onnx files only
    method_name = "AVE"
