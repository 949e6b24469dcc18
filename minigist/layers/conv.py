"""Convolution with Caffe's semantics (2-D, NCHW, axis 1): the layer's parameters, shapes
and declared facts, and the dispatch of its work to a convolution engine.

Arrays (x, y, gy, gx, weights) come from the executor; every tensor-sized temporary is a
workspace the engine declares. The graph is built for an engine (build_graph's `conv`), which
each layer gets as it is made (`engine`); each is an object made once per layer from
`ENGINE_TYPES`:

- "im2col" (minigist/layers/conv_im2col.py): im2col columns and BLAS GEMMs, in batch chunks;
- "onednn" (minigist/layers/conv_onednn.py): oneDNN's direct kernels (minigist/onednn.py).

An engine is made from the layer, `Engine(layer)`, reads its shapes (`geometry`,
minigist/layers/conv_geometry.py) and settings from it, and answers:

- `workspace(phase, gx_needed)`: its workspaces, name -> TensorDecl;
- `forward(xp, x, y, weights, bias, ws)`, `backward(xp, x, weights, gy, gx, gw, gb, ws)`
  (x given only with gw; gx, gw and gb may be None);
- `fuses_bias_gradient(weight_grad)`: whether its backward computes gb itself;
- `inplace_safe()`: whether gx may overwrite gy (y x) where their shapes agree;
- `stream_chunk()`: the samples of x its backward reads at a time (0: all at once); its
  forward reads x in the same chunks where x is a slice reader (a replay's encoded source).

So a further engine is a module and one entry in `ENGINE_TYPES`.
"""
from .base import Layer, TensorDecl, expect_int_list, filler_of, register
from .conv_geometry import (ConvGeometry, columns_per_group, is_pointwise, kernel_extent, output_size,
                            transposed_cheaper)
from .conv_im2col import Im2colEngine
from .conv_onednn import OneDNNEngine

ENGINE_TYPES = {"im2col": Im2colEngine, "onednn": OneDNNEngine}


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


@register
class Convolution(Layer):
    type = "Convolution"
    param_field = "convolution_param"
    chunk_bytes = 8 << 20       # target size of one chunk's im2col columns
    gw_block_bytes = 1 << 20    # target size of the partial weight gradient of a later chunk
    ENGINES = tuple(ENGINE_TYPES)

    def __init__(self, spec, dtype, engine=None):
        super().__init__(spec, dtype, engine or "im2col")     # a key of ENGINE_TYPES

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
            extent = kernel_extent(k, d)
            if size + 2 * pd < extent:
                self.fail(f"kernel extent {extent} is larger than the padded input {axis_name} "
                          f"{size + 2 * pd}")
            out.append(output_size(size, extent, s, pd))
        self.in_shape = (n, c, h, w)
        self.out_hw = tuple(out)
        self.geometry = ConvGeometry(self.in_shape, self.num_output, self.group, self.kernel, self.stride,
                                     self.pad, self.dilation, self.out_hw)
        self._engines = {}
        kh, kw = self.kernel
        self.cols = columns_per_group(self.geometry)
        self.pointwise = is_pointwise(self.geometry)
        oh, ow = self.out_hw
        self.transposed_backward = (self.stride == (1, 1) and not self.pointwise
                                    and transposed_cheaper(self.geometry))
        self.batch_chunk = None
        self.add_param("weight", (self.num_output, c // self.group, kh, kw),
                       filler_of(p.get("weight_filler")))
        self.bias_term = bool(p.get("bias_term", True))
        if self.bias_term:
            self.add_param("bias", (self.num_output,), filler_of(p.get("bias_filler")))
        # backward reads x only for the weight gradient
        self.keeps_bottoms = (0,) if self.params[0].trained else ()
        return [(n, self.num_output, oh, ow)]

    def conv_engine(self):
        """The engine that `engine` names, made on first use (one per name and layer)."""
        if self.engine not in self._engines:
            self._engines[self.engine] = ENGINE_TYPES[self.engine](self)
        return self._engines[self.engine]

    def inplace_safe(self, bottom_index, top_index):
        """gx may overwrite gy (and y x) when they have one shape and the engine reads each
        part of gy (x) before it writes the same part of gx (y)."""
        n, c, h, w = self.in_shape
        if (c, h, w) != (self.num_output,) + self.out_hw:
            return False
        return self.conv_engine().inplace_safe()

    def stream_chunk(self):
        """Samples of x the backward reads at a time (x[0][n0:n0 + b]): a stash encoded per
        sample can be decoded one such slice at a time (minigist.codecs.segmented)."""
        return self.conv_engine().stream_chunk()

    def forward_stream_chunk(self):
        """The backward's slices: each engine's forward runs the batch in the same chunks
        (im2col's 1x1 path does so where x is such a slice reader)."""
        return self.conv_engine().stream_chunk()

    # set on a copy set up for a micro-batch (passes/microbatch.py): its backward may add into
    # the parameter gradients, so it declares what adding needs
    accumulating = False

    @property
    def microbatchable(self):
        """The im2col engine's weight gradient adds its batch chunks in order, and a micro-batch
        of whole chunks adds the same ones (a 1x1 convolution adds its samples one at a time,
        whatever the chunks); the bias gradient adds one sample at a time, numpy's
        order for the whole batch except with one output channel (its sum runs over the batch
        and the pixels as one)."""
        return self.engine == "im2col" and self.num_output > 1

    def workspace(self, phase, gx_needed=None):
        ws = self.conv_engine().workspace(phase, gx_needed)
        if phase == "backward" and self.accumulating and self.bias_term and self.params[1].trained:
            ws["gbpart"] = TensorDecl((self.num_output,))     # one sample's bias gradient
        return ws

    def forward(self, xp, x, y, p, saved, ws):
        self.conv_engine().forward(xp, x[0], y[0], p[0], p[1] if self.bias_term else None, ws)

    def backward(self, xp, x, y, gy, gx, p, gp, saved, ws, accumulate=False):
        """With `accumulate` (a later micro-batch) the parameter gradients are added into."""
        gy0, gx0 = gy[0], gx[0]
        gw = gp[0] if gp else None
        gb = gp[1] if self.bias_term and len(gp) > 1 else None
        engine = self.conv_engine()
        if gb is not None and not engine.fuses_bias_gradient(gw is not None):
            n, o = gy0.shape[:2]
            oh, ow = self.out_hw
            if accumulate:
                # numpy sums the whole batch a sample at a time into gb: the same additions
                part = ws["gbpart"]
                samples = gy0.reshape(n, o, oh * ow)
                for index in range(n):      # by index: iterating a device array is a host sync
                    xp.sum(samples[index], axis=1, out=part)
                    xp.add(gb, part, out=gb)
            else:
                xp.sum(gy0.reshape(n, o, oh * ow), axis=(0, 2), out=gb)
        if gw is None and gx0 is None:
            return
        x0 = x[0] if gw is not None else None
        if accumulate:      # only a microbatchable engine (im2col) is asked to
            engine.backward(xp, x0, p[0], gy0, gx0, gw, gb, ws, accumulate=True)
        else:
            engine.backward(xp, x0, p[0], gy0, gx0, gw, gb, ws)
