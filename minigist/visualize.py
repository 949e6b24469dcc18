"""Pictures of a memory plan: a timeline PNG and a Chrome trace of buffer lifetimes.

    plot_timeline(net.plans["train"], net.report(), "memory.png")
    write_trace(net.plans["train"], net.report(), "memory.trace.json")

Both read the plan (its program's buffers with first_use / last_use, its storage groups and
their offsets) and agree with `memory.report.live_by_step`: at every step the stacked bytes of
the timeline add up to the live bytes the report's peak is taken from. A storage shared by an
in-place chain counts once, under the category of the member holding it at that step.

The stash is split by encoding when Gist encodes some of it: FP32 maps kept as they are,
encoded maps (category `encoded`, one series per encoding name: mask-1bit, fp16, ...) and the
decoded copies that live around their backward use. Nothing here needs matplotlib: the PNG is
drawn with Pillow.
"""
import json

import numpy as np

from .memory import align
from .memory.report import live_by_step
from .program import CATEGORIES, ENCODED, STASH

# one colour per category (RGB), in CATEGORIES order
COLOURS = {
    "weights": (68, 114, 196),
    "weight_grads": (112, 173, 255),
    "optimizer_state": (165, 200, 250),
    "input": (120, 120, 120),
    "stash": (237, 125, 49),
    "feature": (112, 173, 71),
    "gradient": (255, 192, 0),
    "workspace": (165, 105, 189),
    "encoded": (192, 0, 0),
    "communication": (0, 150, 136),
}
LABELS = {
    "weights": "weights",
    "weight_grads": "weight gradients",
    "optimizer_state": "optimizer state (momentum)",
    "input": "input (data, labels)",
    "stash": "stash (kept for backward)",
    "feature": "feature maps (not kept)",
    "gradient": "gradient maps",
    "workspace": "workspace",
    "encoded": "encoded stash (Gist)",
    "communication": "communication buckets",
}


# ---- series -------------------------------------------------------------------------------
def _encodings_of(plan, report):
    """{buffer name: encoding name} for the encoded buffers, and the set of decoded copies."""
    program = plan.program
    encoded, decoded = {}, set()
    for original, encoding in (getattr(program, "encodings", None) or {}).items():
        for name in getattr(encoding, "encoded", []) or []:
            encoded[name] = encoding.name
        if getattr(encoding, "decoded", ""):
            decoded.add(encoding.decoded)
    rows = {row["tensor"]: row["encoding"] for row in (report or {}).get("stash", [])}
    for name, buffer in program.buffers.items():
        if buffer.category == ENCODED and name not in encoded:
            encoded[name] = rows.get(buffer.tensor, str(buffer.dtype))
        if buffer.category == STASH and buffer.kind == "dec":
            decoded.add(name)
    return encoded, decoded


def series_key(buffer, encoded, decoded, split):
    """(category, encoding or None) of one buffer; the encoding only where the stash is split."""
    if not split or buffer.category not in (STASH, ENCODED):
        return buffer.category, None
    if buffer.name in decoded:
        return STASH, "decoded for backward"
    if buffer.category == ENCODED:
        return ENCODED, encoded.get(buffer.name, str(buffer.dtype))
    return STASH, "fp32" if buffer.dtype == np.float32 else str(buffer.dtype)


def live_series(plan, report=None):
    """(keys, matrix): keys are (category, encoding) pairs in report order, matrix[k, step] the
    aligned bytes of series k live at that step. Rows sum to `live_by_step(plan)`."""
    program = plan.program
    buffers = program.buffers
    steps = max(len(program.steps), 1)
    encoded, decoded = _encodings_of(plan, report)
    encodings = {series_key(b, encoded, decoded, True)[1] for b in buffers.values()
                 if b.category in (STASH, ENCODED)}
    split = bool(encoded) or any(e not in (None, "fp32") for e in encodings)
    deltas = {}

    def add(key, start, stop, nbytes):
        row = deltas.setdefault(key, np.zeros(steps + 1, dtype=np.int64))
        row[start] += nbytes
        row[stop + 1] -= nbytes

    persistent_total = 0
    for buffer in buffers.values():
        if buffer.persistent:
            nbytes = align(buffer.nbytes, plan.alignment)
            persistent_total += nbytes
            add(series_key(buffer, encoded, decoded, split), 0, steps - 1, nbytes)
    if persistent_total != plan.persistent_bytes:     # keep the totals equal to the report's
        add((CATEGORIES[0], None), 0, steps - 1, plan.persistent_bytes - persistent_total)
    for group in plan.groups:
        nbytes = align(group.nbytes, plan.alignment)
        members = sorted(group.members, key=lambda n: (buffers[n].first_use, buffers[n].last_use))
        # the member holding the storage: the newest one started (as the report counts it)
        for index, name in enumerate(members):
            start = max(buffers[name].first_use, group.first_use)
            stop = group.last_use if index + 1 == len(members) else buffers[members[index + 1]].first_use - 1
            if stop >= start:
                add(series_key(buffers[name], encoded, decoded, split), start, stop, nbytes)
    order = {c: i for i, c in enumerate(CATEGORIES)}
    keys = sorted(deltas, key=lambda k: (order.get(k[0], len(order)), k[1] != "fp32", k[1] or ""))
    matrix = np.stack([np.cumsum(deltas[k])[:steps] for k in keys]) if keys else np.zeros((0, steps), np.int64)
    return keys, matrix


def series_label(key):
    category, encoding = key
    if encoding is None:
        return LABELS.get(category, category)
    if category == ENCODED:
        return f"encoded: {encoding}"
    return f"stash: {encoding}"


# the encodings of one category get distinct hues of the category's family
SHADES = {
    "encoded": [(192, 0, 0), (255, 105, 180), (110, 0, 40), (250, 150, 110), (150, 75, 20), (200, 0, 200)],
    "stash": [(237, 125, 49), (150, 90, 40), (250, 200, 120), (190, 80, 0)],
}


def series_colour(key, index_in_category):
    base = COLOURS.get(key[0], (90, 90, 90))
    if key[0] in SHADES:
        shades = SHADES[key[0]]
        if index_in_category < len(shades):
            return shades[index_in_category]
    if index_in_category == 0:
        return base
    # lighter / darker shades for the other encodings of the same category
    factor = [1.0, 0.7, 1.35, 0.5, 1.6, 0.85][index_in_category % 6]
    return tuple(int(max(0, min(255, c * factor if factor < 1 else c + (255 - c) * (factor - 1)))) for c in base)


# ---- the PNG ------------------------------------------------------------------------------
def _unit(nbytes):
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return name, size
    return "B", 1


def _nice_step(span, target):
    raw = span / max(target, 1)
    magnitude = 10 ** np.floor(np.log10(raw)) if raw > 0 else 1
    for factor in (1, 2, 2.5, 5, 10):
        if factor * magnitude >= raw:
            return factor * magnitude
    return 10 * magnitude


def _font(size):
    from PIL import ImageFont
    try:
        return ImageFont.load_default(size=size)
    except TypeError:       # Pillow < 10.1: the bitmap font only
        return ImageFont.load_default()


def _human(nbytes):
    unit, size = _unit(nbytes)
    return f"{nbytes / size:,.1f} {unit}" if size > 1 else f"{nbytes:,} B"


def _separate_update_starts(program):
    """The step where the updates start when they run as one block after the backward pass
    (the separate update), else None (a fused update runs each inside the backward pass)."""
    kinds = [step.kind for step in program.steps]
    first = next((i for i, k in enumerate(kinds) if k == "update"), None)
    return first if first is not None and all(k == "update" for k in kinds[first:]) else None


def plot_timeline(plan, report, path, width=1400, height=760):
    """Stacked areas of bytes live by category over the steps of `plan`'s program."""
    from PIL import Image, ImageDraw
    keys, matrix = live_series(plan, report)
    program = plan.program
    steps = matrix.shape[1]
    totals = matrix.sum(axis=0) if len(keys) else np.zeros(steps, np.int64)
    footprint = int(report.get("footprint_bytes", plan.footprint_bytes)) if report else int(plan.footprint_bytes)
    peak_step = int(np.argmax(totals)) if steps else 0
    peak = int(totals[peak_step]) if steps else 0

    left, right, top, bottom = 100, 360, 64, 78
    pw, ph = width - left - right, height - top - bottom
    image = Image.new("RGB", (width, height), "white")
    pixels = np.asarray(image).copy()

    unit, unit_size = _unit(max(footprint, peak, 1))
    ymax_units = max(footprint, peak, 1) / unit_size * 1.08
    ytick = _nice_step(ymax_units, 8)
    ymax_units = np.ceil(ymax_units / ytick) * ytick
    scale = ph / (ymax_units * unit_size)

    def x_of(step):
        return left + step * pw / max(steps, 1)

    def y_of(nbytes):
        return top + ph - nbytes * scale

    # columns: each pixel shows the step with the most bytes among those it covers
    in_category = {}
    colours = []
    for key in keys:
        index = in_category.get(key[0], 0)
        in_category[key[0]] = index + 1
        colours.append(np.array(series_colour(key, index), dtype=np.uint8))
    for column in range(pw):
        first = int(column * steps / pw)
        last = max(first + 1, int((column + 1) * steps / pw))
        span = totals[first:last]
        if not len(span):
            continue
        step = first + int(np.argmax(span))
        base = 0
        for k in range(len(keys)):
            value = int(matrix[k, step])
            if value <= 0:
                continue
            y0 = int(round(y_of(base)))
            y1 = int(round(y_of(base + value)))
            if y0 > y1:
                pixels[y1:y0, left + column] = colours[k]
            base += value
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    font, small, big = _font(14), _font(12), _font(17)

    # axes, grid and ticks
    grey, dark = (225, 225, 225), (40, 40, 40)
    value = 0.0
    while value <= ymax_units + 1e-9:
        y = y_of(value * unit_size)
        draw.line([(left, y), (left + pw, y)], fill=grey)
        draw.line([(left - 5, y), (left, y)], fill=dark)
        label = f"{value:g}"
        draw.text((left - 9, y), label, fill=dark, font=small, anchor="rm")
        value += ytick
    xtick = max(1, int(_nice_step(max(steps, 1), 10)))
    for step in range(0, steps + 1, xtick):
        x = x_of(step)
        draw.line([(x, top + ph), (x, top + ph + 5)], fill=dark)
        draw.text((x, top + ph + 8), str(step), fill=dark, font=small, anchor="mt")
    draw.rectangle([left, top, left + pw, top + ph], outline=dark)
    steps_are = ("program step (forward, backward, update)" if _separate_update_starts(program) is not None
                 else "program step (forward, backward with fused updates)")
    draw.text((left + pw / 2, height - 30), steps_are, fill=dark, font=font,
              anchor="mm")
    ylabel = Image.new("RGB", (ph, 22), "white")
    ImageDraw.Draw(ylabel).text((ph / 2, 11), f"bytes live ({unit})", fill=dark, font=font, anchor="mm")
    image.paste(ylabel.rotate(90, expand=True), (14, top))

    # phases: first backward step, first update step
    kinds = [step.kind for step in program.steps]
    marks = []
    first_backward = next((i for i, k in enumerate(kinds) if k not in ("forward", "encode")), None)
    if first_backward:
        marks.append((first_backward, "backward"))
    # an update phase only where the updates run as one block after the backward pass (the
    # separate update); a fused update runs each one inside the backward pass, no phase of its own
    first_update = _separate_update_starts(program)
    if first_update is not None:
        marks.append((first_update, "update"))
    draw.text((left + 6, top + 6), "forward", fill=dark, font=small)
    label_right = left
    for step, label in marks:
        x = x_of(step)
        for y in range(top, top + ph, 8):
            draw.line([(x, y), (x, min(y + 4, top + ph))], fill=(90, 90, 90))
        row = 1 if x + 5 < label_right + 6 else 0      # the next row down where the previous label runs on
        draw.text((x + 5, top + 6 + 14 * row), label, fill=dark, font=small)
        label_right = max(label_right, draw.textbbox((x + 5, top + 6), label, font=small)[2])

    # footprint (the arena) and the peak
    yf = y_of(footprint)
    for x in range(left, left + pw, 10):
        draw.line([(x, yf), (min(x + 6, left + pw), yf)], fill=(200, 0, 0), width=2)
    # the peak's label runs away from the middle; the footprint's sits at the other end
    xp_ = x_of(peak_step + 0.5)
    peak_right = xp_ < left + pw * 0.6
    text = f"footprint ({report.get('alloc', plan.mode) if report else plan.mode}) {_human(footprint)}"
    if peak_right:
        draw.text((left + 60, yf - 4), text, fill=(200, 0, 0), font=font, anchor="lb")
    else:
        draw.text((left + pw - 4, yf - 4), text, fill=(200, 0, 0), font=font, anchor="rb")
    if steps:
        yp = y_of(peak)
        draw.polygon([(xp_, yp - 2), (xp_ - 7, yp - 14), (xp_ + 7, yp - 14)], fill=(0, 0, 0))
        label = program.steps[peak_step].label if program.steps else ""
        text = f"peak {_human(peak)} at step {peak_step} ({label})"
        anchor = "lb" if peak_right else "rb"
        where = (xp_ + (10 if peak_right else -10), yp - 16)
        box = draw.textbbox(where, text, font=font, anchor=anchor)   # on white: the phase lines stop at it
        draw.rectangle([box[0] - 3, box[1] - 2, box[2] + 3, box[3] + 2], fill=(255, 255, 255))
        draw.text(where, text, fill=(0, 0, 0), font=font, anchor=anchor)

    # title
    model = (report or {}).get("model", "") or "model"
    shape = "x".join(str(d) for d in (report or {}).get("input_shape", []))
    gist_config = (report or {}).get("gist") or {}
    gist = gist_config.get("mode")
    if gist in ("lossy", "all") and gist_config.get("dpr"):
        gist = f"{gist} ({gist_config['dpr']})"
    engine = (report or {}).get("conv")
    title = (f"{model}: training memory by category, batch {(report or {}).get('batch_size', '?')}, input {shape}, "
             f"alloc {plan.mode}" + (f", gist {gist}" if gist else "") + (f", conv {engine}" if engine else ""))
    draw.text((left, 22), title, fill=dark, font=big, anchor="lm")
    draw.text((left, 44), f"{steps} steps; stacked bytes live at each step (aligned to {plan.alignment} B)",
              fill=(90, 90, 90), font=small, anchor="lm")

    # legend: every series with its bytes at the peak
    lx, ly = left + pw + 24, top
    draw.text((lx, ly), "category (bytes at the peak)", fill=dark, font=font)
    ly += 26
    for k in reversed(range(len(keys))):
        if not matrix[k].any():
            continue
        draw.rectangle([lx, ly, lx + 16, ly + 14], fill=tuple(int(c) for c in colours[k]), outline=dark)
        draw.text((lx + 24, ly + 7), series_label(keys[k]), fill=dark, font=small, anchor="lm")
        draw.text((width - 12, ly + 7), _human(int(matrix[k, peak_step])), fill=dark, font=small, anchor="rm")
        ly += 22
    ly += 8
    draw.line([(lx, ly), (width - 12, ly)], fill=dark)
    draw.text((lx + 24, ly + 12), "live at the peak", fill=dark, font=small, anchor="lm")
    draw.text((width - 12, ly + 12), _human(peak), fill=dark, font=small, anchor="rm")
    draw.text((lx + 24, ly + 32), "footprint", fill=(200, 0, 0), font=small, anchor="lm")
    draw.text((width - 12, ly + 32), _human(footprint), fill=(200, 0, 0), font=small, anchor="rm")
    image.save(path, format="PNG")
    return path


# ---- the trace ----------------------------------------------------------------------------
def _lanes(intervals):
    """Lane per interval (start, stop, index) so that within a lane intervals are disjoint or
    nested, which is what trace viewers need to draw complete events on one thread."""
    lanes = []              # per lane: stack of open intervals' stops
    result = {}
    for start, stop, index in sorted(intervals, key=lambda item: (item[0], -item[1])):
        for lane, stack in enumerate(lanes):
            while stack and stack[-1] < start:
                stack.pop()
            if not stack or stack[-1] >= stop:
                stack.append(stop)
                result[index] = lane
                break
        else:
            lanes.append([stop])
            result[index] = len(lanes) - 1
    return result


def trace_events(plan, report=None):
    """The trace as a dict: one complete event ("ph": "X") per buffer, with ts = its first
    step and dur = the steps it lives (1 us = 1 step), on one thread per category (more
    threads where lifetimes overlap without nesting); counter events of the bytes live by
    category; metadata naming the process and threads."""
    program = plan.program
    buffers = program.buffers
    encoded, decoded = _encodings_of(plan, report)
    pid = 1
    model = (report or {}).get("model", "") or "model"
    events = [{"ph": "M", "pid": pid, "tid": 0, "name": "process_name",
               "args": {"name": f"{model} training program ({plan.mode})"}}]
    by_category = {}
    for name, buffer in buffers.items():
        by_category.setdefault(buffer.category, []).append(name)
    tid_base = 1
    for order, category in enumerate(list(CATEGORIES) + sorted(set(by_category) - set(CATEGORIES))):
        names = by_category.get(category, [])
        if not names:
            continue
        intervals = [(buffers[n].first_use, buffers[n].last_use, i) for i, n in enumerate(names)]
        lanes = _lanes(intervals)
        count = max(lanes.values()) + 1
        for lane in range(count):
            tid = tid_base + lane
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                           "args": {"name": category if lane == 0 else f"{category} ({lane + 1})"}})
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                           "args": {"sort_index": tid}})
        for i, name in enumerate(names):
            buffer = buffers[name]
            if buffer.persistent:
                offset = plan.persistent_offsets.get(name)
                group = None
            else:
                group = plan.group_of.get(name)
                offset = plan.persistent_bytes + plan.groups[group].offset if group is not None else None
            args = {"bytes": buffer.nbytes, "aligned_bytes": align(buffer.nbytes, plan.alignment),
                    "offset": offset, "shape": list(buffer.shape), "dtype": str(np.dtype(buffer.dtype)),
                    "layer": buffer.layer, "first_step": buffer.first_use, "last_step": buffer.last_use,
                    "first_step_label": program.steps[buffer.first_use].label if program.steps else "",
                    "last_step_label": program.steps[buffer.last_use].label if program.steps else ""}
            if group is not None:
                args["storage_group"] = group
                args["storage_bytes"] = align(plan.groups[group].nbytes, plan.alignment)
            key = series_key(buffer, encoded, decoded, True)
            if buffer.category in (STASH, ENCODED):
                args["encoding"] = key[1]
            events.append({"ph": "X", "pid": pid, "tid": tid_base + lanes[i], "name": name, "cat": category,
                           "ts": buffer.first_use, "dur": buffer.last_use - buffer.first_use + 1, "args": args})
        tid_base += count
    keys, matrix = live_series(plan, report)
    labels = [series_label(k) for k in keys]
    for step in range(matrix.shape[1]):
        events.append({"ph": "C", "pid": pid, "tid": 0, "name": "bytes live", "ts": step,
                       "args": {labels[k]: int(matrix[k, step]) for k in range(len(keys))}})
    other = {"model": model, "alloc": plan.mode, "steps": len(program.steps),
             "time_unit": "1 us = 1 program step", "footprint_bytes": int(plan.footprint_bytes),
             "live_peak_bytes": int(live_by_step(plan).max()) if program.steps else int(plan.persistent_bytes)}
    if report:
        for field in ("batch_size", "input_shape", "footprint_bytes"):
            if field in report:
                other[field] = report[field]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_trace(plan, report, path):
    trace = trace_events(plan, report)
    with open(path, "w", encoding="utf-8") as out:
        json.dump(trace, out, separators=(",", ":"))
        out.write("\n")
    return path
