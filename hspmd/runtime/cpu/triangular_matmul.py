"""Products of triangular matrices by blocks: causal attention's matmuls on their non-zero part.

`triangular_matmul(triangle)` returns an `out=` kernel computing `a @ b` (batched over the
leading dims, as `np.matmul`) for a product the schedule found triangular
(`hspmd.codegen.schedule.triangular`, which says why each case holds):

* "lhs-lower": rows [r0, r1) of the result are `a[r0:r1, :r1] @ b[:r1]`;
* "lhs-upper": `a[r0:r1, r0:] @ b[r0:]`;
* "rhs-lower": columns [c0, c1) are `a[:, c0:] @ b[c0:, c0:c1]`;
* "rhs-upper": `a[:, :c1] @ b[:c1, c0:c1]`;
* "out-lower", "out-upper" (a result read only on one side of its diagonal): the full product
  (by blocks these went to OpenBLAS's small-matrix kernel: slower, other last bits).

Blocks of `TILE` rows or columns: at attention's 128 x 128 this does 5/8 of the full products'
multiply-adds, in four BLAS calls per product instead of one (at 16 rows the calls got too
small to pay, at 64 only 3/4 is saved). The terms left out are exact zeros, so the results are
the full product's where the operands are finite: to rounding for any shape (tested against
`np.matmul`), bit for bit on attention's shapes (OpenBLAS adds the terms of a dot product in
order there; for some other shapes it picks another kernel for a block). The blocks are small enough that OpenBLAS
runs each on one thread: on a machine shared with other work that also spares the products
the wait for a descheduled second BLAS thread.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hspmd.codegen.schedule.triangular import TRIANGLES

#: rows (or columns) of a block
TILE = 32


def _blocks(n: int) -> list[tuple[int, int]]:
    return [(s, min(s + TILE, n)) for s in range(0, n, TILE)]


def _lhs_lower(a, b, out):
    for r0, r1 in _blocks(a.shape[-2]):
        np.matmul(a[..., r0:r1, :r1], b[..., :r1, :], out=out[..., r0:r1, :])


def _lhs_upper(a, b, out):
    for r0, r1 in _blocks(a.shape[-2]):
        np.matmul(a[..., r0:r1, r0:], b[..., r0:, :], out=out[..., r0:r1, :])


def _rhs_lower(a, b, out):
    for c0, c1 in _blocks(b.shape[-1]):
        np.matmul(a[..., :, c0:], b[..., c0:, c0:c1], out=out[..., :, c0:c1])


def _rhs_upper(a, b, out):
    for c0, c1 in _blocks(b.shape[-1]):
        np.matmul(a[..., :, :c1], b[..., :c1, c0:c1], out=out[..., :, c0:c1])


def _full(a, b, out):
    np.matmul(a, b, out=out)


_BY_TRIANGLE = {"lhs-lower": _lhs_lower, "lhs-upper": _lhs_upper, "rhs-lower": _rhs_lower,
                "rhs-upper": _rhs_upper, "out-lower": _full, "out-upper": _full}


#: the triangle of the transposed product `b^T a^T`
_TRANSPOSED = {"lhs-lower": "rhs-upper", "lhs-upper": "rhs-lower", "rhs-lower": "lhs-upper",
               "rhs-upper": "lhs-lower", "out-lower": "out-upper", "out-upper": "out-lower"}


def _by_columns(out: np.ndarray) -> bool:
    """Return whether `out`'s matrices are laid out by columns (BLAS cannot write their rows)."""
    step = out.itemsize
    return out.ndim >= 2 and out.shape[-1] > 1 and out.strides[-1] != step and out.strides[-2] == step


def triangular_matmul(triangle: str) -> Callable:
    """Return the `out=` kernel of `a @ b` for a product shaped as `triangle` (`TRIANGLES`).

    An `out=` laid out by columns (the schedule placed the result so: `schedule.placement`) gets
    the transposed product `b^T a^T` written into its transpose, whose rows BLAS can write.
    """
    if triangle not in TRIANGLES:
        raise ValueError(f"unknown triangle '{triangle}' (expected one of {', '.join(TRIANGLES)})")
    blocks, transposed = _BY_TRIANGLE[triangle], _BY_TRIANGLE[_TRANSPOSED[triangle]]

    def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            out = np.empty(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]),
                           np.result_type(a, b))
        if _by_columns(out):
            t = out.swapaxes(-1, -2)
            if max(a.shape[-2], b.shape[-1]) <= TILE:
                np.matmul(b.swapaxes(-1, -2), a.swapaxes(-1, -2), out=t)
            else:
                transposed(b.swapaxes(-1, -2), a.swapaxes(-1, -2), t)
            return out
        if max(a.shape[-2], b.shape[-1]) <= TILE:
            return np.matmul(a, b, out=out)
        blocks(a, b, out)
        return out

    matmul.accepts_out = True  # type: ignore[attr-defined]
    matmul.__name__ = f"matmul_{triangle.replace('-', '_')}"
    return matmul
