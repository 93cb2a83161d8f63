"""Small batched products split over the batch, one BLAS thread per half, on two threads.

NumPy multiplies a batch of matrices one product at a time. Attention's products are small
(64 of them per call, 128 x 64 by 64 x 128 in GPT-tiny): OpenBLAS splits each over its
threads and waits for them at its end, a wait paid 64 times per call; the block products of
`triangular_matmul` are smaller still and run on one thread. `BatchSplit` instead runs the two
halves of the batch at once, on the calling thread and one worker, each product on one BLAS
thread (OpenBLAS's thread count is set to 1 for the call and restored after it). NumPy releases
the GIL inside BLAS, so the two halves run on two cores.

Values are those of the whole call: each product is the same BLAS call, and OpenBLAS splits a
product over threads by rows and columns of the result, never along the sum. But on some shapes
and CPUs OpenBLAS picks another kernel when it runs on one thread (the 33 x 1000 @ 1000 x 65
product of `blas_threads`; attention's products on an AMD EPYC), so each kind of call is first
checked once both ways (`blas_threads.OneThreadBits`) and runs whole where the bits differ.
Nothing is split where BLAS has one thread already (an MPI rank given one core,
`blas_threads="auto"` choosing one), or where the batch's leading dim is 1.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hspmd.runtime.cpu.blas_threads import BlasCount, OneThreadBits

#: products of at most this many multiply-adds (m * n * k) count as small
SMALL_PRODUCT = 1 << 21


def small_batched(a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> bool:
    """Return whether `a @ b` of these shapes is a batch (the same leading dims, the first at
    least 2) of small products (`SMALL_PRODUCT`)."""
    if len(a_shape) < 3 or len(a_shape) != len(b_shape) or a_shape[:-2] != b_shape[:-2] or a_shape[0] < 2:
        return False
    m, k = a_shape[-2:]
    return m * k * b_shape[-1] <= SMALL_PRODUCT


class BatchSplit:
    """Runs a batched product kernel by halves of the batch on two threads (see the module docstring)."""

    def __init__(self) -> None:
        self._blas = BlasCount()
        self._bits = OneThreadBits(self._blas)
        self._pool: ThreadPoolExecutor | None = None
        #: whether the latest call ran by halves
        self.last_split = False

    def wrap(self, kernel: Callable) -> Callable:
        """Return `kernel(a, b, out=None)` (an `out=` product over a batch) run by halves."""

        def split(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
            threads = self._blas.get()
            self.last_split = False
            if threads < 2 or a.shape[0] < 2:
                return kernel(a, b, out=out)
            if out is None:
                out = np.empty(a.shape[:-1] + b.shape[-1:], np.result_type(a, b))
            if not self._bits.same(kernel, (a, b), out, threads):
                return kernel(a, b, out=out)
            self.last_split = True
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hspmd-batch")
            h = a.shape[0] // 2
            self._blas.set(1)
            try:
                other = self._pool.submit(kernel, a[h:], b[h:], out=out[h:])
                kernel(a[:h], b[:h], out=out[:h])
                other.result()
            finally:
                self._blas.set(threads)
            return out

        split.accepts_out = True  # type: ignore[attr-defined]
        split.__name__ = f"{getattr(kernel, '__name__', 'matmul')}_by_halves"
        return split
