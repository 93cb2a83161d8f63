"""Executable bundles: a dump directory that `hspmd run` can execute without the compiler.

A bundle holds `logical.mlir`, `annotated.mlir`, per device group its physical program
`physical_groupK.mlir` and its kernel level `kernel_groupK.mlir` (the same program with
elementwise chains and row reductions fused into `kernel.fused` ops: the compiler fuses once,
the runtime only picks), and `manifest.json`, which records what running needs: the model
script that provides the data, its config, the strategy, the device count, and which programs
each group runs. It is the compiler's output format and the runtime's input: nothing else
passes between them.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

FORMAT = 1
MANIFEST = "manifest.json"


class BundleError(Exception):
    """A bundle directory is missing, incomplete, or from another format version."""


@dataclass
class GroupEntry:
    """One device group, the file holding its physical program and the one holding its kernel
    level (None in bundles written before the kernel level was part of them)."""

    devices: list[int]
    program: str
    kernels: str | None = None


@dataclass
class Manifest:
    """What a bundle needs to run (see the module docstring)."""

    script: str
    config: dict
    strategy: str
    num_devices: int
    groups: list[GroupEntry] = field(default_factory=list)
    format: int = FORMAT

    def group_for(self, rank: int) -> GroupEntry:
        """Return the group entry whose devices include `rank`."""
        for g in self.groups:
            if rank in g.devices:
                return g
        raise BundleError(f"no device group of the bundle holds rank {rank}")


def write_manifest(directory: str, manifest: Manifest) -> str:
    """Write `manifest.json` into `directory` atomically and return its path."""
    path = os.path.join(directory, MANIFEST)
    atomic_write_text(path, json.dumps(asdict(manifest), indent=2) + "\n")
    return path


def read_manifest(directory: str) -> Manifest:
    """Return the manifest of the bundle in `directory`."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise BundleError(f"{directory}: not a bundle (no {MANIFEST}); make one with 'hspmd compile --dump-dir'")
    try:
        raw = json.loads(open(path).read())
        if raw.get("format") != FORMAT:
            raise BundleError(f"{path}: bundle format {raw.get('format')} is not {FORMAT}; compile it again")
        raw["groups"] = [GroupEntry(**g) for g in raw["groups"]]
        return Manifest(**raw)
    except (ValueError, TypeError, KeyError) as err:
        raise BundleError(f"{path}: malformed manifest ({err})") from None


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the new one, never a part."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
