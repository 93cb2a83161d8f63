"""Names of stacked parameters: one tensor holding the same parameter of consecutive layers.

`stack-layers` turns the parameters `blocks.0.attn.proj.weight` ... `blocks.47.attn.proj.weight`
(each [128, 128]) into one parameter `blocks.[0:48].attn.proj.weight` of shape [48, 128, 128]:
the dotted component that numbers the layers becomes the half-open range `[start:stop]`, and
slice i of the tensor is layer `start + i`. Layers that repeat with a period (Gemma-2's sliding
and full attention taking turns) stack every period-th layer: `layers.[1:49:2].mlp.up.weight`
holds layers 1, 3, ..., 47, a range with a step as Python writes one. The name says which per-layer names it holds, so
checkpoints, `--init-from` files and initial values keep the per-layer names (`layer_names`),
and optimizer state follows (`opt.m.blocks.[0:48].attn.proj.weight`).

    >>> stack_name(["blocks.0.ln1.weight", "blocks.1.ln1.weight"])
    'blocks.[0:2].ln1.weight'
    >>> layer_names("opt.m.blocks.[2:4].ln1.weight")
    ['opt.m.blocks.2.ln1.weight', 'opt.m.blocks.3.ln1.weight']
    >>> stack_name(["h.1.w", "h.3.w", "h.5.w"])
    'h.[1:7:2].w'
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_RANGE = re.compile(r"^\[(\d+):(\d+)(?::(\d+))?\]$")


def _range_text(layers: range) -> str:
    step = "" if layers.step == 1 else f":{layers.step}"
    return f"[{layers.start}:{layers.stop}{step}]"


def _range_component(parts: Sequence[str]) -> tuple[int, range] | None:
    """Return (index of the range component, the layers it names) of a split name, or None."""
    found = [(i, m) for i, p in enumerate(parts) if (m := _RANGE.match(p))]
    if len(found) != 1:
        return None
    i, m = found[0]
    step = int(m.group(3)) if m.group(3) is not None else 1
    layers = range(int(m.group(1)), int(m.group(2)), step) if step > 0 else range(0)
    return (i, layers) if len(layers) > 0 else None


def layer_range(name: str) -> range | None:
    """Return the layer numbers a stacked name holds, in slice order, or None for a plain name."""
    found = _range_component(name.split("."))
    return None if found is None else found[1]


def is_stacked(name: str) -> bool:
    """Return whether `name` names a stacked parameter (or its optimizer state)."""
    return layer_range(name) is not None


def layer_names(name: str) -> list[str]:
    """Return the per-layer names a stacked name holds, in slice order ([name] for a plain name)."""
    parts = name.split(".")
    found = _range_component(parts)
    if found is None:
        return [name]
    i, layers = found
    return [".".join([*parts[:i], str(k), *parts[i + 1:]]) for k in layers]


def stack_name(names: Sequence[str]) -> str | None:
    """Return the stacked name of per-layer `names` (at least two), or None if they do not form one.

    They must split into the same dotted components but one, which counts up by one step from
    name to name in decimal (`0`, `1`, `2`, ... or, every other layer, `1`, `3`, `5`, ...); no name
    may already be stacked.
    """
    if len(names) < 2 or any(is_stacked(n) for n in names):
        return None
    split = [n.split(".") for n in names]
    if len({len(s) for s in split}) != 1:
        return None
    differ = [i for i in range(len(split[0])) if len({s[i] for s in split}) > 1]
    if len(differ) != 1:
        return None
    i = differ[0]
    values = [s[i] for s in split]
    if not all(v.isdigit() and str(int(v)) == v for v in values):
        return None
    numbers = [int(v) for v in values]
    step = numbers[1] - numbers[0]
    layers = range(numbers[0], numbers[0] + step * len(numbers), step) if step > 0 else range(0)
    if list(layers) != numbers:
        return None
    return ".".join([*split[0][:i], _range_text(layers), *split[0][i + 1:]])


def slice_name(name: str, start: int, stop: int) -> str:
    """Return the name of slices [start, stop) (along the stacking dim) of stacked `name`."""
    parts = name.split(".")
    found = _range_component(parts)
    if found is None:
        raise ValueError(f"'{name}' is not a stacked name")
    i, layers = found
    if not 0 <= start < stop <= len(layers):
        raise ValueError(f"slices [{start}:{stop}] are not within '{name}' ({len(layers)} layers)")
    return ".".join([*parts[:i], _range_text(layers[start:stop]), *parts[i + 1:]])
