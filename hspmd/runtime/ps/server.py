"""A parameter server's loop: take pushes, apply updates, answer pulls the clocks admit.

Server k holds its range of parameters (`PSPlan.on_server`) and their optimizer states, all
made by its update step (`update.UpdateStep`) from names and the seed, as every compiled step
makes them. It answers messages in arrival order on one thread and never blocks but waiting
for the next message (sleeping between looks, `protocol.wait_for`): replies go out with non-blocking sends, so a slow worker never stalls the others.

- A push under BSP waits until every live worker has pushed that step; the gradients are then
  summed in worker order (rows of a table: concatenated in worker order and summed per row)
  and applied once, divided by the number of workers (each worker's gradient is its rows'
  mean). Under ASP and SSP each push is applied as it comes, divided likewise.
- A pull is answered once `Clocks.admits` its step; it carries the values (whole, or the rows
  asked for), the staleness, and per table the asked rows' versions (update counts).
- DONE retires a worker (it holds nobody back); the loop ends when every worker is done.
- Under ASP and SSP a worker silent for `silent_s` seconds after its first message (hung, or on
  a host that is gone while the job lives) is counted as gone (retired: the others go on without waiting for it;
  said once on stderr); if it speaks again it is counted back in. Under BSP nobody is retired.
  A worker *process* that dies ends the whole job: MPICH's mpiexec ends every rank when one
  dies (its `-disable-auto-cleanup` left the others alive in only some of our tries).
"""

from __future__ import annotations

import numpy as np

import sys
import time

from hspmd.ir.ps_plan import PSPlan
from hspmd.runtime.fault import fault_point
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


class Server:
    """Server `index` (0-based among servers) of a run under `plan`."""

    def __init__(self, index: int, plan: PSPlan, update: UpdateStep, seed: int, scalars,
                 silent_s: float = 60.0, rank: int = 0) -> None:
        self.silent_s, self.rank = silent_s, rank
        self.heard: list[float | None] = [None] * plan.workers  # None: not heard from yet (still starting)
        self.finished: set[int] = set()
        self.beats: dict[int, float] = {}  # worker -> when its waiting pull was last said to be alive
        self.index, self.plan, self.update = index, plan, update
        self.state = update.initial_state(seed)
        self.names = plan.on_server(index)
        self.clocks = Clocks(plan.workers, plan.bound)
        self.scalars = scalars  # step -> the update's step inputs ("lr")
        self.pending: list[tuple[int, int, dict]] = []  # pulls not yet admitted: (worker, step, request)
        self.waiting: dict[int, dict[int, dict]] = {}  # BSP: step -> {worker: push}
        self.sends: list = []

    def serve(self, comm) -> None:
        """Answer workers on MPI communicator `comm` (workers are ranks 0..N-1) until all said DONE."""
        from mpi4py import MPI

        self._comm = comm
        done = self.finished
        while len(done) < self.plan.workers:
            payload, worker, tag = protocol.wait_for(comm, MPI.ANY_SOURCE, MPI.ANY_TAG, on_idle=self._count_the_silent)
            self.heard[worker] = time.monotonic()
            if worker not in self.clocks.live and worker not in done:  # counted as gone, but it speaks
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
            self.sends = [r for r in self.sends if not r.Test()]
        self.answer(comm)
        MPI.Request.Waitall(self.sends)

    def _count_the_silent(self) -> None:
        """Send a heartbeat to every worker whose pull has waited half `silent_s` since the last; retire
        every live worker silent for `silent_s` (ASP and SSP only: BSP needs everyone)."""
        now = time.monotonic()
        waiting = {w for w, _, _ in self.pending}  # a worker whose pull waits on us is not silent
        for w in waiting:  # ... and it must know we are alive: a heartbeat every half silence
            if now - self.beats.setdefault(w, now) > self.silent_s / 2:
                self.sends.append(self._comm.isend(None, dest=w, tag=protocol.HEARTBEAT))
                self.beats[w] = now
        for w in sorted(self.clocks.live - waiting):
            if self.plan.bound != 0 and self.heard[w] is not None and now - self.heard[w] > self.silent_s:
                self.clocks.retire(w)
                print(f"hspmd run (server rank {self.rank}): worker {w} has been silent for {self.silent_s:g} s; "
                      f"counted as gone, the other workers go on", file=sys.stderr, flush=True)
        self._flush_waiting()

    def push(self, worker: int, step: int, push: dict) -> None:
        """Take `worker`'s gradients of `step`: apply them now (ASP, SSP) or once all are in (BSP)."""
        self.clocks.tick(worker)
        if self.plan.bound == 0:
            self.waiting.setdefault(step, {})[worker] = push
            self._flush_waiting()
        else:
            self._apply(step, _sum_pushes([push], self.names, self.plan.workers))

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
            self.sends.append(comm.isend(reply, dest=worker, tag=protocol.REPLY))
        self.pending = keep
