"""Fault injection for tests of elastic runs: `HSPMD_FAULT=rank:step` kills that rank at that step.

The rank sends itself SIGKILL at the start of the step, which is what a crash or the kernel's
out-of-memory killer does: nothing is flushed, nothing is said. `rank:step:stop` sends SIGSTOP
instead: the rank hangs (its heartbeat stops), which `--silent-after S` must notice. Steps count
from 1, as in the `--log` file, and are the run's own (a run resumed from step 5 meets step 7 two
steps in).

`hspmd run --elastic` drops the variable from the environment of the attempts it restarts: a
fault fires once per run (the ranks are numbered anew after a restart, so it would otherwise
strike another device at every resume), and it reads the value before the first attempt, so a
malformed one is an error of the command line rather than of every rank.
"""

from __future__ import annotations

import os
import signal

__all__ = ["FaultSpecError", "fault_point", "parse_fault_actions", "parse_faults"]

VARIABLE = "HSPMD_FAULT"

#: what a fault does to its rank, by the third field of its spec (none: kill)
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


class FaultSpecError(ValueError):
    """`HSPMD_FAULT` is not a comma-separated list of `rank:step[:kill|stop]`."""


def parse_fault_actions(text: str) -> dict[tuple[int, int], str]:
    """Return (rank, step) -> "kill" or "stop" of `HSPMD_FAULT` text such as `1:7` or `1:7:stop,2:9`."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        fields = item.split(":")
        try:
            pair = (int(fields[0]), int(fields[1])) if len(fields) in (2, 3) else None
        except ValueError:
            pair = None
        action = fields[2] if len(fields) == 3 else "kill"
        if pair is None or pair[0] < 0 or pair[1] < 1 or action not in ACTIONS:
            raise FaultSpecError(f"{VARIABLE}={text!r}: expected rank:step or rank:step:stop (a rank >= 0, a step "
                                 f">= 1), comma-separated, e.g. 1:7")
        out[pair] = action
    return out


def parse_faults(text: str) -> set[tuple[int, int]]:
    """Return the (rank, step) pairs of `HSPMD_FAULT` text such as `1:7` or `1:7,2:9`."""
    return set(parse_fault_actions(text))


def fault_point(rank: int, step: int) -> None:
    """Kill (or stop) this process if `HSPMD_FAULT` names (`rank`, `step`)."""
    text = os.environ.get(VARIABLE)
    if text:
        action = parse_fault_actions(text).get((rank, step))
        if action is not None:
            os.kill(os.getpid(), ACTIONS[action])
