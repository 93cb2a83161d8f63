"""The products of a device program as cuBLAS calls: `C = op(A) op(B)`, column-major, strided batches.

cuBLAS is column-major; hspmd's arrays are row-major. A row-major `C[M, N] = X[M, K] Y[K, N]`
is the column-major `C^T[N, M] = Y^T[N, K] X^T[K, M]`, and a row-major array is the column-major
array of its transpose with the same leading dimension: so the call takes Y as A and X as B,
with no copy and no transpose flag. A transpose in the product (a weight's gradient `X^T G`)
is a flag, never a copy. `gemm_for(op, ...)` gives the call of each product op of the graph
dialect (`CUDA_GEMM`): a plain or batched `graph.matmul` (same batch dims, or rows times one
2-D weight: the rows merged into one product), `graph.matmul_rhs_grad` (leading dims merged),
and the experts' products (batched over the experts).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
from xdsl.ir import Operation


@dataclass(frozen=True)
class Gemm:
    """One strided-batched GEMM in cuBLAS's terms: for each of `batch` problems,
    `C = op(A) @ op(B)` with op(A) [m, k], op(B) [k, n], C [m, n], all column-major with leading
    dimensions `lda`, `ldb`, `ldc`; `transa`/`transb`: A/B stored transposed; `stride_*`: the
    elements between the batch's problems. `a`, `b`: which operand of the op is A, which B.
    `dtype`: of A, B and C (float32, float64, bfloat16, float16; products accumulate in float32,
    float64 for float64); `tf32`: float32 operands rounded to TF32 on the tensor cores."""

    transa: bool
    transb: bool
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    stride_a: int
    stride_b: int
    stride_c: int
    batch: int
    a: int
    b: int
    dtype: np.dtype
    tf32: bool = False


def _rowmajor(a: int, b: int, rows: int, inner: int, cols: int, batch: int, dtype: np.dtype,
              transposed_x: bool = False, transposed_y: bool = False) -> Gemm:
    """The call of row-major `C[rows, cols] = X[rows, inner] Y[inner, cols]` (X is operand `a`, Y
    operand `b`; `transposed_x`: X is stored as [inner, rows], its transpose; `transposed_y`: Y as
    [cols, inner]), `batch` times with contiguous problems."""
    return Gemm(transposed_y, transposed_x, cols, rows, inner, inner if transposed_y else cols,
                rows if transposed_x else inner, cols, inner * cols, rows * inner, rows * cols, batch, b, a, dtype)


def gemm_for(op: Operation, in_shapes: list[tuple[int, ...]], out_shape: tuple[int, ...], dtype: np.dtype,
             transposed: tuple[bool, bool] = (False, False), tf32: bool = False) -> Gemm:
    """Return the cuBLAS call computing product op `op` on contiguous operands of `in_shapes`
    (the shapes the op sees); `transposed[i]`: operand i is the transpose of its last two dims
    (`device-kernels`' `gemm_transpose`), its memory holding the array it was transposed from;
    `tf32`: a float32 product on TF32 tensor cores."""
    g = _gemm_for(op, in_shapes, out_shape, dtype, transposed)
    return dataclasses.replace(g, tf32=True) if tf32 and np.dtype(dtype) == np.float32 else g


def _gemm_for(op: Operation, in_shapes: list[tuple[int, ...]], out_shape: tuple[int, ...], dtype: np.dtype,
              transposed: tuple[bool, bool]) -> Gemm:
    a, b = in_shapes[0], in_shapes[1]
    ta, tb = transposed
    match op.name:
        case "graph.matmul" | "graph.expert_matmul":
            if len(b) == 2:  # rows times one 2-D matrix (a weight): one product of the rows merged
                if ta and len(a) > 2:
                    raise ValueError("a transposed left operand times a 2-D matrix: its rows do not merge")
                return _rowmajor(0, 1, math.prod(a[:-1]), a[-1], b[-1], 1, dtype, ta, tb)
            return _rowmajor(0, 1, a[-2], a[-1], b[-1], math.prod(a[:-2]), dtype, ta, tb)
        case "graph.matmul_rhs_grad" | "graph.expert_matmul_rhs_grad" if ta or tb:
            raise ValueError(f"'{op.name}' on a transposed operand")
        case "graph.matmul_rhs_grad":  # [..., m, k]^T [..., m, n], every leading dim merged
            return _rowmajor(0, 1, a[-1], math.prod(a[:-1]), out_shape[-1], 1, dtype, transposed_x=True)
        case "graph.expert_matmul_rhs_grad":  # per expert e: a[e]^T g[e]
            return _rowmajor(0, 1, a[-1], a[-2], out_shape[-1], a[0], dtype, transposed_x=True)
    raise ValueError(f"'{op.name}' is not a product a GEMM computes")


def numpy_gemm(g: Gemm, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None:
    """Compute `g` as cuBLAS does, on flat host arrays holding A, B and C (for the emulated device
    and for tests of the mapping): views with the leading dimensions and strides, one product
    per problem of the batch (NumPy's BLAS, its transposes as flags too)."""
    item = a.itemsize

    def matrix(flat: np.ndarray, rows: int, cols: int, ld: int, stride: int) -> np.ndarray:
        # column-major [rows, cols] with leading dimension ld: element (i, j) at i + j * ld
        return np.lib.stride_tricks.as_strided(flat, (g.batch, rows, cols), (stride * item, item, ld * item),
                                               writeable=False)

    ra, ca = (g.k, g.m) if g.transa else (g.m, g.k)
    rb, cb = (g.n, g.k) if g.transb else (g.k, g.n)
    op_a = matrix(a, ra, ca, g.lda, g.stride_a)
    op_b = matrix(b, rb, cb, g.ldb, g.stride_b)
    if g.transa:
        op_a = op_a.transpose(0, 2, 1)
    if g.transb:
        op_b = op_b.transpose(0, 2, 1)
    out = np.lib.stride_tricks.as_strided(c, (g.batch, g.m, g.n), (g.stride_c * item, item, g.ldc * item))
    # computed as the row-major product it stands for (C^T = op(B)^T op(A)^T): the same BLAS call
    # as the CPU backend's for the same arrays, so the same bits
    x, y = op_b.transpose(0, 2, 1), op_a.transpose(0, 2, 1)
    if g.tf32:  # the tensor cores read float32 operands as TF32: 10 mantissa bits, rounded to nearest
        x, y = round_to_tf32(x), round_to_tf32(y)
    np.copyto(out.transpose(0, 2, 1), np.matmul(x, y))


def round_to_tf32(x: np.ndarray) -> np.ndarray:
    """Return float32 `x` rounded to TF32's 10 mantissa bits (to nearest, ties away from zero;
    infinities and NaNs kept): the emulation's model of a TF32 product's operands (a GPU's own
    conversion may round otherwise in the last TF32 bit; tests allow for it)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    finite = (bits & 0x7F800000) != 0x7F800000
    rounded = np.where(finite, (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000), bits)
    return rounded.astype(np.uint32).view(np.float32)
