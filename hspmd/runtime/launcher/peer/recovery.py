"""After ranks were lost: the newest step the peer copies can resume from, and where each piece is.

`plan_recovery(peer_dir, lost)` reads the run's index (`rank-<r>.json`, written by every rank's
`PeerCopies` at the start) and the slots' stamps, and returns the newest step c at which every
tensor is covered by pieces in slots that outlive the loss: a keeper's own slot (a rank that is
left), or, for a lost rank's copied piece, its buddy's copy (if the buddy is left); own slots
are preferred, and pieces may overlap (`cover`). The
result (`Recovery`) is what the restarted ranks read (`restore.load_peer_state`): each region's
host, file, offset and the step c's data position.

When no step has every region (a rank and its buddy were both lost; a host with both keepers of
a region), it returns None with the reason, and the run goes back to its newest disk checkpoint.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

from hspmd.runtime.launcher.peer.slots import SLOTS, read_stamp

__all__ = ["Recovery", "cover", "plan_recovery", "read_recovery", "write_recovery"]


@dataclass
class Recovery:
    """Where the restarted ranks find the state of step `step` (`tensors`: name -> shape, dtype and
    the pieces, each with the host and file it is in); `position`: the stamp's data position and
    sampler state; `sources`: how many pieces come from own slots and from buddies' copies."""

    step: int
    position: dict
    tensors: dict[str, dict] = field(default_factory=dict)
    sources: dict[str, int] = field(default_factory=dict)
    strategy: str = ""

    def to_json(self) -> str:
        """Return the recovery as JSON text."""
        return json.dumps({"format": "hspmd-peer-recovery", "step": self.step, "position": self.position,
                           "strategy": self.strategy, "sources": self.sources, "tensors": self.tensors})


def write_recovery(recovery: Recovery, path: str) -> None:
    """Write `recovery` to `path` (atomically)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".part", "w", encoding="utf-8") as f:
        f.write(recovery.to_json())
    os.replace(path + ".part", path)


def read_recovery(path: str) -> Recovery:
    """Return the recovery written to `path`."""
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    if d.get("format") != "hspmd-peer-recovery":
        raise ValueError(f"{path}: not a peer recovery")
    return Recovery(int(d["step"]), dict(d["position"]), dict(d["tensors"]), dict(d.get("sources", {})),
                    str(d.get("strategy", "")))


def read_index(peer_dir: str) -> dict[int, dict]:
    """Return every rank's index in `peer_dir`, by rank (only those of the run's size)."""
    out = {}
    for path in glob.glob(os.path.join(peer_dir, "rank-*.json")):
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
            out[int(d["rank"])] = d
        except (OSError, ValueError, KeyError, TypeError):
            continue
    sizes = {d["size"] for d in out.values()}
    return out if len(sizes) == 1 and len(out) == sizes.pop() else {}


def _slot_steps(peer_dir: str, name: str) -> dict[int, tuple[int, dict]]:
    """Return step -> (slot, stamp) of the stamped slots `name-0`, `name-1`."""
    out = {}
    for i in range(SLOTS):
        stamp = read_stamp(peer_dir, f"{name}-{i}")
        if stamp is not None and isinstance(stamp.get("step"), int):
            out[stamp["step"]] = (i, stamp)
    return out


def _key(piece: dict) -> tuple[str, tuple]:
    return piece["name"], tuple(tuple(r) for r in piece["region"])


def _cells(shape: list[int], regions: list[tuple]) -> list[tuple]:
    """Return the cells of the grid the regions' bounds cut a tensor of `shape` into (each cell lies
    wholly inside or wholly outside every region)."""
    cuts = [sorted({0, s, *(r[d][0] for r in regions), *(r[d][1] for r in regions)}) for d, s in enumerate(shape)]
    cells: list[tuple] = [()]
    for d in range(len(shape)):
        cells = [c + ((a, b),) for c in cells for a, b in zip(cuts[d], cuts[d][1:]) if a < b]
    return cells


def _inside(cell: tuple, region: tuple) -> bool:
    return all(r0 <= c0 and c1 <= r1 for (c0, c1), (r0, r1) in zip(cell, region))


def cover(shape: list[int], available: list[tuple[tuple, object]]) -> list[tuple[tuple, object]] | None:
    """Return pieces of `available` ((region, source), in order of preference) that together cover a
    tensor of `shape`, each one adding something; None where they do not cover it. Pieces may
    overlap: hetero `dup` layouts hold a tensor whole in one group and sliced in another."""
    cells = _cells(shape, [r for r, _ in available])
    left, chosen = set(cells), []
    for region, source in available:
        inside = {c for c in left if _inside(c, region)}
        if inside:
            chosen.append((region, source))
            left -= inside
    return None if left else chosen


def plan_recovery(peer_dir: str, lost: set[int]) -> tuple[Recovery | None, str]:
    """Return (the recovery at the newest step every tensor survives `lost` at, "") or (None, why not)."""
    index = read_index(peer_dir)
    if not index:
        return None, f"no complete index of peer copies in {peer_dir}"
    own = {r: _slot_steps(peer_dir, f"rank-{r}.own") for r in index if r not in lost}
    copies = {(r, int(w)): _slot_steps(peer_dir, f"rank-{r}.copy-{w}") for r, d in index.items()
              if r not in lost for w in d["copies"] if int(w) in lost}
    tensors: dict[str, dict] = {}  # name -> its shape and dtype
    for d in index.values():
        for p in d["own"]["pieces"]:
            tensors.setdefault(p["name"], {"shape": p["shape"], "dtype": p["dtype"]})
    # the pieces to be had at each step: step -> name -> [(region, (host, file, offset, kind))], own first
    at: dict[int, dict[str, list]] = {}
    for r, steps in own.items():
        d = index[r]
        for step, (slot, _) in steps.items():
            for p in d["own"]["pieces"]:
                at.setdefault(step, {}).setdefault(p["name"], []).append(
                    (_key(p)[1], (d["host"], d["own"]["files"][slot], p["offset"], "own")))
    for (r, w), steps in copies.items():
        d = index[r]
        entry = d["copies"][str(w)]
        for step, (slot, _) in steps.items():
            for p in entry["pieces"]:
                at.setdefault(step, {}).setdefault(p["name"], []).append(
                    (_key(p)[1], (d["host"], entry["files"][slot], p["offset"], "buddy")))
    short = None
    for c in sorted(at, reverse=True):
        chosen = {}
        for name, t in tensors.items():
            pieces = sorted(at[c].get(name, []), key=lambda x: x[1][3] != "own")
            chosen[name] = cover(t["shape"], pieces)
            if chosen[name] is None:
                short = short or name
                break
        else:
            return _recovery(c, tensors, chosen, own, index), ""
    name = short or next(iter(tensors), "?")
    who = sorted(lost)
    return None, (f"no step of the peer copies left holds all of '{name}' (rank{'s' if len(who) > 1 else ''} "
                  f"{', '.join(map(str, who))} and the buddy keeping a copy were lost)")


def _recovery(step: int, tensors: dict, chosen: dict, own: dict, index: dict) -> Recovery:
    out: dict[str, dict] = {}
    counts = {"own": 0, "buddy": 0}
    for name, t in tensors.items():
        pieces = []
        for region, (host, file, offset, kind) in chosen[name]:
            counts[kind] += 1
            pieces.append({"region": [list(r) for r in region], "host": host, "file": file, "offset": offset})
        out[name] = {"shape": t["shape"], "dtype": t["dtype"], "pieces": pieces}
    stamp = next((s for steps in own.values() for c, (_, s) in steps.items() if c == step), {"data_position": step})
    position = {k: v for k, v in stamp.items() if k != "step"}
    strategy = next(iter(index.values())).get("info", {}).get("strategy", "")
    return Recovery(step, position, out, counts, strategy)
