"""Fault injection for tests of elastic runs: `HSPMD_FAULT=rank:step` kills that rank at that step.

The rank sends itself SIGKILL at the start of the step, which is what a crash or the kernel's
out-of-memory killer does: nothing is flushed, nothing is said. Steps count from 1, as in the
`--log` file, and are the run's own (a run resumed from step 5 meets step 7 two steps in).

`hspmd run --elastic` drops the variable from the environment of the attempts it restarts: a
fault fires once per run (the ranks are numbered anew after a restart, so it would otherwise
strike another device at every resume), and it reads the value before the first attempt, so a
malformed one is an error of the command line rather than of every rank.
"""

from __future__ import annotations

import os
import signal

__all__ = ["FaultSpecError", "fault_point", "parse_faults"]

VARIABLE = "HSPMD_FAULT"


class FaultSpecError(ValueError):
    """`HSPMD_FAULT` is not a comma-separated list of `rank:step`."""


def parse_faults(text: str) -> set[tuple[int, int]]:
    """Return the (rank, step) pairs of `HSPMD_FAULT` text such as `1:7` or `1:7,2:9`."""
    out = set()
    for item in filter(None, (t.strip() for t in text.split(","))):
        rank, sep, step = item.partition(":")
        try:
            pair = (int(rank), int(step))
        except ValueError:
            pair = None
        if not sep or pair is None or pair[0] < 0 or pair[1] < 1:
            raise FaultSpecError(f"{VARIABLE}={text!r}: expected rank:step (a rank >= 0, a step >= 1), "
                                 f"comma-separated, e.g. 1:7")
        out.add(pair)
    return out


def fault_point(rank: int, step: int) -> None:
    """Kill this process with SIGKILL if `HSPMD_FAULT` names (`rank`, `step`)."""
    text = os.environ.get(VARIABLE)
    if text and (rank, step) in parse_faults(text):
        os.kill(os.getpid(), signal.SIGKILL)
