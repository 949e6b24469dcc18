"""Matrix products over stacks of matrices, without the operand copies CuPy would make.

CuPy's matmul of 3+-dimensional operands makes every operand C-contiguous first and computes
into a temporary when `out` is not C-contiguous (cupy/_core/_routines_linalg.pyx, matmul),
while its 2-D product takes C- or F-contiguous operands as they are (a transposed view is
F-contiguous). The backward passes multiply by transposed stacks (dW = gy x^T, W^T gy): on
such operands `matmul` here runs one 2-D product per matrix of the stack. numpy reads any
strides itself, and keeps its one call (the same bytes as before).
"""
import itertools

import numpy as np


def matmul(xp, a, b, out):
    """out[...] = a @ b, with numpy's broadcasting of the leading axes; `out` C-contiguous."""
    if xp is np or max(a.ndim, b.ndim) <= 2 or (a.flags.c_contiguous and b.flags.c_contiguous):
        xp.matmul(a, b, out=out)
        return
    lead = out.shape[:-2]
    a_lead, b_lead = a.shape[:-2], b.shape[:-2]
    for index in itertools.product(*(range(n) for n in lead)):
        xp.matmul(a[_broadcast(index, a_lead)], b[_broadcast(index, b_lead)], out=out[index])


def _broadcast(index, shape):
    """The leading index of an operand with leading `shape` (numpy's broadcasting rules)."""
    index = index[len(index) - len(shape):]
    return tuple(i if n > 1 else 0 for i, n in zip(index, shape))
