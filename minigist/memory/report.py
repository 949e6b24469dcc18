"""The footprint report: the same form under every allocation mode.

`footprint_report(plan, ...)` returns a plain dict (JSON-ready); `format_report` prints it as
a table. All byte counts are exact integers: sizes are rounded up to the 256-byte alignment
that the arena and the pool use, except the `raw_bytes` of stash rows.
"""
import json

import numpy as np

from ..program import CATEGORIES, STASH, stash_key
from . import align

FIELDS = ("model", "batch_size", "input_shape", "alloc", "footprint_bytes", "live_peak_bytes",
          "parameters", "peak_by_category", "total_by_category", "forward_peak_bytes",
          "backward_peak_bytes", "stash")


def _live_member(plan, group, step):
    """The member of `group` that holds its storage at `step` (the newest one started)."""
    buffers = plan.program.buffers
    best = None
    for name in group.members:
        buffer = buffers[name]
        if buffer.first_use <= step <= buffer.last_use and (best is None or buffer.first_use >= buffers[best].first_use):
            best = name
    return best


def live_by_step(plan):
    """Aligned bytes live at each step, persistent included."""
    steps = len(plan.program.steps)
    delta = np.zeros(steps + 1, dtype=np.int64)
    for group in plan.groups:
        size = align(group.nbytes, plan.alignment)
        delta[group.first_use] += size
        delta[group.last_use + 1] -= size
    return np.cumsum(delta[:steps]) + plan.persistent_bytes


def stash_rows(plan):
    """One row per tensor kept for the backward pass: as it is (fp32) or encoded by Gist."""
    program, rows = plan.program, []
    buffers = program.buffers
    for name, buffer in buffers.items():
        encoding = program.encodings.get(name)
        if encoding is None and (buffer.category != STASH or buffer.kind == "dec"):
            continue
        # a micro-batch's part of a tensor (passes/microbatch.py: a span's stashes) is a row of its own
        row = {"layer": buffer.layer, "tensor": stash_key(buffer), "shape": list(buffer.shape),
               "encoding": "fp32" if buffer.dtype == np.float32 else str(buffer.dtype),
               "raw_bytes": buffer.nbytes, "stored_bytes": align(buffer.nbytes, plan.alignment),
               "first_use": buffer.first_use, "last_use": buffer.last_use}
        if encoding is not None:
            parts = [buffers[n] for n in encoding.encoded]
            row["encoding"] = encoding.name
            row["stored_bytes"] = sum(align(b.nbytes, plan.alignment) for b in parts)
            if parts:
                row["first_use"] = min(b.first_use for b in parts)
                row["last_use"] = max(b.last_use for b in parts)
        rows.append(row)
    return rows


def footprint_report(plan, model="", parameters=0, extra=None):
    program = plan.program
    graph = program.graph
    buffers = program.buffers
    live = live_by_step(plan)
    peak_step = int(np.argmax(live)) if len(live) else 0
    # the backward phase starts at the loss seed (encode steps still belong to the forward)
    first_backward = next((i for i, s in enumerate(program.steps) if s.kind not in ("forward", "encode")),
                          len(program.steps))

    peak_by_category = {c: 0 for c in CATEGORIES}
    for buffer in buffers.values():
        if buffer.persistent:
            peak_by_category[buffer.category] += align(buffer.nbytes, plan.alignment)
    for group in plan.groups:
        if group.first_use <= peak_step <= group.last_use:
            member = buffers[_live_member(plan, group, peak_step)]
            peak_by_category[member.category] += align(group.nbytes, plan.alignment)
    total_by_category = {c: 0 for c in CATEGORIES}
    for buffer in buffers.values():
        total_by_category[buffer.category] += align(buffer.nbytes, plan.alignment)

    stash = stash_rows(plan)
    stash_by_encoding = {}
    for row in stash:
        stash_by_encoding[row["encoding"]] = stash_by_encoding.get(row["encoding"], 0) + row["stored_bytes"]

    by_layer = {}
    for buffer in buffers.values():
        row = by_layer.setdefault(buffer.layer or "(net)", {})
        row[buffer.category] = row.get(buffer.category, 0) + align(buffer.nbytes, plan.alignment)

    report = {
        "model": model,
        "batch_size": graph.batch_size,
        "input_shape": list(graph.input_shape),
        "alloc": plan.mode,
        "footprint_bytes": int(plan.footprint_bytes),
        "live_peak_bytes": int(live.max()) if len(live) else plan.persistent_bytes,
        "lower_bound_bytes": int(plan.live_peak_bytes),
        "parameters": int(parameters),
        "peak_step": peak_step,
        "peak_step_label": program.steps[peak_step].label if program.steps else "",
        "peak_by_category": peak_by_category,
        "total_by_category": total_by_category,
        "forward_peak_bytes": int(live[:first_backward].max()) if first_backward else 0,
        "backward_peak_bytes": int(live[first_backward:].max()) if first_backward < len(live) else 0,
        "persistent_bytes": int(plan.persistent_bytes),
        "steps": len(program.steps),
        "buffers": len(buffers),
        "stash": stash,
        "stash_by_encoding": stash_by_encoding,
        "by_layer": by_layer,
    }
    # a plan without a loss seed has no backward: say so rather than show "backward peak 0 B"
    report["forward_only"] = not any(step.kind == "seed" for step in program.steps)
    if report["forward_only"]:
        report["forward_only_reason"] = ("no loss layer" if not graph.loss_weights else
                                         "no loss depends on a trained parameter")
    if plan.pool is not None:
        report["pool"] = {"high_water_bytes": int(plan.pool.high_water),
                          "live_peak_bytes": int(plan.pool.peak_in_use),
                          "fragmentation_bytes": int(plan.pool.fragmentation),
                          "mallocs": plan.pool.mallocs}
    if getattr(program, "distributed", None) is not None:
        report["distributed"] = program.distributed.report(plan)
    if extra:
        report.update(extra)
    return report


def _mib(nbytes):
    return f"{nbytes / 2**20:,.1f} MiB"


def format_report(report):
    """The report as a short printed table."""
    engine = f"  conv {report['conv']}" if report.get("conv") else ""   # the engine the plan was made for
    lines = [f"memory: {report['model']}  batch {report['batch_size']}  input {tuple(report['input_shape'])}  "
             f"alloc {report['alloc']}{engine}"]
    if report.get("forward_only"):
        lines.append(f"  forward only: {report['forward_only_reason']}, so nothing is trained and this is an "
                     f"inference plan (add_loss=True, train.py --add-loss, appends a SoftmaxWithLoss)")
    if report.get("added_loss"):
        lines.append(f"  added loss: {report['added_loss']}")
    if report.get("distributed"):
        spread = report["distributed"]
        buckets = spread["buckets"]
        lines.append(f"  one of {spread['ranks']} ranks (batch {report['batch_size']} each), shard {spread['shard']}: "
                     f"{len(buckets)} buckets of at most {spread['bucket_bytes']:,} B (largest "
                     f"{max((b['bytes'] for b in buckets), default=0):,} B); the figures below are per rank")
    if report.get("footprint_with_evaluation_bytes", 0) > report["footprint_bytes"]:
        evaluation = report["evaluation"]
        lines.append(f"  evaluation at batch {evaluation['batch_size']} needs more than training: "
                     f"{report['footprint_with_evaluation_bytes']:,} B "
                     f"({_mib(report['footprint_with_evaluation_bytes'])}) with it")
    lines += [f"  footprint        {report['footprint_bytes']:>16,} B  ({_mib(report['footprint_bytes'])})",
             f"  live peak        {report['live_peak_bytes']:>16,} B  at step {report['peak_step']} "
             f"({report['peak_step_label']})",
             f"  forward peak     {report['forward_peak_bytes']:>16,} B",
             f"  backward peak    {report['backward_peak_bytes']:>16,} B"]
    if report.get("memory_budget_bytes") is not None:
        budget = report["memory_budget_bytes"]
        # the budget holds the evaluation plan too (net.py), where it needs more
        spare = budget - max(report["footprint_bytes"], report.get("footprint_with_evaluation_bytes", 0))
        lines.append(f"  memory budget    {budget:>16,} B  ({_mib(budget)}), "
                     + (f"{spare:,} B to spare" if spare >= 0 else f"exceeded by {-spare:,} B"))
    if "pool" in report:
        pool = report["pool"]
        lines.append(f"  pool high water  {pool['high_water_bytes']:>16,} B  fragmentation "
                     f"{pool['fragmentation_bytes']:,} B")
    lines.append("  category            at peak           total (no sharing)")
    for category, total in report["total_by_category"].items():
        if total:
            lines.append(f"  {category:<16} {report['peak_by_category'][category]:>14,} B  {total:>16,} B")
    stashed = sum(row["stored_bytes"] for row in report["stash"])
    raw = sum(row["raw_bytes"] for row in report["stash"])
    lines.append(f"  stash: {len(report['stash'])} tensors, {raw:,} B as fp32, {stashed:,} B stored")
    for encoding, nbytes in sorted(report["stash_by_encoding"].items(), key=lambda item: -item[1]):
        count = sum(1 for row in report["stash"] if row["encoding"] == encoding)
        lines.append(f"    {encoding:<15} {count:4d} tensors {nbytes:>16,} B")
    return "\n".join(lines)


def write_json(report, path):
    with open(path, "w", encoding="utf-8") as out:
        json.dump(report, out, indent=1)
        out.write("\n")
