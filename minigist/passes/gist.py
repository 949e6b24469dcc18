"""Gist's schedule builder: a pass over a training program.

Reads: the training program (typed buffers, liveness; after passes/recompute.py, whose
replays are readers too: the stashes they start from get only codes that hold their values,
decoded for each run of replays into a copy of its own, or, where each replay of the run reads
it a slice at a time, into a slice buffer of the run), the graph's layer facts (sparse_output,
keeps_zeros, argmax_positions, mask_backward, gradient_only_where_positive, elementwise,
stream_chunk/stream_role, forward_stream_chunk, reads_half, emits_top_slices) and the
GistConfig.
Provides: a new program with encode and decode steps and Gist's step kinds
(passes/gist_steps.py), encoded and decoded buffers, the stashes' categories moved, and
`program.encodings` for the report. Liveness is recomputed; nothing else is touched.

For every stashed tensor (kept from the forward pass for the backward pass) it picks an
encoding from the tensor's producer, its consumers and the GistConfig, then inserts an encode
step and a decode step right before its first backward use, and points the backward steps at
the decoded copy (unless its readers decode it slice by slice, or read it as fp16 as it is:
both below). The FP32 tensor's lifetime now ends at its last forward use, the decoded
copy lives only around its backward uses, and the memory planner, which runs after this pass,
sees the new lifetimes.

The encode step goes right after the step that produces the tensor, not after its last
forward use as in the paper: the encoded copy lives a few steps longer, but the FP32 tensor
is then read by no step after its last consumer, so that consumer may write its output over
it in place (a 64->64 convolution over its ReLU input): VGG-16's forward peak at batch 64
drops by 0.5 GB under `--gist all`.

An fp16 stash whose every backward reader can take float16 in its place (Layer.reads_half:
BatchNorm's x_hat, read by its own backward and Scale's) gets no decode step and is not
streamed: the readers read its DPR codes as a float16 array of the tensor's shape
(HalfStash), each value widened to the float32 a decode would have written, so the bits are
the same and a ResNet-20 step under `--gist all` skips 21 decodes (about 0.6 ms of a 37 ms
step). Where the stash's producer hands over each slice of the tensor as it becomes final
(Layer.emits_top_slices: BatchNorm, whose last pass writes x_hat), its forward step encodes
the slices as they come (WriteCodes) instead of an encode step reading the tensor once more.

Two backward step kinds replace a ReLU's stash, with the layer's own code:
- MaskBackward: the backward from the decoded 1-bit mask (Binarize; Layer.mask_backward);
- IdentityBackward: with the fused ReLU->MaxPool code the pool's backward already drops the
  gradient wherever the ReLU output was <= 0, so the ReLU's backward is a copy.
"""
import math
from dataclasses import dataclass, field

import numpy as np

from ..codecs import DPR_FORMATS, GistConfig, rules
from ..codecs.bits import BitMask, PackedCodes
from ..codecs.dpr import DPR, HalfStash
from ..codecs.segmented import PerSample
from ..codecs.ssdc import SSDC
from ..program import (ENCODED, FEATURE, INPUT, STASH, WORKSPACE, Buffer, Program, Step, names_in, of_micro, renamed_in,
                       stash_key)
from .gist_steps import (Decode, DecodeRows, Encode, IdentityBackward, MaskBackward, StreamedBackward, StreamedReplay,
                         WriteCodes)

# a stash smaller than this is decoded whole, once, before its first backward reader: each
# reader of a streamed stash decodes it again, and for a small tensor the time matters more
# than the bytes of one decoded copy
STREAM_MIN_BYTES = 4 << 20

# DPR encodes feature maps (a batch axis first) of at least this many bytes. A smaller one (a
# small batch's class probabilities) would save under 2 KiB for an encode and a decode step of
# a few microseconds each. Per-channel vectors are no feature maps: BatchNorm's inv_std in fp16
# would save as little and round the layer's whole input gradient.
DPR_MIN_BYTES = 4096


def dpr_applies(buffer, batch_size):
    """Whether DPR may keep `buffer`: a float32 map of the batch or of a micro-batch's rows of
    it (a batch axis first), of at least DPR_MIN_BYTES."""
    return (buffer.dtype == np.float32 and buffer.nbytes >= DPR_MIN_BYTES and len(buffer.shape) >= 2
            and (buffer.shape[0] == batch_size or bool(buffer.micro)))



@dataclass
class Encoding:
    """How one stashed tensor is kept: reported in the footprint's stash table."""
    tensor: str               # the stashed buffer
    codec: object             # None: dropped entirely (fused into another tensor's code)
    name: str                 # encoding name for reports
    encoded: list = field(default_factory=list)   # encoded buffer names
    decoded: str = ""         # the decoded buffer name


def _sparse_prone(graph, blob_id, memo):
    """True when the blob comes from a sparse_output layer (ReLU) through layers that keep its
    zeros (Layer.keeps_zeros)."""
    if blob_id in memo:
        return memo[blob_id]
    node = graph.nodes[graph.blobs[blob_id].producer]
    layer = node.layer
    if layer.sparse_output:
        result = True
    elif layer.keeps_zeros:
        result = bool(node.bottoms) and all(_sparse_prone(graph, b, memo) for b in node.bottoms)
    else:
        result = False
    memo[blob_id] = result
    return result


class _Builder:
    def __init__(self, program, config, calibrating):
        self.program = program
        self.graph = program.graph
        self.config = config
        self.calibrating = calibrating
        self.steps = program.steps
        self.first_backward = next((i for i, s in enumerate(self.steps) if s.kind != "forward"), len(self.steps))
        # buffer -> indices of the backward steps that read it, and of the replays of a
        # recomputation (passes/recompute.py) that do: they need its values, so a stash they
        # read gets only a code that holds them (no mask), and each run of replays decodes it
        # into a copy (or a slice buffer) of its own, freed when the run is done: the long gap
        # to its own backward readers holds the codes alone
        self.readers, self.replay_readers = {}, {}
        for index in range(self.first_backward, len(self.steps)):
            step = self.steps[index]
            readers = self.readers if step.kind == "backward" else self.replay_readers
            for role in ("x", "y", "saved"):
                for name in names_in(step.args.get(role)):
                    readers.setdefault(name, []).append(index)
        self.saved = {(b.layer, b.part, b.micro): b.name for b in program.buffers.values() if b.kind == "saved"}
        self.choices = {}     # buffer -> rules.Choice
        self.identity_relus = set()   # backward step indices turned into copies
        self.mask_relus = {}          # backward step index -> stashed buffer read as a mask
        self.sparse_memo = {}
        self.streams = {}             # backward or replay step index -> {slice buffer: stream details}
        self.row_decoded = {}         # a micro-batch's backward step index -> its own decoded rows

    # ---- choosing ---------------------------------------------------------------------
    def producer(self, buffer):
        if buffer.kind == "blob":
            return self.graph.nodes[self.graph.blobs[buffer.tensor].producer]
        return self.graph.node_of(buffer.layer)

    def dpr_applies(self, buffer):
        return self.config.lossy and dpr_applies(buffer, self.graph.batch_size)

    def ssdc_codec(self, buffer):
        """SSDC sized by the measured density, if it beats the dense tensor; else None."""
        count = int(np.prod(buffer.shape))
        value_format = self.config.dpr if self.config.lossy else "fp32"
        if self.calibrating:
            return SSDC(count, value_format)
        density = self.config.ssdc_density.get(buffer.tensor)
        if density is None:
            return None
        codec = SSDC(max(1, min(count, math.ceil(density * count))), value_format,
                          formats=_ssdc_formats(density))
        # SSDC only where it beats what the tensor would cost otherwise
        otherwise = DPR(value_format).encoded_nbytes(buffer.shape) if self.dpr_applies(buffer) else buffer.nbytes
        return codec if codec.encoded_nbytes(buffer.shape) < otherwise else None

    def by_name(self, name, buffer):
        """A codec from an encoding name (for per-layer overrides)."""
        if name in ("fp32", "none"):
            return None
        if name == "mask-1bit":
            return BitMask()
        if name == "index-4bit":
            return PackedCodes(4)
        if name == "ssdc" or name.startswith("ssdc-"):
            # "ssdc": values as the mode says (the DPR format under lossy modes); "ssdc-FORMAT":
            # values in that format whatever the mode (what the optimizer chooses per tensor)
            value_format = name[len("ssdc-"):] if name != "ssdc" else self.config.dpr if self.config.lossy else "fp32"
            if value_format not in ("fp32",) + DPR_FORMATS:
                raise ValueError(f"unknown encoding {name!r} in the Gist overrides")
            density = self.config.ssdc_density.get(buffer.tensor, 1.0)
            count = int(np.prod(buffer.shape))
            return SSDC(max(1, math.ceil(density * count)), value_format, formats=_ssdc_formats(density))
        if name in ("fp16", "fp10", "fp8-e4m3", "fp8-e5m2"):
            return DPR(name)
        raise ValueError(f"unknown encoding {name!r} in the Gist overrides")

    def choose(self):
        """A rules.Choice per stashed buffer: a per-layer or per-tensor override, else the first
        rule's (codecs/rules.py: the user's first, then the built-in ones)."""
        program, config = self.program, self.config
        # a micro-batch's rows of an input are fed where they are read (passes/microbatch.py)
        stashed = [b for b in program.buffers.values()
                   if b.name in self.readers and (b.category == STASH or (b.category == INPUT and not b.micro))]
        # blobs (ReLU outputs) first: a fused ReLU->MaxPool code decides the pool's argmax too
        stashed.sort(key=lambda b: 0 if b.kind == "blob" else 1)
        for buffer in stashed:
            if buffer.name in self.choices:
                continue
            node = self.producer(buffer)
            layer = node.layer
            override = config.overrides.get(stash_key(buffer), config.overrides.get(buffer.tensor,
                                                                                config.overrides.get(layer.name)))
            if override is not None:
                self.choices[buffer.name] = rules.Choice(self.by_name(override, buffer))
                continue
            choice = rules.choose(self.site(buffer, node))
            self.choices.update(choice.also)     # before its own: the order the steps are made in
            self.choices[buffer.name] = choice
            for index in self.readers[buffer.name] if choice.reader_form else ():
                if choice.reader_form == "identity":
                    self.identity_relus.add(index)
                else:
                    self.mask_relus[index] = buffer.name

    def site(self, buffer, node):
        """What the rules see of the stashed `buffer`, produced by `node`."""
        blob = buffer.kind == "blob"
        consumers = [self.graph.nodes[i].layer for i, _ in self.graph.blobs[buffer.tensor].consumers] if blob else []
        sparse = (blob and buffer.dtype == np.float32 and self.config.lossless
                  and _sparse_prone(self.graph, buffer.tensor, self.sparse_memo))
        return rules.Site(
            buffer=buffer, producer=node.layer,
            readers=[self.steps[i].layer for i in self.readers[buffer.name] + self.replay_readers.get(buffer.name, [])],
            consumers=consumers, config=self.config, sparse=sparse, dpr_applies=self.dpr_applies(buffer),
            ssdc=self.ssdc_codec(buffer) if sparse else None,
            saved_of=lambda layer, part: self.saved.get((layer.name, part, buffer.micro)),
            top_of=lambda layer: self.buffer_of_micro(f"blob:{self.graph.node_of(layer.name).tops[0]}", buffer.micro))

    def buffer_of_micro(self, name, micro):
        """Buffer `name`'s part of micro-batch `micro`, or `name` itself where the micro-batches
        share it whole (a span's last top, written a micro-batch's rows at a time)."""
        local = of_micro(name, micro)
        return local if local in self.program.buffers else name

    # ---- rewriting --------------------------------------------------------------------
    def build(self):
        self.choose()
        program = self.program
        buffers = {name: _copy(b) for name, b in program.buffers.items()}
        encodes, decodes, renames, encodings = {}, {}, {}, {}
        written_by_producer = {}    # forward step index -> (HalfStash, its codes) it writes
        for name, choice in self.choices.items():
            buffer, codec = buffers[name], choice.codec
            tensor = buffer.tensor
            if choice.dropped:
                encodings[name] = Encoding(name, None, "dropped")
                continue
            if codec is None:
                continue
            uses = [i for i, s in enumerate(self.steps) if i < self.first_backward and name in set(s.buffer_names())]
            # encoded once written whole: after its producer's step, or the last of them where a
            # micro-batched front writes it a micro-batch at a time (passes/microbatch.py)
            written = max((i for i in uses if name in names_in(self.steps[i].args.get("y"))
                           or name in names_in(self.steps[i].args.get("saved"))), default=min(uses))
            readers = self.readers[name]
            # read as it is: neither a decoded copy nor a streamed slice buffer
            direct = self.read_as_half(name, codec)
            # readers that each take a micro-batch's rows (a span's first layer reading its
            # input, a front's replays and backward reading the net's input): each micro-batch
            # decodes its own rows
            ranges = {} if direct else self.read_by_rows(name, codec)
            chunk = 0 if direct or ranges else self.stream_chunk(name, codec)
            runs = {} if ranges else self.replay_runs(name)
            run_chunks = {run: 0 if direct else self.replay_stream_chunk(name, codec, indices)
                          for run, indices in runs.items()}
            if chunk or ranges or any(run_chunks.values()):
                codec = self.per_sample(buffer, codec)
            if direct:
                codec = HalfStash()
            encoded = {}
            micro = buffer.micro
            for part, decl in codec.encoded(buffer.shape).items():
                enc_name = of_micro(f"enc:{tensor}.{part}", micro)
                buffers[enc_name] = Buffer(enc_name, tuple(decl.shape), np.dtype(decl.dtype), ENCODED, buffer.layer,
                                           kind="enc", tensor=tensor, part=part, micro=micro)
                encoded[part] = enc_name
            if direct and self.producer_writes_codes(written, name):
                written_by_producer[written] = (codec, encoded)
            else:
                encode_ws = _workspace(buffers, codec.workspace(buffer.shape, "encode"), f"{tensor}.encode", buffer.layer,
                                       micro)
                inputs = [name] + list(choice.inputs)
                args = {"x": inputs, "enc": encoded, "ws": encode_ws}
                producer = self.steps[written].args
                rows = [n for n in inputs if n in producer.get("whole", ())]
                if micro and rows:  # a micro-batch's code of a whole tensor's rows (a span's last pool's top)
                    args.update(samples=producer["samples"], whole=rows)
                encodes.setdefault(written, []).append(Step("encode", None, args, op=Encode(codec, tensor), note=tensor))
            whole = not direct and not chunk
            first = min(readers)
            for run, indices in runs.items():
                if whole and run == first:  # right before the first reader: they share its decode
                    first = min(indices)
                    for index in indices:
                        renames.setdefault(index, {})[name] = f"dec:{tensor}"
                    continue
                own = f"dec:{tensor}#{run}"
                replay_chunk = run_chunks[run]
                own_shape = (replay_chunk,) + tuple(buffer.shape[1:]) if replay_chunk else buffer.shape
                buffers[own] = Buffer(own, own_shape, np.dtype(codec.decoded_dtype(buffer.dtype)), STASH,
                                      buffer.layer, kind="dec", tensor=tensor, part=str(run))
                own_ws = _workspace(buffers, codec.workspace(buffer.shape, "decode"), f"{tensor}.decode#{run}",
                                    buffer.layer)
                if replay_chunk:    # no decode step: each replay decodes the slices it reads
                    for index in indices:
                        self.streams.setdefault(index, {})[own] = (codec, tensor, encoded, own_ws)
                else:
                    decodes.setdefault(min(indices), []).append(Step(
                        "decode", None, {"enc": encoded, "out": own, "ws": own_ws}, op=Decode(codec, tensor),
                        note=tensor))
                for index in indices:
                    renames.setdefault(index, {})[name] = own
            if direct:  # the readers take the fp16 codes themselves: nothing to decode
                for index in readers:
                    renames.setdefault(index, {})[name] = encoded["codes"]
                encodings[name] = Encoding(name, codec, codec.name, list(encoded.values()), "")
                continue
            if ranges:  # each micro-batch's readers get its rows, decoded into a buffer of their own
                decode_ws = _workspace(buffers, codec.workspace(buffer.shape, "decode"), f"{tensor}.decode",
                                       buffer.layer)
                owns = []
                for (first, end), indices in ranges.items():
                    own = f"dec:{tensor}@{first}"
                    buffers[own] = Buffer(own, (end - first,) + tuple(buffer.shape[1:]),
                                          np.dtype(codec.decoded_dtype(buffer.dtype)), STASH, buffer.layer, kind="dec",
                                          tensor=tensor, part=f"samples {first}-{end}")
                    decodes.setdefault(min(indices), []).append(Step(
                        "decode", None, {"enc": encoded, "out": own, "ws": decode_ws, "sample_range": (first, end),
                                         "batch": buffer.shape[0]}, op=DecodeRows(codec, tensor), note=tensor))
                    for index in indices:
                        renames.setdefault(index, {})[name] = own
                        self.row_decoded.setdefault(index, set()).add(own)
                    owns.append(own)
                encodings[name] = Encoding(name, codec, codec.name, list(encoded.values()), owns[0])
                continue
            decoded = of_micro(f"dec:{tensor}", micro)
            decoded_shape = (chunk,) + tuple(buffer.shape[1:]) if chunk else buffer.shape
            buffers[decoded] = Buffer(decoded, decoded_shape, np.dtype(codec.decoded_dtype(buffer.dtype)),
                                      STASH, buffer.layer, kind="dec", tensor=tensor, micro=micro)
            decode_ws = _workspace(buffers, codec.workspace(buffer.shape, "decode"), f"{tensor}.decode", buffer.layer,
                                   micro)
            if chunk:   # no decode step: each reader decodes the slices it needs, in turn
                for index in readers:
                    self.streams.setdefault(index, {})[decoded] = (codec, tensor, encoded, decode_ws)
            else:
                decodes.setdefault(first, []).append(Step(
                    "decode", None, {"enc": encoded, "out": decoded, "ws": decode_ws}, op=Decode(codec, tensor),
                    note=tensor))
            for index in readers:
                renames.setdefault(index, {})[name] = decoded
            encodings[name] = Encoding(name, codec, codec.name, list(encoded.values()), decoded)

        steps = []
        for index, step in enumerate(self.steps):
            steps.extend(decodes.get(index, []))
            if index in written_by_producer:
                codec, encoded = written_by_producer[index]
                step = Step(step.kind, step.layer, {**step.args, "enc": encoded}, op=WriteCodes(codec))
            steps.append(self.rewrite(index, step, renames.get(index, {}), encodings))
            steps.extend(encodes.get(index, []))
        for name in encodings:
            if buffers[name].category == STASH:   # the FP32 map no longer waits for the backward
                buffers[name].category = FEATURE
        result = Program(program.graph, buffers, steps, program.outputs, program.loss_weights)
        result.encodings = {**program.encodings, **encodings}   # an earlier pass's (recomputed) too
        return result

    def rewrite(self, index, step, renames, encodings):
        if step.kind != "backward":     # a replay reads decoded copies or slices; a forward, nothing
            if not renames:
                return step
            args = self.renamed(index, step, renames)
            streams = self.streams.get(index)
            if not streams:
                return Step(step.kind, step.layer, args, op=step.op, note=step.note)
            args["stream"] = _stream_args(streams)
            return Step(step.kind, step.layer, args, op=StreamedReplay(dict(streams)), note=step.note)
        args = self.renamed(index, step, renames)
        op = None
        if index in self.identity_relus:
            op = IdentityBackward()
            args["y"] = [None]
            args["ws"] = {}
        elif index in self.mask_relus and self.mask_relus[index] in renames:
            op = MaskBackward()
            args["ws"] = {k: v for k, v in args["ws"].items() if k != "mask"}   # the decoded mask replaces it
        streams = self.streams.get(index)
        if streams:
            args["stream"] = _stream_args(streams)
            assert op is None, f"{step.label}: a stash read in encoded form is not streamed"
            op = StreamedBackward(dict(streams))
        return Step(step.kind, step.layer, args, op=op)

    def renamed(self, index, step, renames):
        """Step `index`'s args with the stashes it reads renamed to what it reads instead; rows
        decoded for its micro-batch alone are no longer cut from a whole tensor."""
        args = {role: renamed_in(value, renames) for role, value in step.args.items()}
        if index in self.row_decoded:
            args["whole"] = [n for n in args["whole"] if n not in self.row_decoded[index]]
        return args

    def replay_runs(self, name):
        """{the backward step a run of replays comes before: the indices of those replays that
        read `name`}: a recomputation's segments run right before the backward step that first
        reads the tensor they rebuild."""
        runs = {}
        for index in self.replay_readers.get(name, ()):
            run = next(i for i in range(index, len(self.steps)) if self.steps[i].kind != "recompute")
            runs.setdefault(run, []).append(index)
        return runs

    def read_as_half(self, name, codec):
        """Whether every backward reader takes the stash `name` as float16 (Layer.reads_half,
        in its stream_role's first place and nowhere else in the step), so that its DPR fp16
        codes serve as they are (HalfStash)."""
        if type(codec) is not DPR or codec.fmt != "fp16" or self.program.buffers[name].dtype != np.float32:
            return False
        for index in self.readers[name]:
            step = self.steps[index]
            layer = step.layer
            role = step.args.get(layer.stream_role) or []
            if not (layer.reads_half() and role and role[0] == name and name not in role[1:]):
                return False
            if any(name in names_in(step.args.get(other)) for other in ("x", "y", "saved") if other != layer.stream_role):
                return False
        return True

    def producer_writes_codes(self, index, name):
        """Whether forward step `index`, which produces the HalfStash `name` as its first top,
        hand the codec each slice of it as it becomes final (Layer.emits_top_slices), so that
        no encode step reads the tensor again. Not a micro-batch's step: it writes some rows."""
        step = self.steps[index]
        tops = step.args.get("y") or []
        return (step.kind == "forward" and "samples" not in step.args and step.layer.emits_top_slices()
                and bool(tops) and tops[0] == name)

    # ---- streaming ----------------------------------------------------------------------
    def stream_chunk(self, name, codec):
        """Samples per slice when every backward reader of `name` can read it slice by slice
        (a layer whose `stream_chunk()` is positive reading it as its first input, or top for
        `stream_role` "y": a convolution, an LRN, a Scale, a BatchNorm's x_hat; or an
        elementwise layer reading it as its top: a ReLU), for a codec of values (SSDC, DPR);
        else 0."""
        if not self.streamable(name, codec):
            return 0
        if any("samples" in self.steps[index].args for index in self.readers[name]):
            return 0    # a micro-batch's reader takes its own rows (read_by_rows), never a slice buffer
        chunk = 1
        for index in self.readers[name]:
            step = self.steps[index]
            layer = step.layer
            role = step.args.get(layer.stream_role) or []
            if role and role[0] == name and name not in role[1:] and layer.stream_chunk() > 0:
                chunk = max(chunk, layer.stream_chunk())
            elif layer.elementwise and (step.args["y"] or [None])[0] == name and index not in self.mask_relus \
                    and index not in self.identity_relus:
                continue
            else:
                return 0
        # a reader that takes the whole batch at once would decode it whole on every read:
        # one decode step before the first reader costs the same memory and decodes once
        return chunk if chunk < self.graph.batch_size else 0

    def read_by_rows(self, name, codec):
        """{(first, end): the backward steps and replays that read rows first:end of the stash
        `name`} where every one of them is a micro-batch's (passes/microbatch.py: a span's first
        layer reads its input a micro-batch at a time, a front's replays and backward the net's
        input), for a codec of values (SSDC, DPR): each micro-batch then decodes its own rows,
        not the whole tensor; else {}."""
        if not self.streamable(name, codec):
            return {}
        ranges = {}
        for index in sorted(self.readers[name] + self.replay_readers.get(name, [])):
            samples = self.steps[index].args.get("samples")
            if samples is None or name not in self.steps[index].args.get("whole", ()):
                return {}
            ranges.setdefault(tuple(samples), []).append(index)
        return ranges

    def streamable(self, name, codec):
        """Whether the stash `name` in `codec` may be read a slice at a time at all."""
        return streams_values(codec) and sliceable(self.program.buffers[name], self.graph.batch_size)

    def replay_stream_chunk(self, name, codec, indices):
        """Samples per slice when every replay of one run (`indices`: those that read `name`,
        passes/recompute.py) can read it slice by slice: it is the replayed layer's first input
        and nothing else of the step, and the layer's forward reads that input in slices
        (Layer.forward_stream_chunk: a convolution); for a codec of values (SSDC, DPR); else 0.
        Each replay of the run then decodes the slices it reads into a slice buffer of the run,
        instead of a decode step writing a whole copy of the tensor for the run."""
        if not indices or not self.streamable(name, codec):
            return 0
        if any("samples" in self.steps[index].args for index in indices):
            return 0    # a micro-batch's replay reads rows of a decoded copy, never a slice buffer
        chunk = 1
        for index in indices:
            samples = forward_slices(self.steps[index], name)
            if not samples:
                return 0
            chunk = max(chunk, samples)
        return chunk if chunk < self.graph.batch_size else 0

    def per_sample(self, buffer, codec):
        """The per-sample form of a value codec (SSDC capacity divided over the samples)."""
        batch = buffer.shape[0]
        if isinstance(codec, SSDC):
            sample = int(np.prod(buffer.shape)) // batch
            density = 1.0 if self.calibrating else self.config.ssdc_density.get(buffer.tensor, 1.0)
            capacity = max(1, min(sample, math.ceil(density * sample)))
            inner = SSDC(capacity, codec.value_format, formats=_ssdc_formats(density))
        else:
            inner = codec
        return PerSample(inner, batch)


def _ssdc_formats(density):
    """The SSDC formats worth reserving room for. Both formats share one buffer sized for the
    larger; above about 11% non-zeros the bitmap is always the smaller (1 bit per element
    against one index byte per non-zero), so a denser bound reserves for the bitmap alone."""
    return ("bitmap",) if density > 0.1 else ("csr", "bitmap")


def _copy(buffer):
    return Buffer(buffer.name, buffer.shape, buffer.dtype, buffer.category, buffer.layer, pinned=buffer.pinned,
                  kind=buffer.kind, tensor=buffer.tensor, part=buffer.part, micro=buffer.micro)


def sliceable(buffer, batch_size):
    """Whether a stashed buffer may be read a slice at a time at all: a feature map of the
    batch, of at least STREAM_MIN_BYTES."""
    return buffer.kind == "blob" and buffer.shape[0] == batch_size and buffer.nbytes >= STREAM_MIN_BYTES


def forward_slices(step, name):
    """The samples of buffer `name` the forward (or replay) `step` reads at a time where it
    reads it slice by slice: its layer's first input and nowhere else in the step
    (Layer.forward_stream_chunk: a convolution); 0 where it reads it whole."""
    x = step.args.get("x") or []
    if not x or x[0] != name or name in x[1:]:
        return 0
    if any(name in names_in(step.args.get(role)) for role in ("y", "saved")):
        return 0
    return max(0, step.layer.forward_stream_chunk())


def streams_values(codec):
    """Whether a stash in `codec` can be decoded a slice at a time by the layers that read it
    in slices: a codec of values (SSDC, DPR; per sample or not), not fp16 read as it is."""
    inner = codec.inner if isinstance(codec, PerSample) else codec
    return isinstance(inner, (SSDC, DPR))


def _stream_args(streams):
    """The encoded parts and decode workspace a streaming step reads (part of their lifetime),
    as one step argument."""
    return {f"{tensor}.{role}.{part}": buffer for _, tensor, encoded, ws in streams.values()
            for role, names in (("enc", encoded), ("ws", ws)) for part, buffer in names.items()}


def _workspace(buffers, decls, prefix, layer, micro=""):
    names = {}
    for part, decl in decls.items():
        name = of_micro(f"ws:{prefix}.{part}", micro)
        buffers[name] = Buffer(name, tuple(decl.shape), np.dtype(decl.dtype), WORKSPACE, layer,
                               kind="ws", tensor=prefix, part=part, micro=micro)
        names[part] = name
    return names


def apply_gist(program, config, calibrating=False):
    """The program with Gist's encode/decode steps; `program` itself is left unchanged.
    With `calibrating`, every SSDC candidate is encoded at full capacity so that a run can
    measure its density."""
    if not isinstance(config, GistConfig):
        config = GistConfig(config)
    if config.mode == "none" and not config.overrides:
        return program
    return _Builder(program, config, calibrating).build()
