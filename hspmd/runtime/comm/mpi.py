"""The communicator over MPI (mpi4py), for runs started with ``mpiexec`` / ``hspmd run``.

mpi4py is imported when an :class:`MPICommunicator` is created, not when this module is.

Determinism: MPI is used only to *move* bytes (Alltoall(v), Allgather(v), Bcast, Send/Recv,
all on ``MPI.BYTE``); every sum is computed locally by NumPy as the left fold in group order
(:func:`~.base.fold_sum`).  MPI's own reductions are not used where their order depends on
the algorithm MPI picks (message size, process count, placement); the exception is a sum
over two ranks of float32/float64/int32/int64, where ``MPI_SUM`` can only compute ``a + b``
or ``b + a`` (the same bits): ``all_reduce`` and ``iall_reduce`` then call ``Allreduce`` /
``Iallreduce`` directly, the fastest path.

Algorithms (n = len(group), M = bytes of ``buf``):

* ``all_reduce``: for ``M < small_all_reduce_bytes`` (default 256 KiB) every member gathers all buffers
  (one Allgather) and folds them itself.  Above it, a reduce-scatter + all-gather: the flat
  buffer is cut into n near-equal pieces, piece j of every member goes to member j
  (Alltoallv), member j folds the n copies of its piece in group order, and the folded
  pieces are gathered into the result (Allgatherv).  Each rank sends and receives
  2 (n-1)/n M bytes, like a ring all-reduce, and the bits equal a whole-buffer fold since
  addition is elementwise.
* ``reduce_scatter``: the same first half along ``axis`` (Alltoall of the chunks, local fold).
* ``all_gather``: Allgatherv; members' extents along ``axis`` are exchanged first (one small
  Allgather) unless ``sizes=`` gives them.
* ``all_to_all``: Alltoall of the chunks, then a local concatenation along ``concat_axis``.

Sub-communicators are created on first use of a group (``Comm.Create_group``, collective
over the group's members only) and cached per group tuple; rank i of the sub-communicator is
``group[i]``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .base import (
    CommError,
    Communicator,
    Group,
    Request,
    as_buffer,
    check_out,
    chunk_bounds,
    fold_sum,
    normalize_axis,
    normalize_group,
    split_equal,
)

__all__ = ["MPICommunicator", "SMALL_ALL_REDUCE_BYTES"]

#: Below this many bytes, all_reduce gathers whole buffers (fewer steps, more bytes).
SMALL_ALL_REDUCE_BYTES = 256 * 1024

#: persistent two-member sums kept per communicator (one per bucket buffer)
PERSISTENT_SUMS = 64

_TAG_CREATE_GROUP = 7301


def _bytes(a: np.ndarray) -> np.ndarray:
    """Return a C-contiguous array's memory as a flat uint8 view."""
    return a.reshape(-1).view(np.uint8)


def _scatter_counts(total: int, n: int, idx: int, item: int):
    """Return the byte counts of a reduce-scatter by all-to-all, then all-gather, of `total` elements over `n` members.

    (chunk bounds, this member's chunk length, (send counts, displacements), (receive counts,
    displacements), (gather counts, displacements)): chunk j of every member goes to member j,
    nothing to oneself; member `idx` receives the n-1 copies of its chunk into rows of an
    (n, mine) array; the summed chunks are then gathered in place at their bounds.
    """
    bounds = chunk_bounds(total, n)
    mine = bounds[idx + 1] - bounds[idx]
    counts = [(bounds[j + 1] - bounds[j]) * item for j in range(n)]
    displs = [b * item for b in bounds[:-1]]
    send_counts = list(counts)
    send_counts[idx] = 0
    recv_counts = [mine * item] * n
    recv_counts[idx] = 0
    return bounds, mine, (send_counts, displs), (recv_counts, [j * mine * item for j in range(n)]), (counts, displs)


class MPICommunicator(Communicator):
    """A :class:`~.base.Communicator` over an MPI communicator (default ``MPI.COMM_WORLD``).

    The given communicator is duplicated, so messages of this object never mix with the
    caller's own MPI traffic.  Creating one is collective over ``comm``; so is :meth:`close`.
    """

    def __init__(self, comm: Any = None, *, small_all_reduce_bytes: int = SMALL_ALL_REDUCE_BYTES) -> None:
        from mpi4py import MPI

        #: all_reduce of fewer bytes gathers whole buffers instead of reduce-scatter + all-gather.
        self.small_all_reduce_bytes = small_all_reduce_bytes

        self._MPI = MPI
        base = MPI.COMM_WORLD if comm is None else comm
        self._comm = base.Dup()
        # Point-to-point traffic gets its own context, apart from group creation's tags.
        self._p2p = self._comm.Dup()
        self._rank = self._comm.Get_rank()
        self._size = self._comm.Get_size()
        self._world_group: Group = tuple(range(self._size))
        self._subcomms: dict[Group, Any] = {}
        self._groups: dict[Any, Group] = {}
        self._closed = False
        self._scratch_bufs: dict[int, np.ndarray] = {}
        self._persistent: dict[tuple, Any] = {}  # (group, address, bytes, dtype) -> a persistent sum
        # dtypes whose MPI_SUM of two buffers is NumPy's a + b, and their MPI datatypes
        self._sum_types = {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE,
                           np.dtype(np.int32): MPI.INT32_T, np.dtype(np.int64): MPI.INT64_T}

    # -- basics --------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def mpi_comm(self) -> Any:
        """Return the (duplicated) MPI communicator used for the world."""
        return self._comm

    def check_group(self, group: Sequence[int]) -> Group:
        key = group if type(group) is tuple else tuple(group)
        g = self._groups.get(key)
        if g is None:
            g = normalize_group(key, self._rank, self._size)
            self._groups[key] = g
        return g

    def _sub(self, g: Group) -> Any:
        """Return the MPI communicator whose rank i is ``g[i]`` (created on first use)."""
        if self._closed:
            raise CommError("MPICommunicator is closed")
        c = self._subcomms.get(g)
        if c is None:
            if g == self._world_group:
                c = self._comm
            else:
                mpi_group = self._comm.Get_group()
                sub_group = mpi_group.Incl(list(g))
                try:
                    c = self._comm.Create_group(sub_group, _TAG_CREATE_GROUP)
                finally:
                    sub_group.Free()
                    mpi_group.Free()
            self._subcomms[g] = c
        return c

    def _scratch(self, slot: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """Return a reusable uninitialised array (scratch ``slot``; valid until the next call)."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = self._scratch_bufs.get(slot)
        if raw is None or raw.nbytes < nbytes:
            raw = np.empty(max(nbytes, 64), dtype=np.uint8)
            self._scratch_bufs[slot] = raw
        return raw[:nbytes].view(dtype).reshape(shape)

    def _contiguous(self, buf: np.ndarray, axis: int = 0) -> np.ndarray:
        """Return ``buf`` with ``axis`` first, C-contiguous (``buf`` itself, or scratch slot 2)."""
        moved = np.moveaxis(buf, axis, 0) if axis else buf
        if moved.flags.c_contiguous:
            return moved
        tmp = self._scratch(2, moved.shape, buf.dtype)
        np.copyto(tmp, moved)
        return tmp

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for req in self._persistent.values():
            req.Free()
        self._persistent.clear()
        for g in sorted(self._subcomms):
            c = self._subcomms[g]
            if c is not self._comm:
                c.Free()
        self._subcomms.clear()
        self._scratch_bufs.clear()
        self._p2p.Free()
        self._comm.Free()

    # -- collectives ---------------------------------------------------------------------

    def all_reduce(self, buf, group, out=None):
        buf, g = self.check_all_reduce(buf, group, out)
        n = len(g)
        if n == 1:
            return _result(buf, out)
        c = self._sub(g)
        mpi_type = self._sum_type(buf.dtype) if n == 2 else None
        if mpi_type is not None:  # a + b == b + a: MPI's own sum is the left fold
            target = out if out is not None and out.flags.c_contiguous else np.empty(buf.shape, buf.dtype)
            if target is buf or (target.base is not None and np.shares_memory(target, buf)):
                if target is not buf:
                    np.copyto(target, buf)
                c.Allreduce(self._MPI.IN_PLACE, [target.reshape(-1), mpi_type], op=self._MPI.SUM)
            else:
                c.Allreduce([self._contiguous(buf).reshape(-1), mpi_type], [target.reshape(-1), mpi_type],
                            op=self._MPI.SUM)
            if out is not None and target is not out:
                np.copyto(out, target)
                return out
            return target
        flat = self._contiguous(buf).reshape(-1)
        total = flat.size
        if total < n or flat.nbytes < self.small_all_reduce_bytes:
            everyone = self._scratch(0, (n, total), buf.dtype)
            c.Allgather(_bytes(flat), _bytes(everyone))
            return fold_sum([row.reshape(buf.shape) for row in everyone], out)

        # Reduce-scatter: piece j of every member goes to member j (nothing is sent to
        # oneself), member j folds the n copies in group order straight into its slice of
        # the result, then the slices are gathered in place.
        idx = c.Get_rank()
        bounds, mine, send, recv, gather = _scatter_counts(total, n, idx, buf.dtype.itemsize)
        pieces = self._scratch(0, (n, mine), buf.dtype)
        B = self._MPI.BYTE
        c.Alltoallv([_bytes(flat), *send, B], [_bytes(pieces), *recv, B])
        own = flat[bounds[idx] : bounds[idx + 1]]
        terms = [own if j == idx else pieces[j] for j in range(n)]
        direct = out is not None and out.flags.c_contiguous
        target = out.reshape(-1) if direct else np.empty(total, dtype=buf.dtype)
        slot = target[bounds[idx] : bounds[idx + 1]]
        if idx > 0 and np.shares_memory(slot, own):  # in place: own is read after slot is written
            fold_sum(terms, self._scratch(1, (mine,), buf.dtype))
            np.copyto(slot, self._scratch(1, (mine,), buf.dtype))
        else:
            fold_sum(terms, slot)
        c.Allgatherv(self._MPI.IN_PLACE, [_bytes(target), *gather, B])
        if direct:
            return out
        if out is not None:
            np.copyto(out, target.reshape(buf.shape))
            return out
        return target.reshape(buf.shape)

    def _sum_type(self, dtype: np.dtype) -> Any:
        """Return the MPI datatype whose MPI_SUM of two buffers is NumPy's ``a + b`` (None if none)."""
        return self._sum_types.get(dtype)

    def iall_reduce(self, buf, group, out=None):
        """Start an all-reduce without blocking; the result's bits are those of :meth:`all_reduce`.

        Two members: MPI's Iallreduce (SUM is commutative for two terms, so it is the left
        fold). More: the pieces move with Ialltoallv (the reduce-scatter's traffic overlaps
        the caller's work), and ``wait`` folds this member's piece in group order and
        gathers the folded pieces (Allgatherv); below ``small_all_reduce_bytes`` every
        member gathers all buffers (Iallgather) and folds them in ``wait``.
        """
        if out is buf and type(buf) is np.ndarray and buf.flags.c_contiguous and buf.flags.writeable:
            g = self._groups.get(group)  # the hot path of gradient buckets: in place, two members
            mpi_type = self._sum_types.get(buf.dtype)
            if g is not None and len(g) == 2 and mpi_type is not None:
                req = self._persistent_sum(g, buf, mpi_type)
                req.Start()
                return _MPIRequest(req, lambda: buf)
        buf, g = self.check_all_reduce(buf, group, out)
        n = len(g)
        if n == 1:
            return Request(_result(buf, out))
        c = self._sub(g)
        MPI = self._MPI
        mpi_type = self._sum_type(buf.dtype) if n == 2 else None
        if mpi_type is not None:
            target = out if out is not None and out.flags.c_contiguous else np.empty(buf.shape, buf.dtype)
            if target is buf or (target.base is not None and np.shares_memory(target, buf)):
                if target is not buf:
                    np.copyto(target, buf)
                req = c.Iallreduce(MPI.IN_PLACE, [target.reshape(-1), mpi_type], op=MPI.SUM)
            else:
                send = np.ascontiguousarray(buf).reshape(-1)
                req = c.Iallreduce([send, mpi_type], [target.reshape(-1), mpi_type], op=MPI.SUM)

            def finish() -> np.ndarray:
                if out is not None and target is not out:
                    np.copyto(out, target)
                    return out
                return target

            return _MPIRequest(req, finish)
        flat = np.array(buf, copy=True).reshape(-1)  # the caller may reuse buf before wait
        total = flat.size
        if total < n or flat.nbytes < self.small_all_reduce_bytes:
            everyone = np.empty((n, total), dtype=buf.dtype)
            req = c.Iallgather(_bytes(flat), _bytes(everyone))
            return _MPIRequest(req, lambda: fold_sum([row.reshape(buf.shape) for row in everyone], out))
        idx = c.Get_rank()
        bounds, mine, send, recv, gather = _scatter_counts(total, n, idx, buf.dtype.itemsize)
        pieces = np.empty((n, mine), dtype=buf.dtype)
        B = MPI.BYTE
        req = c.Ialltoallv([_bytes(flat), *send, B], [_bytes(pieces), *recv, B])

        def finish() -> np.ndarray:
            own = flat[bounds[idx]: bounds[idx + 1]]
            fold_sum([own if j == idx else pieces[j] for j in range(n)], pieces[idx])
            direct = out is not None and out.flags.c_contiguous
            target = out.reshape(-1) if direct else flat
            target[bounds[idx]: bounds[idx + 1]] = pieces[idx]
            c.Allgatherv(MPI.IN_PLACE, [_bytes(target), *gather, B])
            if direct:
                return out
            if out is not None:
                np.copyto(out, flat.reshape(buf.shape))
                return out
            return flat.reshape(buf.shape)

        return _MPIRequest(req, finish, collective_finish=True)

    def _persistent_sum(self, g: Group, buf: np.ndarray, mpi_type: Any) -> Any:
        """Return the persistent in-place sum of `buf` over the two members `g` (MPI-4's
        `Allreduce_init`, made at the first sum of this buffer, then only started): a bucket sums
        the same buffer every step, and a started persistent request skips the set-up that every
        `Iallreduce` call makes again. At most `PERSISTENT_SUMS` are kept (the oldest freed)."""
        key = (g, buf.ctypes.data, buf.nbytes, buf.dtype)
        req = self._persistent.get(key)
        if req is None:
            if len(self._persistent) >= PERSISTENT_SUMS:
                self._persistent.pop(next(iter(self._persistent))).Free()
            req = self._persistent[key] = self._sub(g).Allreduce_init(
                self._MPI.IN_PLACE, [buf.reshape(-1), mpi_type], op=self._MPI.SUM)
        return req

    def all_gather(self, buf, group, axis, out=None, sizes: Sequence[int] | None = None):
        """Return the concatenation of the members' ``buf`` along ``axis``, in group order.

        ``sizes`` (optional) gives every member's extent along ``axis`` in group order and
        saves the exchange of extents.
        """
        buf = as_buffer(buf, "all_gather")
        g = self.check_group(group)
        axis = normalize_axis(axis, buf.ndim)
        n = len(g)
        if n == 1:
            if out is not None:
                check_out(out, buf.shape, buf.dtype, "all_gather")
            return _result(buf, out)
        c = self._sub(g)
        if sizes is None:
            mine = np.array([buf.shape[axis]], dtype=np.int64)
            ext = np.empty(n, dtype=np.int64)
            c.Allgather(_bytes(mine), _bytes(ext))
            sizes = [int(e) for e in ext]
        else:
            sizes = [int(e) for e in sizes]
            if len(sizes) != n or sizes[g.index(self._rank)] != buf.shape[axis]:
                raise CommError(
                    f"all_gather: sizes {sizes} do not fit group {g} and this rank's extent "
                    f"{buf.shape[axis]}"
                )
        shape = list(buf.shape)
        shape[axis] = sum(sizes)
        shape = tuple(shape)
        if out is not None:
            check_out(out, shape, buf.dtype, "all_gather")
        moved = self._contiguous(buf, axis)
        row = int(np.prod(moved.shape[1:], dtype=np.int64)) * buf.dtype.itemsize
        counts = [s * row for s in sizes]
        displs = [0] * n
        for j in range(1, n):
            displs[j] = displs[j - 1] + counts[j - 1]
        gathered_shape = (shape[axis],) + moved.shape[1:]
        direct = axis == 0 and out is not None and out.flags.c_contiguous
        gathered = out if direct else self._scratch(0, gathered_shape, buf.dtype)
        if direct and np.shares_memory(moved, out):  # e.g. buf is this rank's slice of out
            moved = np.array(moved, copy=True)
        c.Allgatherv(_bytes(moved), [_bytes(gathered), counts, displs, self._MPI.BYTE])
        if direct:
            return out
        return _result_moved(gathered, axis, out)

    def iall_gather(self, buf, group, axis, out=None):
        """Start an all-gather of equal pieces without blocking (MPI's Iallgather); ``wait`` moves
        the gathered axis into place when it is not the first (or ``out`` is not C-contiguous)."""
        buf, g, axis, shape = self.check_iall_gather(buf, group, axis, out)
        if len(g) == 1:
            return Request(_result(buf, out))
        moved = np.moveaxis(buf, axis, 0) if axis else buf
        if not moved.flags.c_contiguous:
            moved = np.ascontiguousarray(moved)  # its own copy: scratch memory may be reused before wait
        gathered_shape = (shape[axis],) + moved.shape[1:]
        direct = axis == 0 and out is not None and out.flags.c_contiguous
        gathered = out if direct else np.empty(gathered_shape, buf.dtype)
        if direct and np.shares_memory(moved, out):
            moved = np.array(moved, copy=True)
        req = self._sub(g).Iallgather(_bytes(moved), _bytes(gathered))

        def finish() -> np.ndarray:
            nonlocal moved
            moved = None  # the send buffer: held by this closure until the gather is complete
            return out if direct else _result_moved(gathered, axis, out)

        return _MPIRequest(req, finish)

    def reduce_scatter(self, buf, group, axis, out=None):
        buf = as_buffer(buf, "reduce_scatter")
        g = self.check_group(group)
        axis = normalize_axis(axis, buf.ndim)
        n = len(g)
        chunk_shape = split_equal(buf, n, axis)[0].shape
        if out is not None:
            check_out(out, chunk_shape, buf.dtype, "reduce_scatter")
        if n == 1:
            return _result(buf, out)
        c = self._sub(g)
        moved = self._contiguous(buf, axis)
        step = moved.shape[0] // n
        received = self._scratch(0, (n, step) + moved.shape[1:], buf.dtype)
        c.Alltoall(_bytes(moved), _bytes(received))
        return fold_sum([np.moveaxis(received[j], 0, axis) for j in range(n)], out)

    def broadcast(self, buf, group, root, out=None):
        buf, g, root = self.check_broadcast(buf, group, root, out)
        if len(g) == 1:
            return _result(buf, out)
        c = self._sub(g)
        direct = out is not None and out.flags.c_contiguous
        target = out if direct else np.empty(buf.shape, dtype=buf.dtype)
        if root == self._rank and target is not buf:
            np.copyto(target, buf)  # NumPy copes with partial overlap
        c.Bcast(_bytes(target), root=g.index(root))
        if out is not None and not direct:
            np.copyto(out, target)
            return out
        return target

    def all_to_all(self, buf, group, split_axis, concat_axis, out=None):
        buf, g, split_axis, concat_axis = self.check_all_to_all(buf, group, split_axis, concat_axis, out)
        n = len(g)
        if n == 1:
            return _result(buf, out)
        c = self._sub(g)
        moved = self._contiguous(buf, split_axis)
        step = moved.shape[0] // n
        received = self._scratch(0, (n, step) + moved.shape[1:], buf.dtype)
        c.Alltoall(_bytes(moved), _bytes(received))
        pieces = [np.moveaxis(received[j], 0, split_axis) for j in range(n)]
        if out is not None:
            return np.concatenate(pieces, axis=concat_axis, out=out)
        return np.concatenate(pieces, axis=concat_axis)

    def barrier(self) -> None:
        self._comm.Barrier()

    # -- point to point ------------------------------------------------------------------

    def _check_peer(self, peer: int, what: str) -> int:
        """Return ``peer`` as an int after checking it is another rank of the world."""
        peer = int(peer)
        if not 0 <= peer < self._size:
            raise CommError(f"{what}: rank {peer} is outside a world of size {self._size}")
        if peer == self._rank:
            raise CommError(f"{what}: rank {peer} cannot exchange messages with itself")
        return peer

    def send(self, buf, dest, tag=0):
        buf = as_buffer(buf, "send")
        dest = self._check_peer(dest, "send")
        self._p2p.Send(_bytes(np.ascontiguousarray(buf)), dest=dest, tag=int(tag))

    def isend(self, buf, dest, tag=0):
        buf = as_buffer(buf, "isend")
        dest = self._check_peer(dest, "isend")
        data = np.array(buf, copy=True, order="C")  # MPI reads it until the send completes
        req = self._p2p.Isend(_bytes(data), dest=dest, tag=int(tag))
        return _MPIRequest(req, lambda: data)

    def _recv_target(self, out: np.ndarray) -> np.ndarray:
        """Return ``out`` if MPI can receive into it directly, else a contiguous temporary."""
        if not isinstance(out, np.ndarray) or not out.flags.writeable:
            raise CommError("recv: out must be a writeable numpy array")
        return out if out.flags.c_contiguous else np.empty(out.shape, dtype=out.dtype)

    def recv(self, out, source, tag=0):
        source = self._check_peer(source, "recv")
        target = self._recv_target(out)
        status = self._MPI.Status()
        self._p2p.Recv(_bytes(target), source=source, tag=int(tag), status=status)
        self._check_count(status, target, source, tag)
        if target is not out:
            np.copyto(out, target)
        return out

    def irecv(self, out, source, tag=0):
        """Post the receive at once (MPI's Irecv) into ``out`` itself where it is C-contiguous."""
        source = self._check_peer(source, "irecv")
        target = self._recv_target(out)
        status = self._MPI.Status()
        req = self._p2p.Irecv(_bytes(target), source=source, tag=int(tag))

        def finish() -> np.ndarray:
            self._check_count(status, target, source, tag)
            if target is not out:
                np.copyto(out, target)
            return out

        return _MPIRequest(req, finish, status)

    def sendrecv(self, buf, dest, out, source, sendtag=0, recvtag=0):
        buf = as_buffer(buf, "sendrecv")
        dest = self._check_peer(dest, "sendrecv")
        source = self._check_peer(source, "sendrecv")
        target = self._recv_target(out)
        status = self._MPI.Status()
        self._p2p.Sendrecv(
            _bytes(np.ascontiguousarray(buf)), dest=dest, sendtag=int(sendtag),
            recvbuf=_bytes(target), source=source, recvtag=int(recvtag), status=status,
        )
        self._check_count(status, target, source, recvtag)
        if target is not out:
            np.copyto(out, target)
        return out

    def _check_count(self, status: Any, target: np.ndarray, source: int, tag: int) -> None:
        """Return nothing if the received message filled ``target``; CommError otherwise."""
        got = status.Get_count(self._MPI.BYTE)
        if got != target.nbytes:
            raise CommError(
                f"recv from rank {source} (tag {tag}): message has {got} byte(s), "
                f"out has {target.nbytes}"
            )


class _MPIRequest(Request):
    """A started MPI collective: its MPI request and the local work that completes it.

    Where that work is itself a collective (`collective_finish`: the all-gather after an all-to-all),
    `test` lets the first part progress but never says done: the rest must run at `wait`, which
    every member calls at the same point of its program, since MPI matches collectives on a
    communicator by their order. (Finished from `test`, where the first part happened to complete
    early on one member, two buckets in flight ran their all-gathers in different orders on
    different members, and the run hung.)"""

    def __init__(self, req: Any, finish: Any, status: Any = None, collective_finish: bool = False) -> None:
        super().__init__()
        self._req, self._finish, self._done, self._status = req, finish, False, status
        self._collective_finish = collective_finish

    def test(self) -> bool:
        if self._done:
            return True
        complete = bool(self._req.Test())
        return complete and not self._collective_finish

    def wait(self) -> np.ndarray:
        if not self._done:
            self._req.Wait() if self._status is None else self._req.Wait(self._status)
            self._result = self._finish()
            self._done = True
        return self._result  # type: ignore[return-value]


def _result(data: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """Return a fresh C-contiguous copy of ``data``, or ``out`` filled with it."""
    if out is None:
        return np.array(data, copy=True, order="C")
    np.copyto(out, data)
    return out


def _result_moved(front: np.ndarray, axis: int, out: np.ndarray | None) -> np.ndarray:
    """Return ``front`` with its first axis moved back to ``axis`` (fresh C array, or ``out``)."""
    back = np.moveaxis(front, 0, axis)
    if out is None:
        return np.array(back, copy=True, order="C")  # never hand out scratch memory
    np.copyto(out, back)
    return out
