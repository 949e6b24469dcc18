"""Caffe's weight fillers, drawn from one seeded numpy generator so that the same seed gives
the same weights on every device."""
import numpy as np

from .errors import LayerSetupError


def fill(filler, shape, rng, dtype):
    """Return a numpy array of `shape` filled as the FillerParameter dict `filler` says."""
    kind = filler.get("type", "constant")
    if kind == "values":     # fixed values the model file gives (an ONNX constant operand)
        values = np.asarray(filler["values"], dtype=dtype)
        if values.shape != tuple(shape):
            raise LayerSetupError(f"values of shape {values.shape} given for a parameter of shape {tuple(shape)}")
        return values.copy()
    count = int(np.prod(shape)) if shape else 1
    if kind == "constant":
        return np.full(shape, filler.get("value", 0.0), dtype=dtype)
    if kind == "uniform":
        return rng.uniform(filler.get("min", 0.0), filler.get("max", 1.0), size=shape).astype(dtype)
    if kind == "gaussian":
        if filler.get("sparse", -1) not in (-1, 0) and filler.get("sparse") is not None:
            raise LayerSetupError("gaussian filler: 'sparse' is not supported")
        return rng.normal(filler.get("mean", 0.0), filler.get("std", 1.0), size=shape).astype(dtype)
    if kind in ("xavier", "msra"):
        fan_in = count / shape[0] if shape else 1
        fan_out = count / shape[1] if len(shape) > 1 else count
        norm = filler.get("variance_norm", "FAN_IN")
        n = {"FAN_IN": fan_in, "FAN_OUT": fan_out, "AVERAGE": (fan_in + fan_out) / 2}[norm]
        if kind == "xavier":
            scale = np.sqrt(3.0 / n)
            return rng.uniform(-scale, scale, size=shape).astype(dtype)
        return rng.normal(0.0, np.sqrt(2.0 / n), size=shape).astype(dtype)
    raise LayerSetupError(f"filler type '{kind}' is not supported (constant, uniform, gaussian, xavier, msra)")
