"""Predicting a training step's time and memory per rank from a compiled program and a `DeviceProfile`.

`estimate_cost(groups, profile)` reads, for every rank, the schedule the runtime would run
(`codegen.schedule.build_schedule` of its group's `@train_step`: calls inlined, the pipeline
laid out, all-reduce buckets placed, buffers planned) and walks it once on a clock:

* **compute** per step of the schedule: `graph.matmul` / `graph.matmul_rhs_grad` by their
  FLOPs (2 m k n) at the rank's matmul rate for that many FLOPs (`DeviceProfile.matmul_seconds`),
  a stack of products (both operands batched: attention's per-head products) at the rate of
  one of them (64 products of 64x32 by 32x64 run at 90 GFLOP/s, not at the 170 of one
  product of all their FLOPs);
  a `kernel.fused` kernel by the bytes of its operands and results at the fused rate; every
  other kernel (elementwise, reductions, softmax, norms, embedding, optimizer updates,
  micro-batch sums) by the bytes of its operands and results at the elementwise rate; views
  (reshape, transpose, broadcast, split, slice, a micro-batch's slice) cost nothing.
* **blocking communication**: each collective by `DeviceProfile.time(kind, group, nbytes)`
  with the rank's group and the local operand's bytes (all_gather: the result's), plus the
  the profile's `resync_seconds` for the compute the rank did since its last blocking
  collective (the wait for a member the compute left behind, likelier the longer they
  computed apart: tp's collectives after whole kernels pay it, the gradient sums with only
  an optimizer update between them little);
  `comm.local_split` / `local_zero` are local (free); a `comm.recv` costs the link's time
  for its message; a `comm.send` is non-blocking in the runtime, so it costs the receiver,
  not the sender; a `comm.exchange` the time of the bytes the rank sends over the slowest
  link of its members. An op inside a repeated block counts once per call, since the
  schedule has inlined the calls.
* **overlap**: a gradient all-reduce bucket (`bucket-start` ... `bucket-wait`, see
  `codegen/schedule/buckets.py`) starts when the schedule starts it and takes the
  profile's all_reduce time t for its bytes. The profile's `bucket_overlap` o says how much
  of it can hide: (1 - o) t is the rank's own time at the start (on CPU ranks the cores
  that move the bytes are the ones computing), o t goes over the network, buckets one after
  another, while the rank computes on, and the rank waits at `bucket-wait` only for what is
  left. So `comm_s` counts every transfer and `exposed_comm_s` what the clock spent on them.
  `hspmd profile` measures o as the runtime runs a bucket (on the 2-core machine this was
  written on: 0 to 0.2, nothing hides); synthetic profiles default to 1 (a GPU's NCCL
  stream), `DeviceProfile.default_cpu` to 0. A *blocking* bucket (a coalesced all-reduce:
  nothing runs between its start and its wait) is one blocking collective of its bytes,
  priced as one (with its resynchronisation). A prefetched all-gather (`gather-start` ...
  `gather-wait`, `codegen/schedule/prefetch.py`) is priced the same way, with the all-gather's
  time for its bytes.
* **pipeline bubbles**: in a stage's program the steps of micro-batch i are known, and which
  of the stage's `@pipeline_forward` / `@pipeline_backward` they belong to. Per stage s,
  F_s and B_s are the slowest of its ranks' forward and backward time per micro-batch; the
  stages of one pipeline (found through their send/recv pairs) run m micro-batches in
  ``sum_s F_s + (m-1) max_s F_s + sum_s B_s + (m-1) max_s B_s`` (GPipe and 1F1B have the
  same bubble: 1F1B changes memory, not time); a stage rank's `bubble_s` is that minus its
  own m (F + B).
* **the step**: a rank's own time is compute + exposed communication + bubble; groups run in
  parallel, and every rank meets the others at the gradient sums (within a data-parallel
  group at every all-reduce, across heterogeneous groups at the cross-group sum), so the
  step takes the slowest rank's time (`step_s`), and each rank's `wait_s` is how long it
  waits for the slowest.
* **memory**: `peak_bytes` is the schedule's own `peak_bytes` (what `hspmd compile --report`
  and the runtime's plan report).

Not modelled: contention between ranks that share cores or links (the profile, measured
with all ranks at once, holds some of it); MPI's algorithm switches by message size beyond
the profile's alpha-beta fits; cache effects between kernels; the cost of copying operands
into a bucket; Python's per-step overhead (a few microseconds per step of the schedule,
kernels, sums, bucket starts and waits and the polls between: `overhead_s`, default 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation

from hspmd.codegen.report import bytes_sent, tensor_nbytes
from hspmd.codegen.schedule import build_schedule
from hspmd.codegen.schedule.analysis import op_matmul_flops
from hspmd.codegen.schedule.buckets import group_of
from hspmd.codegen.schedule.model import Schedule, nbytes
from hspmd.dialects import comm, graph, pipeline
from hspmd.dialects.comm import groups_of
from hspmd.dialects.levels import physical_groups
from hspmd.ir.device_profile import DeviceProfile

__all__ = ["CostError", "CostEstimate", "RankCost", "comm_seconds", "compute_seconds", "estimate_cost", "step_costs"]

STEP = "train_step"
# ops whose result is a view of an operand: no work (codegen/schedule/memory.py's list)
_VIEWS = ("graph.reshape", "graph.transpose", "graph.broadcast", "graph.split", "graph.slice")
_FREE = ("comm.local_split", "comm.local_zero", "comm.send", "graph.parameter", "graph.input",
         "graph.constant", "graph.output", "graph.assign")
_COLLECTIVE_KIND = {
    "comm.all_reduce": "all_reduce", "comm.all_gather": "all_gather", "comm.reduce_scatter": "reduce_scatter",
    "comm.all_to_all": "all_to_all", "comm.broadcast": "broadcast",
}


class CostError(ValueError):
    """The program cannot be costed with this profile (too few ranks, no step function)."""


@dataclass(frozen=True)
class RankCost:
    """The predicted time of one step on one rank, in seconds, and its peak memory.

    `compute_s`: kernels; `comm_s`: every transfer the rank takes part in (hidden or not);
    `exposed_comm_s`: the communication the rank waits for (blocking collectives, receives,
    the unhidden rest of buckets); `bubble_s`: idle in the pipeline schedule; `wait_s`: idle
    waiting for the slowest rank of the step; `peak_bytes`: the schedule's peak memory.
    """

    rank: int
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    bubble_s: float
    peak_bytes: int
    wait_s: float = 0.0

    @property
    def busy_s(self) -> float:
        """Return the rank's own step time: compute + exposed communication + bubble."""
        return self.compute_s + self.exposed_comm_s + self.bubble_s


@dataclass(frozen=True)
class CostEstimate:
    """A step's predicted time (`step_s`, the slowest rank's) and every rank's `RankCost`."""

    step_s: float
    ranks: list[RankCost] = field(default_factory=list)
    profile_source: str = ""

    @property
    def slowest_rank(self) -> int:
        """Return the rank whose own time sets the step time."""
        return max(self.ranks, key=lambda r: r.busy_s).rank

    @property
    def peak_bytes(self) -> int:
        """Return the largest peak memory of any rank."""
        return max((r.peak_bytes for r in self.ranks), default=0)

    def format(self) -> str:
        """Return a readable table: one line per rank (milliseconds, MiB), then the step time."""
        header = ["rank", "compute ms", "comm ms", "exposed ms", "bubble ms", "wait ms", "busy ms", "peak MiB"]
        rows = [[str(r.rank), f"{r.compute_s * 1e3:.2f}", f"{r.comm_s * 1e3:.2f}", f"{r.exposed_comm_s * 1e3:.2f}",
                 f"{r.bubble_s * 1e3:.2f}", f"{r.wait_s * 1e3:.2f}", f"{r.busy_s * 1e3:.2f}",
                 f"{r.peak_bytes / 2**20:.1f}"] for r in self.ranks]
        widths = [max(len(x[i]) for x in (header, *rows)) for i in range(len(header))]
        lines = ["predicted step cost" + (f" (profile: {self.profile_source})" if self.profile_source else "")]
        lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(x, widths)) for x in (header, *rows)]
        lines.append(f"  step: {self.step_s * 1e3:.2f} ms (rank {self.slowest_rank} is the slowest)")
        return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# one op


def _moved(op: Operation) -> int:
    """Return the bytes a kernel reads and writes: its tensor operands and results."""
    return sum(tensor_nbytes(v.type) for v in op.operands) + sum(tensor_nbytes(v.type) for v in op.results)


def compute_seconds(op: Operation, rank: int, profile: DeviceProfile) -> float:
    """Return the predicted time of the kernel of non-communication op `op` on `rank`."""
    if op.name in _VIEWS or op.name in _FREE:
        return 0.0
    if isinstance(op, (graph.MatmulOp, graph.ExpertMatmulOp, graph.MatmulRhsGradOp, graph.ExpertMatmulRhsGradOp)):
        flops = op_matmul_flops(op)
        return profile.matmul_seconds(rank, flops, flops / _products(op))
    if op.name == "kernel.fused":
        return profile.fused_seconds(rank, _moved(op))
    return profile.elementwise_seconds(rank, _moved(op))


def _products(op: Operation) -> int:
    """Return how many separate products a matmul op runs: a stack of them where both operands
    have batch dims (attention's per-head products, each small), else one (the runtime merges a
    batch of rows times one matrix, and a weight gradient's rows, into one product)."""
    if isinstance(op, graph.MatmulOp):
        a, b = (v.type.get_shape() for v in op.operands)  # type: ignore[attr-defined]
        if len(a) > 2 and len(b) > 2:
            return int(np.prod(op.results[0].type.get_shape()[:-2], dtype=np.int64))  # type: ignore[attr-defined]
    return 1


def comm_seconds(op: Operation, rank: int, profile: DeviceProfile) -> float:
    """Return the time `rank` spends blocked in communication op `op` (0 for local and send ops)."""
    kind = _COLLECTIVE_KIND.get(op.name)
    if kind is not None:
        group = group_of(op.rank_groups, rank, op)  # type: ignore[attr-defined]
        value = op.results[0] if kind == "all_gather" else op.operands[0]
        return profile.time(kind, group, tensor_nbytes(value.type))
    if isinstance(op, comm.RecvOp):
        src = next((s for s, d in groups_of(op.pairs) if d == rank), rank)
        return profile.p2p_seconds(src, rank, tensor_nbytes(op.result.type))
    if isinstance(op, comm.ExchangeOp):
        sent = bytes_sent(op, (rank,))
        members = [m for m in op.members() if m < profile.num_ranks]
        return profile.slowest_link(members).seconds(sent) if sent else 0.0
    return 0.0


# ---------------------------------------------------------------------------------------------
# one rank


def _phase(op: Operation) -> str:
    """Return "forward" or "backward" for an op of a stage's `@pipeline_forward` / `@pipeline_backward`."""
    parent = op.parent_op()
    while parent is not None and not isinstance(parent, func.FuncOp):
        parent = parent.parent_op()
    name = parent.sym_name.data if parent is not None else ""
    return "backward" if name == "pipeline_backward" else "forward"


@dataclass
class _Walk:
    """The clock of one rank over its schedule."""

    compute: float = 0.0
    comm: float = 0.0
    exposed: float = 0.0
    per_mb: dict[str, float] = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0})


def _walk(schedule: Schedule, rank: int, profile: DeviceProfile, overhead_s: float) -> _Walk:
    w = _Walk()
    now, net_free = 0.0, 0.0
    done: dict[int, float] = {}
    gathered: dict[int | None, float] = {}  # a prefetched gather -> when its bytes have arrived
    apart = 0.0  # seconds computed since the last blocking collective: the members may have drifted apart
    for step in schedule.steps:
        spent = 0.0
        if step.kind == "op" and step.op is not None:
            op = step.op
            if op.dialect_name() == "comm":
                spent = comm_seconds(op, rank, profile)
                kind = _COLLECTIVE_KIND.get(op.name)
                if kind is not None:
                    group = group_of(op.rank_groups, rank, op)  # type: ignore[attr-defined]
                    spent += profile.resync_seconds(kind, group, apart)
                    apart = 0.0
                w.comm += spent
                w.exposed += spent
            else:
                spent = compute_seconds(op, rank, profile) + overhead_s
                apart += spent
                w.compute += spent
            if step.microbatch is not None:
                w.per_mb[_phase(op)] += spent
        elif step.kind == "sum":
            spent = profile.elementwise_seconds(rank, 3 * sum(
                _slot_bytes(schedule, s) for s in step.outs)) + overhead_s
            w.compute += spent
        elif step.kind == "poll":  # a Python call of the plan like any kernel's (MPI's test inside)
            spent = overhead_s
            w.exposed += spent
        elif step.kind == "bucket-start" and step.bucket is not None and schedule.buckets[step.bucket].blocking:
            # a coalesced all-reduce: one blocking collective of all its tensors' bytes
            spec = schedule.buckets[step.bucket]
            t = profile.time("all_reduce", spec.group, spec.nbytes())
            spent = t + profile.resync_seconds("all_reduce", spec.group, apart) + overhead_s
            apart = 0.0
            w.comm += t
            w.exposed += spent
            done[step.bucket] = now + spent
        elif step.kind == "bucket-start" and step.bucket is not None:
            spec = schedule.buckets[step.bucket]
            t = profile.time("all_reduce", spec.group, spec.nbytes())
            # the part that cannot hide costs the rank's own time (its cores move the bytes);
            # the rest goes over the network while the clock runs on
            spent = (1.0 - profile.bucket_overlap) * t + overhead_s
            w.exposed += spent
            start = max(now + spent, net_free)
            net_free = done[step.bucket] = start + profile.bucket_overlap * t
            w.comm += t
        elif step.kind == "bucket-wait" and step.bucket is not None:
            spent = max(0.0, done.get(step.bucket, now) - now) + overhead_s
            w.exposed += spent
        elif step.kind == "gather-start" and step.op is not None:
            t = comm_seconds(step.op, rank, profile)
            spent = (1.0 - profile.bucket_overlap) * t + overhead_s  # as a bucket's start
            w.exposed += spent
            start = max(now + spent, net_free)
            net_free = gathered[step.gather] = start + profile.bucket_overlap * t
            w.comm += t
        elif step.kind == "gather-wait":
            spent = max(0.0, gathered.get(step.gather, now) - now) + overhead_s
            w.exposed += spent
        elif step.kind == "gather-poll":
            spent = overhead_s
            w.exposed += spent
        now += spent
    return w


def _slot_bytes(schedule: Schedule, slot: int) -> int:
    return nbytes(schedule.slot_types[slot])


# ---------------------------------------------------------------------------------------------
# the program


def _step_function(module: ModuleOp) -> func.FuncOp | None:
    return next((op for op in module.body.block.ops if isinstance(op, func.FuncOp) and op.sym_name.data == STEP),
                None)


def _run_op(fn: func.FuncOp) -> pipeline.RunOp | None:
    return next((op for op in fn.walk() if isinstance(op, pipeline.RunOp)), None)


def _message_links(module: ModuleOp) -> list[tuple[int, int]]:
    """Return the (src, dst) pairs of the sends and receives of a group module."""
    out = []
    for op in module.walk():
        if isinstance(op, (comm.SendOp, comm.RecvOp)):
            out += [(s, d) for s, d in groups_of(op.pairs)]
    return out


def _pipelines(stage_ranks: dict[int, tuple[int, int, int]], links: list[tuple[int, int]]) -> list[set[int]]:
    """Return the ranks of each pipeline: stage ranks joined by their messages (union-find)."""
    parent = {r: r for r in stage_ranks}

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for a, b in links:
        if a in parent and b in parent:
            parent[find(a)] = find(b)
    comps: dict[int, set[int]] = {}
    for r in stage_ranks:
        comps.setdefault(find(r), set()).add(r)
    return list(comps.values())


def step_costs(groups: Sequence[tuple[Sequence[int], ModuleOp]], profile: DeviceProfile, *,
               bucket_bytes: int | None = -1, overhead_s: float = 0.0) -> CostEstimate:
    """Return the cost of one step of the device groups `groups` ((devices, group module) pairs:
    `Compiled.kernel_groups()` or `physical_groups(module)`) under `profile` (module docstring).

    `bucket_bytes` is passed to `build_schedule` (-1: the runtime's default); `overhead_s` is
    added to every kernel (Python's dispatch cost, if you want it modelled).
    """
    walks: dict[int, _Walk] = {}
    peaks: dict[int, int] = {}
    stage_of: dict[int, tuple[int, int, int]] = {}  # rank -> (stage, stages, microbatches)
    links: list[tuple[int, int]] = []
    for devices, module in groups:
        fn = _step_function(module)
        if fn is None:
            raise CostError(f"device group {list(devices)} has no @{STEP}")
        run = _run_op(fn)
        links += _message_links(module)
        for rank in devices:
            if rank >= profile.num_ranks:
                raise CostError(f"the program runs on rank {rank}, but the profile describes "
                                f"{profile.num_ranks} ranks")
            schedule = build_schedule(fn, rank, bucket_bytes=bucket_bytes)
            walks[rank] = _walk(schedule, rank, profile, overhead_s)
            peaks[rank] = schedule.peak_bytes
            if run is not None:
                stage_of[rank] = (run.stage.value.data, run.stages.value.data, run.microbatches.value.data)
    bubbles = _bubbles(walks, stage_of, links)
    costs = [RankCost(r, w.compute, w.comm, w.exposed, bubbles.get(r, 0.0), peaks[r]) for r, w in sorted(walks.items())]
    step = max((c.busy_s for c in costs), default=0.0)
    costs = [RankCost(c.rank, c.compute_s, c.comm_s, c.exposed_comm_s, c.bubble_s, c.peak_bytes, step - c.busy_s)
             for c in costs]
    return CostEstimate(step, costs, profile.source)


def _bubbles(walks: dict[int, _Walk], stage_of: dict[int, tuple[int, int, int]],
             links: list[tuple[int, int]]) -> dict[int, float]:
    """Return each pipeline rank's idle time in its pipeline's schedule (module docstring)."""
    out: dict[int, float] = {}
    for ranks in _pipelines(stage_of, links):
        m = max(stage_of[r][2] for r in ranks)
        per_stage: dict[int, tuple[float, float]] = {}
        for r in ranks:
            s = stage_of[r][0]
            f, b = walks[r].per_mb["forward"] / m, walks[r].per_mb["backward"] / m
            pf, pb = per_stage.get(s, (0.0, 0.0))
            per_stage[s] = (max(pf, f), max(pb, b))
        fs = [f for f, _ in per_stage.values()]
        bs = [b for _, b in per_stage.values()]
        makespan = sum(fs) + (m - 1) * max(fs) + sum(bs) + (m - 1) * max(bs)
        for r in ranks:
            own = walks[r].per_mb["forward"] + walks[r].per_mb["backward"]
            out[r] = max(0.0, makespan - own)
    return out


def estimate_cost(program: ModuleOp | Sequence[tuple[Sequence[int], ModuleOp]], profile: DeviceProfile, *,
                  bucket_bytes: int | None = -1, overhead_s: float = 0.0) -> CostEstimate:
    """Return the cost of one training step of `program` on the ranks of `profile`.

    `program` is a physical module (its device groups are read with `physical_groups`) or a
    list of (devices, group module) pairs, e.g. `Compiled.kernel_groups()` (the fused
    program `hspmd run` runs by default). See `step_costs` for the options.
    """
    groups = list(physical_groups(program)) if isinstance(program, ModuleOp) else list(program)
    return step_costs(groups, profile, bucket_bytes=bucket_bytes, overhead_s=overhead_s)
