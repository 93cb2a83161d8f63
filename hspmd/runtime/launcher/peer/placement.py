"""Which rank keeps which piece of the training state, and whose buddy each rank is.

A piece is a rank's local array of one tensor (a parameter or an optimizer state, per layer): its
global region, `Layout.slices`. Every distinct region of a tensor is held by one or more ranks
(its *holders*: dp replicas hold the same region, zero, tp, pp and ep shards are held once). For
a run to survive the loss of any one rank with nothing read from disk, every region must outlive
any one rank:

* a region with two or more holders is kept by two of them (`keepers`), in their own hosts'
  memory, on two hosts where its holders are on several; no copy crosses the network, since
  another rank already holds it;
* a region with one holder, or whose holders are all on one host of several, is kept by one of
  them and *copied* to its buddy, a rank on another host where there is one (`buddies`: a ring
  over the hosts, then over the ranks of a host).

So the loss of a whole host loses no region either (while another host is left). Everything here is pure: every rank computes the same answer from
the layouts and the ranks' host names.

    >>> buddies(["a", "a", "b", "b"])
    [2, 3, 0, 1]
    >>> buddies(["a", "a", "a"])
    [1, 2, 0]
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from hspmd.codegen.schedule.model import Leaf

__all__ = ["KeptPiece", "buddies", "holders", "keepers", "kept_pieces", "needs_copy", "wards"]

Region = tuple[tuple[int, int], ...]


def buddies(hosts: Sequence[str]) -> list[int]:
    """Return, for each rank, the rank that keeps a copy of its unreplicated pieces: the rank at the
    same position on the next host (cyclically, over the hosts in the order they first appear);
    with one host, the next rank. A run of one rank has no buddy (`[0]`: itself)."""
    order: list[str] = []
    ranks: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        if h not in ranks:
            order.append(h)
            ranks[h] = []
        ranks[h].append(r)
    if len(order) == 1:
        n = len(hosts)
        return [(r + 1) % n for r in range(n)]
    out = [0] * len(hosts)
    for j, h in enumerate(order):
        nxt = ranks[order[(j + 1) % len(order)]]
        for i, r in enumerate(ranks[h]):
            out[r] = nxt[i % len(nxt)]
    return out


def wards(buddy: Sequence[int], rank: int) -> list[int]:
    """Return the ranks whose buddy is `rank` (whose copies it keeps), in rank order."""
    return [r for r, b in enumerate(buddy) if b == rank and r != rank]


def region_of(leaf: Leaf, device: int) -> Region:
    """Return the global region `device` holds of `leaf`."""
    return tuple((s.start, s.stop) for s in leaf.layout.slices(device, leaf.global_shape))


def holders(leaf: Leaf) -> dict[Region, tuple[int, ...]]:
    """Return each distinct region of `leaf` with the devices holding it, in device order."""
    out: dict[Region, list[int]] = {}
    for d in sorted(set(leaf.layout.devices)):
        out.setdefault(region_of(leaf, d), []).append(d)
    return {region: tuple(ds) for region, ds in out.items()}


def needs_copy(devices: Sequence[int], hosts: Sequence[str]) -> bool:
    """Return whether a region held by `devices` goes to a buddy: no other rank holds it, or all
    its holders are on one host while the run has others (a host lost would take it along)."""
    on = {hosts[d] for d in devices}
    return len(devices) == 1 or (len(on) == 1 and len(set(hosts)) > 1)


def keepers(name: str, devices: Sequence[int], hosts: Sequence[str]) -> tuple[int, ...]:
    """Return the holders of a region that keep it: one where it goes to a buddy (`needs_copy`),
    else two (the first by a hash of the tensor's `name`, so that replicas share the keeping; the
    second the next holder on another host)."""
    start = zlib.crc32(name.encode()) % len(devices)
    first = devices[start]
    if needs_copy(devices, hosts):
        return (first,)
    after = [devices[(start + k) % len(devices)] for k in range(1, len(devices))]
    elsewhere = [d for d in after if hosts[d] != hosts[first]]
    return (first, (elsewhere or after)[0])


@dataclass(frozen=True)
class KeptPiece:
    """A piece a rank keeps: tensor `name`'s `region` (its local array, of `shape` and `dtype`),
    `copied` to the rank's buddy when no other rank holds it."""

    name: str
    region: Region
    global_shape: tuple[int, ...]
    dtype: str
    copied: bool

    @property
    def shape(self) -> tuple[int, ...]:
        """Return the shape of the piece."""
        return tuple(b - a for a, b in self.region)

    def to_json(self) -> dict:
        """Return the piece as JSON data."""
        return {"name": self.name, "region": [list(r) for r in self.region], "shape": list(self.global_shape),
                "dtype": self.dtype, "copied": self.copied}

    @staticmethod
    def from_json(d: dict) -> KeptPiece:
        """Return the piece `to_json` gave."""
        return KeptPiece(str(d["name"]), tuple((int(a), int(b)) for a, b in d["region"]),
                         tuple(int(s) for s in d["shape"]), str(d["dtype"]), bool(d["copied"]))


def kept_pieces(leaves: Iterable[Leaf], rank: int, hosts: Sequence[str]) -> list[KeptPiece]:
    """Return the pieces `rank` keeps of `leaves` (per layer, as checkpoints name them), the
    copied ones (held by `rank` alone) first. A partial layout (a sum not yet taken) is never a
    parameter's or an optimizer state's and has no piece."""
    copied, kept = [], []
    for leaf in leaves:
        if leaf.layout.hetero.kind == "partial" or any(g.states.is_partial for g in leaf.layout.groups):
            continue
        mine = region_of(leaf, rank)
        devices = holders(leaf)[mine]
        if rank not in keepers(leaf.name, devices, hosts):
            continue
        piece = KeptPiece(leaf.name, mine, tuple(leaf.global_shape), leaf.dtype, needs_copy(devices, hosts))
        (copied if piece.copied else kept).append(piece)
    return copied + kept
