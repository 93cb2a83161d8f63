"""Prefetched all-gathers at run time: a non-blocking `iall_gather`, polls and a wait.

Which all-gathers start early, where, and where they are waited on is decided with the schedule
(`hspmd.codegen.schedule.prefetch`); `Gather` is what the plan runs for each `gather-start`,
`gather-poll` and `gather-wait` step of one prefetched gather. The result is the communicator's
`iall_gather`, whose values are `all_gather`'s, so prefetch changes no number.
"""

from __future__ import annotations

import numpy as np

from hspmd.runtime.comm.base import Communicator, Request


class Gather:
    """One prefetched all-gather: `start(piece)` returns its result's array (filled by `wait()`)."""

    def __init__(self, communicator: Communicator, group: tuple[int, ...], axis: int,
                 shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.communicator, self.group, self.axis = communicator, group, axis
        self.shape, self.dtype = shape, dtype
        self.request: Request | None = None

    def start(self, piece: np.ndarray) -> np.ndarray:
        """Start gathering `piece` from every member; return the array the result lands in (not
        to be read before `wait`)."""
        out = np.empty(self.shape, self.dtype)
        self.request = self.communicator.iall_gather(np.ascontiguousarray(piece), self.group, self.axis, out=out)
        return out

    def done(self) -> bool:
        """Return whether the gather has completed (letting it progress: MPI moves data of
        non-blocking operations only when called)."""
        return self.request is None or self.request.test()

    def wait(self, *_held) -> None:
        """Return once the result is complete (`_held`: the result and the piece, which the
        schedule keeps alive until here)."""
        if self.request is not None:
            self.request.wait()
            self.request = None


def gather_poller(gathers: list[Gather]):
    """Return the call that lets the gathers of `gathers` progress: the first one not complete is
    tested (one test drives MPI's progress for every request in flight)."""

    def poll() -> None:
        for g in gathers:
            if not g.done():
                return

    return poll
