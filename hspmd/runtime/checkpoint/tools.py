"""Offline tools over a checkpoint directory: `hspmd checkpoint info` and `hspmd checkpoint export`.

Both run in one process and read every piece (checking each CRC-32); training runs never do
(see `reader`).
"""

from __future__ import annotations

import json
import os
import zlib

import numpy as np
from safetensors.numpy import save_file

from hspmd.runtime.checkpoint.manifest import (
    CheckpointError, Manifest, read_manifest, resolve_checkpoint, step_dirs,
)
from hspmd.runtime.checkpoint.reader import OPTIMIZER_PREFIX, assemble, PieceFiles, verify_piece

__all__ = ["checkpoint_info", "export_checkpoint", "export_hugging_face", "global_tensors"]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _verify_all(checkpoint: str, manifest: Manifest) -> int:
    """Return the number of pieces of `manifest`, each read back and checked; CheckpointError at the first bad one."""
    files = PieceFiles(checkpoint)
    count = 0
    for entry in manifest.tensors.values():
        for piece in entry.pieces:
            verify_piece(files, entry.name, piece, entry.dtype)
            count += 1
    return count


def checkpoint_info(path: str, verify: bool = True) -> str:
    """Return a report on checkpoint `path` (a directory of `step-<k>`s, or one of them): the
    steps it holds and, for the newest (or the one named), the run, the tensors and their sizes,
    and whether every piece matches its checksum."""
    checkpoint = resolve_checkpoint(path)
    manifest = read_manifest(checkpoint)
    lines = []
    steps = step_dirs(path) if os.path.realpath(checkpoint) != os.path.realpath(path) else []
    if steps:
        lines.append(f"{path}: {len(steps)} checkpoint(s), steps {', '.join(str(k) for k, _ in steps)}")
    total = sum(p.nbytes for e in manifest.tensors.values() for p in e.pieces)
    params = [e for n, e in manifest.tensors.items() if not n.startswith(OPTIMIZER_PREFIX)]
    lines += [
        f"checkpoint {checkpoint}",
        f"  step {manifest.step} (data position {manifest.data_position}, seed {manifest.seed}"
        + (f", lr {manifest.lr:.6g}" if manifest.lr is not None else "") + ")",
        f"  strategy '{manifest.strategy}' on {manifest.num_devices} devices; script {manifest.script}",
        f"  {len(manifest.tensors)} tensors ({len(params)} parameters, "
        f"{sum(int(np.prod(e.shape, dtype=np.int64)) for e in params):,} elements), "
        f"{sum(len(e.pieces) for e in manifest.tensors.values())} pieces, {_size(total)} in "
        f"{len(manifest.files)} files",
    ]
    for file, size in sorted(manifest.files.items()):
        lines.append(f"    {file}  {_size(size)}")
    width = max((len(n) for n in manifest.tensors), default=0)
    for name, e in manifest.tensors.items():
        lines.append(f"  {name:<{width}}  {e.dtype:<8} {str(list(e.shape)):<14} {len(e.pieces)} piece(s)  {e.layout}")
    if verify:
        lines.append(f"  checksums: all {_verify_all(checkpoint, manifest)} pieces verified")
    return "\n".join(lines) + "\n"


def global_tensors(path: str, include_optimizer: bool = False) -> tuple[Manifest, dict[str, np.ndarray]]:
    """Return the manifest of checkpoint `path` and its global tensors (optimizer states only with
    `include_optimizer`), each assembled from its pieces, every piece checked."""
    checkpoint = resolve_checkpoint(path)
    manifest = read_manifest(checkpoint)
    _verify_all(checkpoint, manifest)
    files = PieceFiles(checkpoint)
    out = {}
    for name, entry in manifest.tensors.items():
        if include_optimizer or not name.startswith(OPTIMIZER_PREFIX):
            out[name] = assemble(files, entry, tuple((0, s) for s in entry.shape), entry.dtype)
    return manifest, out


def _state_dict(path: str, include_optimizer: bool = False) -> tuple[Manifest, dict[str, np.ndarray]]:
    """Return the manifest and global tensors of checkpoint `path`, an imported PyTorch model's tied
    parameters (GPT-2's lm_head.weight is transformer.wte.weight) under each of their names, as
    the module's state_dict has them."""
    manifest, tensors = global_tensors(path, include_optimizer)
    if not tensors:
        raise CheckpointError(f"{path}: holds no tensors to export")
    for alias, name in (manifest.config.get("torch_aliases") or {}).items():
        if name in tensors:
            tensors[alias] = tensors[name].copy()
    return manifest, tensors


def _save_atomically(tensors: dict[str, np.ndarray], to: str, meta: dict[str, str]) -> None:
    """Write `tensors` to safetensors file `to` by a rename, once on disk."""
    os.makedirs(os.path.dirname(os.path.abspath(to)), exist_ok=True)
    tmp = f"{to}.tmp{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata=meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, to)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def export_checkpoint(path: str, to: str, include_optimizer: bool = False) -> str:
    """Write the global tensors of checkpoint `path` to one safetensors file `to` (named as the
    model tree, with `crc32/<name>` and the step in its metadata), atomically; return a summary."""
    manifest, tensors = _state_dict(path, include_optimizer)
    meta = {"format": "hspmd-global", "step": str(manifest.step), "strategy": manifest.strategy}
    meta.update({f"crc32/{k}": str(zlib.crc32(np.ascontiguousarray(v).data)) for k, v in tensors.items()})
    _save_atomically(tensors, to, meta)
    nbytes = sum(v.nbytes for v in tensors.values())
    return f"wrote {len(tensors)} tensors ({_size(nbytes)}) of step {manifest.step} to {to}"


def export_hugging_face(path: str, directory: str) -> str:
    """Write checkpoint `path` of a transformers model (a script whose `torch_model` returned one)
    as `save_pretrained` would: `directory/config.json` (the model's config, its dtype the
    weights') and `directory/model.safetensors` (its state_dict, tied weights once, under the
    name transformers loads them by), so `from_pretrained(directory)` loads it with no key missing
    or unexpected. Return a summary."""
    manifest, tensors = _state_dict(path)
    hf = manifest.config.get("hf")
    if not isinstance(hf, dict) or not isinstance(hf.get("config"), dict):
        raise CheckpointError(f"{path}: not a Hugging Face model's checkpoint (its script's torch_model did not "
                              "return a transformers model); export it with --to FILE.safetensors instead")
    if hf.get("absent"):
        names = ", ".join(hf["absent"][:5]) + (", ..." if len(hf["absent"]) > 5 else "")
        raise CheckpointError(f"{path}: the checkpoint lacks {len(hf['absent'])} entr"
                              f"{'y' if len(hf['absent']) == 1 else 'ies'} of the model's state_dict ({names}): "
                              "parameters the loss does not use or buffers are not trained, so not saved")
    tensors = {k: np.require(v, np.float32 if v.dtype.name == "bfloat16" else v.dtype, "C")
               for k, v in tensors.items() if k not in set(hf.get("tied") or ())}
    dtypes = {v.dtype.name for v in tensors.values() if v.dtype.kind == "f"}
    config = dict(hf["config"])
    if len(dtypes) == 1:
        config["dtype"] = next(iter(dtypes))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: exists and is not a directory")
    os.makedirs(directory, exist_ok=True)
    _save_atomically(tensors, os.path.join(directory, "model.safetensors"), {"format": "pt"})
    tmp = os.path.join(directory, f"config.json.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, os.path.join(directory, "config.json"))
    nbytes = sum(v.nbytes for v in tensors.values())
    return (f"wrote {len(tensors)} tensors ({_size(nbytes)}) of step {manifest.step} and the config of "
            f"{', '.join(config.get('architectures') or ['the model'])} to {directory}")
