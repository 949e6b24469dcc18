"""Normalization layers with Caffe's semantics: BatchNorm (no affine part), Scale and LRN.

Every tensor-sized array is either handed in by the executor (x, y, gy, gx, saved) or declared
as workspace; only per-channel vectors are allocated here. Tensors are viewed as (N, C, S) with
S the product of the axes after the channel axis (1 for a 2-D input), so 2-D and 4-D inputs
share one code path. With numba installed (minigist/jit.py), BatchNorm's and Scale's chains
of element-wise ufuncs run as single compiled passes (minigist/layers/fused_kernels.py, the
same bytes).
"""
import numpy as np

from .. import jit
from ..gpu import kernels as gpu_kernels
from . import fused_kernels
from .base import Layer, TensorDecl, filler_of, paired, register


def _shape3(shape):
    """(N, C, S) of an (N, C, ...) shape; a 1-D shape has one channel, as in Caffe."""
    if len(shape) == 1:
        return (int(shape[0]), 1, 1)
    return (int(shape[0]), int(shape[1]), int(np.prod(shape[2:], dtype=np.int64)))


def _channel_sums(xp, values, out, ones, rows):
    """out (C,) <- the sums of values (b, C, S) over axes 0 and 2: a matrix-vector product
    with a vector of ones into rows (at least b of them, C wide), then a sum down the b rows.
    BLAS's gemv does this 3-5x faster on a CPU than xp.sum over the two axes. ones (S,) is
    workspace, which holds nothing between steps: the layer fills it once per pass."""
    b, c, s = values.shape
    if values.flags.c_contiguous and rows.flags.c_contiguous:
        # one gemv over the b*C rows, not one per sample: the same dot products (the same
        # bytes), half the time at resnet20's shapes, and one BLAS call instead of b
        xp.matmul(values.reshape(b * c, s), ones, out=rows[:b].reshape(b * c))
    else:
        xp.matmul(values, ones, out=rows[:b])
    xp.sum(rows[:b], axis=0, out=out)


def _window_sum(xp, src, dst, half, axis=1):
    """dst[..., i, ...] = sum of src[..., i - half .. i + half, ...] along `axis` (clipped:
    zero padding).

    src and dst are distinct arrays of one shape; one pass per offset, no temporaries.
    """
    length = src.shape[axis]
    lead = (slice(None),) * axis
    xp.copyto(dst, src)
    for d in range(1, min(half, length - 1) + 1):
        head, tail = lead + (slice(None, length - d),), lead + (slice(d, None),)
        low, high = dst[head], dst[tail]
        xp.add(low, src[tail], out=low)
        xp.add(high, src[head], out=high)


# the numpy code of the GPU kernels' steps (minigist/gpu/kernels.py runs it under the checker)
def _center_square(xp, xc, mean, yc, sq):
    xp.subtract(xc, mean[:, None], out=yc)
    xp.multiply(yc, yc, out=sq)


def _scale_channels(xp, yc, scale):
    xp.multiply(yc, scale[:, None], out=yc)


def _product(xp, gyc, yc, pc):
    xp.multiply(gyc, yc, out=pc)


def _input_grad(xp, gyc, yc, mean_gy_y, mean_gy, inv_std, gxc, product):
    pc = product[:yc.shape[0]]
    xp.multiply(yc, mean_gy_y[:, None], out=pc)
    xp.subtract(gyc, pc, out=gxc)
    xp.subtract(gxc, mean_gy[:, None], out=gxc)
    xp.multiply(gxc, inv_std[:, None], out=gxc)


def _scale_grads(xp, gyc, xc, scale, pc, gxc):
    xp.multiply(gyc, xc, out=pc)
    xp.multiply(gyc, scale, out=gxc)


@register
class BatchNorm(Layer):
    """Caffe's BatchNorm: y = (x - mean) / sqrt(var + eps) per channel (axis 1), statistics
    over every other axis. Blobs (state, never learned): mean (C,), variance (C,) and
    scale_factor (1,), the running sums that global-stats mode divides by scale_factor.

    With batch statistics, backward reads only the top y (= x_hat) and the saved inv_std (C,);
    with global statistics it reads nothing but the (unchanged) state blobs.
    """
    type = "BatchNorm"
    param_field = "batch_norm_param"

    def setup(self, bottom_shapes):
        p = self.p
        shape = bottom_shapes[0]
        if len(shape) < 1:
            self.fail("needs an input with at least one axis")
        self.use_global = bool(p.get("use_global_stats", self.spec.phase == "TEST"))
        self.maf, self.eps = self._average_and_eps("moving_average_fraction", 0.999, "eps")
        for index, (lr_mult, _) in enumerate(self.spec.param_specs[:3]):
            if lr_mult != 0.0:
                self.fail(f"param {index} has lr_mult {lr_mult}: the batch statistics cannot be "
                          f"learned (give lr_mult: 0 or no param at all)")
        self.shape3 = _shape3(shape)
        channels = self.shape3[1]
        zero = filler_of(None)   # constant 0
        self.add_param("mean", (channels,), zero, learnable=False)
        self.add_param("variance", (channels,), zero, learnable=False)
        self.add_param("scale_factor", (1,), zero, learnable=False)
        self._declare_stash(channels)
        return [tuple(shape)]

    def _average_and_eps(self, fraction_name, fraction_default, eps_name):
        """(the running average's weight of the old value, eps) from the layer's message, checked."""
        fraction = float(self.p.get(fraction_name, fraction_default))
        eps = float(self.p.get(eps_name, 1e-5))
        if not 0.0 <= fraction <= 1.0:
            self.fail(f"{fraction_name} must be in [0, 1], got {fraction}")
        if not eps >= 0.0:
            self.fail(f"{eps_name} must be >= 0, got {eps}")
        return fraction, eps

    def _declare_stash(self, channels):
        """With batch statistics the backward keeps y (x_hat) and the saved inv_std."""
        if self.use_global:
            self.keeps_tops = ()
            self.saved = {}
        else:
            self.keeps_tops = (0,)
            self.saved = {"inv_std": TensorDecl((channels,))}

    chunk_bytes = 4 << 20       # target size of one chunk-sized workspace
    stream_role = "y"           # the backward reads its top (x_hat), one chunk at a time

    def inplace_safe(self, bottom_index, top_index):
        # both passes go chunk by chunk and write each chunk of y (gx) element-wise after
        # reading the same chunk of x (gy)
        return True

    def stream_chunk(self):
        """Samples of y the backward reads at a time (y[0][n0:n0 + b], twice: one pass for
        the sums, one for gx)."""
        if self.use_global:
            return 0
        n, c, s = self.shape3
        per_sample = c * s * np.dtype(self.dtype).itemsize
        return max(1, min(n, self.chunk_bytes // max(per_sample, 1)))

    def reads_half(self):
        return not self.use_global      # x_hat, in the product pass and the gx pass

    def workspace(self, phase, gx_needed=None):
        if self.use_global:
            return {}
        n, c, s = self.shape3
        chunk = self.stream_chunk()
        return {"square" if phase == "forward" else "product": TensorDecl((chunk, c, s)),
                "sums": TensorDecl((3, c)),   # per-channel totals and a chunk's part
                "ones": TensorDecl((s,)), "rows": TensorDecl((chunk, c))}   # for _channel_sums

    def _global_stats(self, xp, p):
        """Per-channel (mean, inv_std) from the running sums, Caffe's 0 -> 0 factor included."""
        sf = p[2]
        factor = (sf != 0) / (sf + (sf == 0))
        mean = p[0] * factor
        inv_std = p[1] * factor
        inv_std += self.eps
        xp.sqrt(inv_std, out=inv_std)
        xp.reciprocal(inv_std, out=inv_std)
        return mean.astype(self.dtype, copy=False), inv_std.astype(self.dtype, copy=False)

    @staticmethod
    def _channel_sum(xp, values, total, part, first, ws):
        """total (=|+=) the per-channel sum of the chunk values (b, C, S)."""
        _channel_sums(xp, values, total if first else part, ws["ones"], ws["rows"])
        if not first:
            xp.add(total, part, out=total)

    def emits_top_slices(self):
        # y is the x_hat its backward reads, final slice by slice in the last pass; the
        # stashes passes encode are float32 ones
        return not self.use_global and self.dtype == np.float32

    @property
    def forward_updates_state(self):
        return not self.use_global     # the running sums

    def replay_forward(self, xp, x, y, p, saved, ws):
        """The forward without the running-sum update: the same y and inv_std."""
        self.forward(xp, x, y, p, saved, ws, update_running=False)

    def forward(self, xp, x, y, p, saved, ws, emit=None, update_running=True):
        """`emit` (emits_top_slices): called as emit(n0, n1, inv_std, scratch) for each slice
        of y in the last pass, in place of y *= inv_std[c], `scratch` the forward's `square`
        workspace, free by then.
        update_running=False leaves the running sums as they are (a recomputation's replay:
        they were updated once, by the forward pass)."""
        x3, y3 = paired(x[0], y[0], lambda a: a.reshape(self.shape3))
        if self.use_global:
            if emit is not None:
                raise ValueError(f"{self.name}: with use_global_stats BatchNorm emits no slices")
            mean, inv_std = self._global_stats(xp, p)
            xp.subtract(x3, mean[:, None], out=y3)
            xp.multiply(y3, inv_std[:, None], out=y3)
            return
        n, _, s = self.shape3
        m = n * s
        square, sums = ws["square"], ws["sums"]
        ws["ones"].fill(1)
        chunk = square.shape[0]
        starts = range(0, n, chunk)
        mean, part = sums[0], sums[1]
        for n0 in starts:
            self._channel_sum(xp, x3[n0:n0 + chunk], mean, part, n0 == 0, ws)
        xp.divide(mean, m, out=mean)
        var = saved["inv_std"]
        for n0 in starts:
            xc, yc = paired(x3, y3, lambda a: a[n0:n0 + chunk])
            sq = square[:yc.shape[0]]
            if gpu_kernels.serves(xp):
                gpu_kernels.bn_center_square(xp, xc, mean, yc, sq, (_center_square, (xc, mean, yc, sq)))
            elif jit.active(xp, xc, yc, sq, mean):
                fused_kernels.center_square(xc, mean, yc, sq, fused_kernels.same_memory(xc, yc))
            else:
                xp.subtract(xc, mean[:, None], out=yc)     # y may be x: read first
                xp.multiply(yc, yc, out=sq)
            self._channel_sum(xp, sq, var, part, n0 == 0, ws)
        xp.divide(var, m, out=var)
        if update_running:
            self._update_running(xp, p, mean, var, m, sums[2])
        inv_std = var
        xp.add(var, self.eps, out=inv_std)
        xp.sqrt(inv_std, out=inv_std)
        xp.reciprocal(inv_std, out=inv_std)
        scale_compiled = jit.active(xp, y3, inv_std)
        for n0 in starts:
            yc = y3[n0:n0 + chunk]
            if emit is not None:
                emit(n0, n0 + yc.shape[0], inv_std, square[:yc.shape[0]])
            elif gpu_kernels.serves(xp):
                gpu_kernels.scale_channels(xp, yc, inv_std, (_scale_channels, (yc, inv_std)))
            elif scale_compiled:
                fused_kernels.scale_channels(yc, inv_std)
            else:
                xp.multiply(yc, inv_std[:, None], out=yc)

    def _update_running(self, xp, p, mean, var, m, scratch):
        """The running sums, exactly as Caffe: s = s*maf + 1, mean = mean*maf + mean_b,
        variance = variance*maf + var_b * m/(m-1); `scratch` (C,) takes the last product."""
        p[2] *= self.maf
        p[2] += 1
        p[0] *= self.maf
        p[0] += mean
        correction = m / (m - 1) if m > 1 else 1.0
        p[1] *= self.maf
        xp.multiply(var, correction, out=scratch)
        p[1] += scratch

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        if gx[0] is None:
            return
        gy3, gx3 = paired(gy[0], gx[0], lambda a: a.reshape(self.shape3))
        if self.use_global:
            _, inv_std = self._global_stats(xp, p)
            xp.multiply(gy3, inv_std[:, None], out=gx3)
            return
        # gx = inv_std * (gy - mean(gy) - y * mean(gy * y)); gx may be gy (in place). Two
        # passes over chunks: the two per-channel means, then gx; y may be a stash decoded
        # one chunk at a time (read twice)
        n, c, s = self.shape3
        m = n * s
        product, sums = ws["product"], ws["sums"]
        ws["ones"].fill(1)
        chunk = product.shape[0]
        starts = range(0, n, chunk)
        mean_gy_y, mean_gy, part = sums[0], sums[1], sums[2]
        half = y[0].dtype == np.float16   # Gist's fp16 stash (reads_half): its bits to the kernels
        for n0 in starts:
            yc = y[0][n0:n0 + chunk].reshape((-1, c, s))
            gyc = gy3[n0:n0 + chunk]
            pc = product[:yc.shape[0]]
            if gpu_kernels.serves(xp):
                gpu_kernels.product(xp, gyc, yc, pc, (_product, (gyc, yc, pc)))
            elif half and jit.active(xp, gyc, yc, pc):
                fused_kernels.product(gyc.reshape(-1), yc.reshape(-1).view(np.uint16), pc.reshape(-1))
            else:
                xp.multiply(gyc, yc, out=pc)
            self._channel_sum(xp, pc, mean_gy_y, part, n0 == 0, ws)
            self._channel_sum(xp, gyc, mean_gy, part, n0 == 0, ws)
        xp.divide(mean_gy_y, m, out=mean_gy_y)
        xp.divide(mean_gy, m, out=mean_gy)
        inv_std = saved["inv_std"]
        for n0 in starts:
            yc = y[0][n0:n0 + chunk].reshape((-1, c, s))
            gyc, gxc = paired(gy3, gx3, lambda a: a[n0:n0 + chunk])
            if gpu_kernels.serves(xp):
                gpu_kernels.bn_input_grad(xp, gyc, yc, mean_gy_y, mean_gy, inv_std, gxc,
                                          (_input_grad, (gyc, yc, mean_gy_y, mean_gy, inv_std, gxc, product)))
                continue
            if jit.active(xp, gyc, yc, gxc, mean_gy_y, mean_gy, inv_std):
                fused_kernels.batchnorm_input_grad(gyc, yc.view(np.uint16) if half else yc, mean_gy_y, mean_gy,
                                                   inv_std, gxc, fused_kernels.same_memory(gyc, gxc))
                continue
            pc = product[:yc.shape[0]]
            xp.multiply(yc, mean_gy_y[:, None], out=pc)
            xp.subtract(gyc, pc, out=gxc)
            xp.subtract(gxc, mean_gy[:, None], out=gxc)
            xp.multiply(gxc, inv_std[:, None], out=gxc)


@register
class BatchNormalization(BatchNorm):
    """ONNX's BatchNormalization without its affine part, which the ONNX front end gives a
    Scale layer after it (the file's scale and B): y = (x - mean) / sqrt(var + epsilon) per
    channel (axis 1). State (never learned): mean and variance, the running averages
    themselves (no scale factor).

    The TRAIN phase has training_mode=1's semantics: batch statistics (the biased variance),
    and the running statistics updated as running * momentum + batch * (1 - momentum): ONNX's
    momentum is the weight of the old value, 1 - PyTorch's, and ONNX averages the biased batch
    variance where PyTorch averages the unbiased one. The TEST phase has training_mode=0's:
    the running statistics. The forward and backward passes are BatchNorm's."""
    type = "BatchNormalization"
    caffe_type = False       # ONNX's operator: read from .onnx files only
    param_field = "batch_normalization_param"

    def setup(self, bottom_shapes):
        shape = bottom_shapes[0]
        if len(shape) < 2:
            self.fail(f"needs an input with a channel axis (N, C, ...), got shape {tuple(shape)}")
        self.use_global = self.spec.phase == "TEST"
        self.momentum, self.eps = self._average_and_eps("momentum", 0.9, "epsilon")
        self.shape3 = _shape3(shape)
        channels = self.shape3[1]
        one = filler_of(None)
        one["value"] = 1.0
        self.add_param("mean", (channels,), filler_of(None), learnable=False)
        self.add_param("variance", (channels,), one, learnable=False)
        self._declare_stash(channels)
        return [tuple(shape)]

    def _global_stats(self, xp, p):
        inv_std = p[1] + self.eps
        xp.sqrt(inv_std, out=inv_std)
        xp.reciprocal(inv_std, out=inv_std)
        return p[0].astype(self.dtype, copy=False), inv_std.astype(self.dtype, copy=False)

    def _update_running(self, xp, p, mean, var, m, scratch):
        """ONNX's running averages: running * momentum + batch * (1 - momentum); `scratch`
        (C,) takes the product."""
        for running, batch in ((p[0], mean), (p[1], var)):
            running *= self.momentum
            xp.multiply(batch, 1.0 - self.momentum, out=scratch)
            running += scratch


@register
class Scale(Layer):
    """Caffe's Scale with one bottom: y = x * scale (+ bias), the scale (and bias) of shape
    bottom.shape[axis:axis + num_axes] broadcast over the other axes."""
    type = "Scale"
    param_field = "scale_param"
    num_bottoms = (1, 2)   # a second bottom is Caffe syntax; setup says it is not supported

    def setup(self, bottom_shapes):
        if len(bottom_shapes) != 1:
            self.fail("a second bottom as the scale is not supported (use a learned scale)")
        p = self.p
        shape = tuple(bottom_shapes[0])
        ndim = len(shape)
        axis = p.get("axis", 1)
        if not -ndim <= axis < max(ndim, 1):
            self.fail(f"axis {axis} out of range for input shape {shape}")
        axis = axis + ndim if axis < 0 else axis
        num_axes = p.get("num_axes", 1)
        if num_axes < -1:
            self.fail(f"num_axes must be -1 (all remaining axes) or >= 0, got {num_axes}")
        if num_axes == -1:
            num_axes = ndim - axis
        if axis + num_axes > ndim:
            self.fail(f"axis {axis} + num_axes {num_axes} exceeds the {ndim} axes of input shape {shape}")
        scale_shape = shape[axis:axis + num_axes]
        outer = int(np.prod(shape[:axis], dtype=np.int64))
        inner = int(np.prod(shape[axis + num_axes:], dtype=np.int64))
        count = int(np.prod(scale_shape, dtype=np.int64))
        self.shape3 = (outer, count, inner)
        self.shape = shape
        self.bcast = (1,) * axis + scale_shape + (1,) * (ndim - axis - num_axes)
        if p.has("filler"):
            filler = filler_of(p.get("filler"))
        else:
            filler = filler_of(None)
            filler["value"] = 1.0
        self.add_param("scale", scale_shape, filler)
        self.bias_term = bool(p.get("bias_term", False))
        if self.bias_term:
            self.add_param("bias", scale_shape, filler_of(p.get("bias_filler")))
        self.scale_trained = self.params[0].trained
        self.keeps_bottoms = (0,) if self.scale_trained else ()
        return [shape]

    chunk_bytes = 4 << 20       # target size of the backward's chunk-sized workspace

    def inplace_safe(self, bottom_index, top_index):
        # forward is element-wise; backward reads each chunk of gy (and x) before writing the
        # same chunk of gx. (With a trained scale x is kept for the backward, so the planner
        # lets y overwrite x only when x is read from elsewhere then: a Gist stash.)
        return True

    def stream_chunk(self):
        """Samples of x the backward reads at a time (x[0][n0:n0 + b]); 0 when the scale is
        not trained (x is not read) or the layer's outer axis is not the batch."""
        outer, count, inner = self.shape3
        if not self.scale_trained or len(self.shape) < 2 or outer != self.shape[0]:
            return 0
        per_sample = count * inner * np.dtype(self.dtype).itemsize
        return max(1, min(outer, self.chunk_bytes // max(per_sample, 1)))

    def reads_half(self):
        return self.scale_trained       # x, for the scale's gradient

    def _chunk(self):
        return self.stream_chunk() or self.shape3[0]

    def workspace(self, phase, gx_needed=None):
        if phase == "backward" and self.scale_trained:
            outer, count, inner = self.shape3
            return {"product": TensorDecl((self._chunk(), count, inner)), "part": TensorDecl((count,)),
                    "ones": TensorDecl((inner,)), "rows": TensorDecl((outer, count))}   # _channel_sums
        return {}

    def forward(self, xp, x, y, p, saved, ws):
        if self.bias_term:
            x3, y3 = paired(x[0], y[0], lambda a: a.reshape(self.shape3))
            scale, bias = p[0].reshape(-1), p[1].reshape(-1)
            if gpu_kernels.serves(xp):
                gpu_kernels.scale_bias(xp, x3, scale, bias, y3, (self.forward, (x, y, p, saved, ws)))
                return
            if jit.active(xp, x3, y3, scale, bias):
                fused_kernels.scale_bias(x3, scale, bias, y3, fused_kernels.same_memory(x3, y3))
                return
        xp.multiply(x[0], p[0].reshape(self.bcast), out=y[0])
        if self.bias_term:
            xp.add(y[0], p[1].reshape(self.bcast), out=y[0])

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        outer, count, inner = self.shape3
        if gx[0] is not None:
            gy3, gx3 = paired(gy[0], gx[0], lambda a: a.reshape(self.shape3))
        else:
            gy3, gx3 = gy[0].reshape(self.shape3), None
        gscale = gp[0].reshape(-1) if gp[0] is not None else None
        gbias = gp[1].reshape(-1) if self.bias_term and gp[1] is not None else None
        if gscale is not None:
            ws["ones"].fill(1)
        if gbias is not None:
            if gscale is not None:
                _channel_sums(xp, gy3, gbias, ws["ones"], ws["rows"])
            else:
                xp.sum(gy3, axis=(0, 2), out=gbias)
        if gscale is None:
            if gx[0] is not None:
                xp.multiply(gy[0], p[0].reshape(self.bcast), out=gx[0])
            return
        # chunk by chunk: the scale's gradient from gy and x first, then gx (which may be gy)
        product, part = ws["product"], ws["part"]
        chunk = product.shape[0]
        scale = p[0].reshape((1, count, 1))
        # streamed: outer is the batch axis, and x may be a stash decoded a chunk at a time
        source = x[0] if self.stream_chunk() else x[0].reshape(self.shape3)
        for n0 in range(0, outer, chunk):
            xc = source[n0:n0 + chunk].reshape((-1, count, inner))
            if gx3 is not None:
                gyc, gxc = paired(gy3, gx3, lambda a: a[n0:n0 + chunk])
            else:
                gyc, gxc = gy3[n0:n0 + chunk], None
            pc = product[:xc.shape[0]]
            fused = gxc is not None and jit.active(xp, gyc, xc, pc, gxc, p[0])
            if gxc is not None and gpu_kernels.serves(xp):
                gpu_kernels.scale_grads(xp, gyc, xc, p[0].reshape(-1), pc, gxc, (_scale_grads, (gyc, xc, scale, pc, gxc)))
                fused = True
            elif fused:   # the product and gx in one pass: gx (which may be gy) after gy is read
                bits = xc.view(np.uint16) if xc.dtype == np.float16 else xc   # Gist's fp16 stash
                fused_kernels.scale_grads(gyc, bits, p[0].reshape(-1), pc, gxc, fused_kernels.same_memory(gyc, gxc))
            else:
                xp.multiply(gyc, xc, out=pc)
            _channel_sums(xp, pc, gscale if n0 == 0 else part, ws["ones"], ws["rows"])
            if n0:
                xp.add(gscale, part, out=gscale)
            if gxc is not None and not fused:
                xp.multiply(gyc, scale, out=gxc)


@register
class LRN(Layer):
    """Caffe's LRN. ACROSS_CHANNELS: scale = k + alpha/n * sum of x^2 over the n channels
    centred on c (clipped at the edges). WITHIN_CHANNEL (4-D inputs): scale = 1 + alpha/n^2 *
    sum of x^2 over the n x n spatial window centred on (h, w) in its own channel, zero-padded
    by (n - 1)/2 (Caffe's AVE pooling of x^2 with that pad and stride 1, whose divisor is n^2
    at every output, then a power layer with shift 1: k plays no part). Both: y = x *
    scale^-beta.

    Caffe stashes x, y and scale for the backward pass (three input-sized tensors; its
    WITHIN_CHANNEL split/square/pool/power/product chain keeps more). Here the backward keeps
    x alone and recomputes scale from it, a few samples at a time: the window sum is cheap
    next to the power that both versions compute in backward. Both passes work in batch
    chunks with chunk-sized workspaces, so y may overwrite x and gx may overwrite gy (every
    chunk is read into the workspaces before its output is written), and a Gist stash of x
    can be decoded one chunk at a time (`stream_chunk`). The spatial window is summed
    separably (rows, then columns) through the same workspaces."""
    type = "LRN"
    # x * scale^-beta with scale >= k (or 1) > 0, either norm_region: zero exactly where x is
    keeps_zeros = True
    param_field = "lrn_param"
    microbatchable = True
    chunk_bytes = 4 << 20       # target size of one chunk-sized workspace

    def setup(self, bottom_shapes):
        p = self.p
        shape = tuple(bottom_shapes[0])
        self.region = p.get("norm_region", "ACROSS_CHANNELS")
        if self.region not in ("ACROSS_CHANNELS", "WITHIN_CHANNEL"):
            self.fail(f"norm_region {self.region} is not supported (ACROSS_CHANNELS or WITHIN_CHANNEL)")
        self.size = int(p.get("local_size", 5))
        if self.size % 2 != 1:
            self.fail(f"local_size must be odd, got {self.size}")
        self.alpha = float(p.get("alpha", 1.0))
        self.beta = float(p.get("beta", 0.75))
        self.k = float(p.get("k", 1.0))
        if len(shape) < 2:
            self.fail(f"needs an input with a channel axis (N, C, ...), got shape {shape}")
        self.within = self.region == "WITHIN_CHANNEL"
        if self.within and len(shape) != 4:
            self.fail(f"WITHIN_CHANNEL needs a 4-D (N, C, H, W) input, got shape {shape}")
        # the window's element count and the added constant of scale
        self.count = self.size ** 2 if self.within else self.size
        self.shift = 1.0 if self.within else self.k
        self.shape3 = _shape3(shape)
        self.sample_shape = shape[1:]
        self.keeps_bottoms = (0,)
        return [shape]

    def inplace_safe(self, bottom_index, top_index):
        return True

    def stream_chunk(self):
        """Samples of x one chunk of the backward reads (x[0][n0:n0 + b])."""
        n, c, inner = self.shape3
        per_sample = c * inner * np.dtype(self.dtype).itemsize
        return max(1, min(n, self.chunk_bytes // max(per_sample, 1)))

    def workspace(self, phase, gx_needed=None):
        n, c, inner = self.shape3
        chunk = (self.stream_chunk(), c, inner)
        names = ("square", "scale") if phase == "forward" else ("scale", "ratio", "power")
        return {name: TensorDecl(chunk) for name in names}

    def _neighbour_sum(self, xp, src, dst, scratch):
        """dst <- the window sum of src (b, C, S); scratch (WITHIN_CHANNEL: the row sums) is
        distinct from both; dst may be src for WITHIN_CHANNEL, must not be for ACROSS."""
        half = (self.size - 1) // 2
        if not self.within:
            _window_sum(xp, src, dst, half)
            return
        grid = (src.shape[0],) + self.sample_shape
        rows = scratch.reshape(grid)
        _window_sum(xp, src.reshape(grid), rows, half, axis=2)
        _window_sum(xp, rows, dst.reshape(grid), half, axis=3)

    def _scale(self, xp, xc, first, second):
        """The chunk's scale = shift + alpha/count * window sum of xc^2, in first[:b] or
        second[:b] (returned; the other one is left free); both are chunk-sized scratch."""
        b = xc.shape[0]
        first, second = first[:b], second[:b]
        xp.multiply(xc, xc, out=first)
        scale = first if self.within else second
        self._neighbour_sum(xp, first, scale, second)
        xp.multiply(scale, self.alpha / self.count, out=scale)
        xp.add(scale, self.shift, out=scale)
        return scale, (second if scale is first else first)

    def forward(self, xp, x, y, p, saved, ws):
        n = self.shape3[0]
        chunk = ws["scale"].shape[0]
        x3, y3 = paired(x[0], y[0], lambda a: a.reshape(self.shape3))
        for n0 in range(0, n, chunk):
            xc, yc = paired(x3, y3, lambda a: a[n0:n0 + chunk])     # one object in place
            scale, _ = self._scale(xp, xc, ws["square"], ws["scale"])
            xp.power(scale, -self.beta, out=scale)
            xp.multiply(xc, scale, out=yc)

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        if gx[0] is None:
            return
        n, c, inner = self.shape3
        chunk = ws["scale"].shape[0]
        gy3, gx3 = paired(gy[0], gx[0], lambda a: a.reshape(self.shape3))
        factor = -2.0 * self.alpha * self.beta / self.count
        for n0 in range(0, n, chunk):
            xc = x[0][n0:n0 + chunk].reshape((-1, c, inner))     # x may be a chunk-wise decoded stash
            b = xc.shape[0]
            scale, ratio = self._scale(xp, xc, ws["ratio"], ws["scale"])
            power = ws["power"][:b]
            # gx = gy * scale^-beta - 2 alpha beta / count * x * window_sum(gy * scale^-beta * x / scale)
            # (the window is symmetric and zero-padded, so its sum is its own transpose)
            xp.power(scale, -self.beta, out=power)
            xp.multiply(power, gy3[n0:n0 + b], out=power)
            xp.multiply(power, xc, out=ratio)
            xp.divide(ratio, scale, out=ratio)
            gxc = gx3[n0:n0 + b]          # may be gy's bytes: the chunk of gy is used up above
            self._neighbour_sum(xp, ratio, gxc, scale)          # scale is free by now
            xp.multiply(gxc, xc, out=gxc)
            xp.multiply(gxc, factor, out=gxc)
            xp.add(gxc, power, out=gxc)
