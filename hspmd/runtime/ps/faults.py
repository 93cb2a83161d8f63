"""What a rank that dies means for a parameter-server run, as `hspmd run --servers` sees it.

`hspmd run` starts the ranks under guards with `mpiexec -disable-auto-cleanup`
(`hspmd.runtime.launcher.watch`), so it learns at once which rank ended and how, and a
rank's death does not end the others. Then:

- a rank that ended on an error it said (an exit code) stops the run: its message is the error;
- a server that died stops the run: the workers cannot go on without its parameters;
- a worker that died stops the run under BSP and under hybrid (every step needs every worker);
  under ASP and SSP with comm=ps the others go on, and the servers, which count it as lost once
  it has been silent for `--silent-after` seconds, say at which step it was lost.

The exit status: 0 when every rank that was not lost ended well (a run under ASP/SSP that lost
workers, but whose others finished, with the loss said on stderr and in the log); else 1 (also
when every worker was lost).
"""

from __future__ import annotations

from hspmd.ir.ps_plan import PSPlan
from hspmd.runtime.ps.server import loss_message, tolerates_loss
from hspmd.runtime.launcher.watch import RankEnd, WatchedRun

__all__ = ["outcome", "stops_the_run"]


def stops_the_run(plan: PSPlan, end: RankEnd) -> bool:
    """Return whether rank `end.rank` ending so ends the run (the launcher stops the others)."""
    if end.returncode > 0:
        return True
    return end.killed and (end.rank >= plan.workers or not tolerates_loss(plan))


def outcome(plan: PSPlan, run: WatchedRun) -> tuple[int, str | None]:
    """Return (exit status, the error to say or None) of a finished run under `plan`."""
    said = [e for e in run.ends if e.returncode > 0 and not e.stopped]
    if said:  # the rank said why itself
        return 1, None
    for end in run.lost:
        if end.rank >= plan.workers:
            k = end.rank - plan.workers
            return 1, (f"server {k} (rank {end.rank}) died ({end.how()}); a parameter-server run cannot go on "
                       "without its parameters (resume it from its last checkpoint, --checkpoint-dir)")
    for end in run.lost:
        if not tolerates_loss(plan):
            return 1, loss_message(plan, end.rank, None, f"it died: {end.how()}")
    if len(run.lost) >= plan.workers:
        return 1, f"every worker was lost ({', '.join(f'rank {e.rank}: {e.how()}' for e in run.lost)})"
    if run.lost and all(e.returncode == 0 for e in run.ends if not e.killed):
        return 0, None
    return (1 if run.returncode != 0 else 0), None  # MPI_Abort, or mpiexec's own failure: said by them
