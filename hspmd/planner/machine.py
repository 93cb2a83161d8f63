"""What the planner knows of the devices: a `DeviceProfile` seen the way the search asks.

`Machine` wraps a profile (`hspmd profile`, `hspmd.ir.device_profile`) with the planner's
questions: a rank's matmul rate for matmuls of a given size (the profile's table, interpolated
in log FLOPs), its elementwise rate, the seconds of a collective over a group (the profile's
measured fits, else the ring model over the group's slowest link), and a fixed cost per kernel
launched, which the profile does not measure (Python's dispatch of one kernel on a CPU rank).

`Machine.uniform(n)` is the profile `hspmd compile --cost` assumes without one: every rank
alike, this machine's kind of CPU core (`DeviceProfile.default_cpu`).

At scale the questions are asked of classes, not ranks: alike ranks share one `RankRates` in
the profile, so a group's slowest rate is the slowest of its classes (`group_rates`, found once
per group's range), and every rank's rate is computed once per class (`speeds`). A profile of
16,384 ranks in two classes costs what one of two ranks does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hspmd.ir.device_profile import DeviceProfile, RankRates
from hspmd.ir.devices import DeviceRange

__all__ = ["Machine"]

#: seconds one kernel costs whatever its size (a plan's dispatch of one step on a CPU rank:
#: 6.5-6.7 us measured by benchmarks/cost_model.py on a GPT whose kernels do no work)
OP_OVERHEAD_S = 7e-6


@dataclass(frozen=True, eq=False)
class Machine:
    """The devices the planner plans for (see the module docstring)."""

    profile: DeviceProfile
    op_overhead: float = OP_OVERHEAD_S
    #: what was found once: the distinct rates of each group asked about (by the group's range),
    #: every rank's kind of device
    _group_rates: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def uniform(n: int, speed: Sequence[float] | None = None) -> Machine:
        """Return `n` alike ranks (or with relative compute `speed`s) of the default CPU profile."""
        profile = DeviceProfile.default_cpu(n)
        return Machine(profile.with_speed(speed) if speed is not None else profile)

    @property
    def n(self) -> int:
        return self.profile.num_ranks

    @property
    def kinds(self) -> tuple[str, ...]:
        """Return every rank's kind of device, "cpu" or "cuda" (the profile's `meta["kinds"]`, which
        `hspmd profile --device cuda,cpu` records; all "cpu" where a profile does not say)."""
        found = self._group_rates.get("kinds")
        if found is None:
            kinds = self.profile.meta.get("kinds")
            if not isinstance(kinds, (list, tuple)) or len(kinds) != self.n:
                found = ("cpu",) * self.n
            else:
                found = tuple("cuda" if k == "cuda" else "cpu" for k in kinds)
            self._group_rates["kinds"] = found
            self._group_rates["gpus"] = "cuda" in found
        return found

    @property
    def has_gpus(self) -> bool:
        """Return whether some rank is a GPU (its groups then say `device=`)."""
        self.kinds
        return self._group_rates["gpus"]

    @property
    def measured(self) -> bool:
        return not self.profile.source.startswith("synthetic")

    @property
    def elementwise(self) -> tuple[float, ...]:
        """Return every rank's elementwise rate, bytes written per second."""
        return tuple(r.elementwise_bps for r in self.profile.ranks)

    def group_rates(self, devices: Sequence[int]) -> tuple[RankRates, ...]:
        """Return the distinct rates of the ranks of `devices` (their classes), found once per group."""
        group = DeviceRange.of(devices)
        key = (group.start, group.shape, group.strides, group.ids)
        found = self._group_rates.get(key)
        if found is None:
            ranks = self.profile.ranks
            seen: dict[int, RankRates] = {}
            for r in group:
                seen.setdefault(id(ranks[r]), ranks[r])
            found = self._group_rates[key] = tuple(seen.values())
        return found

    def slowest_matmul_rate(self, devices: Sequence[int], flops_per_call: float) -> float:
        """Return the slowest FLOP/s of the ranks of `devices` on matmuls of `flops_per_call` FLOPs."""
        return min(x.matmul_gflops(flops_per_call) for x in self.group_rates(devices)) * 1e9

    def slowest_elementwise(self, devices: Sequence[int]) -> float:
        """Return the slowest elementwise rate of the ranks of `devices`."""
        return min(x.elementwise_bps for x in self.group_rates(devices))

    @property
    def bucket_overlap(self) -> float:
        """Return the part (0..1) of a gradient bucket's all-reduce that hides behind compute."""
        return self.profile.bucket_overlap

    def matmul_rate(self, rank: int, flops_per_call: float) -> float:
        """Return rank's FLOP/s on matmuls of `flops_per_call` FLOPs each."""
        return self.profile.rates(rank).matmul_gflops(flops_per_call) * 1e9

    def speeds(self, flops_per_call: float) -> tuple[float, ...]:
        """Return every rank's matmul rate at `flops_per_call` (computed once per class of ranks)."""
        rate: dict[int, float] = {}
        return tuple(rate.setdefault(id(x), x.matmul_gflops(flops_per_call) * 1e9) for x in self.profile.ranks)

    def resync(self, kind: str, group: tuple[int, ...], apart_s: float, calls: int = 1) -> float:
        """Return what `calls` collectives `kind` over `group` cost more, each after `apart_s`
        seconds of compute (the wait for a member the compute left behind;
        `DeviceProfile.resync_seconds`)."""
        return calls * self.profile.resync_seconds(kind, group, apart_s) if len(group) > 1 and apart_s > 0 else 0.0

    def collective(self, kind: str, group: tuple[int, ...], nbytes: float, calls: int = 1) -> float:
        """Return the seconds of `calls` collectives `kind` over `group`, each on `nbytes` per rank
        (`send`: from the group's first rank to its second)."""
        if len(group) < 2 or nbytes <= 0:
            return 0.0
        if kind == "send":
            return calls * self.profile.p2p_seconds(group[0], group[1], nbytes)
        return calls * self.profile.time(kind, group, nbytes)
