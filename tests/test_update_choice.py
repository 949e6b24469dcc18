"""--optimize --update auto: the optimizer chooses, with the per-stash choices, whether the SGD
update is fused or blocked (a fully connected layer's weight gradient made and applied a block of
rows at a time), every plan compared with the fused update's `none`."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import minigist
from minigist.checkpoint import check_optimized_plan
from minigist.costmodel import reference_model, signature, step_bytes
from minigist.optimize import NothingFits, Optimizer, RecordedPlan, Settings, SettingsSearch, optimizer_for
from minigist.pipeline import Options, compile
from test_gist import model
from test_memory import WIDE

ROOT = os.path.join(os.path.dirname(__file__), "..")
LOSSLESS = Options(update="fused")
# WIDE's fc1 weight gradient (18,040,000 B) sets the fused update's peak; blocks of 1920 rows
# take it to 8,448,000 B at a time
FUSED_NONE = 65_290_240
FUSED_FLOOR = 65_238_016
BLOCKED_NONE = 55_763_968


def wide_images(tmp_path):
    """WIDE reading 1x28x28 images, as train.py's --data gives them."""
    path = tmp_path / "wide_images.prototxt"
    path.write_text(WIDE.replace("shape { dim: 4 dim: 1100 }", "shape { dim: 4 dim: 1 dim: 28 dim: 28 }"))
    return path


@pytest.fixture
def wide(tmp_path):
    path = tmp_path / "wide.prototxt"
    path.write_text(WIDE)
    return str(path)


def test_the_search_compares_the_blocked_update_with_the_fused_none(wide):
    search = optimizer_for(wide, LOSSLESS, reference_model(), update="auto")
    assert isinstance(search, SettingsSearch)
    assert search.describe() == "--update auto: updates tried: fused, blocked"
    assert [o.options.update for o in search.optimizers] == ["fused", "blocked"]
    fused, blocked = search.optimizers
    assert search.baseline_footprint == blocked.baseline_footprint == fused.baseline_footprint == FUSED_NONE
    assert blocked.baseline_seconds == fused.base_seconds < blocked.base_seconds
    assert fused.floor()[0] == FUSED_FLOOR and search.floor()[0] == blocked.floor()[0] < FUSED_FLOOR
    # room for either: the fused update, the faster one
    roomy = search.fit(70_000_000)
    assert roomy.options.update == "fused" and roomy.footprint_bytes == FUSED_NONE
    # below what the fused update can reach: the blocked one, its footprint the compiled plan's
    plan = search.fit(60_000_000)
    assert plan.options.update == "blocked" and plan.footprint_bytes == BLOCKED_NONE
    assert compile(wide, plan.options).plan.footprint_bytes == BLOCKED_NONE
    assert plan.baseline_footprint_bytes == FUSED_NONE and plan.ratio == FUSED_NONE / BLOCKED_NONE
    assert plan.predicted_overhead > 0
    with pytest.raises(NothingFits, match=r"\(the front whole, the blocked update, the nearest of the settings "
                                          r"tried: whole fused, whole blocked\)$"):
        search.fit(50_000_000)


def test_a_plan_with_the_blocked_update_trains_as_the_fused_none_bit_for_bit(wide):
    plan = optimizer_for(wide, LOSSLESS, reference_model(), update="auto").fit(60_000_000)
    rng = np.random.default_rng(5)
    data = [(rng.standard_normal((4, 1100)).astype(np.float32), rng.integers(0, 10, 4)) for _ in range(3)]
    reference = minigist.Net(wide, seed=2, threads=1, plan=Settings(LOSSLESS.replace(gist="none")))
    losses = [reference.train_step(*batch) for batch in data]
    net = minigist.Net(wide, seed=2, threads=1, plan=plan)
    assert net.update == "blocked"
    assert [net.train_step(*batch) for batch in data] == losses
    for key, value in reference.state().items():     # weights and momentum
        np.testing.assert_array_equal(net.state()[key], value, err_msg=key)
    assert net.report()["footprint_with_evaluation_bytes"] == BLOCKED_NONE


def test_the_update_is_applied_and_read_back_from_the_plans_record(wide):
    plan = optimizer_for(wide, LOSSLESS, reference_model(), update="auto").fit(60_000_000)
    net = minigist.Net(wide, seed=2, plan=Settings(LOSSLESS))
    net.apply_plan(plan)        # what a training run's --optimize does after calibration
    assert net.update == "blocked" and net.report()["footprint_with_evaluation_bytes"] == plan.footprint_bytes
    record = json.loads(json.dumps(plan.to_json()))      # as a checkpoint holds it
    assert record["update"] == "blocked"
    check_optimized_plan(record)
    assert RecordedPlan(LOSSLESS, record).options.update == "blocked"
    older = {key: value for key, value in record.items() if key != "update"}     # a checkpoint from before
    assert RecordedPlan(LOSSLESS, older).options.update == "fused"
    with pytest.raises(ValueError, match="'update' is 'separate', not fused or blocked"):
        check_optimized_plan(dict(record, update="separate"))


def test_a_net_without_a_large_weight_gradient_is_searched_with_the_fused_update_alone():
    search = optimizer_for(model("vgg_small"), Options(batch_size=8, update="fused"), reference_model(),
                           update="auto")
    assert len(search.optimizers) == 1 and search.optimizers[0] is search.whole
    assert search.describe() == ("--update auto: updates tried: fused (blocked makes no weight gradient in blocks "
                                 "here: none is above 16 MiB)")


def test_the_blocked_steps_are_priced_by_the_rows_they_touch(wide):
    """The FLOP model: a block's update reads and writes its rows of the weights and momentum,
    not the whole of them; the blocked layer's own backward step is keyed apart from the fused
    one's (it makes the input gradient alone), so a profiling run times each as itself."""
    fused = compile(wide, LOSSLESS.replace(gist="none")).program
    blocked = compile(wide, LOSSLESS.replace(gist="none", update="blocked")).program
    cost = reference_model()
    fc1 = [s for s in blocked.steps if s.layer is not None and s.layer.name == "fc1" and s.kind != "forward"]
    weights = 4100 * 1100 * 4
    updates = [s for s in fc1 if s.kind == "update" and "rows" in s.args]
    # the weights' rows, the momentum's and the block of the gradient
    assert [step_bytes(s, blocked.buffers) for s in updates] == [3 * rows * 1100 * 4 for rows in (1920, 1920, 260)]
    assert sum(step_bytes(s, blocked.buffers) for s in updates) == 3 * weights
    whole = next(s for s in fused.steps if s.label == "backward:fc1")
    apart = next(s for s in blocked.steps if s.label == "backward:fc1")
    assert signature(apart, blocked) != signature(whole, fused)
    assert signature(apart, blocked)[1] == "fc1:weight gradient in blocks"
    # about the same bytes and the same FLOPs both ways: the blocks read x once more each
    added = cost.program_seconds(blocked) / cost.program_seconds(fused) - 1
    assert 0 < added < 1e-3


def test_a_training_runs_cost_model_times_the_blocked_update(wide, monkeypatch):
    from minigist import optimize_cli
    from test_microbatch import recorded_profiles
    profiled = recorded_profiles(monkeypatch)
    rng = np.random.default_rng(0)
    batch = (rng.standard_normal((4, 1100)).astype(np.float32), rng.integers(0, 10, 4))
    optimize_cli.profiled_model(wide, LOSSLESS, batch, lossy=False, threads=1, out=lambda line: None,
                                updates=["blocked"])
    blocked = [p for p in profiled if any("rows" in step.args for step in p.steps)]
    # beside every stash kept, the lossless rules and every stash rebuilt: the blocked update's
    # `none` (no replay), the others fused
    assert len(profiled) == 4 and len(blocked) == 1
    assert not any(step.kind == "recompute" for step in blocked[0].steps)


def test_the_command_line_lets_the_optimizer_choose_the_update(wide, tmp_path):
    report = tmp_path / "r.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--model", wide, "--plan-only",
                           "--optimize", "--memory-budget", "60000000", "--update", "auto", "--report-json",
                           str(report)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "--update auto: updates tried: fused, blocked" in done.stdout
    assert "update: blocked (--update): a fully connected layer's weight gradient above 16 MiB" in done.stdout
    optimizer = json.loads(report.read_text())["optimizer"]
    assert optimizer["update"] == "blocked" and optimizer["footprint_bytes"] == BLOCKED_NONE
    assert optimizer["baseline_footprint_bytes"] == FUSED_NONE


def test_update_auto_without_the_optimizer_is_refused_in_one_line(wide):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--model", wide, "--plan-only",
                           "--update", "auto"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "train.py: error: --update auto: the optimizer chooses between fused and blocked; give --optimize, or name "
        "one"]


def test_an_optimizer_of_the_blocked_update_alone_compares_with_its_own_none(wide):
    """--update blocked given, not auto: the plans are compared with `none` under the blocked update."""
    optimizer = Optimizer(wide, LOSSLESS.replace(update="blocked"), reference_model())
    assert optimizer.baseline_footprint == BLOCKED_NONE and optimizer.baseline_seconds == optimizer.base_seconds


def test_a_training_run_chooses_the_blocked_update_and_a_resume_keeps_it(tmp_path, capsys):
    """A budget only the blocked update reaches: the run trains with it (the weights those of
    --gist none under the fused update, one BLAS thread), its checkpoint records it, and a
    resume applies it again without a new fit."""
    import train
    from minigist.checkpoint import read_checkpoint
    path = wide_images(tmp_path)
    common = ["--model", str(path), "--data", "synthetic", "--threads", "1", "--eval-every", "0",
              "--train-eval-size", "0"]
    optimized, plain = tmp_path / "optimized", tmp_path / "plain"
    assert train.main(common + ["--optimize", "--update", "auto", "--memory-budget", "56MB", "--iters", "2",
                                "--checkpoint", str(optimized)]) == 0
    out = capsys.readouterr().out
    assert "--update auto: updates tried: fused, blocked" in out and "update: blocked (--update)" in out
    assert train.main(common + ["--gist", "none", "--iters", "3", "--checkpoint", str(plain)]) == 0
    meta, _, _ = read_checkpoint(str(optimized))
    assert meta["optimizer"]["update"] == "blocked" and meta["config"]["update"] == "auto"
    capsys.readouterr()
    assert train.main(["--checkpoint", str(optimized), "--resume", "--iters", "3"]) == 0
    out = capsys.readouterr().out
    assert "optimizer: the checkpoint's plan" in out and "footprint 52,977,664 B" in out
    (_, _, resumed), (_, _, expected) = read_checkpoint(str(optimized)), read_checkpoint(str(plain))
    assert resumed.keys() == expected.keys()
    for key in expected:
        np.testing.assert_array_equal(resumed[key], expected[key], err_msg=key)
    # the checkpoint records --update: a resume under another is refused in one line
    assert train.main(["--checkpoint", str(optimized), "--resume", "--iters", "4", "--update", "fused"]) == 2
    assert "was made with --update auto, not fused (drop --update" in capsys.readouterr().err


def test_the_library_takes_update_auto(wide):
    plan = minigist.optimize(wide, 60_000_000, update="auto")
    assert plan.options.update == "blocked" and plan.baseline_footprint_bytes == FUSED_NONE
    assert minigist.optimize(wide, 70_000_000, update="auto").options.update == "fused"


def test_a_lossless_training_run_on_several_blas_threads_keeps_the_fused_update(tmp_path, capsys):
    """A block's GEMM rounds as the same rows of the whole product only on one BLAS thread:
    with two, --gist lossless plans the fused update alone, and says why."""
    import train
    path = wide_images(tmp_path)
    common = ["--model", str(path), "--data", "synthetic", "--conv", "im2col", "--threads", "2", "--eval-every", "0",
              "--train-eval-size", "0", "--iters", "1", "--optimize", "--update", "auto"]
    assert train.main(common + ["--memory-budget", "70MB"]) == 0
    out = capsys.readouterr().out
    assert ("--update auto: the blocked update rounds apart from the fused one on 2 BLAS threads; under --gist "
            "lossless the fused update alone is planned (--threads 1 for both)") in out
    assert "updates tried" not in out and "update: blocked" not in out
    assert train.main(common + ["--memory-budget", "56MB"]) == 2
    assert "nothing fits 56,000,000 bytes" in capsys.readouterr().err
