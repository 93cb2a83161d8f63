"""Sharded checkpoints of a parameter-server run (`--checkpoint-dir`, `--resume` with `--servers`).

The servers hold the parameters and their optimizer states, so the servers write them: server k
writes the whole of every tensor of its update step (its parameters, `opt.m.NAME`, `opt.step`,
...) as writer k of the sharded format of `hspmd.runtime.checkpoint` (docs/checkpoints.md); under
hybrid, worker 0 also writes the dense parameters and their states (which every worker holds
alike) as writer K. Writer 0 (server 0) merges the indices into `manifest.json` and renames the
directory: the same atomic `D/step-<k>` as any run, with the same tensor names. So a checkpoint of
a parameter-server run resumes under another server count, or as all-reduce data parallelism,
and one of an all-reduce run resumes with servers: every reader takes the region its layout
needs from whichever pieces hold it.

When: a server writes checkpoint t once the slowest live worker has pushed step t (t a multiple
of `--checkpoint-every`, or the last step). Under BSP that is exactly the parameters after step
t (step t + 1's update waits for every push of t + 1). Under ASP and SSP it holds every update of
steps up to t and maybe some of a faster worker's later steps: servers checkpoint their own state
as they go, as ps-lite's do. A resumed run starts every worker at step t + 1 and the servers'
clocks at t, after drawing the t batches the steps consumed.
"""

from __future__ import annotations

import numpy as np

from hspmd.codegen.schedule.model import Leaf
from hspmd.ir.layout import Layout
from hspmd.runtime.checkpoint.manifest import resolve_checkpoint, read_manifest
from hspmd.runtime.checkpoint.reader import load_state
from hspmd.runtime.checkpoint.writer import CheckpointWriter, RunInfo
from hspmd.runtime.comm.base import Communicator
from hspmd.runtime.ps.update import UpdateStep

__all__ = ["PSCheckpoints", "leaves_of", "resume"]


def leaves_of(update: UpdateStep, holder: int) -> list[Leaf]:
    """Return the tensors of `update` (parameters and optimizer states) as whole tensors held by
    device `holder` alone (writer `holder` writes all of each)."""
    layout = Layout.replicated([holder])
    return [Leaf(name, 0, shape, layout, dtype.name, init) for name, init, shape, dtype in update.leaves]


def resume(path: str, update: UpdateStep, holder: int, comm: Communicator) -> tuple[dict[str, np.ndarray], int]:
    """Return (the tensors of `update` read from checkpoint `path` (a directory's newest, or
    D/step-<k>), its step). Every rank of `comm` calls this (they agree on a bad checkpoint)."""
    where = resolve_checkpoint(path)
    saved = read_manifest(where)
    return load_state(where, saved, leaves_of(update, holder), holder, comm), saved.step


class PSCheckpoints:
    """Writer `writer` of `writers` of a parameter-server run's checkpoints in `directory`."""

    def __init__(self, directory: str, writer: int, writers: int, update: UpdateStep, info: RunInfo,
                 every: int | None, steps: int, keep: int | None = None, start: int = 0) -> None:
        """`start`: the step the run resumed from (0 for a fresh run)."""
        self.every, self.steps = every or steps, steps
        self.writer = CheckpointWriter(directory, writer, writers, leaves_of(update, writer), info, keep)
        self.saved = start  # the newest step written (or resumed from)

    def due(self, step: int) -> int | None:
        """Return the newest checkpoint step at most `step` not written yet (None if none)."""
        newest = self.steps if step >= self.steps else step - step % self.every
        return newest if newest > self.saved else None

    def save(self, step: int, state: dict[str, np.ndarray], lr: float | None) -> None:
        """Write checkpoint `step` of `state` (in the background); the data position is `step`."""
        self.writer.save(step, state, step, lr)
        self.saved = step

    def close(self) -> None:
        """Wait for the checkpoint in flight to be written (raises CheckpointError if it failed)."""
        self.writer.close()
