"""Per-worker clocks of a parameter server and the rule that admits a pull (ps-lite's SSP handler).

A worker's clock counts the steps it has pushed. A worker about to compute step t (its clock is
t - 1) pulls; the pull is answered when t - 1 - (the slowest live worker's clock) is at most the
bound: 0 under BSP (everyone has pushed step t - 1, so every worker sees the same parameters),
S under SSP:S, no bound under ASP. That difference is the step's *staleness*. A worker that is
done (or gone) no longer holds the others back.

>>> c = Clocks(2, bound=1)
>>> c.tick(0); c.admits(2), c.admits(3)
(True, False)
"""

from __future__ import annotations


class Clocks:
    """The clocks of `workers` workers under a staleness `bound` (None: ASP, no bound)."""

    def __init__(self, workers: int, bound: int | None) -> None:
        self.clock = [0] * workers
        self.live = set(range(workers))
        self.bound = bound

    def tick(self, worker: int) -> None:
        """Count one more pushed step of `worker`."""
        self.clock[worker] += 1

    def retire(self, worker: int) -> None:
        """Stop waiting for `worker` (it is done, or it died)."""
        self.live.discard(worker)

    def slowest(self) -> int:
        """Return the smallest clock among live workers (the largest of all when none is live)."""
        return min((self.clock[w] for w in self.live), default=max(self.clock, default=0))

    def staleness(self, step: int) -> int:
        """Return how many steps the slowest live worker is behind one that computes `step`."""
        return max(0, step - 1 - self.slowest())

    def admits(self, step: int) -> bool:
        """Return whether a pull for `step` may be answered now."""
        return self.bound is None or self.staleness(step) <= self.bound
