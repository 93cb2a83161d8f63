"""Reports read from schedules: a step's matmul FLOPs, and every rank's planned memory."""

from __future__ import annotations

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
