"""Convolution with Caffe's semantics (2-D, NCHW, axis 1), through im2col and GEMM (or oneDNN).

Arrays (x, y, gy, gx, weights) come from the executor; every tensor-sized temporary is a
declared workspace:

- `col`: the im2col columns of a chunk of `b` samples, laid out (C, kh, kw, b, OH, Wc), so
  that one GEMM per group, W (O/g, C/g*kh*kw) against (C/g*kh*kw, b*OH*Wc), covers the whole
  chunk; `yfold` takes its (O, b, OH, Wc) result before the bias is added on the way into y.
  Wc is OW, or the width of a padded frame for stride-1 columns of a padded input: each
  column is then one contiguous copy, and the extra columns are dropped (`_x_pass`). The
  frame's rows share their zero padding (`_frame_width`): the gap after one row is also the
  left border of the next, so a 3x3 pad-1 convolution computes W + 1 columns per row, not W + 2;
- `xpad`: the zero-padded input chunk the im2col view reads from (only with pad > 0), flat,
  with the few zeros more that the wide columns read past its end;
- backward: `gyfold` (gy of a chunk as (O, b, OH, Wc)); `gwt` (a chunk's weight gradient
  transposed, dW^T = cols gy^T, copied or added into dW, where dW fits `gw_block_bytes`:
  `_gw_transposed`) or else `gwsum` (a later chunk's weight gradient, computed a block of
  output rows at a time and added in: `gw_block_bytes`, not a second dW); for the input gradient either `gypad` + `wflip` + `gxfold` (stride 1, where a
  cost model finds it cheaper: gx is the stride-1 convolution of the padded gy with the
  flipped, transposed weights, no col2im scatter) or `gxpad` (any stride: the columns W^T gy
  scattered back by one strided add per kernel offset). The backward re-does the im2col of
  x, as Caffe does, reading x one chunk at a time (a Gist stash decodes chunk by chunk).

The chunk size b is chosen so that one chunk's columns take about `chunk_bytes` (at least
one sample): it keeps the columns in cache between the copy and the GEMM on a CPU and bounds
the workspace (Caffe itself works one sample at a time). Set the instance attribute
`batch_chunk` (an int) before asking for workspaces to force a chunk size, e.g. the whole
batch on a GPU; forward and backward take the chunk size from the workspace they are handed.

With `engine = "onednn"` (Net(conv="onednn"), train.py --conv onednn) none of this runs:
oneDNN's direct kernels do forward, input and weight gradient (minigist/onednn.py), and the
workspaces are its blocked copies of the operands and its scratchpad, as oneDNN sizes them.

A 1x1 convolution with stride 1 and no padding needs no im2col: x itself is the column
matrix. It runs per-sample GEMMs (folding the batch cost two transposing copies, measured
slower), sums the per-sample weight gradients of a chunk (`gwn`), and, when input and output
have one shape, works in place through `stage`: each chunk of x (gy) is copied there before
the same chunk of y (gx) is written over it.
"""
import numpy as np

from .. import jit
from . import fused_kernels
from .base import Layer, TensorDecl, expect_int_list, filler_of, register


def _pair(layer, p, name, hname, wname, default, together=False):
    """(h, w) from `name` (1 or 2 values) or from `hname`/`wname` (Caffe's rules); a default
    of None makes the field required, `together` requires both of `hname` and `wname`."""
    values = list(p.all(name))
    if p.has(hname) or p.has(wname):
        if values:
            layer.fail(f"give either {name} or {hname}/{wname}, not both")
        if together and not (p.has(hname) and p.has(wname)):
            layer.fail(f"{hname} and {wname} must be given together")
        return int(p.get(hname, 0)), int(p.get(wname, 0))
    if not values:
        if default is None:
            layer.fail(f"{name} (or {hname} and {wname}) is required")
        return default, default
    h, w = expect_int_list(layer, values, name, 2)
    return int(h), int(w)


def _overlap(offset, src_len, dst_len):
    """Slices (dst, src) of the overlap when a src of length src_len sits at `offset` in dst."""
    d0 = max(offset, 0)
    d1 = min(offset + src_len, dst_len)
    d1 = max(d1, d0)
    return slice(d0, d1), slice(d0 - offset, d1 - offset)


def _zero_outside(dst, rows, cols):
    """Zero every element of (.., Hd, Wd) dst outside dst[..., rows, cols]."""
    dst[:, :, :rows.start].fill(0)
    dst[:, :, rows.stop:].fill(0)
    dst[:, :, rows, :cols.start].fill(0)
    dst[:, :, rows, cols.stop:].fill(0)


def _staged(xp, stage, src):
    """src copied to the front of the flat `stage` workspace, as a view of src's shape."""
    out = stage[:src.size].reshape(src.shape)
    xp.copyto(out, src)
    return out


def _frame_width(width, pad, reach):
    """Width of a stride-1 staging frame (a row of `width` inputs at column `pad`, zeros
    around it) whose im2col is read as contiguous runs of the flattened frame, for a kernel
    that reaches `reach` = dilation * (k - 1) columns. A window that runs past a row's right
    end continues at the start of the next row: the zeros there serve as its right padding,
    so the rows need `pad` zeros between them, not 2 * pad, and the frame must hold the
    `width + 2 * pad - reach` outputs of a row. Never wider than the plain padded row."""
    if pad < 0:
        return width + 2 * pad
    return min(width + 2 * pad, width + max(pad, 2 * pad - reach))


def _im2col(xp, src, col, stride, dilation):
    """col (C, kh, kw, b, OH, Wc) <- the windows of src (b, C, Hs, Ws): one strided copy.
    Wc is OW, or Ws for stride-1 columns at the source's full width (see `_x_pass`)."""
    s0, s1, s2, s3 = src.strides
    view = xp.lib.stride_tricks.as_strided(
        src, shape=col.shape,
        strides=(s1, dilation[0] * s2, dilation[1] * s3, s0, stride[0] * s2, stride[1] * s3))
    xp.copyto(col, view)


@register
class Convolution(Layer):
    type = "Convolution"
    param_field = "convolution_param"
    chunk_bytes = 8 << 20       # target size of one chunk's im2col columns
    gw_block_bytes = 1 << 20    # target size of the partial weight gradient of a later chunk
    ENGINES = ("im2col", "onednn")
    engine = "im2col"           # or "onednn" (minigist/onednn.py): set before workspaces are asked for

    def setup(self, bottom_shapes):
        p = self.p
        shape = tuple(bottom_shapes[0])
        if not p.has("num_output"):
            self.fail("num_output is required")
        self.num_output = int(p.get("num_output"))
        if self.num_output <= 0:
            self.fail("num_output must be positive")
        axis = int(p.get("axis", 1))
        if axis != 1 and axis != 1 - len(shape):
            self.fail(f"axis {axis} is not supported (only the channel axis 1)")
        if len(shape) != 4:
            self.fail(f"a {len(shape)}-D input {shape} is not supported: only 2-D convolution of 4-D "
                      f"(N, C, H, W) inputs")
        n, c, h, w = (int(d) for d in shape)
        self.kernel = _pair(self, p, "kernel_size", "kernel_h", "kernel_w", None, together=True)
        self.stride = _pair(self, p, "stride", "stride_h", "stride_w", 1, together=True)
        self.pad = _pair(self, p, "pad", "pad_h", "pad_w", 0)
        dilation = list(p.all("dilation"))
        self.dilation = (tuple(int(d) for d in expect_int_list(self, dilation, "dilation", 2))
                         if dilation else (1, 1))
        if min(self.kernel) <= 0:
            self.fail(f"kernel size must be positive, got {self.kernel[0]}x{self.kernel[1]}")
        if min(self.stride) <= 0:
            self.fail(f"stride must be positive, got {self.stride[0]}x{self.stride[1]}")
        if min(self.dilation) <= 0:
            self.fail(f"dilation must be positive, got {self.dilation[0]}x{self.dilation[1]}")
        self.group = int(p.get("group", 1))
        if self.group <= 0:
            self.fail("group must be positive")
        if c % self.group:
            self.fail(f"input channels {c} not divisible by group {self.group}")
        if self.num_output % self.group:
            self.fail(f"num_output {self.num_output} not divisible by group {self.group}")
        out = []
        for size, k, s, pd, d, axis_name in zip((h, w), self.kernel, self.stride, self.pad,
                                               self.dilation, ("height", "width")):
            extent = d * (k - 1) + 1
            if size + 2 * pd < extent:
                self.fail(f"kernel extent {extent} is larger than the padded input {axis_name} "
                          f"{size + 2 * pd}")
            out.append((size + 2 * pd - extent) // s + 1)
        self.in_shape = (n, c, h, w)
        self.out_hw = tuple(out)
        kh, kw = self.kernel
        self.cols = (c // self.group) * kh * kw       # K per group
        self.pointwise = (self.kernel == (1, 1) and self.stride == (1, 1) and self.pad == (0, 0))
        oh, ow = self.out_hw
        self.transposed_backward = (self.stride == (1, 1) and not self.pointwise
                                    and self._transposed_cheaper())
        self.batch_chunk = None
        self.add_param("weight", (self.num_output, c // self.group, kh, kw),
                       filler_of(p.get("weight_filler")))
        self.bias_term = bool(p.get("bias_term", True))
        if self.bias_term:
            self.add_param("bias", (self.num_output,), filler_of(p.get("bias_filler")))
        # backward reads x only for the weight gradient
        self.keeps_bottoms = (0,) if self.params[0].trained else ()
        return [(n, self.num_output, oh, ow)]

    def inplace_safe(self, bottom_index, top_index):
        """gx may overwrite gy (and y x) when they have one shape: each batch chunk of gy (x)
        is copied into the column workspace (the 1x1 path: its staging workspace) before the
        same chunk of gx (y) is written; with oneDNN, where x and gy are reordered into
        blocked copies before y and gx are written (and not where a kernel reads them as
        they are)."""
        n, c, h, w = self.in_shape
        if (c, h, w) != (self.num_output,) + self.out_hw:
            return False
        if self.engine == "onednn":
            prims = self.onednn_primitives()
            return prims.reorders_all("forward", ("x", "y")) and prims.reorders_all("backward", ("gy", "gx"))
        return True

    def onednn_primitives(self):
        """The layer's oneDNN primitives (made once, on first use): minigist/onednn.py."""
        prims = getattr(self, "_onednn", None)
        if prims is None:
            from .. import onednn
            if np.dtype(self.dtype) != np.float32:
                self.fail(f"--conv onednn runs float32 only, not {np.dtype(self.dtype).name}")
            prims = onednn.ConvPrimitives(
                self.in_shape, self.num_output, self.group, self.kernel, self.stride, self.pad,
                self.dilation, self.out_hw, self.bias_term,
                bias_grad=self.bias_term and self.params[0].trained and self.params[1].trained)
            self._onednn = prims
        return prims

    # ---- geometry ----------------------------------------------------------------------
    def _transposed_cheaper(self):
        """Whether gx as a stride-1 convolution of the padded gy (im2col of gy: O*kk*H*W
        columns, a GEMM over H*W pixels) beats the scatter of W^T gy (C*kk*OH*OW columns
        written, read back and added kh*kw times into gx). A cost model measured on a CPU:
        one element moved through memory costs about as much as 16 GEMM flops."""
        n, c, h, w = self.in_shape
        o, g = self.num_output, self.group
        oh, ow = self.out_hw
        transposed = o * h * w * (c / g / 50.0 + 1.0 / 3.0)
        scatter = c * oh * ow * (o / g / 50.0 + 2.0 / 3.0)
        return transposed <= scatter

    def _x_pass(self):
        """(Wc, slack) of the im2col of x: the column width and the elements read past the
        staged input's end. Stride-1 columns of a staged (padded) input are taken at its full
        width Wp (`wide`): each (channel, kernel offset, sample) column is then one
        contiguous run of OH*Wp elements of the flattened padded input, the fastest copy,
        and the extra Wp - OW columns (garbage) are dropped from the GEMM's output and meet
        zeros in gy for the weight gradient. The last row of the last channel reads up to
        dw*(kw-1) elements past the input: the staging buffer holds that many zeros more."""
        if self._wide_x():
            return self._frame_hw()[1], self.dilation[1] * (self.kernel[1] - 1)
        return self.out_hw[1], 0

    def _wide_x(self):
        return self.pad != (0, 0) and self.stride[1] == 1 and self.kernel[1] > 1

    def _gy_pass(self):
        """(Wc, slack) of the im2col of the padded gy (the transposed input gradient)."""
        qh, qw, hg, wg = self._gy_pad()
        kw, dw = self.kernel[1], self.dilation[1]
        if (qh, qw) != (0, 0) and kw > 1:
            return wg, dw * (kw - 1)
        return self.in_shape[3], 0

    def _col_elems(self, phase):
        """Elements of one sample's column buffer."""
        n, c, h, w = self.in_shape
        kh, kw = self.kernel
        oh, ow = self.out_hw
        elems = c * kh * kw * oh * self._x_pass()[0]
        if phase == "backward" and self.transposed_backward:
            elems = max(elems, self.num_output * kh * kw * h * self._gy_pass()[0])
        return elems

    def _chunk(self):
        n = self.in_shape[0]
        if self.batch_chunk:
            return max(1, min(n, int(self.batch_chunk)))
        n, c, h, w = self.in_shape
        if self.pointwise:
            # the 1x1 path: each sample's input (staged in place, or decoded from a Gist
            # stash) and its own dW
            elems = c * h * w
            if self.params[0].trained:
                elems = max(elems, self.num_output * self.cols)
        else:
            elems = self._col_elems("backward")
        per_sample = elems * np.dtype(self.dtype).itemsize
        return max(1, min(n, self.chunk_bytes // max(per_sample, 1)))

    def _gw_transposed(self):
        """Whether the weight gradient is computed transposed, dW^T = cols gy^T, into a
        (g, K, O/g) workspace and copied (added) into dW. With O/g the GEMM's short side and
        the pixels its long reduction, OpenBLAS runs this orientation 1.1-2.4x faster than
        gy cols^T (16-128 channels; bench/README), which writes dW directly; the workspace is
        taken only where the whole dW fits the gw_block_bytes budget: past it (256 x 2304,
        say) the rates are equal, and cutting dW^T into blocks of rows costs more than
        it saves."""
        return (self.params[0].trained and
                self.num_output * self.cols * np.dtype(self.dtype).itemsize <= self.gw_block_bytes)

    def _gw_rows(self):
        """Output rows (per group) of the weight gradient that a later chunk computes at a
        time before adding them in: a block of about gw_block_bytes, not a second dW."""
        per_row = self.group * self.cols * np.dtype(self.dtype).itemsize
        return max(1, min(self.num_output // self.group, self.gw_block_bytes // per_row))

    def _stage_elems(self):
        """Elements of one sample in the 1x1 path's staging workspace: where a chunk of x (gy)
        goes before y (gx) is written over it in place; none when shapes rule that out."""
        n, c, h, w = self.in_shape
        return c * h * w if self.inplace_safe(0, 0) else 0

    def stream_chunk(self):
        """Samples of x the backward reads at a time (x[0][n0:n0 + b]): a stash encoded per
        sample can be decoded one such slice at a time (minigist.codecs.segmented). oneDNN's
        weight gradient reads the whole batch."""
        return 0 if self.engine == "onednn" else self._chunk()

    def _padded_hw(self):
        n, c, h, w = self.in_shape
        return h + 2 * self.pad[0], w + 2 * self.pad[1]

    def _frame_hw(self):
        """(Hp, Wx): the frame x is staged in (at offset pad) for the im2col view: padded,
        with rows that share their zero padding when the columns are wide."""
        hp, wp = self._padded_hw()
        if self._wide_x():
            n, c, h, w = self.in_shape
            wp = _frame_width(w, self.pad[1], self.dilation[1] * (self.kernel[1] - 1))
        return hp, wp

    def _gy_pad(self):
        """(offset_h, offset_w, Hg, Wg): where gy sits in the padded gy of the transposed conv
        (a frame whose rows share their zero padding when its columns are wide)."""
        n, c, h, w = self.in_shape
        (kh, kw), (dh, dw), (ph, pw) = self.kernel, self.dilation, self.pad
        qh, qw = dh * (kh - 1) - ph, dw * (kw - 1) - pw
        wg = w + dw * (kw - 1)
        if (qh, qw) != (0, 0) and kw > 1:
            wg = _frame_width(self.out_hw[1], qw, dw * (kw - 1))
        return qh, qw, h + dh * (kh - 1), wg

    def workspace(self, phase):
        if self.engine == "onednn":   # its blocked copies and scratchpad, as bytes
            sizes = self.onednn_primitives().workspace(
                phase, weight_grad=self.params[0].trained,
                input_grad=self.gx_needed is None or self.gx_needed[0])
            return {name: TensorDecl((nbytes,), np.uint8) for name, nbytes in sizes.items()}
        n, c, h, w = self.in_shape
        b = self._chunk()
        o, g = self.num_output, self.group
        kh, kw = self.kernel
        oh, ow = self.out_hw
        ws = {}
        # backward reads x only for the weight gradient (none when the weights are frozen)
        weight_grad = phase == "backward" and self.params[0].trained
        if self.pointwise:
            if self._stage_elems():
                ws["stage"] = TensorDecl((b * self._stage_elems(),))
            if weight_grad:
                ws["gwn"] = TensorDecl((b, o * self.cols))
                if n > b:
                    ws["gwsum"] = TensorDecl((o * self.cols,))
            return ws
        if weight_grad and self._gw_transposed():
            ws["gwt"] = TensorDecl((g, self.cols, o // g))
        elif weight_grad and n > b:
            ws["gwsum"] = TensorDecl((g, self._gw_rows(), self.cols))
        ws["col"] = TensorDecl((b * self._col_elems(phase),))
        wcx, slack = self._x_pass()
        hp, wp = self._frame_hw()
        if self.pad != (0, 0) and (phase == "forward" or weight_grad):
            ws["xpad"] = TensorDecl((b * c * hp * wp + slack,))
        if phase == "forward":
            ws["yfold"] = TensorDecl((o * b * oh * wcx,))
            return ws
        if weight_grad or not self.transposed_backward:
            ws["gyfold"] = TensorDecl((o * b * oh * wcx,))
        if self.transposed_backward:
            qh, qw, hg, wg = self._gy_pad()
            wcg, slack_g = self._gy_pass()
            if (qh, qw) != (0, 0):
                ws["gypad"] = TensorDecl((b * o * hg * wg + slack_g,))
            ws["wflip"] = TensorDecl((g, c // g, o // g, kh, kw))
            ws["gxfold"] = TensorDecl((c * b * h * wcg,))
        elif self.pad != (0, 0):
            ws["gxpad"] = TensorDecl((b, c) + self._padded_hw())
        return ws

    # ---- helpers ------------------------------------------------------------------------
    @staticmethod
    def _stage(xp, flat, src, offset, hw, first):
        """src (b, C, H, W) copied into the zero-bordered (b, C, Hd, Wd) front of the flat
        buffer at `offset` (rows, cols; a negative offset crops src). On the first chunk (the
        largest) the borders of its b frames are zeroed, and so is all of the buffer after
        them: the wide columns of the last sample read up to `slack` elements past its frame,
        and a frame smaller than that (one channel, one row) leaves whole frames there that no
        chunk writes; their garbage columns meet zeros in gy, and 0 * NaN would be NaN."""
        b, c, h, w = src.shape
        hd, wd = hw
        per = c * hd * wd
        dst = flat[:b * per].reshape(b, c, hd, wd)
        rows, src_rows = _overlap(offset[0], h, hd)
        cols, src_cols = _overlap(offset[1], w, wd)
        if first:   # the borders (and what follows the chunk) stay zero for every chunk
            _zero_outside(dst, rows, cols)
            flat[b * per:].fill(0)
        xp.copyto(dst[:, :, rows, cols], src[:, :, src_rows, src_cols])
        return dst

    def _stage_input(self, xp, xc, ws, first):
        """The (padded) input chunk the im2col view reads from."""
        if self.pad == (0, 0):
            return xc
        return self._stage(xp, ws["xpad"], xc, self.pad, self._frame_hw(), first)

    @staticmethod
    def _unfold(xp, fold, yc, bias):
        """yc (b, O, OH, OW) (=|+ bias) <- fold (O, b, OH, Wc)[..., :OW], one pass (compiled
        with numba: minigist/layers/fused_kernels.py, the same bytes)."""
        if jit.active(xp, fold, yc) and (bias is None or bias.flags.c_contiguous):
            fused_kernels.unfold(fold, yc, fold[0, 0, 0, :0] if bias is None else bias, bias is not None)
            return
        src = fold[..., :yc.shape[3]].transpose(1, 0, 2, 3)
        if bias is None:
            xp.copyto(yc, src)
        else:
            xp.add(src, bias.reshape(1, -1, 1, 1), out=yc)

    @staticmethod
    def _fold(xp, gyc, flat, wc, first):
        """(O, b, OH, Wc) view of the flat buffer <- gyc (b, O, OH, OW), the garbage columns
        zero (`first`: zero them; a chunk of another size views the buffer differently, so
        they are zeroed again then)."""
        b, o, oh, ow = gyc.shape
        view = flat[:o * b * oh * wc].reshape(o, b, oh, wc)
        if wc > ow and first:
            view[..., ow:].fill(0)
        if jit.active(xp, gyc, view):
            fused_kernels.fold(gyc, view)
        else:
            xp.copyto(view[..., :ow], gyc.transpose(1, 0, 2, 3))
        return view

    # ---- forward ------------------------------------------------------------------------
    def forward(self, xp, x, y, p, saved, ws):
        x0, y0 = x[0], y[0]
        if self.engine == "onednn":
            self.onednn_primitives().forward(x0, p[0], p[1] if self.bias_term else None, y0, ws)
            return
        n, c = x0.shape[:2]
        g, o = self.group, self.num_output
        oh, ow = self.out_hw
        pix = oh * ow
        weight = p[0].reshape(g, o // g, self.cols)
        bias = p[1] if self.bias_term else None
        if self.pointwise:
            # in place (y over x): each chunk of x goes to the staging workspace first
            stage = ws.get("stage")
            inplace = stage is not None and xp.may_share_memory(x0, y0)
            chunk = stage.size // self._stage_elems() if inplace else n
            y4 = y0.reshape(n, g, o // g, pix)
            for n0 in range(0, n, chunk):
                xc = x0[n0:n0 + chunk]
                b = xc.shape[0]
                if inplace:
                    xc = _staged(xp, stage, xc)
                xp.matmul(weight, xc.reshape(b, g, c // g, pix), out=y4[n0:n0 + b])
            if bias is not None:
                view = y0.reshape(n, o, pix)
                xp.add(view, bias.reshape(1, -1, 1), out=view)
            return
        kh, kw = self.kernel
        wc = self._x_pass()[0]
        col, yfold = ws["col"], ws["yfold"]
        chunk = col.size // self._col_elems("forward")    # as declared by workspace()
        for n0 in range(0, n, chunk):
            b = min(chunk, n - n0)
            width = b * oh * wc
            src = self._stage_input(xp, x0[n0:n0 + b], ws, n0 == 0)
            cols = col[:c * kh * kw * width].reshape(c, kh, kw, b, oh, wc)
            _im2col(xp, src, cols, self.stride, self.dilation)
            fold = yfold[:o * width].reshape(g, o // g, width)
            xp.matmul(weight, cols.reshape(g, self.cols, width), out=fold)
            self._unfold(xp, fold.reshape(o, b, oh, wc), y0[n0:n0 + b], bias)

    # ---- backward -----------------------------------------------------------------------
    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        gy0, gx0 = gy[0], gx[0]
        gw = gp[0] if gp else None
        gb = gp[1] if self.bias_term and len(gp) > 1 else None
        n, o = gy0.shape[:2]
        g = self.group
        c = self.in_shape[1]
        oh, ow = self.out_hw
        pix = oh * ow
        onednn = self.engine == "onednn"
        if gb is not None and not (onednn and gw is not None):   # oneDNN sums it with dW
            xp.sum(gy0.reshape(n, o, pix), axis=(0, 2), out=gb)
        if gw is None and gx0 is None:
            return
        if onednn:
            self.onednn_primitives().backward(x[0] if gw is not None else None, p[0], gy0, gx0, gw, gb, ws)
            return
        weight = p[0].reshape(g, o // g, self.cols)
        gw3 = gw.reshape(g, o // g, self.cols) if gw is not None else None
        gwsum = ws.get("gwsum")

        if self.pointwise:
            # in place (gx over gy): each chunk of gy goes to the staging workspace first;
            # x is read one chunk at a time (a Gist stash may decode it chunk by chunk)
            gy4 = gy0.reshape(n, g, o // g, pix)
            chunk = (ws["gwn"].shape[0] if "gwn" in ws else
                     ws["stage"].size // self._stage_elems() if "stage" in ws else n)
            gwn = ws["gwn"].reshape(-1, g, o // g, self.cols) if gw is not None else None
            stage = ws.get("stage")
            inplace = gx0 is not None and stage is not None and xp.may_share_memory(gx0, gy0)
            for n0 in range(0, n, chunk):
                gyc = gy4[n0:n0 + chunk]
                b = gyc.shape[0]
                if inplace:
                    gyc = _staged(xp, stage, gyc)
                if gw is not None:
                    xc = x[0][n0:n0 + b].reshape(b, g, c // g, pix)
                    xp.matmul(gyc, xc.transpose(0, 1, 3, 2), out=gwn[:b])
                    if n0 == 0:
                        xp.sum(gwn[:b], axis=0, out=gw3)
                    else:
                        partial = gwsum.reshape(g, o // g, self.cols)
                        xp.sum(gwn[:b], axis=0, out=partial)
                        xp.add(gw3, partial, out=gw3)
                if gx0 is not None:
                    xp.matmul(weight.transpose(0, 2, 1), gyc, out=gx0[n0:n0 + b].reshape(b, g, c // g, pix))
            return

        col = ws["col"]
        chunk = col.size // self._col_elems("backward")    # as declared by workspace()
        h, w = self.in_shape[2:]
        kh, kw = self.kernel
        wc = self._x_pass()[0]
        transposed = gx0 is not None and self.transposed_backward
        if transposed:
            wflip = ws["wflip"]
            # wflip[g, c, o, i, j] = W[g*O/g + o, c, kh-1-i, kw-1-j]
            xp.copyto(wflip, p[0].reshape(g, o // g, c // g, kh, kw)[:, :, :, ::-1, ::-1]
                      .transpose(0, 2, 1, 3, 4))
            wflip3 = wflip.reshape(g, c // g, (o // g) * kh * kw)
            qh, qw, hg, wg = self._gy_pad()
            wcg = self._gy_pass()[0]
        previous = None
        for n0 in range(0, n, chunk):
            b = min(chunk, n - n0)
            width = b * oh * wc
            gyc = gy0[n0:n0 + b]
            gyf = None
            if gw is not None or (gx0 is not None and not transposed):
                # gy as (O, b*OH*Wc), read before gx (which may share gy's bytes) is written
                gyf = self._fold(xp, gyc, ws["gyfold"], wc, b != previous)
                previous = b
                gyf = gyf.reshape(g, o // g, width)
            if gw is not None:
                src = self._stage_input(xp, x[0][n0:n0 + b], ws, n0 == 0)
                cols = col[:c * kh * kw * width].reshape(c, kh, kw, b, oh, wc)
                _im2col(xp, src, cols, self.stride, self.dilation)
                cols3 = cols.reshape(g, self.cols, width)
                colsT = cols3.transpose(0, 2, 1)
                if "gwt" in ws:
                    gwt = ws["gwt"]
                    xp.matmul(cols3, gyf.transpose(0, 2, 1), out=gwt)
                    if n0 == 0:
                        xp.copyto(gw3, gwt.transpose(0, 2, 1))
                    else:
                        xp.add(gw3, gwt.transpose(0, 2, 1), out=gw3)
                elif n0 == 0:
                    xp.matmul(gyf, colsT, out=gw3)
                else:   # added in by blocks of output rows
                    rows = gwsum.shape[1]
                    for r0 in range(0, o // g, rows):
                        # a contiguous (g, r, K) front of the workspace, also for a short last block
                        r = min(rows, o // g - r0)
                        part = gwsum.reshape(-1)[:g * r * self.cols].reshape(g, r, self.cols)
                        xp.matmul(gyf[:, r0:r0 + rows], colsT, out=part)
                        xp.add(gw3[:, r0:r0 + rows], part, out=gw3[:, r0:r0 + rows])
            if gx0 is None:
                continue
            gxc = gx0[n0:n0 + b]
            if transposed:
                # gx = conv(gy padded by d(k-1)-p, flipped W^T), stride 1, same dilation
                if "gypad" in ws:
                    src = self._stage(xp, ws["gypad"], gyc, (qh, qw), (hg, wg), n0 == 0)
                else:
                    src = gyc
                gwidth = b * h * wcg
                cols = col[:o * kh * kw * gwidth].reshape(o, kh, kw, b, h, wcg)
                _im2col(xp, src, cols, (1, 1), self.dilation)
                fold = ws["gxfold"][:c * gwidth].reshape(g, c // g, gwidth)
                xp.matmul(wflip3, cols.reshape(g, (o // g) * kh * kw, gwidth), out=fold)
                self._unfold(xp, fold.reshape(c, b, h, wcg), gxc, None)
            else:
                # columns W^T gy, scattered back with one strided add per kernel offset
                cols = col[:c * kh * kw * width].reshape(g, self.cols, width)
                xp.matmul(weight.transpose(0, 2, 1), gyf, out=cols)
                cols = cols.reshape(c, kh, kw, b, oh, wc)
                if self.pad != (0, 0):
                    target = ws["gxpad"][:b]
                else:
                    target = gxc
                target.fill(0)
                (sh, sw), (dh, dw) = self.stride, self.dilation
                for i in range(kh):
                    for j in range(kw):
                        dst = target[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh,
                                     j * dw:j * dw + sw * (ow - 1) + 1:sw]
                        xp.add(dst, cols[:, i, j, :, :, :ow].transpose(1, 0, 2, 3), out=dst)
                if self.pad != (0, 0):
                    xp.copyto(gxc, target[:, :, self.pad[0]:self.pad[0] + h,
                                          self.pad[1]:self.pad[1] + w])
