"""Batches of small float32 products in one C++ call: attention's matmuls at the machine's rate.

NumPy multiplies a batch of matrices one OpenBLAS call per product; for attention's products
(64 of them per call in GPT-tiny, 128 x 64 by 64 x 128 and the like) each call packs both
operands and splits the small product over BLAS's threads, and the batch ran at about a third
of the machine's rate. `native/small_matmul.cpp` (in the runtime's C++ library, `native.py`)
runs the whole batch in one call: each product on one
thread with an AVX-512 (or AVX2) register-blocked micro-kernel, the products shared out to
BLAS's thread count one at a time (a helper thread that is late holds nobody up), and the
triangles of causal attention (`hspmd.codegen.schedule.triangular`) skipped by 8-row tiles.

Values: each element is one chain of fused multiply-adds in the order of the sum, from +0 —
what OpenBLAS's kernels compute on attention's shapes, so the bits are those of `np.matmul`
there (tested); for other shapes OpenBLAS may add in another order (its small-matrix kernels,
its K blocks beyond a few hundred), and then the last bits differ, within a dot product's
rounding bound (a property test). The bits do not depend on the batch, the threads or the
blocking, so ranks holding different pieces of a batch compute their products alike.
A product whose result is read only on or below its diagonal ("out-lower": the scores, read
through a causal mask) gets its other elements as 0 or as their values.

`SmallMatmul.kernel(triangle)` returns the `out=` kernel; `SmallMatmul.create()` returns None
where the library cannot be built (no C++ compiler, said once), and the plan keeps NumPy's
products (`triangular_matmul`, `batch_split`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hspmd.runtime.cpu import native
from hspmd.runtime.cpu.blas_threads import BlasCount
from hspmd.runtime.kernel_exec import say_once

#: the kernel's code for each triangle (`triangular.TRIANGLES`, and "" for a full product)
TRIANGLE_CODES = {"": 0, "lhs-lower": 1, "lhs-upper": 2, "rhs-lower": 3, "rhs-upper": 4, "out-lower": 5,
                  "out-upper": 6}

#: the triangle of the transposed product `b^T a^T`
TRANSPOSED = {"": "", "lhs-lower": "rhs-upper", "lhs-upper": "rhs-lower", "rhs-lower": "lhs-upper",
              "rhs-upper": "lhs-lower", "out-lower": "out-upper", "out-upper": "out-lower"}

_F32 = np.dtype(np.float32)


def _elements(a: np.ndarray) -> list[int] | None:
    """Return `a`'s strides in elements, or None if one is not a whole number of them."""
    s = [x // a.itemsize for x in a.strides]
    return s if all(x * a.itemsize == y for x, y in zip(s, a.strides)) else None


def _batch_dims(shape: tuple[int, ...], strides: list[int]) -> tuple[int, int, int, int] | None:
    """Return (n1, n2, stride1, stride2): the leading dims as at most two batch dims, or None."""
    lead, st = shape[:-2], strides[:-2]
    if len(lead) == 1:
        return 1, lead[0], 0, st[0]
    if len(lead) == 2:
        return lead[0], lead[1], st[0], st[1]
    return None


def product_args(a: np.ndarray, b: np.ndarray, out: np.ndarray, triangle: str) -> tuple[int, ...] | None:
    """Return the arguments of the C++ kernel (`hs_small_matmul_f32`, all but the thread count)
    that compute `out = a @ b` (float32, the same leading dims, at most two of them), or None
    where it does not apply."""
    if out.strides[-1] != out.itemsize and out.strides[-2] == out.itemsize and out.shape[-1] > 1:
        # laid out by columns (placement.py): write the transposed product b^T a^T into out^T
        a, b, out, triangle = b.swapaxes(-1, -2), a.swapaxes(-1, -2), out.swapaxes(-1, -2), TRANSPOSED[triangle]
    sa, sb, sc = _elements(a), _elements(b), _elements(out)
    if sa is None or sb is None or sc is None or (sc[-1] != 1 and out.shape[-1] > 1):
        return None
    ba, bb, bc = _batch_dims(a.shape, sa), _batch_dims(b.shape, sb), _batch_dims(out.shape, sc)
    if ba is None or bb is None or bc is None:
        return None
    m, k = a.shape[-2:]
    n = b.shape[-1]
    return (ba[0], ba[1], m, n, k, a.ctypes.data, ba[2], ba[3], sa[-2], sa[-1], b.ctypes.data, bb[2], bb[3], sb[-2],
            sb[-1], out.ctypes.data, bc[2], bc[3], sc[-2], TRIANGLE_CODES[triangle])


def multiply(fn, a: np.ndarray, b: np.ndarray, out: np.ndarray, triangle: str, threads: int) -> bool:
    """Compute `out = a @ b` (float32, the same leading dims, at most two of them) with the C++
    kernel `fn`; return False, computing nothing, where it does not apply."""
    if out.size == 0:
        return True
    args = product_args(a, b, out, triangle)
    if args is None:
        return False
    fn(*args, threads)
    return True


def _takes(a: np.ndarray, b: np.ndarray, out: np.ndarray | None) -> bool:
    """Return whether the C++ kernel takes these operands (else the fallback computes them)."""
    return (a.dtype == _F32 and b.dtype == _F32 and a.ndim == b.ndim and a.ndim >= 3
            and a.shape[:-2] == b.shape[:-2] and a.shape[-1] == b.shape[-2]
            and (out is None or out.dtype == _F32))


class SmallMatmul:
    """The C++ kernel for batches of small float32 products, on BLAS's thread count (see the
    module docstring)."""

    def __init__(self, fn, threads: Callable[[], int]) -> None:
        self._fn, self._threads = fn, threads

    @classmethod
    def create(cls) -> "SmallMatmul | None":
        """Return the kernel maker, its threads following BLAS's thread count, or None where the
        library cannot be built."""
        lib, why = native.load()
        if lib is None:
            say_once(f"hspmd: {why}; small batched products run as NumPy's")
            return None
        return cls(lib.hs_small_matmul_f32, BlasCount().get)

    def kernel(self, triangle: str, fallback: Callable) -> Callable:
        """Return the `out=` kernel of `a @ b` for a product shaped as `triangle` ("" for a full
        product); operands it does not take (another dtype, other batch dims) go to `fallback`."""
        if triangle not in TRIANGLE_CODES:
            raise ValueError(f"unknown triangle '{triangle}' (expected one of {', '.join(TRIANGLE_CODES)})")
        fn, threads = self._fn, self._threads

        def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
            if not _takes(a, b, out):
                return fallback(a, b, out=out)
            if out is None:
                out = np.empty(a.shape[:-1] + b.shape[-1:], _F32)
            if not multiply(fn, a, b, out, triangle, threads()):
                return fallback(a, b, out=out)
            return out

        def chain_desc(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> list[int] | None:
            """Return this product as a step of a C++ chain (`native/chain.cpp`), or None."""
            if not _takes(a, b, out) or out.size == 0 or a.shape[:-2] != out.shape[:-2]:
                return None
            args = product_args(a, b, out, triangle)
            if args is None:
                return None
            d = list(args)
            if d[0] == 1 and d[1] == out.shape[0] != 1:  # one batch dim: make it the first (sliced)
                d[0], d[1] = d[1], 1
                for i in (6, 11, 16):  # each operand's two batch strides
                    d[i], d[i + 1] = d[i + 1], 0
            return [0, *d[1:]] if d[0] == out.shape[0] else None

        matmul.accepts_out = True  # type: ignore[attr-defined]
        matmul.chain_desc = chain_desc  # type: ignore[attr-defined]
        matmul.__name__ = f"small_matmul_{triangle.replace('-', '_') or 'full'}"
        return matmul
