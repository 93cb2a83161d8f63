"""Reading a sharded checkpoint into a rank's state, under any strategy (reshard on load).

`load_state` gives each rank its pieces of every tensor its plan holds: for the region the
rank's layout assigns it (`Layout.slices`), it reads from each stored piece that overlaps the
region only the overlap (a safetensors slice: the byte ranges of those elements), so no rank
reads what it does not hold. Every stored piece is also checked once against its CRC-32, by one
rank (piece i by rank i mod N), and the ranks agree on the outcome with one all-reduce before
any of them uses what it read: a truncated file, a flipped byte or a missing piece stops every
rank with nothing loaded, and the rank that found it names the file and the tensor.

`load_global_file` does the same from one file of global tensors (`hspmd checkpoint export`).
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable

import numpy as np
from safetensors import SafetensorError, safe_open

from hspmd.codegen.schedule.model import Leaf
from hspmd.runtime.checkpoint.manifest import CheckpointError, Manifest, Piece, Region, TensorEntry
from hspmd.runtime.checkpoint.writer import region_of
from hspmd.runtime.comm.base import Communicator

__all__ = ["CheckpointElsewhere", "PieceFiles", "assemble", "check_tensors", "load_global_file", "load_state", "verify_piece"]

#: the prefix of optimizer states: a file of global tensors may leave them out (they start fresh)
OPTIMIZER_PREFIX = "opt."


class CheckpointElsewhere(CheckpointError):
    """Another rank found the checkpoint bad (it says where); this rank loaded nothing either."""


class PieceFiles:
    """The safetensors files of one checkpoint, opened once each."""

    def __init__(self, root: str) -> None:
        self.root, self.open = root, {}

    def get(self, file: str):
        if file not in self.open:
            path = os.path.join(self.root, file)
            if os.path.basename(file) != file:
                raise CheckpointError(f"{path}: a piece's file name leaves the checkpoint directory")
            try:
                self.open[file] = safe_open(path, framework="numpy")
            except (OSError, SafetensorError, ValueError) as err:
                raise CheckpointError(f"{path}: cannot read it as safetensors ({err})") from None
        return self.open[file]


def _read(files: PieceFiles, file: str, key: str, index: tuple[slice, ...] | None, what: str) -> np.ndarray:
    """Return `index` of tensor `key` in `file` (all of it for None)."""
    path = os.path.join(files.root, file)
    try:
        handle = files.get(file)
        if index is None or not index:
            return handle.get_tensor(key)
        return handle.get_slice(key)[index]
    except CheckpointError:
        raise
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: {what}: cannot read piece '{key}' ({err})") from None


def check_tensors(entries: dict[str, TensorEntry], leaves: Iterable[Leaf], where: str,
                  optional: str | None = None) -> None:
    """Raise CheckpointError unless every leaf is stored with its global shape and dtype
    (names starting with `optional` may be missing)."""
    for leaf in leaves:
        entry = entries.get(leaf.name)
        if entry is None:
            if optional is not None and leaf.name.startswith(optional):
                continue
            raise CheckpointError(f"{where}: has no tensor '{leaf.name}', which this model needs "
                                  f"(a checkpoint of another model? it holds {len(entries)} tensors)")
        if tuple(entry.shape) != tuple(leaf.global_shape):
            raise CheckpointError(f"{where}: tensor '{leaf.name}' has shape {list(entry.shape)}, "
                                  f"this model's is {list(leaf.global_shape)}")
        if np.dtype(entry.dtype) != np.dtype(leaf.dtype):
            raise CheckpointError(f"{where}: tensor '{leaf.name}' is {entry.dtype}, this model's is {leaf.dtype}")


def verify_piece(files: PieceFiles, name: str, piece: Piece, dtype: str) -> None:
    """Raise CheckpointError unless `piece` reads back whole, with its shape, dtype and CRC-32."""
    path = os.path.join(files.root, piece.file)
    data = _read(files, piece.file, piece.key, None, f"tensor '{name}'")
    if data.shape != piece.shape or data.dtype != np.dtype(dtype):
        raise CheckpointError(f"{path}: tensor '{name}': piece '{piece.key}' is {data.dtype}{list(data.shape)}, "
                              f"the manifest says {dtype}{list(piece.shape)}")
    if zlib.crc32(np.ascontiguousarray(data).data) != piece.crc32:
        raise CheckpointError(f"{path}: tensor '{name}': piece '{piece.key}' fails its checksum (the file is corrupt)")


def _agree(problem: str | None, comm: Communicator) -> None:
    """Raise on every rank if any rank has a problem (it raises its own message)."""
    flags = np.array([0 if problem is None else 1], dtype=np.int64)
    if comm.size > 1:
        flags = comm.all_reduce(flags, tuple(range(comm.size)))
    if problem is not None:
        raise CheckpointError(problem)
    if int(flags[0]):
        raise CheckpointElsewhere("another rank found the checkpoint bad; nothing was loaded")


def _overlap(a: Region, b: Region) -> Region | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(x0 < x1 for x0, x1 in out) or not out else None


def assemble(files: PieceFiles, entry: TensorEntry, want: Region, dtype: str) -> np.ndarray:
    """Return the `want` region of tensor `entry`, read from the overlapping parts of its pieces."""
    out = np.empty(tuple(b - a for a, b in want), dtype=dtype)
    covered = 0
    for piece in entry.pieces:
        inter = _overlap(want, piece.region)
        if inter is None:
            continue
        src = tuple(slice(a - p0, b - p0) for (a, b), (p0, _) in zip(inter, piece.region))
        dst = tuple(slice(a - w0, b - w0) for (a, b), (w0, _) in zip(inter, want))
        part = _read(files, piece.file, piece.key, src, f"tensor '{entry.name}'")
        out[dst] = part
        covered += int(np.prod([b - a for a, b in inter], dtype=np.int64))
    if covered != out.size:
        raise CheckpointError(f"{files.root}: tensor '{entry.name}': the pieces cover {covered} of the "
                              f"{out.size} elements of region {list(want)} (a piece is missing)")
    return out


def load_state(checkpoint: str, manifest: Manifest, leaves: list[Leaf], rank: int,
               comm: Communicator) -> dict[str, np.ndarray]:
    """Return this rank's pieces of `leaves` from `checkpoint` (see the module docstring)."""
    files = PieceFiles(checkpoint)
    problem = None
    try:
        check_tensors(manifest.tensors, leaves, checkpoint)
        everything = [(e, p) for e in manifest.tensors.values() for p in e.pieces]
        for i, (entry, piece) in enumerate(everything):
            if i % comm.size == rank:
                verify_piece(files, entry.name, piece, entry.dtype)
        state = {leaf.name: assemble(files, manifest.tensors[leaf.name], region_of(leaf, rank), leaf.dtype)
                 for leaf in leaves}
    except CheckpointError as err:
        problem = str(err)
    _agree(problem, comm)
    return state


def _global_entries(path: str, handle) -> dict[str, TensorEntry]:
    """Return the tensors of a file of global tensors as manifest entries (one whole piece each)."""
    meta = handle.metadata() or {}
    out = {}
    for key in handle.keys():
        sl = handle.get_slice(key)
        shape = tuple(sl.get_shape())
        dtype = _dtype_of(sl.get_dtype(), path, key)
        crc = meta.get(f"crc32/{key}")
        out[key] = TensorEntry(key, shape, dtype, "",
                               [Piece(os.path.basename(path), key, tuple((0, s) for s in shape),
                                      int(crc) if crc is not None else -1, 0)])
    return out


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64", "I32": "int32",
                       "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def _dtype_of(code: str, path: str, key: str) -> str:
    if code not in _SAFETENSORS_DTYPES:
        raise CheckpointError(f"{path}: tensor '{key}' has dtype {code}, which hspmd does not read")
    return _SAFETENSORS_DTYPES[code]


def load_global_file(path: str, leaves: list[Leaf], rank: int, comm: Communicator,
                     initial: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Return this rank's pieces of `leaves` from a file of global tensors, named as the model tree;
    optimizer states the file lacks keep their `initial` value. Checksums stored in the file's
    metadata (`crc32/<name>`, as `hspmd checkpoint export` writes) are checked, tensor i by rank i mod N."""
    files = PieceFiles(os.path.dirname(os.path.abspath(path)))
    problem = None
    state: dict[str, np.ndarray] = {}
    try:
        entries = _global_entries(path, files.get(os.path.basename(path)))
        check_tensors(entries, leaves, path, optional=OPTIMIZER_PREFIX)
        for i, entry in enumerate(entries.values()):
            if i % comm.size == rank and entry.pieces[0].crc32 >= 0:
                verify_piece(files, entry.name, entry.pieces[0], entry.dtype)
        for leaf in leaves:
            state[leaf.name] = (assemble(files, entries[leaf.name], region_of(leaf, rank), leaf.dtype)
                                if leaf.name in entries else initial[leaf.name])
    except CheckpointError as err:
        problem = str(err)
    _agree(problem, comm)
    return state
