"""Watching the ranks of a run: which ones died, and stopping the others cleanly.

:func:`start_watched` then :func:`watch_started` are :func:`hspmd.runtime.launcher.launch.launch`
for elastic runs. The first starts ``mpiexec -disable-auto-cleanup`` (MPICH's Hydra: when a rank
dies the others are left running, instead of Hydra killing them at once) with every rank under a
guard (:mod:`hspmd.runtime.launcher.rank_guard`), which writes ``STATUS_DIR/rank-<r>.exit`` when its rank
ends; the second polls those files. A rank that ends with a non-zero code before the
launcher stops the run is a failure: killed by a signal, it is a lost device (``WatchedRun.lost``:
killed from outside, crashed, out of memory); with an exit code, the program failed
(``WatchedRun.errors``). Then the launcher runs the caller's ``before_stop`` (an elastic run
waits there for checkpoints in flight), stops the rest (SIGTERM to mpiexec, which Hydra passes to
every guard, which passes it to its rank and kills the rank 5 s later if it is stuck in an MPI
call), and reports how every rank ended (:class:`WatchedRun`).

Hydra itself ends the whole run at once, killing every process so that no end is recorded, when a
rank calls MPI_Abort (the worker's way out on an error) and when a guard (or a host's proxy) is
killed; such a run ends with mpiexec's non-zero code and no lost rank. (A rank's pid file, which
its worker writes, ``rank-<r>.pid``, names the rank, not its guard.)

``STATUS_DIR`` must be visible to every host (as an elastic run's checkpoint directory must be
anyway). Its old ``rank-*.exit`` and ``rank-*.pid`` files are removed before the start.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from hspmd.runtime.launcher import rank_guard
from hspmd.runtime.launcher.launch import LaunchError, mpiexec_command, rank_environment

__all__ = ["RankEnd", "WatchedRun", "read_rank_ends", "start_watched", "stop_started", "watch_started"]

#: the path of the guard script (started by path: it imports nothing of hspmd)
GUARD = os.path.abspath(rank_guard.__file__)

#: seconds between two looks at the status files
POLL_S = 0.1

#: seconds mpiexec has to end after SIGTERM before its survivors are killed: the guards' own
#: SIGKILL deadline plus time to write their status
STOP_GRACE_S = rank_guard.KILL_AFTER_S + 5


@dataclass(frozen=True)
class RankEnd:
    """How one rank ended, as its guard recorded it."""

    rank: int
    host: str
    pid: int
    returncode: int  # negative: the signal that ended it
    stopped: bool  # its guard had been asked to stop it

    @property
    def killed(self) -> bool:
        """Whether a signal ended the rank without anyone in the run asking: a lost device
        (killed, crashed, out of memory) rather than the program giving up."""
        return self.returncode < 0 and not self.stopped

    def how(self) -> str:
        """Return how the rank ended, in words: 'SIGKILL', 'exit code 1'."""
        if self.returncode < 0:
            try:
                return signal.Signals(-self.returncode).name
            except ValueError:
                return f"signal {-self.returncode}"
        return f"exit code {self.returncode}"


@dataclass(frozen=True)
class WatchedRun:
    """The end of a watched run: mpiexec's exit code and how each rank that the guards saw ended."""

    returncode: int
    ends: tuple[RankEnd, ...]

    @property
    def lost(self) -> tuple[RankEnd, ...]:
        """The ranks killed by a signal that the run did not send (lost devices)."""
        return tuple(e for e in self.ends if e.killed)

    @property
    def errors(self) -> tuple[RankEnd, ...]:
        """The ranks that exited on their own with a non-zero exit code (the program failed)."""
        return tuple(e for e in self.ends if e.returncode > 0 and not e.stopped)


def read_rank_ends(status_dir: str) -> tuple[RankEnd, ...]:
    """Return the ends recorded in ``status_dir`` so far, by rank."""
    out = []
    for path in glob.glob(os.path.join(status_dir, "rank-*.exit")):
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
            out.append(RankEnd(int(d["rank"]), str(d["host"]), int(d["pid"]), int(d["returncode"]),
                               bool(d["stopped"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being replaced, or not ours
    return tuple(sorted(out, key=lambda e: e.rank))


def _clear(status_dir: str) -> None:
    """Remove the status and pid files of an earlier run from ``status_dir`` (creating it)."""
    os.makedirs(status_dir, exist_ok=True)
    for pattern in ("rank-*.exit", "rank-*.pid"):
        for path in glob.glob(os.path.join(status_dir, pattern)):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def _local_pids(status_dir: str) -> dict[int, int]:
    """Return rank -> pid of the ranks on this host whose pid files (``<host> <pid>``, written by
    the worker) are in ``status_dir``."""
    here, out = socket.gethostname(), {}
    for path in glob.glob(os.path.join(status_dir, "rank-*.pid")):
        try:
            rank = int(os.path.basename(path)[len("rank-"):-len(".pid")])
            with open(path, encoding="utf-8") as f:
                host, pid = f.read().split()
            if host == here:
                out[rank] = int(pid)
        except (OSError, ValueError):
            continue
    return out


def _stop(proc: subprocess.Popen, status_dir: str) -> None:
    """Stop the run of mpiexec ``proc``: SIGTERM (passed on to every rank), then SIGKILL."""
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(STOP_GRACE_S)
        return
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        pass
    for pid in _local_pids(status_dir).values():  # a rank is in its own session: not in the group
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def start_watched(
    n: int,
    python_args: Sequence[str],
    status_dir: str,
    env: Mapping[str, str] | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
) -> subprocess.Popen:
    """Return the mpiexec process running ``python *python_args`` on ``n`` ranks, each under a
    guard that records its end in ``status_dir`` (cleared first); :func:`watch_started` watches it.

    ``env``, ``hosts`` and ``hostfile`` are as for :func:`hspmd.runtime.launcher.launch.launch`.
    Needs MPICH's Hydra ``mpiexec``.
    """
    _clear(status_dir)
    guarded = [GUARD, status_dir, "--", sys.executable, *map(str, python_args)]
    cmd = mpiexec_command(n, guarded, hosts, hostfile, options=("-disable-auto-cleanup",))
    try:
        return subprocess.Popen(cmd, env=rank_environment(n, env, one_host=not (hosts or hostfile)),
                                start_new_session=True)
    except OSError as exc:
        raise LaunchError(f"cannot start {cmd[0]}: {exc}") from exc


def watch_started(
    proc: subprocess.Popen,
    status_dir: str,
    before_stop: Callable[[tuple[RankEnd, ...]], None] | None = None,
    stop_if: Callable[[RankEnd], bool] | None = None,
    check: Callable[[], tuple[RankEnd, ...]] | None = None,
) -> WatchedRun:
    """Watch the run `start_watched` started until all its ranks end or one fails; return how they ended.

    When a rank fails (a non-zero exit code or a signal it was not asked to stop by),
    ``before_stop`` gets the ends recorded so far, then the other ranks are stopped. On
    KeyboardInterrupt all are stopped and it propagates. ``stop_if`` (given an end) narrows which
    ends stop the run (a parameter-server run goes on without a lost worker); the others' are
    reported all the same. ``check``, called at every look, returns ends the launcher found
    itself (a rank it killed for its silence, `hspmd.runtime.launcher.heartbeat`), counted as failures.
    """
    failed: dict[int, RankEnd] = {}  # the ends that made the launcher stop the run
    try:
        while True:
            try:
                code = proc.wait(POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            ends = read_rank_ends(status_dir)
            # before the launcher stops the run, a rank asked to stop was asked by someone else
            failed = {e.rank: replace(e, stopped=False) for e in ends
                      if e.returncode != 0 and (stop_if is None or stop_if(replace(e, stopped=False)))}
            if check is not None:
                failed.update({e.rank: e for e in check() if e.rank not in failed})
            if failed:
                if before_stop is not None:
                    before_stop(tuple(failed.values()))
                _stop(proc, status_dir)
                code = proc.returncode
                break
    except BaseException:
        _stop(proc, status_dir)
        raise
    ends = {e.rank: e for e in read_rank_ends(status_dir)} | failed
    return WatchedRun(code, tuple(ends[r] for r in sorted(ends)))


def stop_started(proc: subprocess.Popen, status_dir: str) -> None:
    """Stop the run `start_watched` started (SIGTERM to its ranks, SIGKILL to what is left)."""
    if proc.poll() is None:
        _stop(proc, status_dir)
