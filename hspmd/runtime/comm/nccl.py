"""The communicator on device memory: NCCL through `cupy.cuda.nccl`, over explicit groups of global ranks.

For ranks that each hold a GPU of their own (`select.choose_transport` says "nccl"): NCCL
refuses two ranks on one device, so ranks that share a GPU exchange through the host instead
(host-staged MPI, the NumPy `Communicator`).

Groups are tuples of global ranks, as in `base.py`: member i of a group is NCCL rank i of the
group's NCCL communicator, and the order of the tuple is the order of the chunks (all-gather,
reduce-scatter, all-to-all). A group's NCCL communicator is made on first use (or by
`open_groups`), collectively over its members: the group's first rank makes the unique id and
sends it to the others through the host communicator (`MPICommunicator` in a run, over mpi4py),
tagged with the group's size and checksum, so members that open groups in different orders get
a `CommError` instead of a wrong communicator. The id is `bytes`, as CuPy 14's `get_unique_id`
makes it and its `NcclCommunicator(ndev, commId, rank)` takes it (CuPy 13's tuple of ints is
accepted too). Point-to-point traffic (pipeline sends) runs on the communicator of the pair (or
of a group the caller names), and several sends and receives go as one grouped call
(`exchange`: `groupStart` ... `groupEnd`), which is how NCCL pairs them without deadlock;
all-to-all is such a group of sends and receives.

Buffers are arrays in device memory: `hspmd.runtime.cuda.device.DeviceArray`s (or anything
with a pointer `ptr`, a `shape` and a `dtype`), contiguous; every call is queued on a CUDA
stream (the one given to the constructor, e.g. `CupyDevice.stream.ptr`, or per call) and
returns once queued, as NCCL does: order later work on the same stream, or synchronise.

Sums are NCCL's, whose order depends on its algorithm (ring, tree): results equal the left
fold in group order of `base.py` within rounding, not bit for bit.

`cupy` is imported when a communicator is made without an `nccl` module, not when this module
is: the module imports on machines without CuPy, and tests give a stand-in `nccl` module.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .base import CommError, Communicator, Group, normalize_group

__all__ = ["NcclCommunicator", "nccl_dtype", "id_bytes", "ID_TAG"]

#: the host-communicator tag of the messages that carry a group's NCCL unique id
ID_TAG = 0x6E63
#: bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`)
ID_BYTES = 128

#: NumPy dtype name -> the name of NCCL's data type in `cupy.cuda.nccl`
_DTYPES = {
    "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "bool": "NCCL_UINT8", "int32": "NCCL_INT32",
    "uint32": "NCCL_UINT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64", "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "bfloat16": "NCCL_BFLOAT16",
}


def nccl_dtype(nccl: Any, dtype: Any, summed: bool = False) -> int:
    """Return NCCL's data type for NumPy `dtype` (CommError where NCCL has none, or where
    `summed` and the dtype is bool, which moves as bytes but does not add)."""
    name = np.dtype(dtype).name
    if name not in _DTYPES or (summed and name == "bool") or not hasattr(nccl, _DTYPES[name]):
        raise CommError(f"NCCL cannot {'sum' if summed else 'move'} arrays of {name}")
    return int(getattr(nccl, _DTYPES[name]))


def id_bytes(uid: Any) -> bytes:
    """Return an NCCL unique id as its `ID_BYTES` bytes: `get_unique_id` gives bytes from CuPy
    14 on, a tuple of signed chars before (CommError for an id of another length)."""
    raw = bytes(uid) if isinstance(uid, (bytes, bytearray)) else bytes(int(b) & 0xFF for b in uid)
    if len(raw) != ID_BYTES:
        raise CommError(f"an NCCL unique id of {len(raw)} bytes (expected {ID_BYTES})")
    return raw


def _signed_chars(uid: bytes) -> tuple[int, ...]:
    """Return id `uid` as CuPy 13's `NcclCommunicator` takes it: a tuple of signed chars."""
    return tuple(b - 256 if b > 127 else b for b in uid)


def _count(a: Any) -> int:
    return int(np.prod(a.shape, dtype=np.int64))


#: the first NCCL whose calls a CUDA graph may capture (2.9.6, as `ncclGetVersion` gives it)
CAPTURE_VERSION = 20906


class NcclCommunicator:
    """Collectives and point-to-point on device memory through NCCL (see the module docstring).

    `host` is the rank's host communicator (ranks and the unique ids go through it), `stream`
    the CUDA stream calls are queued on (a `cudaStream_t` as an int; 0: the default stream),
    `nccl` the module with NCCL's API (default `cupy.cuda.nccl`).
    """

    def __init__(self, host: Communicator, stream: int = 0, nccl: Any = None) -> None:
        if nccl is None:
            from cupy.cuda import nccl
        self.nccl = nccl
        self.host = host
        self.stream = int(stream)
        self._comms: dict[Group, Any] = {}
        self._closed = False

    @property
    def rank(self) -> int:
        """Return the caller's global rank."""
        return self.host.rank

    @property
    def captures(self) -> bool:
        """Return whether NCCL's calls may be captured in a CUDA graph (NCCL 2.9.6 and later)."""
        version = getattr(self.nccl, "get_version", None)
        try:
            return callable(version) and int(version()) >= CAPTURE_VERSION
        except Exception:  # noqa: BLE001 - a library that cannot say: not captured
            return False

    @property
    def size(self) -> int:
        """Return the number of ranks in the world."""
        return self.host.size

    # -- communicators per group ---------------------------------------------------------

    def open_groups(self, groups: Iterable[Sequence[int]]) -> None:
        """Make the NCCL communicators of those `groups` that hold the caller, in sorted order
        (collective: every member calls it with groups it shares in the same order)."""
        mine = {tuple(int(r) for r in g) for g in groups if self.rank in g}
        for g in sorted(mine):
            self.communicator(g)

    def communicator(self, group: Sequence[int]) -> Any:
        """Return the NCCL communicator of `group` (made on first use, collectively over its members)."""
        if self._closed:
            raise CommError("NcclCommunicator is closed")
        g = group if type(group) is tuple and group in self._comms else normalize_group(group, self.rank, self.size)
        comm = self._comms.get(g)
        if comm is None:
            if not getattr(self.nccl, "available", True):  # CuPy found no NCCL library (`cupy.cuda.nccl.available`)
                raise CommError(f"NCCL is not available to CuPy here: group {g} cannot sum on the GPUs (install "
                                "NCCL for CUDA, e.g. the nvidia-nccl wheel of the CUDA version CuPy was built for)")
            comm = self._open(g, self._unique_id(g))
            self._comms[g] = comm
        return comm

    def _open(self, g: Group, uid: bytes) -> Any:
        """Return the caller's NCCL communicator of group `g` with unique id `uid`. CuPy 14 on
        takes the id as `bytes` (what its `get_unique_id` returns), CuPy 13 as a tuple of 128
        signed chars: the id goes as bytes, and as the tuple where the module refuses bytes."""
        rank = g.index(self.rank)
        try:
            try:
                return self.nccl.NcclCommunicator(len(g), uid, rank)
            except TypeError:  # CuPy 13 (`tuple commId`): a typed argument refused before NCCL is called
                return self.nccl.NcclCommunicator(len(g), _signed_chars(uid), rank)
        except TypeError as err:
            raise CommError(f"cupy.cuda.nccl.NcclCommunicator takes the unique id of group {g} neither as bytes "
                            f"nor as a tuple of {ID_BYTES} ints ({err})") from None
        except Exception as err:  # noqa: BLE001 - NcclError (cupy.cuda.nccl)
            hint = ("; NCCL needs a GPU of its own per rank (ranks sharing a GPU exchange through the host)"
                    if "INVALID_USAGE" in str(err) else "")
            raise CommError(f"NCCL refused a communicator for group {g} ({type(err).__name__}: {err}){hint}") from None

    def _unique_id(self, g: Group) -> bytes:
        """Return the unique id of group `g`'s communicator: made by `g[0]`, sent to the others
        with the group's size and checksum, so that a member expecting another group finds out."""
        message = np.empty(2 + ID_BYTES, np.int64)
        mark = (len(g), zlib.crc32(np.array(g, np.int64).tobytes()))
        if self.rank == g[0]:
            uid = id_bytes(self.nccl.get_unique_id())
            message[:2], message[2:] = mark, np.frombuffer(uid, np.uint8)
            for member in g[1:]:
                self.host.send(message, member, tag=ID_TAG)
            return uid
        got = self.host.recv(message, g[0], tag=ID_TAG)
        if tuple(int(v) for v in got[:2]) != mark:
            raise CommError(f"rank {self.rank} opened NCCL group {g} but rank {g[0]} sent the id of another group "
                            f"(of {int(got[0])} ranks): members must open the groups they share in one order")
        return np.asarray(got[2:], np.int64).astype(np.uint8).tobytes()

    def close(self) -> None:
        """Destroy every NCCL communicator (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for g in sorted(self._comms):
            self._comms[g].destroy()
        self._comms.clear()

    def __enter__(self) -> NcclCommunicator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- collectives ---------------------------------------------------------------------

    def _stream(self, stream: int | None) -> int:
        return self.stream if stream is None else int(stream)

    def _check(self, what: str, buf: Any, out: Any, count: int) -> None:
        """CommError unless `out` has `buf`'s dtype and `count` elements."""
        if np.dtype(out.dtype) != np.dtype(buf.dtype):
            raise CommError(f"{what}: out has dtype {np.dtype(out.dtype)}, the buffer {np.dtype(buf.dtype)}")
        if _count(out) != count:
            raise CommError(f"{what}: out has {_count(out)} elements (shape {tuple(out.shape)}), the result {count}")

    def all_reduce(self, buf: Any, group: Sequence[int], out: Any = None, stream: int | None = None) -> Any:
        """Return `out` (default: `buf`, in place) holding the sum of the members' `buf`."""
        out = buf if out is None else out
        self._check("all_reduce", buf, out, _count(buf))
        comm = self.communicator(group)
        comm.allReduce(buf.ptr, out.ptr, _count(buf), nccl_dtype(self.nccl, buf.dtype, True), self.nccl.NCCL_SUM,
                       self._stream(stream))
        return out

    def all_gather(self, buf: Any, group: Sequence[int], out: Any, stream: int | None = None) -> Any:
        """Return `out` holding the members' `buf` one after the other in group order (along
        the leading dim: `out` has len(group) times `buf`'s elements)."""
        comm = self.communicator(group)
        n = len(self._group(group))
        self._check("all_gather", buf, out, n * _count(buf))
        comm.allGather(buf.ptr, out.ptr, _count(buf), nccl_dtype(self.nccl, buf.dtype), self._stream(stream))
        return out

    def reduce_scatter(self, buf: Any, group: Sequence[int], out: Any, stream: int | None = None) -> Any:
        """Return `out` holding chunk `group.index(rank)` (of len(group) equal chunks of `buf`'s
        elements, in order) of the sum of the members' `buf`."""
        comm = self.communicator(group)
        n = len(self._group(group))
        if _count(buf) % n:
            raise CommError(f"reduce_scatter: {_count(buf)} elements do not split into {n} equal chunks")
        self._check("reduce_scatter", buf, out, _count(buf) // n)
        comm.reduceScatter(buf.ptr, out.ptr, _count(out), nccl_dtype(self.nccl, buf.dtype, True), self.nccl.NCCL_SUM,
                           self._stream(stream))
        return out

    def broadcast(self, buf: Any, group: Sequence[int], root: int, out: Any = None, stream: int | None = None) -> Any:
        """Return `out` (default: `buf`, in place) holding the `buf` of global rank `root`."""
        g = self._group(group)
        if int(root) not in g:
            raise CommError(f"broadcast root {root} is not a member of group {g}")
        out = buf if out is None else out
        self._check("broadcast", buf, out, _count(buf))
        comm = self.communicator(g)
        comm.broadcast(buf.ptr, out.ptr, _count(buf), nccl_dtype(self.nccl, buf.dtype), g.index(int(root)),
                       self._stream(stream))
        return out

    def all_to_all(self, buf: Any, group: Sequence[int], out: Any, stream: int | None = None) -> Any:
        """Return `out` whose chunk j is chunk `group.index(rank)` of member j's `buf` (len(group)
        equal chunks of the elements, in order): one grouped call of sends and receives."""
        g = self._group(group)
        n, total = len(g), _count(buf)
        if total % n:
            raise CommError(f"all_to_all: {total} elements do not split into {n} equal chunks")
        self._check("all_to_all", buf, out, total)
        comm = self.communicator(g)
        step, item = total // n, np.dtype(buf.dtype).itemsize
        dtype, s = nccl_dtype(self.nccl, buf.dtype), self._stream(stream)
        self.nccl.groupStart()
        try:
            for j in range(n):
                comm.send(buf.ptr + j * step * item, step, dtype, j, s)
                comm.recv(out.ptr + j * step * item, step, dtype, j, s)
        finally:
            self.nccl.groupEnd()
        return out

    # -- point to point ------------------------------------------------------------------

    def exchange(self, sends: Sequence[tuple[Any, int]] = (), recvs: Sequence[tuple[Any, int]] = (),
                 group: Sequence[int] | None = None, stream: int | None = None) -> None:
        """Queue every (buffer, destination) send and (out, source) receive as one grouped NCCL
        call, peers as global ranks: on the communicator of `group` when given (it holds every
        peer), else of each pair (made first, in sorted order, so that no member waits on another).
        A receive's out must have the element count and dtype of the matching send."""
        peers = [int(p) for _, p in sends] + [int(p) for _, p in recvs]
        for p in peers:
            if not 0 <= p < self.size or p == self.rank:
                raise CommError(f"exchange: rank {p} is not another rank of a world of {self.size}")
        if group is not None:
            g = self._group(group)
            missing = [p for p in peers if p not in g]
            if missing:
                raise CommError(f"exchange: rank(s) {missing} are not in group {g}")
            comm = self.communicator(g)
            route = {p: (comm, g.index(p)) for p in peers}
        else:
            pairs = sorted({(min(self.rank, p), max(self.rank, p)) for p in peers})
            route = {}
            for pair in pairs:
                comm = self.communicator(pair)
                other = pair[0] if pair[1] == self.rank else pair[1]
                route[other] = (comm, pair.index(other))
        s = self._stream(stream)
        self.nccl.groupStart()
        try:
            for buf, dest in sends:
                comm, peer = route[int(dest)]
                comm.send(buf.ptr, _count(buf), nccl_dtype(self.nccl, buf.dtype), peer, s)
            for out, source in recvs:
                comm, peer = route[int(source)]
                comm.recv(out.ptr, _count(out), nccl_dtype(self.nccl, out.dtype), peer, s)
        finally:
            self.nccl.groupEnd()

    def send(self, buf: Any, dest: int, group: Sequence[int] | None = None, stream: int | None = None) -> None:
        """Queue the send of `buf` to global rank `dest` (a pipeline stage's activation)."""
        self.exchange(sends=[(buf, dest)], group=group, stream=stream)

    def recv(self, out: Any, source: int, group: Sequence[int] | None = None, stream: int | None = None) -> Any:
        """Return `out`, into which the message of global rank `source` is queued."""
        self.exchange(recvs=[(out, source)], group=group, stream=stream)
        return out

    def sendrecv(self, buf: Any, dest: int, out: Any, source: int, group: Sequence[int] | None = None,
                 stream: int | None = None) -> Any:
        """Return `out` filled from `source`, after sending `buf` to `dest`, as one grouped call."""
        self.exchange(sends=[(buf, dest)], recvs=[(out, source)], group=group, stream=stream)
        return out

    def _group(self, group: Sequence[int]) -> Group:
        return group if type(group) is tuple and group in self._comms else normalize_group(group, self.rank, self.size)
