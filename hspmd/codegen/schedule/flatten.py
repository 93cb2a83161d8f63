"""A step function as one flat list of nodes over numbered slots: calls inlined, pipelines laid out.

The bodies of `func.call`ed functions (repeated layers) are inlined, so a step is one flat
list of kernel calls over numbered slots (one slot per SSA value). A `graph.scan` (a stack of
layers) is laid out as its iterations in order, each the callee inlined on its slices: a
stacked operand's slice i is a view ("take"), and a stacked result is the iterations' results
stacked into one array ("stack") only where something other than a later scan reads it (a
forward scan's residuals go to the backward scan's iterations directly, never stacked); the
all-reduce of a stacked value (a layer's gradients under data parallelism) runs per
iteration's value, so that it overlaps the rest of the backward as the calls' did. A pipeline
stage's `pipeline.run` is laid out the same way: its schedule's actions in order, each the forward
or the backward inlined on one micro-batch's slices, then the sums over the micro-batches
in their order (`hspmd.dialects.pipeline`). A program with `comm.send`s ends with one node
that waits for them all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import TensorType
from xdsl.ir import Operation, SSAValue

from hspmd.codegen.schedule.kernel_facts import FRESH, OUT, SUM, OutFacts, out_facts
from hspmd.codegen.schedule.model import Constant, Leaf, ScheduleError, SlotType
from hspmd.dialects import comm, graph, pipeline
from hspmd.dialects.dist import layout_of
from hspmd.ir.layout import Layout
from hspmd.ir.pipeline_schedule import PipelineScheduleError
from hspmd.ir.types import dtype_name


@dataclass
class Node:
    """One call of the flat program while it is scheduled (`model.Step` once finished).

    `kind` as `model.Step.kind` (`gather` its prefetched gather's index); `into` maps a result position to the (bucket, member) it is
    written into; `scope` as `model.Step.scope`.
    """

    op: Operation | None
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    kind: str = "op"
    facts: OutFacts = FRESH
    microbatch: int | None = None
    bucket: int | None = None
    polls: tuple[int, ...] = ()
    into: dict[int, tuple[int, int]] | None = None
    scope: str = ""
    gather: int | None = None


@dataclass
class Flat:
    """A step function with its callees inlined: nodes over slots, with each slot's type."""

    nodes: list[Node] = field(default_factory=list)
    types: list[SlotType] = field(default_factory=list)
    params: list[Leaf] = field(default_factory=list)
    inputs: list[Leaf] = field(default_factory=list)
    constants: list[Constant] = field(default_factory=list)
    outputs: list[tuple[str, int]] = field(default_factory=list)
    assigns: list[tuple[str, int]] = field(default_factory=list)

    def new_slot(self, value: SSAValue) -> int:
        """Return a new slot for `value`, typed as it."""
        typ = value.type
        self.types.append((tuple(typ.get_shape()), np.dtype(dtype_name(typ))) if isinstance(typ, TensorType) else None)
        return len(self.types) - 1

    def like(self, slot: int, drop_leading: bool = False) -> int:
        """Return a new slot of `slot`'s type (without its leading dim with `drop_leading`)."""
        shape, dtype = self.types[slot]  # type: ignore[misc]
        self.types.append((shape[1:], dtype) if drop_leading else (shape, dtype))
        return len(self.types) - 1


def _global(op: graph.ParameterOp | graph.InputOp) -> tuple[tuple[int, ...], Layout]:
    typ = op.global_type
    layout = layout_of(typ) if typ is not None else None
    if not isinstance(typ, TensorType) or layout is None:
        raise ScheduleError(f"'{op.name}' \"{op.tensor_name.data}\" has no global_type with a layout: not physical IR")
    return typ.get_shape(), layout


def _lookup(module, name: str, op: Operation) -> func.FuncOp:
    for candidate in module.body.block.ops if module is not None else ():
        if isinstance(candidate, func.FuncOp) and candidate.sym_name.data == name:
            return candidate
    raise ScheduleError(f"'{op.name}' calls @{name}, which the module does not define")


class _Inliner:
    """Walks a step function's body into a `Flat`, inlining calls (see the module docstring)."""

    def __init__(self, fn: func.FuncOp) -> None:
        self.fn, self.module, self.flat = fn, fn.parent_op(), Flat()
        #: a scan's stacked result not stacked yet -> its iterations' slots (see `real`)
        self.virtual: dict[int, list[int]] = {}

    def own_group(self, op: comm.AllReduceOp) -> bool:
        """Return whether every group of `op` lies inside this program's devices (its members all
        run this program, so they all cut it the same way)."""
        from hspmd.dialects.levels import DEVICES_ATTR, devices_of

        attr = self.module.attributes.get(DEVICES_ATTR) if self.module is not None else None
        if attr is None:
            return False
        return op.rank_groups.members.issubset(devices_of(attr))

    def real(self, slot: int) -> int:
        """Return `slot`, first stacking its iterations' values where it is a scan's stacked result
        that no node has stacked yet."""
        parts = self.virtual.pop(slot, None)
        if parts is not None:
            self.flat.nodes.append(Node(None, tuple(parts), (slot,), "stack", facts=OUT))
        return slot

    def leaf(self, op: Operation, slot: int, top: bool, stack: tuple[str, ...]) -> None:
        """Record a parameter, input, constant, output or assign of the step function."""
        flat = self.flat
        if not top:
            raise ScheduleError(f"@{stack[-1]}: '{op.name}' belongs in the step function, not a callee")
        match op:
            case graph.ParameterOp() | graph.InputOp():
                shape, layout = _global(op)
                leaf = Leaf(op.tensor_name.data, slot, shape, layout, dtype_name(op.result.type))
                if isinstance(op, graph.ParameterOp):
                    flat.params.append(Leaf(**{**leaf.__dict__, "init": op.init.data}))
                else:
                    flat.inputs.append(leaf)
            case graph.OutputOp():
                flat.outputs.append((op.tensor_name.data, slot))
            case graph.AssignOp():
                flat.assigns.append((op.tensor_name.data, slot))

    def body(self, block, slots: dict[SSAValue, int], top: bool, stack: tuple[str, ...],
             microbatch: int | None = None, scope: str = "") -> tuple[int, ...]:
        """Append `block`'s ops (values in `slots`); return the slots it returns. `scope` names the
        pipeline function being inlined ("" outside one)."""
        flat = self.flat

        def slot(value: SSAValue) -> int:
            if value not in slots:
                slots[value] = flat.new_slot(value)
            return slots[value]

        returns: tuple[int, ...] = ()
        for op in block.ops:
            match op:
                case func.ReturnOp():
                    returns = tuple(self.real(slot(v)) for v in op.operands)
                case graph.ParameterOp() | graph.InputOp():
                    self.leaf(op, slot(op.result), top, stack)
                case graph.OutputOp() | graph.AssignOp():
                    self.leaf(op, self.real(slot(op.value)), top, stack)
                case graph.ConstantOp():
                    typ = op.result.type
                    flat.constants.append(Constant(slot(op.result), tuple(typ.get_shape()), dtype_name(typ),
                                                   op.value.value.data))
                case pipeline.RunOp() if not top:
                    raise ScheduleError(f"@{stack[-1]}: '{op.name}' belongs in the step function, not a callee")
                case pipeline.RunOp():
                    results = _expand_pipeline(flat, op, tuple(self.real(slot(v)) for v in op.operands),
                                               lambda callee, args, i, at=op: self.call(callee, args, at, i))
                    for r, s in zip(op.results, results):
                        slots[r] = s
                case func.CallOp():
                    name = op.callee.root_reference.data
                    if name in stack:
                        raise ScheduleError(f"@{name} calls itself (through {' -> '.join(stack)}): recursion cannot run")
                    callee = _lookup(self.module, name, op)
                    inner = {arg: self.real(slot(v)) for arg, v in zip(callee.body.block.args, op.operands)}
                    results = self.body(callee.body.block, inner, False, stack + (name,), microbatch, scope)
                    for r, s in zip(op.results, results):
                        slots[r] = s  # the call's results are the callee's returned values
                case graph.ScanOp():
                    name = op.callee.root_reference.data
                    if name in stack:
                        raise ScheduleError(f"@{name} calls itself (through {' -> '.join(stack)}): recursion cannot run")
                    results = self.scan(op, [slot(v) for v in op.operands], stack, microbatch, scope)
                    for r, s in zip(op.results, results):
                        slots[r] = s
                case comm.AllReduceOp() if slot(op.operands[0]) in self.virtual and self.own_group(op):
                    # a stacked gradient's all-reduce: one per iteration's value, so that the
                    # all-reduce buckets start as the backward scan makes each layer's (the sum of
                    # a slice is the slice of the sum: the same bits)
                    parts = self.virtual.pop(slot(op.operands[0]))
                    reduced = [flat.like(p) for p in parts]
                    for p, r in zip(parts, reduced):
                        flat.nodes.append(Node(op, (p,), (r,), facts=out_facts(op), microbatch=microbatch, scope=scope))
                    self.virtual[slot(op.results[0])] = reduced
                    self.stack_unless_scanned(op.results[0], slot(op.results[0]))
                case _:
                    ins = tuple(self.real(slot(v)) for v in op.operands)
                    flat.nodes.append(Node(op, ins, tuple(slot(r) for r in op.results), facts=out_facts(op),
                                           microbatch=microbatch, scope=scope))
        return returns

    def scan(self, op: graph.ScanOp, operands: list[int], stack: tuple[str, ...], microbatch: int | None,
             scope: str) -> list[int]:
        """Lay out `op`'s iterations (the module docstring); return its result slots."""
        flat, name = self.flat, op.callee.root_reference.data
        callee = _lookup(self.module, name, op)
        n, carries = op.num_iterations, op.carries()
        kinds = [op.arg_kind(j) for j in range(len(operands))]
        args = [s if kinds[j] != "stacked" else None for j, s in enumerate(operands)]
        for j, s in enumerate(operands):
            if kinds[j] != "stacked":
                args[j] = self.real(s)
        per_iteration: list[list[int]] = [[0] * n for _ in op.results]
        returned: tuple[int, ...] = ()
        for i in (reversed(range(n)) if op.is_reverse else range(n)):
            for j, s in enumerate(operands):
                if kinds[j] != "stacked":
                    continue
                if s in self.virtual:
                    args[j] = self.virtual[s][i]
                else:
                    out = flat.like(s, drop_leading=True)
                    flat.nodes.append(Node(None, (s,), (out,), "take", microbatch=i))
                    args[j] = out
            inner = {arg: a for arg, a in zip(callee.body.block.args, args)}
            returned = self.body(callee.body.block, inner, False, stack + (name,), microbatch, scope)  # type: ignore
            for k, r in enumerate(returned):
                per_iteration[k][i] = r
            for j, k in carries:
                args[j] = returned[k]
        results = []
        for k, r in enumerate(op.results):
            if not op.result_stacked(k):
                results.append(returned[k])
                continue
            stacked = flat.new_slot(r)
            self.virtual[stacked] = per_iteration[k]
            self.stack_unless_scanned(r, stacked)
            results.append(stacked)
        return results

    def stack_unless_scanned(self, value: SSAValue, slot: int) -> None:
        """Stack `value`'s iterations right away (`slot`) unless only scans (which read each
        iteration's value) and per-iteration all-reduces read it: the stacked value is then
        computed where the program makes it, not later where it is first read."""
        for use in value.uses:
            user = use.operation
            if isinstance(user, graph.ScanOp) and use.index in user.stacked_args():
                continue
            if isinstance(user, comm.AllReduceOp) and self.own_group(user):
                continue
            self.real(slot)
            return

    def call(self, name: str, args: Sequence[int], at: Operation, microbatch: int) -> tuple[int, ...]:
        """Inline @name (a `pipeline.run`'s forward or backward) on micro-batch `microbatch`'s
        argument slots; return its result slots."""
        callee = _lookup(self.module, name, at)
        return self.body(callee.body.block, dict(zip(callee.body.block.args, args)), False,
                         (self.fn.sym_name.data, name), microbatch, name)


def flatten(fn: func.FuncOp) -> Flat:
    """Return the step function `fn` as one flat list of nodes, callees inlined."""
    inliner = _Inliner(fn)
    inliner.body(fn.body.block, {}, True, (fn.sym_name.data,))
    flat = inliner.flat
    inliner.virtual.clear()  # stacked results nothing read: their iterations' values die unstacked
    if any(isinstance(n.op, comm.SendOp) for n in flat.nodes):  # every send has left before the step ends
        flat.nodes.append(Node(None, (), (), "wait-sends"))
    return flat


def _expand_pipeline(flat: Flat, op: pipeline.RunOp, operands: tuple[int, ...],
                     call: Callable[[str, Sequence[int], int], tuple[int, ...]]) -> list[int]:
    """Lay out a `pipeline.run` in the flat list: its stage's actions in schedule order, each an
    inlined call of the forward or backward on one micro-batch's slices, then the left-fold sums.

    The schedule is walked here, once (as calls are inlined): buffers are then reused across
    micro-batches by liveness, so a schedule that keeps fewer micro-batches in flight (1F1B)
    needs less memory (`Schedule.peak_bytes`).
    """
    try:
        acts = pipeline.actions(op)
    except PipelineScheduleError as err:
        raise ScheduleError(f"'{op.name}': {err}") from None
    stash = op.ints()[3]
    n_shared = len(op.shared)
    shared, stacked = list(operands[:n_shared]), operands[n_shared:]
    slices: dict[int, list[int]] = {}
    kept: dict[int, tuple[int, ...]] = {}
    sums: list[int | None] = [None] * len(op.sums)

    def piece(i: int) -> list[int]:
        if i not in slices:  # micro-batch i's slice of each micro-batched operand: a view
            slices[i] = []
            for s in stacked:
                out = flat.like(s, drop_leading=True)
                flat.nodes.append(Node(None, (s,), (out,), "take", microbatch=i))
                slices[i].append(out)
        return slices[i]

    def accumulate(first: int, values: Sequence[int]) -> None:
        for k, r in enumerate(values, start=first):
            if sums[k] is None:
                sums[k] = r
            else:
                out = flat.like(r)
                flat.nodes.append(Node(None, (sums[k], r), (out,), "sum", facts=SUM))  # as graph.add
                sums[k] = out

    forward_sums = 0
    for kind, i in acts:
        if kind == "F":
            results = call(op.forward.root_reference.data, shared + piece(i), i)
            kept[i] = results[:stash]
            forward_sums = len(results) - stash
            accumulate(0, results[stash:])
        else:
            results = call(op.backward.root_reference.data, shared + piece(i) + list(kept.pop(i)), i)
            accumulate(forward_sums, results)
    if any(s is None for s in sums):
        raise ScheduleError(f"'{op.name}': its forward and backward return fewer values than its {len(sums)} results")
    return sums  # type: ignore[return-value]
