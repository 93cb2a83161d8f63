"""Slots: the host-memory files a rank keeps its pieces and its wards' copies in, and their stamps.

A slot is one file of raw bytes in the host's shared memory (`/dev/shm`, or `$HSPMD_PEER_SHM`),
mapped into the rank's memory: its pieces lie one after another, each at an offset aligned to 64
bytes, in the order of their list (`SlotLayout`). Files in shared memory outlive the process that
wrote them, so a restarted job on the same host reads them back without touching a disk; they
are gone with the host.

Every slot comes twice (`SLOTS`): while one is being written, the other still holds the last
complete copy. A slot's *stamp* (a small JSON file beside the run's index, on the checkpoint
directory's file system) says which step its bytes are of; it is removed before the bytes
change and written after they are complete, so a slot without a stamp is never read.

Nothing is pickled: bytes and JSON only.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hspmd.runtime.launcher.peer.placement import KeptPiece

__all__ = ["SLOTS", "SlotFile", "SlotLayout", "read_stamp", "remove_stamp", "shm_directory", "write_stamp"]

#: the copies of every slot (the one being written and the last complete one)
SLOTS = 2

#: alignment of every piece in a slot file
ALIGN = 64

#: the environment variable naming where slot files go (default /dev/shm)
SHM_VARIABLE = "HSPMD_PEER_SHM"


def shm_base() -> str:
    """Return the directory of host shared memory slot files go under."""
    given = os.environ.get(SHM_VARIABLE)
    if given:
        return given
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def shm_directory(peer_dir: str) -> str:
    """Return the shared-memory directory of the run whose index lives in `peer_dir` (the same on
    every host: named by a hash of the index's absolute path)."""
    return os.path.join(shm_base(), f"hspmd-peer-{zlib.crc32(os.path.abspath(peer_dir).encode()):08x}")


def remove_shm(peer_dir: str) -> None:
    """Remove the shared-memory files of the run whose index lives in `peer_dir` (on this host)."""
    shutil.rmtree(shm_directory(peer_dir), ignore_errors=True)


@dataclass(frozen=True)
class SlotLayout:
    """Where each piece lies in a slot file: byte offsets, and the length of the copied block."""

    pieces: tuple[KeptPiece, ...]
    offsets: tuple[int, ...]
    nbytes: int  # the file's length
    copied_bytes: int  # the pieces copied to the buddy lie in bytes [0, copied_bytes)

    @staticmethod
    def of(pieces: Sequence[KeptPiece]) -> SlotLayout:
        """Return the layout of `pieces` in order (the copied ones must come first)."""
        offsets, at, copied = [], 0, 0
        for p in pieces:
            at = -(-at // ALIGN) * ALIGN
            offsets.append(at)
            at += int(np.prod(p.shape, dtype=np.int64)) * np.dtype(p.dtype).itemsize
            if p.copied:
                copied = at
        return SlotLayout(tuple(pieces), tuple(offsets), max(at, 1), copied)


class SlotFile:
    """One slot file, created at its layout's size and mapped: `views[i]` is piece i's array."""

    def __init__(self, path: str, layout: SlotLayout) -> None:
        self.path, self.layout = path, layout
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:  # the pages reserved now: a full /dev/shm is an error here, not a
            os.posix_fallocate(f.fileno(), 0, layout.nbytes)  # SIGBUS at the first copy
        self.data = np.memmap(path, dtype=np.uint8, mode="r+", shape=(layout.nbytes,))
        self.views = [self.data[o:o + int(np.prod(p.shape, dtype=np.int64)) * np.dtype(p.dtype).itemsize]
                      .view(p.dtype).reshape(p.shape) for p, o in zip(layout.pieces, layout.offsets)]

    def copied_block(self) -> np.ndarray:
        """Return the bytes of the copied pieces (what goes to the buddy, or comes from a ward)."""
        return self.data[:self.layout.copied_bytes]


def stamp_path(peer_dir: str, name: str) -> str:
    """Return the path of the stamp of slot `name` (e.g. 'rank-1.own-0')."""
    return os.path.join(peer_dir, f"{name}.stamp.json")


def write_stamp(peer_dir: str, name: str, stamp: dict) -> None:
    """Say that slot `name` holds `stamp` (its step, the data position): written once its bytes are."""
    path = stamp_path(peer_dir, name)
    tmp = f"{path}.{os.getpid()}.part"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(stamp))
    os.replace(tmp, path)


def remove_stamp(peer_dir: str, name: str) -> None:
    """Say that slot `name` holds nothing complete (before its bytes change)."""
    try:
        os.remove(stamp_path(peer_dir, name))
    except FileNotFoundError:
        pass


def read_stamp(peer_dir: str, name: str) -> dict | None:
    """Return the stamp of slot `name`, None where there is none (being written, or never)."""
    try:
        with open(stamp_path(peer_dir, name), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
