"""The oneDNN engine of the Convolution layer (Net(conv="onednn"), train.py --conv onednn):
oneDNN's direct kernels do forward, input and weight gradient through the ctypes binding in
minigist/onednn.py. This module makes a layer's primitives once and declares, as the
layer's workspaces, their blocked copies of the operands and their scratchpad, as oneDNN
sizes them; no im2col runs.
"""
import numpy as np

from .. import onednn
from .base import TensorDecl


class OneDNNEngine:
    """oneDNN's convolution for one Convolution layer (float32 only)."""

    def __init__(self, layer):
        self.layer = layer
        self._primitives = None

    def primitives(self):
        """The layer's oneDNN primitives (made once, on first use): minigist/onednn.py."""
        if self._primitives is None:
            layer = self.layer
            if np.dtype(layer.dtype) != np.float32:
                layer.fail(f"--conv onednn runs float32 only, not {np.dtype(layer.dtype).name}")
            self._primitives = onednn.ConvPrimitives(
                layer.in_shape, layer.num_output, layer.group, layer.kernel, layer.stride, layer.pad,
                layer.dilation, layer.out_hw, layer.bias_term,
                bias_grad=layer.bias_term and layer.params[0].trained and layer.params[1].trained)
        return self._primitives

    def inplace_safe(self):
        """x and gy are reordered into blocked copies before y and gx are written (not where
        a kernel reads them as they are)."""
        prims = self.primitives()
        return prims.reorders_all("forward", ("x", "y")) and prims.reorders_all("backward", ("gy", "gx"))

    def stream_chunk(self):
        """oneDNN's weight gradient reads the whole batch."""
        return 0

    def fuses_bias_gradient(self, weight_grad):
        """oneDNN sums the bias gradient with dW."""
        return weight_grad

    def workspace(self, phase, gx_needed=None):
        """Its blocked copies and scratchpad, as bytes (no copies for an input gradient that
        is not written)."""
        layer = self.layer
        sizes = self.primitives().workspace(
            phase, weight_grad=layer.params[0].trained, input_grad=gx_needed is None or gx_needed[0])
        return {name: TensorDecl((nbytes,), np.uint8) for name, nbytes in sizes.items()}

    def forward(self, xp, x0, y0, weights, bias, ws):
        self.primitives().forward(x0, weights, bias, y0, ws)

    def backward(self, xp, x0, weights, gy0, gx0, gw, gb, ws):
        self.primitives().backward(x0, weights, gy0, gx0, gw, gb, ws)
