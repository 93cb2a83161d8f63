"""A thread-based communicator for tests and debugging: one thread per rank, shared state.

:func:`run_spmd` runs a function on ``n`` ranks in ``n`` threads.  The implementation is
strict where MPI is lenient, so that bugs show up in fast tests:

* ``send`` is synchronous: it returns only once the receiver has taken the message (MPI
  may buffer small messages, hiding send/send deadlocks until messages grow).
* Members of a collective must agree on the kind of collective and on its scalar
  parameters (axis, root); a mismatch raises :class:`~.base.CommError`.
* A deadlock (every live rank blocked in the communicator with nothing able to wake it,
  e.g. waiting for a rank that has returned) is detected at once and raises
  :class:`DeadlockError` (a :class:`TimeoutError`); anything else that hangs raises
  :class:`TimeoutError` after the timeout.

Every rank posts a private copy of its buffer, so results never depend on when other
ranks overwrite their buffers, and sums are :func:`~.base.fold_sum` in group order.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from .base import (
    CommError,
    Communicator,
    Group,
    Request,
    as_buffer,
    check_out,
    fold_sum,
    normalize_axis,
    normalize_group,
    split_equal,
)

T = TypeVar("T")

__all__ = [
    "CommAborted",
    "DeadlockError",
    "InProcessCommunicator",
    "InProcessWorld",
    "run_spmd",
]


class CommAborted(RuntimeError):
    """The world was aborted (another rank failed, or the run timed out) while this rank waited."""


class DeadlockError(TimeoutError):
    """Every live rank is blocked in the communicator and none can make progress."""


class _Op:
    """One collective call on one group: the members' posted payloads."""

    __slots__ = ("kind", "params", "payloads", "arrived", "readers")

    def __init__(self, kind: str, params: tuple, n: int) -> None:
        self.kind = kind
        self.params = params
        self.payloads: list[Any] = [None] * n
        self.arrived = 0
        self.readers = 0


class _Msg:
    """A point-to-point message: a private copy of the data, and whether it was received."""

    __slots__ = ("data", "taken")

    def __init__(self, data: np.ndarray) -> None:
        self.data = data
        self.taken = False


_RUNNING = "running"
_ERROR_GRACE_S = 2.0
_FINISHED = "finished"


class InProcessWorld:
    """The state shared by the ``n`` communicators of one in-process world."""

    def __init__(self, n: int, timeout: float | None = None) -> None:
        if n < 1:
            raise ValueError(f"world size must be at least 1, got {n}")
        self.n = n
        self.timeout = timeout
        self.cond = threading.Condition(threading.Lock())
        self.ops: dict[tuple[Group, int], _Op] = {}
        self.mailboxes: dict[tuple[int, int, int], deque[_Msg]] = {}
        self.abort_exc: BaseException | None = None
        # Per rank: _RUNNING, _FINISHED, or (description, predicate) while blocked.
        self.state: list[Any] = [_RUNNING] * n

    def communicators(self) -> list["InProcessCommunicator"]:
        """Return one communicator per rank of this world, in rank order."""
        return [InProcessCommunicator(self, r) for r in range(self.n)]

    def abort(self, exc: BaseException) -> None:
        """Return nothing; wakes every waiting rank, which then raises CommAborted."""
        with self.cond:
            if self.abort_exc is None:
                self.abort_exc = exc
            self.cond.notify_all()

    def mark_finished(self, rank: int) -> None:
        """Return nothing; records that ``rank`` will not call the communicator again."""
        with self.cond:
            self.state[rank] = _FINISHED
            self.cond.notify_all()

    def describe(self) -> str:
        """Return one line per rank saying what it is doing (for error messages)."""
        with self.cond:
            return self._describe_locked()

    def _describe_locked(self) -> str:
        parts = []
        for r, st in enumerate(self.state):
            if isinstance(st, tuple):
                parts.append(f"rank {r} waits in {st[0]}")
            else:
                parts.append(f"rank {r} is {st}")
        return "; ".join(parts)

    def _deadlocked_locked(self) -> bool:
        """Return whether no live rank can make progress (call with the lock held)."""
        blocked = False
        for st in self.state:
            if st is _FINISHED:
                continue
            if not isinstance(st, tuple):
                return False  # a running rank may still wake the others
            if st[1]():
                return False  # woken but not yet rescheduled
            blocked = True
        return blocked

    def wait(self, rank: int, what: str, pred: Callable[[], bool]) -> None:
        """Return once ``pred()`` holds (call with the lock held); raise on abort/deadlock/timeout."""
        if pred():
            return
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        self.state[rank] = (what, pred)
        try:
            while not pred():
                if self.abort_exc is not None:
                    raise CommAborted(
                        f"rank {rank}: {what} aborted ({type(self.abort_exc).__name__}: {self.abort_exc})"
                    )
                if self._deadlocked_locked():
                    exc = DeadlockError(f"deadlock detected: {self._describe_locked()}")
                    self.abort_exc = exc
                    self.cond.notify_all()
                    raise exc
                if deadline is None:
                    self.cond.wait(1.0)
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(
                            f"rank {rank}: {what} did not complete within {self.timeout} s "
                            f"({self._describe_locked()})"
                        )
                    self.cond.wait(min(remaining, 1.0))
        finally:
            if self.state[rank] is not _FINISHED:
                self.state[rank] = _RUNNING


class InProcessCommunicator(Communicator):
    """The communicator of one rank of an :class:`InProcessWorld` (use from one thread)."""

    def __init__(self, world: InProcessWorld, rank: int) -> None:
        if not 0 <= rank < world.n:
            raise ValueError(f"rank {rank} is outside a world of size {world.n}")
        self._world = world
        self._rank = rank
        self._seq: dict[Group, int] = {}
        self._groups: dict[Any, Group] = {}

    @classmethod
    def create_world(cls, n: int, timeout: float | None = None) -> list["InProcessCommunicator"]:
        """Return the ``n`` communicators of a new in-process world, in rank order."""
        return InProcessWorld(n, timeout).communicators()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._world.n

    @property
    def world(self) -> InProcessWorld:
        """Return the shared world state."""
        return self._world

    def check_group(self, group: Sequence[int]) -> Group:
        key = group if type(group) is tuple else tuple(group)
        g = self._groups.get(key)
        if g is None:
            g = normalize_group(key, self._rank, self._world.n)
            self._groups[key] = g
        return g

    # -- the rendezvous ------------------------------------------------------------------

    def _exchange(self, kind: str, g: Group, params: tuple, payload: Any) -> list[Any]:
        """Return the payloads posted by all members of ``g`` for this call, in group order."""
        return self._collect(*self._arrive(kind, g, params, payload))

    def _arrive(self, kind: str, g: Group, params: tuple, payload: Any) -> tuple[_Op, tuple, str]:
        """Post this member's payload for the next call on ``g`` without waiting; return (op, key, what)."""
        w = self._world
        n = len(g)
        idx = g.index(self._rank)
        with w.cond:
            if w.abort_exc is not None:
                raise CommAborted(f"rank {self._rank}: {kind} on group {g} called after abort")
            seq = self._seq.get(g, 0)
            self._seq[g] = seq + 1
            key = (g, seq)
            op = w.ops.get(key)
            if op is None:
                op = w.ops[key] = _Op(kind, params, n)
            elif op.kind != kind or op.params != params:
                raise CommError(
                    f"rank {self._rank} called {kind}{params} on group {g} while another member "
                    f"called {op.kind}{op.params} (call #{seq} on this group)"
                )
            op.payloads[idx] = payload
            op.arrived += 1
            if op.arrived == n:
                w.cond.notify_all()
        return op, key, f"{kind} on group {g} (call #{seq})"

    def _collect(self, op: _Op, key: tuple, what: str) -> list[Any]:
        """Return the payloads of ``op`` once every member has posted (waits for them)."""
        w = self._world
        n = len(op.payloads)
        with w.cond:
            if op.arrived != n:
                missing = [r for r, p in zip(key[0], op.payloads) if p is None]
                w.wait(self._rank, f"{what}, waiting for rank(s) {missing}", lambda: op.arrived == n)
            op.readers += 1
            if op.readers == n:
                del w.ops[key]
            return op.payloads

    # -- collectives ---------------------------------------------------------------------

    def all_reduce(self, buf, group, out=None):
        buf, g = self.check_all_reduce(buf, group, out)
        if len(g) == 1:
            return _result(buf, out)
        bufs = self._exchange("all_reduce", g, (), np.array(buf, copy=True))
        _check_same(bufs, g, "all_reduce")
        return fold_sum(bufs, out)

    def iall_reduce(self, buf, group, out=None):
        """Post a copy of ``buf`` at once; ``wait()`` waits for the other members and folds."""
        buf, g = self.check_all_reduce(buf, group, out)
        if len(g) == 1:
            return Request(_result(buf, out))
        return _InProcessRequest(self, self._arrive("all_reduce", g, (), np.array(buf, copy=True)), g, out)

    def all_gather(self, buf, group, axis, out=None):
        buf = as_buffer(buf, "all_gather")
        g = self.check_group(group)
        axis = normalize_axis(axis, buf.ndim)
        if len(g) == 1:
            if out is not None:
                check_out(out, buf.shape, buf.dtype, "all_gather")
            return _result(buf, out)
        bufs = self._exchange("all_gather", g, (axis,), np.array(buf, copy=True))
        _check_same(bufs, g, "all_gather", except_axis=axis)
        shape = list(buf.shape)
        shape[axis] = sum(b.shape[axis] for b in bufs)
        if out is not None:
            check_out(out, tuple(shape), buf.dtype, "all_gather")
            return np.concatenate(bufs, axis=axis, out=out)
        return np.concatenate(bufs, axis=axis)

    def iall_gather(self, buf, group, axis, out=None):
        """Post a copy of ``buf`` at once; ``wait()`` waits for the other members and concatenates."""
        buf, g, axis, _ = self.check_iall_gather(buf, group, axis, out)
        if len(g) == 1:
            return Request(_result(buf, out))

        def combine(bufs: list[np.ndarray]) -> np.ndarray:
            _check_same(bufs, g, "iall_gather")  # equal pieces
            return np.concatenate(bufs, axis=axis, out=out)

        return _InProcessRequest(self, self._arrive("all_gather", g, (axis,), np.array(buf, copy=True)), g, out,
                                 combine)

    def reduce_scatter(self, buf, group, axis, out=None):
        buf = as_buffer(buf, "reduce_scatter")
        g = self.check_group(group)
        axis = normalize_axis(axis, buf.ndim)
        n = len(g)
        mine = split_equal(buf, n, axis)[g.index(self._rank)]
        if out is not None:
            check_out(out, mine.shape, buf.dtype, "reduce_scatter")
        if n == 1:
            return _result(buf, out)
        bufs = self._exchange("reduce_scatter", g, (axis,), np.array(buf, copy=True))
        _check_same(bufs, g, "reduce_scatter")
        idx = g.index(self._rank)
        return fold_sum([split_equal(b, n, axis)[idx] for b in bufs], out)

    def broadcast(self, buf, group, root, out=None):
        buf, g, root = self.check_broadcast(buf, group, root, out)
        if len(g) == 1:
            return _result(buf, out)
        is_root = root == self._rank
        payload = np.array(buf, copy=True) if is_root else (buf.shape, buf.dtype)
        posted = self._exchange("broadcast", g, (root,), payload)
        data = posted[g.index(root)]
        if data.shape != buf.shape or data.dtype != buf.dtype:
            raise CommError(
                f"broadcast on group {g}: rank {self._rank} passed shape {buf.shape} dtype "
                f"{buf.dtype}, root {root} sent shape {data.shape} dtype {data.dtype}"
            )
        return _result(data, out)

    def all_to_all(self, buf, group, split_axis, concat_axis, out=None):
        buf, g, split_axis, concat_axis = self.check_all_to_all(buf, group, split_axis, concat_axis, out)
        n = len(g)
        if n == 1:
            return _result(buf, out)
        bufs = self._exchange(
            "all_to_all", g, (split_axis, concat_axis), np.array(buf, copy=True)
        )
        _check_same(bufs, g, "all_to_all")
        idx = g.index(self._rank)
        pieces = [split_equal(b, n, split_axis)[idx] for b in bufs]
        if out is not None:
            return np.concatenate(pieces, axis=concat_axis, out=out)
        return np.concatenate(pieces, axis=concat_axis)

    def barrier(self) -> None:
        w = self._world
        g = tuple(range(w.n))
        if w.n > 1:
            self._exchange("barrier", g, (), True)

    # -- point to point ------------------------------------------------------------------

    def _check_peer(self, peer: int, what: str) -> int:
        """Return ``peer`` as an int after checking it is another rank of the world."""
        peer = int(peer)
        if not 0 <= peer < self._world.n:
            raise CommError(f"{what}: rank {peer} is outside a world of size {self._world.n}")
        if peer == self._rank:
            raise CommError(f"{what}: rank {peer} cannot exchange messages with itself")
        return peer

    def _post(self, buf: np.ndarray, dest: int, tag: int) -> _Msg:
        """Return the message holding a copy of ``buf``, queued for ``dest`` (does not wait)."""
        w = self._world
        msg = _Msg(np.array(buf, copy=True))
        with w.cond:
            if w.abort_exc is not None:
                raise CommAborted(f"rank {self._rank}: send called after abort")
            w.mailboxes.setdefault((self._rank, dest, tag), deque()).append(msg)
            w.cond.notify_all()
        return msg

    def _await_taken(self, msg: _Msg, dest: int, tag: int) -> None:
        """Return once the receiver has taken ``msg``."""
        w = self._world
        with w.cond:
            w.wait(self._rank, f"send(dest={dest}, tag={tag})", lambda: msg.taken)

    def send(self, buf, dest, tag=0):
        buf = as_buffer(buf, "send")
        dest = self._check_peer(dest, "send")
        msg = self._post(buf, dest, int(tag))
        self._await_taken(msg, dest, int(tag))

    def isend(self, buf, dest, tag=0):
        buf = as_buffer(buf, "isend")
        dest = self._check_peer(dest, "isend")
        self._post(buf, dest, int(tag))  # the message holds a copy: nothing left to wait for
        return Request()

    def recv(self, out, source, tag=0):
        source = self._check_peer(source, "recv")
        tag = int(tag)
        w = self._world
        key = (source, self._rank, tag)
        with w.cond:
            box = w.mailboxes.setdefault(key, deque())
            w.wait(self._rank, f"recv(source={source}, tag={tag})", lambda: bool(box))
            msg = box.popleft()
            msg.taken = True
            w.cond.notify_all()
        data = msg.data
        if not isinstance(out, np.ndarray) or not out.flags.writeable:
            raise CommError("recv: out must be a writeable numpy array")
        if data.size != out.size or data.dtype != out.dtype:
            raise CommError(
                f"recv from rank {source} (tag {tag}): message has {data.size} element(s) of "
                f"{data.dtype}, out has {out.size} of {out.dtype}"
            )
        np.copyto(out, data.reshape(out.shape))
        return out

    def sendrecv(self, buf, dest, out, source, sendtag=0, recvtag=0):
        buf = as_buffer(buf, "sendrecv")
        dest = self._check_peer(dest, "sendrecv")
        msg = self._post(buf, dest, int(sendtag))
        self.recv(out, source, recvtag)
        self._await_taken(msg, dest, int(sendtag))
        return out


class _InProcessRequest(Request):
    """A started in-process collective: the member's copy is posted; `wait` combines the members'
    copies (`combine`; by default an all-reduce's fold in group order)."""

    def __init__(self, comm: InProcessCommunicator, posted: tuple, g: Group, out: np.ndarray | None,
                 combine: Callable[[list[np.ndarray]], np.ndarray] | None = None) -> None:
        super().__init__()
        self._comm, self._posted, self._g, self._out = comm, posted, g, out
        self._combine = combine
        self._done = False

    def test(self) -> bool:
        op = self._posted[0]
        return self._done or op.arrived == len(op.payloads)

    def wait(self) -> np.ndarray:
        if not self._done:
            bufs = self._comm._collect(*self._posted)
            if self._combine is not None:
                self._result = self._combine(bufs)
            else:
                _check_same(bufs, self._g, "all_reduce")
                self._result = fold_sum(bufs, self._out)
            self._done = True
        return self._result  # type: ignore[return-value]


def _result(data: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """Return a fresh copy of ``data``, or ``out`` filled with it."""
    if out is None:
        return np.array(data, copy=True, order="C")
    np.copyto(out, data)
    return out


def _check_same(bufs: list[np.ndarray], g: Group, what: str, except_axis: int | None = None) -> None:
    """Raise CommError unless all members posted the same dtype and shape (but ``except_axis``)."""
    first = bufs[0]

    def key(b: np.ndarray) -> tuple:
        """Return what must agree between members: dtype and shape (but ``except_axis``)."""
        shape = list(b.shape)
        if except_axis is not None and len(shape) > except_axis:
            shape[except_axis] = -1
        return (b.dtype, tuple(shape))

    k0 = key(first)
    for r, b in zip(g, bufs):
        if key(b) != k0:
            raise CommError(
                f"{what} on group {g}: rank {r} passed shape {b.shape} dtype {b.dtype}, "
                f"rank {g[0]} passed shape {first.shape} dtype {first.dtype}"
            )


def run_spmd(n: int, fn: Callable[[Communicator], T], timeout: float = 60.0) -> list[T]:
    """Return ``[fn(comm_0), ..., fn(comm_{n-1})]``, run in ``n`` threads over one in-process world.

    If a rank raises, the world is aborted (ranks waiting in the communicator raise
    :class:`CommAborted`) and the first rank's exception is re-raised here with a note
    naming the rank (``exc.rank`` is set too).  A detected deadlock raises
    :class:`DeadlockError`; a run longer than ``timeout`` seconds raises ``TimeoutError``
    saying where each rank waits.
    """
    world = InProcessWorld(n, timeout)
    comms = world.communicators()
    results: list[Any] = [None] * n
    errors: dict[int, BaseException] = {}
    done = threading.Condition(threading.Lock())
    finished = [0]

    def body(r: int) -> None:
        """Return nothing; runs rank ``r`` and records its result or exception."""
        try:
            results[r] = fn(comms[r])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            with done:
                errors[r] = exc
            world.abort(exc)
        finally:
            world.mark_finished(r)
            with done:
                finished[0] += 1
                done.notify_all()

    threads = [
        threading.Thread(target=body, args=(r,), name=f"hspmd-rank-{r}", daemon=True)
        for r in range(n)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    with done:
        while finished[0] < n:
            if errors:
                # The others were woken by the abort; give ranks busy outside the
                # communicator a short grace period, not the whole timeout.
                deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            done.wait(remaining)
        all_done = finished[0] == n
        errs = dict(errors)

    if errs:
        primary = {r: e for r, e in errs.items() if not isinstance(e, CommAborted)}
        rank, exc = min((primary or errs).items())
        others = sorted(r for r in errs if r != rank)
        note = f"raised on rank {rank} of {n} (run_spmd)"
        if others:
            note += f"; rank(s) {others} failed too"
        if not all_done:
            note += f"; still running: {world.describe()}"
        _annotate(exc, rank, note)
        raise exc
    if not all_done:
        where = world.describe()
        world.abort(TimeoutError(f"run_spmd timed out after {timeout} s"))
        raise TimeoutError(f"run_spmd({n}) did not finish within {timeout} s: {where}")
    return results


def _annotate(exc: BaseException, rank: int, note: str) -> None:
    """Return nothing; marks ``exc`` with the rank that raised it (attribute and note)."""
    try:
        exc.rank = rank  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass
    exc.add_note(note)
