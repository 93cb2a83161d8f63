"""Nodes on one machine, with a slow link between them: a communicator that delays what crosses
nodes by a link's latency and bandwidth, and counts the bytes that cross.

`SlowLinks(inner, node_of, latency_s, bytes_per_s)` does every call through `inner` (the data move
as fast as the machine moves them) and then waits as long as the same traffic would take on the
link between nodes: for a message to a rank of another node, the sender waits for the bytes to
leave (bytes / bandwidth) and the receiver for them to arrive (latency + bytes / bandwidth). A
collective over a group that spans nodes waits, on each rank, for the bytes it exchanges with the
other nodes' members as `MPICommunicator` moves them (below), plus a latency per phase; a
non-blocking one waits at its `wait`, so that work done in between hides the link as it would.

Bytes a rank sends across nodes, for M bytes of its buffer over a group of n with r members on
other nodes (MPICommunicator's algorithms): all-reduce 2 r M / n (reduce-scatter, all-gather;
r M for two members or below its small size: whole buffers), all-gather r M, reduce-scatter and
all-to-all r M / n, broadcast r M at the root. `cross_node_bytes` adds them up on this rank.

The default link is 10 Gb Ethernet as measured between two hosts (`LINK_LATENCY_S`,
`LINK_BYTES_PER_S`); `HSPMD_SLOW_LINK=latency_us:GB/s` sets another (benchmarks/hier_allreduce.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np

from hspmd.runtime.comm.base import Communicator, Group, Request
from hspmd.runtime.comm.forward import Forwarding
from hspmd.runtime.comm.mpi import SMALL_ALL_REDUCE_BYTES

__all__ = ["LINK_BYTES_PER_S", "LINK_LATENCY_S", "SlowLinks", "link_from_env"]

#: a 10 Gb Ethernet link between two hosts, TCP, as measured: 25 us one way, 1.1 GB/s
LINK_LATENCY_S = 25e-6
LINK_BYTES_PER_S = 1.1e9

VARIABLE = "HSPMD_SLOW_LINK"


def link_from_env(env=None) -> tuple[float, float] | None:
    """Return (latency in seconds, bytes per second) of `HSPMD_SLOW_LINK` (`latency_us:GB/s`; `1` for
    the default link), None where it is not set."""
    text = (os.environ if env is None else env).get(VARIABLE, "")
    if not text:
        return None
    if text == "1":
        return LINK_LATENCY_S, LINK_BYTES_PER_S
    try:
        latency, rate = (float(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"{VARIABLE}={text!r}: expected latency_us:GB/s, e.g. 25:1.1") from None
    return latency * 1e-6, rate * 1e9


class _Delayed(Request):
    """A started operation that also waits, at `wait`, until its traffic would have crossed the link
    (`until`: wall clock)."""

    def __init__(self, inner: Request, until: float) -> None:
        super().__init__()
        self._inner, self._until = inner, until

    def test(self) -> bool:
        return self._inner.test() and time.time() >= self._until

    def wait(self) -> np.ndarray:
        result = self._inner.wait()
        _sleep_until(self._until)
        return result


def _sleep_until(deadline: float) -> None:
    """Return at `deadline` (wall clock), or at once when it has passed."""
    left = deadline - time.time()
    if left > 0:
        time.sleep(left)


#: the tag of the arrival-time header sent before a message that crosses nodes (one per payload tag)
HEADER_TAG = 30000


class SlowLinks(Forwarding):
    """`inner` with the link between nodes slowed to `latency_s` and `bytes_per_s` (module docstring).

    This rank's link to other nodes carries one message at a time (`_link_free`: when the bytes
    already given to it will have left). A message to another node goes with a small header
    saying when it arrives (wall clock: the simulated nodes share one machine's), and the
    receiver waits until then."""

    def __init__(self, inner: Communicator, node_of: Sequence[int], latency_s: float = LINK_LATENCY_S,
                 bytes_per_s: float = LINK_BYTES_PER_S) -> None:
        super().__init__(inner)
        self.node_of, self.latency_s, self.bytes_per_s = tuple(node_of), float(latency_s), float(bytes_per_s)
        #: bytes this rank sent to ranks of other nodes so far
        self.cross_node_bytes = 0
        self._link_free = 0.0  # wall clock

    def _remote(self, group: Sequence[int]) -> int:
        here = self.node_of[self.rank]
        return sum(1 for r in group if self.node_of[r] != here)

    def _occupy(self, nbytes: float, phases: int = 1) -> float:
        """Return when `nbytes` given to this rank's link now will have arrived (wall clock), in
        `phases` rounds of a latency each; the link is busy until they have left."""
        now = time.time()
        if nbytes <= 0:
            return now
        self.cross_node_bytes += int(nbytes)
        self._link_free = max(now, self._link_free) + nbytes / self.bytes_per_s
        return self._link_free + phases * self.latency_s

    def _all_reduce_bytes(self, buf: np.ndarray, group: Sequence[int]) -> tuple[float, int]:
        n, r, m = len(group), self._remote(group), np.asarray(buf).nbytes
        if not r:
            return 0.0, 0
        if n == 2 or m < SMALL_ALL_REDUCE_BYTES:
            return float(r * m), 1
        return 2.0 * r * m / n, 2

    def all_reduce(self, buf, group, out=None):
        deadline = self._occupy(*self._all_reduce_bytes(buf, group))
        result = self.inner.all_reduce(buf, group, out)
        _sleep_until(deadline)
        return result

    def iall_reduce(self, buf, group, out=None):
        deadline = self._occupy(*self._all_reduce_bytes(buf, group))
        return _Delayed(self.inner.iall_reduce(buf, group, out), deadline)

    def _collective(self, nbytes: float, call):
        deadline = self._occupy(nbytes)
        result = call()
        _sleep_until(deadline)
        return result

    def all_gather(self, buf, group, axis, out=None, **kwargs):
        return self._collective(self._remote(group) * np.asarray(buf).nbytes,
                                lambda: self.inner.all_gather(buf, group, axis, out, **kwargs))

    def iall_gather(self, buf, group, axis, out=None):
        deadline = self._occupy(self._remote(group) * np.asarray(buf).nbytes)
        return _Delayed(self.inner.iall_gather(buf, group, axis, out), deadline)

    def reduce_scatter(self, buf, group, axis, out=None):
        return self._collective(self._remote(group) * np.asarray(buf).nbytes / len(group),
                                lambda: self.inner.reduce_scatter(buf, group, axis, out))

    def all_to_all(self, buf, group, split_axis, concat_axis, out=None):
        return self._collective(self._remote(group) * np.asarray(buf).nbytes / len(group),
                                lambda: self.inner.all_to_all(buf, group, split_axis, concat_axis, out))

    def broadcast(self, buf, group, root, out=None):
        sent = self._remote(group) * np.asarray(buf).nbytes if self.rank == root else 0
        return self._collective(sent, lambda: self.inner.broadcast(buf, group, root, out))

    def _crosses(self, peer: int) -> bool:
        return self.node_of[peer] != self.node_of[self.rank]

    def _header(self, buf, dest: int, tag: int) -> Request | None:
        """Send the arrival time of `buf` to `dest` ahead of it, where it crosses nodes."""
        if not self._crosses(dest):
            return None
        arrives = self._occupy(np.asarray(buf).nbytes)
        return self.inner.isend(np.array([arrives]), dest, HEADER_TAG + int(tag) % 2000)

    def _arrival(self, source: int, tag: int) -> float:
        """Return when the message from `source` arrives (its header), or now within a node."""
        if not self._crosses(source):
            return 0.0
        return float(self.inner.recv(np.empty(1), source, HEADER_TAG + int(tag) % 2000)[0])

    def send(self, buf, dest, tag=0):
        header = self._header(buf, dest, tag)
        self.inner.send(buf, dest, tag)
        if header is not None:
            header.wait()
            _sleep_until(self._link_free)  # a blocking send returns once its bytes have left

    def isend(self, buf, dest, tag=0):
        header = self._header(buf, dest, tag)
        req = self.inner.isend(buf, dest, tag)
        return req if header is None else _Delayed(req, self._link_free)

    def recv(self, out, source, tag=0):
        arrives = self._arrival(source, tag)
        result = self.inner.recv(out, source, tag)
        _sleep_until(arrives)
        return result

    def irecv(self, out, source, tag=0):
        return Communicator.irecv(self, out, source, tag)  # received at wait, after its header

    def sendrecv(self, buf, dest, out, source, sendtag=0, recvtag=0):
        header = self._header(buf, dest, sendtag)
        arrives = self._arrival(source, recvtag)
        result = self.inner.sendrecv(buf, dest, out, source, sendtag, recvtag)
        if header is not None:
            header.wait()
        _sleep_until(max(arrives, self._link_free if header is not None else 0.0))
        return result
