"""Rank 0's report of each training step: a live progress bar, or one plain line per step.

`hspmd run` asks for the bar when its standard output is a terminal (the ranks' own output
goes through mpiexec, so the command line decides, not the worker): a `tqdm` bar with the
loss, the throughput in tokens/s (rows/s for a batch without token ids) and the time left.
Otherwise each step prints `step K/N  loss L  T ms`, as it always has, for logs and pipes.
"""

from __future__ import annotations

import shutil
import sys
from typing import TextIO

import numpy as np


def batch_items(batch: dict) -> tuple[int, str] | None:
    """Return how many items one global batch holds and what they are: the tokens of its first
    integer input of two or more dims (token ids, `[rows, seq]`), else the rows of its first
    array input; None for a batch without arrays."""
    arrays = [np.asarray(v) for v in batch.values() if hasattr(v, "shape") and np.ndim(v) > 0]
    for a in arrays:
        if a.ndim >= 2 and np.issubdtype(a.dtype, np.integer):
            return int(a.size), "tokens"
    return (int(arrays[0].shape[0]), "rows") if arrays else None


class Progress:
    """Reports each step (see the module docstring): `bar` for the live bar, else plain lines."""

    def __init__(self, total: int, done: int, bar: bool, file: TextIO | None = None) -> None:
        """`total` steps in all, `done` of them trained before this run started."""
        self.total, self.file = total, file if file is not None else sys.stdout
        self._bar = None
        if bar:
            from tqdm import tqdm

            # a terminal that reports no size (0 columns and rows) gets the fallback size, not a hidden bar
            size = shutil.get_terminal_size((100, 20))
            self._bar = tqdm(total=total, initial=done, unit="step", file=self.file, ncols=size.columns,
                             nrows=size.lines, leave=True)

    def step(self, step: int, loss: float, elapsed_s: float, items: tuple[int, str] | None = None) -> None:
        """Report step `step`: its loss, its time, the items its batch held."""
        if self._bar is None:
            print(f"step {step}/{self.total}  loss {loss:.6f}  {elapsed_s * 1e3:.1f} ms", file=self.file, flush=True)
            return
        postfix = f"loss {loss:.4f}"
        if items is not None and elapsed_s > 0:
            postfix += f", {items[0] / elapsed_s:,.0f} {items[1]}/s"
        self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        """End the bar (plain lines need nothing)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
