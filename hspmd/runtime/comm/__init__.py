"""Communicators: collectives over explicit groups of global ranks (MPI and in-process).

``MPICommunicator`` is imported lazily, so importing this package does not import mpi4py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import CommError, Communicator, Group, fold_sum, group_index, normalize_group
from .inprocess import (
    CommAborted,
    DeadlockError,
    InProcessCommunicator,
    InProcessWorld,
    run_spmd,
)

if TYPE_CHECKING:
    from .mpi import MPICommunicator

__all__ = [
    "CommAborted",
    "CommError",
    "Communicator",
    "DeadlockError",
    "Group",
    "InProcessCommunicator",
    "InProcessWorld",
    "MPICommunicator",
    "fold_sum",
    "group_index",
    "normalize_group",
    "run_spmd",
]


def __getattr__(name: str) -> Any:
    if name == "MPICommunicator":
        from .mpi import MPICommunicator

        return MPICommunicator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
