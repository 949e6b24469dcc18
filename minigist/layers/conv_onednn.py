"""The oneDNN engine of the Convolution layer (Net(conv="onednn"), train.py --conv onednn):
oneDNN's direct kernels do forward, input and weight gradient through the ctypes binding in
minigist/onednn.py. This module makes a layer's primitives once and declares, as the
layer's workspaces, their blocked copies of the operands and their scratchpad, as oneDNN
sizes them; no im2col runs.
"""
import math

import numpy as np

from .. import onednn
from .base import TensorDecl


class OneDNNEngine:
    """oneDNN's convolution for one Convolution layer (float32 only), in batch chunks of
    `samples` (see chunk_bytes)."""
    # the most bytes one operand (x, y, gy, gx) of one oneDNN call may take: each is copied
    # into oneDNN's blocked layout, in the workspace, so a convolution over the whole of a
    # large batch would hold blocked copies of full-batch maps, which fill the peak once
    # Gist has shrunk the stashes (VGG-16 at batch 64: 2.47 GB of copies). Larger batches
    # run in chunks of samples, as the im2col engine's columns do; the weight gradient of
    # every chunk after the first is computed into a workspace and added to the first's.
    chunk_bytes = 16 << 20

    def __init__(self, layer):
        self.layer = layer
        self._primitives = None
        self.samples = None

    def samples_per_call(self):
        """The samples of one oneDNN call: the largest divisor of the batch whose operands
        each fit chunk_bytes (at least one sample)."""
        layer = self.layer
        batch = layer.in_shape[0]
        per_sample = max(math.prod(layer.in_shape[1:]), layer.num_output * math.prod(layer.out_hw))
        per_sample *= np.dtype(layer.dtype).itemsize
        # the divisors in pairs up to sqrt(batch): a --plan-only at batch 100,000,000 took 13 s
        # per layer when every count up to the batch was tried
        divisors = {d for k in range(1, math.isqrt(batch) + 1) if batch % k == 0 for d in (k, batch // k)}
        return max((d for d in divisors if d * per_sample <= self.chunk_bytes), default=1)

    def primitives(self):
        """The layer's oneDNN primitives (made once, on first use): minigist/onednn.py."""
        if self._primitives is None:
            layer = self.layer
            if np.dtype(layer.dtype) != np.float32:
                layer.fail(f"--conv onednn runs float32 only, not {np.dtype(layer.dtype).name}")
            self.samples = self.samples_per_call()
            try:
                self._primitives = onednn.ConvPrimitives(
                    (self.samples,) + tuple(layer.in_shape[1:]), layer.num_output, layer.group, layer.kernel,
                    layer.stride, layer.pad, layer.dilation, layer.out_hw, layer.bias_term,
                    bias_grad=layer.bias_term and layer.params[0].trained and layer.params[1].trained)
            except onednn.OneDNNError as exc:
                # oneDNN refuses what it cannot index (4,294,967,295 outputs, say): the layer
                # and the engine that would take it are the user's to change
                layer.fail(f"oneDNN cannot make this convolution ({exc}); --conv im2col plans it")
        return self._primitives

    def inplace_safe(self):
        """x and gy are reordered into blocked copies before y and gx are written (not where
        a kernel reads them as they are)."""
        prims = self.primitives()
        return prims.reorders_all("forward", ("x", "y")) and prims.reorders_all("backward", ("gy", "gx"))

    def stream_chunk(self):
        """The samples of one call where the batch runs in chunks (Gist may then hand x
        decoded chunk by chunk); 0 where one call reads the whole batch."""
        samples = self.samples_per_call()
        return samples if samples < self.layer.in_shape[0] else 0

    def fuses_bias_gradient(self, weight_grad):
        """oneDNN sums the bias gradient with dW."""
        return weight_grad

    def workspace(self, phase, gx_needed=None):
        """Its blocked copies and scratchpad, as bytes (no copies for an input gradient that
        is not written)."""
        layer = self.layer
        prims = self.primitives()
        weight_grad = layer.params[0].trained
        sizes = prims.workspace(phase, weight_grad=weight_grad, input_grad=gx_needed is None or gx_needed[0])
        ws = {name: TensorDecl((nbytes,), np.uint8) for name, nbytes in sizes.items()}
        if phase == "backward" and weight_grad and self.samples < layer.in_shape[0]:
            # a later chunk's weight (and fused bias) gradient, added to the first chunk's
            ws["gw_part"] = TensorDecl(tuple(layer.params[0].shape), layer.dtype)
            if "gb" in prims.bias_memory:
                ws["gb_part"] = TensorDecl(tuple(layer.params[1].shape), layer.dtype)
        return ws

    def forward(self, xp, x0, y0, weights, bias, ws):
        prims = self.primitives()
        step = self.samples
        for n0 in range(0, x0.shape[0], step):
            prims.forward(x0[n0:n0 + step], weights, bias, y0[n0:n0 + step], ws, weights_ready=n0 > 0)

    def backward(self, xp, x0, weights, gy0, gx0, gw, gb, ws):
        prims = self.primitives()
        step = self.samples
        for n0 in range(0, gy0.shape[0], step):
            part = slice(n0, n0 + step)
            later = n0 > 0
            gw_k = ws["gw_part"] if later and gw is not None else gw
            gb_k = ws["gb_part"] if later and gw is not None and gb is not None else gb
            prims.backward(None if x0 is None else x0[part], weights, gy0[part],
                           None if gx0 is None else gx0[part], gw_k, gb_k, ws, weights_ready=later)
            if later and gw is not None:
                xp.add(gw, gw_k, out=gw)
                if gb is not None:
                    xp.add(gb, gb_k, out=gb)
