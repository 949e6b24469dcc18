"""The step kinds the Gist pass inserts, and how each one runs.

A step that carries an `op` is bound by it (`op.bind(step, arrays, xp, stats)` returns the
no-argument callable the executor runs); the executor knows nothing else about them. `stats`
is the run's GistStats, which the encode steps report to.

- Encode / Decode: a codec's encode after the tensor's producer, its decode before the first
  backward reader;
- WriteCodes: a forward step whose layer emits its top slice by slice as each becomes final
  (Layer.emits_top_slices): the codec encodes each slice while it is in cache, so no encode
  step reads the tensor again;
- MaskBackward / IdentityBackward: a backward that reads its stash in encoded form, through
  the layer's own facts (Layer.mask_backward: from the 1-bit mask; gradient_only_where_positive:
  the fused ReLU->MaxPool code already dropped the gradient, so the backward is a copy);
- StreamedBackward: a backward that reads a stash encoded per sample, one batch slice at a
  time, decoding each slice as it is read;
- StreamedReplay: a recomputation's replay (passes/recompute.py) of a layer that reads its
  encoded source the same way (Layer.forward_stream_chunk).
"""
import numpy as np

from ..executor import arrays_for
from ..gpu import kernels as gpu_kernels


class GistStats:
    """What the encode steps saw: the densest SSDC input per tensor, and the fallbacks taken
    when a batch was denser than the plan's bound (the FP32 tensor is then copied outside the
    planned memory until its decode, so nothing is corrupted; each case is counted)."""

    def __init__(self):
        self._density = {}
        self.fallbacks = 0
        self.fallback_bytes = 0
        self.fallback_tensors = set()
        self.overflows = 0
        self._kept = {}
        # the GPU's own record (SSDC.encode_device): per slot, the densest count and the
        # overflows, int32 on the device, read back only when asked (a sync)
        self.counts = None
        self.slots = []          # (tensor, elements counted per encode) per slot
        self._xp = None

    def record_density(self, tensor, density):
        self._density[tensor] = max(self._density.get(tensor, 0.0), float(density))

    @property
    def density(self):
        """{tensor: the densest fraction of non-zeros its encodes saw} (reads the device's
        counts back, where SSDC runs on the GPU)."""
        self.collect()
        return self._density

    def device_slot(self, xp, tensor, elements):
        """The slot of `tensor` in the device counts (made, or grown, when steps are bound)."""
        if (tensor, elements) in self.slots:
            return self.slots.index((tensor, elements))
        self.slots.append((tensor, elements))
        grown = xp.zeros(2 * len(self.slots), dtype=np.int32)
        if self.counts is not None:
            grown[:self.counts.size] = self.counts
        self.counts, self._xp = grown, xp
        return len(self.slots) - 1

    def overflowed(self):
        """Whether an SSDC encode on the device found a tensor denser than its capacity since
        the last call (one host sync); the counts are collected then."""
        if self.counts is None or not int(self.counts[1::2].sum()):
            return False
        self.collect()
        return True

    def collect(self):
        """Fold the device counts into density / overflows and clear them (a host sync)."""
        if self.counts is None:
            return
        host = self.counts.get() if hasattr(self.counts, "get") else np.array(self.counts)
        for slot, (tensor, elements) in enumerate(self.slots):
            if host[2 * slot] or host[2 * slot + 1]:
                self.record_density(tensor, host[2 * slot] / max(1, elements))
            if host[2 * slot + 1]:
                self.overflows += int(host[2 * slot + 1])
                self.fallback_tensors.add(tensor)
        self.counts.fill(0)

    def fallback(self, tensor, x):
        self.fallbacks += 1
        self.fallback_bytes += x.nbytes
        self.fallback_tensors.add(tensor)
        self._kept[tensor] = x.copy()

    def fallback_for(self, tensor):
        """The FP32 copy kept because `tensor` did not fit its plan this iteration, or None."""
        return self._kept.get(tensor)

    def drop_fallback(self, tensor):
        self._kept.pop(tensor, None)


class StreamedStash:
    """A stash encoded per sample, read by a backward step (or a replay) one batch slice at a time:
    `reader[n0:n1]` decodes samples n0..n1-1 into the slice buffer and returns them."""

    def __init__(self, xp, codec, enc, ws, buffer, stats, tensor):
        self.xp, self.codec, self.enc, self.ws = xp, codec, enc, ws
        self.buffer, self.stats, self.tensor = buffer, stats, tensor
        self.chunk_samples = buffer.shape[0]
        self.shape = (codec.batch,) + tuple(buffer.shape[1:])
        self.dtype = buffer.dtype

    def __getitem__(self, index):
        start, stop, step = index.indices(self.shape[0])
        if step != 1 or stop - start > self.chunk_samples:
            raise IndexError(f"{self.tensor}: read at most {self.chunk_samples} consecutive samples at a time")
        kept = self.stats.fallback_for(self.tensor) if self.stats is not None else None
        if kept is not None:
            return kept[start:stop]
        out = self.buffer[:stop - start]
        self.codec.decode_slice(self.xp, self.enc, start, stop, out, self.ws)
        return out


class _CodecStep:
    """A step that runs a codec on one tensor: its encoded parts and workspace, bound."""

    def __init__(self, codec, tensor):
        self.codec, self.tensor = codec, tensor

    def bind(self, step, arrays, xp, stats):
        return self.run(xp, stats, arrays_for(arrays, step.args["enc"]), arrays_for(arrays, step.args["ws"]),
                        step, arrays)


class Encode(_CodecStep):
    def run(self, xp, stats, enc, ws, step, arrays):
        codec, tensor = self.codec, self.tensor
        inputs = arrays_for(arrays, step.args["x"])
        x = inputs[0] if len(inputs) == 1 else tuple(inputs)

        if codec.data_dependent and gpu_kernels.serves(xp):
            # counted and checked on the device: no host sync per tensor (GistStats.overflowed)
            elements = (x.size // codec.batch) if hasattr(codec, "batch") else x.size
            slot = stats.device_slot(xp, tensor, elements)
            return lambda: codec.encode_device(xp, x, enc, ws, stats.counts, slot)

        def encode():
            stats.drop_fallback(tensor)
            if codec.data_dependent:          # record what its capacity had to hold
                fitted, density = codec.encode_measured(xp, x, enc, ws)
                stats.record_density(tensor, density)
            else:
                fitted = codec.encode(xp, x, enc, ws)
            if fitted is False:
                stats.fallback(tensor, x)
        return encode


class Decode(_CodecStep):
    def run(self, xp, stats, enc, ws, step, arrays):
        codec, tensor = self.codec, self.tensor
        out = arrays[step.args["out"]]

        def decode():
            kept = stats.fallback_for(tensor)
            if kept is not None:
                xp.copyto(out, kept)
            else:
                codec.decode(xp, enc, out, ws)
        return decode


class DecodeRows(_CodecStep):
    """The decode of one micro-batch's rows (args "sample_range": (first, end)) of a stash
    encoded per sample, into a buffer of those rows alone."""

    def run(self, xp, stats, enc, ws, step, arrays):
        codec, tensor = self.codec, self.tensor
        out = arrays[step.args["out"]]
        first, end = step.args["sample_range"]

        def decode():
            kept = stats.fallback_for(tensor)
            if kept is not None:
                xp.copyto(out, kept[first:end])
            else:
                codec.decode_slice(xp, enc, first, end, out, ws)
        return decode


class StreamedReplay:
    """A replay (passes/recompute.py) whose first input in `streams` ({slice buffer: (codec,
    tensor, enc, ws)}) is encoded per sample: the layer's forward reads it through a
    StreamedStash, one decoded slice at a time (Layer.forward_stream_chunk)."""

    def __init__(self, streams):
        self.streams = streams

    def bind(self, step, arrays, xp, stats):
        layer = step.layer
        x, y, p, saved, ws = _layer_arrays(step, arrays, ("x", "y", "p", "saved", "ws"))
        readers = _readers(self.streams, arrays, xp, stats)
        x = [readers.get(n, a) for n, a in zip(step.args["x"], x)]
        return lambda: layer.replay_forward(xp, x, y, p, saved, ws)


def _readers(streams, arrays, xp, stats):
    """{slice buffer: its StreamedStash} for the `streams` of a step."""
    return {name: StreamedStash(xp, codec, arrays_for(arrays, encoded), arrays_for(arrays, ws), arrays[name], stats,
                                tensor)
            for name, (codec, tensor, encoded, ws) in streams.items()}


def _layer_arrays(step, arrays, roles):
    return [arrays_for(arrays, step.args[role]) for role in roles]


class WriteCodes:
    """The forward step of a layer that emits its first top slice by slice: each final slice
    is encoded at once (`codec.encode_slice`, with the scratch the layer hands over)."""

    def __init__(self, codec):
        self.codec = codec

    def bind(self, step, arrays, xp, stats):
        layer, codec = step.layer, self.codec
        x, y, p, saved, ws = _layer_arrays(step, arrays, ("x", "y", "p", "saved", "ws"))
        enc = arrays_for(arrays, step.args["enc"])
        top = y[0]

        def emit(n0, n1, scale, scratch):
            codec.scale_encode_slice(xp, top[n0:n1], scale, enc, n0, n1, scratch)
        return lambda: layer.forward(xp, x, y, p, saved, ws, emit=emit)


class MaskBackward:
    """The backward from the decoded 1-bit mask of the kept top (Layer.mask_backward)."""

    def bind(self, step, arrays, xp, stats):
        layer = step.layer
        mask, gy, gx = arrays[step.args["y"][0]], arrays[step.args["gy"][0]], arrays_for(arrays, step.args["gx"])[0]
        ws = arrays_for(arrays, step.args["ws"])
        return lambda: layer.backward_from_mask(xp, mask, gy, gx, ws)


class IdentityBackward:
    """gx = gy: the fused ReLU->MaxPool code made the pool's backward drop the gradient
    wherever the ReLU's output was not positive (Layer.gradient_only_where_positive)."""

    def bind(self, step, arrays, xp, stats):
        gy, gx = arrays[step.args["gy"][0]], arrays_for(arrays, step.args["gx"])[0]
        return lambda: None if gx is gy or gx is None else xp.copyto(gx, gy)


class StreamedBackward:
    """A backward whose stashes in `streams` ({slice buffer: (codec, tensor, enc, ws)}) are
    encoded per sample. A layer that reads them slice by slice itself (Layer.stream_chunk)
    gets a StreamedStash in their place; an elementwise layer (Layer.elementwise) runs once
    per slice of the stash, on that slice of every tensor."""

    def __init__(self, streams):
        self.streams = streams

    def bind(self, step, arrays, xp, stats):
        layer = step.layer
        roles = ("x", "y", "gy", "gx", "p", "gp", "saved", "ws")
        bound = _layer_arrays(step, arrays, roles)
        readers = _readers(self.streams, arrays, xp, stats)
        chunk = min(reader.chunk_samples for reader in readers.values())
        for role in (0, 1):     # x, y
            bound[role] = [readers.get(n, a) for n, a in zip(step.args[roles[role]], bound[role])]
        if not layer.elementwise:
            return lambda: layer.backward(xp, *bound)
        x, y, gy, gx, p, gp, saved, ws = bound
        batch = next(a for a in (*y, *x) if a is not None).shape[0]

        def cut(values, part):
            if isinstance(values, dict):
                return {key: value[part] for key, value in values.items()}
            return [None if value is None else value[part] for value in values]

        def run():
            for n0 in range(0, batch, chunk):
                part = slice(n0, n0 + chunk)
                # scratch is the leading rows (a layer's workspace may hold fewer than the batch)
                scratch = slice(0, min(batch, n0 + chunk) - n0)
                layer.backward(xp, cut(x, part), cut(y, part), cut(gy, part), cut(gx, part), p, gp,
                               cut(saved, part), cut(ws, scratch))
        return run
