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
from collections.abc import Iterator
from contextlib import contextmanager

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
