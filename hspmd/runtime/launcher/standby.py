"""Standby ranks: the next attempt of an elastic run, started before it is needed.

With `--redundancy peer`, `hspmd run --elastic` starts the ranks of the attempt that would follow
the loss of one rank while the current attempt trains: `python -m hspmd.runtime.worker BUNDLE
--standby ORDERS ...` imports everything, joins its own MPI job, loads its program and builds
its plan, then waits (`wait_for_orders`, a look every 10 ms) until the launcher writes the file
ORDERS. After a loss the ranks of the new attempt are then ready: they read where to start from
(the peer copies' recovery, or a disk checkpoint) and go on, so the restart costs what is left
(reading the state, the first step), not starting processes, importing, compiling and planning.

ORDERS is one JSON object: `{"dismiss": true}` (the run ended, or lost more ranks than the
standby was made for: the standby ranks exit quietly), or what to start from:
`{"resume": D/step-k | null, "peer_restore": FILE | null, "peer_dir": DIR | null,
"restart_record": {...} | null, "log_append": true}`.
"""

from __future__ import annotations

import json
import os
import time

__all__ = ["StandbyDismissed", "dismiss", "give_orders", "wait_for_orders"]

#: seconds between two looks at the orders file
POLL_S = 0.01


class StandbyDismissed(Exception):
    """The launcher dismissed this standby rank: it ends without training."""


def wait_for_orders(path: str, poll: float = POLL_S) -> dict:
    """Return the orders written to `path`, once they are there; StandbyDismissed for a dismissal."""
    while True:
        try:
            with open(path, encoding="utf-8") as f:
                orders = json.load(f)
            break
        except FileNotFoundError:
            time.sleep(poll)
    if orders.get("dismiss"):
        raise StandbyDismissed()
    return orders


def _write(path: str, orders: dict) -> None:
    tmp = f"{path}.{os.getpid()}.part"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(orders))
    os.replace(tmp, path)


def give_orders(path: str, resume: str | None, peer_restore: str | None, peer_dir: str | None,
                restart_record: dict | None) -> None:
    """Tell the standby ranks waiting on `path` where to start from (atomically)."""
    _write(path, {"resume": resume, "peer_restore": peer_restore, "peer_dir": peer_dir,
                  "restart_record": restart_record, "log_append": True})


def dismiss(path: str) -> None:
    """Tell the standby ranks waiting on `path` to end."""
    _write(path, {"dismiss": True})
