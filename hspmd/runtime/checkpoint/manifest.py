"""The manifest of a sharded checkpoint: where every slice of every global tensor lies.

A checkpoint is a directory `D/step-<k>/` holding safetensors files (`rank-<r>.safetensors`, the
pieces rank r wrote) and `manifest.json`, written last:

    {"format": "hspmd-checkpoint", "version": 1, "step": 10, "data_position": 10,
     "seed": 0, "lr": 0.0029, "strategy": "[0,1]: dp=2", "num_devices": 2,
     "script": "examples/gpt.py", "config": {...}, "rng": {...},
     "data": {"format": "hspmd-sampler", "epoch": 0, "offset": 160, ...},
     "tensors": {"wte.weight": {"shape": [256, 128], "dtype": "float32",
                                "layout": "[0,1]: dup=2",
                                "pieces": [{"file": "rank-00000.safetensors",
                                            "key": "wte.weight@0:256,0:128",
                                            "region": [[0, 256], [0, 128]],
                                            "crc32": 1234, "nbytes": 131072}]}},
     "files": {"rank-00000.safetensors": 2345678}}

A piece's `region` is the global index range it holds, `[start, stop)` per dim; a tensor's pieces
are disjoint and together cover it. `crc32` is zlib's CRC-32 of the piece's bytes (C order).
`data` is the position of a `dataset(config)` script's data (`hspmd.data.Loader.state_dict`: the
sampler's cursor, two integers, and what it is a cursor in), restored in O(1) on resume; `{}` for
a `batches(config)` script, whose position is `data_position` batches drawn.
The directory appears under its name by one rename once everything in it is on disk, so a
`step-<k>` directory with a manifest is complete; one still being written is `step-<k>.tmp`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import numpy as np

__all__ = ["CheckpointError", "Manifest", "Piece", "TensorEntry", "MANIFEST", "latest_checkpoint",
           "piece_key", "read_manifest", "resolve_checkpoint", "step_dirs"]

FORMAT = "hspmd-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_STEP = re.compile(r"^step-(\d+)$")

Region = tuple[tuple[int, int], ...]


class CheckpointError(Exception):
    """A checkpoint cannot be written or read: missing, incomplete, corrupt, or not this model's."""


@dataclass(frozen=True)
class Piece:
    """One slice of a global tensor, stored under `key` in `file`."""

    file: str
    key: str
    region: Region
    crc32: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Return the shape of the piece."""
        return tuple(b - a for a, b in self.region)


@dataclass
class TensorEntry:
    """A global tensor: its shape, dtype, the layout it was trained under, and its pieces."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: str
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class Manifest:
    """What a checkpoint holds and the training position it was taken at."""

    step: int
    data_position: int
    seed: int
    strategy: str
    num_devices: int
    script: str
    config: dict
    tensors: dict[str, TensorEntry]
    lr: float | None = None
    rng: dict = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)
    #: the data loader's position (`hspmd.data.Loader.state_dict`), {} where the script has none
    data: dict = field(default_factory=dict)

    def to_json(self) -> str:
        """Return the manifest as JSON text."""
        # one line per field and per tensor: readable, and written by the C encoder (an `indent`
        # takes the pure-Python one, about 10x slower, holding the GIL in the writer thread)
        head = {"format": FORMAT, "version": VERSION, "step": self.step, "data_position": self.data_position,
                "seed": self.seed, "lr": self.lr, "strategy": self.strategy, "num_devices": self.num_devices,
                "script": self.script, "config": self.config, "rng": self.rng, "data": self.data, "files": self.files}
        tensors = ",\n".join(
            f"  {json.dumps(name)}: " + json.dumps(
                {"shape": list(t.shape), "dtype": t.dtype, "layout": t.layout,
                 "pieces": [{"file": p.file, "key": p.key, "region": [list(r) for r in p.region],
                             "crc32": p.crc32, "nbytes": p.nbytes} for p in t.pieces]})
            for name, t in self.tensors.items())
        fields = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in head.items()]
        return "{\n" + ",\n".join([*fields, ' "tensors": {\n' + tensors + "\n }"]) + "\n}\n"

    @staticmethod
    def from_json(text: str, where: str) -> Manifest:
        """Return the manifest in JSON `text` (read from `where`); CheckpointError if it is not one."""
        try:
            d = json.loads(text)
            if not isinstance(d, dict) or d.get("format") != FORMAT:
                raise CheckpointError(f"{where}: not an hspmd checkpoint manifest")
            if d.get("version") != VERSION:
                raise CheckpointError(f"{where}: manifest version {d.get('version')!r}; this hspmd reads {VERSION}")
            tensors = {}
            for name, t in d["tensors"].items():
                shape = tuple(int(s) for s in t["shape"])
                pieces = [Piece(str(p["file"]), str(p["key"]), tuple((int(a), int(b)) for a, b in p["region"]),
                                int(p["crc32"]), int(p["nbytes"])) for p in t["pieces"]]
                for p in pieces:
                    if len(p.region) != len(shape) or any(not 0 <= a <= b <= s for (a, b), s in zip(p.region, shape)):
                        raise CheckpointError(f"{where}: tensor '{name}': piece {p.key} has region {p.region} "
                                              f"outside its shape {list(shape)}")
                np.dtype(t["dtype"])
                tensors[name] = TensorEntry(name, shape, str(t["dtype"]), str(t["layout"]), pieces)
            return Manifest(int(d["step"]), int(d["data_position"]), int(d["seed"]), str(d["strategy"]),
                            int(d["num_devices"]), str(d["script"]), dict(d["config"]), tensors,
                            None if d.get("lr") is None else float(d["lr"]), dict(d.get("rng", {})),
                            {str(k): int(v) for k, v in d.get("files", {}).items()}, dict(d.get("data") or {}))
        except CheckpointError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{where}: malformed manifest ({type(err).__name__}: {err})") from None


def piece_key(name: str, region: Region) -> str:
    """Return the safetensors key of the piece of tensor `name` that covers `region`."""
    return f"{name}@" + ",".join(f"{a}:{b}" for a, b in region)


def step_dirs(directory: str) -> list[tuple[int, str]]:
    """Return (step, path) of every complete checkpoint in `directory`, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _STEP.match(name)
        path = os.path.join(directory, name)
        if m and os.path.isfile(os.path.join(path, MANIFEST)):
            out.append((int(m.group(1)), path))
    return sorted(out)


def latest_checkpoint(directory: str) -> str | None:
    """Return the newest complete checkpoint `directory/step-<k>`, or None if there is none."""
    found = step_dirs(directory)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str) -> str:
    """Return the checkpoint directory `path` names: `path` itself if it holds a manifest, else
    the newest complete `path/step-<k>`. CheckpointError if there is none."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    newest = latest_checkpoint(path)
    if newest is None:
        raise CheckpointError(f"{path}: holds no complete checkpoint (no step-<k>/{MANIFEST})")
    return newest


def read_manifest(checkpoint: str) -> Manifest:
    """Return the manifest of checkpoint directory `checkpoint` (a `step-<k>`)."""
    path = os.path.join(checkpoint, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read the manifest ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: the manifest is not UTF-8 text (corrupt?)") from None
    return Manifest.from_json(text, path)
