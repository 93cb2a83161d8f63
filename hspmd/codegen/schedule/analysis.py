"""Reports read from schedules: a step's matmul FLOPs, and every rank's planned memory (its peak,
and what it holds: parameters, gradients, optimizer states, activations kept for the backward)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation

from hspmd.codegen.schedule import build_schedule
from hspmd.codegen.schedule.flatten import flatten
from hspmd.dialects import graph
from hspmd.dialects.levels import physical_groups


def op_matmul_flops(op: Operation | None) -> int:
    """Return the floating-point operations of one matmul op (2 m k n; 0 for any other op)."""
    if isinstance(op, (graph.MatmulOp, graph.ExpertMatmulOp)):
        out_shape = op.results[0].type.get_shape()  # type: ignore[attr-defined]
        return 2 * int(np.prod(out_shape, dtype=np.int64)) * op.operands[0].type.get_shape()[-1]  # type: ignore
    if isinstance(op, (graph.MatmulRhsGradOp, graph.ExpertMatmulRhsGradOp)):
        a_shape = op.operands[0].type.get_shape()  # type: ignore[attr-defined]
        return 2 * int(np.prod(a_shape, dtype=np.int64)) * op.operands[1].type.get_shape()[-1]  # type: ignore
    return 0


def matmul_flops(fn: func.FuncOp) -> int:
    """Return the floating-point operations of one step's matmuls (2 m k n each, callees counted per call)."""
    return sum(op_matmul_flops(node.op) for node in flatten(fn).nodes)


def memory_report(physical: ModuleOp) -> str:
    """Return one line per rank of a physical module: its schedule's peak bytes per step (and buffers)."""
    lines = ["plan memory per rank (one step: buffers reused by liveness, live arrays, parameters, inputs):"]
    for devices, module in physical_groups(physical):
        fn = next((op for op in module.body.block.ops if isinstance(op, func.FuncOp)
                   and op.sym_name.data == "train_step"), None)
        if fn is None:
            continue
        for rank in devices:
            schedule = build_schedule(fn, rank)
            lines.append(f"  rank {rank}: peak {schedule.peak_bytes:,} bytes ({schedule.peak_bytes / 2**20:.1f} MiB), "
                         f"buffers {schedule.buffer_bytes:,} bytes, {len(schedule.buckets)} all-reduce buckets")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class MemoryRow:
    """What one rank holds per step, in bytes (`memory_rows`); `activations` is None for a pipeline
    stage (its micro-batches' activations depend on the schedule: `hspmd compile --cost`)."""

    rank: int
    parameters: int
    gradients: int
    optimizer_states: int
    activations: int | None
    peak: int


def _nbytes(t) -> int:
    from hspmd.codegen.report import tensor_nbytes

    return tensor_nbytes(t)


def kept_activations(fn: func.FuncOp) -> int | None:
    """Return the bytes of the values the step's forward makes and its backward reads: made before
    `graph.output "loss"` (not parameters, inputs or constants) and read after it; None where the
    step has no such output in its own body (a pipeline stage)."""
    ops = list(fn.body.block.ops)
    loss = next((i for i, o in enumerate(ops) if isinstance(o, graph.OutputOp) and o.tensor_name.data == "loss"), None)
    if loss is None:
        return None
    after = set(ops[loss + 1:])
    kept = 0
    for o in ops[:loss]:
        if isinstance(o, (graph.ParameterOp, graph.InputOp, graph.ConstantOp)):
            continue
        for r in o.results:
            if any(u.operation in after for u in r.uses):
                kept += _nbytes(r.type)
    return kept


def memory_rows(physical: ModuleOp) -> list[MemoryRow]:
    """Return each rank's planned memory: parameters, gradients (the values the updates read),
    optimizer states (`opt.*`), activations kept for the backward, and the schedule's peak."""
    rows = []
    for devices, module in physical_groups(physical):
        fn = next((op for op in module.body.block.ops if isinstance(op, func.FuncOp)
                   and op.sym_name.data == "train_step"), None)
        if fn is None:
            continue
        params = states = grads = 0
        for o in fn.walk():
            if isinstance(o, graph.ParameterOp):
                if o.tensor_name.data.startswith("opt."):  # optimizer states (transforms/optimizer.py)
                    states += _nbytes(o.result.type)
                else:
                    params += _nbytes(o.result.type)
            elif o.name in ("optim.adam", "optim.sgd"):
                grads += _nbytes(o.operands[1].type)
        kept = kept_activations(fn)
        for rank in devices:
            peak = build_schedule(fn, rank).peak_bytes
            rows.append(MemoryRow(rank, params, grads, states, kept, peak))
    return rows


def format_memory_rows(rows: list[MemoryRow], title: str) -> str:
    """Return `rows` as a table in MiB under `title`."""
    mib = lambda b: "-" if b is None else f"{b / 2**20:.2f}"  # noqa: E731
    lines = [title, f"  {'rank':>4}  {'parameters':>10}  {'gradients':>9}  {'opt states':>10}  {'activations':>11}  "
             f"{'peak':>9}   (MiB; activations: kept from the forward for the backward)"]
    for r in rows:
        lines.append(f"  {r.rank:>4}  {mib(r.parameters):>10}  {mib(r.gradients):>9}  {mib(r.optimizer_states):>10}  "
                     f"{mib(r.activations):>11}  {mib(r.peak):>9}")
    return "\n".join(lines) + "\n"
