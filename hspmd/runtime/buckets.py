"""All-reduce buckets at run time: one flat buffer, a non-blocking all-reduce, polls and a wait.

Which all-reduces share a bucket, where it starts and where it is waited on is decided with
the schedule (`hspmd.codegen.schedule.buckets`); `Bucket` is what the plan runs for each of
the schedule's `BucketSpec`s. The sums are the communicator's (`iall_reduce` gives the bits
of `all_reduce`: left folds in group order), so bucketing changes no result.
"""

from __future__ import annotations

import numpy as np

from hspmd.runtime.comm.base import Communicator, Request


class Bucket:
    """One flat buffer of all-reduce operands: `start(*operands)`, `poll()`, `wait()` -> results."""

    def __init__(self, communicator: Communicator, group: tuple[int, ...], dtype: np.dtype,
                 shapes: list[tuple[int, ...]], blocking: bool = False) -> None:
        #: sum at `start` with one blocking all-reduce (nothing runs before the wait: `BucketSpec.blocking`)
        self.blocking = blocking
        self.communicator, self.group, self.dtype = communicator, group, dtype
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        self.buffer = np.empty(max(sum(sizes), 1), dtype=dtype)
        self.views: list[np.ndarray] = []
        offset = 0
        for shape, size in zip(shapes, sizes):
            self.views.append(self.buffer[offset: offset + size].reshape(shape))
            offset += size
        self.request: Request | None = None

    def start(self, *operands: np.ndarray) -> None:
        """Copy the operands into the buffer and start the in-place all-reduce (a blocking
        bucket's ends here: the same bits, `all_reduce` and `iall_reduce` agree)."""
        for view, x in zip(self.views, operands):
            if x is not view:  # a producer that wrote into the bucket needs no copy
                np.copyto(view, x)
        if self.blocking:
            self.communicator.all_reduce(self.buffer, self.group, out=self.buffer)
            return
        self.request = self.communicator.iall_reduce(self.buffer, self.group, out=self.buffer)

    def poll(self) -> None:
        """Let the transfer progress (MPI moves data of non-blocking operations only when called)."""
        if self.request is not None and self.request.test():
            self.request.wait()
            self.request = None

    def wait(self):
        """Return the summed tensors (views of the buffer): one array, or a tuple of several."""
        if self.request is not None:
            self.request.wait()
            self.request = None
        return self.views[0] if len(self.views) == 1 else tuple(self.views)

    def nbytes(self) -> int:
        """Return the bytes of the bucket's buffer."""
        return self.buffer.nbytes

    def summary(self) -> tuple[tuple[int, ...], int, int]:
        """Return (group, number of tensors, bytes)."""
        return self.group, len(self.views), self.buffer.nbytes


def poller(buckets: list[Bucket]):
    """Return the call that lets every bucket of `buckets` progress."""

    def poll() -> None:
        for b in buckets:
            b.poll()

    return poll
