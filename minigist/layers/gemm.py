"""Matrix products over stacks of matrices, without the operand copies CuPy would make.

CuPy's matmul of 3+-dimensional operands makes every operand C-contiguous first and computes
into a temporary when `out` is not C-contiguous (cupy/_core/_routines_linalg.pyx, matmul),
while its 2-D product takes C- or F-contiguous operands as they are (a transposed view is
F-contiguous). The backward passes multiply by transposed stacks (dW = gy x^T, W^T gy). On
the GPU such a stack goes to cuBLAS's strided batched GEMM, which reads each matrix row- or
column-major with a fixed stride between matrices, so one call covers what would be one 2-D
product per sample (a pointwise convolution's backward at batch 128: 128 launches, the host's
time rather than the device's). Leading axes that no single stride covers, and stacks whose
matrices are neither row- nor column-major, take one 2-D product per matrix. numpy reads any
strides itself, and keeps its one call (the same bytes as before).
"""
import itertools

import numpy as np

from ..gpu import kernels as gpu_kernels


def matmul(xp, a, b, out):
    """out[...] = a @ b, with numpy's broadcasting of the leading axes; `out` C-contiguous."""
    if xp is not np and not (_whole(a) and _whole(b)) and gpu_kernels.serves(xp) and single_plan(a, b, out) \
            and gpu_kernels.strided_gemm_usable(xp):
        # a block of a matrix's columns (a leading dimension past its width): CuPy would copy it
        gpu_kernels.strided_gemm(xp, a, b, out, (1, 0, 0, 0))
        return
    if xp is np or max(a.ndim, b.ndim) <= 2 or (a.flags.c_contiguous and b.flags.c_contiguous):
        xp.matmul(a, b, out=out)
        return
    plan = batched_plan(a, b, out) if gpu_kernels.serves(xp) else None
    if plan is not None and gpu_kernels.strided_gemm_usable(xp):
        outer, batch = plan
        axes = out.ndim - 2
        for index in itertools.product(*(range(n) for n in outer)):
            gpu_kernels.strided_gemm(xp, a[_lead(index, a, axes)], b[_lead(index, b, axes)], out[index], batch)
        return
    lead = out.shape[:-2]
    a_lead, b_lead = a.shape[:-2], b.shape[:-2]
    for index in itertools.product(*(range(n) for n in lead)):
        xp.matmul(a[_broadcast(index, a_lead)], b[_broadcast(index, b_lead)], out=out[index])


def _whole(x):
    """Whether CuPy's 2-D product reads x as it is: C- or F-contiguous."""
    return x.flags.c_contiguous or x.flags.f_contiguous


def single_plan(a, b, out):
    """Whether one cuBLAS GEMM computes the 2-D product: float32 matrices, each row- or
    column-major with any leading dimension, `out` row-major."""
    if not (a.ndim == b.ndim == out.ndim == 2 and a.dtype == b.dtype == out.dtype == np.float32):
        return False
    layout = matrix_layout(out.shape, out.strides)
    return (layout is not None and layout[0] == "row" and matrix_layout(a.shape, a.strides) is not None
            and matrix_layout(b.shape, b.strides) is not None)


def _broadcast(index, shape):
    """The leading index of an operand with leading `shape` (numpy's broadcasting rules)."""
    index = index[len(index) - len(shape):]
    return tuple(i if n > 1 else 0 for i, n in zip(index, shape))


def _lead(index, operand, axes):
    """`operand`'s index for the outer `index` over the first of the output's `axes` leading
    axes (numpy's broadcasting: the operand's axes align right, its axes of one take 0)."""
    pad = axes - (operand.ndim - 2)
    return tuple(i if operand.shape[t - pad] > 1 else 0 for t, i in enumerate(index) if t >= pad)


def batched_plan(a, b, out):
    """(outer shape, batch) where one strided batched GEMM per outer index computes the
    product: `batch` (count, stride of a, of b, of out, in elements) covers the innermost
    leading axes of the output that one stride per operand walks (0 where an operand is
    broadcast). None where float32 matrices are not all row- or column-major, or `out`'s are
    not row-major."""
    if not (a.dtype == b.dtype == out.dtype == np.float32) or out.ndim < 3:
        return None
    lead = out.shape[:-2]
    strides = [_lead_strides(x, len(lead)) for x in (a, b, out)]
    if any(matrix_layout(x.shape[-2:], x.strides[-2:]) is None for x in (a, b)):
        return None
    layout = matrix_layout(out.shape[-2:], out.strides[-2:])
    if layout is None or layout[0] != "row":
        return None
    # the innermost run of leading axes that one stride per operand covers
    count, first = 1, len(lead)
    step = None
    for axis in reversed(range(len(lead))):
        if lead[axis] == 1:
            first = axis
            continue
        here = tuple(s[axis] for s in strides)
        if step is None:
            step = here
        elif any(h != st * count for h, st in zip(here, step)):
            break
        count *= lead[axis]
        first = axis
    if step is None:
        step = (0, 0, 0)
    return tuple(lead[:first]), (count,) + step


def _lead_strides(x, axes):
    """Element strides of x's leading axes against the output's `axes` leading axes (0 where x
    is broadcast)."""
    lead = x.shape[:-2]
    pad = axes - len(lead)
    return [0] * pad + [s // x.itemsize if n > 1 else 0 for n, s in zip(lead, x.strides[:-2])]


def matrix_layout(shape, strides):
    """("row", leading dimension) or ("column", leading dimension) of a float32 matrix in
    elements, as cuBLAS reads it; None where it is neither."""
    rows, cols = shape
    row_step, col_step = strides[0] // 4, strides[1] // 4
    if strides[0] % 4 or strides[1] % 4:
        return None
    if cols == 1 or col_step == 1:
        ld = row_step if rows > 1 else cols
        if ld >= max(1, cols):
            return "row", ld
    if rows == 1 or row_step == 1:
        ld = col_step if cols > 1 else rows
        if ld >= max(1, rows):
            return "column", ld
    return None
