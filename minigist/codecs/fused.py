"""The fused ReLU->MaxPool code (Gist's Binarize, in its fused form).

A ReLU whose only consumers are max-pools needs no stash of its own: one code per pool output
tells both backward passes what they need (see FusedReluPool).
"""
import numpy as np

from ..gpu import kernels as gpu_kernels
from ..layers.base import TensorDecl
from . import kernels
from .base import Codec


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
        ws = {f"packed.{k}": v for k, v in self.packed.workspace(shape, phase).items()}
        if phase == "encode":
            ws["codes"] = TensorDecl(shape, np.uint8)
            ws["positive"] = TensorDecl(shape, np.bool_)
        return ws

    def encode(self, xp, x, enc, ws):
        argmax, pool_out = x
        codes, positive = ws["codes"], ws["positive"]
        if argmax.dtype == np.uint8 and pool_out.dtype == np.float32 and self.packed.bits == 4 \
                and gpu_kernels.serves(xp):     # the codes and their packing in one pass
            gpu_kernels.relu_pool_pack(xp, argmax.reshape(-1), pool_out.reshape(-1), enc["codes"], self.positions,
                                       (self.encode, (x, enc, ws)))
            return
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
