"""Heartbeats of an elastic run's ranks, and the silent ones (`hspmd run --elastic --silent-after S`).

A rank that hangs (a deadlocked or stopped process, a host cut off from the others) ends nothing:
its guard records no end, and the other ranks wait for it in their collectives. So every rank
*beats*: a thread of its own touches `DIR/rank-<r>.beat` every `BEAT_S` seconds. It beats
whatever the rank's main thread waits in (mpi4py and the kernels let go of the interpreter while
they wait or compute) and stops when the process stops. The launcher (`silent_ranks`) counts a
rank whose beat is older than S seconds as lost, kills it where it runs on the launcher's host,
and restarts as for a rank that died.
"""

from __future__ import annotations

import glob
import os
import threading
import time

__all__ = ["BEAT_S", "Heartbeat", "clear_beats", "silent_ranks"]

#: seconds between two beats
BEAT_S = 0.5


def beat_path(directory: str, rank: int) -> str:
    """Return the path of rank `rank`'s beat file."""
    return os.path.join(directory, f"rank-{rank}.beat")


class Heartbeat:
    """A daemon thread touching this rank's beat file every `BEAT_S` seconds until `stop`."""

    def __init__(self, directory: str, rank: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path, self._stop = beat_path(directory, rank), threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(f"{time.time():.3f}\n")

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._beat()
            except OSError:  # the directory went away (the run ended): nothing to beat for
                return

    def stop(self) -> None:
        """Stop beating, and remove the beat file: the rank's training is over, its end is near (the
        process's exit may take a while: no silence to see in it)."""
        self._stop.set()
        self._thread.join()
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass


def clear_beats(directory: str) -> None:
    """Remove the beat files of an earlier attempt."""
    for path in glob.glob(os.path.join(directory, "rank-*.beat")):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def silent_ranks(directory: str, size: int, after: float, now: float | None = None) -> list[int]:
    """Return the ranks of `size` whose beat file is older than `after` seconds (a rank that has not
    beaten yet is starting, not silent)."""
    now = time.time() if now is None else now
    out = []
    for rank in range(size):
        try:
            if now - os.path.getmtime(beat_path(directory, rank)) > after:
                out.append(rank)
        except OSError:
            continue
    return out
