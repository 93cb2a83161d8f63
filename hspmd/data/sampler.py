"""The order of a training run's samples, independent of the strategy: global batch k is a pure
function of (seed, epoch, k), and the position in it is two integers.

    sampler = Sampler(size=len(dataset), batch_size=16, seed=0)
    sampler.indices(k)                     # the sample indices of global batch k (k from 0)
    cursor = sampler.advance(sampler.start, 100_000)        # O(1): where batch 100,000 begins
    indices, cursor = sampler.batch(cursor)                 # that batch, and where the next begins

Epoch e visits every sample once, in the order of a keyed permutation of (seed, e)
(`permutation.permute`: no permutation array, so nothing grows with the dataset and a resume is
O(1)); without `shuffle` in index order. An epoch's last, short batch is dropped (`drop_last`,
the default) or padded: its missing rows are index -1, which a loader fills with pad values.

A cursor is (epoch, offset): the epoch, and how many of its samples were drawn. Its `state_dict`
is what a checkpoint stores (docs/data.md); since the cursor counts samples rather than batches,
a run may resume with another batch size and continue at the same sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from hspmd.data.errors import DataError
from hspmd.data.permutation import permute

__all__ = ["Cursor", "Sampler", "SAMPLER_FORMAT"]

SAMPLER_FORMAT = "hspmd-sampler"

Cursor = tuple[int, int]  # (epoch, samples of it drawn)

#: positions whose images are found together (one NumPy pass for 1,024 is as cheap as for 16)
BLOCK = 1024


@dataclass(frozen=True)
class Sampler:
    """Batches of `batch_size` sample indices of a dataset of `size` samples (module docstring)."""

    size: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = True
    #: the images of the last few blocks of positions drawn: (epoch, block) -> images (a memo)
    _blocks: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise DataError(f"batch size {self.batch_size}: a batch holds at least one sample")
        if self.size < (self.batch_size if self.drop_last else 1):
            raise DataError(f"the dataset has {self.size} samples, too few for one batch of {self.batch_size}"
                            + (" (drop_last drops a short batch)" if self.drop_last and self.size else ""))

    #: where a run that has drawn nothing stands
    start: ClassVar[Cursor] = (0, 0)

    @property
    def batches_per_epoch(self) -> int:
        """Return the global batches of one epoch."""
        full, rest = divmod(self.size, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _normal(self, cursor: Cursor) -> Cursor:
        """Return `cursor`, or the next epoch's start where its epoch has no (full) batch left."""
        epoch, offset = cursor
        left = self.size - offset
        if left <= 0 or (self.drop_last and left < self.batch_size):
            return epoch + 1, 0
        return epoch, offset

    def batch(self, cursor: Cursor) -> tuple[np.ndarray, Cursor]:
        """Return the sample indices of the batch at `cursor` (-1: a padding row) and the cursor after it."""
        epoch, offset = self._normal(cursor)
        positions = np.arange(offset, min(offset + self.batch_size, self.size), dtype=np.int64)
        taken = self._images(epoch, positions) if self.shuffle and len(positions) else positions
        if len(taken) < self.batch_size:
            taken = np.concatenate([taken, np.full(self.batch_size - len(taken), -1, np.int64)])
        return taken, (epoch, offset + len(positions))

    def _images(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Return the permutation of epoch `epoch` at `positions` (consecutive), a block at a time."""
        first, last = int(positions[0]) // BLOCK, int(positions[-1]) // BLOCK
        parts = []
        for b in range(first, last + 1):
            images = self._blocks.get((epoch, b))
            if images is None:
                start = b * BLOCK
                images = permute(np.arange(start, min(start + BLOCK, self.size)), self.size, (self.seed, epoch))
                while len(self._blocks) >= 4:
                    self._blocks.pop(next(iter(self._blocks)), None)
                self._blocks[(epoch, b)] = images
            parts.append(images)
        table = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return table[positions - first * BLOCK]

    def advance(self, cursor: Cursor, batches: int) -> Cursor:
        """Return the cursor `batches` batches after `cursor`, in O(1)."""
        if batches < 0:
            raise ValueError("a cursor only moves forward")
        if batches == 0:
            return cursor
        epoch, offset = self._normal(cursor)
        left = (self.size - offset) // self.batch_size if self.drop_last else -(-(self.size - offset) // self.batch_size)
        if batches < left:
            return epoch, offset + batches * self.batch_size
        batches -= left
        per = self.batches_per_epoch
        epoch += 1 + batches // per
        return epoch, min((batches % per) * self.batch_size, self.size)

    def indices(self, k: int) -> np.ndarray:
        """Return the sample indices of global batch k (counting from 0) of a run that started at 0."""
        return self.batch(self.advance(self.start, k))[0]

    def state_dict(self, cursor: Cursor, batches: int = 0) -> dict:
        """Return the position `cursor` as plain JSON data, with what it is a position in (`batches`:
        how many batches were drawn to get there, for people)."""
        epoch, offset = cursor
        return {"format": SAMPLER_FORMAT, "version": 1, "epoch": int(epoch), "offset": int(offset),
                "batches": int(batches), "size": self.size, "batch_size": self.batch_size, "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> Cursor:
        """Return the cursor a `state_dict` holds; DataError if it is a position in another order
        (another dataset size, seed, or shuffling). The batch size may differ: the run continues
        at the same sample of the same epoch."""
        try:
            if state.get("format") != SAMPLER_FORMAT:
                raise DataError(f"not a sampler state (format {state.get('format')!r})")
            theirs = {k: state[k] for k in ("size", "seed", "shuffle", "drop_last")}
            epoch, offset = int(state["epoch"]), int(state["offset"])
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise DataError(f"a malformed sampler state ({type(err).__name__}: {err})") from None
        ours = {"size": self.size, "seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last}
        if theirs != ours:
            diff = ", ".join(f"{k} {theirs[k]} (now {ours[k]})" for k in ours if theirs[k] != ours[k])
            raise DataError(f"the saved data position is in another sample order: {diff}; resume with the "
                            "dataset and seed the run was started with")
        if epoch < 0 or not 0 <= offset <= self.size:
            raise DataError(f"a sampler state at epoch {epoch}, sample {offset} of {self.size}")
        return epoch, offset
