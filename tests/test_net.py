"""Whole networks: a finite-difference gradient check through a branching graph, training,
determinism, save/load and the summary."""
import os

import numpy as np
import pytest

import minigist
from minigist.errors import MinigistError
from minigist.memory.report import format_report
from minigist.pipeline import plan_footprint

BRANCHY = """
name: "branchy"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 6 dim: 4 dim: 3 dim: 3 } shape { dim: 6 } } }
layer { name: "fc_a" type: "InnerProduct" bottom: "data" top: "a"
  inner_product_param { num_output: 7 weight_filler { type: "gaussian" std: 0.3 } bias_filler { type: "uniform" min: -0.1 max: 0.1 } } }
layer { name: "bn_a" type: "BatchNorm" bottom: "a" top: "a" }
layer { name: "scale_a" type: "Scale" bottom: "a" top: "a" scale_param { bias_term: true filler { type: "uniform" min: 0.5 max: 1.5 } } }
layer { name: "fc_b" type: "InnerProduct" bottom: "data" top: "b"
  inner_product_param { num_output: 7 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "s" eltwise_param { coeff: 1 coeff: -0.7 } }
layer { name: "cat" type: "Concat" bottom: "s" bottom: "b" top: "c" }
layer { name: "tanh_free" type: "Softmax" bottom: "c" top: "p" }
layer { name: "fc_out" type: "InnerProduct" bottom: "p" top: "out"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 1.0 } } }
layer { name: "fc_side" type: "InnerProduct" bottom: "s" top: "side"
  inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.5 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "out" bottom: "label" top: "loss" }
layer { name: "loss_side" type: "SoftmaxWithLoss" bottom: "side" bottom: "label" top: "loss_side" loss_weight: 0.3 }
layer { name: "acc" type: "Accuracy" bottom: "out" bottom: "label" top: "acc" include { phase: TEST } }
"""


@pytest.fixture
def branchy(tmp_path):
    path = tmp_path / "branchy.prototxt"
    path.write_text(BRANCHY)
    return path


def batch(shape=(6, 4, 3, 3), classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape), rng.integers(0, classes, size=shape[0]).astype(np.float64)


def test_whole_network_gradient_check(branchy):
    net = minigist.Net(branchy, dtype=np.float64, seed=3)
    data, label = batch()
    net.forward_backward(data, label)
    grads = {k: v.copy() for k, v in net.grads().items()}
    # every learned parameter gets a gradient; BN's running statistics do not
    assert set(grads) == {"fc_a.weight", "fc_a.bias", "scale_a.scale", "scale_a.bias",
                          "fc_b.weight", "fc_b.bias", "fc_out.weight", "fc_out.bias",
                          "fc_side.weight", "fc_side.bias"}
    params = net.params()
    rng = np.random.default_rng(0)
    eps = 1e-6
    for name, analytic in grads.items():
        flat = params[name].reshape(-1)
        for k in rng.choice(flat.size, size=min(flat.size, 8), replace=False):
            keep = flat[k]
            flat[k] = keep + eps
            plus = net.forward_backward(data, label)
            flat[k] = keep - eps
            minus = net.forward_backward(data, label)
            flat[k] = keep
            numeric = (plus - minus) / (2 * eps)
            assert analytic.reshape(-1)[k] == pytest.approx(numeric, rel=1e-5, abs=1e-8), (name, k)


def test_gradient_accumulates_over_consumers(branchy):
    """'b' feeds the Eltwise and the Concat, 's' the Concat and fc_side: each gets one add."""
    net = minigist.Net(branchy, dtype=np.float64)
    kinds = [step.kind for step in net.programs["train"].steps]
    assert kinds.count("accumulate") == 2


def test_same_seed_same_weights_and_training(branchy):
    data, label = batch()
    runs = []
    for _ in range(2):
        net = minigist.Net(branchy, seed=11)
        losses = [net.train_step(data.astype(np.float32), label) for _ in range(3)]
        runs.append((losses, {k: v.copy() for k, v in net.params().items()}))
    assert runs[0][0] == runs[1][0]
    for key in runs[0][1]:
        np.testing.assert_array_equal(runs[0][1][key], runs[1][1][key])
    other = minigist.Net(branchy, seed=12)
    assert not np.array_equal(other.params()["fc_a.weight"], runs[0][1]["fc_a.weight"])


def test_sgd_matches_caffe_update_rule(tmp_path):
    path = tmp_path / "lin.prototxt"
    path.write_text("""
layer { name: "data" type: "Input" top: "data" top: "label" input_param { shape { dim: 4 dim: 3 } shape { dim: 4 } } }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
  param { lr_mult: 2 decay_mult: 0.5 } param { lr_mult: 0 }
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" } bias_filler { type: "constant" value: 0.25 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
""")
    net = minigist.Net(path, dtype=np.float64, solver=minigist.SGD(lr=0.1, momentum=0.9, weight_decay=0.01))
    data, label = batch((4, 3), classes=2)
    weight = net.params()["fc.weight"].copy()
    history = np.zeros_like(weight)
    for _ in range(3):
        net.forward_backward(data, label)
        grad = net.grads()["fc.weight"].copy()
        assert "fc.bias" not in net.grads()        # lr_mult 0: frozen, no gradient buffer
        net.train_step(data, label)
        grad = grad + 0.01 * 0.5 * weight
        history = 0.9 * history + 0.1 * 2 * grad
        weight = weight - history
        np.testing.assert_allclose(net.params()["fc.weight"], weight, rtol=1e-12)
    assert np.all(net.params()["fc.bias"] == 0.25)


def test_training_reduces_loss(branchy):
    net = minigist.Net(branchy, seed=0, solver=minigist.SGD(lr=0.05, momentum=0.9))
    data, label = batch()
    data = data.astype(np.float32)
    first = net.train_step(data, label)
    for _ in range(30):
        last = net.train_step(data, label)
    assert last < 0.5 * first
    out = net.evaluate(data, label)
    assert set(out) == {"loss", "loss_side", "acc"}
    assert out["acc"] == 1.0


def test_save_and_load_round_trip(branchy, tmp_path):
    net = minigist.Net(branchy, seed=1)
    data, label = batch()
    net.train_step(data.astype(np.float32), label)
    target = tmp_path / "w" / "weights.npz"
    net.save(target, with_momentum=True)
    other = minigist.Net(branchy, seed=2)
    other.load(target)
    for key, value in net.params().items():
        np.testing.assert_array_equal(other.params()[key], value)
    assert net.train_step(data.astype(np.float32), label) == other.train_step(data.astype(np.float32), label)
    with np.load(target, allow_pickle=False) as stored:
        assert "momentum:fc_a.weight" in stored.files and "bn_a.mean" in stored.files


def test_load_errors(branchy, tmp_path):
    net = minigist.Net(branchy)
    with pytest.raises(MinigistError, match="not found"):
        net.load(tmp_path / "missing.npz")
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(MinigistError, match="bad.npz"):
        net.load(bad)
    wrong = tmp_path / "wrong.npz"
    values = {k: np.asarray(v) for k, v in net.params().items()}
    values["fc_a.weight"] = np.zeros((2, 2), np.float32)
    np.savez(wrong, **values)
    with pytest.raises(MinigistError, match="fc_a.weight"):
        net.load(wrong)


def test_input_shape_is_checked(branchy):
    net = minigist.Net(branchy)
    with pytest.raises(MinigistError, match="shape"):
        net.train_step(np.zeros((5, 4, 3, 3), np.float32), np.zeros(5))


def test_summary_lists_layers_and_parameter_count(branchy):
    net = minigist.Net(branchy)
    text = net.summary()
    assert text.splitlines()[-1] == f"parameters: {net.train_graph.param_count():,}"
    expected = (36 * 7 + 7) + (7 + 7) + (36 * 7 + 7) + (14 * 3 + 3) + (7 * 3 + 3)
    assert net.train_graph.param_count() == expected
    assert "fc_a" in text and "InnerProduct" in text and "6x7" in text


@pytest.mark.parametrize("name", [pytest.param("vgg_small", marks=pytest.mark.slow), "resnet20",
                                  pytest.param("inception_small", marks=pytest.mark.slow)])
def test_small_models_fit_a_fixed_batch(name):
    """A few SGD steps on one fixed batch bring the loss down."""
    path = os.path.join(os.path.dirname(__file__), "..", "models", name + ".prototxt")
    net = minigist.Net(path, batch_size=8, seed=0, solver=minigist.SGD(lr=0.003, momentum=0.9))
    rng = np.random.default_rng(0)
    data = rng.standard_normal((8, 3, 32, 32)).astype(np.float32)
    label = np.arange(8) % 10
    losses = [net.train_step(data, label) for _ in range(12)]
    assert losses[-1] < 0.6 * losses[0], losses


# ---- force_backward, deploy files -----------------------------------------------------------
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
FORCE_BACKWARD = os.path.join(DATA, "force_backward.prototxt")
TINY_DEPLOY = os.path.join(DATA, "tiny_deploy.prototxt")


def without_force_backward(tmp_path):
    path = tmp_path / "plain.prototxt"
    with open(FORCE_BACKWARD) as source:
        path.write_text(source.read().replace("force_backward: true", ""))
    return str(path)


def test_force_backward_adds_exactly_the_input_gradient(tmp_path):
    plain = without_force_backward(tmp_path)
    forced = plan_footprint(FORCE_BACKWARD, alloc="none")
    base = plan_footprint(plain, alloc="none")
    data_grad = 3 * 2 * 4 * 4 * 4      # float32 (3, 2, 4, 4): 384 bytes, aligned to 512
    assert forced["total_by_category"]["gradient"] - base["total_by_category"]["gradient"] == 512
    assert forced["footprint_bytes"] - base["footprint_bytes"] == 512 >= data_grad
    # the static plan too: the gradient is live at the peak, nothing else moves
    assert plan_footprint(FORCE_BACKWARD)["footprint_bytes"] - plan_footprint(plain)["footprint_bytes"] == 512
    program = minigist.build_program(minigist.build_graph(FORCE_BACKWARD))
    assert "grad:data" in program.buffers and "grad:label" not in program.buffers
    assert "grad:data" not in minigist.build_program(minigist.build_graph(plain)).buffers


def test_force_backward_input_gradient_matches_finite_differences(tmp_path):
    net = minigist.Net(FORCE_BACKWARD, dtype=np.float64, seed=1)
    rng = np.random.default_rng(5)
    data = rng.standard_normal((3, 2, 4, 4))
    label = np.array([0.0, 3.0, 1.0])
    grads = net.input_gradients(data, label)
    assert set(grads) == {"data"}

    def loss(x):
        return net.evaluate(x, label)["loss"]
    step = 1e-6
    numeric = np.zeros_like(data)
    for index in np.ndindex(data.shape):
        bumped = data.copy()
        bumped[index] += step
        up = loss(bumped)
        bumped[index] -= 2 * step
        numeric[index] = (up - loss(bumped)) / (2 * step)
    np.testing.assert_allclose(grads["data"], numeric, rtol=1e-6, atol=1e-9)
    # no update ran: the same batch gives the same gradient
    np.testing.assert_array_equal(net.input_gradients(data, label)["data"], grads["data"])
    for alloc in ("static", "dynamic"):
        other = minigist.Net(FORCE_BACKWARD, dtype=np.float64, seed=1, alloc=alloc, update="fused")
        np.testing.assert_array_equal(other.input_gradients(data, label)["data"], grads["data"])
    with pytest.raises(MinigistError, match="needs 'force_backward: true'"):
        minigist.Net(without_force_backward(tmp_path)).input_gradients(data, label)


def test_deploy_file_plans_forward_only_and_says_so():
    report = plan_footprint(TINY_DEPLOY)
    assert report["forward_only"] is True and report["forward_only_reason"] == "no loss layer"
    assert report["backward_peak_bytes"] == 0
    assert "forward only: no loss layer" in format_report(report)
    assert minigist.summary(minigist.build_graph(TINY_DEPLOY)).splitlines()[-1].startswith("forward only: no loss layer")
    assert minigist.summary(minigist.build_graph(TINY_DEPLOY, add_loss=True)).splitlines()[-1].startswith(
        "added loss: SoftmaxWithLoss 'loss' on 'fc'")
    trained = plan_footprint(TINY_DEPLOY, add_loss=True)
    assert trained["forward_only"] is False and "forward_only_reason" not in trained
    assert trained["backward_peak_bytes"] > 0 and trained["footprint_bytes"] > report["footprint_bytes"]
    assert "SoftmaxWithLoss 'loss' on 'fc'" in trained["added_loss"]
    assert "forward only" not in format_report(trained)


def test_deploy_file_trains_only_with_add_loss():
    rng = np.random.default_rng(0)
    data, label = rng.standard_normal((4, 1, 8, 8)), np.array([1.0, 2.0, 3.0, 4.0])
    with pytest.raises(MinigistError, match="no loss layer, nothing to train .* add_loss=True"):
        minigist.Net(TINY_DEPLOY).train_step(data, label)
    net = minigist.Net(TINY_DEPLOY, add_loss=True, solver=minigist.SGD(lr=0.1))
    first = net.train_step(data, label)
    for _ in range(5):
        last = net.train_step(data, label)
    assert np.isfinite(first) and last < first
    outputs = net.evaluate(data, label)
    assert outputs["prob"].shape == (4, 10) and np.isfinite(outputs["loss"]) and 0 <= outputs["accuracy"] <= 1
    assert net.report()["added_loss"].startswith("SoftmaxWithLoss 'loss' on 'fc'")


def test_force_backward_input_gradient_through_branches_batchnorm_and_two_losses(tmp_path):
    # data feeds two layers (its gradient is a sum), BatchNorm uses the batch's statistics,
    # and fc_b's propagate_down: false is overridden by force_backward, as Caffe does
    path = tmp_path / "branchy_forced.prototxt"
    path.write_text("force_backward: true\n" + BRANCHY.replace(
        'bottom: "data" top: "b"', 'bottom: "data" top: "b" propagate_down: false'))
    net = minigist.Net(path, dtype=np.float64, seed=3)
    data, label = batch()
    analytic = net.input_gradients(data, label)["data"]
    eps = 1e-6
    rng = np.random.default_rng(1)
    for index in (tuple(rng.integers(0, d) for d in data.shape) for _ in range(12)):
        bumped = data.copy()
        bumped[index] += eps
        plus = net.forward_backward(bumped, label)
        bumped[index] -= 2 * eps
        minus = net.forward_backward(bumped, label)
        assert analytic[index] == pytest.approx((plus - minus) / (2 * eps), rel=1e-5, abs=1e-8), index


def test_bundled_models_by_name_as_on_the_command_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)     # not the repository: the name is looked up in minigist's models/
    by_name = minigist.Net("vgg_small", batch_size=2, gist="lossless")
    path = os.path.join(os.path.dirname(minigist.__file__), "..", "models", "vgg_small.prototxt")
    by_path = minigist.Net(path, batch_size=2, gist="lossless")
    assert by_name.report()["footprint_bytes"] == by_path.report()["footprint_bytes"]
    named, given = (plan_footprint(m, batch_size=4) for m in ("resnet20", path.replace("vgg_small", "resnet20")))
    assert named["footprint_bytes"] == given["footprint_bytes"] and named["stash"] == given["stash"]
    (tmp_path / "vgg_small").write_text("not a model")     # a file of that name is the file, not the bundled model
    with pytest.raises(MinigistError):
        minigist.Net("vgg_small", batch_size=2)
