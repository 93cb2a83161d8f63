"""A paper plan for many GPUs: synthetic H100 device profiles and the cost model's predictions.

    python tools/gpu_paper_plan.py                      # both models, 8 and 16 GPUs (a few minutes)
    python tools/gpu_paper_plan.py --models gpt2-small --no-plan
    python tools/gpu_paper_plan.py --write-profiles DIR # h100x8.json, h100x16.json for --profile
    python tools/gpu_paper_plan.py --write-profiles DIR --gpus 16384 --slow-nodes 0.333
                                                        # h100x16384.json and h100x16384-slow.json

Nothing here runs on a GPU. It writes down, as hspmd's own `DeviceProfile` data, what
`hspmd profile` would measure on (a) one node of 8 H100 SXM GPUs joined by NVLink 4 through
NVSwitch and (b) two such nodes joined by InfiniBand, and asks the project's cost model (the
code `hspmd compile --cost` runs: `codegen.cost_model.estimate_cost` over the compiled
program's kernel groups) and planner (`planner.model_facts` + `planner.plan`, what
`hspmd plan` / `--strategy auto` run) what they predict for GPT-2-small and a 1.3B GPT
(GPT-3 XL's shape) under dp/tp/pp strategies. These are predictions, not measurements; the
numbers behind them, and what they leave out, are in `docs/gpus.md`.

The hardware assumptions (`H100Node`), each a published peak times an assumed achieved fraction:

* matmuls in bfloat16 on the tensor cores (the models compile with `precision=bfloat16`, float32
  master weights, as Megatron-LM trains): dense peak 989 TFLOP/s (NVIDIA H100 datasheet, SXM5;
  1979 is with 2:4 sparsity). The profile's matmul table (rate by the FLOPs of one product)
  reaches 700 TFLOP/s (71 %) for products of 1e11 FLOPs and falls off for small ones; its
  points at 1e8-1e9 FLOPs stand for attention's per-head products run as one strided-batched
  GEMM (the cost model prices a stack of products at the rate of one of them), which are
  bound by memory: 1024x64 by 64x1024 moves about 57 FLOPs per byte, under 200 TFLOP/s at
  3.35 TB/s;
* elementwise and fused kernels by the bytes they move: HBM3 3.35 TB/s peak (datasheet),
  70 % achieved for a plain kernel, 80 % for a fused one;
* NVLink 4: 900 GB/s per GPU both ways, 450 GB/s each way (datasheet); NCCL's bus bandwidth
  inside a node taken as 80 % of it, 360 GB/s (NVLink SHARP, NVLS, would give more for
  all-reduce; not assumed);
* InfiniBand: one ConnectX-7 NDR 400 Gb/s (50 GB/s) NIC per GPU, 8 per node, as a DGX H100
  has for its compute fabric, a rail-optimised non-blocking fabric; 80 % achieved, 40 GB/s
  per GPU, 320 GB/s per node each way;
* latencies: 5 us to start a collective (kernel launch and handshake), 1 us per ring step over
  NVLink, 4 us per step that crosses InfiniBand; point-to-point 6 us over NVLink, 10 us over IB.

Collectives follow NCCL's algorithms as alpha-beta formulas (`collective_seconds`): a ring over
n ranks moves 2(n-1)/n of the buffer per rank for an all-reduce at the group's bus bandwidth
(NVLink inside a node; across nodes NCCL runs one ring per NIC, so the bus bandwidth is
min(NVLink, g x NIC) for g GPUs of the group per node); across nodes also NCCL's tree (a chain
inside the node, a binary tree between nodes: logarithmic latency, taken at 80 % of the ring's
bandwidth) and the hierarchical form (reduce-scatter inside the node, all-reduce of 1/g of the
buffer between nodes over every GPU's own NIC at once, all-gather inside the node); at each
size the fastest, as NCCL's tuner picks. Each fit is stored with `points` at sizes 1 KiB to
4 GiB, so `DeviceProfile.time` reads the piecewise line of the fastest algorithm, for every
regular group (contiguous blocks and strided sets of 2, 4, 8, 16 ranks: every tp, dp and pp
group the strategies below make).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from hspmd.ir.device_profile import (
    COLLECTIVES,
    CollectiveFit,
    DeviceProfile,
    Link,
    MatmulPoint,
    RankRates,
    Topology,
)

__all__ = [
    "MODELS",
    "H100Node",
    "ModelShape",
    "Prediction",
    "collective_seconds",
    "make_profile",
    "model_flops",
    "plan_choice",
    "predict",
    "strategies_for",
]

GPT_SCRIPT = os.path.join(ROOT, "examples", "gpt.py")
#: usable memory per 80 GB H100 (about 79.6 GiB on the device; 10 % kept for the CUDA context,
#: NCCL's buffers and cuBLAS workspaces)
MEMORY_PER_GPU = 72 * 2**30
#: a GPU kernel's cost whatever its size inside a replayed CUDA graph (launch gaps), for the
#: planner's `op_overhead` and the second step column
KERNEL_GAP_S = 2e-6


@dataclass(frozen=True)
class H100Node:
    """The hardware a profile describes (module docstring): `nodes` nodes of `gpus_per_node` H100 SXM."""

    nodes: int = 1
    gpus_per_node: int = 8
    bf16_peak_flops: float = 989.4e12
    #: (FLOPs of one product, achieved TFLOP/s): launch-bound below, memory-bound in the middle
    matmul_table: tuple[tuple[float, float], ...] = (
        (1e6, 0.3), (1e7, 3.0), (1e8, 120.0), (1e9, 300.0), (1e10, 600.0), (1e11, 700.0))
    hbm_bps: float = 3.35e12
    elementwise_eff: float = 0.70
    fused_eff: float = 0.80
    nvlink_bps: float = 450e9  # per GPU, each way
    nvlink_eff: float = 0.80
    nic_bps: float = 50e9  # one NDR 400 Gb/s NIC per GPU
    nic_eff: float = 0.80
    start_s: float = 5e-6
    nvlink_step_s: float = 1e-6
    ib_step_s: float = 4e-6
    nvlink_p2p_s: float = 6e-6
    ib_p2p_s: float = 10e-6
    tree_eff: float = 0.80
    #: nodes under one set of leaf switches (a DGX SuperPOD scalable unit: 32 nodes, 256 GPUs); a
    #: ring step between pods crosses the spine, `pod_step_s` more
    pod_nodes: int = 32
    pod_step_s: float = 2e-6
    #: the nodes (the last ones) whose GPUs compute at `slow_speed` of the others (0: none)
    slow_nodes: int = 0
    slow_speed: float = 0.5
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def n(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    @property
    def nvlink_busbw(self) -> float:
        return self.nvlink_bps * self.nvlink_eff

    @property
    def nic_bw(self) -> float:
        return self.nic_bps * self.nic_eff

    def describe(self) -> str:
        what = f"{self.gpus_per_node} H100 SXM over NVLink/NVSwitch"
        if self.nodes > 1:
            what = f"{self.nodes} nodes x {what}, InfiniBand NDR 400 Gb/s, one NIC per GPU"
        if self.nodes > self.pod_nodes:
            what += f", rail-optimised, pods of {self.pod_nodes} nodes"
        if self.slow_nodes:
            what += f"; the last {self.slow_nodes} nodes at {self.slow_speed:g}x speed"
        return what

    def topology(self) -> Topology:
        """Return the profile's topology: nodes, pods, NVLink inside a node, a NIC per GPU between
        nodes, and NCCL's algorithms over them (`hspmd.ir.device_profile.Topology`)."""
        return Topology(self.gpus_per_node, self.pod_nodes, self.start_s, self.nvlink_step_s, self.ib_step_s,
                        self.pod_step_s, self.nvlink_busbw, self.nic_bw, Link(self.nvlink_p2p_s, self.nvlink_busbw),
                        Link(self.ib_p2p_s, self.nic_bw), self.tree_eff)


def collective_seconds(hw: H100Node, kind: str, group: Sequence[int], nbytes: float) -> tuple[float, str]:
    """Return (seconds, algorithm) of collective `kind` over `group` for a rank's buffer of
    `nbytes` (all_gather: the result), the fastest of NCCL's algorithms (module docstring):
    `Topology.seconds` of the machine's topology, the formulas hspmd's profiles carry."""
    return hw.topology().seconds(kind, group, nbytes)


def regular_groups(n: int) -> list[tuple[int, ...]]:
    """Return every group of 2, 4, 8 ... ranks of 0..n-1 that is an aligned block of stride d
    (tp groups are contiguous, dp and pp groups strided: `planner.cost._ring_groups`)."""
    out = []
    size = 2
    while size <= n:
        stride = 1
        while size * stride <= n:
            for block in range(0, n, size * stride):
                for off in range(stride):
                    out.append(tuple(block + off + k * stride for k in range(size)))
            stride *= 2
        size *= 2
    return out


#: sizes the fits are tabulated at: 1 KiB to 4 GiB, 4 per octave pair
SIZES = tuple(float(2 ** (10 + k / 2)) for k in range(45))


#: above this many GPUs a profile carries its topology (nodes, pods, formulas) instead of every
#: link and a fit per regular group, and its ranks as classes
TOPOLOGY_ABOVE = 16


def make_profile(hw: H100Node) -> DeviceProfile:
    """Return the synthetic `DeviceProfile` of `hw`: every GPU alike (but `slow_nodes`), links by
    node, collective fits of NCCL's algorithms for every regular group; above `TOPOLOGY_ABOVE`
    GPUs the topology itself (its formulas are the fits' source), ranks as classes."""
    points = tuple(MatmulPoint(f, t * 1e3, (0, 0, 0)) for f, t in hw.matmul_table)
    rates = RankRates(points, hw.hbm_bps * hw.elementwise_eff, hw.hbm_bps * hw.fused_eff)
    nv = Link(hw.nvlink_p2p_s, hw.nvlink_busbw)
    ib = Link(hw.ib_p2p_s, hw.nic_bw)
    if hw.n > TOPOLOGY_ABOVE:
        slow = rates.scaled(hw.slow_speed)
        first_slow = (hw.nodes - hw.slow_nodes) * hw.gpus_per_node
        return DeviceProfile(
            tuple(rates if r < first_slow else slow for r in range(hw.n)), ib, topology=hw.topology(),
            source=f"synthetic (tools/gpu_paper_plan.py): {hw.describe()}; published peaks x assumed efficiencies",
            meta={"hosts": [], "devices": "NVIDIA H100 SXM5 80GB (assumed)", "nodes": hw.nodes,
                  "gpus_per_node": hw.gpus_per_node},
            bucket_overlap=1.0)
    links = {(a, b): (nv if hw.node_of(a) == hw.node_of(b) else ib)
             for a in range(hw.n) for b in range(hw.n) if a != b}
    fits = []
    for group in regular_groups(hw.n):
        for kind in COLLECTIVES:
            pts = [(s, collective_seconds(hw, kind, group, s)[0]) for s in SIZES]
            fits.append(CollectiveFit.from_points(kind, group, pts))
    return DeviceProfile(
        tuple(rates for _ in range(hw.n)), ib if hw.nodes > 1 else nv, links, tuple(fits),
        source=f"synthetic (tools/gpu_paper_plan.py): {hw.describe()}; published peaks x assumed efficiencies",
        meta={"hosts": [], "devices": ["NVIDIA H100 SXM5 80GB (assumed)"] * hw.n, "nodes": hw.nodes},
        bucket_overlap=1.0)


# ---------------------------------------------------------------------------------------------
# the models and the strategies


@dataclass(frozen=True)
class ModelShape:
    """A GPT shape for examples/gpt.py and its global batch (sequences per step)."""

    name: str
    layers: int
    d_model: int
    heads: int
    seq_len: int
    batch: int
    vocab: int = 50304  # GPT-2's 50257 padded to a multiple of 128, as Megatron-LM pads it

    def overrides(self) -> dict:
        return {"model.layers": self.layers, "model.d_model": self.d_model, "model.heads": self.heads,
                "model.seq_len": self.seq_len, "model.vocab_size": self.vocab, "data.batch_size": self.batch,
                "precision": "bfloat16"}

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def params(self) -> float:
        """Return the parameters of examples/gpt.py: 12 l h^2 (1 + 13/(12h)) in the layers, the
        embedding and the output head (not tied: 2 V h) and learned positions (s h)."""
        h, l = self.d_model, self.layers
        return 12 * l * h * h * (1 + 13 / (12 * h)) + (2 * self.vocab + self.seq_len) * h


MODELS = {
    # GPT-2 small's shape (124M parameters with GPT-2's tied embedding; 163M with this script's
    # separate output head), 64 sequences of 1024 per step
    "gpt2-small": ModelShape("GPT-2 small", 12, 768, 12, 1024, 64),
    # GPT-3 XL (Brown et al. 2020, Table 2.1: 1.3B, 24 layers, d 2048, 16 heads of 128), 32 of 2048
    "gpt-1.3b": ModelShape("GPT 1.3B (GPT-3 XL)", 24, 2048, 16, 2048, 32),
}


def model_flops(shape: ModelShape) -> float:
    """Return a step's model FLOPs (no recomputation): 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) —
    Narayanan et al. 2021's formula with 3 passes, not the 4 it counts with recomputation."""
    b, s, l, h, v = shape.batch, shape.seq_len, shape.layers, shape.d_model, shape.vocab
    return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def strategies_for(n: int, batch: int, heads: int = 16) -> list[tuple[str, int]]:
    """Return (strategy text, micro-batches) to price on `n` GPUs for a batch of `batch` rows and
    a model of `heads` heads (a tp that does not divide them runs in uneven pieces, which the
    compiler lays out only without pp: such pipelines are left out)."""
    last = f"[0-{n - 1}]"
    out = [(f"{last}: dp={n}", 1), (f"{last}: dp={n} zero=1", 1), (f"{last}: dp={n // 2} tp=2", 1),
           (f"{last}: dp={n // 4} tp=4", 1), (f"{last}: dp={n // 8} tp=8", 1) if n > 8 else (f"{last}: tp=8", 1),
           (f"{last}: dp={n // 2} pp=2", 4), (f"{last}: dp={n // 4} tp=2 pp=2", 8)]
    if n >= 16:
        out += [(f"{last}: dp={n // 8} tp=4 pp=2", 8), (f"{last}: tp=8 pp=2", 8)]
    return [(s, m) for s, m in out if batch % (_dp(s) * m) == 0 and (m == 1 or heads % _tp(s) == 0)]


def _degree(strategy: str, key: str) -> int:
    part = [p for p in strategy.split() if p.startswith(key + "=")]
    return int(part[0][len(key) + 1:]) if part else 1


def _dp(strategy: str) -> int:
    return _degree(strategy, "dp")


def _tp(strategy: str) -> int:
    return _degree(strategy, "tp")


@dataclass(frozen=True)
class Prediction:
    """The cost model's prediction of one strategy (seconds, bytes)."""

    model: str
    gpus: int
    strategy: str
    microbatches: int
    step_s: float
    step_gap_s: float  # with KERNEL_GAP_S per kernel (nan: not asked for)
    peak_bytes: int
    compute_s: float
    matmul_s: float  # of compute_s, the matmuls (the rest moves bytes: elementwise and fused kernels)
    exposed_comm_s: float
    bubble_s: float
    model_flops: float
    tokens: int
    peak_flops: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_s * self.gpus * self.peak_flops)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= MEMORY_PER_GPU


def _script(shape: ModelShape):
    from hspmd.frontend.script import load_script

    return load_script(GPT_SCRIPT, shape.overrides())


def matmul_seconds(groups, rank: int, profile: DeviceProfile) -> float:
    """Return the time `rank`'s step spends in matmuls (of its compute; the rest moves bytes)."""
    from hspmd.codegen.cost_model import _step_function, compute_seconds
    from hspmd.codegen.schedule import build_schedule
    from hspmd.dialects import graph

    module = next(m for devices, m in groups if rank in devices)
    kinds = (graph.MatmulOp, graph.ExpertMatmulOp, graph.MatmulRhsGradOp, graph.ExpertMatmulRhsGradOp)
    return sum(compute_seconds(s.op, rank, profile) for s in build_schedule(_step_function(module), rank).steps
               if s.kind == "op" and isinstance(s.op, kinds))


def predict(shape: ModelShape, strategy: str, profile: DeviceProfile, microbatches: int = 1,
            hw: H100Node | None = None, level: str = "kernel", gaps: bool = False) -> Prediction:
    """Compile examples/gpt.py at `shape` under `strategy` and return the cost model's prediction
    on `profile` (what `hspmd compile --cost --profile` prints, read as numbers).

    `level="kernel"` costs the kernel level (`Compiled.kernel_groups()`, what `--cost` costs);
    `"device"` the GPU program of `hspmd run --device cuda` (`device_groups()`: the 16-bit
    chains fused as well), which part 1 of the GPU runtime builds for one rank only."""
    from hspmd.codegen.cost_model import estimate_cost
    from hspmd.compiler import compile_script

    n = profile.num_ranks
    compiled = compile_script(_script(shape), strategy, n, microbatches=microbatches,
                              pipeline_schedule="1f1b" if microbatches > 1 else None)
    groups = compiled.kernel_groups() if level == "kernel" else compiled.device_groups()
    est = estimate_cost(groups, profile)
    gap = estimate_cost(groups, profile, overhead_s=KERNEL_GAP_S) if gaps else None
    slow = est.ranks[est.slowest_rank]
    return Prediction(shape.name, n, strategy, microbatches, est.step_s, gap.step_s if gap else math.nan, est.peak_bytes,
                      slow.compute_s, matmul_seconds(groups, est.slowest_rank, profile), slow.exposed_comm_s, slow.bubble_s,
                      model_flops(shape), shape.tokens,
                      (hw or H100Node()).bf16_peak_flops)


def model_facts_for(shape: ModelShape, max_devices: int = 16):
    """Return the planner's facts of examples/gpt.py at `shape` (its probe compiles), as `hspmd plan` reads them."""
    from hspmd.planner import model_facts

    return model_facts(_script(shape), max_devices)


# ---------------------------------------------------------------------------------------------
# next to Megatron-LM's Table 1 (GPT-3 family, 32 to 3,072 A100)


def a100_node(nodes: int) -> H100Node:
    """Return `nodes` nodes of 8 A100 SXM 80 GB as Selene has them (the paper's section 5): the
    H100 machine's assumptions with the A100's published peaks: bfloat16 312 TFLOP/s dense (the
    matmul table scaled by 312/989, so the same 71 % at the largest products), HBM2e 2.04 TB/s,
    NVLink 3 600 GB/s per GPU both ways (300 each way), one HDR 200 Gb/s (25 GB/s) NIC per GPU."""
    scale = 312e12 / 989.4e12
    return replace(H100Node(nodes=nodes), bf16_peak_flops=312e12,
                   matmul_table=tuple((f, t * scale) for f, t in H100Node().matmul_table),
                   hbm_bps=2.039e12, nvlink_bps=300e9, nic_bps=25e9)


@dataclass(frozen=True)
class MegatronRow:
    """One row of Narayanan et al. 2021 (SC'21), Table 1: the model, its parallelism and what they measured."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float  # achieved, counting activation recomputation's extra forward
    peak_percent: int

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def shape(self) -> ModelShape:
        return ModelShape(f"GPT {self.params_b:g}B", self.layers, self.hidden, self.heads, 2048, self.batch, vocab=51200)


#: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
#: Megatron-LM", SC'21, Table 1 (weak scaling, sequence 2048, vocabulary 51,200, A100 80 GB on
#: Selene): the paper's numbers, as published
MEGATRON_TABLE1 = (
    MegatronRow(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    MegatronRow(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    MegatronRow(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    MegatronRow(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    MegatronRow(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    MegatronRow(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    MegatronRow(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    MegatronRow(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    MegatronRow(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    MegatronRow(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
)


def megatron_flops(shape: ModelShape) -> float:
    """Return a step's FLOPs as the paper counts them (its equation 3, with recomputation's extra
    forward): 96 B s l h^2 (1 + s/(6h) + V/(16 l h))."""
    b, s, l, h, v = shape.batch, shape.seq_len, shape.layers, shape.d_model, shape.vocab
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


@dataclass(frozen=True)
class MegatronComparison:
    """hspmd's planner on one Table 1 row's GPUs and batch, beside the paper's measurement."""

    row: MegatronRow
    chosen: str  # the planner's strategy and settings
    step_s: float  # its predicted step (the planner's price)
    theirs_priced_s: float  # Megatron's own tp/pp/dp priced by the same cost model (nan: does not fit or run)
    mfu: float  # model FLOPs (no recomputation) / (step x GPUs x peak)
    tflops_per_gpu: float  # the paper's FLOP count / (step x GPUs): what the paper would have reported

    @property
    def ratio(self) -> float:
        return self.tflops_per_gpu / self.row.tflops_per_gpu


def compare_megatron(row: MegatronRow, memory: float = MEMORY_PER_GPU) -> MegatronComparison:
    """Return the planner's choice for `row`'s model on its GPUs (A100 nodes) and batch."""
    from hspmd.planner import Machine, plan
    from hspmd.planner.cost import GroupConfig
    from hspmd.planner.search import MICROBATCHES, _price

    hw = a100_node(row.gpus // 8)
    machine = Machine(make_profile(hw), op_overhead=KERNEL_GAP_S)
    shape = row.shape()
    facts = model_facts_for(shape, row.gpus)
    fits, over = plan(facts, machine, memory)
    if not fits:  # the search's micro-batches (at most MICROBATCHES[-1]) leave too many activations per stage
        lean = min(over, key=lambda c: c.memory_bytes)
        chosen = (f"none fits in {memory / 2**30:.0f} GiB with at most {MICROBATCHES[-1]} micro-batches; the leanest "
                  f"needs {lean.memory_bytes / 2**30:.0f} GiB: {' '.join([lean.strategy(), *lean.settings()])}")
        return MegatronComparison(row, chosen, math.nan, math.nan, math.nan, math.nan)
    best = fits[0]
    theirs = math.nan
    config = GroupConfig(tuple(range(row.gpus)), row.dp, row.tp, row.pp, recompute="block")
    for m in (MICROBATCHES if row.pp > 1 else (1,)):
        c = _price(facts, machine, (config,), m)
        if c is not None and c.memory_bytes <= memory and not c.step_s >= theirs:
            theirs = c.step_s
    step = best.step_s
    return MegatronComparison(row, " ".join([best.strategy(), *best.settings()]), step, theirs,
                              model_flops(shape) / (step * row.gpus * hw.bf16_peak_flops),
                              megatron_flops(shape) / (step * row.gpus) / 1e12)


def megatron_table(rows: Sequence[MegatronRow] = MEGATRON_TABLE1, markdown: bool = False) -> str:
    """Return the comparison of every row as a table (markdown or plain)."""
    head = ["model", "GPUs", "batch", "paper t/p/d", "paper TFLOP/s/GPU", "hspmd's choice", "step s",
            "Megatron's t/p/d priced, s", "MFU", "TFLOP/s/GPU (paper's count)", "ratio"]
    body = []
    for row in rows:
        c = compare_megatron(row)
        def num(x: float, text: str) -> str:
            return "-" if math.isnan(x) else text

        body.append([f"{row.params_b:g}B", f"{row.gpus:,}", f"{row.batch:,}", f"{row.tp}/{row.pp}/{row.dp}",
                     f"{row.tflops_per_gpu:g} ({row.peak_percent} %)", c.chosen, num(c.step_s, f"{c.step_s:.2f}"),
                     num(c.theirs_priced_s, f"{c.theirs_priced_s:.2f}"), num(c.mfu, f"{c.mfu * 100:.0f} %"),
                     num(c.tflops_per_gpu, f"{c.tflops_per_gpu:.0f}"), num(c.ratio, f"{c.ratio:.2f}")])
        print("  | " + " | ".join(body[-1]) + " |", file=sys.stderr, flush=True)  # each row as it is done
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                         + ["| " + " | ".join(r) + " |" for r in body]) + "\n"
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(x, widths)) for x in (head, *body)) + "\n"


def plan_choice(facts, profile: DeviceProfile, memory: float = MEMORY_PER_GPU):
    """Return the planner's candidates under `memory` on `profile`, best first (`hspmd plan`'s
    search), with GPU kernel gaps for its per-kernel cost."""
    from hspmd.planner import Machine, plan

    fits, _ = plan(facts, Machine(profile, op_overhead=KERNEL_GAP_S), memory)
    return fits


# ---------------------------------------------------------------------------------------------
# the command


def _row(p: Prediction) -> list[str]:
    settings = f" m={p.microbatches}" if p.microbatches > 1 else ""
    return [p.strategy + settings, f"{p.step_s * 1e3:.1f}",
            "-" if math.isnan(p.step_gap_s) else f"{p.step_gap_s * 1e3:.1f}",
            f"{p.tokens_per_s / 1e3:.0f}k", f"{p.peak_bytes / 2**30:.1f}" + ("" if p.fits else " (over)"),
            f"{p.mfu * 100:.0f}%", f"{p.compute_s * 1e3:.1f}", f"{p.matmul_s * 1e3:.1f}", f"{p.exposed_comm_s * 1e3:.1f}",
            f"{p.bubble_s * 1e3:.1f}"]


HEADER = ["strategy", "step ms", "+gaps ms", "tokens/s", "GiB/GPU", "MFU", "compute", "matmul", "comm", "bubble"]


def format_table(rows: list[list[str]], markdown: bool = False) -> str:
    if markdown:
        lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"
    widths = [max(len(x[i]) for x in (HEADER, *rows)) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(x, widths)))
                     for x in (HEADER, *rows)) + "\n"


def machine_for(n: int, slow_nodes: int = 0, slow_speed: float = 0.5) -> H100Node:
    """Return `n` H100s: one node of n up to 8, else nodes of 8."""
    return H100Node(nodes=max(1, n // 8), gpus_per_node=min(8, n), slow_nodes=slow_nodes, slow_speed=slow_speed)


def write_profiles(directory: str, gpus: Sequence[int], slow_fraction: float = 0.0, slow_speed: float = 0.5) -> int:
    """Write `DIR/h100xN.json` for each N (and `h100xN-slow.json`, its last `slow_fraction` of
    the nodes at `slow_speed`, where asked); print what each holds."""
    os.makedirs(directory, exist_ok=True)
    for n in gpus:
        variants = [(f"h100x{n}.json", 0)]
        if slow_fraction > 0:
            variants.append((f"h100x{n}-slow.json", max(1, round(slow_fraction * max(1, n // 8)))))
        for name, slow in variants:
            hw = machine_for(n, slow, slow_speed)
            path = os.path.join(directory, name)
            make_profile(hw).save(path)
            print(f"wrote {path}: {hw.describe()} ({os.path.getsize(path):,} bytes)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-small,gpt-1.3b", help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--gpus", default="8,16", help="comma list: 8 (one node), 16 (two nodes)")
    ap.add_argument("--no-plan", action="store_true", help="skip the planner")
    ap.add_argument("--gaps", action="store_true", help=f"also price {KERNEL_GAP_S * 1e6:g} us per kernel (launch gaps)")
    ap.add_argument("--markdown", action="store_true", help="tables as markdown")
    ap.add_argument("--write-profiles", metavar="DIR",
                    help="write h100xN.json there for each N of --gpus (and h100xN-slow.json with --slow-nodes), "
                         "then stop")
    ap.add_argument("--slow-nodes", type=float, default=0.0, metavar="F",
                    help="with --write-profiles: also write a profile whose last F of the nodes (a fraction, e.g. "
                         "0.333) compute at --slow-speed")
    ap.add_argument("--slow-speed", type=float, default=0.5, help="the slow nodes' speed (default 0.5)")
    ap.add_argument("--megatron", action="store_true",
                    help="only the comparison with Megatron-LM's Table 1 (GPT-3 family, 32 to 3,072 A100): hspmd's "
                         "planner on the same GPUs and batches")
    ap.add_argument("--megatron-rows", default=None, metavar="LIST",
                    help="with --megatron: the rows to run, by model size in billions (e.g. 1.7,18.4)")
    args = ap.parse_args(argv)
    if args.megatron:
        rows = MEGATRON_TABLE1 if args.megatron_rows is None else tuple(
            r for r in MEGATRON_TABLE1 if f"{r.params_b:g}" in args.megatron_rows.split(","))
        start = time.perf_counter()
        print(megatron_table(rows, args.markdown))
        print(f"({time.perf_counter() - start:.0f} s)")
        return 0
    if args.write_profiles:
        return write_profiles(args.write_profiles, [int(x) for x in args.gpus.split(",")], args.slow_nodes,
                              args.slow_speed)
    from hspmd.transforms.util import PassError

    start = time.perf_counter()
    machines = {}
    for n in (int(x) for x in args.gpus.split(",")):
        hw = machine_for(n)
        machines[n] = (hw, make_profile(hw))
    print("collectives (one rank's buffer; the algorithm NCCL's tuner would pick by this model):")
    for n, (hw, _) in machines.items():
        for label, group in (("all ranks", tuple(range(n))), ("tp=8 (one node)", tuple(range(8))),
                             ("pairs across nodes", (0, 8)) if n > 8 else ("pair", (0, 1))):
            cells = []
            for size in (64 * 2**10, 16 * 2**20, 256 * 2**20):
                t, alg = collective_seconds(hw, "all_reduce", group, size)
                cells.append(f"{size / 2**20:g} MiB {t * 1e6:,.0f} us ({alg}, {size / t / 1e9:.0f} GB/s alg)")
            print(f"  {n} GPUs, all_reduce over {label}: " + "; ".join(cells))
    for key in args.models.split(","):
        shape = MODELS[key]
        print(f"\n{shape.name}: {shape.layers} layers, d {shape.d_model}, {shape.heads} heads, seq {shape.seq_len}, "
              f"vocab {shape.vocab}, {shape.params() / 1e6:.0f}M parameters; global batch {shape.batch} sequences "
              f"({shape.tokens:,} tokens), bfloat16; model FLOPs {model_flops(shape) / 1e12:.1f} TFLOP per step")
        facts = None
        one = replace(shape, batch=max(1, shape.batch // 8))
        hw1, profile1 = next(iter(machines.values()))
        rows = [_row(replace(predict(one, "[0]: dp=1", profile1.restricted(1), 1, hw1, level, args.gaps), strategy=label))
                for level, label in (("kernel", "[0]: dp=1 (kernel level)"), ("device", "[0]: dp=1 (GPU program)"))]
        print(f"  1 GPU, {one.batch} sequences (one dp=8 rank's share), as --cost prices it and as the GPU program "
              f"of hspmd run --device cuda would run:")
        print("    " + format_table(rows, args.markdown).replace("\n", "\n    ").rstrip())
        for n, (hw, profile) in machines.items():
            print(f"  {n} GPUs ({hw.describe()}):")
            rows, priced = [], set()
            for strategy, m in strategies_for(n, shape.batch, shape.heads):
                priced.add((strategy, m))
                try:
                    rows.append(_row(predict(shape, strategy, profile, m, hw, gaps=args.gaps)))
                except PassError as err:  # a strategy the compiler refuses: said, the table goes on
                    print(f"    {strategy}: does not compile ({str(err).splitlines()[0][:160]})")
            print("    " + format_table(rows, args.markdown).replace("\n", "\n    ").rstrip())
            if not args.no_plan:
                facts = facts or model_facts_for(shape)
                fits = plan_choice(facts, profile)
                best = fits[0]
                settings = " ".join(best.settings())
                print(f"    planner (hspmd plan's search, {len(fits)} candidates under {MEMORY_PER_GPU / 2**30:.0f} GiB): "
                      f"'{best.strategy()}' {settings} at {best.step_s * 1e3:.1f} ms by its own price; then "
                      + "; ".join(f"'{c.strategy()}' {' '.join(c.settings())} {c.step_s * 1e3:.1f} ms".replace("  ", " ")
                                  for c in fits[1:4]))
                mb = best.microbatches if best.settings() else 1
                if (best.strategy(), mb) not in priced:
                    try:
                        chosen = predict(shape, best.strategy(), profile, mb, hw, gaps=args.gaps)
                    except PassError as err:
                        print(f"    the choice does not compile ({str(err).splitlines()[0][:160]})")
                        continue
                    print("    the choice by the IR cost model: " + ", ".join(
                        f"{h} {v}" for h, v in zip(HEADER, _row(chosen))))
        if facts is not None:
            print(f"  the IR's matmul FLOPs / the formula's: {facts.matmul_flops / model_flops(shape):.3f}")
    print(f"\n({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
