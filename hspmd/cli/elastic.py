"""`hspmd run --elastic`: when ranks die, go on from the newest checkpoint on the ranks that are left.

    hspmd run -n N SCRIPT --elastic --checkpoint-dir D [--checkpoint-every K]
              [--fallback-strategy S ...] [--max-restarts R] [--hosts H1,H2 | --hostfile F] ...

Each attempt runs under :mod:`hspmd.runtime.launcher.watch`, which tells how every rank
ended. When ranks die by a signal (killed, crashed, out of memory; `HSPMD_FAULT` in tests), the
launcher waits up to `CHECKPOINT_WAIT_S` for a checkpoint that is still being written, stops the
other ranks, and starts again on the `n` ranks that are left:

* the strategy is the first `--fallback-strategy` (in the order given) for exactly `n` devices,
  else data parallelism over `n` (`hspmd.compiler.default_strategy`); the script is compiled again;
* the ranks resume from the newest complete checkpoint in D (`--resume D/step-<k>`); without one
  yet, they start the way the first attempt did;
* the `--log` file is cut back to the steps up to the one resumed from and the restart appends to
  it, so the log reads as one run, each step once;
* `HSPMD_FAULT` is dropped from the restart's environment: an injected fault fires once;
* one line on stderr says what happened and what comes next, e.g. `hspmd run: rank 1 died at
  step ~7 (SIGKILL); resuming from D/step-5 on 2 ranks under '[0,1]: dp=2' (restart 1 of 3)`.

A device coming back is a new run on more ranks: `hspmd run -n N --elastic --checkpoint-dir D`
where D holds a checkpoint (and no `--resume` is given) resumes from its newest, in any strategy,
and says so in one line. A rank that fails with an exit code (an error of the program or of the
user, which every rank would meet again) is no device loss: the run ends with that code. More
losses than `--max-restarts` allows end the run with an error naming the newest checkpoint, where
the same command goes on from. With `--dump-dir B`, restart `i` keeps its bundle in `B-restart-i`.

What it needs from the launcher: MPICH's Hydra `mpiexec` (the `mpich` wheel's), started by hspmd
itself, for `-disable-auto-cleanup` (the other ranks live on when one dies, so that the guards
can tell which one did) and for starting the ranks of each restart. Where hspmd cannot restart
ranks itself it refuses in one line before starting: an `mpiexec` that is not Hydra
(`HSPMD_MPIEXEC`), and `hspmd run` inside a job that `srun` or `mpirun` started
(`hspmd.cli.outside`; such a job is restarted by its launcher, e.g. Slurm's `--requeue`, and goes
on from the newest checkpoint). docs/clusters.md says the same for users.

Not covered: when a rank's guard or a host's process manager (`hydra_pmi_proxy`: a host lost in a
multi-host run) is killed, Hydra ends the whole run itself, killing every rank, and nothing tells
which device was lost. That run ends with mpiexec's non-zero code; the same command, run again
(with the `-n` there is now), goes on from the newest checkpoint.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from collections.abc import Callable

from hspmd.runtime.launcher.heartbeat import clear_beats
from hspmd.runtime.launcher.launch import LaunchError

#: seconds to wait, once a rank died, for a checkpoint in flight to be completed
CHECKPOINT_WAIT_S = 5.0

#: a checkpoint in flight whose files have not changed for this many seconds is not being written
#: any more (it waits for the pieces of a rank that died)
CHECKPOINT_QUIET_S = 1.0

#: where the ranks' pid files (`rank-<r>.pid`, written by the worker) and end records
#: (`rank-<r>.exit`, written by their guards) are, under the checkpoint directory
RANKS_DIR = ".ranks"

#: the environment variable of injected faults (`hspmd.runtime.launcher.fault`), dropped on restarts
FAULT_VARIABLE = "HSPMD_FAULT"

#: where the peer copies' index and stamps are (`gen-<restart>/`), under the checkpoint directory
PEER_DIR = ".peer"

#: seconds a restart waits for the standby world to have started (it is prepared from the attempt's start)
STANDBY_WAIT_S = 30.0


def parse_redundancy(text: str | None, elastic: bool) -> int | None:
    """Return K of `--redundancy peer[:K]` (1 for `peer`), None without the option; SystemExit
    (one line) for another spelling, or without --elastic."""
    if text is None:
        return None
    kind, sep, every = text.partition(":")
    if kind != "peer" or (sep and not every.isdigit()) or (sep and int(every) < 1):
        raise SystemExit(f"hspmd: error: --redundancy {text}: expected peer or peer:K (K >= 1, the steps between "
                         "copies), e.g. peer:2")
    if not elastic:
        raise SystemExit("hspmd: error: --redundancy needs --elastic (the copies are what its restarts resume from)")
    return int(every) if sep else 1


def choose_strategy(fallbacks: list[str], n: int) -> str:
    """Return the strategy for `n` devices: the first of `fallbacks` that has exactly `n`, else
    data parallelism over `n`."""
    from hspmd.compiler import default_strategy
    from hspmd.ir.strategy import parse_strategy

    for text in fallbacks:
        if parse_strategy(text).num_devices == n:
            return text
    return default_strategy(n)


def checkpoint_step(path: str) -> int:
    """Return the step that checkpoint `path` (D, or D/step-<k>) was written after."""
    from hspmd.runtime.checkpoint.manifest import read_manifest, resolve_checkpoint

    return read_manifest(resolve_checkpoint(path)).step


def _log_records(path: str) -> list[tuple[str, dict | None]]:
    """Return each line of the log at `path` with its JSON object (None where it is not one)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            out.append((line, record if isinstance(record, dict) else None))
    return out


def last_logged_step(path: str | None) -> int | None:
    """Return the highest step in the `--log` file at `path`, None if there is none."""
    if not path or not os.path.isfile(path):
        return None
    steps = [r["step"] for _, r in _log_records(path) if r is not None and isinstance(r.get("step"), int)]
    return max(steps, default=None)


def _last_change(path: str) -> float:
    """Return the newest modification time of directory `path` and the files in it."""
    times = [os.stat(path).st_mtime]
    for entry in os.scandir(path):
        try:
            times.append(entry.stat().st_mtime)
        except FileNotFoundError:
            pass
    return max(times)


def wait_for_checkpoints(directory: str, limit: float = CHECKPOINT_WAIT_S) -> None:
    """Return once no checkpoint of `directory` is being written (no `step-<k>.tmp` that changed
    in the last `CHECKPOINT_QUIET_S` seconds), or after `limit` seconds."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        busy = False
        for path in glob.glob(os.path.join(directory, "step-*.tmp")):
            try:
                busy = busy or time.time() - _last_change(path) < CHECKPOINT_QUIET_S
            except FileNotFoundError:  # renamed into place just now
                continue
        if not busy:
            return
        time.sleep(0.1)


def describe_losses(lost, step: int | None) -> str:
    """Return e.g. 'rank 1 died at step ~7 (SIGKILL)' for the ranks `lost` (RankEnds)."""
    ranks = [e.rank for e in lost]
    hows = sorted({e.how() for e in lost})
    who = f"rank {ranks[0]} died" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} died"
    when = f" at step ~{step}" if step is not None else ""
    return f"{who}{when} ({', '.join(hows)})"


def _check(args) -> None:
    """Raise for what would stop an elastic run later: said before the first attempt starts."""
    from hspmd.ir.strategy import parse_strategy
    from hspmd.runtime.launcher.fault import FaultSpecError, parse_faults

    from hspmd.runtime.launcher.launch import find_mpiexec, is_hydra

    mpiexec = find_mpiexec()
    if not is_hydra(mpiexec):
        raise LaunchError(f"--elastic restarts ranks with MPICH's Hydra mpiexec (the mpich wheel's), which keeps the "
                          f"others alive when one dies; {mpiexec} is not Hydra (docs/clusters.md)")
    if os.path.isdir(args.script):
        raise LaunchError(f"--elastic needs a model script, which it compiles again for the ranks that are left; "
                          f"{args.script} is a compiled bundle")
    for text in args.fallback_strategy:
        parse_strategy(text)  # a StrategyError says where the text is wrong
    try:
        parse_faults(os.environ.get(FAULT_VARIABLE, ""))
    except FaultSpecError as err:
        raise LaunchError(str(err)) from None


def _attempt_args(args, n: int, strategy: str | None, resume: str | None, init_from: str | None,
                  restart: int) -> argparse.Namespace:
    """Return `args` for one attempt: its ranks, strategy, where it starts from, its bundle's dir."""
    out = argparse.Namespace(**vars(args))
    out.n, out.strategy, out.resume, out.init_from = n, strategy, resume, init_from
    if restart and args.dump_dir:
        out.dump_dir = f"{args.dump_dir}-restart-{restart}"
    return out


def run_elastic(args, compile_for_run: Callable[[argparse.Namespace, int, str | None], str],
                worker_arguments: Callable[[argparse.Namespace, str], list[str]]) -> int:
    """Run `hspmd run --elastic` for the parsed command line `args`; return the exit code.

    `compile_for_run(args, n, strategy)` returns the bundle of one attempt and
    `worker_arguments(args, bundle)` the arguments of its ranks (`hspmd.cli.main`'s, passed in so
    that this module does not import the one that imports it).
    """
    from hspmd.compiler import default_strategy
    from hspmd.runtime.checkpoint.manifest import latest_checkpoint

    _check(args)
    directory = args.checkpoint_dir
    run = _Run(args, compile_for_run, worker_arguments)
    newest = latest_checkpoint(directory)
    if newest and not args.resume:  # the run goes on (on as many devices as there are now)
        run.start_resume, run.start_init = newest, None
        run.resume, run.init_from, run.append = newest, None, True
        run.record = _resume_record(args.log, checkpoint_step(newest))
        unused = f" (not --init-from {args.init_from})" if args.init_from else ""
        _say(f"resuming from {newest} (the newest checkpoint in {directory}){unused} on {_ranks(run.n)} under "
             f"'{run.strategy or default_strategy(run.n)}'")
    try:
        while True:
            result = run.attempt()
            if not result.lost:
                if result.errors:  # the program failed (it said why): every attempt would
                    return result.errors[0].returncode
                return result.returncode
            run.after_loss(result.lost)
    finally:
        run.close()


class _Run:
    """The attempts of one elastic run: where the next one starts from, and its standby world."""

    def __init__(self, args, compile_for_run: Callable, worker_arguments: Callable) -> None:
        self.args, self.compile_for_run, self.worker_arguments = args, compile_for_run, worker_arguments
        self.directory = args.checkpoint_dir
        self.status_dir = os.path.join(self.directory, RANKS_DIR)
        self.every = getattr(args, "redundancy", None)  # K of --redundancy peer:K, None without
        self.peer_root = os.path.join(self.directory, PEER_DIR)
        self.n, self.strategy, self.env = args.n, args.strategy, dict(os.environ)
        self.start_resume, self.start_init = args.resume, args.init_from  # where the first attempt starts from
        self.resume, self.init_from = args.resume, args.init_from
        self.append, self.restart = False, 0
        self.record: dict | None = None  # the restart's facts for the --log line
        self.recovery: str | None = None  # the peer copies' recovery the next attempt starts from
        self.standby = None
        self.silenced: list[int] = []  # the ranks this attempt killed for their silence
        self.watched_dir = self.status_dir  # where the guards of the attempt watched record its ranks' ends
        if self.every:
            _clear_peer(self.peer_root)

    def _peer_dir(self) -> str | None:
        return os.path.join(self.peer_root, f"gen-{self.restart}") if self.every else None

    def _extra(self) -> list[str]:
        """Return the worker arguments of the attempt besides `worker_arguments`'."""
        out = ["--log-append"] if self.append and self.args.log else []
        if self.every:
            out += ["--peer-every", str(self.every)]
        if self.args.silent_after:
            out += ["--heartbeat", self.status_dir]
        return out

    def attempt(self):
        """Start the next attempt (the standby world where it is ready) and watch it to its end."""
        from hspmd.runtime.launcher.watch import start_watched, watch_started

        args, peer_dir = self.args, self._peer_dir()
        record = json.dumps(self.record) if self.record is not None and args.log else None
        standby, self.standby = self.standby, None
        clear_beats(self.status_dir)
        self.silenced = []
        if standby is not None and standby.n == self.n and standby.ready(wait=STANDBY_WAIT_S):
            _clear_pids(self.status_dir)
            proc, status_dir = standby.promote(self.resume, self.recovery, peer_dir, self.record), standby.status_dir
        else:
            if standby is not None:
                standby.dismiss()
            attempt = _attempt_args(args, self.n, self.strategy, self.resume, self.init_from, self.restart)
            worker = self.worker_arguments(attempt, self.compile_for_run(attempt, self.n, self.strategy))
            worker += self._extra() + (["--peer-dir", peer_dir] if peer_dir else [])
            worker += (["--peer-restore", self.recovery] if self.recovery else []) + (
                ["--restart-record", record] if record else [])
            proc = start_watched(self.n, worker, self.status_dir, env=self.env, hosts=args.hosts,
                                 hostfile=args.hostfile)
            status_dir = self.status_dir
        if self.every and self.n > 1 and self.restart < args.max_restarts:
            self._prepare_standby()
        self.watched_dir = status_dir
        return watch_started(proc, status_dir, before_stop=lambda _ends: wait_for_checkpoints(self.directory),
                             check=self._silent if args.silent_after else None)

    def _silent(self) -> tuple:
        """Return the ends of the ranks silent for `--silent-after` seconds, killed here (on this host)."""
        import signal
        import socket

        from hspmd.runtime.launcher.heartbeat import silent_ranks
        from hspmd.runtime.launcher.watch import RankEnd, read_rank_ends

        out = []
        ended = {e.rank for e in read_rank_ends(self.watched_dir)}  # an end said is no silence
        for rank in silent_ranks(self.status_dir, self.n, self.args.silent_after):
            if rank in ended or rank in self.silenced:
                continue
            host, pid = socket.gethostname(), -1
            try:
                with open(os.path.join(self.status_dir, f"rank-{rank}.pid"), encoding="utf-8") as f:
                    host, pid_text = f.read().split()
                pid = int(pid_text)
                if host == socket.gethostname():
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError):
                pass  # on another host: stopping the run ends it there
            self.silenced.append(rank)
            out.append(RankEnd(rank, host, pid, -signal.SIGKILL, False))
        return tuple(out)

    def _prepare_standby(self) -> None:
        from hspmd.cli.standby import StandbyWorld

        n = self.n - 1
        strategy = choose_strategy(self.args.fallback_strategy, n)
        attempt = _attempt_args(self.args, n, strategy, None, None, self.restart + 1)
        env = {k: v for k, v in self.env.items() if k != FAULT_VARIABLE}
        extra = (["--log-append"] if self.args.log else []) + ["--peer-every", str(self.every)]
        extra += ["--heartbeat", self.status_dir] if self.args.silent_after else []
        self.standby = StandbyWorld(attempt, n, strategy, self.directory, self.restart + 1, env,
                                    self.compile_for_run, self.worker_arguments, extra)

    def after_loss(self, lost) -> None:
        """Decide where the next attempt starts from after the ranks `lost` (RankEnds) died, and say it."""
        from hspmd.runtime.checkpoint.manifest import latest_checkpoint

        args = self.args
        last, last_at = last_logged_step(args.log), _modified(args.log)
        died = describe_losses(lost, None if last is None else last + 1)
        if self.silenced and len(self.silenced) == len(lost):
            who = ", ".join(map(str, self.silenced))
            step = "" if last is None else f" at step ~{last + 1}"
            died = f"rank{'s' if len(self.silenced) > 1 else ''} {who} fell silent{step} (no heartbeat for " \
                   f"{self.args.silent_after:g} s: killed)"
        newest = latest_checkpoint(self.directory)
        left = self.n - len(lost)
        if left < 1:
            raise LaunchError(f"{died}: no rank is left to go on with{_newest_hint(newest)}")
        if self.restart >= args.max_restarts:
            raise LaunchError(f"{died}, and --max-restarts {args.max_restarts} allows no more restarts"
                              f"{_newest_hint(newest)}")
        source, start, said = self._source(sorted(e.rank for e in lost), newest)
        self.restart += 1
        self.n, self.strategy = left, choose_strategy(args.fallback_strategy, left)
        self.record = {"lost_ranks": sorted(e.rank for e in lost), "resumed_from_step": start,
                       "steps_redone": None if last is None else max(0, last - start), "source": source,
                       "last_step_at": last_at}
        self.append = True
        self.env.pop(FAULT_VARIABLE, None)
        if self.every and self.restart >= 2:  # two generations of copies at most: the one read, the one written
            _remove_generation(self.peer_root, self.restart - 2)
        _say(f"{died}; {said} on {_ranks(self.n)} under '{self.strategy}' (restart {self.restart} of "
             f"{args.max_restarts})")

    def _source(self, lost: list[int], newest: str | None) -> tuple[str, int, str]:
        """Return (source, the step resumed from, what to say) for the next attempt: the peer copies
        where they survived the loss and are not older than the newest checkpoint, else the disk."""
        from hspmd.runtime.launcher.peer.recovery import plan_recovery, write_recovery

        why = ""
        if self.every:
            recovery, why = plan_recovery(self._peer_dir(), set(lost))
            disk = checkpoint_step(newest) if newest else None
            if recovery is not None and (disk is None or recovery.step >= disk):
                self.recovery = os.path.join(self.peer_root, f"recovery-{self.restart + 1}.json")
                write_recovery(recovery, self.recovery)
                self.resume = self.init_from = None
                return "peer", recovery.step, f"resuming from the peer copies of step {recovery.step} in host memory"
            if recovery is not None:
                why = f"the peer copies hold step {recovery.step}, {newest} is newer"
        self.recovery = None
        self.resume, self.init_from = (newest, None) if newest else (self.start_resume, self.start_init)
        start = checkpoint_step(self.resume) if self.resume else 0
        said = f"resuming from {newest}" if newest else f"no checkpoint in {self.directory} yet: starting over"
        return "disk", start, f"{why}: {said}" if why else said

    def close(self) -> None:
        """Dismiss the standby world and remove this host's peer copies."""
        if self.standby is not None:
            self.standby.dismiss()
            self.standby = None
        if self.every:
            _clear_peer(self.peer_root)


def _next_step(log: str | None) -> int | None:
    """Return the step after the last one in the `--log` file (the one a rank died in, about)."""
    last = last_logged_step(log)
    return None if last is None else last + 1


def _modified(path: str | None) -> float | None:
    """Return when the file at `path` was last written (wall clock), None without one."""
    try:
        return os.path.getmtime(path) if path else None
    except OSError:
        return None


def _resume_record(log: str | None, step: int) -> dict | None:
    """Return the facts of a run resumed by a new command (no rank lost in it) for its --log line."""
    last = last_logged_step(log)
    return {"lost_ranks": [], "resumed_from_step": step, "steps_redone": None if last is None else max(0, last - step),
            "source": "disk", "last_step_at": None, "event": "resume"}


def _clear_pids(status_dir: str) -> None:
    """Remove the ranks' pid files of an attempt that ended (the next one writes its own)."""
    for path in glob.glob(os.path.join(status_dir, "rank-*.pid")):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def _clear_peer(peer_root: str) -> None:
    """Remove the peer copies of an earlier run or attempt under `peer_root` (their host memory on
    this host, their index and stamps)."""
    import shutil

    for gen in glob.glob(os.path.join(peer_root, "gen-*")):
        _remove_generation(peer_root, int(gen.rsplit("-", 1)[1]) if gen.rsplit("-", 1)[1].isdigit() else -1)
    shutil.rmtree(peer_root, ignore_errors=True)


def _remove_generation(peer_root: str, gen: int) -> None:
    """Remove the peer copies of attempt `gen` (this host's memory; its index and stamps)."""
    import shutil

    from hspmd.runtime.launcher.peer.slots import remove_shm

    path = os.path.join(peer_root, f"gen-{gen}")
    remove_shm(path)
    shutil.rmtree(path, ignore_errors=True)


def _ranks(n: int) -> str:
    """Return '1 rank', '2 ranks'."""
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _newest_hint(newest: str | None) -> str:
    """Return where to go on from, for an error message."""
    return f"; the newest checkpoint is {newest}, where the same command goes on from" if newest else ""


def _say(line: str) -> None:
    """Print one line of the elastic launcher on stderr."""
    print(f"hspmd run: {line}", file=sys.stderr, flush=True)
