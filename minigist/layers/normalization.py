"""Normalization layers with Caffe's semantics: BatchNorm (no affine part), Scale and LRN.

Every tensor-sized array is either handed in by the executor (x, y, gy, gx, saved) or declared
as workspace; only per-channel vectors are allocated here. Tensors are viewed as (N, C, S) with
S the product of the axes after the channel axis (1 for a 2-D input), so 2-D and 4-D inputs
share one code path.
"""
import numpy as np

from .base import Layer, TensorDecl, filler_of, register


def _shape3(shape):
    """(N, C, S) of an (N, C, ...) shape; a 1-D shape has one channel, as in Caffe."""
    if len(shape) == 1:
        return (int(shape[0]), 1, 1)
    return (int(shape[0]), int(shape[1]), int(np.prod(shape[2:], dtype=np.int64)))


def _window_sum(xp, src, dst, half):
    """dst[:, c] = sum of src[:, c - half .. c + half] over the channel axis (clipped).

    src and dst are distinct (N, C, S) arrays; one pass per offset, no temporaries.
    """
    channels = src.shape[1]
    xp.copyto(dst, src)
    for d in range(1, min(half, channels - 1) + 1):
        low, high = dst[:, :channels - d], dst[:, d:]
        xp.add(low, src[:, d:], out=low)
        xp.add(high, src[:, :channels - d], out=high)


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
        self.maf = float(p.get("moving_average_fraction", 0.999))
        self.eps = float(p.get("eps", 1e-5))
        if not 0.0 <= self.maf <= 1.0:
            self.fail(f"moving_average_fraction must be in [0, 1], got {self.maf}")
        if not self.eps >= 0.0:
            self.fail(f"eps must be >= 0, got {self.eps}")
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
        if self.use_global:
            self.keeps_tops = ()
            self.saved = {}
        else:
            self.keeps_tops = (0,)
            self.saved = {"inv_std": TensorDecl((channels,))}
        return [tuple(shape)]

    def inplace_safe(self, bottom_index, top_index):
        # forward reads x before writing y element-wise; backward reads only y, gy and
        # per-channel values, and writes gx element-wise last.
        return True

    def workspace(self, phase):
        if self.use_global:
            return {}
        return {"square" if phase == "forward" else "product": TensorDecl(self.shape3)}

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

    def forward(self, xp, x, y, p, saved, ws):
        x3 = x[0].reshape(self.shape3)
        y3 = y[0].reshape(self.shape3)
        if self.use_global:
            mean, inv_std = self._global_stats(xp, p)
            xp.subtract(x3, mean[:, None], out=y3)
            xp.multiply(y3, inv_std[:, None], out=y3)
            return
        n, _, s = self.shape3
        m = n * s
        mean = xp.mean(x3, axis=(0, 2))
        xp.subtract(x3, mean[:, None], out=y3)          # y may be x: x is read first
        square = ws["square"]
        xp.multiply(y3, y3, out=square)
        var = xp.mean(square, axis=(0, 2))
        inv_std = saved["inv_std"]
        xp.add(var, self.eps, out=inv_std)
        xp.sqrt(inv_std, out=inv_std)
        xp.reciprocal(inv_std, out=inv_std)
        xp.multiply(y3, inv_std[:, None], out=y3)
        # running sums, exactly as Caffe: s = s*maf + 1, mean = mean*maf + mean_b,
        # variance = variance*maf + var_b * m/(m-1)
        p[2] *= self.maf
        p[2] += 1
        p[0] *= self.maf
        p[0] += mean
        correction = m / (m - 1) if m > 1 else 1.0
        p[1] *= self.maf
        var *= correction
        p[1] += var

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        if gx[0] is None:
            return
        gy3 = gy[0].reshape(self.shape3)
        gx3 = gx[0].reshape(self.shape3)
        if self.use_global:
            _, inv_std = self._global_stats(xp, p)
            xp.multiply(gy3, inv_std[:, None], out=gx3)
            return
        # gx = inv_std * (gy - mean(gy) - y * mean(gy * y)); gx may be gy (in place)
        y3 = y[0].reshape(self.shape3)
        product = ws["product"]
        xp.multiply(gy3, y3, out=product)
        mean_gy_y = xp.mean(product, axis=(0, 2))
        mean_gy = xp.mean(gy3, axis=(0, 2))
        xp.multiply(y3, mean_gy_y[:, None], out=product)
        xp.subtract(gy3, product, out=gx3)
        xp.subtract(gx3, mean_gy[:, None], out=gx3)
        xp.multiply(gx3, saved["inv_std"][:, None], out=gx3)


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

    def inplace_safe(self, bottom_index, top_index):
        # backward needs x itself only for the scale's gradient
        return not self.scale_trained

    def workspace(self, phase):
        if phase == "backward" and self.scale_trained:
            return {"product": TensorDecl(self.shape)}
        return {}

    def forward(self, xp, x, y, p, saved, ws):
        xp.multiply(x[0], p[0].reshape(self.bcast), out=y[0])
        if self.bias_term:
            xp.add(y[0], p[1].reshape(self.bcast), out=y[0])

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        # parameter gradients first: gx may share memory with gy when the layer runs in place
        if gp[0] is not None:
            product = ws["product"]
            xp.multiply(gy[0], x[0], out=product)
            xp.sum(product.reshape(self.shape3), axis=(0, 2), out=gp[0].reshape(-1))
        if self.bias_term and gp[1] is not None:
            xp.sum(gy[0].reshape(self.shape3), axis=(0, 2), out=gp[1].reshape(-1))
        if gx[0] is not None:
            xp.multiply(gy[0], p[0].reshape(self.bcast), out=gx[0])


@register
class LRN(Layer):
    """Caffe's LRN across channels: scale = k + alpha/n * sum of x^2 over the n channels
    centred on c (clipped at the edges), y = x * scale^-beta.

    Caffe stashes x, y and scale for the backward pass (three input-sized tensors). Here the
    backward keeps x alone and recomputes scale from it, a few samples at a time: the window
    sum is cheap next to the power that both versions compute in backward. Both passes work
    in batch chunks with chunk-sized workspaces, so y may overwrite x and gx may overwrite gy
    (every chunk is read into the workspaces before its output is written), and a Gist stash
    of x can be decoded one chunk at a time (`stream_chunk`)."""
    type = "LRN"
    param_field = "lrn_param"
    chunk_bytes = 4 << 20       # target size of one chunk-sized workspace

    def setup(self, bottom_shapes):
        p = self.p
        shape = tuple(bottom_shapes[0])
        if p.get("norm_region", "ACROSS_CHANNELS") != "ACROSS_CHANNELS":
            self.fail(f"norm_region {p.get('norm_region')} is not supported (only ACROSS_CHANNELS)")
        self.size = int(p.get("local_size", 5))
        if self.size % 2 != 1:
            self.fail(f"local_size must be odd, got {self.size}")
        self.alpha = float(p.get("alpha", 1.0))
        self.beta = float(p.get("beta", 0.75))
        self.k = float(p.get("k", 1.0))
        if len(shape) < 2:
            self.fail(f"needs an input with a channel axis (N, C, ...), got shape {shape}")
        self.shape3 = _shape3(shape)
        self.keeps_bottoms = (0,)
        return [shape]

    def inplace_safe(self, bottom_index, top_index):
        return True

    def stream_chunk(self):
        """Samples of x one chunk of the backward reads (x[0][n0:n0 + b])."""
        n, c, inner = self.shape3
        per_sample = c * inner * np.dtype(self.dtype).itemsize
        return max(1, min(n, self.chunk_bytes // max(per_sample, 1)))

    def workspace(self, phase):
        n, c, inner = self.shape3
        chunk = (self.stream_chunk(), c, inner)
        names = ("square", "scale") if phase == "forward" else ("scale", "ratio", "power")
        return {name: TensorDecl(chunk) for name in names}

    def _scale(self, xp, xc, ws):
        """ws["scale"][:b] <- k + alpha/n * window sum of xc^2, for the chunk xc (b, C, S)."""
        b = xc.shape[0]
        square, scale = ws["square" if "square" in ws else "ratio"][:b], ws["scale"][:b]
        xp.multiply(xc, xc, out=square)
        _window_sum(xp, square, scale, (self.size - 1) // 2)
        xp.multiply(scale, self.alpha / self.size, out=scale)
        xp.add(scale, self.k, out=scale)
        return scale

    def forward(self, xp, x, y, p, saved, ws):
        n = self.shape3[0]
        chunk = ws["scale"].shape[0]
        y3 = y[0].reshape(self.shape3)
        x3 = x[0].reshape(self.shape3)
        for n0 in range(0, n, chunk):
            xc = x3[n0:n0 + chunk]
            scale = self._scale(xp, xc, ws)
            xp.power(scale, -self.beta, out=scale)
            xp.multiply(xc, scale, out=y3[n0:n0 + chunk])

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        if gx[0] is None:
            return
        n, c, inner = self.shape3
        chunk = ws["scale"].shape[0]
        gy3 = gy[0].reshape(self.shape3)
        gx3 = gx[0].reshape(self.shape3)
        factor = -2.0 * self.alpha * self.beta / self.size
        for n0 in range(0, n, chunk):
            xc = x[0][n0:n0 + chunk].reshape((-1, c, inner))     # x may be a chunk-wise decoded stash
            b = xc.shape[0]
            scale = self._scale(xp, xc, ws)
            ratio, power = ws["ratio"][:b], ws["power"][:b]
            # gx = gy * scale^-beta - 2 alpha beta / n * x * window_sum(gy * scale^-beta * x / scale)
            xp.power(scale, -self.beta, out=power)
            xp.multiply(power, gy3[n0:n0 + b], out=power)
            xp.multiply(power, xc, out=ratio)
            xp.divide(ratio, scale, out=ratio)
            gxc = gx3[n0:n0 + b]          # may be gy's bytes: the chunk of gy is used up above
            _window_sum(xp, ratio, gxc, (self.size - 1) // 2)
            xp.multiply(gxc, xc, out=gxc)
            xp.multiply(gxc, factor, out=gxc)
            xp.add(gxc, power, out=gxc)
