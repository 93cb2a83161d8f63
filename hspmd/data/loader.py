"""A loader: a dataset read in a sampler's order, batch by batch, optionally only some rows of each
batch, optionally made ahead in a background thread; its position is a `state_dict`.

    loader = Loader(dataset, Sampler(len(dataset), 16, seed=0))
    batch = next(loader)                     # global batch 0: {"ids": [16, T], "targets": [16, T]}
    state = loader.state_dict()              # JSON data: into a checkpoint
    loader.load_state_dict(state)            # O(1): the next batch is the one after
    Loader(..., rows=[8, 9, ..., 15])        # only those rows of every batch are read

The position counts the batches handed out, not the ones made ahead, so a checkpoint taken while
batches wait in the prefetch queue resumes at the first batch the run has not trained on.
(torchdata's `StatefulDataLoader` keeps its position the same way; here the position is the
sampler's cursor, two integers, so a restore reads nothing and replays nothing.)
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping

import numpy as np

from hspmd.data.errors import DataError
from hspmd.data.sampler import Cursor, Sampler

__all__ = ["Loader", "Prefetcher", "pad_rows"]


def pad_rows(data: Mapping[str, object], real: np.ndarray, pad: Mapping[str, object]) -> dict[str, np.ndarray]:
    """Return `data` (the rows where `real` is true, collated) spread over all `len(real)` rows, the
    others filled with `pad[key]` (a padding row that counts for nothing: a target the loss ignores)."""
    out = {}
    for key, value in data.items():
        value = np.asarray(value)
        if key not in pad:
            raise DataError(f"the epoch's last batch is short and input '{key}' has no pad value: give "
                            f"config['data']['pad']['{key}'] (for labels, the loss's ignore_index) or keep drop_last")
        full = np.full((len(real), *value.shape[1:]), pad[key], dtype=value.dtype)
        full[real] = value
        out[key] = full
    return out


class Prefetcher:
    """Makes `make(cursor) -> (item, next cursor)` ahead in a daemon thread, up to `depth` items,
    starting at `cursor`; `get()` returns them in order (and raises what making one raised)."""

    def __init__(self, make: Callable[[Cursor], tuple[object, Cursor]], cursor: Cursor, depth: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(make, cursor), name="hspmd-prefetch", daemon=True)
        self._thread.start()

    def _run(self, make, cursor) -> None:
        while not self._stop.is_set():
            try:
                item, cursor = make(cursor)
                entry = (True, (item, cursor))
            except BaseException as err:  # handed to the consumer, which raises it
                entry = (False, err)
            while not self._stop.is_set():
                try:
                    self._queue.put(entry, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if not entry[0]:
                return

    def get(self) -> tuple[object, Cursor]:
        ok, value = self._queue.get()
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Stop the thread (it finishes the item it is making)."""
        self._stop.set()
        self._thread.join()


class Loader:
    """Batches of `dataset` in `sampler`'s order (see the module docstring).

    `collate(rows) -> rows` turns what `dataset.read` gives into the batch's inputs, row by row
    (row i of its output may depend only on row i of its input, so that any subset of rows
    collates alike); `pad` holds each input's value for the padding rows of a short last batch
    (default: the dataset's `pad`); `rows`: read only these rows of each global batch; `finish`
    is applied to each batch in the thread that makes it; `prefetch`: batches made ahead.
    """

    def __init__(self, dataset, sampler: Sampler, collate: Callable | None = None,
                 pad: Mapping[str, object] | None = None, rows=None, finish: Callable | None = None,
                 prefetch: int = 0) -> None:
        if not hasattr(dataset, "read") or not hasattr(dataset, "__len__"):
            raise DataError(f"a dataset has len() and read(indices); got {type(dataset).__name__}")
        self.dataset, self.sampler, self.collate, self.finish = dataset, sampler, collate, finish
        self.pad = dict(getattr(dataset, "pad", {}) or {}) | dict(pad or {})
        self.rows = None if rows is None else np.asarray(rows, dtype=np.int64)
        if self.rows is not None and self.rows.size and (self.rows.min() < 0 or self.rows.max() >= sampler.batch_size):
            raise DataError(f"rows {self.rows.tolist()} are outside a batch of {sampler.batch_size}")
        self.prefetch = max(int(prefetch), 0)
        self.cursor: Cursor = sampler.start
        self.batches = 0  # handed out since the run began (restored with the position)
        self._ahead: Prefetcher | None = None

    def make(self, cursor: Cursor) -> tuple[dict, Cursor]:
        """Return the batch at `cursor` (this loader's rows of it, finished) and the cursor after it."""
        indices, after = self.sampler.batch(cursor)
        wanted = indices if self.rows is None else indices[self.rows]
        real = wanted >= 0
        data = self.dataset.read(wanted[real])
        if self.collate is not None:
            data = self.collate(data)
        if not real.all():
            data = pad_rows(data, real, self.pad)
        return (self.finish(data) if self.finish is not None else data), after

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.prefetch:
            if self._ahead is None:
                self._ahead = Prefetcher(self.make, self.cursor, self.prefetch)
            batch, self.cursor = self._ahead.get()
        else:
            batch, self.cursor = self.make(self.cursor)
        self.batches += 1
        return batch

    def _restart(self) -> None:
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None

    def close(self) -> None:
        """Stop making batches ahead."""
        self._restart()

    def skip(self, batches: int) -> None:
        """Move on `batches` batches without reading them (O(1))."""
        self._restart()
        self.cursor = self.sampler.advance(self.cursor, batches)
        self.batches += batches

    def state_dict(self) -> dict:
        """Return the position (the next batch to hand out) as plain JSON data (`Sampler.state_dict`)."""
        return self.sampler.state_dict(self.cursor, self.batches)

    def load_state_dict(self, state: dict) -> None:
        """Continue at the position `state` holds (O(1)); DataError if it is a position in another order."""
        self._restart()
        self.cursor = self.sampler.load_state_dict(state)
        self.batches = int(state.get("batches", 0))
