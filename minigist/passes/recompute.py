"""Recomputation: a pass that drops stashed tensors after their forward use and rebuilds them
before their backward use, by re-running the forward steps that produce them.

Reads: a training program from passes/backward.py (typed buffers, liveness; nothing encoded
yet), the names of the stashed tensors to drop (buffer.tensor of a stashed blob, e.g.
"conv1@relu1"), and the layers' declared facts: `recomputable`, `forward_updates_state`,
`forward_draws_random`, `replay_workspace` and `replay_forward` (layers/base.py).
Also reads `shared`, a subset of them: the tensors whose copy, when a segment rebuilds them on
the way to another tensor before their own segment comes, is kept from then on.
Provides: a new program where each named tensor's FP32 buffer is read by no backward step, so
its lifetime ends at its last forward use. Right before its first backward reader a segment
of "recompute" steps (Replay ops) re-runs the forward chain that produces it, from tensors
that are kept anyway (the net's inputs, stashes not dropped) or rebuilt earlier, into "rec"
buffers the backward steps read instead. `program.encodings` names each dropped tensor
"recomputed" for the report's stash table. Liveness is recomputed; nothing else is touched.

Exactness: a replay runs the layer's own forward code on the same inputs with workspace of the
same shapes, so it writes the same bits. A layer whose forward writes state (BatchNorm's
running sums) replays without writing it, so the state is updated once per iteration; a layer
whose forward draws random numbers (Dropout) replays with the numbers its forward saved (the
mask, still kept for its own backward). Any other saved tensor a replay writes goes to scratch:
the backward reads the one the forward pass saved.

Segments are ordered as their tensors' first backward readers (ties in forward order). A
segment starts from kept tensors and from the copies earlier segments rebuilt (each dropped
tensor's copy lives from its replay to its last backward reader); every other map it rebuilds
on the way (an unkept feature map, or a dropped tensor whose own segment comes later) is its
own, freed as soon as the segment is done with it. So dropping every stash keeps only the
copies whose backward readers are still to come, at the price of replaying a chain from the
net's input for each: memory against time. A shared tensor is the other side of that trade: a
segment that rebuilds it on the way keeps its copy (as its own segment would have made it) and
its own segment replays nothing, so a run of shared tensors between two kept ones is rebuilt
once, together, as in the checkpointing of Chen et al. (2016): each replayed once, each copy
live from the segment that made it to its last backward reader.

Order: this pass runs before Gist's. Gist then never encodes what is recomputed (the dropped
tensors have no backward reader left, and the rebuilt copies are made in the backward pass,
where an encoding would save nothing), and it sees the replays as readers of the stashes they
start from: those get only a code that holds their values (SSDC, not a 1-bit mask; under lossy
modes a reduced precision, as any reader gets), decoded before the first replay or backward
step that reads them (or, by a replayed convolution, a slice at a time as it reads them).
Run after Gist, this pass would have to rebuild tensors from encoded inputs and undo
encodings already planned for the tensors it drops.
"""
from dataclasses import replace

import numpy as np

from ..errors import MinigistError
from ..executor import arrays_for
from ..program import FEATURE, INPUT, STASH, WORKSPACE, Buffer, Program, Step, renamed_in
from .gist import Encoding


class Replay:
    """A recompute step: the layer's forward once more (Layer.replay_forward)."""

    def bind(self, step, arrays, xp, stats):
        layer = step.layer
        x, y, p, saved, ws = (arrays_for(arrays, step.args[role]) for role in ("x", "y", "p", "saved", "ws"))
        return lambda: layer.replay_forward(xp, x, y, p, saved, ws)


class _Segment:
    """The replays that rebuild one dropped tensor (`target`, a blob buffer name, of `tensor`),
    and the copies they write: {blob buffer: rec buffer}."""

    def __init__(self, target, tensor):
        self.target, self.tensor = target, tensor
        self.steps, self.copies = [], {}


class _Builder:
    def __init__(self, program, tensors, shared=()):
        self.program = program
        self.graph = program.graph
        self.buffers = {name: replace(b) for name, b in program.buffers.items()}   # the input left as it is
        self.steps = program.steps
        self.first_backward = next((i for i, s in enumerate(self.steps) if s.kind != "forward"), len(self.steps))
        self.dropped = {f"blob:{tensor}" for tensor in tensors}
        self.shared = {f"blob:{tensor}" for tensor in shared}
        self.rebuilt = {}       # dropped blob buffer -> the copy its segment rebuilt, which its readers read

    def check(self, tensor):
        """A one-line MinigistError unless `tensor` is a stashed blob whose chain can be re-run."""
        name = f"blob:{tensor}"
        buffer = self.program.buffers.get(name)
        if buffer is None:
            if any(b.kind == "saved" and b.tensor == tensor for b in self.program.buffers.values()):
                raise MinigistError(f"recompute: '{tensor}' is a layer's saved tensor; only tops can be recomputed")
            raise MinigistError(f"recompute: '{tensor}' is no top of this net{self.hint(tensor)}")
        if buffer.category == INPUT:
            raise MinigistError(f"recompute: '{tensor}' is the net's input; it cannot be recomputed")
        if buffer.category != STASH:
            raise MinigistError(f"recompute: '{tensor}' is not stashed (no backward step reads it){self.hint(tensor)}")
        self.producer_step(name, tensor)

    def hint(self, name):
        """The stashed tops a user may mean by `name`: a top written in place by later layers is
        stashed under TOP@LAYER (the stash table's names), and a layer's name ends some."""
        stashed = [b.tensor for b in self.program.buffers.values() if b.kind == "blob" and b.category == STASH
                   and (b.tensor.split("@")[0] == name or b.tensor.endswith(f"@{name}"))]
        return f"; stashed under that name: {', '.join(stashed)}" if stashed else ""

    def producer_step(self, name, tensor):
        """The forward step index that writes blob buffer `name`, checked recomputable."""
        node_index = self.graph.blobs[self.buffers[name].tensor].producer
        layer = self.graph.nodes[node_index].layer
        if not layer.recomputable:
            raise MinigistError(f"recompute: '{tensor}' cannot be recomputed: it needs a replay of "
                                f"'{layer.name}' ({layer.type}), which cannot be replayed")
        return node_index

    def kept(self, name):
        buffer = self.buffers[name]
        return buffer.category == INPUT or (buffer.category == STASH and name not in self.dropped)

    def source(self, name, segment):
        """The buffer a replay of `segment` reads for blob buffer `name`: kept, a dropped tensor's
        copy rebuilt by an earlier segment, or rebuilt in this one (its producer's replay
        appended first)."""
        if name in self.rebuilt:
            return self.rebuilt[name]
        if self.kept(name):
            return name
        if name not in segment.copies:
            self.replay(self.producer_step(name, segment.tensor), segment)
        return segment.copies[name]

    def replay(self, index, segment):
        """Append to `segment` the replay of forward step `index` (its inputs first)."""
        step = self.steps[index]
        layer = step.layer
        x = [self.source(name, segment) for name in step.args["x"]]
        y = []
        for name in step.args["y"]:
            original = self.buffers[name]
            # the segment's own tensor, and a shared one, get the copy their backward readers
            # read; every other top is the segment's alone, freed when the segment is done with it
            own = name == segment.target or name in self.shared
            rec = f"rec:{original.tensor}" if own else f"rec:{original.tensor}#{segment.tensor}"
            self.buffers[rec] = Buffer(rec, original.shape, original.dtype, FEATURE, original.layer,
                                       kind="rec", tensor=original.tensor, part="" if own else segment.tensor)
            segment.copies[name] = rec
            if own and name in self.dropped:
                self.rebuilt[name] = rec
            y.append(rec)
        if layer.forward_draws_random:   # the numbers the forward drew and saved, read again
            saved = dict(step.args["saved"])
        else:
            saved = {part: self.scratch(self.buffers[name], layer, f"saved.{part}", segment)
                     for part, name in step.args["saved"].items()}
        ws = {part: self.scratch(decl, layer, part, segment) for part, decl in layer.replay_workspace().items()}
        segment.steps.append(Step("recompute", layer, {"x": x, "y": y, "p": step.args["p"], "saved": saved,
                                                       "ws": ws}, op=Replay()))

    def scratch(self, decl, layer, part, segment):
        """A replay's scratch buffer: one per replay, so that each lives for its step alone."""
        tensor = f"{layer.name}.recompute.{segment.tensor}"
        name = f"ws:{tensor}.{part}"
        dtype = decl.dtype if isinstance(decl, Buffer) else (decl.dtype or layer.dtype)
        self.buffers[name] = Buffer(name, tuple(decl.shape), np.dtype(dtype), WORKSPACE, layer.name,
                                    kind="ws", tensor=tensor, part=part)
        return name

    def build(self):
        first_reader = {}
        for index in range(self.first_backward, len(self.steps)):
            step = self.steps[index]
            for name in step.buffer_names(("x", "y", "saved")) if step.kind == "backward" else ():
                if name in self.dropped:
                    first_reader.setdefault(name, index)
        segments = {}
        # ties (one backward step reads two dropped tensors) in forward order: a tensor's
        # source is rebuilt first and read by the later segment, whatever the set's order
        order = {name: (first_reader[name], self.graph.blobs[self.buffers[name].tensor].producer)
                 for name in self.dropped}
        for name in sorted(self.dropped, key=order.__getitem__):
            if name in self.rebuilt:        # shared, and rebuilt by an earlier segment
                continue
            segment = _Segment(name, self.buffers[name].tensor)
            self.replay(self.producer_step(name, segment.tensor), segment)
            segments.setdefault(first_reader[name], []).extend(segment.steps)
        steps = []
        for index, step in enumerate(self.steps):
            steps.extend(segments.get(index, []))
            if step.kind == "backward":
                # Only the stash roles read the rebuilt copies; gy and gx stay the gradients.
                step = Step(step.kind, step.layer,
                            {role: renamed_in(value, self.rebuilt) if role in ("x", "y") else value
                             for role, value in step.args.items()}, op=step.op)
            steps.append(step)
        for name in self.dropped:
            self.buffers[name].category = FEATURE    # read by the forward pass only
        program = self.program
        result = Program(program.graph, self.buffers, steps, program.outputs, program.loss_weights)
        result.encodings = dict(program.encodings)
        for name in self.dropped:
            result.encodings[name] = Encoding(name, None, "recomputed", [], self.rebuilt[name])
        return result


def apply_recompute(program, tensors, shared=()):
    """The program with each stashed tensor of `tensors` (buffer.tensor names of stashed
    blobs) dropped after its forward use and rebuilt before its backward use, those of
    `shared` kept from the first segment that rebuilds them; `program` itself is left
    unchanged. An empty `tensors` returns `program` as it is."""
    tensors = tuple(tensors)
    unknown = [tensor for tensor in shared if tensor not in tensors]
    if unknown:
        raise MinigistError(f"recompute_shared: '{unknown[0]}' is not among the recomputed tensors (recompute)")
    if not tensors:
        return program
    builder = _Builder(program, tensors, shared)
    for tensor in tensors:
        builder.check(tensor)
    return builder.build()
