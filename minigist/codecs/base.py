"""The codec contract.

A codec stores one stashed tensor in another form between its last forward use and its
first backward use. It knows its encoded size from the shape alone (or, for data-dependent
codecs such as SSDC, from a planned bound), declares every buffer it writes, and encodes and
decodes through `xp` into the arrays it is handed:

    codec.encoded(shape)          -> {name: TensorDecl}   the encoded form (planned buffers)
    codec.workspace(shape, phase) -> {name: TensorDecl}   scratch for "encode" / "decode"
    codec.decoded_dtype(dtype)    -> the dtype decode writes (float32, or bool for a mask)
    codec.encode(xp, x, enc, ws)  -> None, or for bounded codecs True when it fit
    codec.decode(xp, enc, out, ws)
    codec.encode_measured(xp, x, enc, ws) -> (encode's result, density(xp, x)) for a
                                   data-dependent codec, counting the data once

`lossless` says whether decode(encode(x)) gives back exactly what the backward needs.
"""


class Codec:
    name = None
    lossless = True
    data_dependent = False     # True: the encoded size depends on the data (SSDC); such a
                               # codec also has density(xp, x), what its capacity must hold

    def encoded(self, shape):
        raise NotImplementedError

    def workspace(self, shape, phase):
        return {}

    def decoded_dtype(self, dtype):
        return dtype

    def encode(self, xp, x, enc, ws):
        raise NotImplementedError

    def decode(self, xp, enc, out, ws):
        raise NotImplementedError

    def encode_measured(self, xp, x, enc, ws):
        """encode, and the density its capacity had to hold (a codec that counts anyway
        overrides this to count once)."""
        density = self.density(xp, x)
        return self.encode(xp, x, enc, ws), density

    def encoded_nbytes(self, shape):
        import numpy as np
        return sum(int(np.prod(d.shape)) * np.dtype(d.dtype).itemsize for d in self.encoded(shape).values())
