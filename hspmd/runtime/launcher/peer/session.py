"""What a rank of `hspmd run --elastic --redundancy peer[:K]` does with the peer copies, for the worker.

`PeerOptions` are the worker's options (`--peer-dir`, `--peer-every`, `--peer-restore`,
`--restart-record`); `restore` starts a rank from a recovery, `start_copies` makes the copies,
`restart_line` is the `--log` line of a restart (rank 0 writes it beside the first step after).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import numpy as np

from hspmd.runtime.comm.base import Communicator
from hspmd.runtime.launcher.peer.copier import PeerCopies
from hspmd.runtime.launcher.peer.recovery import read_recovery
from hspmd.runtime.launcher.peer.restore import PeerRestoreError, load_peer_state
from hspmd.runtime.stacked import layer_leaves, stacked

__all__ = ["PeerOptions", "PeerRestoreError", "restart_line", "restore", "start_copies"]


@dataclass(frozen=True)
class PeerOptions:
    """A rank's options of the peer copies and of an elastic restart."""

    directory: str | None = None  # the attempt's index and stamps: copies are made when given
    every: int = 1  # a copy after every K-th step
    restore: str | None = None  # start from this recovery (`recovery.write_recovery`)
    restart: dict | None = None  # the restart's facts from the launcher, for the --log line
    heartbeat: str | None = None  # beat in this directory (hspmd.runtime.launcher.heartbeat)

    @staticmethod
    def from_args(directory: str | None, every: int | None, restore: str | None, record: str | None,
                  heartbeat: str | None = None) -> PeerOptions:
        """Return the options from the worker's command line (`record`: JSON)."""
        return PeerOptions(directory, int(every or 1), restore, json.loads(record) if record else None, heartbeat)


def restore(path: str, leaves, comm: Communicator) -> tuple[dict[str, np.ndarray], int, dict]:
    """Return (this rank's state for `leaves`, stacked as its plan holds it; the step it is of; the
    position stamped with it) from the recovery at `path`."""
    try:
        recovery = read_recovery(path)
    except (OSError, ValueError, KeyError) as err:
        raise PeerRestoreError(f"{path}: cannot read the peer recovery ({err})") from None
    state = load_peer_state(recovery, layer_leaves(leaves), comm)
    return stacked(state, leaves), recovery.step, recovery.position


def start_copies(options: PeerOptions, comm: Communicator, leaves, strategy: str) -> PeerCopies | None:
    """Return this rank's peer copies of the state `leaves` describes (None without a directory, or
    alone: a run of one rank has nobody to copy to)."""
    if not options.directory or comm.size < 2:
        return None
    return PeerCopies(options.directory, comm, leaves, options.every, info={"strategy": strategy})


def restart_line(record: dict, now: float | None = None) -> str:
    """Return the `--log` line of a restart: the launcher's facts (`lost_ranks`, `resumed_from_step`,
    `steps_redone`, `source`) and `restart_s`, the seconds from the last step logged before the loss
    (`record["last_step_at"]`, wall clock) to now, the end of the first step after."""
    now = time.time() if now is None else now
    out = {"event": record.get("event", "restart"), "lost_ranks": list(record.get("lost_ranks", [])),
           "resumed_from_step": record.get("resumed_from_step"), "steps_redone": record.get("steps_redone"),
           "restart_s": round(now - record["last_step_at"], 3) if record.get("last_step_at") else None,
           "source": record.get("source")}
    return json.dumps(out)
