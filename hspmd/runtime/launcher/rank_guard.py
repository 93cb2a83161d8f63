"""The guard of one rank of an elastic run: run the rank as a child and record how it ended.

``python .../hspmd/runtime/launcher/rank_guard.py STATUS_DIR -- PROGRAM [ARGS...]`` is what
:func:`hspmd.runtime.launcher.watch.start_watched` starts under ``mpiexec`` for every rank, in place of
the rank's own program. The guard starts ``PROGRAM ARGS...`` as its child (which inherits the
environment and file descriptors, so it is the MPI rank), waits for it, and writes
``STATUS_DIR/rank-<r>.exit``, one JSON object::

    {"rank": 1, "host": "vm", "pid": 4242, "returncode": -9, "stopped": false}

``returncode`` is the child's (negative: the signal that ended it, as in :mod:`subprocess`);
``stopped`` says the guard had been sent a signal to pass on (mpiexec or the launcher stopping
the run), so the end was asked for, not a failure. The guard then exits with the child's code
(128 + the signal for a signal). Only a guard knows how its rank ended: the launcher may run on
another host, and ``mpiexec -disable-auto-cleanup`` (which keeps the other ranks alive after one
dies, so that the launcher decides when to stop them) says nothing until all have ended.

The guard passes SIGTERM, SIGINT and SIGHUP on to its child and, if the child has not ended
``KILL_AFTER_S`` seconds later (a rank blocked inside an MPI call may not), kills it with SIGKILL;
the child is killed (SIGKILL, Linux ``PR_SET_PDEATHSIG``) if the guard itself is killed, so no rank
outlives its guard. It ignores SIGUSR1 and SIGUSR2 (``IGNORED`` says why). The rank ``r`` is the one the process manager gives (``PMI_RANK``, ``PMIX_RANK`` or
``OMPI_COMM_WORLD_RANK``).

It is started by its path, not with ``-m``, and imports only the standard library: a guard costs
a bare interpreter, not the import of ``hspmd`` (about half a second and its memory per rank).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping

#: the environment variables a process manager gives a rank its number in, in the order read
RANK_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")

#: signals the guard hands on to its rank as requests to stop
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

#: signals the guard ignores: Hydra (under -disable-auto-cleanup) sends SIGUSR1 to every process
#: of the run when one of them ends (even, racing the others' exits, at a good end). It would kill
#: a guard (its default action); passed on, it could make MPICH fail the rank's collectives, and a
#: survivor's failure would read as an error of the program. The rank is started without them ignored.
IGNORED = (signal.SIGUSR1, signal.SIGUSR2)

#: seconds a rank has to end after a forwarded signal before the guard kills it
KILL_AFTER_S = 5

_PR_SET_PDEATHSIG = 1


def rank_of(env: Mapping[str, str]) -> int:
    """Return this process's rank as its process manager set it in ``env``."""
    for name in RANK_VARIABLES:
        if env.get(name, "").isdigit():
            return int(env[name])
    raise SystemExit(f"rank_guard: none of {', '.join(RANK_VARIABLES)} is set; run me under mpiexec")


def status_path(status_dir: str, rank: int) -> str:
    """Return the path of the file that says how rank ``rank`` ended."""
    return os.path.join(status_dir, f"rank-{rank}.exit")


def _die_with_parent(parent: int):
    """Return a preexec function that makes the child die (SIGKILL) when its parent does, with
    the default actions of the signals the guard ignores."""

    try:  # loaded here, before the fork
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the guard forwards signals, and that is all
        prctl = None

    def preexec() -> None:
        for sig in IGNORED:
            signal.signal(sig, signal.SIG_DFL)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:  # the guard died before prctl took effect
                os._exit(128 + signal.SIGKILL)

    return preexec


def _write_status(path: str, status: dict) -> None:
    """Write ``status`` to ``path`` atomically (a reader sees all of it or no file)."""
    tmp = f"{path}.{os.getpid()}.part"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(status) + "\n")
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    """Run the guarded rank ``argv = [STATUS_DIR, "--", PROGRAM, *ARGS]``; return its exit code."""
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: rank_guard.py STATUS_DIR -- PROGRAM [ARGS...]")
    status_dir, command = argv[0], argv[2:]
    rank = rank_of(os.environ)
    asked: list[int] = []  # the stop signals received (filled by the handler)
    child: list[subprocess.Popen] = []  # the rank, once started (read by the handlers)

    def forward(signum, _frame) -> None:
        asked.append(signum)
        if child:
            child[0].send_signal(signum)
        signal.alarm(KILL_AFTER_S)

    def kill(_signum, _frame) -> None:
        if child:
            child[0].kill()

    signal.signal(signal.SIGALRM, kill)
    for sig in STOPS:
        signal.signal(sig, forward)
    for sig in IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    # close_fds=False: the rank needs the process manager's descriptors (PMI_FD)
    proc = subprocess.Popen(command, close_fds=False, preexec_fn=_die_with_parent(os.getpid()))
    child.append(proc)
    if asked:  # a signal came while the child was being started
        proc.send_signal(asked[-1])
    code = proc.wait()
    _write_status(status_path(status_dir, rank), {
        "rank": rank, "host": socket.gethostname(), "pid": proc.pid, "returncode": code, "stopped": bool(asked)})
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    # os._exit: no interpreter shutdown, during which Python restores the default actions of the
    # signals it handles, so that a stop signal arriving then would kill the guard; and Hydra,
    # once stopping a run, kills every process at once when one of them is killed by a signal
    # (seen with MPICH 5.0.2), before the others have written how their ranks ended.
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
