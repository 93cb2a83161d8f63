"""The execution schedule of a physical step function: one flat list of steps over numbered slots.

`schedule_step(fn)` is the compile-side half of an execution plan (`hspmd.runtime.plan` binds
kernels, communicators and buffers to it for one rank): it knows nothing of ranks or kernels.

* The bodies of `func.call`ed functions (repeated layers) are inlined, so a step is one flat
  list of op steps over slots (one slot per SSA value).
* A pipeline stage's `pipeline.run` is laid out the same way: its schedule's actions in order
  (`hspmd.ir.pipeline_schedule`, walked here once), each the forward or the backward inlined on
  one micro-batch's slices (`take` steps: views of slice i of a stacked operand), then the
  left-fold sums over the micro-batches in their order (`add` steps), so every schedule gives
  the same bits. Buffers are then reused across micro-batches by liveness, so a schedule that
  keeps fewer micro-batches in flight (1F1B) needs less memory.
* A program with `comm.send` ends with a `wait-sends` step: every send has left before the
  step ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import TensorType
from xdsl.ir import Block, Operation, SSAValue

from hspmd.dialects import comm, graph, pipeline
from hspmd.dialects.dist import layout_of
from hspmd.ir.layout import Layout
from hspmd.ir.pipeline_schedule import PipelineScheduleError
from hspmd.ir.types import dtype_name

__all__ = ["Leaf", "PlanError", "Schedule", "Step", "schedule_step"]


class PlanError(Exception):
    """The physical IR cannot be run by this rank (wrong level, missing group, unknown op)."""


@dataclass(frozen=True)
class Leaf:
    """A parameter or input: its slot, global shape, layout and dtype (and initialiser)."""

    name: str
    slot: int
    global_shape: tuple[int, ...]
    layout: Layout
    dtype: str
    init: str = ""


@dataclass(frozen=True)
class Step:
    """One step of the schedule: its operand and result slots, and what computes it.

    kind "op": `op`'s kernel (for micro-batch `microbatch` inside a pipeline's forward or
    backward); "take": the view of slice `index` along the leading dim of `ins[0]`; "add": the
    sum of two micro-batches' values (`graph.add`'s kernel); "wait-sends": wait for every send
    the step's `comm.send`s started.
    """

    op: Operation | None
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    kind: str = "op"
    microbatch: int | None = None
    index: int = 0


@dataclass
class Schedule:
    """A step function with its callees inlined and its pipeline run laid out."""

    steps: list[Step] = field(default_factory=list)
    #: each slot's (local shape, dtype); None for a value that is not a tensor
    types: list[tuple[tuple[int, ...], np.dtype] | None] = field(default_factory=list)
    params: list[Leaf] = field(default_factory=list)
    inputs: list[Leaf] = field(default_factory=list)
    constants: dict[int, np.ndarray] = field(default_factory=dict)
    outputs: list[tuple[str, int]] = field(default_factory=list)
    assigns: list[tuple[str, int]] = field(default_factory=list)

    def new_slot(self, value: SSAValue) -> int:
        """Return a fresh slot of `value`'s type."""
        typ = value.type
        self.types.append((tuple(typ.get_shape()), np.dtype(dtype_name(typ))) if isinstance(typ, TensorType) else None)
        return len(self.types) - 1

    def new_slot_like(self, slot: int, drop_leading: bool = False) -> int:
        """Return a fresh slot of `slot`'s type (without its leading dim: one micro-batch's slice)."""
        t = self.types[slot]
        if drop_leading:
            assert t is not None
            t = (t[0][1:], t[1])
        self.types.append(t)
        return len(self.types) - 1


def _global(op: graph.ParameterOp | graph.InputOp) -> tuple[tuple[int, ...], Layout]:
    typ = op.global_type
    layout = layout_of(typ) if typ is not None else None
    if not isinstance(typ, TensorType) or layout is None:
        raise PlanError(f"'{op.name}' \"{op.tensor_name.data}\" has no global_type with a layout: not physical IR")
    return typ.get_shape(), layout


def _constant(op: graph.ConstantOp) -> np.ndarray:
    typ = op.result.type
    return np.full(typ.get_shape(), op.value.value.data, dtype_name(typ))


def _lookup(module, name: str, op: Operation) -> func.FuncOp:
    for candidate in module.body.block.ops if module is not None else ():
        if isinstance(candidate, func.FuncOp) and candidate.sym_name.data == name:
            return candidate
    raise PlanError(f"'{op.name}' calls @{name}, which the module does not define")


class _Inliner:
    """Walks a step function's block into a Schedule, inlining calls and pipeline runs."""

    def __init__(self, fn: func.FuncOp) -> None:
        self.fn, self.module, self.out = fn, fn.parent_op(), Schedule()

    def block(self, block: Block, slots: dict[SSAValue, int], top: bool, stack: tuple[str, ...],
              microbatch: int | None = None) -> tuple[int, ...]:
        """Schedule the ops of `block` (the step's when `top`); return the slots it returns."""
        def slot(value: SSAValue) -> int:
            if value not in slots:
                slots[value] = self.out.new_slot(value)
            return slots[value]

        out = self.out
        returns: tuple[int, ...] = ()
        for op in block.ops:
            match op:
                case func.ReturnOp():
                    returns = tuple(slot(v) for v in op.operands)
                case graph.ParameterOp() | graph.InputOp() | graph.OutputOp() | graph.AssignOp() | \
                        pipeline.RunOp() if not top:
                    raise PlanError(f"@{stack[-1]}: '{op.name}' belongs in the step function, not a callee")
                case graph.ParameterOp() | graph.InputOp():
                    shape, layout = _global(op)
                    leaf = Leaf(op.tensor_name.data, slot(op.result), shape, layout, dtype_name(op.result.type))
                    if isinstance(op, graph.ParameterOp):
                        out.params.append(Leaf(**{**leaf.__dict__, "init": op.init.data}))
                    else:
                        out.inputs.append(leaf)
                case graph.ConstantOp():
                    out.constants[slot(op.result)] = _constant(op)
                case graph.OutputOp():
                    out.outputs.append((op.tensor_name.data, slot(op.value)))
                case graph.AssignOp():
                    out.assigns.append((op.tensor_name.data, slot(op.value)))
                case pipeline.RunOp():
                    results = self.pipeline_run(op, tuple(slot(v) for v in op.operands))
                    for r, s in zip(op.results, results):
                        slots[r] = s
                case func.CallOp():
                    name = op.callee.root_reference.data
                    if name in stack:
                        raise PlanError(f"@{name} calls itself (through {' -> '.join(stack)}): recursion cannot run")
                    callee = _lookup(self.module, name, op)
                    inner = {arg: slot(v) for arg, v in zip(callee.body.block.args, op.operands)}
                    results = self.block(callee.body.block, inner, False, stack + (name,), microbatch)
                    for r, s in zip(op.results, results):
                        slots[r] = s  # the call's results are the callee's returned values
                case _:
                    ins = tuple(slot(v) for v in op.operands)
                    out.steps.append(Step(op, ins, tuple(slot(r) for r in op.results), microbatch=microbatch))
        return returns

    def call(self, name: str, args: Sequence[int], at: Operation, microbatch: int) -> tuple[int, ...]:
        """Inline @name (a `pipeline.run`'s forward or backward) on micro-batch `microbatch`'s
        argument slots; return its result slots."""
        callee = _lookup(self.module, name, at)
        return self.block(callee.body.block, dict(zip(callee.body.block.args, args)), False,
                          (self.fn.sym_name.data, name), microbatch)

    def pipeline_run(self, op: pipeline.RunOp, operands: tuple[int, ...]) -> list[int]:
        """Lay out a `pipeline.run`: its stage's actions in schedule order, each an inlined call of
        the forward or backward on one micro-batch's slices, then the left-fold sums."""
        try:
            acts = pipeline.actions(op)
        except PipelineScheduleError as err:
            raise PlanError(f"'{op.name}': {err}") from None
        stash = op.ints()[3]
        n_shared = len(op.shared)
        shared, stacked = list(operands[:n_shared]), operands[n_shared:]
        slices: dict[int, list[int]] = {}
        kept: dict[int, tuple[int, ...]] = {}
        sums: list[int | None] = [None] * len(op.sums)
        out = self.out

        def piece(i: int) -> list[int]:
            if i not in slices:  # micro-batch i's slice of each micro-batched operand: a view
                slices[i] = []
                for s in stacked:
                    view = out.new_slot_like(s, drop_leading=True)
                    out.steps.append(Step(None, (s,), (view,), "take", index=i))
                    slices[i].append(view)
            return slices[i]

        def accumulate(first: int, values: Sequence[int]) -> None:
            for k, r in enumerate(values, start=first):
                if sums[k] is None:
                    sums[k] = r
                else:
                    total = out.new_slot_like(r)
                    out.steps.append(Step(None, (sums[k], r), (total,), "add"))
                    sums[k] = total

        forward_sums = 0
        for kind, i in acts:
            if kind == "F":
                results = self.call(op.forward.root_reference.data, shared + piece(i), op, i)
                kept[i] = results[:stash]
                forward_sums = len(results) - stash
                accumulate(0, results[stash:])
            else:
                results = self.call(op.backward.root_reference.data, shared + piece(i) + list(kept.pop(i)), op, i)
                accumulate(forward_sums, results)
        if any(s is None for s in sums):
            raise PlanError(f"'{op.name}': its forward and backward return fewer values than its {len(sums)} results")
        return [s for s in sums if s is not None]


def schedule_step(fn: func.FuncOp) -> Schedule:
    """Return the schedule of physical step function `fn`: callees inlined, pipeline runs laid out."""
    inliner = _Inliner(fn)
    inliner.block(fn.body.block, {}, True, (fn.sym_name.data,))
    schedule = inliner.out
    if any(isinstance(s.op, comm.SendOp) for s in schedule.steps):
        schedule.steps.append(Step(None, (), (), "wait-sends"))
    return schedule


def matmul_flops(fn: func.FuncOp) -> int:
    """Return the floating-point operations of one step's matmuls (2 m k n each, callees counted per call)."""
    flops = 0
    for step in schedule_step(fn).steps:
        if isinstance(step.op, graph.MatmulOp):
            out_shape = step.op.results[0].type.get_shape()
            flops += 2 * int(np.prod(out_shape, dtype=np.int64)) * step.op.operands[0].type.get_shape()[-1]
        elif isinstance(step.op, graph.MatmulRhsGradOp):
            a_shape = step.op.operands[0].type.get_shape()
            flops += 2 * int(np.prod(a_shape, dtype=np.int64)) * step.op.operands[1].type.get_shape()[-1]
    return flops

