"""MAX pooling's compiled kernels (minigist/layers/pool_kernels.py) against its xp code, byte
for byte: outputs, argmax maps and input gradients, on every pooling geometry of the layer
tests, with ties, infinities, NaN and signed zeros in the input and the gradient. A NaN must
be a NaN in the same place; its sign and payload are the hardware's and the compiler's
(0 * inf, NaN + NaN) and may differ.
(tests/test_layers_conv_pool.py runs its Caffe references and gradient checks on both paths.)"""
import numpy as np
import pytest

from minigist import jit
from minigist.testing import LayerRun, make_layer

from test_layers_conv_pool import POOL_GEOMETRIES, POOL_IDS, pool_text

pytestmark = pytest.mark.skipif(not jit.available(), reason="numba is not installed")

GEOMETRIES = POOL_GEOMETRIES + [
    ("kernel_size: 3 stride: 1 pad: 1", (3, 5, 16, 16), (3, 3), (1, 1), (1, 1), True),   # Inception's
    ("kernel_size: 3 stride: 2", (2, 4, 32, 32), (3, 3), (2, 2), (0, 0), True),
    ("kernel_size: 2 stride: 2", (2, 4, 8, 8), (2, 2), (2, 2), (0, 0), True),            # tiles
    ("kernel_size: 17", (1, 2, 17, 17), (17, 17), (1, 1), (0, 0), True),                # uint16 map
]
IDS = POOL_IDS + ["inception 3x3 s1 p1", "3x3 s2", "2x2 s2 tiles", "17x17 (uint16 argmax)"]


def awkward(shape, rng, dtype):
    """Few distinct values (many ties), with +-0, +-inf and NaN sprinkled in."""
    x = rng.integers(-3, 4, size=shape).astype(dtype)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan], dtype)
    spots = rng.random(shape) < 0.08
    x[spots] = rng.choice(special, size=int(spots.sum()))
    return x


def both_paths(layer, x, gy):
    results = []
    for on in (False, True):
        with jit.use_kernels(on), np.errstate(invalid="ignore"):    # 0 * inf in the xp code
            run = LayerRun(layer)
            y = run.forward([x])[0]
            gx = run.backward([gy])[0][0]
            results.append((y, run.saved["argmax"], gx))
    return results


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=IDS)
def test_max_pool_kernels_write_the_same_bytes(geometry, dtype):
    body, shape = geometry[:2]
    layer = make_layer(pool_text(f"pool: MAX {body}"), [shape], dtype=dtype)
    rng = np.random.default_rng(21)
    for x, gy in [(rng.standard_normal(shape).astype(dtype),
                   rng.standard_normal(layer.top_shapes[0]).astype(dtype)),
                  (awkward(shape, rng, dtype), awkward(layer.top_shapes[0], rng, dtype))]:
        (y0, a0, g0), (y1, a1, g1) = both_paths(layer, x, gy)
        assert a0.dtype == a1.dtype
        assert a0.tobytes() == a1.tobytes()
        same_bytes(y0, y1)
        same_bytes(g0, g1)


def same_bytes(a, b):
    nan = np.isnan(a)
    np.testing.assert_array_equal(nan, np.isnan(b))
    assert a[~nan].tobytes() == b[~nan].tobytes()


def test_the_kernels_run_when_on(monkeypatch):
    from minigist.layers import pool_kernels
    calls = []
    for name in ("max_forward", "max_backward"):
        original = getattr(pool_kernels, name)
        monkeypatch.setattr(pool_kernels, name,
                            lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    rng = np.random.default_rng(22)
    for body in ("kernel_size: 3 stride: 1 pad: 1", "kernel_size: 3 stride: 2"):
        layer = make_layer(pool_text(f"pool: MAX {body}"), [(2, 2, 5, 5)])
        with jit.use_kernels(False):
            run = LayerRun(layer)
            run.backward([rng.standard_normal(run.forward([rng.standard_normal((2, 2, 5, 5))])[0].shape)])
        assert calls == []
        with jit.use_kernels(True):
            run = LayerRun(layer)
            run.backward([rng.standard_normal(run.forward([rng.standard_normal((2, 2, 5, 5))])[0].shape)])
        assert calls == ["max_forward", "max_backward"]
        calls.clear()
