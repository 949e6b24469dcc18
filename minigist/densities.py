"""SSDC densities measured ahead of a plan: a plan from shapes alone cannot see the data, so
it plans SSDC only for the tensors whose densest sample somebody measured (Net.calibrate does
that on real batches; tools/measure_densities.py writes it to a file).

A densities file is JSON: {"model": NAME, "input_size": PIXELS, "density": {blob: fraction}, ...}.
"""
import json
import math

from .errors import MinigistError

MARGIN = 0.05     # plan SSDC this far above the densest sample seen, as Net.calibrate does


def read_densities(path, graph):
    """The measured densities in `path` for `graph`'s training program, checked: every tensor
    must be a blob of the graph, every value a fraction, and a stated input size the graph's.
    Returns {blob: measured density}."""
    try:
        with open(path, encoding="utf-8") as handle:
            content = json.load(handle)
    except OSError as exc:
        raise MinigistError(f"--densities: cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise MinigistError(f"--densities: {path} is not JSON ({exc})") from None
    if not isinstance(content, dict) or not isinstance(content.get("density"), dict):
        raise MinigistError(f"--densities: {path} has no \"density\" object of tensor -> fraction")
    stated = content.get("input_size")
    size = graph.input_shape[-1]
    if stated is not None and stated != size:
        raise MinigistError(f"--densities: {path} was measured at input size {stated}, this plan's is {size}")
    measured = {}
    for name, value in content["density"].items():
        if name not in graph.blobs:
            raise MinigistError(f"--densities: {path} gives a density for '{name}', which is no blob of "
                                f"{graph.path}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value <= 1) \
                or not math.isfinite(value):
            raise MinigistError(f"--densities: {path}: the density of '{name}' is {value!r}, not a fraction")
        measured[name] = float(value)
    return measured


def planned(measured, margin=MARGIN):
    """What a plan reserves for each measured density: `margin` above it, at most all of it."""
    return {name: min(1.0, value * (1.0 + margin)) for name, value in measured.items()}
