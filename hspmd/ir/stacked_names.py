"""Names of stacked parameters: one tensor holding the same parameter of consecutive layers.

`stack-layers` turns the parameters `blocks.0.attn.proj.weight` ... `blocks.47.attn.proj.weight`
(each [128, 128]) into one parameter `blocks.[0:48].attn.proj.weight` of shape [48, 128, 128]:
the dotted component that numbers the layers becomes the half-open range `[start:stop]`, and
slice i of the tensor is layer `start + i`. The name says which per-layer names it holds, so
checkpoints, `--init-from` files and initial values keep the per-layer names (`layer_names`),
and optimizer state follows (`opt.m.blocks.[0:48].attn.proj.weight`).

    >>> stack_name(["blocks.0.ln1.weight", "blocks.1.ln1.weight"])
    'blocks.[0:2].ln1.weight'
    >>> layer_names("opt.m.blocks.[2:4].ln1.weight")
    ['opt.m.blocks.2.ln1.weight', 'opt.m.blocks.3.ln1.weight']
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_RANGE = re.compile(r"^\[(\d+):(\d+)\]$")


def _range_component(parts: Sequence[str]) -> tuple[int, int, int] | None:
    """Return (index of the range component, start, stop) of a split name, or None."""
    found = [(i, m) for i, p in enumerate(parts) if (m := _RANGE.match(p))]
    if len(found) != 1:
        return None
    i, m = found[0]
    start, stop = int(m.group(1)), int(m.group(2))
    return (i, start, stop) if stop > start else None


def layer_range(name: str) -> tuple[int, int] | None:
    """Return (start, stop) of the layers a stacked name holds, or None for a plain name."""
    found = _range_component(name.split("."))
    return None if found is None else found[1:]


def is_stacked(name: str) -> bool:
    """Return whether `name` names a stacked parameter (or its optimizer state)."""
    return layer_range(name) is not None


def layer_names(name: str) -> list[str]:
    """Return the per-layer names a stacked name holds, in slice order ([name] for a plain name)."""
    parts = name.split(".")
    found = _range_component(parts)
    if found is None:
        return [name]
    i, start, stop = found
    return [".".join([*parts[:i], str(k), *parts[i + 1:]]) for k in range(start, stop)]


def stack_name(names: Sequence[str]) -> str | None:
    """Return the stacked name of per-layer `names` (at least two), or None if they do not form one.

    They must split into the same dotted components but one, which counts up by one from name
    to name in decimal (`0`, `1`, `2`, ...); no name may already be stacked.
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
    start = int(values[0])
    if [int(v) for v in values] != list(range(start, start + len(values))):
        return None
    return ".".join([*split[0][:i], f"[{start}:{start + len(values)}]", *split[0][i + 1:]])


def sub_range(name: str, start: int, stop: int) -> str:
    """Return the name of layers [start, stop) (absolute layer numbers) of stacked `name`."""
    parts = name.split(".")
    found = _range_component(parts)
    if found is None:
        raise ValueError(f"'{name}' is not a stacked name")
    i, lo, hi = found
    if not lo <= start < stop <= hi:
        raise ValueError(f"layers [{start}:{stop}] are not within '{name}'")
    return ".".join([*parts[:i], f"[{start}:{stop}]", *parts[i + 1:]])
