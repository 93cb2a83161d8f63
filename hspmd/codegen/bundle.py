"""Executable bundles: a dump directory that `hspmd run` can execute without the compiler.

A bundle holds `logical.mlir`, `annotated.mlir`, one `physical_groupK.mlir` per device group,
the same program at the kernel level (fused by the compiler) as `kernel_groupK.mlir`, for a
GPU run its device program (`device-kernels`: every op a kernel, a GEMM or a view) as
`device_groupK.mlir`, and
`manifest.json`, which records what running needs: the model script that provides the data,
its config, the strategy, the device count, and which programs each group runs (a group's
devices as range text, `"0-65535"`, so the manifest does not grow with the device count; one
written before ranges lists them, `[0, 1]`, and still reads). The
compiler writes it (`write_bundle`), the runtime reads it (`read_manifest`). A manifest
written before bundles held kernel-level IR has no `kernels` entries: such a bundle runs its
physical programs (NumPy per op). A program imported from PyTorch (`hspmd.frontend.torch_import`)
also holds its module's weights, `weights.safetensors` (global tensors named as the parameters),
which a run starts from unless it resumes or is given `--init-from`. A bundle compiled with the
user's own passes (`--load-pass`, `--pass-after`, ...) records them, `user_passes`: each file or
module with the SHA-256 of its text and the passes it defines, and the flags that placed them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from xdsl.dialects.builtin import ModuleOp

from hspmd.dialects.context import module_text
from hspmd.ir.devices import DeviceRange, DeviceSetError, parse_devices

FORMAT = 1
MANIFEST = "manifest.json"


class BundleError(Exception):
    """A bundle directory is missing, incomplete, or from another format version."""


@dataclass
class GroupEntry:
    """One device group, the file holding its physical program, the file holding the same
    program at the kernel level (None in bundles written before they held it) and the file of
    its GPU program (None where the bundle was not compiled for a GPU run)."""

    devices: DeviceRange
    program: str
    kernels: str | None = None
    device: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.devices, str):
            self.devices = parse_devices(self.devices)
        elif not isinstance(self.devices, DeviceRange):  # a list: a manifest written before ranges
            self.devices = DeviceRange.of(self.devices)


@dataclass
class Manifest:
    """What a bundle needs to run (see the module docstring)."""

    script: str
    config: dict
    strategy: str
    num_devices: int
    groups: list[GroupEntry] = field(default_factory=list)
    format: int = FORMAT
    # graph switching: the sub-bundle (a directory relative to this one, "." for this one) of
    # strategies 1, 2, ... of the run; empty for a bundle of one strategy
    variants: list[str] = field(default_factory=list)
    # the file of global tensors the run starts from (relative to the bundle), or None: the
    # parameters' own initialisers
    weights: str | None = None
    # idle ranks (`hspmd.runtime.launcher.idle`): the run's rank of each of the program's devices 0..K-1
    # and the run's rank count, where the strategy names only some of its ranks; None: every
    # rank of the run works and the devices are its ranks
    ranks: list[int] | None = None
    world_size: int | None = None
    # the user's passes it was compiled with: {"ran": [names], "placed": [flags], "sources": [{"source",
    # "sha256", "passes"}]}; None: hspmd's passes alone
    user_passes: dict | None = None

    def group_for(self, rank: int) -> GroupEntry:
        """Return the group entry whose devices include `rank`."""
        for g in self.groups:
            if rank in g.devices:
                return g
        raise BundleError(f"no device group of the bundle holds rank {rank}")


def write_manifest(directory: str, manifest: Manifest) -> str:
    """Write `manifest.json` into `directory` atomically and return its path."""
    path = os.path.join(directory, MANIFEST)
    raw = asdict(manifest)
    for group, entry in zip(raw["groups"], manifest.groups):
        group["devices"] = str(entry.devices)  # range text: "0-65535", not the list
        if group.get("device") is None:  # a bundle for CPUs only says nothing of GPU programs
            group.pop("device", None)
    if raw.get("ranks") is None:  # a bundle whose every rank works says nothing of idle ones
        raw.pop("ranks", None)
        raw.pop("world_size", None)
    if raw.get("user_passes") is None:  # compiled by hspmd's passes alone
        raw.pop("user_passes", None)
    atomic_write_text(path, json.dumps(raw, indent=2) + "\n")
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
    except (ValueError, TypeError, KeyError, DeviceSetError) as err:
        raise BundleError(f"{path}: malformed manifest ({err})") from None


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the new one, never a part."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_bundle(directory: str, *, script: str, config: dict, strategy: str, logical: ModuleOp,
                 annotated: ModuleOp, groups: Sequence[tuple[Sequence[int], ModuleOp, ModuleOp, ModuleOp | None]],
                 variants: Sequence[str] = (), weights: dict | None = None,
                 user_passes: dict | None = None) -> Manifest:
    """Write a bundle into `directory` and return its manifest.

    `groups` holds, per device group, its devices, its physical program, the same program at
    the kernel level (the compiler runs `fuse-kernels` on a copy of the physical one) and its
    GPU program (None: the bundle runs on CPUs only); `variants`, the sub-bundles of a
    switching run's other strategies (`Manifest.variants`); `weights`, the initial values of
    the parameters (name -> global array), where they are not the initialisers' (an imported
    PyTorch module's); `user_passes`, the user's passes it was compiled with (`Manifest.user_passes`).
    """
    os.makedirs(directory, exist_ok=True)
    atomic_write_text(os.path.join(directory, "logical.mlir"), module_text(logical))
    atomic_write_text(os.path.join(directory, "annotated.mlir"), module_text(annotated))
    entries = []
    for gi, (devices, physical, kernels, device) in enumerate(groups):
        entry = GroupEntry(DeviceRange.of(devices), f"physical_group{gi}.mlir", f"kernel_group{gi}.mlir",
                           f"device_group{gi}.mlir" if device is not None else None)
        atomic_write_text(os.path.join(directory, entry.program), module_text(physical))
        atomic_write_text(os.path.join(directory, entry.kernels), module_text(kernels))
        if device is not None:
            atomic_write_text(os.path.join(directory, entry.device), module_text(device))  # type: ignore[arg-type]
        entries.append(entry)
    weights_file = None
    if weights:
        import zlib

        import numpy as np
        from safetensors.numpy import save_file

        weights_file = "weights.safetensors"
        arrays = {k: np.require(v, None, "C") for k, v in weights.items()}  # 0-d stays 0-d (ascontiguousarray makes 1-d)
        meta = {"format": "hspmd-global", **{f"crc32/{k}": str(zlib.crc32(v.data)) for k, v in arrays.items()}}
        tmp = os.path.join(directory, f"{weights_file}.tmp{os.getpid()}")
        save_file(arrays, tmp, metadata=meta)
        os.replace(tmp, os.path.join(directory, weights_file))
    manifest = Manifest(script=script, config=config, strategy=strategy,
                        num_devices=sum(len(g.devices) for g in entries), groups=entries, variants=list(variants),
                        weights=weights_file, user_passes=user_passes)
    write_manifest(directory, manifest)
    return manifest
