"""`hspmd run --elastic`: when ranks die, go on from the newest checkpoint on the ranks that are left.

    hspmd run -n N SCRIPT --elastic --checkpoint-dir D [--checkpoint-every K]
              [--fallback-strategy S ...] [--max-restarts R] [--hosts H1,H2 | --hostfile F] ...

Each attempt runs under :func:`hspmd.runtime.watch.launch_watched`, which tells how every rank
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

from hspmd.runtime.launch import LaunchError

#: seconds to wait, once a rank died, for a checkpoint in flight to be completed
CHECKPOINT_WAIT_S = 5.0

#: a checkpoint in flight whose files have not changed for this many seconds is not being written
#: any more (it waits for the pieces of a rank that died)
CHECKPOINT_QUIET_S = 1.0

#: where the ranks' pid files (`rank-<r>.pid`, written by the worker) and end records
#: (`rank-<r>.exit`, written by their guards) are, under the checkpoint directory
RANKS_DIR = ".ranks"

#: the environment variable of injected faults (`hspmd.runtime.fault`), dropped on restarts
FAULT_VARIABLE = "HSPMD_FAULT"


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


def truncate_log(path: str | None, step: int) -> None:
    """Cut the `--log` file at `path` back to its records of steps up to `step` (a half-written
    last line goes too; records without a step stay)."""
    if not path or not os.path.isfile(path):
        return
    keep = [line if line.endswith("\n") else line + "\n" for line, r in _log_records(path)
            if r is not None and not (isinstance(r.get("step"), int) and r["step"] > step)]
    tmp = f"{path}.{os.getpid()}.part"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(keep)
    os.replace(tmp, path)


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
    from hspmd.runtime.fault import FaultSpecError, parse_faults

    from hspmd.runtime.launch import find_mpiexec, is_hydra

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
    from hspmd.runtime.watch import launch_watched

    _check(args)
    directory = args.checkpoint_dir
    status_dir = os.path.join(directory, RANKS_DIR)
    n, strategy, env = args.n, args.strategy, dict(os.environ)
    start_resume, start_init = args.resume, args.init_from  # where the first attempt starts from
    append = False
    newest = latest_checkpoint(directory)
    if newest and not args.resume:  # the run goes on (on as many devices as there are now)
        start_resume, start_init, append = newest, None, True
        truncate_log(args.log, checkpoint_step(newest))
        unused = f" (not --init-from {args.init_from})" if args.init_from else ""
        _say(f"resuming from {newest} (the newest checkpoint in {directory}){unused} on {_ranks(n)} under "
             f"'{strategy or default_strategy(n)}'")
    resume, init_from = start_resume, start_init
    restart = 0
    while True:
        attempt = _attempt_args(args, n, strategy, resume, init_from, restart)
        bundle = compile_for_run(attempt, n, strategy)
        worker = worker_arguments(attempt, bundle) + (["--log-append"] if append and args.log else [])
        result = launch_watched(n, worker, status_dir, env=env, hosts=args.hosts, hostfile=args.hostfile,
                                before_stop=lambda _ends: wait_for_checkpoints(directory))
        if not result.lost:
            if result.errors:  # the program failed (it said why): every attempt would
                return result.errors[0].returncode
            return result.returncode
        died = describe_losses(result.lost, _next_step(args.log))
        newest = latest_checkpoint(directory)
        left = n - len(result.lost)
        if left < 1:
            raise LaunchError(f"{died}: no rank is left to go on with{_newest_hint(newest)}")
        if restart >= args.max_restarts:
            raise LaunchError(f"{died}, and --max-restarts {args.max_restarts} allows no more restarts"
                              f"{_newest_hint(newest)}")
        restart += 1
        n, strategy = left, choose_strategy(args.fallback_strategy, left)
        resume, init_from = (newest, None) if newest else (start_resume, start_init)
        truncate_log(args.log, checkpoint_step(resume) if resume else 0)
        append = True
        env.pop(FAULT_VARIABLE, None)
        source = f"resuming from {newest}" if newest else f"no checkpoint in {directory} yet: starting over"
        _say(f"{died}; {source} on {_ranks(n)} under '{strategy}' (restart {restart} of {args.max_restarts})")


def _next_step(log: str | None) -> int | None:
    """Return the step after the last one in the `--log` file (the one a rank died in, about)."""
    last = last_logged_step(log)
    return None if last is None else last + 1


def _ranks(n: int) -> str:
    """Return '1 rank', '2 ranks'."""
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _newest_hint(newest: str | None) -> str:
    """Return where to go on from, for an error message."""
    return f"; the newest checkpoint is {newest}, where the same command goes on from" if newest else ""


def _say(line: str) -> None:
    """Print one line of the elastic launcher on stderr."""
    print(f"hspmd run: {line}", file=sys.stderr, flush=True)
