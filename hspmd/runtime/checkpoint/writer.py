"""Writing sharded checkpoints in the background, atomically.

`owned_pieces` decides, from the layouts alone (every rank computes the same answer, no
communication), which rank writes which piece: of the pieces the devices of a layout hold, each
distinct region once (replicas take turns by a hash of the tensor's name, so data-parallel ranks
share the writing), and under a hetero `dup` layout only the first group's pieces, since every
group holds the whole tensor. A piece with a partial sum is never written (parameters and
optimizer states are never partial).

`CheckpointWriter.save(step, state, ...)` copies this rank's pieces (the only work done on the
training thread) and hands them to a background thread, which

1. writes `D/step-<k>.tmp/rank-<r>.safetensors`, then `rank-<r>.json` (the pieces it holds and
   their CRC-32s), each fsynced, the index by rename, so a rank's index means its file is whole;
2. on rank 0 only: waits for every rank's index, merges them into `manifest.json` (fsynced),
   renames `step-<k>.tmp` to `step-<k>` (fsyncing the directory), and deletes the checkpoints
   beyond `keep`.

With a `trace.Tracer`, the copy on the training thread is traced as `checkpoint.snapshot` and
the background write as `checkpoint.write` (rank 0's manifest and rename as
`checkpoint.manifest`) on the tracer's own checkpoint thread.

A crash at any moment leaves every earlier `step-<j>` as it was: an unfinished checkpoint is a
`.tmp` directory, which the next run's rank 0 removes. At most one checkpoint is in flight per
rank; `save` waits for the previous one, and `close` for the last.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
from safetensors.numpy import save_file

from hspmd.codegen.schedule.model import Leaf
from hspmd.ir.layout import DUP
from hspmd.runtime.comm.base import Communicator
from hspmd.runtime.checkpoint.manifest import (
    MANIFEST, CheckpointError, Manifest, Piece, Region, TensorEntry, piece_key, step_dirs,
)
from hspmd.runtime.trace import CHECKPOINT, MAIN, Tracer, traced

__all__ = ["CheckpointWriter", "RunInfo", "fsync_path", "owned_pieces", "region_of"]

#: how long rank 0 waits for the other ranks' pieces of one checkpoint before giving up on it
INDEX_TIMEOUT_S = 600.0


def region_of(leaf: Leaf, device: int) -> Region:
    """Return the global region `device`'s piece of `leaf` covers."""
    return tuple((s.start, s.stop) for s in leaf.layout.slices(device, leaf.global_shape))


def _writer_devices(leaf: Leaf) -> dict[Region, int]:
    """Return, for each distinct region to be written of `leaf`, the device that writes it."""
    layout = leaf.layout
    groups = layout.groups[:1] if layout.hetero.kind == "dup" else layout.groups
    if layout.hetero.kind == "partial" or any(g.states.is_partial for g in groups):
        return {}
    holders: dict[Region, list[int]] = {}
    for g in groups:
        for d in g.devices:
            holders.setdefault(region_of(leaf, d), []).append(d)
    turn = zlib.crc32(leaf.name.encode())
    return {region: devices[turn % len(devices)] for region, devices in holders.items()}


def _writes(leaf: Leaf, rank: int) -> Region | None:
    """Return the region `rank` writes of `leaf` (None: none), from the rank's coordinates alone:
    the holders of its region are its replicas (the devices of its group that differ from it on
    the dup axis only, by dup coordinate), and the one at the leaf's turn writes it. The same
    answer as `_writer_devices`, without listing the layout's devices."""
    layout = leaf.layout
    groups = layout.groups[:1] if layout.hetero.kind == "dup" else layout.groups
    if layout.hetero.kind == "partial" or any(g.states.is_partial for g in groups):
        return None
    where = next((g for g in groups if rank in g.devices), None)
    if where is None:
        return None
    holders = where.subgroup(rank, DUP)
    turn = zlib.crc32(leaf.name.encode())
    return region_of(leaf, rank) if holders[turn % len(holders)] == rank else None


def owned_pieces(leaves: Iterable[Leaf], rank: int) -> list[tuple[Leaf, Region]]:
    """Return the (leaf, region) pieces that `rank` writes; every piece of every tensor is written
    by exactly one of the ranks holding it."""
    out = []
    for leaf in leaves:
        if any(0 in leaf.layout.group_shape(g, leaf.global_shape) for g in range(len(leaf.layout.groups))):
            # empty pieces are alike whatever their coordinates: list the holders
            out += [(leaf, region) for region, device in _writer_devices(leaf).items() if device == rank]
            continue
        region = _writes(leaf, rank)
        if region is not None:
            out.append((leaf, region))
    return out


@dataclass(frozen=True)
class RunInfo:
    """What a checkpoint records about the run besides tensors."""

    strategy: str
    num_devices: int
    script: str
    config: dict
    seed: int


def fsync_path(path: str) -> None:
    """Flush `path` (a file or a directory) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, payload: str) -> None:
    """Write `payload` to `path` atomically (temporary name, fsync, rename)."""
    tmp = path + ".part"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointWriter:
    """Writes this rank's pieces of `leaves` to `directory/step-<k>/` (see the module docstring)."""

    def __init__(self, directory: str, rank: int, size: int, leaves: list[Leaf], info: RunInfo,
                 keep: int | None = None, comm: Communicator | None = None, tracer: Tracer | None = None) -> None:
        """`comm` (the run's ranks) makes every rank wait until rank 0 has removed an earlier
        run's unfinished checkpoints, so none removes a directory this run already writes to;
        without it (one rank, or a test) the caller keeps the ranks apart. `tracer` records
        the snapshots and writes."""
        self.directory, self.rank, self.size, self.info, self.keep = directory, rank, size, info, keep
        self.tracer = tracer
        self.pieces = owned_pieces(leaves, rank)
        self.leaves = {leaf.name: leaf for leaf in leaves}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        #: seconds the training thread spent in `save` (copying pieces, waiting for the previous write)
        self.stall_s: list[float] = []
        self._buffers: dict[str, np.ndarray] = {}
        os.makedirs(directory, exist_ok=True)
        if rank == 0:  # an earlier run's unfinished checkpoints
            for name in os.listdir(directory):
                if name.startswith("step-") and name.endswith((".tmp", ".old")):
                    shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
        if comm is not None and comm.size > 1:
            comm.barrier()

    def save(self, step: int, state: dict[str, np.ndarray], data_position: int, lr: float | None,
             data: dict | None = None) -> None:
        """Start writing checkpoint `step` of `state` (this rank's pieces) in the background; `data`:
        the data loader's position (`Manifest.data`)."""
        start = time.perf_counter()
        traced = self.tracer.clock() if self.tracer is not None else 0
        self.wait()
        snapshot = self._snapshot(state)
        if self.tracer is not None:
            self.tracer.complete("checkpoint.snapshot", "checkpoint", traced, self.tracer.clock(), MAIN,
                                 {"bytes": sum(int(b.nbytes) for b in snapshot.values())})
        thread = threading.Thread(target=self._guarded, args=(self._write, step, snapshot, data_position, lr, data),
                                  name=f"checkpoint-{step}", daemon=True)
        self._thread = thread
        thread.start()
        self.stall_s.append(time.perf_counter() - start)

    def _snapshot(self, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Copy this rank's pieces of `state` into buffers of the writer's own (made on the first
        save, reused after: the previous write is over when `save` copies, and a fresh buffer
        would page-fault its way in, about 4x slower than a copy into a warm one)."""
        if not self._buffers:
            self._buffers = {piece_key(leaf.name, region): np.empty_like(state[leaf.name], order="C")
                             for leaf, region in self.pieces}
        for (leaf, _), buf in zip(self.pieces, self._buffers.values()):
            np.copyto(buf, state[leaf.name])
        return self._buffers

    def wait(self) -> None:
        """Return once the checkpoint in flight (if any) is written; raise CheckpointError if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"writing a checkpoint in {self.directory} failed: {err}") from err

    close = wait

    def _guarded(self, job: Callable, *args) -> None:
        try:
            job(*args)
        except BaseException as err:  # reported by the training thread at its next save or close
            self._error = err

    def _write(self, step: int, snapshot: dict[str, np.ndarray], data_position: int, lr: float | None,
               data: dict | None = None) -> None:
        with traced(self.tracer, "checkpoint.write", "checkpoint", CHECKPOINT, step=step,
                    bytes=sum(int(b.nbytes) for b in snapshot.values())):
            self._write_pieces(step, snapshot, data_position, lr, data)

    def _write_pieces(self, step: int, snapshot: dict[str, np.ndarray], data_position: int, lr: float | None,
                      loader_state: dict | None = None) -> None:
        tmp = os.path.join(self.directory, f"step-{step}.tmp")
        os.makedirs(tmp, exist_ok=True)
        file = f"rank-{self.rank:05d}.safetensors"
        pieces = []
        if snapshot:
            path = os.path.join(tmp, file)
            save_file(snapshot, path)
            fsync_path(path)
        for leaf, region in self.pieces:
            key = piece_key(leaf.name, region)
            data = snapshot[key]
            pieces.append({"name": leaf.name, "shape": list(leaf.global_shape), "dtype": leaf.dtype,
                           "layout": str(leaf.layout), "file": file, "key": key,
                           "region": [list(r) for r in region], "crc32": zlib.crc32(data.data),
                           "nbytes": int(data.nbytes)})
        index = {"rank": self.rank, "pieces": pieces,
                 "files": {file: os.path.getsize(os.path.join(tmp, file))} if snapshot else {}}
        _write_json(os.path.join(tmp, f"rank-{self.rank:05d}.json"), json.dumps(index))
        if self.rank == 0:
            with traced(self.tracer, "checkpoint.manifest", "checkpoint", CHECKPOINT, step=step):
                self._finish(step, tmp, data_position, lr, loader_state)

    def _indices(self, tmp: str) -> list[dict]:
        """Return every rank's index of checkpoint directory `tmp`, waiting for them to appear."""
        deadline = time.monotonic() + INDEX_TIMEOUT_S
        out = []
        for r in range(self.size):
            path = os.path.join(tmp, f"rank-{r:05d}.json")
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise CheckpointError(f"{tmp}: rank {r} did not write its pieces within {INDEX_TIMEOUT_S:.0f} s")
                time.sleep(0.005)
            with open(path, encoding="utf-8") as f:
                out.append(json.load(f))
        return out

    def _finish(self, step: int, tmp: str, data_position: int, lr: float | None, data: dict | None = None) -> None:
        tensors: dict[str, TensorEntry] = {}
        files: dict[str, int] = {}
        for index in self._indices(tmp):
            files.update(index["files"])
            for p in index["pieces"]:
                entry = tensors.setdefault(p["name"], TensorEntry(p["name"], tuple(p["shape"]), p["dtype"], p["layout"]))
                region = tuple(tuple(r) for r in p["region"])
                if any(q.region == region for q in entry.pieces):  # a name in several pipeline stages (opt.step)
                    continue
                entry.pieces.append(Piece(p["file"], p["key"], region, p["crc32"], p["nbytes"]))
        info = self.info
        manifest = Manifest(step, data_position, info.seed, info.strategy, info.num_devices, info.script, info.config,
                            dict(sorted(tensors.items())), lr,
                            {"dropout": "counter-based: a mask is a hash of (seed, op salt, step, element)",
                             "seed": info.seed, "step": step}, files, dict(data or {}))
        _write_json(os.path.join(tmp, MANIFEST), manifest.to_json())
        fsync_path(tmp)
        final = os.path.join(self.directory, f"step-{step}")
        old = None
        if os.path.exists(final):  # a rerun from an earlier step writes this step again
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_path(self.directory)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        if self.keep:
            for _, path in step_dirs(self.directory)[: -self.keep]:
                shutil.rmtree(path, ignore_errors=True)
