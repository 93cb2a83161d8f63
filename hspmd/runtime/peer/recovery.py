"""After ranks were lost: the newest step the peer copies can resume from, and where each piece is.

`plan_recovery(peer_dir, lost)` reads the run's index (`rank-<r>.json`, written by every rank's
`PeerCopies` at the start) and the slots' stamps, and returns the newest step c at which every
region of every tensor is in a slot that outlives the loss: a keeper's own slot (a rank that is
left), or, for a lost rank's unreplicated piece, its buddy's copy (if the buddy is left). The
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

from hspmd.runtime.peer.slots import SLOTS, read_stamp

__all__ = ["Recovery", "plan_recovery", "read_recovery", "write_recovery"]


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


def plan_recovery(peer_dir: str, lost: set[int]) -> tuple[Recovery | None, str]:
    """Return (the recovery at the newest step every region survives `lost` at, "") or (None, why not)."""
    index = read_index(peer_dir)
    if not index:
        return None, f"no complete index of peer copies in {peer_dir}"
    own = {r: _slot_steps(peer_dir, f"rank-{r}.own") for r in index if r not in lost}
    copies = {(r, int(w)): _slot_steps(peer_dir, f"rank-{r}.copy-{w}") for r, d in index.items()
              if r not in lost for w in d["copies"] if int(w) in lost}
    regions: dict[tuple, dict] = {}  # (name, region) -> the piece
    for d in index.values():
        for p in d["own"]["pieces"]:
            regions.setdefault(_key(p), p)
    # the sources of each region at a step: (step -> [(host, file, offset, kind)])
    sources: dict[tuple, dict[int, list]] = {k: {} for k in regions}
    for r, steps in own.items():
        d = index[r]
        for step, (slot, _) in steps.items():
            for p in d["own"]["pieces"]:
                sources[_key(p)].setdefault(step, []).append((d["host"], d["own"]["files"][slot], p["offset"], "own"))
    for (r, w), steps in copies.items():
        d = index[r]
        entry = d["copies"][str(w)]
        for step, (slot, _) in steps.items():
            for p in entry["pieces"]:
                sources[_key(p)].setdefault(step, []).append((d["host"], entry["files"][slot], p["offset"], "buddy"))
    candidates = sorted({s for per in sources.values() for s in per}, reverse=True)
    for c in candidates:
        if all(c in per for per in sources.values()):
            return _recovery(c, regions, sources, own, index), ""
    missing = [k for k, per in sources.items() if not per]
    if missing:
        name, _ = missing[0]
        holders = sorted(lost)
        return None, (f"no rank left holds a copy of '{name}' (rank{'s' if len(holders) > 1 else ''} "
                      f"{', '.join(map(str, holders))} and the buddy keeping its copy were lost)")
    return None, "the peer copies left hold no step in common"


def _recovery(step: int, regions: dict, sources: dict, own: dict, index: dict) -> Recovery:
    tensors: dict[str, dict] = {}
    counts = {"own": 0, "buddy": 0}
    for key, piece in regions.items():
        host, file, offset, kind = sorted(sources[key][step], key=lambda s: s[3] != "own")[0]
        counts[kind] += 1
        t = tensors.setdefault(piece["name"], {"shape": piece["shape"], "dtype": piece["dtype"], "pieces": []})
        t["pieces"].append({"region": piece["region"], "host": host, "file": file, "offset": offset})
    stamp = next(s for steps in own.values() for c, (_, s) in steps.items() if c == step)
    position = {k: v for k, v in stamp.items() if k != "step"}
    strategy = next(iter(index.values())).get("info", {}).get("strategy", "")
    return Recovery(step, position, tensors, counts, strategy)
