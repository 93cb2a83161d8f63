"""A stand-in for `cupy.cuda.nccl` for tests without a GPU: ranks are threads, "device pointers"
are host addresses (as `EmulatedDevice`'s are), and each call moves bytes at once.

It keeps NCCL's contract strict where that finds bugs: the members of a communicator must make
it with the same id and size and distinct ranks, call the same collectives in the same order with
the same counts and data types (else `FakeNcclError`), and a receive must match its send's count
and data type. Sends and receives between `groupStart` and `groupEnd` run at `groupEnd`, sends
first, as NCCL pairs them; `calls` records every call, for tests that check what went to NCCL.

Its API is CuPy 14's (the GPU machine's): `get_unique_id()` returns the id as 128 `bytes` and
`NcclCommunicator(ndev, commId, rank)` takes `bytes` only (a tuple is a TypeError, as CuPy's
typed argument makes it). `FakeNccl13` is CuPy 13's: a tuple of 128 signed chars both ways.
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
        self._cliques: dict[bytes, _Clique] = {}
        self._local = threading.local()
        self.calls: list[tuple] = []  # (global id of the clique, rank, call name, count, datatype)
        self.ids_made = 0

    def get_unique_id(self) -> bytes:
        with self._lock:
            self.ids_made += 1
            k = next(self._ids)
        # the count in the first 8 bytes (NULs among them), then bytes over 127 (negative as C chars)
        return bytes((k >> (8 * i)) & 0xFF if i < 8 else 0x80 + i for i in range(128))

    def NcclCommunicator(self, ndev: int, commId: bytes, rank: int) -> _Comm:
        if not isinstance(commId, bytes):  # CuPy 14: `bytes commId`, a typed argument
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(commId).__name__})")
        if len(commId) != 128:
            raise ValueError(f"commId length {len(commId)} != 128.")
        return self._join(ndev, bytes(commId), rank)

    def _join(self, ndev: int, key: bytes, rank: int) -> _Comm:
        with self._lock:
            clique = self._cliques.setdefault(key, _Clique(ndev))
            if clique.n != ndev or rank in clique.ranks or not 0 <= rank < ndev:
                raise FakeNcclError(f"communicator {key[:2]!r}: rank {rank} of {ndev} does not fit")
            clique.ranks.add(rank)
        return _Comm(self, clique, tuple(key[:8]), rank)

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


class FakeNccl13(FakeNccl):
    """CuPy 13's `cupy.cuda.nccl`: the unique id a tuple of 128 signed chars, both ways."""

    def get_unique_id(self) -> tuple[int, ...]:
        return tuple(b - 256 if b > 127 else b for b in super().get_unique_id())

    def NcclCommunicator(self, ndev: int, commId: tuple[int, ...], rank: int) -> _Comm:
        if not isinstance(commId, tuple):  # CuPy 13: `tuple commId`
            raise TypeError(f"Argument 'commId' has incorrect type (expected tuple, got {type(commId).__name__})")
        assert len(commId) == 128
        return self._join(ndev, bytes(int(b) & 0xFF for b in commId), rank)


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
