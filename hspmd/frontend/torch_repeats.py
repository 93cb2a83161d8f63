"""Which blocks of a PyTorch model repeat, so that the importer exports only the first of them.

A transformer's `nn.ModuleList` of decoder layers is rarely all alike: Gemma-2 alternates
sliding-window and full attention, Gemma-3 puts one full layer after five sliding ones,
DeepSeek-style models start with dense layers before the expert ones. What they share is a
pattern: after `start` layers, the layers repeat with a `period`. `repeat_pattern` finds the
shortest such pattern of a sequence (the blocks' settings, with the config's per-layer lists,
transformers' `layer_types`, say), and `repeatable_lists` the lists worth cutting: those whose
pattern leaves at least one block out of `start + period + 1`. The importer
(`hspmd.frontend.torch_import`) exports those first blocks (one period, and the first block of
the next), checks that the second period's first block has the first's graph (a block that
computes with its number shows there), and calls each block left out as the exported block at
its place in the pattern is called (`RepeatPattern.template`), on the one before's result. The
export, the import's dearest part, so holds one block more than a period however deep the model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence


#: a block's settings that only number it (a block that computes with its number shows it in its
#: graph, which the importer compares a period apart)
LAYER_INDEX = frozenset(("training", "layer_idx", "layer_id", "layer_index", "layer_number", "layer_num", "block_idx",
                         "seed"))


@dataclass(frozen=True)
class RepeatPattern:
    """A ModuleList of `length` blocks where block i equals block i + `period` for every i >=
    `start`."""

    length: int
    start: int
    period: int

    @property
    def exported(self) -> int:
        """How many of the first blocks the export keeps: `start`, a period and the next block."""
        return self.start + self.period + 1

    def template(self, k: int) -> int:
        """Return the exported block that block `k` is called as: the one at its place in the first
        period, or the second period's first (`start + period`) in the first's place."""
        r = (k - self.start) % self.period
        return self.start + (r if r else self.period)


def repeat_pattern(items: Sequence) -> tuple[int, int]:
    """Return the (start, period) of `items` with the smallest `start + 2 * period`, then the
    smallest period: items[i] == items[i + period] for every i >= start. (0, 1) where all are
    equal; (len(items), 1) where nothing repeats."""
    n = len(items)
    for total in range(2, n + 1):
        for period in range(1, total // 2 + 1):
            start = total - 2 * period
            if all(items[i] == items[i + period] for i in range(start, n - period)):
                return start, period
    return n, 1


def repeatable_lists(module) -> dict[str, RepeatPattern]:
    """Return {path: pattern} of the top-level `nn.ModuleList`s whose blocks repeat (see the module
    docstring) and that hold more blocks than the pattern's `exported`. What must repeat of a
    block: its class, parameters (names, shapes, dtypes), buffers and plain settings (numbers,
    strings, flags of every submodule; its number, `LAYER_INDEX`, aside), and its entry of each per-layer list of
    the model's config (a list or tuple as long as the ModuleList, not one of layer numbers)."""
    import torch

    config = getattr(module, "config", None)
    lists = [v for v in (vars(config).values() if config is not None else ()) if isinstance(v, (list, tuple))]
    out: dict[str, RepeatPattern] = {}
    for path, m in module.named_modules():
        if not isinstance(m, torch.nn.ModuleList) or len(m) < 3 or any(path.startswith(p + ".") for p in out):
            continue
        per_layer = [v for v in lists if len(v) == len(m) and not _counting(list(v))]
        counting = numbering(list(m))
        keys = [(block_key(b, counting), *(repr(v[i]) for v in per_layer)) for i, b in enumerate(m)]
        start, period = repeat_pattern(keys)
        pattern = RepeatPattern(len(m), start, period)
        if pattern.exported < len(m):
            out[path] = pattern
    return out


def _settings(block) -> dict[tuple[str, str], object]:
    """Return the plain settings (numbers, strings, flags) of `block` and its submodules by
    (submodule, name), its number (`LAYER_INDEX`) aside."""
    return {(name, k): v for name, sub in block.named_modules() for k, v in vars(sub).items()
            if not k.startswith("_") and k not in LAYER_INDEX and isinstance(v, (bool, int, float, str, type(None)))}


def _counting(values: list) -> bool:
    """Return whether `values` are integers `a + i * d`, d != 0: layer numbers (Llama-4's
    `moe_layers` lists every layer's), not a setting per layer."""
    if len(values) < 2 or not all(type(v) is int for v in values):
        return False
    step = values[1] - values[0]
    return step != 0 and values == [values[0] + i * step for i in range(len(values))]


def numbering(blocks: Sequence) -> frozenset[tuple[str, str]]:
    """Return the integer settings of `blocks` that count with the block's number (`a + i * d`,
    d != 0, in block i; Beam numbers its residual adds so): the block's number under another name,
    aside as `LAYER_INDEX` is (a block that computes with it shows it in its graph)."""
    settings = [_settings(b) for b in blocks]
    return frozenset(key for key in settings[0] if _counting([s.get(key) for s in settings]))


def block_key(block, counting: frozenset[tuple[str, str]] = frozenset()) -> str:
    """Return what two blocks must share to compute alike (see `repeatable_lists`), the settings
    `counting` (`numbering`) aside."""
    parts: list = [type(block).__qualname__]
    settings = _settings(block)
    for name, sub in block.named_modules():
        parts.append((name, type(sub).__qualname__, sorted(
            (k, repr(v)) for (n, k), v in settings.items() if n == name and (n, k) not in counting)))
    parts += [(n, tuple(p.shape), str(p.dtype)) for n, p in block.named_parameters()]
    parts += [(n, digest(b)) for n, b in block.named_buffers()]
    return repr(parts)


def digest(value) -> str:
    """Return a short digest of a concrete value (a tensor's dtype, shape and bytes; a list's
    items'; another value's repr)."""
    import torch

    if isinstance(value, torch.Tensor):
        arr = value.detach().cpu()
        return hashlib.sha1(repr((str(arr.dtype), tuple(arr.shape))).encode() +
                            arr.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                            if arr.numel() else b"empty" + repr(tuple(arr.shape)).encode()).hexdigest()[:16]
    if isinstance(value, (list, tuple)):
        return repr(tuple(digest(v) for v in value))
    return repr(value)
