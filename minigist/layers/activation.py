"""Element-wise layers: ReLU and Dropout. With numba installed (minigist/jit.py), ReLU's
forward, and its backward's mask and product, run as one compiled pass each
(minigist/layers/fused_kernels.py, the same bytes)."""
import numpy as np

from .. import jit
from ..gpu import kernels as gpu_kernels
from . import fused_kernels
from .base import Layer, TensorDecl, register
from .conv_geometry import chunk_samples


@register
class ReLU(Layer):
    """y = max(x, 0) + negative_slope * min(x, 0). Backward reads only y: y > 0 exactly where
    x > 0, which is what lets Gist keep a 1-bit mask instead of y."""
    type = "ReLU"
    param_field = "relu_param"
    sparse_output = True
    elementwise = True
    mask_backward = True
    microbatchable = True
    # the backward's mask (one byte per element) is made a batch chunk of about this at a time:
    # a whole-batch mask would be a quarter of the map's bytes at the ReLU's backward step
    chunk_bytes = 4 << 20

    @property
    def gradient_only_where_positive(self):
        return self.slope == 0.0   # a leaky ReLU passes slope * gy where y <= 0

    def setup(self, bottom_shapes):
        self.slope = float(self.p.get("negative_slope", 0.0))
        if self.slope < 0:
            self.fail("negative_slope must be >= 0")
        self.keeps_tops = (0,)
        return [bottom_shapes[0]]

    def inplace_safe(self, bottom_index, top_index):
        return True

    def workspace(self, phase, gx_needed=None):
        ws = {}
        if phase == "backward":
            top = tuple(self.top_shapes[0])
            rows = chunk_samples(top[0], int(np.prod(top[1:], dtype=np.int64)), self.chunk_bytes)
            ws["mask"] = TensorDecl((rows,) + top[1:], np.bool_)
        if self.slope != 0.0:   # slope * x (slope * gy), kept apart: y may be x (gx gy) itself
            ws["scaled"] = TensorDecl(self.top_shapes[0])
        return ws

    def forward(self, xp, x, y, p, saved, ws):
        if self.slope == 0.0:
            if gpu_kernels.serves(xp) and x[0].dtype == np.float32:
                gpu_kernels.relu_forward(xp, x[0], y[0], (self.forward, (x, y, p, saved, ws)))
                return
            if jit.active(xp, x[0], y[0]):   # one compiled pass, the same bytes (2.2x faster)
                same = fused_kernels.same_memory(x[0], y[0])
                if same and x[0].dtype == np.float32 and not jit.MASKED_STORES:
                    fused_kernels.relu_in_place_bits(x[0].reshape(-1).view(np.uint32))
                    return
                fused_kernels.relu(x[0].reshape(-1), y[0].reshape(-1), x[0].dtype.type(0), same)
            else:
                xp.maximum(x[0], 0, out=y[0])
            return
        scaled = ws["scaled"]
        xp.multiply(x[0], self.slope, out=scaled)
        (xp.maximum if self.slope <= 1.0 else xp.minimum)(x[0], scaled, out=y[0])

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        if gx[0] is None:
            return
        mask, y0, gy0, gx0 = ws["mask"], y[0], gy[0], gx[0]
        if self.slope == 0.0 and gpu_kernels.serves(xp) and gy0.dtype == np.float32:
            gpu_kernels.relu_backward(xp, y0, gy0, gx0, (self.backward, (x, y, gy, gx, p, gp, saved, ws)))
            return
        if self.slope == 0.0 and jit.active(xp, y0, gy0, gx0):
            # mask and multiply in one compiled pass (minigist/layers/fused_kernels.py)
            dtype = gy0.dtype.type
            fused_kernels.relu_grad(y0.reshape(-1), gy0.reshape(-1), gx0.reshape(-1), dtype(1), dtype(0),
                                    fused_kernels.same_memory(gy0, gx0))
            return
        rows = mask.shape[0]
        for n0 in range(0, y0.shape[0], rows):
            part = slice(n0, min(n0 + rows, y0.shape[0]))
            chunk_mask = mask[:part.stop - n0]
            xp.greater(y0[part], 0, out=chunk_mask)
            chunk_gy = gy0[part]
            chunk_gx = chunk_gy if gx0 is gy0 else gx0[part]     # in place stays one array (CuPy's rule)
            self.backward_from_mask(xp, chunk_mask, chunk_gy, chunk_gx,
                                    {k: v[part] for k, v in ws.items() if k == "scaled"})

    def backward_from_mask(self, xp, mask, gy, gx, ws):
        """gx from the positive mask alone (the form Gist's Binarize codec stores). gx may be
        gy itself (in place); the mask is used up (inverted) when negative_slope > 0."""
        if self.slope == 0.0:
            if gx is not None and gpu_kernels.serves(xp) and gy.dtype == np.float32:
                gpu_kernels.mask_backward(xp, mask.view(xp.uint8), gy, gx,
                                          (self.backward_from_mask, (mask, gy, gx, ws)))
                return
            if gx is not None and jit.active(xp, mask, gy, gx):
                # the same products as multiply(gy, mask) in one pass: numpy's loop for a
                # float32 times a bool casts the bools in buffered chunks, 3x slower
                dtype = gy.dtype.type
                fused_kernels.relu_grad(mask.reshape(-1).view(np.uint8), gy.reshape(-1), gx.reshape(-1),
                                        dtype(1), dtype(0), fused_kernels.same_memory(gy, gx))
                return
            xp.multiply(gy, mask, out=gx)
            return
        scaled = ws["scaled"]
        xp.multiply(gy, self.slope, out=scaled)
        xp.copyto(gx, gy, where=mask)
        xp.logical_not(mask, out=mask)
        xp.copyto(gx, scaled, where=mask)


@register
class Dropout(Layer):
    """Caffe's dropout: in training, y = x * mask / (1 - ratio) (mask kept as one byte per
    element); at test time y = x. With scale_train false, the scaling moves to test time."""
    type = "Dropout"
    param_field = "dropout_param"
    keeps_zeros = True

    def setup(self, bottom_shapes):
        self.ratio = float(self.p.get("dropout_ratio", 0.5))
        if not 0.0 <= self.ratio < 1.0:
            self.fail(f"dropout_ratio must be in [0, 1), got {self.ratio}")
        scale_train = self.p.get("scale_train", True)
        self.train = self.spec.phase == "TRAIN"
        if self.train:
            self.scale = 1.0 / (1.0 - self.ratio) if scale_train else 1.0
            self.saved = {"mask": TensorDecl(bottom_shapes[0], np.bool_)}
        else:
            self.scale = 1.0 if scale_train else 1.0 - self.ratio
        return [bottom_shapes[0]]

    def inplace_safe(self, bottom_index, top_index):
        return True

    def workspace(self, phase, gx_needed=None):
        if phase == "forward" and self.train:
            return {"uniform": TensorDecl(self.bottom_shapes[0])}
        return {}

    @property
    def forward_draws_random(self):
        return self.train

    def replay_workspace(self):
        return {}   # the replay draws nothing: no uniform numbers

    def forward(self, xp, x, y, p, saved, ws):
        if not self.train:
            xp.multiply(x[0], self.scale, out=y[0])
            return
        uniform, mask = ws["uniform"], saved["mask"]
        if gpu_kernels.serves(xp) and x[0].dtype == np.float32:
            # drawn inside the kernel (CuPy's Generator.random(out=...) without size drew one
            # number for the whole mask, and its own array every call)
            gpu_kernels.dropout_forward(xp, x[0], y[0], mask, self.ratio, self.scale, self.rng)
            return
        self.rng.random(uniform.shape, dtype=uniform.dtype, out=uniform)
        xp.greater_equal(uniform, self.ratio, out=mask)
        self._apply_mask(xp, x, y, mask)

    def replay_forward(self, xp, x, y, p, saved, ws):
        """The training forward with the mask it saved: the same top, nothing drawn."""
        if not self.train:
            self.forward(xp, x, y, p, saved, ws)
            return
        self._apply_mask(xp, x, y, saved["mask"])

    def _apply_mask(self, xp, x, y, mask):
        xp.multiply(x[0], mask, out=y[0])
        y[0] *= self.scale

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        if gx[0] is None:
            return
        xp.multiply(gy[0], saved["mask"], out=gx[0])
        gx[0] *= self.scale


class _Bounded(Layer):
    """An element-wise layer whose output is clipped to [low, high] and whose backward passes
    `slope` * gy where low < y < high, 0 elsewhere: it reads y alone (y is strictly inside
    exactly where its unclipped value is; on a bound itself the gradient is 0)."""
    elementwise = True
    slope = 1.0

    def inplace_safe(self, bottom_index, top_index):
        return True

    def workspace(self, phase, gx_needed=None):
        if phase == "backward":
            return {"inside": TensorDecl(self.top_shapes[0], np.bool_), "below": TensorDecl(self.top_shapes[0], np.bool_)}
        return {}

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        if gx[0] is None:
            return
        inside, below = ws["inside"], ws["below"]
        xp.greater(y[0], self.low, out=inside)
        xp.less(y[0], self.high, out=below)
        xp.logical_and(inside, below, out=inside)
        xp.multiply(gy[0], inside, out=gx[0])
        if self.slope != 1.0:
            xp.multiply(gx[0], self.slope, out=gx[0])


@register
class Clip(_Bounded):
    """y = min(max(x, min), max): Caffe's Clip (clip_param) and ONNX's (ReLU6 is min 0, max
    6); a bound left out is infinite. The backward passes gy where min < y < max and 0
    elsewhere, so it reads y alone. (At x exactly on a bound it gives 0, where PyTorch's clamp
    passes gy: a set of measure zero.)

    Not a ReLU for Gist: its backward needs both bounds of y, not y > 0 (no mask_backward), and
    it is no source of sparsity (no sparse_output), though it keeps the zeros of an input that
    has them when 0 lies within its bounds."""
    type = "Clip"
    param_field = "clip_param"

    def setup(self, bottom_shapes):
        self.low = float(self.p.get("min", -np.inf))
        self.high = float(self.p.get("max", np.inf))
        if not self.low <= self.high:
            self.fail(f"min {self.low} is above max {self.high}")
        self.keeps_tops = (0,)
        return [bottom_shapes[0]]

    @property
    def keeps_zeros(self):
        return self.low <= 0.0 <= self.high

    def forward(self, xp, x, y, p, saved, ws):
        xp.maximum(x[0], self.low, out=y[0])
        xp.minimum(y[0], self.high, out=y[0])


@register
class Sigmoid(Layer):
    """y = 1 / (1 + exp(-x)), computed as Caffe does, 0.5 * tanh(0.5 x) + 0.5 (no overflow
    for large |x|). Backward reads y: gx = gy * y * (1 - y)."""
    type = "Sigmoid"
    param_field = "sigmoid_param"
    elementwise = True

    def setup(self, bottom_shapes):
        self.keeps_tops = (0,)
        return [bottom_shapes[0]]

    def inplace_safe(self, bottom_index, top_index):
        return True

    def workspace(self, phase, gx_needed=None):
        return {"slope": TensorDecl(self.top_shapes[0])} if phase == "backward" else {}

    def forward(self, xp, x, y, p, saved, ws):
        xp.multiply(x[0], 0.5, out=y[0])
        xp.tanh(y[0], out=y[0])
        xp.multiply(y[0], 0.5, out=y[0])
        xp.add(y[0], 0.5, out=y[0])

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        if gx[0] is None:
            return
        slope = ws["slope"]
        xp.subtract(1.0, y[0], out=slope)
        xp.multiply(slope, y[0], out=slope)
        xp.multiply(gy[0], slope, out=gx[0])


@register
class HardSigmoid(_Bounded):
    """ONNX's HardSigmoid: y = max(0, min(1, alpha * x + beta)) (alpha 0.2, beta 0.5 unless
    given). Backward reads y: gx = alpha * gy where 0 < y < 1, else 0 (at the kinks 0)."""
    type = "HardSigmoid"
    caffe_type = False       # ONNX's operator: read from .onnx files only
    param_field = "hard_sigmoid_param"
    low, high = 0.0, 1.0

    def setup(self, bottom_shapes):
        self.alpha = self.slope = float(self.p.get("alpha", 0.2))
        self.beta = float(self.p.get("beta", 0.5))
        self.keeps_tops = (0,)
        return [bottom_shapes[0]]

    def forward(self, xp, x, y, p, saved, ws):
        xp.multiply(x[0], self.alpha, out=y[0])
        xp.add(y[0], self.beta, out=y[0])
        xp.maximum(y[0], self.low, out=y[0])
        xp.minimum(y[0], self.high, out=y[0])


@register
class HardSwish(Layer):
    """ONNX's HardSwish: y = x * max(0, min(1, alpha * x + 1/2)), alpha = 1/6 rounded to float32
    as ONNX's definition (a HardSigmoid with a float attribute) has it. Backward reads x (y does
    not determine x: the curve dips and rises again between -3 and 0): gx = gy * (2 alpha x +
    1/2) where -3 < x < 3, gy where x >= 3, 0 where x <= -3.

    Not a ReLU for Gist: its output is negative between -3 and 0, and its backward needs x."""
    type = "HardSwish"
    caffe_type = False       # ONNX's operator: read from .onnx files only
    param_field = "hard_swish_param"
    elementwise = True
    alpha, beta = float(np.float32(1.0 / 6.0)), 0.5

    def setup(self, bottom_shapes):
        self.keeps_bottoms = (0,)
        return [bottom_shapes[0]]

    def inplace_safe(self, bottom_index, top_index):
        return True     # each pass reads x (gy) whole into a workspace before it writes y (gx)

    def workspace(self, phase, gx_needed=None):
        shape = self.bottom_shapes[0]
        if phase == "forward":
            return {"gate": TensorDecl(shape)}
        return {"gate": TensorDecl(shape), "slope": TensorDecl(shape), "mask": TensorDecl(shape, np.bool_)}

    def _gate(self, xp, x0, gate):
        """gate <- alpha * x + beta (before the clipping)."""
        xp.multiply(x0, self.alpha, out=gate)
        xp.add(gate, self.beta, out=gate)

    def forward(self, xp, x, y, p, saved, ws):
        gate = ws["gate"]
        self._gate(xp, x[0], gate)
        xp.maximum(gate, 0.0, out=gate)
        xp.minimum(gate, 1.0, out=gate)
        xp.multiply(x[0], gate, out=y[0])

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        if gx[0] is None:
            return
        gate, slope, mask = ws["gate"], ws["slope"], ws["mask"]
        self._gate(xp, x[0], gate)
        xp.multiply(x[0], 2.0 * self.alpha, out=slope)      # d/dx of x * (alpha x + beta)
        xp.add(slope, self.beta, out=slope)
        xp.greater_equal(gate, 1.0, out=mask)
        xp.copyto(slope, 1.0, where=mask)
        xp.less_equal(gate, 0.0, out=mask)
        xp.copyto(slope, 0.0, where=mask)
        xp.multiply(gy[0], slope, out=gx[0])
