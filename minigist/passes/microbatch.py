"""Micro-batching the front of the net: a pass that runs the layers from the net's input
through one blob a few samples at a time, in the forward pass and again in the backward pass,
so that no feature map, stash or gradient of the front is ever whole.

Reads: a training program from passes/recompute.py (before Gist's), `through` (a blob id: the
front's last top), `samples` (the micro-batch), and `clones`, the graph of the same model file
set up for a batch of `samples` (pipeline.compile builds it): its layers run the micro-batches,
with their workspaces. Layers' facts: `microbatchable`.
Provides: a new program where
- the forward steps of the front (every layer before `through`'s producer, and it) run once per
  micro-batch, in order: a step's args "samples" (first, end) and "whole" (the names of the
  batch-sized buffers it reads or writes: the net's input, `through`) tell the executor to hand
  it rows first:end of those; every other tensor of the front is a buffer of its own per
  micro-batch, of `samples` rows, freed when the micro-batch is done with it;
- where the backward reaches the front, per micro-batch, the front's forward is re-run
  ("recompute" steps: Replay ops) into buffers of that micro-batch, then the front's backward
  steps run on them, reading rows of `through`'s gradient; from the second micro-batch on they
  add into the parameter gradients (args "accumulate");
- the update steps of the front's layers come after the last micro-batch;
- a net input that only the front reads (the images) is never whole in the arena: before each
  micro-batch's forward, and again before its replays, a Feed op (a step of the data layer)
  copies that micro-batch's rows of the run's batch into a buffer of its own, as the executor
  copies a whole input before the first step. Re-reading the rows is the data layer's
  recomputation: its forward is a copy, and the batch is the caller's, on the host.
Liveness is recomputed; the rest of the program is left as it is.

Exactness: every layer of the front computes each sample alone, and its micro-batch is a whole
number of a convolution's batch chunks (its weight gradient is added chunk by chunk, in the
order of the whole batch; a 1x1 convolution adds it a sample at a time, so any micro-batch
will do there), so the forward writes the same bits, the backward the same gradients.
Costs: the front's forward runs twice, and the convolutions' bias gradients are summed a
sample at a time.

A span (apply_span) is the same loop over a cut of the net past the front, from blob `start`
(exclusive) through `through`, with no replay: its forward runs a micro-batch at a time as the
front's does, each micro-batch's stashes stay buffers of that micro-batch (category stash, their
`micro` tag naming it) until its backward. The backward runs a micro-batch at a time where the
span's backward starts, each reading the stashes its own forward kept and rows of `through`'s
gradient, and writing rows of `start`'s gradient. A span from the front's last top at the
front's micro-batch joins the front's backward loop instead (_Builder.join_front): each
micro-batch's backward of the span runs right after the front's replays of that micro-batch and
reads their copy of `start`, which then needs no stash. A span from the net's input feeds its
rows as the front does.

Order: after recomputation, which may not touch the front (its tensors are rebuilt here), and
before Gist, which then sees only `through` of the front, written by several steps, and
encodes it after the last.
"""
from dataclasses import replace

import numpy as np

from ..errors import MinigistError
from ..program import FEATURE, GRADIENT, INPUT, STASH, WORKSPACE, Buffer, Program, Step, names_in, of_micro, renamed_in
from .recompute import Replay

# roles whose buffers a step reads or writes a sample per row (parameters are whole)
_BATCH_ROLES = ("x", "y", "gy", "gx")


class Feed:
    """A micro-batch's rows of the net's input `top`, copied from the batch of the run (as the
    executor feeds a whole input before the first step) into the micro-batch's own buffer."""
    needs = ("feeding",)

    def __init__(self, top):
        self.top = top

    def bind(self, step, arrays, xp, stats, feeding):
        target, rows, name = arrays[step.args["y"][0]], step.args["samples"], f"blob:{self.top}"
        return lambda: feeding.feed({name: target}, rows)


def check_samples(samples, batch, flag="--microbatch"):
    """A one-line MinigistError (naming `flag`) unless a micro-batch of `samples` divides
    `batch` and is smaller."""
    if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or not 0 < samples < batch \
            or batch % samples:
        raise MinigistError(f"{flag}: a micro-batch of {samples!r} samples must divide the batch "
                            f"of {batch} and be smaller")


def check_front(program, through, samples):
    """The graph indices of the front through blob `through` (every layer up to its producer
    but the data layers) when `program` (before Gist) may run it `samples` samples at a time;
    a one-line MinigistError naming --microbatch when it may not."""
    graph = program.graph
    blob = graph.blobs.get(through)
    if blob is None:
        raise MinigistError(f"--microbatch: '{through}' is no top of this net")
    front = [i for i in range(blob.producer + 1) if not graph.nodes[i].layer.is_data]
    if not front:
        raise MinigistError(f"--microbatch: '{through}' is the net's input; the front must hold a layer")
    check_samples(samples, graph.batch_size)
    inside = set(front)
    for i in front:
        node = graph.nodes[i]
        layer = node.layer
        _check_microbatchable(layer, samples, "--microbatch", f"the front through '{through}'")
        for top in node.tops:
            outside = [graph.nodes[c].layer.name for c, _ in graph.blobs[top].consumers if c not in inside]
            if top != through and outside:
                raise MinigistError(f"--microbatch: '{top}' is read past the front through '{through}' "
                                    f"(by '{outside[0]}')")
    names = {graph.nodes[i].layer.name for i in front}
    recomputed = [s.layer.name for s in program.steps if s.kind == "recompute" and s.layer.name in names]
    if recomputed or f"blob:{through}" in program.encodings:
        raise MinigistError(f"--microbatch: the front through '{through}' may not be recomputed "
                            f"(its tensors are rebuilt a micro-batch at a time)")
    return front


def front_candidates(program):
    """The fronts `--microbatch auto` lets the optimizer choose among, as (blob, samples): the
    top of each pooling layer that check_front accepts, in the net's order, with the smallest
    micro-batch it accepts there. Pooling tops: a pool shrinks its input, so the whole-batch
    tensors a front leaves (its last top and that top's gradient) are smallest just past one.
    The smallest micro-batch: a convolution's micro-batch is a whole number of its batch
    chunks, so each runs the GEMMs of the whole batch's chunks either way, while the front's
    buffers grow with the samples. The search stops at the first layer no front may hold."""
    graph = program.graph
    found = []
    for node in graph.nodes:
        layer = node.layer
        if not layer.is_data and not layer.microbatchable:
            break
        if layer.type != "Pooling":
            continue
        for samples in range(1, graph.batch_size):
            if graph.batch_size % samples:
                continue
            try:
                check_front(program, node.tops[0], samples)
            except MinigistError:
                continue
            found.append((node.tops[0], samples))
            break
    return found


def span_after(program, start):
    """The span `--microbatch auto` offers behind a front through blob `start`, as (start,
    through, samples): through the top of the next pooling layer (its gradient and top, whole,
    are small), at the smallest micro-batch check_span accepts; None where check_span accepts
    none (a layer on the way that cannot run a micro-batch at a time, a branch)."""
    graph = program.graph
    through = None
    for node in graph.nodes[graph.blobs[start].producer + 1:]:
        if not node.layer.microbatchable:
            return None
        if node.layer.type == "Pooling":
            through = node.tops[0]
            break
    if through is None:
        return None
    for samples in range(1, graph.batch_size):
        if graph.batch_size % samples:
            continue
        try:
            check_span(program, start, through, samples)
        except MinigistError:
            continue
        return (start, through, samples)
    return None


def apply_microbatch(program, through, samples, clones):
    """The program with the front through blob `through` run `samples` samples at a time (see
    the module docstring); `program` itself is left unchanged. A one-line MinigistError
    (naming --microbatch) when it cannot be."""
    return _Builder(program, through, samples, clones, check_front(program, through, samples)).build()


def check_span(program, start, through, samples):
    """The graph indices of the span after blob `start` through blob `through` (the layers
    after `start`'s producer up to `through`'s) when `program` (before Gist, after the front's
    pass) may run it `samples` samples at a time keeping its stashes; a one-line MinigistError
    naming --microbatch-span when it may not. The span is a cut of the net: it reads `start`
    alone of what comes before it (and `start` is read by nothing else), and nothing after it
    reads any of its tops but `through`."""
    graph = program.graph
    flag = "--microbatch-span"
    for blob in (start, through):
        if blob not in graph.blobs:
            raise MinigistError(f"{flag}: '{blob}' is no top of this net")
    first, last = graph.blobs[start].producer, graph.blobs[through].producer
    if last <= first:
        raise MinigistError(f"{flag}: '{through}' is not made after '{start}'")
    span = [i for i in range(first + 1, last + 1) if not graph.nodes[i].layer.is_data]
    check_samples(samples, graph.batch_size, flag)
    inside = set(span)
    tops = {t for i in span for t in graph.nodes[i].tops}
    outside = [graph.nodes[c].layer.name for c, _ in graph.blobs[start].consumers if c not in inside]
    if outside:
        raise MinigistError(f"{flag}: '{start}' is read outside the span (by '{outside[0]}')")
    for i in span:
        node = graph.nodes[i]
        layer = node.layer
        _check_microbatchable(layer, samples, flag, f"the span after '{start}' through '{through}'")
        for bottom in node.bottoms:
            if bottom != start and bottom not in tops:
                raise MinigistError(f"{flag}: '{layer.name}' reads '{bottom}', which the span after '{start}' "
                                    f"does not make")
        for top in node.tops:
            outside = [graph.nodes[c].layer.name for c, _ in graph.blobs[top].consumers if c not in inside]
            if top != through and outside:
                raise MinigistError(f"{flag}: '{top}' is read past the span through '{through}' (by '{outside[0]}')")
    names = {graph.nodes[i].layer.name for i in span}
    if any(s.layer is not None and s.layer.name in names and ("samples" in s.args or s.kind == "recompute")
           for s in program.steps) or any(f"blob:{top}" in program.encodings for top in tops):
        raise MinigistError(f"{flag}: the span after '{start}' overlaps the front or a recomputation")
    return span


def _check_microbatchable(layer, samples, flag, what):
    """A one-line MinigistError unless `layer` may run `samples` samples at a time as the
    whole batch would, bit for bit."""
    if layer.type == "Convolution" and layer.engine != "im2col":
        raise MinigistError(f"{flag}: '{layer.name}' runs on the {layer.engine} engine, which does not "
                            f"add a weight gradient into one a chunk at a time; use --conv im2col")
    if not layer.microbatchable:
        raise MinigistError(f"{flag}: '{layer.name}' ({layer.type}) cannot run a micro-batch at a "
                            f"time; {what} must hold only convolutions (im2col), ReLU, pooling and LRN")
    chunk = layer.conv_engine().sum_grain() if layer.type == "Convolution" else 1
    if samples % chunk:
        raise MinigistError(f"{flag}: {samples} samples are no whole number of the batch chunks of "
                            f"'{layer.name}' ({chunk} samples each)")


def apply_span(program, start, through, samples, clones):
    """The program with the span after blob `start` through blob `through` run `samples`
    samples at a time in the forward and the backward pass, its stashes kept a micro-batch at a
    time (no replay: see the module docstring); `program` itself is left unchanged. A one-line
    MinigistError (naming --microbatch-span) when it cannot be."""
    span = check_span(program, start, through, samples)
    return _Builder(program, through, samples, clones, span, keep=True, start=start).build()


class _Builder:
    def __init__(self, program, through, samples, clones, front, keep=False, start=None):
        self.program = program
        self.start = start
        self.graph = graph = program.graph
        self.clones = {layer.name: layer for layer in clones.layers}
        self.samples = samples
        self.keep = keep
        self.through = f"blob:{through}"
        self.front = front
        self.names = {graph.nodes[i].layer.name for i in self.front}
        self.batch = graph.batch_size
        tops = {t for i in self.front for t in graph.nodes[i].tops} - {through}
        internal = {f"blob:{t}" for t in tops}
        internal.update(name for name, b in program.buffers.items()
                        if (b.kind in ("grad", "zero") and b.tensor in tops)
                        or (b.kind == "saved" and b.layer in self.names))
        internal.update(name for step in program.steps if step.layer is not None and step.layer.name in self.names
                        and step.kind in ("forward", "backward") for name in names_in(step.args.get("ws")))
        # the net's inputs only the front (a span from the input) reads: each micro-batch's rows
        # are fed into a buffer of its own, again for its backward, and the whole batch never
        # sits in the arena
        self.fed = self.fed_inputs()
        internal.update(self.fed)
        self.internal = internal
        self.buffers = {name: replace(b) for name, b in program.buffers.items() if name not in internal}

    def fed_inputs(self):
        """{blob buffer: top} of the net's inputs that only the front reads."""
        graph, inside = self.graph, set(self.front)
        fed = {}
        for node in graph.nodes:
            for top in node.tops if node.layer.is_data else ():
                buffer = self.program.buffers.get(f"blob:{top}")
                consumers = graph.blobs[top].consumers
                if buffer is not None and buffer.category == INPUT and consumers and \
                        all(c in inside for c, _ in consumers):
                    fed[buffer.name] = top
        return fed

    # ---- buffers ------------------------------------------------------------------------
    def local(self, name, tag):
        """The buffer of micro-batch `tag` standing for front tensor `name`: a blob, a saved
        tensor or a gradient of `samples` rows."""
        replayed = name == self.through and tag[0] == "r"      # the front's replays rebuild it
        if name is None or not (name in self.internal or replayed):
            return name
        local = of_micro(name, tag)
        if local not in self.buffers:
            original = self.program.buffers[name]
            shape = (self.samples,) + tuple(original.shape[1:])
            # a span keeps each micro-batch's stashes for its backward; the front rebuilds them
            category = original.category if self.keep or original.category in (GRADIENT, INPUT) else FEATURE
            self.buffers[local] = Buffer(local, shape, original.dtype, category, original.layer,
                                         kind=original.kind, tensor=original.tensor, part=original.part, micro=tag)
        return local

    def workspace(self, clone, phase, tag, gx_needed=None):
        """The clone's workspace of `phase`, buffers of micro-batch `tag`."""
        names = {}
        for part, decl in clone.workspace(phase, gx_needed).items():
            tensor = f"{clone.name}.{phase}.{part}"
            name = of_micro(f"ws:{tensor}", tag)
            self.buffers[name] = Buffer(name, tuple(decl.shape), np.dtype(decl.dtype or clone.dtype), WORKSPACE,
                                        clone.name, kind="ws", tensor=tensor, part=part, micro=tag)
            names[part] = name
        return names

    def rename(self, value, tag, fed_tag=None):
        """`value` with micro-batch `tag`'s buffers (`fed_tag`'s for a fed input, where given)."""
        if isinstance(value, str):
            return self.local(value, fed_tag if fed_tag and value in self.fed else tag)
        if isinstance(value, dict):
            return {key: self.rename(v, tag, fed_tag) for key, v in value.items()}
        if isinstance(value, list):
            return [self.rename(v, tag, fed_tag) for v in value]
        return value

    def sliced(self, args, original, k, tag):
        """`args` with the rows of micro-batch k, and the names of the whole-batch buffers
        (those of the `original` args that stay themselves) the executor takes them from."""
        whole = sorted({name for role in _BATCH_ROLES for name in names_in(original.get(role))
                        if self.local(name, tag) == name})
        return {**args, "samples": (k * self.samples, (k + 1) * self.samples), "whole": whole}

    # ---- steps --------------------------------------------------------------------------
    def clone(self, layer):
        return self.clones[layer.name]

    def feeds(self, steps, k, replay):
        """The feed steps of micro-batch k's rows of the inputs that `steps` read (`replay`: in
        the backward pass)."""
        tag = f"{'r' if replay else 'm' if self.keep else 'f'}{k}"
        read = {name for step in steps for name in names_in(step.args.get("x"))}
        rows = (k * self.samples, (k + 1) * self.samples)
        return [Step("recompute" if replay else "forward", self.graph.nodes[self.graph.blobs[top].producer].layer,
                     {"y": [self.local(name, tag)], "samples": rows, "whole": []}, op=Feed(top))
                for name, top in self.fed.items() if name in read]

    def forward(self, step, k, replay):
        """The forward step (replay: a recompute step in the backward pass) of micro-batch k."""
        tag = f"{'r' if replay else 'm' if self.keep else 'f'}{k}"
        clone = self.clone(step.layer)
        args = {role: self.rename(step.args[role], tag) for role in ("x", "y", "p", "saved")}
        args["ws"] = self.workspace(clone, "forward", tag)
        args = self.sliced(args, step.args, k, tag)
        if replay:
            return Step("recompute", clone, args, op=Replay())
        return Step("forward", clone, args)

    def backward(self, step, k):
        tag = f"{'m' if self.keep else 'r'}{k}"      # a span's backward reads its forward's stashes
        if step.layer is None:      # a zero fill or an accumulation of the front's gradients
            return Step(step.kind, None, self.rename(dict(step.args), tag), op=step.op, note=step.note)
        clone = self.clone(step.layer)
        # a span's backward reads its input's rows fed again, not kept since its forward
        args = {role: (value if role in ("p", "gp") else self.rename(value, tag, f"r{k}"))
                for role, value in step.args.items() if role != "ws"}
        gx_needed = tuple(name is not None for name in step.args["gx"])
        args["ws"] = self.workspace(clone, "backward", tag, gx_needed)
        if k and any(name is not None for name in step.args.get("gp") or ()):
            args["accumulate"] = True
        return Step("backward", clone, self.sliced(args, step.args, k, tag), op=step.op)

    def join_front(self, steps, blocks):
        """`steps` with each micro-batch's backward of the span (`blocks`, in order) moved into
        the front's, right after the front's replays of that micro-batch, where the span starts
        at the front's last top at the front's micro-batch and those replays rebuild its rows
        of START: the span's backward then reads that copy, and START needs no stash. The span's
        updates follow its last micro-batch. Each layer still adds its micro-batches' gradients
        in their order, so the bits are the same. `steps` unchanged where the two do not meet."""
        start = f"blob:{self.start}"
        rebuilt = [of_micro(start, f"r{k}") for k in range(len(blocks))]
        last_replay = {}
        for index, step in enumerate(steps):
            if step.kind == "recompute" and "samples" in step.args and step.layer.name not in self.names:
                first, end = step.args["samples"]
                if end - first != self.samples:
                    return steps
                last_replay[first // self.samples] = index
        if not blocks or sorted(last_replay) != list(range(len(blocks))) or \
                any(name not in self.buffers or not any(name in names_in(s.args.get("y")) for s in steps)
                    for name in rebuilt):
            return steps
        moved = {id(step) for block in blocks for step in block}
        updates = [step for step in steps if step.kind == "update" and step.layer is not None
                   and step.layer.name in self.names]
        moved.update(id(step) for step in updates)
        micro_batch_at = {at: k for k, at in last_replay.items()}
        joined = []
        for index, step in enumerate(steps):
            if id(step) not in moved:
                joined.append(step)
            k = micro_batch_at.get(index)
            if k is not None:
                joined.extend(_renamed(step, start, rebuilt[k]) for step in blocks[k])
                if k == len(blocks) - 1:
                    joined.extend(updates)
        return self.local_start_gradient(joined)

    def local_start_gradient(self, steps):
        """`steps` with START's gradient a buffer per micro-batch where only micro-batch steps
        name it (the span's backward writes a micro-batch's rows, the front's backward of the
        same micro-batch reads them right after): it is then never whole."""
        name = f"grad:{self.start}"
        whole = self.buffers.get(name)
        if whole is None or any(name in s.buffer_names() and "samples" not in s.args for s in steps):
            return steps
        local = []
        for step in steps:
            if name in step.buffer_names():
                first, end = step.args["samples"]
                tag = f"g{first // self.samples}"
                part = of_micro(name, tag)
                if part not in self.buffers:
                    self.buffers[part] = Buffer(part, (end - first,) + tuple(whole.shape[1:]), whole.dtype,
                                                whole.category, whole.layer, kind=whole.kind, tensor=whole.tensor,
                                                part=whole.part, micro=tag)
                step = _renamed(step, name, part)
            local.append(step)
        del self.buffers[name]
        return local

    def needed_replays(self, forward_steps, backward_steps):
        """The front's forward steps whose tops or saved tensors its backward reads, with those
        they read in turn."""
        needed = {name for step in backward_steps for role in ("x", "y", "saved") for name in names_in(step.args.get(role))}
        chosen = []
        for step in reversed(forward_steps):
            if any(name in needed for role in ("y", "saved") for name in names_in(step.args[role])):
                chosen.append(step)
                needed.update(names_in(step.args["x"]))
        return chosen[::-1]

    def build(self):
        program, graph = self.program, self.graph
        steps = program.steps
        # the graph's layers' forward steps (a front's pass before a span's has moved them)
        forward_of = {id(s.layer): i for i, s in enumerate(steps) if s.kind == "forward" and "samples" not in s.args}
        if any(id(graph.nodes[i].layer) not in forward_of for i in self.front):
            raise MinigistError("--microbatch: the program's forward steps are not the graph's")
        positions = [forward_of[id(graph.nodes[i].layer)] for i in self.front]
        forward_steps = [steps[i] for i in positions]
        for index in self.front:
            full = graph.nodes[index].layer
            layer = self.clone(full)
            if hasattr(full, "chunk_bytes"):     # as set_chunks left the whole batch's (on a GPU, larger)
                layer.chunk_bytes = full.chunk_bytes
            if layer.type == "Convolution":
                # the whole batch's choices, which may depend on its size
                layer.transposed_backward = full.transposed_backward
                layer.batch_chunk = full.conv_engine().chunk()
                layer.accumulating = True
        count = self.batch // self.samples
        first_backward = next((i for i, s in enumerate(steps) if s.kind != "forward"), len(steps))
        touches = [i for i in range(first_backward, len(steps))
                   if (steps[i].layer is not None and steps[i].layer.name in self.names and steps[i].kind == "backward")
                   or (steps[i].kind in ("zero", "accumulate") and any(n in self.internal for n in steps[i].buffer_names()))]
        front_backward = [steps[i] for i in touches]
        replays = [] if self.keep else self.needed_replays(forward_steps, front_backward)
        result, blocks = [], []
        skipped = set(positions) | set(touches[1:])
        for index, step in enumerate(steps):
            if index == positions[0]:
                for k in range(count):
                    result.extend(self.feeds(forward_steps, k, replay=False))
                    result.extend(self.forward(s, k, replay=False) for s in forward_steps)
            if index in skipped:
                continue
            if touches and index == touches[0]:
                for k in range(count):
                    block = self.feeds(replays + front_backward, k, replay=True)
                    block += [self.forward(s, k, replay=True) for s in replays]
                    block += [self.backward(s, k) for s in front_backward]
                    blocks.append(block)
                    result.extend(block)
                continue
            if self.fed and step.kind == "forward" and step.layer is not None and step.layer.is_data:
                # the data layer writes nothing itself (the executor feeds its tops)
                result.append(replace(step, args={**step.args, "y": [None if name in self.fed else name
                                                                     for name in step.args["y"]]}))
                continue
            result.append(step)
        if self.keep:
            result = self.join_front(result, blocks)
            read_back = f"blob:{self.start}"
        else:
            read_back = self.through
        buffer = self.buffers.get(read_back)    # (a fed input is gone)
        if buffer is not None and buffer.category == STASH and not any(read_back in s.buffer_names() for s in result if s.kind != "forward"):
            buffer.category = FEATURE      # read by no backward step (past the front; by the span's, joined)
        out = Program(graph, self.buffers, result, program.outputs, program.loss_weights)
        out.encodings = dict(program.encodings)
        return out


def _renamed(step, old, new):
    """`step` reading buffer `new` where it read `old` (rows of it, where `old` was whole)."""
    args = {role: renamed_in(value, {old: new}) for role, value in step.args.items() if role != "whole"}
    if "whole" in step.args:
        args["whole"] = [name for name in step.args["whole"] if name != old]
    return replace(step, args=args)
