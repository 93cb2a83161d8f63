"""The communicator interface shared by the MPI and the in-process implementations.

A *group* is a tuple of global ranks that contains the caller; the order of the tuple is
the order of the chunks (``all_gather``, ``reduce_scatter``, ``all_to_all``) and the order
of the reduction.

Reduction order (the determinism contract)
------------------------------------------
Every sum (``all_reduce``, ``reduce_scatter``) is the *left fold in group order*::

    ((buf[group[0]] + buf[group[1]]) + buf[group[2]]) + ...

computed elementwise by NumPy in the buffer's dtype (see :func:`fold_sum`).  Both
implementations compute exactly this, so a program gives the same bits on MPI and
in-process, on any number of processes per node, and from run to run.  The one use of
MPI's own reduction is a sum of *two* buffers of float32/float64/int32/int64: there every
algorithm computes ``a + b`` or ``b + a``, the same bits (IEEE addition commutes; only a
NaN's payload could differ).

Buffers and results
-------------------
* Every member passes a buffer of the same dtype; shapes must agree except where a method
  says otherwise (``all_gather`` accepts different extents along ``axis``).
* A result is a fresh C-contiguous array, or ``out`` when given (then it is filled and
  returned; ``out`` may be ``buf`` itself for the in-place form).  A group of size 1 gives
  a copy of ``buf`` (or fills ``out``).
* Collectives over one group must be called in the same order by all its members;
  collectives over disjoint groups may run at the same time.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

Group = tuple[int, ...]

__all__ = [
    "Communicator",
    "CommError",
    "Group",
    "Request",
    "check_out",
    "chunk_bounds",
    "fold_sum",
    "group_index",
    "normalize_axis",
    "normalize_group",
    "split_equal",
]


class CommError(RuntimeError):
    """A communicator was used wrongly (bad group, mismatched collective, bad buffer)."""


def normalize_group(group: Sequence[int], rank: int, size: int) -> Group:
    """Return ``group`` as a tuple of ints, after checking it is a valid group for ``rank``.

    Raises :class:`CommError` when a member is out of ``range(size)``, repeated, or when
    ``rank`` is not a member.
    """
    g = group if type(group) is tuple else tuple(group)
    try:
        g = tuple(int(r) for r in g)
    except (TypeError, ValueError) as exc:
        raise CommError(f"group {group!r} is not a sequence of integer ranks") from exc
    if not g:
        raise CommError("a group must not be empty")
    if len(set(g)) != len(g):
        raise CommError(f"group {g} repeats a rank")
    bad = [r for r in g if not 0 <= r < size]
    if bad:
        raise CommError(f"group {g} names rank(s) {bad} outside a world of size {size}")
    if rank not in g:
        raise CommError(f"rank {rank} is not a member of group {g}")
    return g


def group_index(group: Group, rank: int) -> int:
    """Return the position of ``rank`` in ``group`` (its chunk number)."""
    try:
        return group.index(rank)
    except ValueError:
        raise CommError(f"rank {rank} is not a member of group {group}") from None


def normalize_axis(axis: int, ndim: int) -> int:
    """Return ``axis`` as a non-negative axis of an ``ndim``-dimensional array."""
    if not -ndim <= axis < ndim:
        raise CommError(f"axis {axis} is out of range for an array of {ndim} dimension(s)")
    return axis % ndim


def chunk_bounds(total: int, n: int) -> list[int]:
    """Return the ``n + 1`` boundaries that split ``range(total)`` into ``n`` near-equal parts.

    The first ``total % n`` parts are one element longer.
    """
    q, r = divmod(total, n)
    bounds = [0]
    for i in range(n):
        bounds.append(bounds[-1] + q + (1 if i < r else 0))
    return bounds


def split_equal(buf: np.ndarray, n: int, axis: int) -> list[np.ndarray]:
    """Return the ``n`` equal chunks (views) of ``buf`` along ``axis``.

    Raises :class:`CommError` if the extent along ``axis`` is not divisible by ``n``.
    """
    extent = buf.shape[axis]
    if extent % n:
        raise CommError(
            f"cannot split extent {extent} of axis {axis} (shape {buf.shape}) into {n} equal chunks"
        )
    step = extent // n
    index: list[slice] = [slice(None)] * buf.ndim
    chunks = []
    for j in range(n):
        index[axis] = slice(j * step, (j + 1) * step)
        chunks.append(buf[tuple(index)])
    return chunks


def fold_sum(arrays: Sequence[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """Return the left fold ``((a0 + a1) + a2) + ...`` of ``arrays``: THE reduction order.

    The sum is elementwise in the dtype of ``arrays[0]``; without ``out`` the result is a
    fresh C-contiguous array.  ``out`` may be ``arrays[0]`` but must not overlap
    ``arrays[1:]``.
    """
    first = arrays[0]
    if out is None:
        out = np.empty(first.shape, dtype=first.dtype)
    if len(arrays) == 1:
        np.copyto(out, first)
        return out
    np.add(first, arrays[1], out=out)
    for a in arrays[2:]:
        np.add(out, a, out=out)
    return out


def check_out(out: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, what: str) -> None:
    """Check that ``out`` can hold a result of ``shape`` and ``dtype``; raise CommError if not."""
    if not isinstance(out, np.ndarray):
        raise CommError(f"{what}: out must be a numpy array, got {type(out).__name__}")
    if out.shape != tuple(shape) or out.dtype != dtype:
        raise CommError(
            f"{what}: out has shape {out.shape} and dtype {out.dtype}, "
            f"the result has shape {tuple(shape)} and dtype {dtype}"
        )
    if not out.flags.writeable:
        raise CommError(f"{what}: out is read-only")


def as_buffer(buf: np.ndarray, what: str) -> np.ndarray:
    """Return ``buf`` as a numpy array of a dtype that can be communicated."""
    arr = np.asarray(buf)
    if arr.dtype.hasobject:
        raise CommError(f"{what}: arrays of Python objects (dtype {arr.dtype}) cannot be communicated")
    return arr


class Request:
    """A started non-blocking collective: `wait()` returns its result, `test()` helps it along.

    This base class is a request that completed when it was made (``result`` is known).
    """

    def __init__(self, result: np.ndarray | None = None) -> None:
        self._result = result

    def test(self) -> bool:
        """Return whether the operation has completed (and let it progress if not). A request whose
        last step is itself a collective (MPI's sum of more than two members by pieces: its
        all-gather) says so only once `wait` ran it, since members must reach collectives in the
        same order: call `wait` where the program needs the result, on every member alike."""
        return True

    def wait(self) -> np.ndarray:
        """Return the result once the operation has completed."""
        return self._result  # type: ignore[return-value]


class _DeferredRecv(Request):
    """A receive made when it is waited for (`Communicator.irecv`'s default)."""

    def __init__(self, comm: "Communicator", out: np.ndarray, source: int, tag: int) -> None:
        super().__init__()
        self._args, self._done = (comm, out, source, tag), False

    def test(self) -> bool:
        return self._done

    def wait(self) -> np.ndarray:
        if not self._done:
            comm, out, source, tag = self._args
            self._result = comm.recv(out, source, tag)
            self._done = True
        return self._result  # type: ignore[return-value]


class Communicator(ABC):
    """Collectives over explicit groups of global ranks.

    A group is a tuple of global ranks that contains the caller; chunk order = order in the
    tuple.  Sums are left folds in group order (see the module docstring), so results are
    bitwise identical across implementations.
    """

    @property
    @abstractmethod
    def rank(self) -> int:
        """Return the caller's global rank."""

    @property
    @abstractmethod
    def size(self) -> int:
        """Return the number of ranks in the world."""

    def check_group(self, group: Sequence[int]) -> Group:
        """Return ``group`` normalised to a tuple; CommError if the caller cannot use it."""
        return normalize_group(group, self.rank, self.size)

    def check_all_reduce(
        self, buf: np.ndarray, group: Sequence[int], out: np.ndarray | None
    ) -> tuple[np.ndarray, Group]:
        """Return (buffer, group) of an all-reduce (blocking or not), checked (``out``'s shape and dtype)."""
        buf = as_buffer(buf, "all_reduce")
        g = self.check_group(group)
        if out is not None:
            check_out(out, buf.shape, buf.dtype, "all_reduce")
        return buf, g

    def check_broadcast(
        self, buf: np.ndarray, group: Sequence[int], root: int, out: np.ndarray | None
    ) -> tuple[np.ndarray, Group, int]:
        """Return (buffer, group, root) of a broadcast, checked (root in the group, ``out``'s shape)."""
        buf = as_buffer(buf, "broadcast")
        g = self.check_group(group)
        root = int(root)
        if root not in g:
            raise CommError(f"broadcast root {root} is not a member of group {g}")
        if out is not None:
            check_out(out, buf.shape, buf.dtype, "broadcast")
        return buf, g, root

    def check_all_to_all(
        self, buf: np.ndarray, group: Sequence[int], split_axis: int, concat_axis: int, out: np.ndarray | None
    ) -> tuple[np.ndarray, Group, int, int]:
        """Return (buffer, group, split axis, concat axis) of an all-to-all, checked (and ``out``'s shape)."""
        buf = as_buffer(buf, "all_to_all")
        g = self.check_group(group)
        split_axis = normalize_axis(split_axis, buf.ndim)
        concat_axis = normalize_axis(concat_axis, buf.ndim)
        shape = list(split_equal(buf, len(g), split_axis)[0].shape)
        shape[concat_axis] *= len(g)
        if out is not None:
            check_out(out, tuple(shape), buf.dtype, "all_to_all")
        return buf, g, split_axis, concat_axis

    @abstractmethod
    def all_reduce(
        self, buf: np.ndarray, group: Group, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Return the sum of the members' ``buf`` (left fold in group order)."""

    def iall_reduce(self, buf: np.ndarray, group: Group, out: np.ndarray | None = None) -> Request:
        """Start the sum of the members' ``buf`` and return its :class:`Request`; no member blocks.

        The result (``out`` when given, which may be ``buf``) holds the same bits as
        :meth:`all_reduce` once ``wait()`` returns; ``buf`` must not change until then.
        Members start their non-blocking collectives on a group in the same order, as for
        blocking ones.  This default runs :meth:`all_reduce` at once.
        """
        return Request(self.all_reduce(buf, group, out))

    @abstractmethod
    def all_gather(
        self, buf: np.ndarray, group: Group, axis: int, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Return the concatenation of the members' ``buf`` along ``axis``, in group order.

        Extents along ``axis`` may differ between members; all other dimensions must agree.
        """

    def iall_gather(self, buf: np.ndarray, group: Group, axis: int, out: np.ndarray | None = None) -> Request:
        """Start the concatenation of the members' ``buf`` along ``axis`` (group order) and return
        its :class:`Request`; no member blocks.

        Every member's ``buf`` has the same shape (equal pieces: the result's extent along
        ``axis`` is ``len(group)`` times this one's). The result (``out`` when given) holds
        :meth:`all_gather`'s values once ``wait()`` returns; ``buf`` must not change and
        ``out`` must not be read until then. Members start their collectives on a group in the
        same order, blocking and non-blocking alike. This default runs :meth:`all_gather` at once.
        """
        return Request(self.all_gather(buf, group, axis, out))

    def check_iall_gather(self, buf: np.ndarray, group: Sequence[int], axis: int,
                          out: np.ndarray | None) -> tuple[np.ndarray, Group, int, tuple[int, ...]]:
        """Return (buffer, group, axis, result shape) of a non-blocking all-gather, checked."""
        buf = as_buffer(buf, "iall_gather")
        g = self.check_group(group)
        axis = normalize_axis(axis, buf.ndim)
        shape = list(buf.shape)
        shape[axis] *= len(g)
        if out is not None:
            check_out(out, tuple(shape), buf.dtype, "iall_gather")
        return buf, g, axis, tuple(shape)

    @abstractmethod
    def reduce_scatter(
        self, buf: np.ndarray, group: Group, axis: int, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Return chunk ``group.index(rank)`` along ``axis`` of the sum of the members' ``buf``.

        The extent along ``axis`` must be divisible by ``len(group)`` (equal chunks).
        """

    @abstractmethod
    def broadcast(
        self, buf: np.ndarray, group: Group, root: int, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Return a copy of the ``buf`` of ``root`` (a global rank in ``group``).

        Non-root members pass a buffer of the same shape and dtype; its contents are unused.
        """

    @abstractmethod
    def all_to_all(
        self,
        buf: np.ndarray,
        group: Group,
        split_axis: int,
        concat_axis: int,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Return the chunks received from all members, concatenated along ``concat_axis``.

        ``buf`` is split into ``len(group)`` equal chunks along ``split_axis``; chunk ``j``
        goes to ``group[j]``.  The received chunks are concatenated in group order.
        """

    @abstractmethod
    def send(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        """Return nothing once ``buf`` is sent to global rank ``dest``.

        May block until the matching :meth:`recv` starts (the in-process implementation
        always does), so two ranks must not both send to each other first; use
        :meth:`sendrecv` for exchanges.
        """

    @abstractmethod
    def isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Request:
        """Return a request for sending ``buf`` to global rank ``dest``, without waiting for the receive.

        The message holds a copy of ``buf`` (the caller may overwrite it at once); `wait()` on
        the request returns once the message has left. Messages from one rank to another with
        one tag are received in the order they were sent.
        """

    @abstractmethod
    def recv(self, out: np.ndarray, source: int, tag: int = 0) -> np.ndarray:
        """Return ``out`` filled with the message from global rank ``source`` with ``tag``.

        The message must have as many elements as ``out`` and the same dtype.
        """

    def irecv(self, out: np.ndarray, source: int, tag: int = 0) -> Request:
        """Return a request that fills ``out`` with the message from global rank ``source`` with
        ``tag``; ``out`` must not be read until ``wait()`` returns it. This default receives in
        ``wait()`` (a message sent with :meth:`isend` waits for it); MPI's receives at once."""
        return _DeferredRecv(self, out, source, tag)

    @abstractmethod
    def sendrecv(
        self,
        buf: np.ndarray,
        dest: int,
        out: np.ndarray,
        source: int,
        sendtag: int = 0,
        recvtag: int = 0,
    ) -> np.ndarray:
        """Return ``out`` filled from ``source``, after sending ``buf`` to ``dest``, without deadlock."""

    @abstractmethod
    def barrier(self) -> None:
        """Return nothing once every rank of the world has entered the barrier."""

    def close(self) -> None:
        """Return nothing; releases resources held by the communicator (idempotent)."""

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
