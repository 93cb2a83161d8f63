"""Graceful leave: a rank asked to go (SIGTERM) leaves at the next step boundary, handing over its pieces.

Every rank of the run checks at each step boundary, with one all-reduce of one integer over the
ranks still running, whether any of them was asked to leave (its SIGTERM handler set a flag; for
tests, `HSPMD_LEAVE=rank:step` or `leave_at` sends it at a given step). If so, all of them switch
to the first of the run's strategies that runs on exactly the ranks that stay
(`hspmd.runtime.switch`: the leaving rank sends what the others lack, in memory), and the leaving
rank stops training; no step is lost and nothing is written to disk (docs/switching.md).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence

import numpy as np

from hspmd.runtime.comm.base import Communicator

__all__ = ["LeaveError", "LeaveSignal", "leave_target", "parse_leave"]


class LeaveError(ValueError):
    """A rank asked to leave, but no strategy of the run runs without it (or a bad HSPMD_LEAVE)."""


def parse_leave(text: str | None) -> tuple[int, int] | None:
    """Return (rank, step) from `HSPMD_LEAVE`'s `rank:step` (None for None or empty)."""
    if not text:
        return None
    try:
        rank, step = (int(x) for x in text.split(":"))
    except ValueError:
        raise LeaveError(f"HSPMD_LEAVE={text!r}: expected RANK:STEP, e.g. 2:8") from None
    return rank, step


class LeaveSignal:
    """Whether this rank was asked to leave: SIGTERM (handled when this is the main thread) or `at`."""

    def __init__(self, rank: int, at: tuple[int, int] | None = None) -> None:
        self.rank, self.at, self.asked = rank, at, False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.asked = True

    def agree(self, step: int, active: Sequence[int], comm: Communicator) -> set[int]:
        """Return the ranks of `active` asked to leave before `step` (every active rank calls this)."""
        if self.at is not None and self.at == (self.rank, step):
            if threading.current_thread() is threading.main_thread():
                os.kill(os.getpid(), signal.SIGTERM)  # the real signal, through the handler
            else:
                self.asked = True
        mask = np.array([1 << self.rank if self.asked else 0], dtype=np.int64)
        if len(active) > 1:
            mask = comm.all_reduce(mask, tuple(active))
        bits = int(mask[0])
        return {r for r in active if bits >> r & 1}


def leave_target(devices: Sequence[Sequence[int]], active: Sequence[int], gone: set[int]) -> int:
    """Return the index of the first strategy (by its devices) that runs on exactly `active` minus `gone`."""
    stay = sorted(set(active) - gone)
    if 0 in gone:
        raise LeaveError("rank 0 asked to leave; it writes the log and gathers the result, so it stays (stop the "
                         "run instead)")
    for i, d in enumerate(devices):
        if sorted(d) == stay:
            return i
    raise LeaveError(f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, sorted(gone)))} asked to leave, but "
                     f"no strategy of the run runs on ranks {stay}; give one (another --strategy)")
