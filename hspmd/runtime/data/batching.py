"""Short batches: the last batch of an epoch, padded to the compiled batch so that it counts for what it holds.

A program is compiled for one batch size B, but a finite dataset's last batch may hold fewer
rows, and under heterogeneous data parallelism the rows a group would have taken may not exist
at all (HetSeq's empty last batch). `pad_batch` fills every batch input up to B rows along dim
0 with the script's pad value for it (`config["data"]["pad"]`, e.g. `{"ids": 0, "targets":
-100}`), chosen so that a padded row contributes nothing: a label equal to the loss's
`ignore_index` (`hs.cross_entropy(..., ignore_index=-100)`). The loss then divides by the
number of real labels, counted at run time over the whole batch, so every group's rows weigh
by their share of real tokens and a group whose rows are all padding contributes zero to the
gradient; it still runs the step and joins every collective, so nobody stalls.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

__all__ = ["BatchError", "compiled_batch_shapes", "pad_batch", "split_microbatches"]


class BatchError(ValueError):
    """A batch that cannot be fitted to the compiled program (too many rows, no pad value)."""


def pad_batch(batch: Mapping[str, np.ndarray], shapes: Iterable[tuple[str, tuple[int, ...]]],
              pad: Mapping[str, object] | None) -> dict[str, np.ndarray]:
    """Return `batch` with every input of `shapes` (name, compiled global shape) padded to its rows.

    Inputs that already have their compiled shape, scalars, and names not in `shapes` pass
    unchanged. An input with fewer rows (dim 0) than compiled is padded with `pad[name]`; one
    with more rows, other trailing dims, or no pad value raises BatchError naming the input,
    its shape and the rule.
    """
    out = dict(batch)
    pad = dict(pad or {})
    for name, shape in shapes:
        if name not in batch or not shape:
            continue
        value = np.asarray(batch[name])
        if value.shape == tuple(shape):
            continue
        rows = shape[0]
        if value.ndim != len(shape) or value.shape[1:] != tuple(shape[1:]) or value.shape[0] > rows:
            raise BatchError(f"input '{name}' has shape {list(value.shape)}; the program was compiled for "
                             f"{list(shape)}, and only a batch with fewer rows (dim 0) can be padded to it")
        if name not in pad:
            raise BatchError(f"input '{name}' has {value.shape[0]} rows, the program was compiled for {rows}: "
                             f"give config['data']['pad']['{name}'], the value a padding row holds (for labels, "
                             f"the loss's ignore_index, so that the row counts for nothing)")
        filler = np.full((rows - value.shape[0], *shape[1:]), pad[name], dtype=value.dtype)
        out[name] = np.concatenate([value, filler], axis=0)
    return out


def compiled_batch_shapes(inputs: Iterable[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
    """Return (name, global shape) of each batch input a program reads, before micro-batch splitting.

    A pipeline stage run in m micro-batches reads `x@mb`, the global batch `x` viewed as m
    micro-batches of 1/m of its rows (`[m, rows / m, ...]`); the global batch holds `x`.
    """
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in inputs:
        base, sep, rest = name.rpartition("@mb")
        if sep and not rest and len(shape) >= 2:
            out[base] = (shape[0] * shape[1], *shape[2:])
        else:
            out.setdefault(name, tuple(shape))
    return list(out.items())


def split_microbatches(batch: dict[str, np.ndarray], names) -> dict[str, np.ndarray]:
    """Add input `NAME@mb` (NAME's rows as m equal micro-batches, `[m, rows / m, ...]`, m from the
    compiled shape) for each such name the program reads (`names`: input name -> compiled shape)."""
    out = dict(batch)
    for name, shape in names.items():
        base, sep, rest = name.rpartition("@mb")
        if not sep or rest or base not in batch:
            continue
        value = np.asarray(batch[base])
        m = shape[0]
        if value.ndim == 0 or value.shape[0] % m:
            raise BatchError(f"input '{base}' of shape {value.shape}: {m} micro-batches need a batch dim divisible by {m}")
        out[name] = value.reshape(m, value.shape[0] // m, *value.shape[1:])
    return out
