"""One codec per batch sample, so that a backward step can decode a stash slice by slice.

`PerSample(inner, batch)` encodes each of the `batch` samples of a tensor (N, ...) with
`inner` (sized for one sample) into its own part of the encoded buffers. `decode_slice`
decodes samples [start, stop) alone: a convolution's backward then holds one chunk of
decoded input at a time instead of the whole FP32 tensor.
"""
import numpy as np

from ..layers.base import TensorDecl
from .base import Codec


class PerSample(Codec):
    def __init__(self, inner, batch):
        self.inner = inner
        self.batch = int(batch)
        self.name = inner.name
        self.lossless = inner.lossless
        self.data_dependent = inner.data_dependent
        self._kept = None      # (enc, per-sample slices of it): see _parts

    def _sample_shape(self, shape):
        if shape[0] != self.batch:
            raise ValueError(f"expected a batch of {self.batch}, got shape {tuple(shape)}")
        return (1,) + tuple(shape[1:])

    def encoded(self, shape):
        parts = self.inner.encoded(self._sample_shape(shape))
        return {part: TensorDecl((self.batch * int(np.prod(decl.shape)),), decl.dtype)
                for part, decl in parts.items()}

    def workspace(self, shape, phase):
        return self.inner.workspace(self._sample_shape(shape), phase)

    def decoded_dtype(self, dtype):
        return self.inner.decoded_dtype(dtype)

    def _parts(self, enc):
        """Each sample's slices of the encoded buffers, a list by sample. Kept per enc (a static
        plan hands the same arrays every step), so that the inner codec sees the same slice
        arrays too."""
        kept = self._kept
        if kept is None or len(kept[0]) != len(enc) or any(kept[0].get(k) is not v for k, v in enc.items()):
            kept = self._kept = (dict(enc), [{part: array.reshape(self.batch, -1)[i] for part, array in enc.items()}
                                             for i in range(self.batch)])
        return kept[1]

    def density(self, xp, x):
        """The densest sample's fraction of non-zeros: what each sample's capacity must hold."""
        return max(self.inner.density(xp, x[index:index + 1]) for index in range(self.batch))

    def encode(self, xp, x, enc, ws):
        if self.data_dependent:
            return self.encode_measured(xp, x, enc, ws)[0]
        parts = self._parts(enc)
        for index in range(self.batch):
            self.inner.encode(xp, x[index:index + 1], parts[index], ws)

    def encode_measured(self, xp, x, enc, ws):
        """encode, returning (True unless a sample did not fit; the densest sample's density)."""
        fitted, densest = True, 0.0
        parts = self._parts(enc)
        for index in range(self.batch):
            result, density = self.inner.encode_measured(xp, x[index:index + 1], parts[index], ws)
            fitted = fitted and result is not False
            densest = max(densest, density)
        return fitted, densest

    def encode_device(self, xp, x, enc, ws, stats, slot):
        """The inner codec's encode_device per sample (one stats slot for them all)."""
        parts = self._parts(enc)
        for index in range(self.batch):
            self.inner.encode_device(xp, x[index:index + 1], parts[index], ws, stats, slot)

    def decode_slice(self, xp, enc, start, stop, out, ws):
        """Samples [start, stop) into out[:stop - start]."""
        parts = self._parts(enc)
        for index in range(start, stop):
            self.inner.decode(xp, parts[index], out[index - start:index - start + 1], ws)

    def decode(self, xp, enc, out, ws):
        self.decode_slice(xp, enc, 0, self.batch, out, ws)
