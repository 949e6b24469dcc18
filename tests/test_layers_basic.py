"""ReLU, Dropout, InnerProduct, Softmax, losses, Concat, Eltwise, Flatten: forward against
plain numpy, gradients against central finite differences in float64."""
import numpy as np
import pytest

from minigist.errors import LayerSetupError, MinigistError
from minigist.testing import LayerRun, check_gradients, make_layer


def away_from_zero(rng, shape, margin=0.05):
    """Random values with no element near 0, so ReLU's kink is never crossed by eps."""
    x = rng.standard_normal(shape)
    return np.where(np.abs(x) < margin, np.sign(x + 1e-12) * margin, x) + np.sign(x) * margin


@pytest.mark.parametrize("slope", [0.0, 0.1, 2.0])
def test_relu(slope, kernel_path):
    rng = np.random.default_rng(1)
    x = away_from_zero(rng, (2, 3, 4, 5))
    layer = make_layer(f'name: "r" type: "ReLU" bottom: "x" top: "y" relu_param {{ negative_slope: {slope} }}', [x.shape])
    y, = LayerRun(layer).forward([x])
    np.testing.assert_array_equal(y, np.where(x > 0, x, slope * x))
    check_gradients(layer, [x])
    assert layer.keeps_tops == (0,) and layer.keeps_bottoms == ()


@pytest.mark.parametrize("inplace", [False, True], ids=["apart", "in place"])
@pytest.mark.parametrize("slope", [0.0, 0.1])
def test_relu_backward_makes_its_mask_a_batch_chunk_at_a_time(slope, inplace):
    """The ufunc path's mask (one byte per element) holds a chunk of samples, not the whole
    batch, and gives the same bytes as a whole-batch one."""
    from minigist import jit
    rng = np.random.default_rng(3)
    shape = (5, 3, 4, 5)
    x = away_from_zero(rng, shape).astype(np.float32)
    gy = rng.standard_normal(shape).astype(np.float32)
    results = []
    for chunk_bytes, rows in ((2 * 60, 2), (1 << 20, 5)):      # 60 elements (bytes of mask) a sample
        layer = make_layer(f'name: "r" type: "ReLU" bottom: "x" top: "y" relu_param {{ negative_slope: {slope} }}',
                           [shape], dtype=np.float32)
        layer.chunk_bytes = chunk_bytes
        ws = {k: np.empty(d.shape, d.dtype or np.float32) for k, d in layer.workspace("backward").items()}
        assert ws["mask"].shape == (rows, 3, 4, 5)
        y = np.where(x > 0, x, np.float32(slope) * x).astype(np.float32)
        g = gy.copy()
        gx = g if inplace else np.empty_like(g)
        with jit.use_kernels(False):
            layer.backward(np, [None], [y], [g], [gx], [], [], {}, ws)
        results.append(gx)
    np.testing.assert_array_equal(results[0].view(np.uint32), results[1].view(np.uint32))
    np.testing.assert_array_equal(results[0], np.where(x > 0, gy, gy * np.float32(slope)))


def test_relu_rejects_negative_slope():
    with pytest.raises(LayerSetupError, match="negative_slope"):
        make_layer('name: "r" type: "ReLU" bottom: "x" top: "y" relu_param { negative_slope: -1 }', [(2, 3)])


@pytest.mark.parametrize("axis,transpose,bias", [(1, False, True), (2, False, False), (1, True, True)])
def test_inner_product(axis, transpose, bias):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 4, 2, 2))
    text = (f'name: "fc" type: "InnerProduct" bottom: "x" top: "y" inner_product_param {{ num_output: 5 '
            f'axis: {axis} transpose: {str(transpose).lower()} bias_term: {str(bias).lower()} '
            f'weight_filler {{ type: "gaussian" std: 0.5 }} bias_filler {{ type: "uniform" }} }}')
    layer = make_layer(text, [x.shape])
    run = LayerRun(layer)
    y, = run.forward([x])
    rows = int(np.prod(x.shape[:axis]))
    weight = run.params[0] if transpose else run.params[0].T
    expected = x.reshape(rows, -1) @ weight + (run.params[1] if bias else 0)
    np.testing.assert_allclose(y.reshape(rows, 5), expected, rtol=1e-12)
    assert y.shape == tuple(x.shape[:axis]) + (5,)
    check_gradients(layer, [x])


def test_inner_product_needs_num_output():
    with pytest.raises(LayerSetupError, match="num_output"):
        make_layer('name: "fc" type: "InnerProduct" bottom: "x" top: "y"', [(2, 3)])


def test_dropout_train_and_test():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((50, 40))
    layer = make_layer('name: "d" type: "Dropout" bottom: "x" top: "y" dropout_param { dropout_ratio: 0.3 }', [x.shape])
    run = LayerRun(layer)
    y, = run.forward([x])
    mask = run.saved["mask"]
    np.testing.assert_allclose(y, x * mask / 0.7)
    assert 0.6 < mask.mean() < 0.8
    gx, _ = run.backward([np.ones_like(x)])
    np.testing.assert_allclose(gx[0], mask / 0.7)
    check_gradients(layer, [x])
    test_layer = make_layer('name: "d" type: "Dropout" bottom: "x" top: "y" dropout_param { dropout_ratio: 0.3 }',
                            [x.shape], phase="TEST")
    np.testing.assert_array_equal(LayerRun(test_layer).forward([x])[0], x)


def test_softmax():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 5, 2))
    layer = make_layer('name: "s" type: "Softmax" bottom: "x" top: "y"', [x.shape])
    y, = LayerRun(layer).forward([x])
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(axis=1, keepdims=True), rtol=1e-12)
    check_gradients(layer, [x])


def reference_softmax_loss(scores, labels, ignore=None, normalization="VALID"):
    prob = np.exp(scores - scores.max(axis=1, keepdims=True))
    prob /= prob.sum(axis=1, keepdims=True)
    n, c = scores.shape[:2]
    p3 = prob.reshape(n, c, -1)
    lab = labels.reshape(n, -1).astype(int)
    total, count = 0.0, 0
    for i in range(n):
        for j in range(lab.shape[1]):
            if ignore is not None and lab[i, j] == ignore:
                continue
            total -= np.log(max(p3[i, lab[i, j], j], np.finfo(np.float32).tiny))
            count += 1
    normalizer = {"VALID": count, "BATCH_SIZE": n, "FULL": lab.size, "NONE": 1}[normalization]
    return total / max(1, normalizer)


@pytest.mark.parametrize("extra,ignore,norm", [
    ("", None, "VALID"),
    ("loss_param { ignore_label: 2 }", 2, "VALID"),
    ("loss_param { normalization: BATCH_SIZE ignore_label: 1 }", 1, "BATCH_SIZE"),
    ("loss_param { normalize: false }", None, "BATCH_SIZE"),
    ("loss_param { normalization: FULL }", None, "FULL"),
])
def test_softmax_with_loss(extra, ignore, norm):
    rng = np.random.default_rng(5)
    scores = rng.standard_normal((4, 3, 2, 2))
    labels = rng.integers(0, 3, size=(4, 2, 2)).astype(np.float64)
    layer = make_layer(f'name: "l" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" top: "loss" {extra}',
                       [scores.shape, labels.shape])
    loss, = LayerRun(layer).forward([scores, labels])
    assert loss.shape == ()
    assert float(loss) == pytest.approx(reference_softmax_loss(scores, labels, ignore, norm), rel=1e-12)
    check_gradients(layer, [scores, labels])


def test_softmax_with_loss_rejects_bad_labels():
    layer = make_layer('name: "l" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" top: "loss"', [(2, 3), (2,)])
    with pytest.raises(MinigistError, match=r"labels must be in \[0, 3\)"):
        LayerRun(layer).forward([np.zeros((2, 3)), np.array([0.0, 3.0])])
    with pytest.raises(LayerSetupError, match="label count"):
        make_layer('name: "l" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" top: "loss"', [(2, 3), (3,)])


@pytest.mark.parametrize("top_k", [1, 2])
def test_accuracy(top_k):
    scores = np.array([[0.1, 0.5, 0.4], [0.9, 0.05, 0.05], [0.2, 0.3, 0.5], [0.3, 0.3, 0.4]])
    labels = np.array([1.0, 1.0, 0.0, 2.0])
    layer = make_layer(f'name: "a" type: "Accuracy" bottom: "s" bottom: "l" top: "a" accuracy_param {{ top_k: {top_k} }}',
                       [scores.shape, labels.shape])
    acc, = LayerRun(layer).forward([scores, labels])
    assert float(acc) == pytest.approx(caffe_accuracy(scores, labels, top_k))
    assert not layer.has_backward


def caffe_accuracy(scores, labels, top_k, ignore_label=None):
    """Caffe's AccuracyLayer, loop for loop: a sample is a hit when fewer than top_k classes
    other than the true one score >= the true class (the true class itself counts when its
    score is >= itself, i.e. not NaN)."""
    hits = count = 0
    for i, label in enumerate(labels.astype(int)):
        if ignore_label is not None and label == ignore_label:
            continue
        better = -1
        for k in range(scores.shape[1]):
            better += scores[i, k] >= scores[i, label]
        hits += better < top_k
        count += 1
    return 0.0 if count == 0 else hits / count


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("ignore", [None, 2])
def test_accuracy_ties_and_nans_count_as_caffe(top_k, ignore):
    scores = np.array([[0.0, 0.0, 0.0, 0.0],        # all tied: a miss for top_k < 4
                       [0.5, 0.5, 0.1, 0.2],        # tie with one other class
                       [0.5, 0.5, 0.5, 0.2],        # tie with two
                       [np.nan, 0.3, 0.3, 0.1],     # a NaN elsewhere never counts as better
                       [0.2, np.nan, 0.9, 0.1],     # a NaN true class is a hit in Caffe
                       [0.9, 0.1, 0.3, 0.3]])
    labels = np.array([0.0, 1.0, 2.0, 1.0, 1.0, 2.0])
    extra = f" ignore_label: {ignore}" if ignore is not None else ""
    layer = make_layer(f'name: "a" type: "Accuracy" bottom: "s" bottom: "l" top: "a" '
                       f'accuracy_param {{ top_k: {top_k}{extra} }}', [scores.shape, labels.shape])
    acc, = LayerRun(layer).forward([scores, labels])
    expected = caffe_accuracy(scores, labels, top_k, ignore)
    assert float(acc) == pytest.approx(expected)
    if top_k == 1:
        hits = [False, False, False, False, True, False]
        kept = [i for i in range(6) if ignore is None or labels[i] != ignore]
        assert expected == pytest.approx(np.mean([hits[i] for i in kept]))
    per_class = make_layer(f'name: "a" type: "Accuracy" bottom: "s" bottom: "l" top: "a" top: "c" '
                           f'accuracy_param {{ top_k: {top_k}{extra} }}', [scores.shape, labels.shape])
    assert per_class.top_shapes == [(), (4,)]
    acc2, rates = LayerRun(per_class).forward([scores, labels])
    assert float(acc2) == float(acc)
    expected_rates = []
    for c in range(4):      # Caffe: hits / samples of class c, 0 for a class with none
        chosen = (labels == c) & (labels != (ignore if ignore is not None else -1))
        expected_rates.append(caffe_accuracy(scores[chosen], labels[chosen], top_k) if chosen.any() else 0.0)
    np.testing.assert_allclose(rates, expected_rates, rtol=1e-12)
    zeros, = LayerRun(layer).forward([np.zeros_like(scores), labels])
    assert float(zeros) == (1.0 if top_k == 4 else 0.0)    # all-zero scores: 0.0 in Caffe


@pytest.mark.parametrize("axis", [1, 0, 2])
def test_concat(axis):
    rng = np.random.default_rng(6)
    shapes = [(2, 3, 4), (2, 3, 4)]
    shapes = [tuple(s[:axis]) + (s[axis] + i,) + tuple(s[axis + 1:]) for i, s in enumerate(shapes)]
    xs = [rng.standard_normal(s) for s in shapes]
    layer = make_layer(f'name: "c" type: "Concat" bottom: "a" bottom: "b" top: "y" concat_param {{ axis: {axis} }}', shapes)
    y, = LayerRun(layer).forward(xs)
    np.testing.assert_array_equal(y, np.concatenate(xs, axis=axis))
    check_gradients(layer, xs)


def test_concat_shape_mismatch():
    with pytest.raises(LayerSetupError, match="differ"):
        make_layer('name: "c" type: "Concat" bottom: "a" bottom: "b" top: "y"', [(2, 3, 4), (2, 3, 5)])


@pytest.mark.parametrize("param,reference", [
    ("", lambda a, b, c: a + b + c),
    ("eltwise_param { operation: SUM coeff: 1 coeff: -0.5 coeff: 2 }", lambda a, b, c: a - 0.5 * b + 2 * c),
    ("eltwise_param { operation: PROD }", lambda a, b, c: a * b * c),
    ("eltwise_param { operation: MAX }", lambda a, b, c: np.maximum(np.maximum(a, b), c)),
])
def test_eltwise(param, reference):
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((2, 3, 4)) + 3 * i for i in range(3)]
    xs[1][0, 0, 0] = xs[0][0, 0, 0] + 10   # MAX: make every bottom win somewhere
    layer = make_layer(f'name: "e" type: "Eltwise" bottom: "a" bottom: "b" bottom: "c" top: "y" {param}',
                       [x.shape for x in xs])
    y, = LayerRun(layer).forward(xs)
    np.testing.assert_allclose(y, reference(*xs), rtol=1e-12)
    check_gradients(layer, xs)


def caffe_eltwise_max(xs):
    """Caffe's EltwiseLayer MAX forward, element by element: (top, index of the winner)."""
    top, mask = np.empty_like(xs[0]), np.empty(xs[0].shape, np.int64)
    for idx in np.ndindex(top.shape):
        a, b = xs[0][idx], xs[1][idx]
        top[idx], mask[idx] = (a, 0) if a > b else (b, 1)
        for i in range(2, len(xs)):
            if xs[i][idx] > top[idx]:
                top[idx], mask[idx] = xs[i][idx], i
    return top, mask


@pytest.mark.parametrize("count", [2, 3, 4])
def test_eltwise_max_ties_and_nans_go_where_caffe_sends_them(count):
    """Bottom 0 beats bottom 1 only when strictly greater; later bottoms only when strictly
    greater than the running maximum. With ties the forward is the same, the gradient is not."""
    rng = np.random.default_rng(17)
    choices = np.array([0.0, 1.0, 2.0, np.nan])
    xs = [choices[rng.integers(0, 4, size=(6, 40))] for _ in range(count)]
    xs[0][0, :3] = xs[1][0, :3] = 5.0          # 0 == 1: bottom 1
    if count >= 3:
        xs[2][0, :2] = 5.0                     # 0 == 1 == 2: still bottom 1
        xs[0][1, 0], xs[1][1, 0], xs[2][1, 0] = 5.0, 1.0, 5.0   # 0 == 2 > 1: bottom 0
        xs[0][1, 1], xs[1][1, 1], xs[2][1, 1] = 1.0, 5.0, 5.0   # 1 == 2 > 0: bottom 1
    names = "".join(f' bottom: "b{i}"' for i in range(count))
    layer = make_layer(f'name: "e" type: "Eltwise"{names} top: "y" eltwise_param {{ operation: MAX }}',
                       [x.shape for x in xs])
    run = LayerRun(layer)
    y, = run.forward(xs)
    top, winner = caffe_eltwise_max(xs)
    np.testing.assert_array_equal(y, top)      # NaN where Caffe's top is NaN
    np.testing.assert_array_equal(run.saved["argmax"], winner)
    assert (winner[0, :3] == 1).all()
    if count >= 3:
        assert winner[1, 0] == 0 and winner[1, 1] == 1
    gy = rng.standard_normal(y.shape)
    gx = run.backward([gy])[0]
    for i in range(count):
        np.testing.assert_array_equal(gx[i], np.where(winner == i, gy, 0.0))


def test_eltwise_coeff_count():
    with pytest.raises(LayerSetupError, match="coeff"):
        make_layer('name: "e" type: "Eltwise" bottom: "a" bottom: "b" top: "y" eltwise_param { coeff: 1 }',
                   [(2, 3), (2, 3)])


@pytest.mark.parametrize("param,shape", [("", (2, 60)), ("flatten_param { axis: 2 }", (2, 3, 20)),
                                         ("flatten_param { axis: 1 end_axis: 2 }", (2, 12, 5))])
def test_flatten(param, shape):
    x = np.arange(120.0).reshape(2, 3, 4, 5)
    layer = make_layer(f'name: "f" type: "Flatten" bottom: "x" top: "y" {param}', [x.shape])
    y, = LayerRun(layer).forward([x])
    np.testing.assert_array_equal(y, x.reshape(shape))
    check_gradients(layer, [x])
