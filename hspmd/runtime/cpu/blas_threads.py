"""BLAS threads chosen by measurement: a plan's matmuls on all of BLAS's threads or on one.

On a quiet machine a step's products run about twice as fast on both cores of the 2-core
machine as on one. On one shared with other work they can run several times *slower*: each
product waits at its end for a BLAS thread the kernel has descheduled (measured, GPT-tiny,
load 8 on 2 cores: 1.4 s a step on one thread, 2.5 to 8.4 s on two). `BlasThreads` times
every step (`Plan.run` runs each step inside `around_step`) and keeps the faster of the two:

* each is tried once on the first steps;
* then the faster by its latest times runs; the other is tried again when the one running
  gets much slower than its best (the machine's load changed), and at least every
  `probe_every` steps;
* BLAS's thread count is restored after every step (a benchmark's own NumPy products in the
  same process are not affected).

Values mostly do not depend on the choice: OpenBLAS splits a product by rows and columns of
the result, so GPT-tiny's products give the same bits on one thread and on two; but for some
shapes it picks another kernel on one thread (a 33x1000 @ 1000x65 product differs in the last
bits; tests/test_blas_threads.py). So the choice is opt-in (`build_plan(blas_threads="auto")`,
`HSPMD_BLAS_THREADS=auto`), and a run that must repeat bit for bit leaves it off.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

class BlasCount:
    """BLAS's thread count in this process, read and set per call (the libraries found once).

    For the runtime's paths that run products on one BLAS thread each, on threads of their own,
    and restore the count after (`batch_split`, `paired_matmul`, `small_matmul`)."""

    def __init__(self) -> None:
        from threadpoolctl import ThreadpoolController

        self._libs = ThreadpoolController().select(user_api="blas").lib_controllers

    def get(self) -> int:
        """Return the thread count (the least over the BLAS libraries loaded; 1 without one)."""
        return min((lib.num_threads for lib in self._libs), default=1)

    def set(self, n: int) -> None:
        """Set every loaded BLAS library's thread count to `n`."""
        for lib in self._libs:
            lib.set_num_threads(n)


def same_bits(x: np.ndarray, y: np.ndarray) -> bool:
    """Return whether two arrays hold the same bits (NaNs and signed zeros included)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.dtype.itemsize in (1, 2, 4, 8) and x.dtype.kind in "fiub":
        ints = np.dtype(f"u{x.dtype.itemsize}")
        return bool(np.array_equal(x.view(ints), y.view(ints)))
    return np.ascontiguousarray(x).tobytes() == np.ascontiguousarray(y).tobytes()


class OneThreadBits:
    """Whether a product kernel gives the same bits on one BLAS thread as on `threads`, per call.

    OpenBLAS splits a product over its threads by rows and columns of the result, so on most
    shapes one thread gives the whole call's bits; but which kernel it runs can depend on the
    thread count and the CPU (on an AMD EPYC, OpenBLAS 0.3.31 multiplies GPT-tiny's attention
    products to other last bits on one thread than on two). The runtime's paths that run
    products on one thread each (`batch_split`, `paired_matmul`) ask this first: each call's
    kind (the kernel, its operands' shapes, strides and dtypes, the result's layout, the thread
    count) is checked once, on the call's own operands, by running it both ways; a kind whose
    bits differ keeps the whole call."""

    def __init__(self, blas: BlasCount) -> None:
        self._blas = blas
        self._known: dict[tuple, bool] = {}

    @staticmethod
    def _kind(kernel: Callable, args: tuple[np.ndarray, ...], out: np.ndarray, threads: int) -> tuple:
        return (kernel, threads, out.shape, out.strides, out.dtype.str,
                tuple((a.shape, a.strides, a.dtype.str) for a in args))

    def same(self, kernel: Callable, args: tuple[np.ndarray, ...], out: np.ndarray, threads: int) -> bool:
        """Return whether `kernel(*args, out=out)` gives the same bits on one BLAS thread as on
        `threads` (BLAS's count at the call, restored after a check)."""
        kind = self._kind(kernel, args, out, threads)
        known = self._known.get(kind)
        if known is None:
            whole, one = np.empty_like(out), np.empty_like(out)
            kernel(*args, out=whole)
            self._blas.set(1)
            try:
                kernel(*args, out=one)
            finally:
                self._blas.set(threads)
            known = self._known[kind] = same_bits(whole, one)
        return known


#: the running choice is re-measured against the other when a step takes this much longer than its best
SLOWER = 1.3


class BlasThreads:
    """The BLAS thread count of a plan's steps, chosen by measured step times (see the module docstring)."""

    def __init__(self, most: int | None = None, probe_every: int = 32) -> None:
        """`most`: the larger choice (default: BLAS's thread count now); one choice when it is 1."""
        from threadpoolctl import ThreadpoolController

        self._controller = ThreadpoolController().select(user_api="blas")
        found = max((lib["num_threads"] for lib in self._controller.info()), default=1)
        self.choices: tuple[int, ...] = tuple(sorted({1, max(1, most or found)}))
        self.probe_every = probe_every
        #: per choice: (latest seconds, best seconds), None until measured
        self.seconds: dict[int, tuple[float, float] | None] = {c: None for c in self.choices}
        self._since_probe = 0
        #: steps run on each choice so far
        self.steps: dict[int, int] = {c: 0 for c in self.choices}

    def pick(self) -> int:
        """Return the thread count of the next step."""
        unmeasured = [c for c in self.choices if self.seconds[c] is None]
        if unmeasured:
            return unmeasured[-1]
        latest = {c: s[0] for c, s in self.seconds.items() if s is not None}
        best = min(latest, key=lambda c: latest[c])
        if len(self.choices) > 1:
            slowed = latest[best] > SLOWER * self.seconds[best][1]  # type: ignore[index]
            if slowed or self._since_probe >= self.probe_every:
                self._since_probe = 0
                self.seconds[best] = (latest[best], latest[best])  # its best is now: no probe each step under load
                return next(c for c in self.choices if c != best)
        self._since_probe += 1
        return best

    def record(self, threads: int, seconds: float) -> None:
        """Record that a step on `threads` threads took `seconds`."""
        old = self.seconds[threads]
        self.steps[threads] += 1
        self.seconds[threads] = (seconds, seconds if old is None else min(old[1], seconds))

    @contextmanager
    def around_step(self) -> Iterator[int]:
        """Run the `with` block (one step) on the picked thread count, timed; yield the count."""
        if len(self.choices) == 1:
            yield self.choices[0]
            return
        threads = self.pick()
        with self._controller.limit(limits=threads):
            start = time.perf_counter()
            yield threads
            self.record(threads, time.perf_counter() - start)
