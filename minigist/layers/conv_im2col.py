"""The im2col engine of the Convolution layer: forward and backward through im2col columns
and BLAS GEMMs, and the workspaces they run in.

Every tensor-sized temporary is a declared workspace:

- `col`: the im2col columns of a chunk of `b` samples, laid out (C, kh, kw, b, OH, Wc), so
  that one GEMM per group, W (O/g, C/g*kh*kw) against (C/g*kh*kw, b*OH*Wc), covers the whole
  chunk; `yfold` takes its (O, b, OH, Wc) result before the bias is added on the way into y.
  Wc is OW, or the width of a padded frame for stride-1 columns of a padded input: each
  column is then one contiguous copy, and the extra columns are dropped
  (conv_geometry.x_pass). The frame's rows share their zero padding
  (conv_geometry.frame_width): the gap after one row is also the left border of the next,
  so a 3x3 pad-1 convolution computes W + 1 columns per row, not W + 2;
- `xpad`: the zero-padded input chunk the im2col view reads from (only with pad > 0), flat,
  with the few zeros more that the wide columns read past its end;
- backward: `gyfold` (gy of a chunk as (O, b, OH, Wc)); `gwt` (a chunk's weight gradient
  transposed, dW^T = cols gy^T, copied or added into dW, where dW fits `gw_block_bytes`:
  `_gw_transposed`) or else `gwsum` (a later chunk's weight gradient, computed a block of
  output rows at a time and added in: `gw_block_bytes`, not a second dW); for the input
  gradient either `gypad` + `wflip` + `gxfold` (stride 1, where a cost model finds it
  cheaper: gx is the stride-1 convolution of the padded gy with the flipped, transposed
  weights, no col2im scatter) or `gxpad` (any stride: the columns W^T gy scattered back by
  one strided add per kernel offset). The backward re-does the im2col of x, as Caffe does,
  reading x one chunk at a time (a Gist stash decodes chunk by chunk).

The chunk size b is chosen so that one chunk's columns take about the layer's `chunk_bytes`
(at least one sample): it keeps the columns in cache between the copy and the GEMM on a CPU
and bounds the workspace (Caffe itself works one sample at a time). The layer's
`batch_chunk` (an int), set before workspaces are asked for, forces a chunk size, e.g. the
whole batch on a GPU; forward and backward take the chunk size from the workspace they are
handed.

A 1x1 convolution with stride 1 and no padding needs no im2col: x itself is the column
matrix. It runs per-sample GEMMs (folding the batch cost two transposing copies, measured
slower), adds the per-sample weight gradients of a chunk (`gwn`) into dW one sample at a
time, so that dW does not depend on the chunks (on NumPy), and, when input and output
have one shape, works in place through `stage`: each chunk of x (gy) is copied there before
the same chunk of y (gx) is written over it.
"""
import numpy as np

from .. import jit
from . import fused_kernels
from .base import TensorDecl
from .gemm import matmul
from .conv_geometry import (chunk_samples, col_elems, frame_hw, gw_rows, gy_pad, gy_pass, overlap,
                            padded_hw, x_pass)


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


def _im2col(xp, src, col, stride, dilation):
    """col (C, kh, kw, b, OH, Wc) <- the windows of src (b, C, Hs, Ws): one strided copy.
    Wc is OW, or Ws for stride-1 columns at the source's full width (conv_geometry.x_pass)."""
    s0, s1, s2, s3 = src.strides
    view = xp.lib.stride_tricks.as_strided(
        src, shape=col.shape,
        strides=(s1, dilation[0] * s2, dilation[1] * s3, s0, stride[0] * s2, stride[1] * s3))
    xp.copyto(col, view)


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
    rows, src_rows = overlap(offset[0], h, hd)
    cols, src_cols = overlap(offset[1], w, wd)
    if first:   # the borders (and what follows the chunk) stay zero for every chunk
        _zero_outside(dst, rows, cols)
        flat[b * per:].fill(0)
    xp.copyto(dst[:, :, rows, cols], src[:, :, src_rows, src_cols])
    return dst


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


class Im2colEngine:
    """minigist's own convolution engine for one Convolution layer, whose set-up shapes
    (`geometry`) and tuning attributes (`batch_chunk`, `chunk_bytes`, `gw_block_bytes`,
    `transposed_backward`) it reads at each call."""

    def __init__(self, layer):
        self.layer = layer

    # ---- sizes --------------------------------------------------------------------------
    def chunk(self):
        """Samples per batch chunk: the layer's `batch_chunk`, or as many as keep one chunk's
        largest per-sample workspace within its `chunk_bytes`."""
        layer = self.layer
        n, c, h, w = layer.in_shape
        if layer.pointwise:
            # the 1x1 path: each sample's input (staged in place, or decoded from a Gist
            # stash) and its own dW
            elems = c * h * w
            if layer.params[0].trained:
                elems = max(elems, layer.num_output * layer.cols)
        else:
            elems = col_elems(layer.geometry, "backward", layer.transposed_backward)
        per_sample = elems * np.dtype(layer.dtype).itemsize
        return chunk_samples(n, per_sample, layer.chunk_bytes, layer.batch_chunk)

    def sum_grain(self):
        """Samples whose weight gradients are summed together before they are added into dW:
        a batch chunk, or one sample for a 1x1 convolution (backward adds its samples one at a
        time). A micro-batch of whole grains adds the same sums as the whole batch."""
        return 1 if self.layer.pointwise else self.chunk()

    def _gw_transposed(self):
        """Whether the weight gradient is computed transposed, dW^T = cols gy^T, into a
        (g, K, O/g) workspace and copied (added) into dW. With O/g the GEMM's short side and
        the pixels its long reduction, OpenBLAS runs this orientation 1.1-2.4x faster than
        gy cols^T (16-128 channels; bench/README), which writes dW directly; the workspace is
        taken only where the whole dW fits the gw_block_bytes budget: past it (256 x 2304,
        say) the rates are equal, and cutting dW^T into blocks of rows costs more than
        it saves."""
        layer = self.layer
        return (layer.params[0].trained and
                layer.num_output * layer.cols * np.dtype(layer.dtype).itemsize <= layer.gw_block_bytes)

    def _stage_elems(self):
        """Elements of one sample in the 1x1 path's staging workspace: where a chunk of x (gy)
        goes before y (gx) is written over it in place; none when shapes rule that out."""
        n, c, h, w = self.layer.in_shape
        return c * h * w if self.layer.inplace_safe(0, 0) else 0

    def inplace_safe(self):
        """Each batch chunk of gy (x) is copied into the column workspace (the 1x1 path: its
        staging workspace) before the same chunk of gx (y) is written."""
        return True

    def stream_chunk(self):
        """The backward reads x one batch chunk at a time."""
        return self.chunk()

    def fuses_bias_gradient(self, weight_grad):
        """The bias gradient is left to the layer: no GEMM here produces it."""
        return False

    def workspace(self, phase, gx_needed=None):
        layer = self.layer
        geom = layer.geometry
        n, c, h, w = layer.in_shape
        b = self.chunk()
        o, g = layer.num_output, layer.group
        kh, kw = layer.kernel
        oh, ow = layer.out_hw
        ws = {}
        # backward reads x only for the weight gradient (none when the weights are frozen)
        weight_grad = phase == "backward" and layer.params[0].trained
        if layer.pointwise:
            if self._stage_elems():
                ws["stage"] = TensorDecl((b * self._stage_elems(),))
            if weight_grad:
                ws["gwn"] = TensorDecl((b, o * layer.cols))
            return ws
        if weight_grad and self._gw_transposed():
            ws["gwt"] = TensorDecl((g, layer.cols, o // g))
        elif weight_grad and (n > b or layer.accumulating):
            rows = gw_rows(geom, np.dtype(layer.dtype).itemsize, layer.gw_block_bytes)
            ws["gwsum"] = TensorDecl((g, rows, layer.cols))
        ws["col"] = TensorDecl((b * col_elems(geom, phase, layer.transposed_backward),))
        wcx, slack = x_pass(geom)
        hp, wp = frame_hw(geom)
        if layer.pad != (0, 0) and (phase == "forward" or weight_grad):
            ws["xpad"] = TensorDecl((b * c * hp * wp + slack,))
        if phase == "forward":
            ws["yfold"] = TensorDecl((o * b * oh * wcx,))
            return ws
        if weight_grad or not layer.transposed_backward:
            ws["gyfold"] = TensorDecl((o * b * oh * wcx,))
        if layer.transposed_backward:
            qh, qw, hg, wg = gy_pad(geom)
            wcg, slack_g = gy_pass(geom)
            if (qh, qw) != (0, 0):
                ws["gypad"] = TensorDecl((b * o * hg * wg + slack_g,))
            ws["wflip"] = TensorDecl((g, c // g, o // g, kh, kw))
            ws["gxfold"] = TensorDecl((c * b * h * wcg,))
        elif layer.pad != (0, 0):
            ws["gxpad"] = TensorDecl((b, c) + padded_hw(geom))
        return ws

    def _stage_input(self, xp, xc, ws, first):
        """The (padded) input chunk the im2col view reads from."""
        if self.layer.pad == (0, 0):
            return xc
        return _stage(xp, ws["xpad"], xc, self.layer.pad, frame_hw(self.layer.geometry), first)

    # ---- forward ------------------------------------------------------------------------
    def forward(self, xp, x0, y0, weights, bias, ws):
        layer = self.layer
        n, c = x0.shape[:2]
        g, o = layer.group, layer.num_output
        oh, ow = layer.out_hw
        pix = oh * ow
        weight = weights.reshape(g, o // g, layer.cols)
        if layer.pointwise:
            # in place (y over x): each chunk of x goes to the staging workspace first; x read
            # from a slice reader (a replay's source decoded from Gist's per-sample codes, which
            # hands out at most `chunk_samples` samples at a time) goes in the backward's chunks
            stage = ws.get("stage")
            sliced = hasattr(x0, "chunk_samples")
            inplace = stage is not None and not sliced and xp.may_share_memory(x0, y0)
            chunk = stage.size // self._stage_elems() if inplace else self.chunk() if sliced else n
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
        kh, kw = layer.kernel
        wc = x_pass(layer.geometry)[0]
        col, yfold = ws["col"], ws["yfold"]
        # as declared by workspace()
        chunk = col.size // col_elems(layer.geometry, "forward", layer.transposed_backward)
        for n0 in range(0, n, chunk):
            b = min(chunk, n - n0)
            width = b * oh * wc
            src = self._stage_input(xp, x0[n0:n0 + b], ws, n0 == 0)
            cols = col[:c * kh * kw * width].reshape(c, kh, kw, b, oh, wc)
            _im2col(xp, src, cols, layer.stride, layer.dilation)
            fold = yfold[:o * width].reshape(g, o // g, width)
            xp.matmul(weight, cols.reshape(g, layer.cols, width), out=fold)
            _unfold(xp, fold.reshape(o, b, oh, wc), y0[n0:n0 + b], bias)

    # ---- backward -----------------------------------------------------------------------
    def backward(self, xp, x0, weights, gy0, gx0, gw, gb, ws, accumulate=False):
        """gx (where gx0 is given) and dW (where gw is given) from gy; x0 (read one chunk at
        a time) is given with gw. The bias gradient is the layer's. With `accumulate` every
        chunk's dW is added in, as a whole batch's later chunks are."""
        layer = self.layer
        n, o = gy0.shape[:2]
        g = layer.group
        c = layer.in_shape[1]
        oh, ow = layer.out_hw
        pix = oh * ow
        weight = weights.reshape(g, o // g, layer.cols)
        gw3 = gw.reshape(g, o // g, layer.cols) if gw is not None else None
        gwsum = ws.get("gwsum")

        if layer.pointwise:
            # in place (gx over gy): each chunk of gy goes to the staging workspace first;
            # x is read one chunk at a time (a Gist stash may decode it chunk by chunk)
            gy4 = gy0.reshape(n, g, o // g, pix)
            chunk = (ws["gwn"].shape[0] if "gwn" in ws else
                     ws["stage"].size // self._stage_elems() if "stage" in ws else n)
            gwn = ws["gwn"].reshape(-1, g, o // g, layer.cols) if gw is not None else None
            stage = ws.get("stage")
            inplace = gx0 is not None and stage is not None and xp.may_share_memory(gx0, gy0)
            for n0 in range(0, n, chunk):
                gyc = gy4[n0:n0 + chunk]
                b = gyc.shape[0]
                if inplace:
                    gyc = _staged(xp, stage, gyc)
                if gw is not None:
                    xc = x0[n0:n0 + b].reshape(b, g, c // g, pix)
                    matmul(xp, gyc, xc.transpose(0, 1, 3, 2), gwn[:b])
                    # the samples' dW added in one at a time, in the batch's order, so that
                    # the sums are the same whatever the chunks (a micro-batched front's too);
                    # the first chunk in one call: NumPy adds along the outer axis in order
                    # (CuPy's reduction does not, so on a GPU the sums depend on the chunks)
                    if n0 == 0 and not accumulate:
                        xp.sum(gwn[:b], axis=0, out=gw3)
                    else:
                        for i in range(b):
                            xp.add(gw3, gwn[i], out=gw3)
                if gx0 is not None:
                    matmul(xp, weight.transpose(0, 2, 1), gyc, gx0[n0:n0 + b].reshape(b, g, c // g, pix))
            return

        geom = layer.geometry
        col = ws["col"]
        # as declared by workspace()
        chunk = col.size // col_elems(geom, "backward", layer.transposed_backward)
        h, w = layer.in_shape[2:]
        kh, kw = layer.kernel
        wc = x_pass(geom)[0]
        transposed = gx0 is not None and layer.transposed_backward
        if transposed:
            wflip = ws["wflip"]
            # wflip[g, c, o, i, j] = W[g*O/g + o, c, kh-1-i, kw-1-j]
            xp.copyto(wflip, weights.reshape(g, o // g, c // g, kh, kw)[:, :, :, ::-1, ::-1]
                      .transpose(0, 2, 1, 3, 4))
            wflip3 = wflip.reshape(g, c // g, (o // g) * kh * kw)
            qh, qw, hg, wg = gy_pad(geom)
            wcg = gy_pass(geom)[0]
        previous = None
        for n0 in range(0, n, chunk):
            b = min(chunk, n - n0)
            width = b * oh * wc
            gyc = gy0[n0:n0 + b]
            gyf = None
            if gw is not None or (gx0 is not None and not transposed):
                # gy as (O, b*OH*Wc), read before gx (which may share gy's bytes) is written
                gyf = _fold(xp, gyc, ws["gyfold"], wc, b != previous)
                previous = b
                gyf = gyf.reshape(g, o // g, width)
            if gw is not None:
                src = self._stage_input(xp, x0[n0:n0 + b], ws, n0 == 0)
                cols = col[:c * kh * kw * width].reshape(c, kh, kw, b, oh, wc)
                _im2col(xp, src, cols, layer.stride, layer.dilation)
                cols3 = cols.reshape(g, layer.cols, width)
                colsT = cols3.transpose(0, 2, 1)
                if "gwt" in ws:
                    gwt = ws["gwt"]
                    matmul(xp, cols3, gyf.transpose(0, 2, 1), gwt)
                    if n0 == 0 and not accumulate:
                        xp.copyto(gw3, gwt.transpose(0, 2, 1))
                    else:
                        xp.add(gw3, gwt.transpose(0, 2, 1), out=gw3)
                elif n0 == 0 and not accumulate:
                    matmul(xp, gyf, colsT, gw3)
                else:   # added in by blocks of output rows
                    rows = gwsum.shape[1]
                    for r0 in range(0, o // g, rows):
                        # a contiguous (g, r, K) front of the workspace, also for a short last block
                        r = min(rows, o // g - r0)
                        part = gwsum.reshape(-1)[:g * r * layer.cols].reshape(g, r, layer.cols)
                        matmul(xp, gyf[:, r0:r0 + rows], colsT, part)
                        xp.add(gw3[:, r0:r0 + rows], part, out=gw3[:, r0:r0 + rows])
            if gx0 is None:
                continue
            gxc = gx0[n0:n0 + b]
            if transposed:
                # gx = conv(gy padded by d(k-1)-p, flipped W^T), stride 1, same dilation
                if "gypad" in ws:
                    src = _stage(xp, ws["gypad"], gyc, (qh, qw), (hg, wg), n0 == 0)
                else:
                    src = gyc
                gwidth = b * h * wcg
                cols = col[:o * kh * kw * gwidth].reshape(o, kh, kw, b, h, wcg)
                _im2col(xp, src, cols, (1, 1), layer.dilation)
                fold = ws["gxfold"][:c * gwidth].reshape(g, c // g, gwidth)
                xp.matmul(wflip3, cols.reshape(g, (o // g) * kh * kw, gwidth), out=fold)
                _unfold(xp, fold.reshape(c, b, h, wcg), gxc, None)
            else:
                # columns W^T gy, scattered back with one strided add per kernel offset
                cols = col[:c * kh * kw * width].reshape(g, layer.cols, width)
                matmul(xp, weight.transpose(0, 2, 1), gyf, cols)
                cols = cols.reshape(c, kh, kw, b, oh, wc)
                if layer.pad != (0, 0):
                    target = ws["gxpad"][:b]
                else:
                    target = gxc
                target.fill(0)
                (sh, sw), (dh, dw) = layer.stride, layer.dilation
                for i in range(kh):
                    for j in range(kw):
                        dst = target[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh,
                                     j * dw:j * dw + sw * (ow - 1) + 1:sw]
                        xp.add(dst, cols[:, i, j, :, :, :ow].transpose(1, 0, 2, 3), out=dst)
                if layer.pad != (0, 0):
                    xp.copyto(gxc, target[:, :, layer.pad[0]:layer.pad[0] + h,
                                          layer.pad[1]:layer.pad[1] + w])
