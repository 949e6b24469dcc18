"""The GPU's strided batched GEMM (layers/gemm.py, gpu/kernels.py: strided_gemm) without a GPU:
its plan of a stack into one cuBLAS call, its column-major arguments run through an emulation
of cublasSgemmStridedBatched over the arrays' own memory, and the checker's stand-in."""
import ctypes
import types

import numpy as np
import pytest

from minigist.gpu import kernels
from minigist.gpu.rules import XP
from minigist.layers.gemm import _lead, batched_plan, matmul


def _column_major(address, rows, cols, ld):
    """The matrix cuBLAS reads at `address`: element (i, j) at address + 4 (i + j ld)."""
    out = np.empty((rows, cols), np.float32)
    for j in range(cols):
        out[:, j] = np.ctypeslib.as_array((ctypes.c_float * rows).from_address(address + 4 * j * ld))
    return out


def _sgemm_strided_batched(handle, transa, transb, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c,
                           ldc, stride_c, count):
    """cuBLAS's documented semantics: C_i = alpha op(A_i) op(B_i) + beta C_i, column-major,
    alpha and beta read through host pointers, C not read where beta is 0."""
    alpha = np.ctypeslib.as_array((ctypes.c_float * 1).from_address(alpha))[0]
    beta = np.ctypeslib.as_array((ctypes.c_float * 1).from_address(beta))[0]
    assert lda >= max(1, m if transa == 0 else k) and ldb >= max(1, k if transb == 0 else n) and ldc >= max(1, m)
    for i in range(count):
        op_a = _column_major(a + 4 * i * stride_a, *((m, k) if transa == 0 else (k, m)), lda)
        op_b = _column_major(b + 4 * i * stride_b, *((k, n) if transb == 0 else (n, k)), ldb)
        product = alpha * ((op_a if transa == 0 else op_a.T).astype(np.float64)
                           @ (op_b if transb == 0 else op_b.T).astype(np.float64))
        for j in range(n):
            column = np.ctypeslib.as_array((ctypes.c_float * m).from_address(c + 4 * (i * stride_c + j * ldc)))
            column[:] = product[:, j] if beta == 0 else product[:, j] + beta * column


class _Device(np.ndarray):
    """A host array with cupy's `.data.ptr`."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


_CUBLAS = types.SimpleNamespace(sgemmStridedBatched=_sgemm_strided_batched)
_FAKE_CUPY = types.SimpleNamespace(cuda=types.SimpleNamespace(device=types.SimpleNamespace(get_cublas_handle=lambda: 0)))


def _stacks(batch, groups, rng):
    o, c, p = 6, 4, 10
    gy = rng.standard_normal((batch, groups, o, p), dtype=np.float32)
    x = rng.standard_normal((batch, groups, c, p), dtype=np.float32)
    w = rng.standard_normal((groups, o, c), dtype=np.float32)
    # a pointwise convolution's backward: dW = gy x^T per sample, gx = W^T gy; and a broadcast
    # transposed right operand
    return [(gy, lambda t: t, x, lambda t: t.transpose(0, 1, 3, 2)),
            (w, lambda t: t.transpose(0, 2, 1), gy, lambda t: t),
            (x, lambda t: t.transpose(0, 1, 3, 2), w, lambda t: t.transpose(0, 2, 1)[None])]


@pytest.mark.parametrize("batch,groups", [(4, 1), (3, 2), (1, 1), (2, 3)])
def test_the_cublas_arguments_compute_numpys_product(monkeypatch, batch, groups):
    monkeypatch.setattr(kernels, "_cublas", lambda xp: _CUBLAS)
    for a_host, view_a, b_host, view_b in _stacks(batch, groups, np.random.default_rng(3)):
        a, b = view_a(a_host.view(_Device)), view_b(b_host.view(_Device))
        expected = np.matmul(view_a(a_host).astype(np.float64), view_b(b_host).astype(np.float64))
        out = np.full(expected.shape, np.nan, np.float32).view(_Device)
        outer, plan = batched_plan(a, b, out)
        assert len(outer) <= 1 and plan[0] * int(np.prod(outer)) == batch * groups
        for index in np.ndindex(*outer):
            kernels.strided_gemm(_FAKE_CUPY, a[_lead(index, a, 2)], b[_lead(index, b, 2)], out[index], plan)
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_one_launch_per_stack_under_the_checker_with_numpys_bytes():
    rng = np.random.default_rng(5)
    for a_host, view_a, b_host, view_b in _stacks(8, 1, rng):
        a, b = view_a(XP.asarray(a_host)), view_b(XP.asarray(b_host))
        out = XP.empty(np.matmul(view_a(a_host), view_b(b_host)).shape, dtype=np.float32)
        with XP.checking() as report:
            matmul(XP, a, b, out)
        assert report.kernels == 1 and not report.all_violations()
        assert np.array_equal(np.asarray(out), np.matmul(view_a(a_host), view_b(b_host)))


def test_what_no_stride_covers_is_refused():
    x = np.zeros((4, 6, 8), np.float32)
    right, out = np.zeros((4, 4, 6), np.float32), np.zeros((4, 6, 6), np.float32)
    # neither row- nor column-major: every other column of each matrix
    assert batched_plan(x[:, :, ::2], right, out) is None
    # an output that is not row-major; float64
    assert batched_plan(x[:, :, :4], right, out.transpose(0, 2, 1)) is None
    assert batched_plan(x[:, :, :4].astype(np.float64), right, out) is None
    assert batched_plan(x[:, :, :4], right, out) == ((), (4, 48, 24, 36))
    # the self-check the GPU runs once, on the checker's stand-in
    assert kernels._strided_gives_matmul(XP)
