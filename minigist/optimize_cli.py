"""train.py's --optimize: the plan that fits --memory-budget (printed, written, or trained
with), or without a budget the frontier of footprint against predicted overhead.

The choosing is minigist/optimize.py's; this module settles the cost model (a plan from
shapes alone: FLOPs and bytes at the reference rates, or this machine's measured ones with
--measure-rates; a training run: its steps timed by a short profiling run), prints the
decisions and draws the frontier.
"""

import math

import numpy as np

from .costmodel import MeasuredModel, flop_model, profile_programs, reference_model
from .errors import MinigistError
from .optimize import (KEEP, SMALL_CHUNK_BYTES, RecordedPlan, Settings, SettingsSearch, makes_blocks,
                       dominated_by, layout_label, layouts, lossy_overrides, optimizer_for)
from .passes.microbatch import front_candidates
from .pipeline import compile, plan_report
from .program import STASH, WEIGHT_GRAD_BLOCK_BYTES

FRONTIER_POINTS = 8
# timed iterations of each profiled program: on a shared 2-core machine a program's time moves
# by 10% from one iteration to the next, and with 7 the predicted overhead of one fixed plan
# (resnet20, 3x less memory) moved by 7 points from one profiling run to the next; with 15, by 2
PROFILE_REPEATS = 15


def check_args(args):
    """--optimize's own rules, before anything runs."""
    if args.measure_rates and not (args.optimize and args.plan_only):
        raise MinigistError("--measure-rates sets the cost model of --optimize --plan-only (a training run "
                            "times its own steps)")
    if args.gist not in ("lossless", "all"):
        raise MinigistError(f"--optimize chooses with --gist lossless (the default) or all, not {args.gist}")
    if args.alloc != "static":
        raise MinigistError(f"--optimize plans for --alloc static (the exact plan), not {args.alloc}")
    if (getattr(args, "ranks", None) or 1) > 1:
        raise MinigistError("--optimize plans one process's program, not a rank's share of a data-parallel batch")
    if args.plan_only and args.memory_budget is None:
        for flag, path, what in (("--report-json", args.report_json, "report"), ("--trace", args.trace, "trace")):
            if path is not None:
                raise MinigistError(f"{flag}: --optimize without --memory-budget prints the frontier and writes no "
                                    f"{what}; give --memory-budget for a plan's (--plot draws the frontier)")


def auto_front(args):
    """"auto" where --microbatch auto lets the optimizer choose the front, else None (the
    options carry a named one)."""
    return "auto" if getattr(args, "microbatch", None) == "auto" else None


def auto_update(args):
    """"auto" where --update auto lets the optimizer choose the update, else None."""
    return "auto" if getattr(args, "update", None) == "auto" else None


def _optimizer(model, options, cost, args, out, fronts=None, update=None):
    """The optimizer --optimize asks (optimize.optimizer_for), the fronts and updates it tries
    said first under --microbatch auto and --update auto (`update`: None, as args say)."""
    optimizer = optimizer_for(model, options, cost, lossy=args.gist == "all", microbatch=auto_front(args),
                              fronts=fronts, update=auto_update(args) if update is None else update)
    if isinstance(optimizer, SettingsSearch):
        out(optimizer.describe())
    return optimizer


def _mib(nbytes):
    return f"{nbytes / 2**20:,.1f} MiB"


def plan_lines(plan):
    """The footprint, the predicted step time against the unoptimized plan's, the decisions."""
    budget = "none (the smallest plan)" if plan.budget_bytes is None else f"{plan.budget_bytes:,} B"
    lines = [f"optimizer: budget {budget}; cost model {plan.cost_model.describe()}",
             f"footprint: {plan.footprint_bytes:,} B ({_mib(plan.footprint_bytes)}), "
             f"{plan.ratio:.2f}x less than every stash kept in fp32 ({plan.baseline_footprint_bytes:,} B)",
             f"predicted step time: {plan.predicted_seconds:.4g} s, {1 + plan.predicted_overhead:.3f}x the "
             f"unoptimized plan's {plan.baseline_seconds:.4g} s ({100 * plan.predicted_overhead:+.1f}%)"]
    microbatch = getattr(plan.options, "microbatch", ())
    if microbatch:
        unit = "samples" if microbatch[1] > 1 else "sample"
        lines.append(f"front: the input through {microbatch[0]} runs {microbatch[1]} {unit} at a time (--microbatch), "
                     f"its forward again in the backward pass (in the predicted time)")
    for start, through, samples in getattr(plan.options, "spans", ()):
        unit = "samples" if samples > 1 else "sample"
        lines.append(f"span: the layers after {start} through {through} run {samples} {unit} at a time, forward and "
                     f"backward, each micro-batch's stashes kept for its own backward (no replay)")
    if plan.options.update == "blocked":
        lines.append("update: blocked (--update): a fully connected layer's weight gradient above "
                     f"{WEIGHT_GRAD_BLOCK_BYTES >> 20} MiB is made and applied a block of rows at a time")
    lines.append("decisions:")
    rows = [("tensor", "layer", "choice", "bytes saved", "time added")]
    for decision in plan.decisions:
        rows.append((decision.tensor, decision.layer, decision.choice, f"{decision.bytes_saved:,}",
                     f"{1e3 * decision.seconds_added:.2f} ms"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        lines.append("  " + "  ".join(cell.ljust(w) if i < 3 else cell.rjust(w)
                                      for i, (cell, w) in enumerate(zip(row, widths))))
    return lines


def frontier(optimizer, points=FRONTIER_POINTS, each=None):
    """Plans from no optimization down to the smallest: the budgets spaced evenly (in log)
    between the unoptimized footprint and the smallest reachable. `each(budget, plan)` is
    called as each row is found, in the rows' order (the smallest plan is searched first, but
    is the last row): the large nets take minutes, and the rows come one by one."""
    smallest = optimizer.smallest()
    top = optimizer.baseline_footprint
    plans = []
    for k in range(points):
        budget = int(top * (smallest.footprint_bytes / top) ** (k / (points - 1)))
        plan = smallest if k == points - 1 else optimizer.fit(budget)
        plans.append((budget if k < points - 1 else None, plan))
        if each is not None:
            each(*plans[-1])
    return plans


FRONTIER_HEADER = ["frontier (budget against predicted overhead, budgets from the unoptimized plan's footprint down to "
                   "the smallest plan's):",
                   "  budget            footprint         vs fp32   predicted overhead"]


def frontier_row(budget, plan):
    shown = "smallest" if budget is None else f"{budget:,}"
    front = getattr(plan.options, "microbatch", ())
    spans = getattr(plan.options, "spans", ())
    return (f"  {shown:>16}  {plan.footprint_bytes:>16,}  {plan.ratio:6.2f}x  "
            f"{100 * plan.predicted_overhead:+8.1f}%" + (f"  front {layout_label(front, spans)}" if front else "")
            + ("  blocked update" if plan.options.update == "blocked" else ""))


def _tick_step(high, most=6):
    """A round tick step (1, 2 or 5 times a power of ten) that marks 0..high in at most `most`
    intervals."""
    step = 10.0 ** math.floor(math.log10(high / most)) if high > 0 else 1.0
    for factor in (1, 2, 5, 10):
        if high / (step * factor) <= most:
            return step * factor
    return step * 10


def plot_frontier(plans, path, width=900, height=560):
    """The frontier as a PNG (Pillow): footprint (MiB) against predicted overhead (%)."""
    from PIL import Image, ImageDraw

    from .visualize import _font
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    left, right, top, bottom = 90, 30, 40, 70
    xs = [100 * plan.predicted_overhead for _, plan in plans]
    ys = [plan.footprint_bytes / 2**20 for _, plan in plans]
    x_step, y_step = _tick_step(max(max(xs), 1.0)), _tick_step(max(ys))
    x_high = x_step * math.ceil(max(max(xs), 1.0) * 1.02 / x_step)
    y_high = y_step * math.ceil(max(ys) * 1.02 / y_step)

    def at(x, y):
        return (left + (width - left - right) * x / x_high, height - bottom - (height - top - bottom) * y / y_high)
    font = _font(14)
    draw.line([at(0, 0), at(x_high, 0)], fill="black")
    draw.line([at(0, 0), at(0, y_high)], fill="black")
    for k in range(round(x_high / x_step) + 1):
        x = k * x_step
        draw.text((at(x, 0)[0] - 10, height - bottom + 6), f"{x:g}", fill="black", font=font)
    for k in range(round(y_high / y_step) + 1):
        y = k * y_step
        draw.text((8, at(0, y)[1] - 8), f"{y:,g}", fill="black", font=font)
    points = sorted(at(x, y) for x, y in zip(xs, ys))
    draw.line(points, fill=(192, 0, 0), width=2)
    for px, py in points:
        draw.ellipse([px - 4, py - 4, px + 4, py + 4], fill=(192, 0, 0))
    draw.text((left, 10), "footprint (MiB) against predicted step-time overhead (%)", fill="black", font=font)
    draw.text((width // 2 - 90, height - 30), "predicted overhead, %", fill="black", font=font)
    try:
        image.save(path)
    except OSError as exc:
        raise MinigistError(f"--plot: cannot write {path}: {exc.strerror or exc}") from None


def plan_only(path, options, args, out=print):
    """--plan-only --optimize: the plan that fits the budget (or the frontier without one),
    from the FLOP model (reference rates unless --measure-rates); returns the report (None
    for the frontier)."""
    from .memory.report import format_report, write_json
    cost = flop_model() if args.measure_rates else reference_model()
    optimizer = _optimizer(path, options, cost, args, out)
    if args.memory_budget is None:
        out("searching the smallest plan first (the last row; minutes on the ImageNet networks) ...")
        for line in FRONTIER_HEADER:
            out(line)
        plans = frontier(optimizer, each=lambda budget, plan: out(frontier_row(budget, plan)))
        out(f"cost model: {cost.describe()}; smallest plan: {dominated_by(plans[-1][1])}")
        if args.plot:
            plot_frontier(plans, args.plot)
            out(f"frontier: {args.plot}")
        return None
    plan = optimizer.fit(args.memory_budget)
    report = plan_report(path, plan.options)
    report["model"] = args.model
    report["optimizer"] = plan.to_json()
    report["memory_budget_bytes"] = args.memory_budget
    out(format_report(report))
    for line in plan_lines(plan):
        out(line)
    if args.report_json:
        write_json(report, args.report_json)
    if args.plot or args.trace:
        from .trainer import write_visuals
        write_visuals(args, plan.compiled.plan, report, out)
    return report


def profiled_model(model, options, batch, lossy, threads=None, out=print, fronts=(), updates=()):
    """The measured cost model of a training run: throwaway nets under the programs the
    optimizer chooses from (every stash kept; the lossless rules; under lossy modes DPR
    everywhere it applies, and the three again at SMALL_CHUNK_BYTES) and one that recomputes
    every stash (at both chunk sizes under lossy modes), and under each of `fronts` (--microbatch
    auto: (blob, samples)) and of `updates` (--update auto: "blocked") its `none` program, so
    that the fronts' steps and the blocked update's are timed too, each
    step timed on `batch`, and each program's own time kept. Falls back to the FLOP model where
    those nets do not fit this machine."""
    from .net import Net
    fallback = flop_model(seconds=0.25)     # for steps not profiled, scaled to the profiled ones
    base = options.replace(overrides=(), recompute=(), recompute_shared=(), budget=None, chunk_bytes=None)
    variants = [base.replace(gist="none"), base.replace(gist="lossless")]
    nets = []
    try:
        nets = [Net(model, threads=threads, plan=Settings(variant)) for variant in variants]
        if lossy:
            plain, lossless = nets[0].compiled["train"], nets[1].compiled["train"]
            dpr = lossy_overrides(plain.graph, plain.program, lossless.program, options.dpr)
            variants = [variants[0], variants[1], base.replace(gist="lossless", overrides=dpr)]
            nets.append(Net(model, threads=threads, plan=Settings(variants[2])))
            nets += [Net(model, threads=threads, plan=Settings(v.replace(chunk_bytes=SMALL_CHUNK_BYTES)))
                     for v in variants]
        # the smaller chunks' replays too under lossy modes
        chunked = [base.replace(chunk_bytes=SMALL_CHUNK_BYTES)] if lossy else []
        nets += _replaying_nets(model, [base] + chunked, nets[0], threads)
        nets += _front_nets(model, base, fronts, threads)
        nets += [Net(model, threads=threads, plan=Settings(base.replace(gist="none", update=update)))
                 for update in updates if update != base.update]
        seconds, own = profile_programs(nets, batch, repeats=PROFILE_REPEATS)
    except MinigistError as exc:
        out(f"cost model: FLOPs and bytes (the profiling run could not run here: {exc})")
        return fallback
    measured = MeasuredModel(seconds, fallback, len(nets), own)
    measured.calibrate([n.compiled["train"].program for n in nets])
    return measured


def _replaying_nets(model, bases, plain, threads):
    """For each of `bases`, a net that drops every stash of `plain` and rebuilds it (shared), so
    that replays and the decodes they need are timed as they run: a replay took 11% less than
    its forward step on inception_small (its inputs were just rebuilt). None where there is no
    stash, or where that program cannot be built here."""
    from .net import Net
    program = plain.compiled["train"].program
    stashed = tuple(sorted({b.tensor for b in program.buffers.values() if b.kind == "blob" and b.category == STASH}))
    if not stashed:
        return []
    nets = []
    for base in bases:
        try:
            nets.append(Net(model, threads=threads, plan=Settings(base.replace(gist="lossless", recompute=stashed,
                                                                                recompute_shared=stashed))))
        except MinigistError:
            pass
    return nets


def _front_nets(model, base, fronts, threads):
    """For each of the settings --microbatch auto makes of `fronts` (optimize.layouts: each
    front, and with the span behind it), a net of `base` under --gist none with that front and
    spans micro-batched (none where that program cannot be built here: the search leaves such a
    setting out)."""
    from .net import Net
    if not fronts:
        return []
    nets = []
    whole = compile(model, base.replace(gist="none", microbatch=(), spans=())).program
    for front, spans in layouts(whole, fronts):
        try:
            nets.append(Net(model, threads=threads, plan=Settings(base.replace(gist="none", microbatch=front,
                                                                               spans=spans))))
        except MinigistError:
            pass
    return nets


def fit_training_net(net, batch, args, out=print):
    """--optimize in a training run: after calibration, the plan that fits --memory-budget with
    the measured cost model, applied to `net` (re-planned; weights kept). Returns the plan."""
    if args.memory_budget is None:
        raise MinigistError("--optimize: a training run needs --memory-budget SIZE (without one, --plan-only "
                            "prints the frontier)")
    if net.comm is not None:
        raise MinigistError("--optimize plans one process's program, not a rank's share of a data-parallel batch")
    options = net.options.replace(budget=None)
    fronts = []
    if auto_front(args):
        fronts = front_candidates(compile(net.model, options.replace(gist="none", microbatch=())).program)
    update = None
    if auto_update(args) and args.gist == "lossless" and not (net.xp is np and net.blas_threads == 1):
        # a block's GEMM rounds as the same rows of the whole one only on one CPU BLAS thread
        threads = f"{net.blas_threads} BLAS threads" if net.xp is np else "the GPU"
        out(f"--update auto: the blocked update rounds apart from the fused one on {threads}; under --gist "
            f"lossless the fused update alone is planned (--threads 1 for both)")
        update = "fused"
    updates = ["blocked"] if auto_update(args) and update is None and makes_blocks(net.model, options) else []
    cost = profiled_model(net.model, net.options, batch, args.gist == "all", net.threads, out, fronts=fronts,
                          updates=updates)
    optimizer = _optimizer(net.model, options, cost, args, out, fronts, update)
    plan = optimizer.fit(args.memory_budget)
    net.apply_plan(plan)
    net.optimized = plan
    for line in plan_lines(plan):
        out(line)
    return plan


def restore_training_plan(net, record, out=print):
    """--resume of a run with --optimize: the checkpoint's plan (`record`, its choices) applied
    to `net` again, not a new fit: a new profiling run may time this machine otherwise, and
    under --gist all another choice of DPR or of batch chunks would change the arithmetic of
    the rest of the run (a resumed run ends with the weights of an uninterrupted one)."""
    plan = RecordedPlan(net.options, record)
    try:
        net.apply_plan(plan)
    except (KeyError, ValueError) as exc:
        raise MinigistError(f"--resume: the checkpoint's optimized plan does not apply to this model: {exc}") from None
    footprint = net.report()["footprint_with_evaluation_bytes"]
    out(f"optimizer: the checkpoint's plan ({choice_counts(plan)}), footprint {footprint:,} B ({_mib(footprint)}); "
        f"the fit chose it at {record.get('footprint_bytes', 0):,} B")
    return plan


def choice_counts(plan):
    """How many stashes a RecordedPlan recomputes, encodes and keeps in fp32, from its decisions (an
    fp32 stash is an override too, against the lossless rule's code: the overrides alone do
    not count encodings)."""
    choices = [decision["choice"] for decision in plan.decisions]
    recomputed = sum(choice.startswith("recompute") for choice in choices)
    kept = choices.count(KEEP)
    return f"{len(choices) - recomputed - kept} tensors encoded, {recomputed} recomputed, {kept} kept in fp32"
