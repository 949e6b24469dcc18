"""InnerProduct (fully connected): y = x W^T + b over the axes from `axis` on."""
import numpy as np

from .base import Layer, filler_of, register
from .gemm import matmul


@register
class InnerProduct(Layer):
    type = "InnerProduct"
    param_field = "inner_product_param"

    def setup(self, bottom_shapes):
        p = self.p
        shape = bottom_shapes[0]
        if not p.has("num_output"):
            self.fail("num_output is required")
        self.num_output = p.get("num_output")
        axis = p.get("axis", 1)
        axis = axis + len(shape) if axis < 0 else axis
        if not 0 <= axis < len(shape):
            self.fail(f"axis {p.get('axis', 1)} out of range for input shape {shape}")
        self.transpose = p.get("transpose", False)
        self.rows = int(np.prod(shape[:axis]))
        self.features = int(np.prod(shape[axis:]))
        weight_shape = (self.features, self.num_output) if self.transpose else (self.num_output, self.features)
        self.add_param("weight", weight_shape, filler_of(p.get("weight_filler")))
        self.bias_term = p.get("bias_term", True)
        if self.bias_term:
            self.add_param("bias", (self.num_output,), filler_of(p.get("bias_filler")))
        self.keeps_bottoms = (0,)
        # W (num_output, features): a block of rows is a block of gy's columns, one GEMM each
        self.weight_grad_in_rows = not self.transpose
        return [tuple(shape[:axis]) + (self.num_output,)]

    def _weight_t(self, weight):
        """W as (features, num_output): a view, never a copy."""
        return weight if self.transpose else weight.T

    def forward(self, xp, x, y, p, saved, ws):
        x2 = x[0].reshape(self.rows, self.features)
        y2 = y[0].reshape(self.rows, self.num_output)
        xp.matmul(x2, self._weight_t(p[0]), out=y2)
        if self.bias_term:
            y2 += p[1]

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        gy2 = gy[0].reshape(self.rows, self.num_output)
        if gp[0] is not None:
            x2 = x[0].reshape(self.rows, self.features)
            if self.transpose:
                xp.matmul(x2.T, gy2, out=gp[0])
            else:
                xp.matmul(gy2.T, x2, out=gp[0])
        if self.bias_term and gp[1] is not None:
            xp.sum(gy2, axis=0, out=gp[1])
        if gx[0] is not None:
            xp.matmul(gy2, self._weight_t(p[0]).T, out=gx[0].reshape(self.rows, self.features))

    def weight_grad_rows(self, xp, x, gy, gw, first, end):
        gy2 = gy[0].reshape(self.rows, self.num_output)
        # gy's columns first:end, read in place (on a GPU by one GEMM of leading dimension
        # num_output, not a copy)
        matmul(xp, gy2[:, first:end].T, x[0].reshape(self.rows, self.features), gw)


@register
class Gemm(InnerProduct):
    """ONNX's Gemm where it is no plain InnerProduct: y = alpha * x W^T + beta * b (gemm_param
    alpha, beta; the rest as InnerProduct's inner_product_param, W in either layout). The
    gradients carry the same factors: gW = alpha * gy^T x, gb = beta * sum(gy), gx = alpha * gy W."""
    type = "Gemm"
    caffe_type = False       # ONNX's operator: read from .onnx files only

    def setup(self, bottom_shapes):
        top = super().setup(bottom_shapes)
        gemm = self.spec.msg.get("gemm_param")
        self.alpha = float(gemm.get("alpha", 1.0)) if gemm is not None else 1.0
        self.beta = float(gemm.get("beta", 1.0)) if gemm is not None else 1.0
        self.weight_grad_in_rows = False     # its gradient carries alpha: made whole
        return top

    def forward(self, xp, x, y, p, saved, ws):
        x2 = x[0].reshape(self.rows, self.features)
        y2 = y[0].reshape(self.rows, self.num_output)
        xp.matmul(x2, self._weight_t(p[0]), out=y2)
        y2 *= self.alpha
        if self.bias_term:
            y2 += p[1] * self.beta

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws):
        super().backward(xp, x, y, gy, gx, p, gp, saved, ws)
        if gp[0] is not None:
            gp[0] *= self.alpha
        if self.bias_term and gp[1] is not None:
            gp[1] *= self.beta
        if gx[0] is not None:
            gx[0] *= self.alpha
