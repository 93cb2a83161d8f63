"""A parameter server's loop: take pushes, apply updates, answer pulls the clocks admit.

Server k holds its range of parameters (`PSPlan.on_server`) and their optimizer states, all
made by its update step (`update.UpdateStep`) from names and the seed, as every compiled step
makes them. It answers messages in arrival order on one thread and never blocks but waiting
for the next message (sleeping between looks, `protocol.wait_for`): replies go out with
non-blocking sends, so a slow worker never stalls the others.

- A push under BSP waits until every live worker has pushed that step; the gradients are then
  summed in worker order (rows of a table: concatenated in worker order and summed per row)
  and applied once, divided by the number of workers (each worker's gradient is its rows'
  mean). Under ASP and SSP each push is applied as it comes, divided likewise.
- A pull is answered once `Clocks.admits` its step; it carries the values (whole, or the rows
  asked for), the staleness, and per table the asked rows' versions (update counts).
- DONE retires a worker (it holds nobody back); the loop ends when every worker is done or
  lost, and the server then tells each worker that is done which workers were lost (END).
- Every worker beats (`protocol.Heartbeat`, a thread), so a live worker is never silent, however
  long its step. One from which nothing came for `silent_s` seconds is *lost* (its process died,
  or its host). Under ASP and SSP with comm=ps the run goes on without it: it is retired (the
  others stop waiting for it), its pending pulls and replies are dropped, and server 0 says on
  stderr which worker was lost at which step (its pushed steps + 1); if it speaks again it is
  counted back in. Under BSP, and under hybrid (the workers all-reduce their dense gradients
  each step), the run cannot go on: server 0 raises `WorkerLost` with that message (`main`
  prints it and ends the rank, and `hspmd run` stops the others). `hspmd run` itself sees a
  rank's process die at once (`hspmd.runtime.ps.faults`); the silence is how a server knows on
  its own (a host that is gone, a status directory not shared).
"""

from __future__ import annotations

import numpy as np

import sys
import time

from hspmd.ir.ps_plan import PSPlan
from hspmd.runtime.launcher.fault import fault_point
from hspmd.runtime.ps import protocol
from hspmd.runtime.ps.clocks import Clocks
from hspmd.runtime.ps.update import UpdateStep


def _sum_pushes(pushes: list[dict], names: list[str], workers: int) -> dict:
    """Return one push: `pushes` (in worker order) summed per parameter (per row for tables)."""
    out = {}
    for name in names:
        parts = [p[name] for p in pushes if name in p]
        rows = [r for r, _ in parts]
        if rows[0] is None:
            total = parts[0][1].copy()
            for _, g in parts[1:]:
                total += g
            out[name] = (None, total / np.float32(workers) if total.dtype == np.float32 else total / workers)
            continue
        out[name] = _sum_rows(np.concatenate(rows), np.concatenate([g for _, g in parts]), workers)
    return out


def _sum_rows(rows: np.ndarray, grads: np.ndarray, workers: int):
    """Return (distinct rows, their gradients summed in the given order, divided by `workers`)."""
    unique, where = np.unique(rows, return_inverse=True)
    total = np.zeros((len(unique), *grads.shape[1:]), dtype=grads.dtype)
    np.add.at(total, where, grads)
    total /= total.dtype.type(workers)
    return unique, total


class WorkerLost(RuntimeError):
    """A worker was lost where the run cannot go on without it (BSP, or hybrid)."""


def tolerates_loss(plan: PSPlan) -> bool:
    """Return whether a run under `plan` goes on when a worker is lost (comm=ps under ASP or SSP)."""
    return plan.comm == "ps" and plan.bound != 0


def loss_message(plan: PSPlan, worker: int, step: int | None, why: str) -> str:
    """Return the one line that says worker `worker` was lost (at `step`, if known; `why`: how it
    was seen)."""
    at = f" at step {step}" if step is not None else ""
    if tolerates_loss(plan):
        return (f"worker {worker} (rank {worker}) was lost{at} ({why}); under "
                f"consistency={plan.consistency} the other workers go on without it")
    why_not = ("the workers all-reduce their dense gradients each step" if plan.comm == "hybrid"
               else "every step waits for every worker's push")
    return (f"worker {worker} (rank {worker}) was lost{at} ({why}); under comm={plan.comm} "
            f"consistency={plan.consistency} {why_not}, so the run cannot go on")


class Server:
    """Server `index` (0-based among servers) of a run under `plan`."""

    def __init__(self, index: int, plan: PSPlan, update: UpdateStep, seed: int, scalars,
                 silent_s: float = 60.0, rank: int = 0, checkpoints=None,
                 resumed: tuple[dict, int] | None = None) -> None:
        """`checkpoints` (a `checkpoints.PSCheckpoints`) writes this server's tensors as the
        slowest worker passes each checkpoint step; `resumed` is (tensors, step) of a checkpoint
        to start from (every worker's clock starts at that step)."""
        self.silent_s, self.rank = silent_s, rank
        self.heard: list[float] = [time.monotonic()] * plan.workers  # the workers beat from their start
        self.finished: set[int] = set()
        self.lost: dict[int, int] = {}  # worker -> the step it was lost at
        self.beats: dict[int, float] = {}  # worker -> when its waiting pull was last said to be alive
        self.index, self.plan, self.update = index, plan, update
        self.state = update.initial_state(seed)
        self.names = plan.on_server(index)
        self.clocks = Clocks(plan.workers, plan.bound)
        self.checkpoints = checkpoints
        if resumed is not None:
            tensors, step = resumed
            self.state.update(tensors)
            self.clocks.clock = [step] * plan.workers
        self.scalars = scalars  # step -> the update's step inputs ("lr")
        self.pending: list[tuple[int, int, dict]] = []  # pulls not yet admitted: (worker, step, request)
        self.waiting: dict[int, dict[int, dict]] = {}  # BSP: step -> {worker: push}
        self.sends: list = []

    def serve(self, comm) -> dict[int, int]:
        """Answer workers on MPI communicator `comm` (workers are ranks 0..N-1) until each said DONE
        or is lost; return the lost workers and the step each was lost at."""
        from mpi4py import MPI

        self._comm = comm
        done = self.finished
        looked = time.monotonic()
        while len(done) + len(self.lost) < self.plan.workers:
            try:
                payload, worker, tag = protocol.wait_for(comm, MPI.ANY_SOURCE, MPI.ANY_TAG, 0.1)
            except protocol.Silence:  # nothing for a while: look for the silent (the loop may end)
                self._count_the_silent()
                looked = time.monotonic()
                continue
            except protocol.Unreadable as err:  # a worker died while sending (a push in flight)
                if err.source < self.plan.workers and err.source not in self.lost:
                    self._lose(err.source, "it died while sending a message")
                    self._flush_waiting()
                    continue
                raise
            self.heard[worker] = time.monotonic()
            if worker in self.lost:  # counted as lost, but it speaks: it was only slow to be heard
                del self.lost[worker]
                self.clocks.live.add(worker)
            if tag == protocol.PULL:
                step, request = payload
                self.pending.append((worker, step, request))
                self.beats[worker] = time.monotonic()
            elif tag == protocol.PUSH:
                step, push = payload
                fault_point(self.rank, step)
                self.push(worker, step, push)
            elif tag == protocol.DONE:
                if any(len(rows) for rows, _ in payload.values()):  # the HET cache's last gradients
                    self._apply(0, _sum_pushes([payload], [n for n in self.names if n in payload], self.plan.workers))
                done.add(worker)
                self.clocks.retire(worker)
                self._flush_waiting()
            self.answer(comm)
            self.sends = [(w, r) for w, r in self.sends if not r.Test()]
            if time.monotonic() - looked > 0.1:  # a busy server looks for the silent too
                self._count_the_silent()
                looked = time.monotonic()
        self.answer(comm)
        if self.checkpoints is not None:  # (every due checkpoint was started as the clocks passed it)
            self.checkpoints.close()
        for worker in sorted(done):
            self.sends.append((worker, comm.isend(dict(self.lost), dest=worker, tag=protocol.END)))
        MPI.Request.Waitall([r for w, r in self.sends if w not in self.lost])
        return dict(self.lost)

    def _count_the_silent(self) -> None:
        """Send a heartbeat to every worker that waits on us (a pull not yet admitted, or the END)
        once half `silent_s` has passed since the last; count every live worker silent for
        `silent_s` as lost."""
        now = time.monotonic()
        waiting = {w for w, _, _ in self.pending} | self.finished
        for w in waiting:
            if now - self.beats.setdefault(w, now) > self.silent_s / 2:
                self.sends.append((w, self._comm.isend(None, dest=w, tag=protocol.HEARTBEAT)))
                self.beats[w] = now
        for w in sorted(set(range(self.plan.workers)) - self.finished - set(self.lost)):
            if now - self.heard[w] > self.silent_s:
                self._lose(w, f"nothing from it for {now - self.heard[w]:.0f} s")
        self._flush_waiting()

    def _lose(self, worker: int, why: str) -> None:
        """Count `worker` as lost: go on without it, or raise `WorkerLost` where the run cannot."""
        step = self.clocks.clock[worker] + 1
        message = loss_message(self.plan, worker, step, why)
        if not tolerates_loss(self.plan):
            if self.index == 0:  # one server speaks for all
                raise WorkerLost(message)
            self.heard[worker] = time.monotonic()  # server 0 ends the run; wait for that
            return
        self.lost[worker] = step
        self.clocks.retire(worker)
        self.pending = [p for p in self.pending if p[0] != worker]
        self.sends = [(w, r) for w, r in self.sends if w != worker]  # never completed: it is gone
        if self.index == 0:
            print(f"hspmd run (server rank {self.rank}): {message}", file=sys.stderr, flush=True)

    def push(self, worker: int, step: int, push: dict) -> None:
        """Take `worker`'s gradients of `step`: apply them now (ASP, SSP) or once all are in (BSP)."""
        self.clocks.tick(worker)
        if self.plan.bound == 0:
            self.waiting.setdefault(step, {})[worker] = push
            self._flush_waiting()
        else:
            self._apply(step, _sum_pushes([push], self.names, self.plan.workers))
        self._checkpoint()

    def _checkpoint(self) -> None:
        """Write the checkpoint the slowest live worker's clock has reached, if one is due."""
        if self.checkpoints is None:
            return
        step = self.checkpoints.due(self.clocks.slowest())
        if step is not None:
            lr = self.scalars(max(step, 1)).get("lr")
            self.checkpoints.save(step, self.state, None if lr is None else float(lr))

    def _flush_waiting(self) -> None:
        """Apply every BSP step whose pushes from all live workers are in, oldest first."""
        for step in sorted(self.waiting):
            pushes = self.waiting[step]
            if not self.clocks.live.issubset(pushes) or not pushes:
                return
            del self.waiting[step]
            self._apply(step, _sum_pushes([pushes[w] for w in sorted(pushes)], self.names, self.plan.workers))

    def _apply(self, step: int, grads: dict) -> None:
        self.update.apply(self.state, grads, self.scalars(max(step, 1)))

    def answer(self, comm) -> None:
        """Send every pending pull the clocks now admit."""
        keep = []
        for worker, step, request in self.pending:
            if not self.clocks.admits(step):
                keep.append((worker, step, request))
                continue
            values = {name: self.state[name] if rows is None else self.state[name][rows]
                      for name, rows in request.items()}
            reply = (step, values, self.clocks.staleness(step), list(self.clocks.clock))
            self.sends.append((worker, comm.isend(reply, dest=worker, tag=protocol.REPLY)))
        self.pending = keep
