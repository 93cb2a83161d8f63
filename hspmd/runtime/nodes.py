"""The nodes of a bound plan (`hspmd.runtime.plan`), shared with the bucketing that rewrites them
(`hspmd.runtime.buckets`), and the rank-group lookup both use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from xdsl.ir import Operation

from hspmd.codegen.schedule import PlanError

__all__ = ["Node", "group_of"]


@dataclass
class Node:
    """One kernel call of the flat program: the op, its kernel, operand and result slots."""

    op: Operation | None
    kernel: Callable
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    kind: str = "op"  # "op", "view" (its result is a view of its operand), "bucket-start", "bucket-wait", "poll"
    bucket: object = None
    into: dict[int, np.ndarray] | None = None  # result position -> array to write it into (a bucket's view)


def group_of(groups: tuple[tuple[int, ...], ...], rank: int, op: Operation) -> tuple[int, ...]:
    """Return the group of `groups` (an op's rank groups) that holds `rank`."""
    for g in groups:
        if rank in g:
            return g
    raise PlanError(f"rank {rank} is in no group of '{op.name}' {list(groups)}")
