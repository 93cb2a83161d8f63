"""The elastic launcher's standby world: the attempt that follows the loss of one rank, made ahead.

While an attempt of `hspmd run --elastic --redundancy peer` trains on n ranks, a thread of the
launcher compiles the program for n - 1 ranks (the strategy `choose_strategy` would pick) and
starts its ranks (`hspmd.runtime.launcher.standby`): they import, join their own MPI job, build their plan
and wait for orders. After the loss of one rank the launcher gives them their orders (the peer
copies' recovery, or a disk checkpoint) instead of compiling and starting processes; after the
loss of more, or at the end of the run, it dismisses them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import threading
from collections.abc import Callable

__all__ = ["StandbyWorld"]

#: seconds a dismissed standby world has to end before it is stopped
DISMISS_WAIT_S = 10.0


class StandbyWorld:
    """The ranks of the attempt after the loss of one rank (see the module docstring)."""

    def __init__(self, attempt: argparse.Namespace, n: int, strategy: str, directory: str, restart: int,
                 env: dict, compile_for_run: Callable, worker_arguments: Callable, extra: list[str]) -> None:
        """Start preparing, in a thread: `attempt` (the command line of that attempt, with `n` and
        `strategy`), compiled with `compile_for_run` and started with `worker_arguments` + `extra`;
        its files under `directory` (the checkpoint directory) named for restart `restart`."""
        self.n, self.strategy = n, strategy
        self.status_dir = os.path.join(directory, f".ranks-standby-{restart}")
        self.orders = os.path.join(directory, ".standby", f"orders-{restart}.json")
        self.proc: subprocess.Popen | None = None
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._dismissed = False
        self._thread = threading.Thread(target=self._prepare, name=f"standby-{restart}", daemon=True,
                                        args=(attempt, env, compile_for_run, worker_arguments, extra))
        self._thread.start()

    def _prepare(self, attempt, env, compile_for_run, worker_arguments, extra) -> None:
        from hspmd.runtime.launcher.watch import start_watched

        try:
            os.makedirs(os.path.dirname(self.orders), exist_ok=True)
            if os.path.exists(self.orders):
                os.remove(self.orders)
            bundle = compile_for_run(attempt, self.n, self.strategy)
            argv = worker_arguments(attempt, bundle) + extra + ["--standby", self.orders]
            with self._lock:
                if not self._dismissed:
                    self.proc = start_watched(self.n, argv, self.status_dir, env=env, hosts=attempt.hosts,
                                              hostfile=attempt.hostfile)
        except BaseException as err:  # the cold path says it, if it meets it too
            self.error = err

    def ready(self, wait: float = 0.0) -> bool:
        """Return whether the standby ranks were started and none of them ended (waiting up to
        `wait` seconds for the start)."""
        from hspmd.runtime.launcher.watch import read_rank_ends

        self._thread.join(wait)
        return (not self._thread.is_alive() and self.proc is not None and self.proc.poll() is None
                and not read_rank_ends(self.status_dir))  # none of its ranks ended while waiting

    def promote(self, resume: str | None, peer_restore: str | None, peer_dir: str | None,
                record: dict | None) -> subprocess.Popen:
        """Return the standby's mpiexec process, its ranks told where to start from."""
        from hspmd.runtime.launcher.standby import give_orders

        give_orders(self.orders, resume, peer_restore, peer_dir, record)
        assert self.proc is not None
        return self.proc

    def dismiss(self) -> None:
        """End the standby ranks (told to; stopped if they do not end in `DISMISS_WAIT_S`)."""
        from hspmd.runtime.launcher.standby import dismiss
        from hspmd.runtime.launcher.watch import stop_started

        with self._lock:
            self._dismissed = True
        self._thread.join()
        if self.proc is None:
            return
        try:
            dismiss(self.orders)
        except OSError:
            pass
        try:
            self.proc.wait(DISMISS_WAIT_S)
        except subprocess.TimeoutExpired:
            stop_started(self.proc, self.status_dir)
