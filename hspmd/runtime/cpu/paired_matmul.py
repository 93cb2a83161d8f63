"""Two large independent products at once, one BLAS thread each: a layer's input and weight gradients.

The backward of `y = x @ w` is two products of the same size that do not read each other:
`dx = dy @ w^T` (`graph.matmul`) and `dw = x^T dy` (`graph.matmul_rhs_grad`); the schedule
puts them next to each other. OpenBLAS runs each on all its threads and joins them at the end,
and on some shapes splits them unevenly (GPT-tiny's 256 x 2048 @ 2048 x 1024 weight gradient
ran at 0.8 of the large-shape rate). `ProductPairs` runs such a pair as two one-thread products
on two threads instead: the first step hands its product to a helper thread and returns its
(preallocated) result at once; the second computes its own product on the calling thread, then
waits for the helper. OpenBLAS's thread count is 1 between the two steps and restored after.
Linux wakes the helper on the CPU of the thread that wakes it, where both products then shared
one core (a pair took twice as long as the two products one after the other), so the helper
keeps itself off the caller's CPU, as the runtime's parallel loop does (`native/parallel.cpp`).

Values: OpenBLAS splits a product over its threads by rows and columns of the result, never
along the sum, so a product on one thread is mostly the whole call's; on some shapes and CPUs a
one-thread OpenBLAS picks another kernel, as `batch_split` says, so each product's kind of call
is checked once both ways (`blas_threads.OneThreadBits`), and a pair runs one after the other
where either product's bits differ (`tests/test_paired_matmul.py`). A pair is run one after the
other also where BLAS has one thread at the time of the call (a rank given one core,
`blas_threads="auto"` choosing one) or where the second product's result shares memory with
the first's operands (a buffer the schedule reuses).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from hspmd.runtime.cpu.blas_threads import BlasCount, OneThreadBits

#: products of at least this many multiply-adds (m * n * k) each are paired: smaller ones
#: (GPT-tiny's 2048 x 256 x 256) ran slower on one thread each than one after the other
PAIR_PRODUCT = 1 << 28

#: the ops whose kernels are one 2-D BLAS product
_PRODUCTS = ("graph.matmul", "graph.matmul_rhs_grad")


def product_size(name: str, a_shape: Sequence[int], b_shape: Sequence[int]) -> int:
    """Return the multiply-adds of a `graph.matmul` (rows times a 2-D matrix) or
    `graph.matmul_rhs_grad` of these operand shapes; 0 for other ops and batched products."""
    if name not in _PRODUCTS or len(b_shape) < 2 or (name == "graph.matmul" and len(b_shape) != 2):
        return 0
    return int(np.prod(a_shape, dtype=np.int64)) * int(b_shape[-1])


class ProductPairs:
    """Runs pairs of adjacent large products on two threads (see the module docstring)."""

    def __init__(self) -> None:
        self._blas = BlasCount()
        self._bits = OneThreadBits(self._blas)
        self._pool: ThreadPoolExecutor | None = None
        self._cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self._avoid = -1  # the CPU the helper keeps off (it alone reads and writes this)
        try:
            self._sched_getcpu = ctypes.CDLL(None).sched_getcpu
        except (OSError, AttributeError):  # not Linux: no pinning
            self._sched_getcpu = None

    def _caller_cpu(self) -> int:
        return self._sched_getcpu() if self._sched_getcpu is not None else -1

    def _off(self, cpu: int, fn: Callable, args: tuple, kw: dict):
        """Run `fn(*args, **kw)` on the helper thread, first moved off CPU `cpu`."""
        if cpu != self._avoid and cpu in self._cpus and len(self._cpus) > 1:
            os.sched_setaffinity(0, self._cpus - {cpu})  # 0: this thread
            self._avoid = cpu
        return fn(*args, **kw)

    def pair(self, first: Callable, first_kw: dict, second: Callable, second_kw: dict) -> tuple[Callable, Callable]:
        """Return the kernels of two adjacent steps (`first(*args, **first_kw)`, then `second`'s)
        that run both products at once. Both steps write into preallocated results (`out=`), and
        the second does not read the first's result (the caller checks)."""
        pending: list[tuple[Future, int]] = []
        second_same: list[bool | None] = [None]  # whether the second keeps its bits on one thread

        def launch(*args: np.ndarray, **kw) -> np.ndarray:
            threads = self._blas.get()
            out = kw["out"]
            later = second_kw.get("out")
            if threads < 2 or later is None or any(np.may_share_memory(later, a) for a in (*args, out)):
                return first(*args, **kw)
            if second_same[0] is False or not self._bits.same(first, args, out, threads):
                return first(*args, **kw)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hspmd-pair")
            self._blas.set(1)
            try:
                pending.append((self._pool.submit(self._off, self._caller_cpu(), first, args, kw), threads))
            except BaseException:
                self._blas.set(threads)
                raise
            return out

        def join(*args: np.ndarray, **kw) -> np.ndarray:
            if not pending:
                return second(*args, **kw)
            other, threads = pending.pop()
            if second_same[0] is None:
                # the second's bits on one thread not yet checked: the first finishes, BLAS's
                # count is restored, the check runs, and the second runs whole
                try:
                    other.result()
                finally:
                    self._blas.set(threads)
                second_same[0] = self._bits.same(second, args, kw["out"], threads)
                return second(*args, **kw)
            try:
                return second(*args, **kw)
            finally:
                try:
                    other.result()
                finally:
                    self._blas.set(threads)

        launch.accepts_out = join.accepts_out = True  # type: ignore[attr-defined]
        launch.__name__ = getattr(first, "__name__", "matmul")
        join.__name__ = getattr(second, "__name__", "matmul")
        return launch, join
