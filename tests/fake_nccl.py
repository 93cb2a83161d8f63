"""A stand-in for `cupy.cuda.nccl` for tests without a GPU: ranks are threads, "device pointers"
are host addresses (as `EmulatedDevice`'s are), and each call moves bytes at once.

It keeps NCCL's contract strict where that finds bugs: the members of a communicator must make
it with the same id and size and distinct ranks, call the same collectives in the same order with
the same counts and data types (else `FakeNcclError`), and a receive must match its send's count
and data type. Sends and receives between `groupStart` and `groupEnd` run at `groupEnd`, sends
first, as NCCL pairs them; `calls` records every call, for tests that check what went to NCCL.
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import threading

import numpy as np

NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3
_NUMPY = {NCCL_INT8: np.int8, NCCL_UINT8: np.uint8, NCCL_INT32: np.int32, NCCL_UINT32: np.uint32,
          NCCL_INT64: np.int64, NCCL_UINT64: np.uint64, NCCL_FLOAT16: np.float16, NCCL_FLOAT32: np.float32,
          NCCL_FLOAT64: np.float64}
TIMEOUT = 20.0


class FakeNcclError(RuntimeError):
    """What NCCL would refuse (or hang on): mismatched members, calls or messages."""


def _view(ptr: int, count: int, datatype: int) -> np.ndarray:
    """Return the `count` elements of `datatype` at host address `ptr` as a writeable array."""
    dtype = np.dtype(_NUMPY[datatype])
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype, count=count)


class _Clique:
    """The shared state of one communicator's members: their deposits, a barrier, mailboxes."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.ranks: set[int] = set()
        self.barrier = threading.Barrier(n, timeout=TIMEOUT)
        self.slots: list = [None] * n
        self.mail = {(a, b): queue.Queue() for a in range(n) for b in range(n)}


class FakeNccl:
    """The module: `get_unique_id`, `NcclCommunicator`, `groupStart`/`groupEnd`, the constants."""

    def __init__(self) -> None:
        for name, value in globals().items():
            if name.startswith("NCCL_"):
                setattr(self, name, value)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._cliques: dict[tuple[int, ...], _Clique] = {}
        self._local = threading.local()
        self.calls: list[tuple] = []  # (global id of the clique, rank, call name, count, datatype)
        self.ids_made = 0

    def get_unique_id(self) -> tuple[int, ...]:
        with self._lock:
            self.ids_made += 1
            k = next(self._ids)
        return tuple(((k >> (8 * i)) & 0xFF) - 128 if i < 8 else 0 for i in range(128))

    def NcclCommunicator(self, ndev: int, commId: tuple[int, ...], rank: int) -> _Comm:
        if len(commId) != 128:
            raise FakeNcclError(f"an id of {len(commId)} bytes")
        with self._lock:
            clique = self._cliques.setdefault(tuple(commId), _Clique(ndev))
            if clique.n != ndev or rank in clique.ranks or not 0 <= rank < ndev:
                raise FakeNcclError(f"communicator {commId[:2]}: rank {rank} of {ndev} does not fit")
            clique.ranks.add(rank)
        return _Comm(self, clique, tuple(commId[:8]), rank)

    def groupStart(self) -> None:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        if self._local.depth == 1:
            self._local.pending = []

    def groupEnd(self) -> None:
        self._local.depth -= 1
        if self._local.depth == 0:
            pending, self._local.pending = self._local.pending, []
            for kind, run in sorted(pending, key=lambda p: p[0] != "send"):  # sends first, as NCCL pairs them
                run()

    def _p2p(self, kind: str, run) -> None:
        if getattr(self._local, "depth", 0):
            self._local.pending.append((kind, run))
        else:
            run()


class _Comm:
    """One member's communicator: NCCL's calls on host addresses."""

    def __init__(self, nccl: FakeNccl, clique: _Clique, key: tuple[int, ...], rank: int) -> None:
        self.nccl, self.clique, self.key, self.rank = nccl, clique, key, rank
        self.destroyed = False

    def rank_id(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.clique.n

    def destroy(self) -> None:
        self.destroyed = True

    def _collective(self, name: str, send: np.ndarray, params: tuple):
        """Deposit (name, params, a copy of send), wait for every member; return the deposits."""
        self.nccl.calls.append((self.key, self.rank, name, *params))
        c = self.clique
        c.slots[self.rank] = (name, params, send.copy())
        c.barrier.wait()
        deposits = list(c.slots)
        c.barrier.wait()  # every member has read the slots before they are reused
        if any(d[:2] != (name, params) for d in deposits):
            raise FakeNcclError(f"members disagree on the collective: {[d[:2] for d in deposits]}")
        return [d[2] for d in deposits]

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        assert op == NCCL_SUM
        parts = self._collective("allReduce", _view(sendbuf, count, datatype), (count, datatype, op))
        total = parts[0].copy()
        for p in parts[1:]:
            total += p
        _view(recvbuf, count, datatype)[:] = total

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        parts = self._collective("allGather", _view(sendbuf, count, datatype), (count, datatype))
        _view(recvbuf, count * self.clique.n, datatype)[:] = np.concatenate(parts)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        n = self.clique.n
        parts = self._collective("reduceScatter", _view(sendbuf, recvcount * n, datatype), (recvcount, datatype, op))
        mine = slice(self.rank * recvcount, (self.rank + 1) * recvcount)
        total = parts[0][mine].copy()
        for p in parts[1:]:
            total += p[mine]
        _view(recvbuf, recvcount, datatype)[:] = total

    def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream):
        parts = self._collective("broadcast", _view(sendbuf, count, datatype), (count, datatype, root))
        _view(recvbuf, count, datatype)[:] = parts[root]

    def send(self, sendbuf, count, datatype, peer, stream):
        self.nccl.calls.append((self.key, self.rank, "send", count, datatype, peer))
        data = _view(sendbuf, count, datatype).copy()
        self.nccl._p2p("send", lambda: self.clique.mail[(self.rank, peer)].put((count, datatype, data)))

    def recv(self, recvbuf, count, datatype, peer, stream):
        self.nccl.calls.append((self.key, self.rank, "recv", count, datatype, peer))

        def run() -> None:
            try:
                got_count, got_type, data = self.clique.mail[(peer, self.rank)].get(timeout=TIMEOUT)
            except queue.Empty:
                raise FakeNcclError(f"rank {self.rank} waits for a message from {peer} that never comes") from None
            if (got_count, got_type) != (count, datatype):
                raise FakeNcclError(f"rank {self.rank} receives {count} of type {datatype} from {peer}, "
                                    f"which sent {got_count} of type {got_type}")
            _view(recvbuf, count, datatype)[:] = data

        self.nccl._p2p("recv", run)
