"""Gist's schedule builder: a pass over a training program.

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
step). Where the stash's producer can write the codes as it computes the tensor
(Layer.writes_half: BatchNorm, whose last pass writes x_hat), its forward step takes the
codes as an extra output instead of an encode step reading the tensor once more.

Two backward variants replace a ReLU's stash, with the ReLU layer's own code:
- "mask": ReLU backward from the decoded 1-bit mask (Binarize);
- "identity": with the fused ReLU->MaxPool code the pool's backward already drops the
  gradient wherever the ReLU output was <= 0, so the ReLU's backward is a copy.
"""
import math
from dataclasses import dataclass, field

import numpy as np

from .codecs import Codec, GistConfig, kernels, registered_codec
from .codecs.segmented import PerSample
from .program import ENCODED, FEATURE, INPUT, STASH, WORKSPACE, Buffer, Program, Step, names_in

# a stash smaller than this is decoded whole, once, before its first backward reader: each
# reader of a streamed stash decodes it again, and for a small tensor the time matters more
# than the bytes of one decoded copy
STREAM_MIN_BYTES = 4 << 20

# DPR encodes feature maps (a batch axis first) of at least this many bytes. A smaller one (a
# small batch's class probabilities) would save under 2 KiB for an encode and a decode step of
# a few microseconds each. Per-channel vectors are no feature maps: BatchNorm's inv_std in fp16
# would save as little and round the layer's whole input gradient.
DPR_MIN_BYTES = 4096

# layers whose output keeps the zeros of a ReLU input: SSDC candidates after a ReLU (LRN too,
# either norm_region: x * scale^-beta with scale >= k (or 1) > 0 is zero exactly where x is)
_SPARSITY_PRESERVING = {"ReLU", "Concat", "Dropout", "Flatten", "Split", "LRN"}


@dataclass
class Encoding:
    """How one stashed tensor is kept: reported in the footprint's stash table."""
    tensor: str               # the stashed buffer
    codec: object             # None: dropped entirely (fused into another tensor's code)
    name: str                 # encoding name for reports
    encoded: list = field(default_factory=list)   # encoded buffer names
    decoded: str = ""         # the decoded buffer name


def _max_pool_code_count(layer):
    """Codes a MaxPool's argmax needs (window positions), or None if not a MAX pool."""
    if layer.type != "Pooling" or getattr(layer, "method", None) != "MAX":
        return None
    kernel_h, kernel_w = layer.kernel
    return kernel_h * kernel_w


def _sparse_prone(graph, blob_id, memo):
    """True when the blob comes from a ReLU through layers that keep its zeros."""
    if blob_id in memo:
        return memo[blob_id]
    node = graph.nodes[graph.blobs[blob_id].producer]
    layer = node.layer
    if layer.type == "ReLU":
        result = True
    elif layer.type in _SPARSITY_PRESERVING or _max_pool_code_count(layer) is not None:
        result = bool(node.bottoms) and all(_sparse_prone(graph, b, memo) for b in node.bottoms)
    else:
        result = False
    memo[blob_id] = result
    return result


class _Builder:
    def __init__(self, program, config, calibrating):
        from .codecs.bits import BitMask, PackedCodes
        from .codecs.dpr import DPR, HalfStash
        from .codecs.ssdc import SSDC
        self.BitMask, self.PackedCodes, self.DPR, self.SSDC, self.HalfStash = BitMask, PackedCodes, DPR, SSDC, HalfStash
        self.program = program
        self.graph = program.graph
        self.config = config
        self.calibrating = calibrating
        self.steps = program.steps
        self.first_backward = next((i for i, s in enumerate(self.steps) if s.kind != "forward"), len(self.steps))
        self.readers = {}     # buffer -> indices of backward steps that read it
        for index in range(self.first_backward, len(self.steps)):
            step = self.steps[index]
            if step.kind != "backward":
                continue
            for role in ("x", "y", "saved"):
                for name in names_in(step.args.get(role)):
                    self.readers.setdefault(name, []).append(index)
        self.choices = {}     # buffer -> (codec or None, extra inputs)
        self.identity_relus = set()   # backward step indices turned into copies
        self.mask_relus = {}          # backward step index -> stashed buffer read as a mask
        self.sparse_memo = {}
        self.streams = {}             # backward step index -> {decoded buffer: stream details}

    # ---- choosing ---------------------------------------------------------------------
    def tensor_name(self, buffer):
        return buffer.name.split(":", 1)[1]

    def producer(self, buffer):
        if buffer.name.startswith("blob:"):
            blob = self.graph.blobs[self.tensor_name(buffer)]
            return self.graph.nodes[blob.producer]
        return next(node for node in self.graph.nodes if node.layer.name == buffer.layer)

    def dpr_applies(self, buffer):
        return (self.config.lossy and buffer.dtype == np.float32 and buffer.nbytes >= DPR_MIN_BYTES
                and len(buffer.shape) >= 2 and buffer.shape[0] == self.graph.batch_size)

    def ssdc_codec(self, buffer):
        """SSDC sized by the measured density, if it beats the dense tensor; else None."""
        count = int(np.prod(buffer.shape))
        value_format = self.config.dpr if self.config.lossy else "fp32"
        if self.calibrating:
            return self.SSDC(count, value_format)
        density = self.config.ssdc_density.get(self.tensor_name(buffer))
        if density is None:
            return None
        codec = self.SSDC(max(1, min(count, math.ceil(density * count))), value_format,
                          formats=_ssdc_formats(density))
        # SSDC only where it beats what the tensor would cost otherwise
        otherwise = self.DPR(value_format).encoded_nbytes(buffer.shape) if self.dpr_applies(buffer) else buffer.nbytes
        return codec if codec.encoded_nbytes(buffer.shape) < otherwise else None

    def by_name(self, name, buffer):
        """A codec from an encoding name (for per-layer overrides)."""
        if name in ("fp32", "none"):
            return None
        if name == "mask-1bit":
            return self.BitMask()
        if name == "index-4bit":
            return self.PackedCodes(4)
        if name == "ssdc":
            density = self.config.ssdc_density.get(self.tensor_name(buffer), 1.0)
            count = int(np.prod(buffer.shape))
            return self.SSDC(max(1, math.ceil(density * count)), self.config.dpr if self.config.lossy else "fp32",
                             formats=_ssdc_formats(density))
        if name in ("fp16", "fp10", "fp8-e4m3", "fp8-e5m2"):
            return self.DPR(name)
        raise ValueError(f"unknown encoding {name!r} in the Gist overrides")

    def choose(self):
        program, config = self.program, self.config
        stashed = [b for b in program.buffers.values()
                   if b.name in self.readers and b.category in (STASH, INPUT)]
        # ReLU outputs first: a fused ReLU->MaxPool code decides the pool's argmax too
        stashed.sort(key=lambda b: 0 if b.name.startswith("blob:") else 1)
        for buffer in stashed:
            if buffer.name in self.choices:
                continue
            node = self.producer(buffer)
            layer = node.layer
            tensor = self.tensor_name(buffer)
            override = config.overrides.get(tensor, config.overrides.get(layer.name))
            if override is not None:
                self.choices[buffer.name] = (self.by_name(override, buffer), [])
                continue
            readers = [self.steps[i].layer for i in self.readers[buffer.name]]
            factory = registered_codec(layer.type, [r.type for r in readers if r is not layer])
            if factory is not None:
                self.choices[buffer.name] = (factory(buffer.shape, buffer.dtype), [])
                continue
            self.choices[buffer.name] = self.builtin(buffer, node, readers)

    def builtin(self, buffer, node, readers):
        layer, config = node.layer, self.config
        if config.lossless:
            if buffer.name.startswith("saved:"):
                kind = buffer.name.rsplit(".", 1)[1]
                count = _max_pool_code_count(layer)
                if kind == "argmax" and count is not None and count <= 16:
                    return self.PackedCodes(4), []
                if layer.type == "Dropout" and kind == "mask":
                    return self.BitMask(), []
            elif layer.type == "ReLU" and all(r is layer for r in readers):
                consumers = [self.graph.nodes[i].layer for i, _ in self.graph.blobs[self.tensor_name(buffer)].consumers]
                counts = [_max_pool_code_count(c) for c in consumers]
                # the fused code drops the gradient where the pool output is <= 0: right for
                # max(x, 0), not for a leaky ReLU (which passes slope * gy there)
                if (config.binarize == "fused" and layer.slope == 0.0 and consumers
                        and all(c is not None and c + 1 <= 16 for c in counts)
                        and all(f"saved:{c.name}.argmax" in self.program.buffers and c.name not in config.overrides
                                and f"{c.name}.argmax" not in config.overrides for c in consumers)):
                    for consumer in consumers:
                        argmax = f"saved:{consumer.name}.argmax"
                        pool_out = f"blob:{self.graph.node_of(consumer.name).tops[0]}"
                        self.choices[argmax] = (FusedReluPool(self.PackedCodes(4), _max_pool_code_count(consumer)),
                                                [pool_out])
                    for index in self.readers[buffer.name]:
                        self.identity_relus.add(index)
                    return None, "dropped"
                for index in self.readers[buffer.name]:
                    self.mask_relus[index] = buffer.name
                return self.BitMask(), []
            if buffer.dtype == np.float32 and buffer.name.startswith("blob:") and \
                    _sparse_prone(self.graph, self.tensor_name(buffer), self.sparse_memo):
                codec = self.ssdc_codec(buffer)
                if codec is not None:
                    return codec, []
        if self.dpr_applies(buffer):
            return self.DPR(config.dpr), []
        return None, []

    # ---- rewriting --------------------------------------------------------------------
    def build(self):
        self.choose()
        program = self.program
        buffers = {name: _copy(b) for name, b in program.buffers.items()}
        encodes, decodes, renames, encodings = {}, {}, {}, {}
        written_by_producer = {}    # forward step index -> (HalfStash, its codes) it writes
        for name, (codec, extra) in self.choices.items():
            buffer = buffers[name]
            tensor = self.tensor_name(buffer)
            if extra == "dropped":
                encodings[name] = Encoding(name, None, "dropped")
                continue
            if codec is None:
                continue
            uses = [i for i, s in enumerate(self.steps) if i < self.first_backward and name in set(s.buffer_names())]
            readers = self.readers[name]
            # read as it is: neither a decoded copy nor a streamed slice buffer
            direct = self.read_as_half(name, codec)
            chunk = 0 if direct else self.stream_chunk(name, codec)
            if chunk:
                codec = self.per_sample(buffer, codec)
            if direct:
                codec = self.HalfStash()
            encoded = {}
            for part, decl in codec.encoded(buffer.shape).items():
                enc_name = f"enc:{tensor}.{part}"
                buffers[enc_name] = Buffer(enc_name, tuple(decl.shape), np.dtype(decl.dtype), ENCODED, buffer.layer)
                encoded[part] = enc_name
            if direct and self.producer_writes_codes(min(uses), name):
                written_by_producer[min(uses)] = (codec, encoded)
            else:
                encode_ws = _workspace(buffers, codec.workspace(buffer.shape, "encode"), f"{tensor}.encode", buffer.layer)
                inputs = [name] + list(extra)
                encodes.setdefault(min(uses), []).append(Step(
                    "encode", None, {"x": inputs, "enc": encoded, "ws": encode_ws}, codec=codec, note=tensor))
            if direct:  # the readers take the fp16 codes themselves: nothing to decode
                for index in readers:
                    renames.setdefault(index, {})[name] = encoded["codes"]
                encodings[name] = Encoding(name, codec, codec.name, list(encoded.values()), "")
                continue
            decoded = f"dec:{tensor}"
            decoded_shape = (chunk,) + tuple(buffer.shape[1:]) if chunk else buffer.shape
            buffers[decoded] = Buffer(decoded, decoded_shape, np.dtype(codec.decoded_dtype(buffer.dtype)),
                                      STASH, buffer.layer)
            decode_ws = _workspace(buffers, codec.workspace(buffer.shape, "decode"), f"{tensor}.decode", buffer.layer)
            if chunk:   # no decode step: each reader decodes the slices it needs, in turn
                for index in readers:
                    self.streams.setdefault(index, {})[decoded] = (codec, tensor, encoded, decode_ws)
            else:
                decodes.setdefault(min(readers), []).append(Step(
                    "decode", None, {"enc": encoded, "out": decoded, "ws": decode_ws}, codec=codec, note=tensor))
            for index in readers:
                renames.setdefault(index, {})[name] = decoded
            encodings[name] = Encoding(name, codec, codec.name, list(encoded.values()), decoded)

        steps = []
        for index, step in enumerate(self.steps):
            steps.extend(decodes.get(index, []))
            if index in written_by_producer:
                codec, encoded = written_by_producer[index]
                step = Step(step.kind, step.layer, {**step.args, "enc": encoded}, codec=codec)
            steps.append(self.rewrite(index, step, renames.get(index, {}), encodings))
            steps.extend(encodes.get(index, []))
        for name in encodings:
            if buffers[name].category == STASH:   # the FP32 map no longer waits for the backward
                buffers[name].category = FEATURE
        result = Program(program.graph, buffers, steps, program.outputs, program.loss_weights)
        result.encodings = encodings
        return result

    def rewrite(self, index, step, renames, encodings):
        if step.kind != "backward":
            return step
        args = {role: _rename(value, renames) for role, value in step.args.items()}
        variant = None
        if index in self.identity_relus:
            variant = "identity"
            args["y"] = [None]
            args["ws"] = {}
        elif index in self.mask_relus and self.mask_relus[index] in renames:
            variant = "mask"
            args["ws"] = {k: v for k, v in args["ws"].items() if k != "mask"}   # the decoded mask replaces it
        streams = self.streams.get(index)
        if streams:
            # the encoded parts and decode workspace are read by this step: part of its lifetime
            args["stream"] = {f"{tensor}.{role}.{part}": buffer for _, tensor, encoded, ws in streams.values()
                              for role, names in (("enc", encoded), ("ws", ws)) for part, buffer in names.items()}
            streams = {name: (codec, tensor, encoded, ws) for name, (codec, tensor, encoded, ws) in streams.items()}
        return Step(step.kind, step.layer, args, variant=variant, streams=streams)

    def read_as_half(self, name, codec):
        """Whether every backward reader takes the stash `name` as float16 (Layer.reads_half,
        in its stream_role's first place and nowhere else in the step), so that its DPR fp16
        codes serve as they are (HalfStash)."""
        if type(codec) is not self.DPR or codec.fmt != "fp16" or self.program.buffers[name].dtype != np.float32:
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
        can write the stash's codes itself as it computes it (Layer.writes_half), so that no
        encode step reads the tensor again."""
        step = self.steps[index]
        tops = step.args.get("y") or []
        return (step.kind == "forward" and step.layer.writes_half()
                and bool(tops) and tops[0] == name)

    # ---- streaming ----------------------------------------------------------------------
    def stream_chunk(self, name, codec):
        """Samples per slice when every backward reader of `name` can read it slice by slice
        (a layer whose `stream_chunk()` is positive reading it as its first input, or top for
        `stream_role` "y": a convolution, an LRN, a Scale, a BatchNorm's x_hat; a ReLU's
        output), for a codec of values (SSDC, DPR); else 0."""
        if not isinstance(codec, (self.SSDC, self.DPR)) or not name.startswith("blob:"):
            return 0
        buffer = self.program.buffers[name]
        if buffer.shape[0] != self.graph.batch_size or buffer.nbytes < STREAM_MIN_BYTES:
            return 0
        chunk = 1
        for index in self.readers[name]:
            step = self.steps[index]
            layer = step.layer
            role = step.args.get(layer.stream_role) or []
            if role and role[0] == name and name not in role[1:] and layer.stream_chunk() > 0:
                chunk = max(chunk, layer.stream_chunk())
            elif layer.type == "ReLU" and step.args["y"][0] == name and index not in self.mask_relus \
                    and index not in self.identity_relus:
                continue
            else:
                return 0
        # a reader that takes the whole batch at once would decode it whole on every read:
        # one decode step before the first reader costs the same memory and decodes once
        return chunk if chunk < self.graph.batch_size else 0

    def per_sample(self, buffer, codec):
        """The per-sample form of a value codec (SSDC capacity divided over the samples)."""
        batch = buffer.shape[0]
        if isinstance(codec, self.SSDC):
            sample = int(np.prod(buffer.shape)) // batch
            density = 1.0 if self.calibrating else self.config.ssdc_density.get(self.tensor_name(buffer), 1.0)
            capacity = max(1, min(sample, math.ceil(density * sample)))
            inner = self.SSDC(capacity, codec.value_format, formats=_ssdc_formats(density))
        else:
            inner = codec
        return PerSample(inner, batch)


class FusedReluPool(Codec):
    """One code per MaxPool output for a ReLU whose only consumers are max-pools: the argmax
    window position where the pool output is > 0, else the reserved code K (= kh*kw), which
    matches no window position, so the pool's backward passes no gradient there: exactly the
    gradient ReLU's backward would have zeroed. Stored with PackedCodes (4 bits per output)."""

    lossless = True
    name = "relu-pool-4bit"

    def __init__(self, packed, positions):
        self.packed = packed
        self.positions = positions

    def encoded(self, shape):
        return self.packed.encoded(shape)

    def encoded_nbytes(self, shape):
        return self.packed.encoded_nbytes(shape)

    def decoded_dtype(self, dtype):
        return np.uint8

    def workspace(self, shape, phase):
        from .layers.base import TensorDecl
        ws = {f"packed.{k}": v for k, v in self.packed.workspace(shape, phase).items()}
        if phase == "encode":
            ws["codes"] = TensorDecl(shape, np.uint8)
            ws["positive"] = TensorDecl(shape, np.bool_)
        return ws

    def encode(self, xp, x, enc, ws):
        argmax, pool_out = x
        codes, positive = ws["codes"], ws["positive"]
        if argmax.dtype == np.uint8 and kernels.active(xp, argmax, pool_out, codes):
            kernels.relu_pool_codes(argmax.reshape(-1), pool_out.reshape(-1), np.uint8(self.positions),
                                    codes.reshape(-1))
        else:
            codes.fill(self.positions)
            xp.greater(pool_out, 0, out=positive)
            xp.copyto(codes, argmax, where=positive, casting="unsafe")
        self.packed.encode(xp, codes, enc, {k[7:]: v for k, v in ws.items() if k.startswith("packed.")})

    def decode(self, xp, enc, out, ws):
        self.packed.decode(xp, enc, out, {k[7:]: v for k, v in ws.items() if k.startswith("packed.")})


def _ssdc_formats(density):
    """The SSDC formats worth reserving room for. Both formats share one buffer sized for the
    larger; above about 11% non-zeros the bitmap is always the smaller (1 bit per element
    against one index byte per non-zero), so a denser bound reserves for the bitmap alone."""
    return ("bitmap",) if density > 0.1 else ("csr", "bitmap")


def _rename(value, renames):
    if not renames:
        return value
    if isinstance(value, dict):
        return {k: renames.get(v, v) if isinstance(v, str) else v for k, v in value.items()}
    if isinstance(value, list):
        return [renames.get(v, v) if isinstance(v, str) else v for v in value]
    if isinstance(value, str):
        return renames.get(value, value)
    return value


def _copy(buffer):
    return Buffer(buffer.name, buffer.shape, buffer.dtype, buffer.category, buffer.layer, pinned=buffer.pinned)


def _workspace(buffers, decls, prefix, layer):
    names = {}
    for part, decl in decls.items():
        name = f"ws:{prefix}.{part}"
        buffers[name] = Buffer(name, tuple(decl.shape), np.dtype(decl.dtype), WORKSPACE, layer)
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
