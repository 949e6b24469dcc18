"""Run one layer outside a net, and check its gradients by central finite differences.

Output, gradient and workspace arrays are handed to the layer filled with NaN, so a layer
that reads memory it did not write (or accumulates into gx instead of writing it) fails.
"""
import numpy as np

from . import prototxt
from .fillers import fill
from .graph import layer_spec
from .layers import LAYER_TYPES


def codes_dpr_writes(fmt, codes):
    """The codes among `codes` (one per element) that DPR in `fmt` can write: every one, but
    for fp16 not a signalling NaN (DPR writes every NaN as 0x7E00 with its sign, and its F16C
    decode, the conversion alone, would quiet one)."""
    if fmt != "fp16":
        return codes
    magnitude = np.asarray(codes).astype(np.uint32) & 0x7FFF
    return codes[~((magnitude > 0x7C00) & (magnitude & 0x200 == 0))]


def make_layer(text, bottom_shapes, dtype=np.float64, phase="TRAIN", engine=None):
    """Build and set up the layer described by a `layer { ... }` body (without the braces),
    made for the compute `engine` (None: its default)."""
    msg = prototxt.parse(text, "<test>", root="LayerParameter")
    spec = layer_spec(msg, "<test>", phase)
    layer = LAYER_TYPES[spec.type](spec, np.dtype(dtype), engine)
    shapes = [tuple(s) for s in bottom_shapes]
    layer.top_shapes = [tuple(int(d) for d in s) for s in layer.setup(shapes)]
    layer.bottom_shapes = shapes
    return layer


def make_layer_from(type_name, bottom_shapes, fields=None, initial=None, dtype=np.float64, phase="TRAIN"):
    """Build and set up a layer of `type_name` from a dict of its message's fields ({"clip_param":
    {"min": 0.0}}: what a front end that is not prototxt text gives, as the ONNX one does) and
    {param name: starting value} for `initial`."""
    from .layers.base import LayerSpec
    from .onnx_import import _msg
    msg = _msg("LayerParameter", {"name": "layer", "type": type_name, **(fields or {})})
    spec = LayerSpec(name="layer", type=type_name, bottoms=[f"x{i}" for i in range(len(bottom_shapes))],
                     tops=["y"], msg=msg, path="<test>", line=0, phase=phase, initial=dict(initial or {}))
    layer = LAYER_TYPES[type_name](spec, np.dtype(dtype))
    shapes = [tuple(s) for s in bottom_shapes]
    layer.top_shapes = [tuple(int(d) for d in s) for s in layer.setup(shapes)]
    layer.bottom_shapes = shapes
    return layer


def _empty(decl_shape, dtype, xp):
    array = xp.empty(decl_shape, dtype=dtype)
    if np.dtype(dtype).kind == "f":
        array.fill(np.nan)
    return array


class LayerRun:
    """Arrays for one layer: parameters, outputs, stash, workspace and gradients."""

    def __init__(self, layer, xp=np, seed=0):
        self.layer = layer
        self.xp = xp
        rng = np.random.default_rng(seed)
        self.params = [xp.asarray(fill(p.filler, p.shape, rng, layer.dtype)) for p in layer.params]
        layer.rng = np.random.default_rng(seed + 1)

    def _decls(self, decls):
        return {name: _empty(d.shape, d.dtype or self.layer.dtype, self.xp) for name, d in decls.items()}

    def forward(self, bottoms):
        layer = self.layer
        self.bottoms = [self.xp.asarray(b) for b in bottoms]
        self.tops = [_empty(s, layer.dtype, self.xp) for s in layer.top_shapes]
        self.saved = self._decls(layer.saved)
        layer.forward(self.xp, self.bottoms, self.tops, self.params, self.saved,
                      self._decls(layer.workspace("forward")))
        return self.tops

    def backward(self, gtops, need_bottoms=None, need_params=True):
        """Gradients for the bottoms (None where not asked) and the trained parameters."""
        layer = self.layer
        if need_bottoms is None:
            need_bottoms = [layer.propagates_down(i) for i in range(len(self.bottoms))]
        x = [b if i in layer.keeps_bottoms else None for i, b in enumerate(self.bottoms)]
        y = [t if i in layer.keeps_tops else None for i, t in enumerate(self.tops)]
        gx = [_empty(b.shape, layer.dtype, self.xp) if need else None
              for b, need in zip(self.bottoms, need_bottoms)]
        gp = [_empty(p.shape, layer.dtype, self.xp) if (need_params and decl.trained) else None
              for p, decl in zip(self.params, layer.params)]
        layer.backward(self.xp, x, y, [self.xp.asarray(g) for g in gtops], gx, self.params, gp,
                       self.saved, self._decls(layer.workspace("backward")))
        return gx, gp


def check_gradients(layer, bottoms, seed=0, eps=1e-6, rtol=1e-5, atol=1e-7, check_params=True,
                    check_bottoms=None, top_weights=None):
    """Central finite differences in float64 on L = sum_i <top_i, R_i> for random R_i.

    Compares every input element and every parameter element named; raises AssertionError
    with the worst mismatch. Returns the largest relative error seen.
    """
    assert layer.dtype == np.float64, "gradient checks run in float64"
    rng = np.random.default_rng(seed)
    run = LayerRun(layer, seed=seed)
    bottoms = [np.array(b, dtype=np.float64) for b in bottoms]
    weights = top_weights or [rng.standard_normal(s) for s in layer.top_shapes]
    rng_state = run.layer.rng.bit_generator.state

    def objective():
        run.layer.rng.bit_generator.state = rng_state   # same random draws each evaluation
        tops = run.forward(bottoms)
        return sum(float(np.sum(t * w)) for t, w in zip(tops, weights))

    objective()
    if check_bottoms is None:
        check_bottoms = [i for i in range(len(bottoms)) if layer.propagates_down(i)]
    need = [i in check_bottoms for i in range(len(bottoms))]
    run.layer.rng.bit_generator.state = rng_state
    run.forward(bottoms)
    gx, gp = run.backward(weights, need_bottoms=need, need_params=check_params)

    worst = 0.0
    targets = [(f"bottom {i}", bottoms[i], gx[i]) for i in check_bottoms]
    if check_params:
        targets += [(f"param {layer.params[j].name}", run.params[j], gp[j])
                    for j in range(len(run.params)) if gp[j] is not None]
    for label, array, analytic in targets:
        flat = array.reshape(-1)
        numeric = np.empty(flat.size)
        for k in range(flat.size):
            keep = flat[k]
            flat[k] = keep + eps
            plus = objective()
            flat[k] = keep - eps
            minus = objective()
            flat[k] = keep
            numeric[k] = (plus - minus) / (2 * eps)
        analytic = np.asarray(analytic).reshape(-1)
        error = np.abs(analytic - numeric)
        bound = atol + rtol * np.maximum(np.abs(numeric), np.abs(analytic))
        if np.any(~(error <= bound)):
            k = int(np.nanargmax(error - bound)) if np.all(np.isfinite(error)) else int(np.argmax(~np.isfinite(error)))
            raise AssertionError(f"{layer!r} {label}: gradient mismatch at flat index {k}: "
                                 f"analytic {analytic[k]!r} numeric {numeric[k]!r}")
        scale = np.maximum(np.abs(numeric), 1e-12)
        worst = max(worst, float(np.max(error / scale)) if error.size else 0.0)
    return worst
