"""The HET cache (Miao et al., VLDB'22): hot embedding rows kept on a worker, staleness bounded.

`cache=ROWS:B` (B defaults to S under `consistency=ssp:S`) lets each worker keep up to ROWS rows
of each table it pulled. A cached row is used without asking a server for B steps after it was
fetched (so a value a worker computes with misses at most the updates of B of its own steps,
on top of what the consistency model already allows); after that, or once evicted (least recently used first), it
is pulled again. Gradients of cached rows are summed on the worker and pushed when the row
is about to be refreshed or is evicted (and at the end of the run), so a hot row costs one
pull and one push every B + 1 steps instead of one each per step. B = 0 caches nothing (BSP). The worker's table array
holds the values; the cache keeps only which rows are valid, since when, and their pending
gradients.
"""

from __future__ import annotations

import numpy as np


class RowCache:
    """The cache of one table on one worker: `capacity` rows valid for `bound` steps after a pull."""

    def __init__(self, capacity: int, bound: int | None, shape: tuple[int, int], dtype) -> None:
        if bound is None:
            raise ValueError("the HET cache needs a staleness bound (consistency=ssp:S)")
        rows, dim = shape
        self.capacity, self.bound = int(capacity), int(bound)
        self.cached = np.zeros(rows, bool)
        self.fetched = np.zeros(rows, np.int64)
        self.last_used = np.zeros(rows, np.int64)
        self.pending = np.zeros((rows, dim), dtype)
        self.has_pending = np.zeros(rows, bool)

    def missing(self, rows: np.ndarray, step: int) -> np.ndarray:
        """Return the rows of `rows` (distinct ids) that must be pulled at `step`: not cached, or
        fetched more than `bound` steps ago. Marks all of them used at `step`."""
        valid = self.cached[rows] & (step - self.fetched[rows] <= self.bound)
        self.last_used[rows] = step
        return rows[~valid]

    def store(self, rows: np.ndarray, step: int) -> None:
        """Mark `rows` pulled at `step`; evict the least recently used rows beyond the capacity."""
        self.cached[rows] = True
        self.fetched[rows] = step
        held = np.flatnonzero(self.cached)
        extra = len(held) - self.capacity
        if extra > 0:
            victims = held[np.argpartition(self.last_used[held], extra - 1)[:extra]]
            self.cached[victims] = False

    def accumulate(self, rows: np.ndarray, grads: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Add the gradients of `rows` at `step`; return (rows, summed gradients) to push now: rows
        not cached, and cached rows that must be pulled again at the next step."""
        self.pending[rows] += grads
        self.has_pending[rows] = True
        owed = np.flatnonzero(self.has_pending)
        due = owed[~self.cached[owed] | (step + 1 - self.fetched[owed] > self.bound)]
        return self._take(due)

    def flush(self) -> tuple[np.ndarray, np.ndarray]:
        """Return (rows, gradients) of every pending gradient (the run's end)."""
        return self._take(np.flatnonzero(self.has_pending))

    def _take(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        grads = self.pending[rows].copy()
        self.pending[rows] = 0
        self.has_pending[rows] = False
        return rows.astype(np.int64), grads
