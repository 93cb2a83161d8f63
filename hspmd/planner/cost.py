"""The planner's price of one device group's configuration, from `ModelFacts` and a `Machine`.

For a group of devices with degrees dp, tp, pp, ZeRO stage `zero`, sequence parallelism `sp`,
`m` micro-batches and `rows` of the batch, per rank (all of them wait for the slowest device
of the group):

* compute: the matmul FLOPs of its rows and its 1/(tp*pp) of the model at the group's slowest
  matmul rate for matmuls of that size, plus the bytes its other ops write at its elementwise
  rate (the optimizer's update over its parameter shard); the largest stage sets the pace
  (ceil(layers/pp) layers against layers/pp), and under uneven tp pieces the rank holding
  the most (`ModelFacts.tp_busiest`: 3 heads over tp=2 are 2 and 1, 4/3 of an even half);
  and a fixed cost per step of the plan (each
  micro-batch runs its stage's kernels again; a tp rank's plan also starts, polls and waits
  for buckets, and under dp and tp together the gradient buckets are polled after each
  kernel of the backward). Under tp the non-matmul work and the
  activation memory are not all split: without sp the residual stream's layer norms, adds
  and dropout run whole on every tp rank; the split and the replicated parts come from the
  tp=2 and tp=2 sp=1 probes (`facts.TensorParallelFacts`);
* pipeline bubble: (pp - 1) / m of the compute (GPipe and 1F1B alike: in 1F1B's steady state
  a stage still waits for its neighbours' micro-batches, and a send is non-blocking on this
  runtime, so nothing else overlaps);
* tp: the collectives of a tp=2 (or tp=2 sp=1) rank by kind, scaled to the rows, per
  micro-batch and stage, each blocking (the next kernel reads it: nothing overlaps them) and
  each after compute (so each pays the machine's resynchronisation cost for the compute
  before it, `Machine.resync`; a gradient sum has one parameter's optimizer update before it);
  sp trades each all-reduce for a reduce-scatter and an all-gather (the same bytes, twice
  the latencies) for the split residual stream;
* pp: the sends between stages, one per micro-batch each way;
* dp: the gradient all-reduces over the dp ranks as the dp=2 probe's schedule runs them
  (`facts.DataParallelSync`): the blocking ones each whole (a model whose optimizer reads
  each gradient right after its sum, GPT here, gets only these: nothing overlaps), the
  bucketed ones overlapped as the runtime overlaps them: the machine's `bucket_overlap` o of
  each bucket's time t goes on while the backward computes (all buckets but the last hide
  behind what is left of the backward), the rest, (1 - o) t, costs the rank (on CPU ranks
  the cores that move the bytes are the ones computing: `hspmd profile` measured o near 0 on
  this project's 2-core machine). ZeRO: a
  reduce-scatter of each parameter's gradient and an all-gather of the parameter, per
  tensor, unbucketed and blocking;
* ep (a mixture-of-experts model): the batch splits over dp * ep ranks and the experts over
  ep, so a rank computes what a dp rank would; the all-to-alls of an ep=2 rank (tokens to the
  experts and back, and their gradients), scaled to the rows, blocking (priced with tp's
  collectives); the other parameters' gradients summed over dp * ep, the experts' over dp;
* memory: parameters, gradients and optimizer states of its shard (states over dp with
  ZeRO; experts over ep), and the activations of its rows (GPipe keeps every micro-batch's,
  1F1B at most pp).

Rough, by design: it ranks candidates, the measured run is the truth (`hspmd run --log`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hspmd.ir.devices import DeviceRange
from hspmd.planner.facts import ModelFacts, TensorParallelFacts
from hspmd.planner.machine import Machine

__all__ = ["GroupConfig", "GroupCost", "group_cost"]

#: bytes of one gradient all-reduce bucket (the runtime's default)
BUCKET_BYTES = 4 * 1024 * 1024
#: the backward's share of a step's compute (its matmuls are twice the forward's)
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class GroupConfig:
    """One device group of a candidate strategy."""

    devices: DeviceRange
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    sp: int = 0  # sequence parallelism over the tp ranks (needs tp > 1)
    ep: int = 1  # expert parallelism (a mixture-of-experts model): the batch splits over dp * ep
    recompute: str = "none"  # activation recompute: "block" or "selective" (`transforms/recompute.py`)

    def __post_init__(self) -> None:
        if not isinstance(self.devices, DeviceRange):
            object.__setattr__(self, "devices", DeviceRange.of(self.devices))


@dataclass(frozen=True)
class GroupCost:
    """A group's predicted step time, split by what it is made of, and its memory per rank."""

    compute_s: float
    bubble_s: float
    tp_s: float
    pp_s: float
    dp_s: float
    memory_bytes: float
    dp_hidden_s: float = 0.0  # the gradient all-reduce's time hidden behind the backward

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.tp_s + self.pp_s + self.dp_s

    def parts(self) -> dict[str, float]:
        return {"compute": self.compute_s, "pipeline bubble": self.bubble_s, "tp collectives": self.tp_s,
                "pipeline sends": self.pp_s, "dp gradient sync": self.dp_s}


def _ring_groups(config: GroupConfig) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Return one dp, one tp and one pp group of rank 0 of `config` (devices stage-major, then
    dp, then ep, then tp, as the strategy lays them out); with ep, the "dp" group is every rank
    that splits the batch (dp * ep of them)."""
    d = config.devices
    tp = d[: config.tp]
    dp = d[: config.dp * config.ep * config.tp: config.tp]
    pp = d[:: config.dp * config.ep * config.tp]
    return dp, tp, pp


def _ep_groups(config: GroupConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return rank 0's ep group (the ranks that swap tokens) and its dp group over the experts
    (the ranks holding the same experts)."""
    d, t, e = config.devices, config.tp, config.ep
    return d[: e * t: t], d[: config.dp * e * t: e * t]


def group_cost(facts: ModelFacts, machine: Machine, config: GroupConfig, rows: int, m: int = 1,
               schedule: str = "gpipe") -> GroupCost:
    """Return the cost of `config` computing `rows` of the batch in `m` micro-batches."""
    dp, tp, pp, ep = config.dp * config.ep, config.tp, config.pp, config.ep  # the batch splits over dp * ep
    # of the batch's work, per dp rank: the busiest (rows need not divide: the first ranks take one more)
    frac = math.ceil(rows / dp) * dp / facts.rows
    part = frac / dp  # one rank's part of the batch
    shard = tp * pp
    per_call = facts.mean_matmul_flops() * frac / (dp * tp * m)
    mm_rate = machine.slowest_matmul_rate(config.devices, per_call)
    ew_rate = machine.slowest_elementwise(config.devices)
    imbalance = math.ceil(facts.layers / pp) * pp / facts.layers if pp > 1 else 1.0
    imbalance *= facts.tp_busiest(tp)  # uneven tp pieces: the rank with the most heads sets the pace
    probe = (facts.sp if config.sp else facts.tp) if tp > 1 else None
    if probe is not None:  # what tensor parallelism replicates stays whole on every tp rank
        written = TensorParallelFacts.per_rank(facts.activation_bytes_written, probe.activation_bytes_written, tp)
        activations = TensorParallelFacts.per_rank(facts.activation_bytes, probe.activation_bytes, tp)
        ops = probe.ops
    else:
        written, activations, ops = facts.activation_bytes_written / tp, facts.activation_bytes / tp, facts.ops
    matmul_flops = facts.matmul_flops
    ratios = facts.recompute_ratios(config.recompute)
    if ratios is not None:
        # the forward again (all of each block's, or attention's core): the probe's FLOPs and kept
        # activations, measured on one device with that recompute
        grow, shrink = ratios
        matmul_flops, written, activations = matmul_flops * grow, written * grow, activations * shrink
    work = (matmul_flops * part / shard / mm_rate + written * part / pp / ew_rate) * imbalance
    update_s = facts.update_bytes_written / (shard * (dp if config.zero else 1)) / ew_rate
    compute = work + update_s
    steps = ops + (probe.steps if probe is not None else 0)
    sync = facts.ep.sync if ep > 1 and facts.ep is not None else facts.dp_sync
    # the dp sums go into buckets that overlap the backward, polled after each of its kernels: under
    # tp, where the probe's schedule has such buckets, and for the experts' sums over dp beside ep
    if dp > 1 and not config.zero and (tp > 1 or (sync is not None and sync.bucket_bytes)
                                        or (ep > 1 and config.dp > 1)):
        steps += BACKWARD_SHARE * ops
    compute += steps * m / pp * machine.op_overhead  # every micro-batch runs its stage's plan steps
    bubble = compute * (pp - 1) / m
    dp_group, tp_group, pp_group = _ring_groups(config)
    tp_s = 0.0
    if tp > 1 and probe is not None and probe.collectives:
        # each collective of a tp=2 rank, on this rank's rows per micro-batch, every micro-batch
        between = compute / max(1, sum(c for _, _, c in probe.collectives) * m)  # compute before each
        for kind, nbytes, calls in probe.collectives:
            n = max(1, round(calls * m / pp))
            tp_s += machine.collective(kind, tp_group, nbytes * part / m, n) + machine.resync(kind, tp_group, between, n)
    elif tp > 1:
        calls = max(1, round(facts.tp_calls * m / pp))
        tp_s = machine.collective("all_reduce", tp_group, facts.tp_bytes * frac / dp / pp / m, calls)
        tp_s += machine.resync("all_reduce", tp_group, compute / calls, calls)
    pp_s = 0.0
    if pp > 1:
        pp_s = 2 * machine.collective("send", pp_group[:2], facts.pp_bytes * frac / dp / m, m)
    grads = facts.param_bytes / shard * facts.tp_busiest(tp)
    dp_s = dp_hidden = 0.0
    if ep > 1 and facts.ep is not None:
        moe = facts.ep
        ep_group, expert_dp = _ep_groups(config)
        if moe.all_to_all[1]:  # the ep=2 rank's all-to-alls moved half the batch
            nbytes, calls = moe.all_to_all
            n = max(1, round(calls * m / pp))
            tp_s += machine.collective("all_to_all", ep_group, nbytes * 2 * part / m, n)
            tp_s += machine.resync("all_to_all", ep_group, compute / n, n)
        grads = (facts.param_bytes - moe.expert_param_bytes * (1 - 1 / ep)) / shard
        sync = moe.sync  # the other parameters' gradients: over every rank of the batch
        if sync.blocking_calls:
            dp_s = machine.collective("all_reduce", dp_group, sync.blocking_bytes / sync.blocking_calls / tp,
                                      max(1, round(sync.blocking_calls / pp)))
            dp_s += machine.resync("all_reduce", dp_group, update_s / sync.blocking_calls, calls=sync.blocking_calls)
        if config.dp > 1:  # the experts' gradients: over the ranks holding the same experts
            dp_s += machine.collective("all_reduce", expert_dp, moe.expert_param_bytes / moe.expert_tensors / ep
                                       / shard, max(1, round(moe.expert_tensors / pp)))
    elif dp > 1 and config.zero:  # per parameter: a reduce-scatter of its gradient, an all-gather of it
        calls = max(1, facts.param_tensors)
        # zero=3 gathers each parameter twice (its layer's forward and backward) and never after the update
        gathers = ("all_gather", "all_gather") if config.zero == 3 else ("all_gather",)
        dp_s = sum(machine.collective(k, dp_group, grads / calls, calls) for k in ("reduce_scatter", *gathers))
        dp_s += machine.resync("reduce_scatter", dp_group, update_s / calls, calls)
    elif dp > 1 and facts.dp_sync is not None:  # as the dp=2 probe's schedule runs them, on this shard
        sync = facts.dp_sync
        if sync.blocking_calls:
            calls = max(1, round(sync.blocking_calls / pp))
            dp_s = machine.collective("all_reduce", dp_group, sync.blocking_bytes / sync.blocking_calls / tp, calls)
            # between two sums runs one parameter's optimizer update (the schedule interleaves them)
            dp_s += machine.resync("all_reduce", dp_group, update_s / sync.blocking_calls, calls)
        if sync.bucket_bytes:
            nbytes = sum(sync.bucket_bytes) / shard
            buckets = max(1, math.ceil(len(sync.bucket_bytes) / pp))
            total = machine.collective("all_reduce", dp_group, nbytes / buckets, buckets)
            exposed = _exposed(total, buckets, BACKWARD_SHARE * work, machine.bucket_overlap)
            dp_s, dp_hidden = dp_s + exposed, total - exposed
    elif dp > 1:
        buckets = max(1, math.ceil(grads / BUCKET_BYTES))
        total = machine.collective("all_reduce", dp_group, grads / buckets, buckets)
        dp_s = _exposed(total, buckets, BACKWARD_SHARE * work, machine.bucket_overlap)
        dp_hidden = total - dp_s
    in_flight = 1.0 if schedule == "gpipe" or pp == 1 else min(pp, m) / m
    states = facts.state_bytes * (grads * shard / facts.param_bytes if ep > 1 and facts.param_bytes else 1.0)
    if config.zero == 3 and dp > 1:  # parameters and gradients sharded; one layer's weights gathered and its
        held = 2 * grads / dp + 2 * grads * min(1.0, 1 / max(1, facts.layers))  # gradient before the scatter
    else:
        held = 2 * grads
    memory = held + states / (shard * (dp if config.zero else 1)) + activations * part / pp * in_flight
    return GroupCost(compute, bubble, tp_s, pp_s, dp_s, memory, dp_hidden)


def _exposed(total: float, buckets: int, backward: float, overlap: float) -> float:
    """Return the part of `buckets` gradient buckets' all-reduce time `total` a rank waits for.

    The part `1 - overlap` costs the rank's own time; the rest goes over the network while the
    backward computes: bucket i (of n, in the order the backward makes their gradients) is
    ready after i/n of the `backward` seconds, so all but the last hide behind the
    backward's remaining (n-1)/n, and the last is waited for at the optimizer.
    """
    hideable = overlap * total
    return (1.0 - overlap) * total + max(hideable / buckets, hideable - backward * (buckets - 1) / buckets)
