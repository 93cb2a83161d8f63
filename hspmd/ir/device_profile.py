"""How fast each rank computes and communicates: measured (`hspmd profile`) or synthetic.

A `DeviceProfile` is plain, frozen data about N ranks, in seconds and bytes:

* per rank, compute rates: a small **matmul table** (`MatmulPoint`: the FLOPs of one
  float32 matmul and the GFLOP/s measured for it), read by `matmul_seconds(rank, flops)`
  which interpolates the rate linearly in log(FLOPs) between the measured points and holds
  it constant outside them; an **elementwise** rate (bytes read + written per second by a
  NumPy ufunc chain) and a **fused** rate (bytes per second of a fused C++ kernel; falls back
  to the elementwise rate when not measured);
* per ordered rank pair, a **point-to-point link** (`Link`: latency seconds, bandwidth bytes
  per second), `link(a, b)` falling back to the profile's `default_link`;
* per collective kind (`COLLECTIVES`) and measured group, an alpha-beta fit
  (`CollectiveFit`): ``time = latency + nbytes / bandwidth`` for a rank's local buffer of
  ``nbytes`` bytes;
* optionally a **topology** (`Topology`): ranks in nodes and nodes in pods, links inside a node
  and between nodes, and NCCL's collective algorithms as formulas over a group's shape (ranks
  per node times nodes). A profile of thousands of ranks describes its links and collectives
  this way, not pair by pair and group by group, and its ranks as classes of alike ranks.

`time(kind, group, nbytes)` is the model a planner reads: a fit measured over exactly that
group if there is one; else the topology's formula; else the kind's fit over a measured group
of the same size, slowed to the group's slowest link; else the usual ring algorithms over the
slowest link of the group (`ring_seconds`). Everything is deterministic and pure: no I/O except
`save`/`load`.

The JSON form (`to_json` / `from_json`, `save` / `load`) carries `"format":
"hspmd-device-profile"` and `"version": 1`; a file that is not one, or is malformed, raises
`ProfileError` with one line saying what is wrong. A profile with a topology writes its ranks
as classes (`"rank_classes": [{"ranks": "0-10927", ...}]`, the ranks as a device range) and
no links or fits; it reads ranks listed one by one too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from hspmd.ir.devices import DeviceRange, DeviceSetError, parse_devices

__all__ = [
    "COLLECTIVES", "DEFAULT_CPU", "FORMAT", "VERSION", "CollectiveFit", "DeviceProfile", "Link", "MatmulPoint", "ProfileError",
    "RankRates", "Topology", "ring_seconds",
]

FORMAT = "hspmd-device-profile"
VERSION = 1

#: collective kinds a profile may describe (the `comm` dialect's names without the prefix)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


#: the rates of `DeviceProfile.default_cpu` (the arguments of `DeviceProfile.uniform`)
DEFAULT_CPU = {"gflops": 40.0, "elementwise_gbps": 10.0, "latency_s": 10e-6, "bandwidth_gbps": 5.0,
               "bucket_overlap": 0.0}


class ProfileError(ValueError):
    """A device profile is malformed, or asked about ranks or kinds it does not have."""


@dataclass(frozen=True)
class MatmulPoint:
    """One measured matmul: `flops` (2 m k n) at `gflops` GFLOP/s; `shape` is (m, k, n), or
    (p, m, k, n) for a stack of p such products (`flops` is then one product's), informative."""

    flops: float
    gflops: float
    shape: tuple[int, ...] = (0, 0, 0)


@dataclass(frozen=True)
class RankRates:
    """The compute rates of one rank.

    `matmul`: measured points, sorted by FLOPs (at least one). `elementwise_bps`: bytes moved
    (read + written) per second by NumPy elementwise ops; `fused_bps`: the same for fused C++
    kernels (None: not measured, the elementwise rate is used).
    """

    matmul: tuple[MatmulPoint, ...]
    elementwise_bps: float
    fused_bps: float | None = None

    def matmul_gflops(self, flops: float) -> float:
        """Return the GFLOP/s of a matmul of `flops` FLOPs: interpolated in log(FLOPs), clamped at the ends."""
        pts = self.matmul
        if flops <= pts[0].flops or len(pts) == 1:
            return pts[0].gflops
        if flops >= pts[-1].flops:
            return pts[-1].gflops
        for lo, hi in zip(pts, pts[1:]):
            if lo.flops <= flops <= hi.flops:
                if hi.flops == lo.flops:
                    return hi.gflops
                t = (math.log(flops) - math.log(lo.flops)) / (math.log(hi.flops) - math.log(lo.flops))
                return lo.gflops + t * (hi.gflops - lo.gflops)
        return pts[-1].gflops  # not reached: the points are sorted

    def scaled(self, factor: float) -> RankRates:
        """Return these rates multiplied by `factor` (0.5: a rank twice as slow)."""
        return RankRates(
            tuple(replace(p, gflops=p.gflops * factor) for p in self.matmul),
            self.elementwise_bps * factor,
            None if self.fused_bps is None else self.fused_bps * factor,
        )


@dataclass(frozen=True)
class Link:
    """A point-to-point link: a message of n bytes takes `latency_s + n / bandwidth_bps` seconds."""

    latency_s: float
    bandwidth_bps: float

    def seconds(self, nbytes: float) -> float:
        """Return the time of one message of `nbytes` bytes."""
        return self.latency_s + nbytes / self.bandwidth_bps


@dataclass(frozen=True)
class CollectiveFit:
    """An alpha-beta fit of one collective over one group: `latency_s + nbytes / bandwidth_bps`.

    `nbytes` is the local buffer of one rank (the operand; for all_gather the result), so
    `bandwidth_bps` is an *algorithm* bandwidth, the ring's (n-1)/n factors folded in.
    """

    kind: str
    group: tuple[int, ...]
    latency_s: float
    bandwidth_bps: float
    #: measured (nbytes, seconds) at several sizes, by size; empty: the alpha-beta line alone
    points: tuple[tuple[float, float], ...] = ()
    #: seconds more a call costs when the members computed `resync_after_s` seconds since their
    #: last collective together (the wait for a member the compute left behind: descheduled, or
    #: slower); 0: not measured
    resync_s: float = 0.0
    resync_after_s: float = 0.0

    def seconds(self, nbytes: float) -> float:
        """Return the time for a local buffer of `nbytes` bytes: with `points`, linear between the
        two measured sizes around it (a collective's algorithm changes with the size, so one line
        through all sizes misses the middle), the smallest size's time below them and the last
        segment's slope above; else the alpha-beta line."""
        pts = self.points
        if not pts:
            return self.latency_s + nbytes / self.bandwidth_bps
        if nbytes <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if nbytes <= x1:
                return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return y1 + max(y1 - y0, 0.0) / (x1 - x0) * (nbytes - x1)

    @staticmethod
    def from_points(kind: str, group: tuple[int, ...], points: Sequence[tuple[float, float]]) -> CollectiveFit:
        """Return the fit of measured (nbytes, seconds) `points`: the alpha-beta line through the
        smallest and the largest (for summaries and old readers), and the points themselves."""
        pts = tuple(sorted((float(b), float(t)) for b, t in points))
        (b0, t0), (b1, t1) = pts[0], pts[-1]
        slope = max((t1 - t0) / (b1 - b0), 1e-15) if b1 > b0 else 1e-15
        return CollectiveFit(kind, tuple(group), max(t0 - slope * b0, 0.0), 1.0 / slope, pts)


def ring_seconds(kind: str, n: int, nbytes: float, link: Link) -> float:
    """Return the time of collective `kind` over `n` ranks by the ring algorithms over `link`.

    all_reduce: 2(n-1) steps of nbytes/n; all_gather (nbytes: the result), reduce_scatter and
    all_to_all: n-1 steps of nbytes/n; broadcast: a pipelined ring, about (n-1) latencies
    plus nbytes once. One rank (n <= 1) takes no time.
    """
    if kind not in COLLECTIVES:
        raise ProfileError(f"unknown collective kind '{kind}' (known: {', '.join(COLLECTIVES)})")
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) * link.seconds(nbytes / n)
    if kind == "broadcast":
        return (n - 1) * link.latency_s + nbytes / link.bandwidth_bps
    return (n - 1) * link.seconds(nbytes / n)


@dataclass(frozen=True)
class Topology:
    """Ranks in nodes and nodes in pods, and NCCL's collectives over them as formulas.

    Rank r is on node `r // per_node`; node k in pod `k // pod_nodes` (0: one pod). Inside a
    node the ranks share a switch (NVLink through NVSwitch): a ring moves `intra_bps` per rank
    (NCCL's bus bandwidth) at `intra_step_s` a step. Between nodes each rank has its own NIC of
    `nic_bps` on a rail-optimised fabric (rank i of every node on rail i, non-blocking): NCCL
    runs a ring per NIC, so a group with g ranks on each of its nodes moves min(intra, g x nic)
    at `inter_step_s` a step, `pod_step_s` more where it crosses pods. All-reduce takes the
    fastest of the ring, the double binary tree (`tree_eff` of the ring's bandwidth, logarithmic
    latency) and the hierarchical form (reduce-scatter in the node, all-reduce of 1/g between
    nodes, all-gather in the node), as NCCL's tuner picks by size.

    >>> t = Topology(8, 32, 5e-6, 1e-6, 4e-6, 2e-6, 360e9, 40e9, Link(6e-6, 360e9), Link(10e-6, 40e9))
    >>> t.shape(tuple(range(0, 64, 8)))   # one rank on each of 8 nodes, one pod
    (8, 8, 1, 1)
    >>> round(t.seconds("all_reduce", tuple(range(8)), 2**24)[0] * 1e6)   # 16 MiB in one node, us
    101
    """

    per_node: int
    pod_nodes: int
    start_s: float
    intra_step_s: float
    inter_step_s: float
    pod_step_s: float
    intra_bps: float
    nic_bps: float
    intra_link: Link
    inter_link: Link
    tree_eff: float = 0.8
    #: `shape` of each group asked about, by the group's range (a group's shape is found once)
    _shapes: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def pod_of(self, rank: int) -> int:
        return self.node_of(rank) // self.pod_nodes if self.pod_nodes else 0

    def shape(self, group: Sequence[int]) -> tuple[int, int, int, int]:
        """Return (ranks, nodes, fewest ranks on one of its nodes, pods) of `group` (once per range)."""
        if isinstance(group, DeviceRange):
            key = (group.start, group.shape, group.strides, group.ids)
            found = self._shapes.get(key)
            if found is None:
                found = self._shapes[key] = self._shape(group)
            return found
        return self._shape(group)

    def _shape(self, group: Sequence[int]) -> tuple[int, int, int, int]:
        per: dict[int, int] = {}
        pods = set()
        for r in set(group):
            per[self.node_of(r)] = per.get(self.node_of(r), 0) + 1
            pods.add(self.pod_of(r))
        return sum(per.values()), len(per), min(per.values(), default=0), len(pods)

    def link(self, a: int, b: int) -> Link:
        """Return the point-to-point link from a to b: inside a node or across nodes."""
        if self.node_of(a) == self.node_of(b):
            return self.intra_link
        if self.pod_of(a) == self.pod_of(b):
            return self.inter_link
        return Link(self.inter_link.latency_s + self.pod_step_s, self.inter_link.bandwidth_bps)

    def seconds(self, kind: str, group: Sequence[int], nbytes: float) -> tuple[float, str]:
        """Return (seconds, algorithm) of collective `kind` over `group` for a rank's buffer of
        `nbytes` (all_gather: the result), the fastest of NCCL's algorithms (class docstring)."""
        return self.seconds_of(kind, self.shape(group), nbytes)

    def seconds_of(self, kind: str, shape: tuple[int, int, int, int], nbytes: float) -> tuple[float, str]:
        """Return `seconds` for a group of `shape` (`Topology.shape`)."""
        n, nodes, g, pods = shape
        if n <= 1:
            return 0.0, "none"
        intra = nodes == 1
        busbw = self.intra_bps if intra else min(self.intra_bps, g * self.nic_bps)
        step = self.intra_step_s if intra else self.inter_step_s + (self.pod_step_s if pods > 1 else 0.0)
        if kind == "all_reduce":
            options = [(self.start_s + 2 * (n - 1) * step + 2 * (n - 1) / n * nbytes / busbw, "ring")]
            if not intra:
                depth = math.ceil(math.log2(nodes))
                tree = (self.start_s + 2 * ((g - 1) * self.intra_step_s + depth * step)
                        + 2 * nbytes / (self.tree_eff * busbw))
                options.append((tree, "tree"))
                if g > 1:  # reduce-scatter in the node, all-reduce of 1/g between nodes, all-gather in the node
                    inside = self.start_s + (g - 1) * self.intra_step_s + (g - 1) / g * nbytes / self.intra_bps
                    between = self.start_s + 2 * (nodes - 1) * step + 2 * (nodes - 1) / nodes * (nbytes / g) / self.nic_bps
                    options.append((2 * inside + between, "hierarchical"))
            return min(options)
        if kind in ("all_gather", "reduce_scatter"):
            return self.start_s + (n - 1) * step + (n - 1) / n * nbytes / busbw, "ring"
        if kind == "broadcast":
            return self.start_s + (n - 1) * step + nbytes / busbw, "ring"
        if kind == "all_to_all":
            near = (g - 1) / n * nbytes / self.intra_bps
            far = 0.0 if intra else (n - g) / n * nbytes / self.nic_bps
            return self.start_s + (n - 1) * step + max(near, far), "pairwise"
        raise ProfileError(f"unknown collective kind '{kind}' (known: {', '.join(COLLECTIVES)})")

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in ("per_node", "pod_nodes", "start_s", "intra_step_s", "inter_step_s",
                                            "pod_step_s", "intra_bps", "nic_bps", "tree_eff")}
        for k in ("intra_link", "inter_link"):
            out[k] = {"latency_s": getattr(self, k).latency_s, "bandwidth_bps": getattr(self, k).bandwidth_bps}
        return out

    @staticmethod
    def from_json(d: dict) -> Topology:
        links = {k: Link(float(d[k]["latency_s"]), float(d[k]["bandwidth_bps"])) for k in ("intra_link", "inter_link")}
        return Topology(int(d["per_node"]), int(d.get("pod_nodes", 0)), float(d["start_s"]), float(d["intra_step_s"]),
                        float(d["inter_step_s"]), float(d.get("pod_step_s", 0.0)), float(d["intra_bps"]),
                        float(d["nic_bps"]), links["intra_link"], links["inter_link"], float(d.get("tree_eff", 0.8)))


@dataclass(frozen=True)
class DeviceProfile:
    """Compute and communication rates of `num_ranks` ranks (module docstring).

    `ranks[r]` are rank r's compute rates; `links` maps an ordered pair (a, b) to its measured
    link, `default_link` is used for pairs not measured; `collectives` holds the measured
    alpha-beta fits. `source` says where the numbers came from ("measured ...",
    "synthetic ..."); `meta` is free-form (host, date, parameters of the measurement).
    Profiles compare by value; they are not hashable (`links` and `meta` are dicts).
    """

    ranks: tuple[RankRates, ...]
    default_link: Link
    links: Mapping[tuple[int, int], Link] = field(default_factory=dict)
    collectives: tuple[CollectiveFit, ...] = ()
    source: str = "synthetic"
    meta: Mapping[str, object] = field(default_factory=dict)
    #: the part (0..1) of a gradient bucket's all-reduce that hides behind the backward's compute
    #: (1: a transfer engine of its own, as NCCL on its stream; on CPU ranks the cores that move
    #: the bytes are the ones computing, so less: `hspmd profile` measures it)
    bucket_overlap: float = 1.0
    #: nodes, pods and the collectives over them (None: links pair by pair, fits group by group)
    topology: Topology | None = None

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ProfileError("a device profile needs at least one rank")
        # alike ranks share one RankRates: checked and sorted once per class, and kept shared
        # (the planner prices classes of ranks, not ranks)
        sorted_rates: dict[int, RankRates] = {}
        for r, rates in enumerate(self.ranks):
            if id(rates) in sorted_rates:
                continue
            if not rates.matmul:
                raise ProfileError(f"rank {r} has no matmul rate")
            if any(p.gflops <= 0 or p.flops <= 0 for p in rates.matmul) or rates.elementwise_bps <= 0 or (
                    rates.fused_bps is not None and rates.fused_bps <= 0):
                raise ProfileError(f"rank {r} has a rate that is not positive")
            # the matmul table sorted by FLOPs, for the interpolation
            sorted_rates[id(rates)] = replace(rates, matmul=tuple(sorted(rates.matmul, key=lambda p: p.flops)))
        object.__setattr__(self, "ranks", tuple(sorted_rates[id(x)] for x in self.ranks))
        n = len(self.ranks)
        for link in (self.default_link, *self.links.values()):
            if link.latency_s < 0 or link.bandwidth_bps <= 0:
                raise ProfileError("a link has a negative latency or a bandwidth that is not positive")
        for a, b in self.links:
            if not (0 <= a < n and 0 <= b < n):
                raise ProfileError(f"link ({a}, {b}) names a rank outside 0..{n - 1}")
        for fit in self.collectives:
            if fit.kind not in COLLECTIVES:
                raise ProfileError(f"unknown collective kind '{fit.kind}' (known: {', '.join(COLLECTIVES)})")
            if any(not 0 <= r < n for r in fit.group):
                raise ProfileError(f"{fit.kind} group {list(fit.group)} names a rank outside 0..{n - 1}")
            if fit.latency_s < 0 or fit.bandwidth_bps <= 0:
                raise ProfileError(f"{fit.kind} over {list(fit.group)}: negative latency or bandwidth not positive")
            if fit.resync_s < 0 or fit.resync_after_s < 0:
                raise ProfileError(f"{fit.kind} over {list(fit.group)}: negative resync_s or resync_after_s")
            if any(b <= 0 or t < 0 for b, t in fit.points) or len({b for b, _ in fit.points}) != len(fit.points):
                raise ProfileError(f"{fit.kind} over {list(fit.group)}: its points need distinct positive sizes "
                                   "and times that are not negative")
        if not 0.0 <= self.bucket_overlap <= 1.0:
            raise ProfileError(f"bucket_overlap {self.bucket_overlap!r} is not between 0 and 1")
        object.__setattr__(self, "links", dict(self.links))
        object.__setattr__(self, "meta", dict(self.meta))

    # -- construction -------------------------------------------------------------------------

    @staticmethod
    def uniform(n: int, gflops: float = 50.0, elementwise_gbps: float = 5.0, fused_gbps: float | None = None,
                latency_s: float = 20e-6, bandwidth_gbps: float = 5.0,
                speed: Sequence[float] | None = None, bucket_overlap: float = 1.0) -> DeviceProfile:
        """Return a synthetic profile of `n` alike ranks, optionally of unequal speed.

        `gflops`: the matmul rate at every size; `elementwise_gbps` / `fused_gbps`: GB/s (1e9
        bytes) moved by elementwise / fused kernels; every link has `latency_s` and
        `bandwidth_gbps`; collectives follow the ring model. `speed[r]` multiplies rank r's
        compute rates (default all 1.0: `speed=[0.5, 1]` makes rank 0 twice as slow);
        `bucket_overlap` the part of a gradient bucket's transfer that hides behind compute.
        """
        if n < 1:
            raise ProfileError(f"a device profile needs at least one rank, got {n}")
        factors = [1.0] * n if speed is None else [float(s) for s in speed]
        if len(factors) != n:
            raise ProfileError(f"speed has {len(factors)} factors for {n} ranks")
        if any(f <= 0 for f in factors):
            raise ProfileError("speed factors must be positive")
        base = RankRates((MatmulPoint(1.0, gflops),), elementwise_gbps * 1e9,
                         None if fused_gbps is None else fused_gbps * 1e9)
        return DeviceProfile(
            tuple(base.scaled(f) for f in factors), Link(latency_s, bandwidth_gbps * 1e9),
            bucket_overlap=bucket_overlap,
            source=f"synthetic: {n} ranks, {gflops:g} GFLOP/s, {elementwise_gbps:g} GB/s elementwise, "
                   f"links {latency_s * 1e6:g} us + {bandwidth_gbps:g} GB/s",
        )

    @staticmethod
    def default_cpu(n: int) -> DeviceProfile:
        """Return the synthetic profile used when none is given (`hspmd compile --cost` without
        `--profile`): `n` alike CPU ranks of one core each, with the rates of `DEFAULT_CPU`
        (about what one core of a 2-core x86 cloud machine with other load measured: 40
        GFLOP/s float32 matmuls, 10 GB/s elementwise, shared-memory MPI messages at 10 us and
        5 GB/s)."""
        return replace(DeviceProfile.uniform(n, **DEFAULT_CPU),
                       source=f"synthetic default CPU profile of {n} ranks (no --profile given; "
                              f"measure one with hspmd profile)")

    def with_speed(self, speed: Sequence[float]) -> DeviceProfile:
        """Return this profile with rank r's compute rates multiplied by `speed[r]` (alike ranks
        at one speed stay one class)."""
        if len(speed) != self.num_ranks or any(s <= 0 for s in speed):
            raise ProfileError(f"speed needs {self.num_ranks} positive factors, got {list(speed)[:8]}")
        scaled: dict[tuple[int, float], RankRates] = {}
        return replace(self, ranks=tuple(scaled.setdefault((id(r), float(s)), r.scaled(float(s)))
                                         for r, s in zip(self.ranks, speed)))

    def classes(self) -> list[tuple[RankRates, DeviceRange]]:
        """Return the classes of alike ranks: (their rates, the ranks), in order of first rank."""
        members: dict[int, list[int]] = {}
        rates: dict[int, RankRates] = {}
        for r, x in enumerate(self.ranks):
            members.setdefault(id(x), []).append(r)
            rates[id(x)] = x
        return [(rates[k], DeviceRange.of(v)) for k, v in members.items()]

    def with_link(self, a: int, b: int, link: Link, both_ways: bool = True) -> DeviceProfile:
        """Return this profile with the link a -> b (and b -> a) replaced; collective fits over
        groups holding both are dropped (they no longer describe the links)."""
        links = dict(self.links)
        links[(a, b)] = link
        if both_ways:
            links[(b, a)] = link
        fits = tuple(f for f in self.collectives if not (a in f.group and b in f.group))
        return replace(self, links=links, collectives=fits)

    def restricted(self, n: int) -> DeviceProfile:
        """Return the profile of ranks 0..n-1 only (for a program on fewer ranks than profiled)."""
        if not 1 <= n <= self.num_ranks:
            raise ProfileError(f"the profile has {self.num_ranks} ranks; cannot take {n}")
        return replace(
            self, ranks=self.ranks[:n], links={k: v for k, v in self.links.items() if max(k) < n},
            collectives=tuple(f for f in self.collectives if max(f.group) < n))

    @staticmethod
    def load_for(path: str, n: int) -> DeviceProfile:
        """Return the profile in `path` for a program on ranks 0..n-1: its first n ranks
        (ProfileError, saying what to measure, when it has fewer)."""
        profile = DeviceProfile.load(path)
        if profile.num_ranks < n:
            raise ProfileError(f"{path}: the profile describes {profile.num_ranks} ranks, the program runs on {n}; "
                               f"measure these devices: hspmd profile -n {n} -o {path}")
        return profile.restricted(n)

    # -- queries ------------------------------------------------------------------------------

    @property
    def num_ranks(self) -> int:
        """Return the number of ranks described."""
        return len(self.ranks)

    def rates(self, rank: int) -> RankRates:
        """Return rank `rank`'s compute rates (ProfileError if the profile has no such rank)."""
        if not 0 <= rank < self.num_ranks:
            raise ProfileError(f"the profile describes ranks 0..{self.num_ranks - 1}, not rank {rank}")
        return self.ranks[rank]

    def matmul_seconds(self, rank: int, flops: float, product_flops: float | None = None) -> float:
        """Return the time of float32 matmuls of `flops` FLOPs in all on `rank`: one product, or
        a stack of products of `product_flops` FLOPs each, run at the rate of one of them."""
        if flops <= 0:
            return 0.0
        return flops / (self.rates(rank).matmul_gflops(product_flops or flops) * 1e9)

    def elementwise_seconds(self, rank: int, nbytes: float) -> float:
        """Return the time of NumPy elementwise work moving `nbytes` bytes (read + written) on `rank`."""
        return nbytes / self.rates(rank).elementwise_bps

    def fused_seconds(self, rank: int, nbytes: float) -> float:
        """Return the time of a fused kernel moving `nbytes` bytes on `rank` (elementwise rate if not measured)."""
        rates = self.rates(rank)
        return nbytes / (rates.fused_bps or rates.elementwise_bps)

    def link(self, a: int, b: int) -> Link:
        """Return the link from rank a to rank b (measured, else its reverse, else the topology's,
        else the default)."""
        found = self.links.get((a, b)) or self.links.get((b, a))
        if found is None and self.topology is not None:
            return self.topology.link(a, b)
        return found or self.default_link

    def p2p_seconds(self, a: int, b: int, nbytes: float) -> float:
        """Return the time of one message of `nbytes` bytes from a to b (0 when a == b)."""
        return 0.0 if a == b else self.link(a, b).seconds(nbytes)

    def slowest_link(self, group: Iterable[int]) -> Link:
        """Return the slowest link between members of `group` (by a 1 MiB message), or the default."""
        g = list(group)
        if self.topology is not None and not self.links:  # by the group's nodes and pods, not pair by pair
            if len(g) < 2:
                return self.default_link
            t, first = self.topology, g[0]
            other = next((r for r in g if t.pod_of(r) != t.pod_of(first)), None)
            if other is None:
                other = next((r for r in g if t.node_of(r) != t.node_of(first)), g[1])
            return t.link(first, other)
        pairs = [self.link(a, b) for a in g for b in g if a != b]
        return max(pairs, key=lambda lk: lk.seconds(2 ** 20), default=self.default_link)

    def fit(self, kind: str, group: Sequence[int]) -> CollectiveFit | None:
        """Return the fit measured for `kind` over exactly `group` (any order), or None."""
        key = tuple(sorted(group))
        return next((f for f in self.collectives if f.kind == kind and tuple(sorted(f.group)) == key), None)

    def time(self, kind: str, group: Sequence[int], nbytes: float) -> float:
        """Return the seconds of collective `kind` over `group` for a local buffer of `nbytes` bytes.

        An exact measured fit if there is one; else a fit of `kind` over a measured group of the
        same size, scaled by how much slower this group's slowest link is than that group's;
        else `ring_seconds` over the group's slowest link. A group of one rank takes 0.
        """
        if kind not in COLLECTIVES:
            raise ProfileError(f"unknown collective kind '{kind}' (known: {', '.join(COLLECTIVES)})")
        n = len(group) if isinstance(group, DeviceRange) else len(set(group))
        if n <= 1:
            return 0.0
        exact = self.fit(kind, group) if self.collectives else None
        if exact is not None:
            return exact.seconds(nbytes)
        if self.topology is not None:
            return self.topology.seconds(kind, group, nbytes)[0]
        slow = self.slowest_link(group)
        same = [f for f in self.collectives if f.kind == kind and len(set(f.group)) == n]
        if same:
            f = same[0]
            ref = self.slowest_link(f.group)
            ratio = slow.seconds(max(nbytes, 1.0)) / ref.seconds(max(nbytes, 1.0))
            return f.seconds(nbytes) * max(ratio, 1e-9)
        return ring_seconds(kind, n, nbytes, slow)

    def resync_seconds(self, kind: str, group: Sequence[int], apart_s: float) -> float:
        """Return what collective `kind` over `group` costs more after its members computed
        `apart_s` seconds apart: `CollectiveFit.resync_s` in proportion to `apart_s` up to the
        compute it was measured after (the longer they compute apart, the likelier one is left
        behind), then all of it. The exact group's fit, else one of the same size's, else 0."""
        if apart_s <= 0 or not self.collectives or len(set(group)) <= 1:
            return 0.0
        fit = self.fit(kind, group) or next((f for f in self.collectives if f.kind == kind
                                             and len(set(f.group)) == len(set(group))), None)
        if fit is None or not fit.resync_s:
            return 0.0
        return fit.resync_s * (min(1.0, apart_s / fit.resync_after_s) if fit.resync_after_s > 0 else 1.0)

    # -- JSON ---------------------------------------------------------------------------------

    def to_json(self) -> dict:
        """Return the profile as a JSON-ready dict (see the module docstring)."""
        def rates(x: RankRates) -> dict:
            return {"matmul": [{"shape": list(p.shape), "flops": p.flops, "gflops": p.gflops} for p in x.matmul],
                    "elementwise_bps": x.elementwise_bps, "fused_bps": x.fused_bps}

        if self.topology is not None:
            ranks = {"rank_classes": [{"ranks": str(members), **rates(x)} for x, members in self.classes()],
                     "topology": self.topology.to_json()}
        else:
            ranks = {"ranks": [{"rank": r, **rates(x)} for r, x in enumerate(self.ranks)]}
        return {
            "format": FORMAT,
            "version": VERSION,
            "source": self.source,
            "meta": dict(self.meta),
            **ranks,
            "default_link": {"latency_s": self.default_link.latency_s,
                             "bandwidth_bps": self.default_link.bandwidth_bps},
            "links": [{"src": a, "dst": b, "latency_s": lk.latency_s, "bandwidth_bps": lk.bandwidth_bps}
                      for (a, b), lk in sorted(self.links.items())],
            "bucket_overlap": self.bucket_overlap,
            "collectives": [{"kind": f.kind, "group": list(f.group), "latency_s": f.latency_s,
                             "bandwidth_bps": f.bandwidth_bps,
                             **({"points": [list(p) for p in f.points]} if f.points else {}),
                             **({"resync_s": f.resync_s, "resync_after_s": f.resync_after_s}
                                if f.resync_s else {})}
                            for f in self.collectives],
        }

    @staticmethod
    def from_json(data: object, where: str = "profile") -> DeviceProfile:
        """Return the profile of a dict made by `to_json` (ProfileError, naming `where`, if malformed)."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ProfileError(f"{where}: not a device profile (no \"format\": \"{FORMAT}\")")
        if data.get("version") != VERSION:
            raise ProfileError(f"{where}: device profile version {data.get('version')!r} is not supported "
                               f"(this hspmd reads version {VERSION})")
        def rates(r: dict) -> RankRates:
            return RankRates(
                tuple(MatmulPoint(float(p["flops"]), float(p["gflops"]), tuple(int(d) for d in p.get("shape", (0, 0, 0))))
                      for p in r["matmul"]),
                float(r["elementwise_bps"]),
                None if r.get("fused_bps") is None else float(r["fused_bps"]),
            )

        try:
            if "rank_classes" in data:  # alike ranks as one class over a range of ranks
                by_rank: dict[int, RankRates] = {}
                for c in data["rank_classes"]:
                    x = rates(c)
                    by_rank.update((r, x) for r in parse_devices(str(c["ranks"])))
                if sorted(by_rank) != list(range(len(by_rank))):
                    raise ProfileError("its rank_classes do not cover ranks 0..n-1 once each")
                ranks = tuple(by_rank[r] for r in range(len(by_rank)))
            else:
                ranks = tuple(rates(r) for r in data["ranks"])
            topology = Topology.from_json(data["topology"]) if data.get("topology") else None
            dl = data["default_link"]
            links = {(int(x["src"]), int(x["dst"])): Link(float(x["latency_s"]), float(x["bandwidth_bps"]))
                     for x in data.get("links", [])}
            fits = tuple(CollectiveFit(str(f["kind"]), tuple(int(r) for r in f["group"]), float(f["latency_s"]),
                                       float(f["bandwidth_bps"]),
                                       tuple(sorted((float(b), float(t)) for b, t in f.get("points", ()))),
                                       float(f.get("resync_s", 0.0)), float(f.get("resync_after_s", 0.0)))
                         for f in data.get("collectives", []))
            return DeviceProfile(ranks, Link(float(dl["latency_s"]), float(dl["bandwidth_bps"])), links, fits,
                                 str(data.get("source", "")), dict(data.get("meta", {})),
                                 float(data.get("bucket_overlap", 1.0)), topology)
        except ProfileError as err:
            raise ProfileError(f"{where}: {err}") from None
        except KeyError as err:
            raise ProfileError(f"{where}: malformed device profile: missing field {err}") from None
        except (TypeError, ValueError, AttributeError, DeviceSetError) as err:
            raise ProfileError(f"{where}: malformed device profile: {err}") from None

    def save(self, path: str) -> None:
        """Write the profile to `path` as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")

    @staticmethod
    def load(path: str) -> DeviceProfile:
        """Return the profile in JSON file `path` (ProfileError if it is not valid JSON or not a profile)."""
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ProfileError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
        return DeviceProfile.from_json(data, path)

    def summary(self) -> str:
        """Return a short readable description: per rank, its rates; the links and collectives measured."""
        lines = [f"device profile: {self.num_ranks} ranks ({self.source})"]
        classes = self.classes() if self.topology is not None else [(x, [r]) for r, x in enumerate(self.ranks)]
        for x, members in classes:
            mm = ", ".join(f"{p.gflops:.1f}" for p in x.matmul)
            fused = f", fused {x.fused_bps / 1e9:.2f} GB/s" if x.fused_bps else ""
            who = f"rank {members[0]}" if len(members) == 1 else f"ranks {members}"
            lines.append(f"  {who}: matmul GFLOP/s {mm}; elementwise {x.elementwise_bps / 1e9:.2f} GB/s{fused}")
        if self.topology is not None:
            t = self.topology
            lines.append(f"  topology: {t.per_node} ranks per node, {t.pod_nodes or 'all'} nodes per pod; "
                         f"{t.intra_bps / 1e9:.0f} GB/s inside a node, {t.nic_bps / 1e9:.0f} GB/s per rank's NIC")
        for (a, b), lk in sorted(self.links.items()):
            lines.append(f"  link {a}->{b}: {lk.latency_s * 1e6:.1f} us, {lk.bandwidth_bps / 1e9:.2f} GB/s")
        for f in self.collectives:
            lines.append(f"  {f.kind} over {list(f.group)}: {f.latency_s * 1e6:.1f} us + "
                         f"{f.bandwidth_bps / 1e9:.2f} GB/s"
                         + (f" (at {len(f.points)} sizes: 1 KiB {f.seconds(1024) * 1e6:.0f} us, 64 KiB "
                            f"{f.seconds(1 << 16) * 1e6:.0f} us, 1 MiB {f.seconds(1 << 20) * 1e6:.0f} us)"
                            if f.points else "")
                         + (f"; {f.resync_s * 1e6:.0f} us more after compute" if f.resync_s else ""))
        lines.append(f"  gradient buckets: {self.bucket_overlap:.0%} of a transfer hides behind compute")
        return "\n".join(lines) + "\n"
