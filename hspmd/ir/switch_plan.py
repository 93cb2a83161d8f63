"""Which rank sends which piece of which tensor when a run switches from one strategy to another.

A strategy gives every rank a region (per dim `(start, stop)`) of each tensor it holds
(`Layout.slices`, the same fact checkpoints use to read a piece back under another strategy).
`plan_switch(before, after, tensors)` says, for every rank and every tensor it holds *after*,
where each part of its new region comes from: its own old piece where the two overlap (a
local copy), else one rank holding that part before. A rank receives only the elements it
lacks, so the plan's bytes moved equal the minimum the two layouts allow; the transfers between
one pair of ranks travel as one message.

    >>> before = {0: {"w": ((0, 4),)}, 1: {"w": ((4, 8),)}}       # tp: halves
    >>> after = {0: {"w": ((0, 8),)}, 1: {"w": ((0, 8),)}}        # dp: whole on each
    >>> plan = plan_switch(before, after, {"w": ((8,), 4)})
    >>> plan.bytes_moved(), plan.messages()
    (32, 2)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Region", "SwitchError", "SwitchPlan", "Transfer", "box_subtract", "overlap", "plan_switch"]

#: a box of a global tensor: per dim (start, stop)
Region = tuple[tuple[int, int], ...]


class SwitchError(ValueError):
    """Two strategies cannot be switched between (a tensor one of them needs, nobody holds)."""


@dataclass(frozen=True)
class Transfer:
    """`src` gives `dst` the global `region` of tensor `name` (a local copy when src == dst)."""

    name: str
    src: int
    dst: int
    region: Region

    def elements(self) -> int:
        """Return the number of elements of the region."""
        n = 1
        for a, b in self.region:
            n *= b - a
        return n


def overlap(a: Region, b: Region) -> Region | None:
    """Return the intersection of boxes `a` and `b` (None when empty; `()` for scalars)."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(x0 < x1 for x0, x1 in out) else None


def box_subtract(a: Region, b: Region) -> list[Region]:
    """Return disjoint boxes covering `a` minus `b`.

    >>> box_subtract(((0, 4), (0, 4)), ((1, 3), (0, 4)))
    [((0, 1), (0, 4)), ((3, 4), (0, 4))]
    """
    inter = overlap(a, b)
    if inter is None:
        return [a]
    out: list[Region] = []
    rest = list(a)
    for d, ((a0, a1), (i0, i1)) in enumerate(zip(a, inter)):
        if a0 < i0:
            out.append(tuple(rest[:d]) + ((a0, i0),) + tuple(rest[d + 1:]))
        if i1 < a1:
            out.append(tuple(rest[:d]) + ((i1, a1),) + tuple(rest[d + 1:]))
        rest[d] = (i0, i1)  # later dims' pieces lie inside the intersection along this one
    return out


@dataclass(frozen=True)
class SwitchPlan:
    """Every transfer of one switch, in (dst, name) order; the same list on every rank."""

    transfers: tuple[Transfer, ...]
    itemsize: tuple[tuple[str, int], ...]  # bytes per element of each tensor

    def bytes_moved(self) -> int:
        """Return the bytes that cross between ranks (local copies not counted)."""
        size = dict(self.itemsize)
        return sum(t.elements() * size[t.name] for t in self.transfers if t.src != t.dst)

    def messages(self) -> int:
        """Return the number of messages: one per (src, dst) pair with anything to move."""
        return len({(t.src, t.dst) for t in self.transfers if t.src != t.dst})

    def sends(self, rank: int) -> dict[int, list[Transfer]]:
        """Return `rank`'s outgoing transfers by destination (in plan order)."""
        out: dict[int, list[Transfer]] = {}
        for t in self.transfers:
            if t.src == rank and t.dst != rank:
                out.setdefault(t.dst, []).append(t)
        return out

    def receives(self, rank: int) -> dict[int, list[Transfer]]:
        """Return `rank`'s incoming transfers by source (in plan order), local copies under `rank` itself."""
        out: dict[int, list[Transfer]] = {}
        for t in self.transfers:
            if t.dst == rank:
                out.setdefault(t.src, []).append(t)
        return out


def plan_switch(before: Mapping[int, Mapping[str, Region]], after: Mapping[int, Mapping[str, Region]],
                tensors: Mapping[str, tuple[tuple[int, ...], int]]) -> SwitchPlan:
    """Return the transfers that give every rank its `after` regions from the `before` ones.

    `before[r][name]` / `after[r][name]`: the region rank r holds of tensor `name` under each
    strategy (absent: it holds none); `tensors[name]`: (global shape, bytes per element). What
    a rank already holds is copied locally; each other part comes from one holder, chosen by
    turns (the first holder at or after the receiving rank), so replicas share the sending.
    """
    holders: dict[str, list[tuple[int, Region]]] = {}
    for r in sorted(before):
        for name, reg in before[r].items():
            holders.setdefault(name, []).append((r, reg))
    ranks = sorted(set(before) | set(after))
    transfers: list[Transfer] = []
    for dst in sorted(after):
        for name in sorted(after[dst]):
            need = after[dst][name]
            have = before.get(dst, {}).get(name)
            boxes = [need]
            if have is not None:
                mine = overlap(need, have)
                if mine is not None:
                    transfers.append(Transfer(name, dst, dst, mine))
                    boxes = box_subtract(need, have)
            turn = sorted(holders.get(name, []), key=lambda h: (ranks.index(h[0]) - ranks.index(dst)) % len(ranks))
            for src, reg in turn:
                if not boxes:
                    break
                left: list[Region] = []
                for box in boxes:
                    part = overlap(box, reg)
                    if part is None:
                        left.append(box)
                        continue
                    transfers.append(Transfer(name, src, dst, part))
                    left += box_subtract(box, part)
                boxes = left
            if boxes:
                shape = tensors[name][0] if name in tensors else "?"
                raise SwitchError(f"tensor '{name}' {list(shape)}: rank {dst} needs region {list(boxes[0])}, "
                                  f"which no rank holds under the strategy switched from")
    return SwitchPlan(tuple(transfers), tuple(sorted((n, s) for n, (_, s) in tensors.items())))
