"""The rows of a global batch that one rank needs, found from its program's inputs and their layouts.

A program reads each batch input `x` of global shape [B, ...] under a layout (data parallelism
splits dim 0 over the ranks, heterogeneous groups by their shares, tensor parallelism
replicates it), or, in a pipeline stage, as `x@mb` of shape [m, B/m, ...] (the batch cut into m
micro-batches). `row_plan` turns those into the sorted global rows the rank must read (only
those are read, `Loader.rows`) and `RowPlan.local` cuts the inputs' local pieces from them:
exactly what `Plan.local_batch` would cut from the whole batch, without the whole batch.

    plan = row_plan([("ids", (16, 64), layout), ...], rank=1)
    plan.rows                    # e.g. [8 .. 15] under dp=2
    plan.local(loader_rows)      # {"ids": [8, 64] piece, ...}
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from hspmd.data.errors import DataError

__all__ = ["RowPlan", "Take", "row_plan", "MICROBATCH_SUFFIX"]

#: a pipeline stage's view of batch input NAME as m micro-batches: `NAME@mb`, [m, rows / m, ...]
MICROBATCH_SUFFIX = "@mb"


@dataclass(frozen=True)
class Take:
    """How one program input is cut from the rank's rows."""

    name: str  # the program's input (NAME or NAME@mb)
    base: str  # the batch's key
    positions: np.ndarray  # which of the rank's rows, in the order of the local piece's leading dims
    lead: tuple[int, ...]  # the local piece's leading dims: (rows,), or (micro-batches, rows of each)
    rest: tuple[slice, ...]  # the piece of the other dims
    shape: tuple[int, ...]  # the global shape of a row (dims after the batch dim)
    dtype: np.dtype


@dataclass(frozen=True)
class RowPlan:
    """The global rows one rank reads for a step (`rows`, sorted) and how its inputs are cut from them."""

    batch_rows: int
    rows: np.ndarray
    takes: tuple[Take, ...]

    def local(self, data: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Return the rank's piece of every input from `data` (the batch's keys, one row per entry of `rows`)."""
        out = {}
        for t in self.takes:
            if t.base not in data:
                raise DataError(f"the program reads input '{t.base}', the data gives {', '.join(sorted(data)) or 'nothing'}")
            value = np.asarray(data[t.base])
            if value.shape[:1] != (len(self.rows),) or tuple(value.shape[1:]) != t.shape:
                raise DataError(f"input '{t.base}': the data gives rows of shape {list(value.shape[1:])}, the program "
                                f"was compiled for {list(t.shape)}")
            piece = value[t.positions].reshape(*t.lead, *t.shape)
            out[t.name] = np.require(piece[(slice(None),) * len(t.lead) + t.rest], t.dtype, "C")
        return out


def row_plan(inputs: Iterable[tuple], rank: int) -> RowPlan:
    """Return the rows `rank` reads for a program whose inputs are `inputs`: (name, global shape,
    layout[, dtype]) each, the layout any object with `slices(rank, shape)` (`hspmd.ir.layout.Layout`).
    Scalar inputs (the learning rate, the step) are no rows of the batch and are left out."""
    gathered: list[tuple[str, str, np.ndarray, tuple[int, ...], tuple[slice, ...], tuple[int, ...], np.dtype]] = []
    batch = None
    for entry in inputs:
        name, shape, layout = entry[0], tuple(entry[1]), entry[2]
        dtype = np.dtype(entry[3]) if len(entry) > 3 else np.dtype(np.int32)
        if not shape:
            continue
        base, sep, tail = name.rpartition(MICROBATCH_SUFFIX)
        sl = layout.slices(rank, shape)
        if sep and not tail and len(shape) >= 2:
            m, per = shape[0], shape[1]
            rows_i, rows_j = np.arange(m)[sl[0]], np.arange(per)[sl[1]]
            wanted = (rows_i[:, None] * per + rows_j[None, :]).reshape(-1)
            lead, rest, rows, row_shape = (len(rows_i), len(rows_j)), tuple(sl[2:]), m * per, shape[2:]
        else:
            base = name
            wanted = np.arange(shape[0])[sl[0]]
            lead, rest, rows, row_shape = (len(wanted),), tuple(sl[1:]), shape[0], shape[1:]
        if batch is not None and rows != batch:
            raise DataError(f"input '{base}' has {rows} rows a step, another input {batch}: the inputs of one batch "
                            "have the same rows")
        batch = rows
        gathered.append((name, base, wanted.astype(np.int64), lead, rest, tuple(row_shape), dtype))
    rows = np.unique(np.concatenate([g[2] for g in gathered])) if gathered else np.zeros(0, np.int64)
    takes = tuple(Take(name, base, np.searchsorted(rows, wanted), lead, rest, shape, dtype)
                  for name, base, wanted, lead, rest, shape, dtype in gathered)
    return RowPlan(batch or 0, rows, takes)
