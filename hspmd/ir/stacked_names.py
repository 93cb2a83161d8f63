"""Names of stacked parameters: one tensor holding the same parameter of consecutive layers.

`stack-layers` turns the parameters `blocks.0.attn.proj.weight` ... `blocks.47.attn.proj.weight`
(each [128, 128]) into one parameter `blocks.[0:48].attn.proj.weight` of shape [48, 128, 128]:
the dotted component that numbers the layers becomes the half-open range `[start:stop]`, and
slice i of the tensor is layer `start + i`. Layers that repeat with a period (Gemma-2's sliding
and full attention taking turns) stack every period-th layer: `layers.[1:49:2].mlp.up.weight`
holds layers 1, 3, ..., 47, a range with a step as Python writes one. Layers numbered
irregularly (Mllama's text layers, its cross-attention ones between them left out) are several
ranges: `layers.[0:3,4:8,9:48].mlp.up.weight`. The name says which per-layer names it holds, so
checkpoints, `--init-from` files and initial values keep the per-layer names (`layer_names`),
and optimizer state follows (`opt.m.blocks.[0:48].attn.proj.weight`).

    >>> stack_name(["blocks.0.ln1.weight", "blocks.1.ln1.weight"])
    'blocks.[0:2].ln1.weight'
    >>> layer_names("opt.m.blocks.[2:4].ln1.weight")
    ['opt.m.blocks.2.ln1.weight', 'opt.m.blocks.3.ln1.weight']
    >>> stack_name(["h.1.w", "h.3.w", "h.5.w"])
    'h.[1:7:2].w'
    >>> stack_name(["h.0.w", "h.1.w", "h.3.w", "h.4.w", "h.9.w"])
    'h.[0:2,3:5,9:10].w'
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_SLICE = r"\d+:\d+(?::\d+)?"
_RANGE = re.compile(rf"^\[{_SLICE}(?:,{_SLICE})*\]$")


def _runs(layers: Sequence[int]) -> list[range]:
    """Return increasing `layers` as ranges, each as long as it can be, in order."""
    runs: list[range] = []
    i = 0
    while i < len(layers):
        step = layers[i + 1] - layers[i] if i + 1 < len(layers) else 1
        j = i + 1
        while j < len(layers) and layers[j] - layers[j - 1] == step:
            j += 1
        runs.append(range(layers[i], layers[j - 1] + step, step))
        i = j
    return runs


def _range_text(layers: Sequence[int]) -> str:
    def text(r: range) -> str:
        return f"{r.start}:{r.stop}" + ("" if r.step == 1 else f":{r.step}")

    return "[" + ",".join(text(r) for r in _runs(layers)) + "]"


def _range_component(parts: Sequence[str]) -> tuple[int, Sequence[int]] | None:
    """Return (index of the range component, the layers it names) of a split name, or None."""
    found = [i for i, p in enumerate(parts) if _RANGE.match(p)]
    if len(found) != 1:
        return None
    i = found[0]
    ranges = []
    for piece in parts[i][1:-1].split(","):
        numbers = [int(x) for x in piece.split(":")]
        step = numbers[2] if len(numbers) == 3 else 1
        ranges.append(range(numbers[0], numbers[1], step) if step > 0 else range(0))
    layers: Sequence[int] = ranges[0] if len(ranges) == 1 else tuple(k for r in ranges for k in r)
    if not layers or any(not r for r in ranges) or any(b <= a for a, b in zip(layers, layers[1:])):
        return None
    return i, layers


def layer_range(name: str) -> Sequence[int] | None:
    """Return the layer numbers a stacked name holds, in slice order (a `range` where they count
    up by one step), or None for a plain name."""
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

    They must split into the same dotted components but one, which counts up from name to name
    in decimal (`0`, `1`, `2`, ... or, every other layer, `1`, `3`, `5`, ...; where the step
    changes, the range is written as several: `[0:3,4:8]` holds layers 0 to 2 and 4 to 7); no
    name may already be stacked.
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
    if any(b <= a for a, b in zip(numbers, numbers[1:])):
        return None
    return ".".join([*split[0][:i], _range_text(numbers), *split[0][i + 1:]])


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
