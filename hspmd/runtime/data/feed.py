"""What a rank's training loop draws each step: its program's piece of the step's global batch.

Two kinds of model script feed a run:

- `batches(config)` (`BatchesFeed`): every rank makes each whole global batch and keeps its piece
  (`Plan.local_batch`); a resumed run draws and drops the batches the checkpoint's steps used.
- `dataset(config)` (`DatasetFeed`, `hspmd.data`): the rank reads only the rows its program's
  layouts give it (`hspmd.data.rows`), made ahead in a background thread (`data.prefetch`
  batches); under `--device cuda` into page-locked host buffers that the GPU plan uploads from
  directly. Its position is the sampler's cursor: a checkpoint stores it (`state_dict`), a
  resume restores it in O(1), under any strategy or device count. A bundle of several
  strategies (switching between programs by step) reads each global batch whole, since the
  program that takes it is known only then.

`open_feed` picks one; `next(step)` returns a `StepBatch`: `items` (what the progress line
counts), `full()` (the global batch, for a script's `strategy_for`) and `local(plan, scalars)`
(the program's inputs).
"""

from __future__ import annotations

import numpy as np

from hspmd.data.errors import DataError
from hspmd.data.rows import RowPlan, row_plan
from hspmd.data.script import data_settings, has_dataset, script_loader
from hspmd.runtime.data.batching import compiled_batch_shapes, pad_batch, split_microbatches
from hspmd.runtime.progress import batch_items

__all__ = ["BatchesFeed", "DataElsewhere", "DatasetFeed", "GlobalBatch", "LocalBatch", "open_feed", "program_rows",
           "verify_data"]


class DataElsewhere(DataError):
    """Another rank found the data bad (it says which file); this one stops without a word."""


class GlobalBatch:
    """A whole global batch: each program cuts its piece from it."""

    def __init__(self, batch: dict, pad) -> None:
        self.batch, self.pad = batch, pad
        self.items = batch_items(batch)

    def full(self) -> dict:
        return self.batch

    def local(self, plan, scalars: dict) -> dict:
        """Return `plan`'s inputs: the batch padded to the compiled rows (an epoch's short last batch),
        with the step's scalars, cut into micro-batches where the program reads them so, then sliced."""
        names = {leaf.name: leaf.global_shape for leaf in plan.inputs}
        batch = pad_batch({**self.batch, **scalars}, compiled_batch_shapes(names.items()), self.pad)
        return plan.local_batch(split_microbatches(batch, names))


class LocalBatch:
    """The rows of a global batch one program reads, already cut into its inputs."""

    def __init__(self, inputs: dict, items, plan) -> None:
        self.inputs, self.items, self._plan = inputs, items, plan

    def full(self) -> dict:
        raise DataError("a rank that reads only its rows has no whole batch (a script's strategy_for needs one)")

    def local(self, plan, scalars: dict) -> dict:
        if plan is not self._plan:
            raise DataError("the batch was read for another program than the one it is given to")
        out = dict(self.inputs)
        for leaf in plan.inputs:
            if not leaf.global_shape:
                if leaf.name not in scalars:
                    raise DataError(f"the program reads scalar input '{leaf.name}', which is no step input "
                                    "(lr, step) and no row of the batch")
                out[leaf.name] = np.array(scalars[leaf.name], dtype=leaf.dtype)  # 0-d (ascontiguousarray makes 1-d)
        return out


class BatchesFeed:
    """A `batches(config)` script's global batches (see the module docstring)."""

    verify = False  # nothing on disk that hspmd knows of

    def __init__(self, module, config: dict) -> None:
        self.batches = iter(module.batches(config))
        section = config.get("data")
        self.pad = section.get("pad") if isinstance(section, dict) else None

    def restore(self, state: dict | None, done: int) -> None:
        """Continue after the `done` batches a checkpoint's steps used: drawn and dropped."""
        for _ in range(done):
            next(self.batches, None)

    def state_dict(self) -> dict | None:
        """Return None: the position of a generator is the number of batches drawn (the step)."""
        return None

    def next(self, step: int) -> GlobalBatch:
        return GlobalBatch(next(self.batches), self.pad)

    def close(self) -> None:
        pass


def program_rows(plan, rank: int) -> RowPlan:
    """Return the rows of each global batch that `plan`'s inputs take on `rank`."""
    return row_plan([(leaf.name, leaf.global_shape, leaf.layout, leaf.dtype) for leaf in plan.inputs], rank)


class DatasetFeed:
    """A `dataset(config)` script's batches, this rank's rows of each (see the module docstring).

    `plan` is the program every step runs (None: several programs, each batch read whole);
    `staging(inputs) -> inputs` copies a made batch into host buffers of the device's (page-locked
    memory under CUDA), in the thread that made it."""

    def __init__(self, module, config: dict, rank: int, plan=None, prefetch: bool = True, staging=None) -> None:
        settings = data_settings(config)
        self.plan, self.staging = plan, staging
        if plan is None:
            self.rows = None
            self.loader = script_loader(module, config)
        else:
            self.rows = program_rows(plan, rank)
            if self.rows.batch_rows and self.rows.batch_rows != settings.batch_size and not callable(
                    getattr(module, "sampler", None)):
                raise DataError(f"the program was compiled for batches of {self.rows.batch_rows} rows, "
                                f"config data.batch_size is {settings.batch_size}")
            self.loader = script_loader(module, config, rows=self.rows.rows, finish=self._finish,
                                        prefetch=settings.prefetch if prefetch else 0)
        self.pad = settings.pad
        self.verify = settings.verify

    def _finish(self, data: dict):
        inputs = self.rows.local(data)
        if self.staging is not None:
            inputs = self.staging(inputs)
        per_row = next((v.shape[1:] for v in data.values() if getattr(v, "ndim", 0) >= 2
                        and np.issubdtype(v.dtype, np.integer)), None)
        items = (int(self.loader.sampler.batch_size * np.prod(per_row)), "tokens") if per_row is not None else \
            (self.loader.sampler.batch_size, "rows")
        return inputs, items

    def restore(self, state: dict | None, done: int) -> None:
        """Continue at a checkpoint's data position: its sampler state, else `done` batches on (O(1))."""
        if state:
            self.loader.load_state_dict(state)
        else:
            self.loader.skip(done)

    def state_dict(self) -> dict:
        """Return the loader's position (`Loader.state_dict`): the next batch this run would train on."""
        return self.loader.state_dict()

    def next(self, step: int):
        batch = next(self.loader)
        if self.rows is None:
            return GlobalBatch(batch, self.pad)
        inputs, items = batch
        return LocalBatch(inputs, items, self.plan)

    def close(self) -> None:
        self.loader.close()


def open_feed(module, config: dict, rank: int, plan=None, prefetch: bool = True, staging=None):
    """Return the feed of a loaded model script: `DatasetFeed` for `dataset(config)`, else `BatchesFeed`."""
    if has_dataset(module):
        return DatasetFeed(module, config, rank, plan, prefetch, staging)
    return BatchesFeed(module, config)


def verify_data(feed, comm) -> None:
    """Check the CRC-32 of every shard of a feed's on-disk dataset before the run trains on it
    (config `data.verify`, default true): shard i by rank i mod N, then every rank agrees (one
    all-reduce). DataError on the rank that found a bad shard, DataElsewhere on the others."""
    loader = getattr(feed, "loader", None)
    corpus = getattr(getattr(loader, "dataset", None), "corpus", None)
    if corpus is None or not callable(getattr(corpus, "verify", None)) or not feed.verify:
        return
    problem = None
    try:
        corpus.verify(range(comm.rank, len(corpus.index.shards), comm.size))
    except DataError as err:
        problem = str(err)
    flags = np.array([0 if problem is None else 1], dtype=np.int64)
    if comm.size > 1:
        flags = comm.all_reduce(flags, tuple(range(comm.size)))
    if problem is not None:
        raise DataError(problem)
    if int(flags[0]):
        raise DataElsewhere("another rank found a shard of the dataset corrupt; nothing was trained")
