"""A straggler whose slowness comes in bursts: for benchmarks and tests of SSP (`--slow-bursts F:SEED`).

Each worker draws its own schedule from `SEED` and its rank: at a step where it is not slowed,
a burst starts with probability 1/3 and lasts 1 or 2 steps (equally likely), and the step after
a burst is not slowed; so bursts of 1.5 steps on average come every 4.5 steps, and about a
third of the steps are slowed. In a slowed step its own
work (drawing the batch, asking for the pull, computing the gradients) takes `F` times as long:
the worker sleeps F - 1 times that work's time after computing. The waits for others (the
pull's reply, BSP's meeting) are not stretched: they are what the consistency model decides.

    >>> b = BurstSchedule(3.0, seed=7, rank=0)
    >>> "".join("x" if b.slowed(s) else "." for s in range(1, 25))
    '...x..x....x.x........xx'
"""

from __future__ import annotations

import numpy as np

__all__ = ["BurstSchedule", "parse_bursts"]

START = 1 / 3  # the chance that a burst starts at a step that is not slowed (nor right after one)
LENGTHS = (1, 2)  # a burst's steps, equally likely


class BurstSchedule:
    """Which steps of one worker are slowed, and by how much (see the module docstring)."""

    def __init__(self, factor: float, seed: int, rank: int) -> None:
        if factor < 1:
            raise ValueError(f"a burst slows a step by a factor >= 1, got {factor}")
        self.factor = factor
        self._rng = np.random.default_rng([seed, rank])
        self._slowed: list[bool] = []

    def slowed(self, step: int) -> bool:
        """Return whether step `step` (from 1) is in a burst."""
        while len(self._slowed) < step:
            if self._rng.random() < START:
                self._slowed += [True] * int(self._rng.choice(LENGTHS)) + [False]
            else:
                self._slowed.append(False)
        return self._slowed[step - 1]

    def extra_seconds(self, step: int, work_s: float) -> float:
        """Return how long to sleep at step `step` whose own work took `work_s` seconds."""
        return (self.factor - 1.0) * work_s if self.slowed(step) else 0.0


def parse_bursts(text: str) -> tuple[float, int]:
    """Return (factor, seed) of `--slow-bursts F:SEED` text such as `3:7`; ValueError if malformed."""
    factor, sep, seed = text.partition(":")
    try:
        out = (float(factor), int(seed))
    except ValueError:
        out = None
    if not sep or out is None or out[0] < 1:
        raise ValueError(f"--slow-bursts {text!r}: expected FACTOR:SEED (a factor >= 1, an integer seed), e.g. 3:7")
    return out
