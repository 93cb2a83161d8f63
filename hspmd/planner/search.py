"""The search: device groups, per-group degrees, micro-batches and batch shares, ranked by cost.

1. **Groupings.** Ranks are sorted by their matmul rate at the model's matmul size and cut
   into clusters of like speed (each within `LIKE_SPEED` of its fastest) and of one kind of
   device (a profile's GPU ranks apart from its CPU ranks; each group of the strategy then says
   `device=cuda|cpu`). Up to three groupings are priced: every device in one group (the slowest
   sets the pace; not where GPU and CPU ranks mix), one group per cluster (when there are several), and each cluster cut into groups of powers of two (when a
   size such as 3 or 6 divides no batch: `[0,1]: dp=2 share=2 | [2]: dp=1 share=1`). The same
   groupings are priced again on the fastest clusters alone (the fastest, the two fastest,
   ...), the slower ones idle: an idle rank costs nothing, so where the slower ranks' compute
   and the gradient sum across groups (across kinds beside a GPU) cost more than their rows
   save, the strategy leaves them out (`[0]: dp=1 device=cuda` beside a slow CPU rank 1;
   `Candidate.idle_ranks`; the runtime side is `hspmd.runtime.launcher.idle`).
2. **Configurations per group.** Every (dp, tp, pp) whose product is the group's size, with tp
   a degree the model allows and pp at most its layer count; ZeRO-1 where dp > 1 and ZeRO-3
   where also pp = 1; each of them with and without activation recompute (`block`,
   `selective`: the facts' recompute probes price their extra FLOPs and smaller activations); sequence
   parallelism (sp=1) beside every tp > 1 of a strategy of one group, when the model runs it;
   for a mixture-of-experts model in a strategy of one group, expert parallelism: every ep
   dividing the experts and the ranks that split the batch (dp * ep); for a
   pipeline, 1, 2, 4 or 8 micro-batches (one count for the whole strategy, as the runtime has)
   under 1F1B. Combinations the runtime does not run are left out (several pipelined groups
   with tp and micro-batches; ZeRO in a pipeline beside other groups).
3. **Rows per group.** A pipelined group needs a multiple of dp * m rows; any other group at
   least dp rows, divisible or not (the compiler evens uneven rows into two groups:
   `even_out_rows`). Starting from the least each may hold, rows go one unit at a time to the
   group whose step would then end first (min-max greedy, HetSeq's "fewer rows to the slower
   GPU" from the cost model).
4. **Choosing across groups.** A group's configuration is chosen with the others fixed, in
   turn, twice (coordinate descent), each time with the rows re-balanced: the number of
   candidates stays linear in the configurations per group, not their product, so 64 devices
   in several clusters plan in well under a second once the facts are read.

A candidate's step time is its slowest group's plus the gradient sum across groups; those
over `memory_per_rank` are dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

from hspmd.ir.devices import DeviceRange
from hspmd.ir.strategy import Strategy, StrategyGroup
from hspmd.planner.cost import GroupConfig, GroupCost, group_cost
from hspmd.planner.facts import ModelFacts
from hspmd.planner.machine import Machine

__all__ = ["Candidate", "PlanError", "clusters", "plan", "preference"]

#: ranks within this factor of a cluster's fastest share its group
LIKE_SPEED = 0.85
MICROBATCHES = (1, 2, 4, 8)
#: how much faster a ZeRO candidate must be predicted than its plain twin to rank above it
ZERO_MARGIN = 0.02
#: clusters of at most this many ranks are also cut into groups of powers of two (a size such as 3
#: or 6 divides no batch); a larger cluster is whole nodes of a large machine, which tp and pp
#: divide and whose uneven rows the compiler evens
BINARY_PIECES_UP_TO = 64
#: beside other groups, a group of more ranks than BINARY_PIECES_UP_TO tries its KEEP_CONFIGS best
#: configurations (each priced alone on its share of the batch) in the coordinate descent, not all
KEEP_CONFIGS = 12


class PlanError(Exception):
    """No strategy fits (the devices, the model's shapes, the memory limit)."""


@dataclass(frozen=True)
class Candidate:
    """One strategy the planner priced."""

    groups: tuple[GroupConfig, ...]
    rows: tuple[int, ...]
    microbatches: int
    costs: tuple[GroupCost, ...]
    cross_s: float  # the gradient sum across groups
    # every rank's kind of device where some rank is a GPU (each group then says its `device=`)
    kinds: tuple[str, ...] | None = None
    n: int = 0  # the machine's ranks; those no group names are idle (0: every rank is in a group)
    # per group, the host memory of each rank's peer copies (`--redundancy peer`; empty without)
    copies: tuple[float, ...] = ()

    @property
    def idle_ranks(self) -> tuple[int, ...]:
        """Return the ranks of the machine that no group names: they run nothing (`hspmd.runtime.launcher.idle`)."""
        if sum(len(g.devices) for g in self.groups) >= self.n:
            return ()
        named = {d for g in self.groups for d in g.devices}
        return tuple(r for r in range(self.n) if r not in named)

    @property
    def step_s(self) -> float:
        return max(c.step_s for c in self.costs) + self.cross_s

    @property
    def memory_bytes(self) -> float:
        """Return the most memory a rank needs: its step's, and on a CPU rank (whose memory is the
        host's) its peer copies too."""
        copies = self.copies or (0.0,) * len(self.costs)
        return max(c.memory_bytes + (k if self.device(g) != "cuda" else 0.0)
                   for c, k, g in zip(self.costs, copies, self.groups))

    @property
    def copies_bytes(self) -> float:
        """Return the most host memory a rank's peer copies take (0 without `--redundancy peer`)."""
        return max(self.copies, default=0.0)

    @property
    def schedule(self) -> str:
        return "1f1b" if any(g.pp > 1 for g in self.groups) else "gpipe"

    def strategy(self) -> str:
        """Return the strategy text (`--strategy`), batch shares as the rows' smallest ratio."""
        if len(self.groups) == 1:
            g = self.groups[0]
            return str(Strategy((StrategyGroup(g.devices, g.dp, g.tp, g.pp, zero=g.zero, sp=g.sp, ep=g.ep,
                                               recompute=g.recompute, device=self.device(g)),)))
        common = reduce(math.gcd, self.rows)
        pairs = sorted(zip(self.groups, self.rows), key=lambda gr: gr[0].devices.min)  # in device order
        return str(Strategy(tuple(StrategyGroup(g.devices, g.dp, g.tp, g.pp, share=r // common, zero=g.zero, sp=g.sp,
                                                recompute=g.recompute, device=self.device(g))
                                  for g, r in pairs)))

    def device(self, group: GroupConfig) -> str | None:
        """Return the `device=` key of `group`: its ranks' kind where the machine has GPU ranks
        (None where it has none, or the group mixes kinds, which the search never makes)."""
        if self.kinds is None:
            return None
        kinds = {self.kinds[r] for r in group.devices}
        return kinds.pop() if len(kinds) == 1 else None

    def settings(self) -> list[str]:
        """Return the `--set` entries the strategy runs with (micro-batches of a pipeline)."""
        if not any(g.pp > 1 for g in self.groups):
            return []
        return [f"microbatches={self.microbatches}", f"pipeline_schedule={self.schedule}"]

    def parts(self) -> dict[str, float]:
        """Return the slowest group's time split by what it is made of, plus the cross-group sum."""
        slowest = max(self.costs, key=lambda c: c.step_s)
        return {**slowest.parts(), "gradient sum across groups": self.cross_s}


def clusters(machine: Machine, flops_per_call: float) -> list[tuple[int, ...]]:
    """Return the ranks cut into groups of like speed and one kind of device (GPU ranks first),
    fastest first, each sorted by rank."""
    speed, kind = machine.speeds(flops_per_call), machine.kinds
    order = sorted(range(machine.n), key=lambda r: (kind[r] != "cuda", -speed[r], r))
    out: list[list[int]] = []
    for r in order:
        if out and kind[r] == kind[out[-1][0]] and speed[r] >= LIKE_SPEED * speed[out[-1][0]]:
            out[-1].append(r)
        else:
            out.append([r])
    return [DeviceRange.of(sorted(c)) for c in out]


def _binary_pieces(devices: DeviceRange) -> list[DeviceRange]:
    """Return `devices` cut into runs whose sizes are the powers of two of its size (6: 4 + 2)."""
    out, start = [], 0
    for bit in reversed(range(len(devices).bit_length())):
        if len(devices) & (1 << bit):
            out.append(devices[start:start + (1 << bit)])
            start += 1 << bit
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _configs(devices: tuple[int, ...], facts: ModelFacts, alone: bool) -> list[GroupConfig]:
    out = []
    n = len(devices)
    for tp in facts.tp_degrees:
        if n % tp:
            continue
        for pp in _divisors(n // tp):
            if pp > facts.max_pp:
                continue
            even = facts.tp_busiest(tp) == 1.0  # sp and ep are refused beside uneven tp pieces
            for ep in (_expert_degrees(facts, n // (tp * pp), alone) if even else [1]):
                dp = n // (tp * pp * ep)
                # sequence parallelism where the model runs it, over one group's tp ranks (the runtime
                # runs it in a strategy of one group)
                sps = (0, 1) if tp > 1 and alone and ep == 1 and even and facts.sp is not None else (0,)
                zeros = (0, 1) if dp * ep > 1 and (pp == 1 or alone) and not (ep > 1 and pp > 1) else (0,)
                zeros += (3,) if dp > 1 and pp == 1 and ep == 1 else ()  # parameters sharded too
                for zero in zeros:
                    for sp in sps:
                        for recompute in ("none", *facts.recompute_modes):
                            out.append(GroupConfig(devices, dp, tp, pp, zero, sp, ep, recompute))
    return out


def _expert_degrees(facts: ModelFacts, batch_ranks: int, alone: bool) -> list[int]:
    """Return the ep degrees for `batch_ranks` ranks that split the batch: 1, and for a
    mixture-of-experts model in a strategy of one group every degree dividing both them and
    the experts."""
    if facts.ep is None or not alone:
        return [1]
    return [e for e in _divisors(batch_ranks) if facts.ep.experts % e == 0]


def _runs(groups: tuple[GroupConfig, ...], m: int) -> bool:
    """Return whether the runtime runs this combination (README: "Not yet")."""
    pipelined = [g for g in groups if g.pp > 1]
    if m > 1 and not pipelined:
        return False  # micro-batches only split pipelines
    if len(pipelined) > 1 and m > 1 and any(g.tp > 1 for g in pipelined):
        return False
    return True


def _cost(memo: dict | None, facts: ModelFacts, machine: Machine, g: GroupConfig, rows: int, m: int,
          schedule: str = "gpipe") -> GroupCost:
    """Return `group_cost`, once per (configuration, rows, m, schedule) where `memo` keeps them."""
    if memo is None:
        return group_cost(facts, machine, g, rows, m, schedule)
    key = (g, rows, m, schedule)
    found = memo.get(key)
    if found is None:
        found = memo[key] = group_cost(facts, machine, g, rows, m, schedule)
    return found


def _balance(facts: ModelFacts, machine: Machine, groups: tuple[GroupConfig, ...], m: int,
             memo: dict | None = None) -> tuple[int, ...] | None:
    """Return rows per group (a pipelined group's a multiple of dp * m, any other at least dp;
    summing to the batch) by min-max greedy."""
    # rows need not divide dp (even_out_rows), but must divide the ranks of an ep split
    units = [g.dp * g.ep * m if g.pp > 1 else g.ep * g.dp if g.ep > 1 else 1 for g in groups]
    rows = [g.dp * g.ep * (m if g.pp > 1 else 1) for g in groups]  # the least each group may hold
    left = facts.rows - sum(rows)
    if left < 0:
        return None
    if len(groups) == 1:
        return (facts.rows,) if left % units[0] == 0 else None
    # a large batch goes in coarser steps (at most ~64 per group), unless they cannot sum to it
    coarse = [u if g.pp > 1 else max(1, min(facts.rows // 64, g.dp)) for g, u in zip(groups, units)]
    if left % math.gcd(*coarse) == 0:
        units = coarse
    while left > 0:
        best, best_t = None, math.inf
        for i, (g, u) in enumerate(zip(groups, units)):
            if u <= left:
                t = _cost(memo, facts, machine, g, rows[i] + u, m).step_s
                if t < best_t:
                    best, best_t = i, t
        if best is None:
            return None
        rows[best] += units[best]
        left -= units[best]
    return tuple(rows)


def _price(facts: ModelFacts, machine: Machine, groups: tuple[GroupConfig, ...], m: int,
           memo: dict | None = None) -> Candidate | None:
    if not _runs(groups, m):
        return None
    rows = _balance(facts, machine, groups, m, memo)
    if rows is None:
        return None
    schedule = "1f1b" if any(g.pp > 1 for g in groups) else "gpipe"
    costs = tuple(_cost(memo, facts, machine, g, r, m, schedule) for g, r in zip(groups, rows))
    cross = 0.0
    if len(groups) > 1:
        shard = min(g.tp * g.pp for g in groups)
        cross = machine.collective("all_reduce", tuple(g.devices[0] for g in groups), facts.param_bytes / shard)
    return Candidate(groups, rows, m, costs, cross, machine.kinds if machine.has_gpus else None, machine.n)


def _grouping_candidates(facts: ModelFacts, machine: Machine, parts: list[DeviceRange]) -> list[Candidate]:
    alone = len(parts) == 1
    options = [_configs(p, facts, alone) for p in parts]
    memo: dict = {}  # a group's price at some rows recurs while the others' configurations vary
    out: list[Candidate] = []
    for m in MICROBATCHES:
        if alone:
            out.extend(c for g in options[0] if (c := _price(facts, machine, (g,), m)) is not None)
            continue
        opts_m = [_best_alone(facts, machine, p, opts, parts, m) for p, opts in zip(parts, options)]
        # coordinate descent from the plain data-parallel choice of every group
        chosen = [next((g for g in opts if g.tp == 1 and g.pp == 1 and g.zero == 0), opts[0]) for opts in opts_m]
        best = _price(facts, machine, tuple(chosen), m, memo)
        for _ in range(2):
            for i, opts in enumerate(opts_m):
                for g in opts:
                    trial = tuple(chosen[:i] + [g] + chosen[i + 1:])
                    c = _price(facts, machine, trial, m, memo)
                    if c is not None:
                        out.append(c)
                        if best is None or c.step_s < best.step_s:
                            best, chosen = c, list(trial)
        if best is not None:
            out.append(best)
    return out


def _best_alone(facts: ModelFacts, machine: Machine, part: DeviceRange, options: list[GroupConfig],
                parts: list[DeviceRange], m: int) -> list[GroupConfig]:
    """Return the configurations of `part` the coordinate descent tries beside the other parts:
    all of them for a small part; for a large one (whole nodes of a large machine) the
    KEEP_CONFIGS fastest, each priced alone on the part's share of the batch by its speed, and
    the plain data-parallel one the descent starts from. Symmetry: the configurations of a group
    depend on its size and its ranks' class, not on which ranks they are."""
    if len(part) <= BINARY_PIECES_UP_TO or len(options) <= KEEP_CONFIGS:
        return options
    per_call = facts.mean_matmul_flops()
    speed = [machine.slowest_matmul_rate(p, per_call) * len(p) for p in parts]
    share = speed[parts.index(part)] / sum(speed)

    def alone(g: GroupConfig) -> float:
        rows = max(g.dp * g.ep * (m if g.pp > 1 else 1), round(facts.rows * share))
        if g.pp > 1:
            unit = g.dp * g.ep * m
            rows = max(unit, rows // unit * unit)
        return group_cost(facts, machine, g, rows, m, "1f1b" if g.pp > 1 else "gpipe").step_s

    ranked = sorted(options, key=alone)[:KEEP_CONFIGS]
    plain = next((g for g in options if g.tp == 1 and g.pp == 1 and g.zero == 0), None)
    return ranked + ([plain] if plain is not None and plain not in ranked else [])


def _nothing_fits(facts: ModelFacts, n: int) -> str:
    """Say why no strategy keeps `n` devices busy, the closest one, and what it would need."""
    tp, pp = max(facts.tp_degrees), facts.max_pp
    most = facts.rows * tp * pp  # dp at most one row per rank, times the model's split
    closest = Strategy((StrategyGroup(tuple(range(min(n, most))), dp=min(n, most) // (tp * pp) or 1,
                                      tp=tp, pp=pp),)) if most < n and most >= tp * pp else None
    need = -(-n // (tp * pp))  # rows for dp = n / (tp pp)
    return (f"no strategy fits {n} devices: a batch of {facts.rows} rows, tp at most {tp} (the model's shapes) "
            f"and at most {pp} pipeline stage{'s' if pp > 1 else ''} keep at most {most} devices busy"
            + (f"; the closest is '{closest}' on {closest.num_devices} devices" if closest else "")
            + f"; {n} devices need a batch of at least {need} rows, or use fewer devices")


def preference(c: Candidate) -> tuple[float, int, str]:
    """Rank by step time, ZeRO (and recompute) counted 2 % slower per group that uses it: its per-tensor
    collectives and gradient copies cost more than the model sees, so it must win clearly
    (or be needed for memory) to be chosen; ties go to fewer groups."""
    zero = sum(1 for g in c.groups if g.zero) + sum(1 for g in c.groups if g.recompute != "none")
    return (c.step_s * (1 + ZERO_MARGIN * zero), len(c.groups), c.strategy())


def _groupings(machine: Machine, parts: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """Return the groupings of the ranks of `parts` (clusters) the search prices: all of them in
    one group (where they are of one kind: GPU and CPU ranks never share a group), one group per
    cluster (where there are several), and clusters cut into groups of powers of two (where a
    size divides nothing: 3, 6, ...)."""
    devices = DeviceRange.of(sorted(d for p in parts for d in p))
    one_kind = not machine.has_gpus or len({machine.kinds[d] for d in devices}) == 1
    groupings = ([[devices]] if one_kind else []) + ([list(parts)] if len(parts) > 1 else [])
    split = [piece for p in parts for piece in (_binary_pieces(p) if len(p) <= BINARY_PIECES_UP_TO else [p])]
    if len(split) > len(parts):
        groupings.append(split)
    return groupings


def _working_clusters(machine: Machine, facts: ModelFacts, parts: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """Return the sets of clusters that leave the slower ones idle: the fastest cluster, the two
    fastest, ..., all but the slowest (by each cluster's fastest rank's matmul rate). A rank
    left out runs nothing and costs nothing: where the slower ranks' compute, their share's
    rounding and the gradient sum across kinds cost more than their rows save, such a
    candidate is the fastest."""
    speed = machine.speeds(facts.mean_matmul_flops())
    fastest_first = sorted(parts, key=lambda p: (-max(speed[r] for r in p), p))
    return [sorted(fastest_first[:k], key=parts.index) for k in range(1, len(parts))]


def plan(facts: ModelFacts, machine: Machine, memory_per_rank: float | None = None,
         redundancy: bool = False) -> tuple[list[Candidate], list[Candidate]]:
    """Return (candidates that fit, fastest first; those over `memory_per_rank`, fastest first).
    With `redundancy` (`--redundancy peer`), each rank's peer copies count too (`redundancy.py`).

    Raises PlanError when no candidate runs on these devices at all.
    """
    parts = clusters(machine, facts.mean_matmul_flops())
    groupings = _groupings(machine, parts)
    for working in _working_clusters(machine, facts, parts):  # the slower clusters idle
        groupings += _groupings(machine, working)
    seen: dict[tuple[str, int], Candidate] = {}
    for grouping in groupings:
        for c in _grouping_candidates(facts, machine, grouping):
            key = (c.strategy(), c.microbatches if c.settings() else 1)
            if key not in seen or c.step_s < seen[key].step_s:
                seen[key] = c
    if redundancy:
        from dataclasses import replace

        from hspmd.planner.redundancy import copies_bytes

        seen = {k: replace(c, copies=tuple(copies_bytes(facts, g) for g in c.groups)) for k, c in seen.items()}
    ranked = sorted(seen.values(), key=preference)
    if not ranked:
        raise PlanError(_nothing_fits(facts, machine.n))
    fits = [c for c in ranked if memory_per_rank is None or c.memory_bytes <= memory_per_rank]
    over = [c for c in ranked if memory_per_rank is not None and c.memory_bytes > memory_per_rank]
    return fits, over
