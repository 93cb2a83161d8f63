"""The planner's price of one device group's configuration, from `ModelFacts` and a `Machine`.

For a group of devices with degrees dp, tp, pp, ZeRO stage `zero`, `m` micro-batches and `rows`
of the batch, per rank (all of them wait for the slowest device of the group):

* compute: the matmul FLOPs of its rows and its 1/(tp*pp) of the model at the group's slowest
  matmul rate for matmuls of that size, plus the bytes its other ops write at its elementwise
  rate (the optimizer's update over its parameter shard); the largest stage sets the pace
  (ceil(layers/pp) layers against layers/pp), and under uneven tp pieces the rank holding
  the most (`ModelFacts.tp_busiest`: 3 heads over tp=2 are 2 and 1, 4/3 of an even half);
  and a fixed cost per kernel launched (each
  micro-batch runs its stage's kernels again);
* pipeline bubble: (pp - 1) / m of the compute (GPipe and 1F1B alike);
* tp: the collectives tp adds (bytes measured at tp=2, scaled to the rows, per micro-batch
  and stage), each a ring over the tp ranks;
* pp: the sends between stages, one per micro-batch each way;
* dp: the gradient all-reduce in 4 MiB buckets over the dp ranks (ZeRO: a reduce-scatter
  of each parameter's gradient and an all-gather of the parameter, per tensor, unbucketed). It is counted whole, not overlapped with the backward:
  on CPU ranks the transfers take the cores the backward needs, so the overlap is small;
* memory: parameters, gradients and optimizer states of its shard (states over dp with
  ZeRO), and the activations of its rows (GPipe keeps every micro-batch's, 1F1B at most pp).

Rough, by design: it ranks candidates, the measured run is the truth (`hspmd run --log`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hspmd.planner.facts import ModelFacts
from hspmd.planner.machine import Machine

__all__ = ["GroupConfig", "GroupCost", "group_cost"]

#: bytes of one gradient all-reduce bucket (the runtime's default)
BUCKET_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class GroupConfig:
    """One device group of a candidate strategy."""

    devices: tuple[int, ...]
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0


@dataclass(frozen=True)
class GroupCost:
    """A group's predicted step time, split by what it is made of, and its memory per rank."""

    compute_s: float
    bubble_s: float
    tp_s: float
    pp_s: float
    dp_s: float
    memory_bytes: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.tp_s + self.pp_s + self.dp_s

    def parts(self) -> dict[str, float]:
        return {"compute": self.compute_s, "pipeline bubble": self.bubble_s, "tp collectives": self.tp_s,
                "pipeline sends": self.pp_s, "dp gradient sync": self.dp_s}


def _ring_groups(config: GroupConfig) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Return one dp, one tp and one pp group of rank 0 of `config` (devices stage-major, then
    dp, then tp, as the strategy lays them out)."""
    d = config.devices
    tp = d[: config.tp]
    dp = d[: config.dp * config.tp: config.tp]
    pp = d[:: config.dp * config.tp]
    return dp, tp, pp


def group_cost(facts: ModelFacts, machine: Machine, config: GroupConfig, rows: int, m: int = 1,
               schedule: str = "gpipe") -> GroupCost:
    """Return the cost of `config` computing `rows` of the batch in `m` micro-batches."""
    dp, tp, pp = config.dp, config.tp, config.pp
    # of the batch's work, per dp rank: the busiest (rows need not divide: the first ranks take one more)
    frac = math.ceil(rows / dp) * dp / facts.rows
    shard = tp * pp
    per_call = facts.mean_matmul_flops() * frac / (dp * tp * m)
    mm_rate = min(machine.matmul_rate(r, per_call) for r in config.devices)
    ew_rate = min(machine.elementwise[r] for r in config.devices)
    imbalance = math.ceil(facts.layers / pp) * pp / facts.layers if pp > 1 else 1.0
    imbalance *= facts.tp_busiest(tp)  # uneven tp pieces: the rank with the most heads sets the pace
    compute = (facts.matmul_flops * frac / (dp * shard) / mm_rate
               + facts.activation_bytes_written * frac / (dp * shard) / ew_rate) * imbalance
    compute += facts.update_bytes_written / (shard * (dp if config.zero else 1)) / ew_rate
    compute += facts.ops * m / pp * machine.op_overhead  # every micro-batch runs its stage's kernels
    bubble = compute * (pp - 1) / m
    dp_group, tp_group, pp_group = _ring_groups(config)
    tp_s = 0.0
    if tp > 1:
        calls = max(1, round(facts.tp_calls * m / pp))
        tp_s = machine.collective("all_reduce", tp_group, facts.tp_bytes * frac / dp / pp / m, calls)
    pp_s = 0.0
    if pp > 1:
        pp_s = 2 * machine.collective("send", pp_group[:2], facts.pp_bytes * frac / dp / m, m)
    grads = facts.param_bytes / shard * facts.tp_busiest(tp)
    dp_s = 0.0
    if dp > 1 and config.zero:  # per parameter: a reduce-scatter of its gradient, an all-gather of it
        calls = max(1, facts.param_tensors)
        dp_s = sum(machine.collective(k, dp_group, grads / calls, calls) for k in ("reduce_scatter", "all_gather"))
    elif dp > 1:
        buckets = max(1, math.ceil(grads / BUCKET_BYTES))
        dp_s = machine.collective("all_reduce", dp_group, grads / buckets, buckets)
    in_flight = 1.0 if schedule == "gpipe" or pp == 1 else min(pp, m) / m
    memory = (2 * grads + facts.state_bytes / (shard * (dp if config.zero else 1))
              + facts.activation_bytes * frac / (dp * shard) * in_flight)
    return GroupCost(compute, bubble, tp_s, pp_s, dp_s, memory)
