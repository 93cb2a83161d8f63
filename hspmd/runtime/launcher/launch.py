"""Starting multi-process runs with ``mpiexec`` (the one the ``mpich`` wheel installs).

The MPICH ``mpiexec`` (Hydra) runs more processes than cores without extra flags, so
``mpiexec_command`` adds none; set ``HSPMD_MPIEXEC`` to use a different ``mpiexec``.

``launch`` gives each rank its share of the cores for its math libraries' threads
(``rank_environment``): without it, every rank starts one BLAS thread (and one OpenMP thread)
per core, and n ranks on the same cores spin against each other. On the 2-core machine this
was measured on, a GPT step over 2 ranks took 725 ms with the libraries' defaults and 27 ms
with one thread per rank (one rank alone: 30 ms).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["LaunchError", "LaunchTimeout", "YIELDING_WAITS", "find_mpiexec", "is_hydra", "launch", "mpiexec_command",
           "rank_environment", "ranks_share_cores"]

_NAMES = ("mpiexec", "mpiexec.hydra")


class LaunchError(RuntimeError):
    """A multi-process run could not be started (or did not end in time)."""


class LaunchTimeout(LaunchError):
    """A multi-process run was killed because it ran past its timeout."""


def _executable(path: Path) -> bool:
    """Return whether ``path`` is an executable file."""
    return path.is_file() and os.access(path, os.X_OK)


def _wheel_mpiexec() -> Path | None:
    """Return the mpiexec installed by the ``mpich`` wheel, if that wheel is installed."""
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        dist = distribution("mpich")
    except (ImportError, PackageNotFoundError):
        return None
    for f in dist.files or ():
        if f.name in _NAMES and f.parent.name == "bin":
            p = Path(dist.locate_file(f))
            if _executable(p):
                return p.resolve()
    return None


def find_mpiexec() -> str:
    """Return the path of the ``mpiexec`` to use.

    Looked for in this order: ``$HSPMD_MPIEXEC``; beside ``sys.executable`` (a virtual
    environment's ``bin``); the ``mpich`` wheel's own; the interpreter's scripts
    directory; ``PATH``.  Raises :class:`LaunchError` if there is none.
    """
    override = os.environ.get("HSPMD_MPIEXEC")
    if override:
        p = Path(override)
        found = str(p) if _executable(p) else shutil.which(override)
        if not found:
            raise LaunchError(f"HSPMD_MPIEXEC={override!r} is not an executable mpiexec")
        return found
    # Not resolved: a venv's python is a symlink to the base interpreter.
    beside = Path(sys.executable).parent
    for name in _NAMES:
        if _executable(beside / name):
            return str(beside / name)
    wheel = _wheel_mpiexec()
    if wheel is not None:
        return str(wheel)
    scripts = sysconfig.get_path("scripts")
    if scripts:
        for name in _NAMES:
            if _executable(Path(scripts) / name):
                return str(Path(scripts) / name)
    for name in _NAMES:
        found = shutil.which(name)
        if found:
            return found
    raise LaunchError(
        "no mpiexec found: install the 'mpich' wheel (pip install mpich) into this "
        "environment, put mpiexec on PATH, or set HSPMD_MPIEXEC"
    )


def is_hydra(mpiexec: str) -> bool:
    """Return whether `mpiexec` is MPICH's Hydra (what `--elastic` needs: `-disable-auto-cleanup`
    keeps the other ranks alive when one dies, so that the launcher learns which one did), from
    what `mpiexec --version` prints."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return "HYDRA" in (out.stdout + out.stderr).upper()


def mpiexec_command(n: int, python_args: Sequence[str], hosts: str | None = None,
                    hostfile: str | None = None, options: Sequence[str] = ()) -> list[str]:
    """Return the command line that runs ``python *python_args`` on ``n`` MPI processes.

    It is ``[mpiexec, "-n", str(n), sys.executable, *python_args]``; MPICH needs no flag to
    run more processes than there are cores. ``hosts`` (comma-separated names) and
    ``hostfile`` go to mpiexec as its own ``-hosts`` and ``-f`` options; ``options`` are more of
    mpiexec's own, put before ``-n``.
    """
    if isinstance(python_args, (str, bytes)):
        raise TypeError("python_args must be a sequence of arguments, not one string")
    n = int(n)
    if n < 1:
        raise LaunchError(f"the number of processes must be at least 1, got {n}")
    placement = (["-hosts", hosts] if hosts else []) + (["-f", hostfile] if hostfile else [])
    return [find_mpiexec(), *placement, *options, "-n", str(n), sys.executable, *map(str, python_args)]


#: the thread counts of the math libraries a rank uses (BLAS, OpenMP in the fused kernels)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def usable_cores() -> int:
    """Return the number of cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


#: MPICH's busy waits, made to give the core away at every poll (its defaults: every 1,000 polls)
#: where ranks share cores; each is set only where the environment does not set it already
YIELDING_WAITS = {"MPIR_CVAR_POLLS_BEFORE_YIELD": "1", "MPIR_CVAR_POSIX_POLL_FREQUENCY": "1"}


def ranks_share_cores(n: int, cpu_bind: Sequence[int] | None = None) -> bool:
    """Return whether `n` ranks on this machine must share cores: `cpu_bind` (a core per rank)
    names a core twice, or, without it, there are more ranks than usable cores."""
    if cpu_bind:
        return len(set(cpu_bind)) < len(cpu_bind)
    return int(n) > usable_cores()


def rank_environment(n: int, env: Mapping[str, str] | None = None,
                     cpu_bind: Sequence[int] | None = None, one_host: bool = True) -> dict[str, str]:
    """Return ``env`` (default: this process's) with each math-library thread count that it does
    not set already set to the ranks' share of the cores, ``max(1, cores // n)``.

    Where the ranks share cores (`ranks_share_cores`; only known for ranks on this machine,
    `one_host`), MPI's waits also yield the core at every poll (`YIELDING_WAITS`). A rank that
    waits in a collective otherwise spins through 1,000 polls before it lets the rank beside it
    run, and every message between two ranks on one core waits for such a hand-over: GPT's
    29 gradient sums over 3 ranks, two of them on one core, took 8.1 ms one by one and 3.1 ms
    in one all-reduce, against 5.0 and 2.1 ms yielding at every poll. Where each rank has its
    own core nobody waits for a core, and the waits keep MPICH's defaults.
    """
    out = dict(os.environ if env is None else env)
    share = str(max(1, usable_cores() // max(1, int(n))))
    for name in THREAD_VARIABLES:
        out.setdefault(name, share)
    if one_host and ranks_share_cores(n, cpu_bind):
        for name, value in YIELDING_WAITS.items():
            out.setdefault(name, value)
    return out


def _kill_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Return once ``proc`` and its process group are gone (SIGTERM, then SIGKILL)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def launch(
    n: int,
    python_args: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    cpu_bind: Sequence[int] | None = None,
) -> int:
    """Return the exit code of ``mpiexec -n n python *python_args``, run to completion.

    Output streams straight to this process's stdout/stderr.  ``env`` replaces the
    environment as in :mod:`subprocess` (``None`` inherits it); either way the ranks get
    their share of the cores for their math libraries, and MPI waits that yield where they
    share cores (``rank_environment``; ``cpu_bind``: the core of each rank, if pinned) unless
    it says otherwise.  If the run takes longer than ``timeout`` seconds, all its processes
    are killed and :class:`LaunchTimeout` is raised; on KeyboardInterrupt they are killed too.
    """
    cmd = mpiexec_command(n, python_args, hosts, hostfile)
    try:
        proc = subprocess.Popen(cmd, env=rank_environment(n, env, cpu_bind, one_host=not (hosts or hostfile)),
                                start_new_session=True)
    except OSError as exc:
        raise LaunchError(f"cannot start {cmd[0]}: {exc}") from exc
    try:
        with _terminated_as_exit():
            return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise LaunchTimeout(
            f"{' '.join(cmd[:3])} ... did not finish within {timeout} s and was killed"
        ) from None
    except BaseException:
        _kill_group(proc)
        raise


@contextlib.contextmanager
def _terminated_as_exit():
    """Within the block, SIGTERM and SIGHUP (`timeout`, a batch system, a closed terminal) end
    the process as SystemExit(128 + signal), so that the job's processes, which run in a session
    of their own, are killed with it (`launch`), not left running. Outside the main thread: as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_on(signum, frame):
        raise SystemExit(128 + signum)

    old = {sig: signal.signal(sig, exit_on) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
