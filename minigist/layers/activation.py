"""Element-wise layers: ReLU and Dropout. With numba installed (minigist/jit.py), ReLU's
forward, and its backward's mask and product, run as one compiled pass each
(minigist/layers/fused_kernels.py, the same bytes)."""
import numpy as np

from .. import jit
from ..gpu import kernels as gpu_kernels
from . import fused_kernels
from .base import Layer, TensorDecl, register


@register
class ReLU(Layer):
    """y = max(x, 0) + negative_slope * min(x, 0). Backward reads only y: y > 0 exactly where
    x > 0, which is what lets Gist keep a 1-bit mask instead of y."""
    type = "ReLU"
    param_field = "relu_param"
    sparse_output = True
    elementwise = True
    mask_backward = True

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
            ws["mask"] = TensorDecl(self.top_shapes[0], np.bool_)
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
        xp.greater(y0, 0, out=mask)
        self.backward_from_mask(xp, mask, gy0, gx0, {k: v for k, v in ws.items() if k == "scaled"})

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
