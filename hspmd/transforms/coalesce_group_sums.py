"""`coalesce-group-sums`: mark runs of all-reduces across device groups that may be summed as one.

In a strategy of several device groups (`[0,1]: dp=2 share=15 | [2]: dp=1 share=17`) the
gradients are summed across the groups by one `comm.all_reduce` per parameter, each over
ranks of several group modules, and the loss by one more. Each is a meeting of all their
ranks; where ranks share a core every meeting costs scheduler hand-overs (GPT, 2 layers,
3 ranks on 2 cores: 29 sums of 0.1-0.3 ms each, 5.3 ms of a 90 ms step, against 3.1 ms for
the same bytes in one all-reduce). Inside one program the schedule puts such sums into
buckets itself (`codegen/schedule/buckets.py`), since every member runs that program; across
programs each must make the same buckets, so the decision is taken here, where every program
is seen, and written into the IR: each all-reduce of a run gets `coalesce = K`, and the
schedule of every program sums run K in one bucket.

A run is a sequence of all-reduces with the same rank groups (spanning more than one group
module) and element type such that, in the `@train_step` of *every* group module taking part,

* they are consecutive among the ops that communicate with ranks outside that module
  (another such collective, a transfer, an exchange, a pipeline, or an op whose body or
  whose function (a call, any op naming a function) has one):
  only communication inside the module may lie between them, which its own ranks, all
  running the same program, meet in the same order whatever the bucket does;
* every operand of the run is computed before any result of the run is read (the bucket
  starts after its last operand and is waited on before its first use; the step's outputs
  and assignments are read at its end);
* their bytes add up to at most `bucket_bytes` (default: the runtime's bucket size).

The modules' runs are cut where any module would cut them, so all agree; a module that holds
a different number of these all-reduces than another, or other shapes, is left as it is. Runs
of one all-reduce are not marked. Nothing else changes: the ops stay where they are, and a
runtime without buckets runs them one by one as before.

    %75 = comm.all_reduce %74 {groups = [array<i64: 0, 1, 2>]} : tensor<f32> -> tensor<f32>
becomes
    %75 = comm.all_reduce %74 {groups = [array<i64: 0, 1, 2>], coalesce = 0 : i64} : tensor<f32> -> tensor<f32>
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ArrayAttr, DictionaryAttr, IntegerAttr, ModuleOp, SymbolRefAttr, TensorType, i64
from xdsl.ir import Attribute, Operation
from xdsl.passes import ModulePass

from hspmd.codegen.schedule import DEFAULT_BUCKET_BYTES
from hspmd.codegen.schedule.model import nbytes
from hspmd.dialects import comm, graph
from hspmd.dialects.levels import physical_groups
from hspmd.ir.devices import DeviceRange, RankGroups
from hspmd.ir.types import dtype_name

__all__ = ["CoalesceGroupSums"]

Key = RankGroups  # a collective's rank groups


@dataclass(frozen=True)
class _Sum:
    """One all-reduce across modules in one module's step: where it reads and is read."""

    op: comm.AllReduceOp
    ready: int  # the position after its operand's definition (0: an argument)
    first_use: int  # the position of its result's first reader (the end for outputs and assignments)
    nbytes: int
    dtype: str


def _symbols(value: Attribute) -> list[str]:
    """Return the function names an attribute refers to (in arrays and dictionaries too)."""
    if isinstance(value, SymbolRefAttr):
        return [value.root_reference.data]
    if isinstance(value, ArrayAttr):
        return [name for v in value.data for name in _symbols(v)]
    if isinstance(value, DictionaryAttr):
        return [name for v in value.data.values() for name in _symbols(v)]
    return []


def _outside(op: Operation, devices: DeviceRange, funcs: dict[str, func.FuncOp], memo: dict[str, bool]) -> bool:
    """Return whether `op`, a body it holds or a function it refers to (a call, a pipeline's
    forward and backward, any op naming a function) communicates with a rank outside `devices`."""
    if op.dialect_name() == "comm":
        parts = comm.members(op)
        return parts is not None and not all(p.issubset(devices) for p in parts)
    if op.name == "pipeline.run":
        return True  # its forward and backward send to and receive from other stages
    for name in (n for v in (*op.properties.values(), *op.attributes.values()) for n in _symbols(v)):
        if name not in memo:
            memo[name] = False  # a recursive reference adds nothing
            callee = funcs.get(name)
            # a function this module does not hold: assume the worst
            memo[name] = callee is None or any(_outside(o, devices, funcs, memo) for o in callee.body.walk())
        if memo[name]:
            return True
    return any(_outside(o, devices, funcs, memo) for region in op.regions for o in region.walk())


def _sequence(module: ModuleOp, devices: DeviceRange) -> list[tuple[Key, _Sum] | None] | None:
    """Return the module's step as what communicates outside it, in order: (groups, sum) for an
    all-reduce, None for anything else that does; None when the module has no `@train_step`."""
    funcs = {f.sym_name.data: f for f in module.body.block.ops if isinstance(f, func.FuncOp)}
    step = funcs.get("train_step")
    if step is None:
        return None
    ops = list(step.body.block.ops)
    position = {op: i for i, op in enumerate(ops)}
    end = len(ops)
    memo: dict[str, bool] = {}
    out: list[tuple[Key, _Sum] | None] = []
    for i, op in enumerate(ops):
        if not _outside(op, devices, funcs, memo):
            continue
        typ = op.results[0].type if isinstance(op, comm.AllReduceOp) else None
        if not isinstance(typ, TensorType):
            out.append(None)
            continue
        owner = op.operands[0].owner
        ready = position[owner] + 1 if owner in position else 0
        readers = [position[u.operation] for u in op.results[0].uses if u.operation in position
                   and not isinstance(u.operation, (graph.OutputOp, graph.AssignOp))]
        name = dtype_name(typ)
        size = nbytes((tuple(typ.get_shape()), np.dtype(name)))
        out.append((op.rank_groups, _Sum(op, ready, min(readers, default=end), size, name)))
    return out


def _cuts(sequence: list[tuple[Key, _Sum] | None], key: Key, limit: int) -> tuple[list[_Sum], set[int]]:
    """Return the all-reduces over `key` in order, and the indices k where a run must start anew
    (the k-th cannot join the (k-1)-th) in this module."""
    sums: list[_Sum] = []
    cuts: set[int] = set()
    run: list[_Sum] = []
    joined = False  # nothing but sums over `key` since the last one
    for entry in sequence:
        if entry is None or entry[0] != key:
            joined = False
            continue
        s = entry[1]
        if run and joined and s.dtype == run[0].dtype and sum(x.nbytes for x in run) + s.nbytes <= limit \
                and max(x.ready for x in run + [s]) <= min(x.first_use for x in run + [s]):
            run.append(s)
        else:
            cuts.add(len(sums))
            run = [s]
        sums.append(s)
        joined = True
    return sums, cuts


@dataclass(frozen=True)
class CoalesceGroupSums(ModulePass):
    """Mark all-reduces across device groups that every program may sum in one bucket (module docstring)."""

    name = "coalesce-group-sums"

    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        sequences = []  # (devices, what communicates outside them) per module with a step
        for devices, module in physical_groups(op):
            seq = _sequence(module, devices)
            if seq is not None:
                sequences.append((devices, seq))
        # in one order in every program: by the groups' first member, size and text (not listed)
        keys = sorted({e[0] for _, seq in sequences for e in seq if e is not None},
                      key=lambda k: (k.members.min, len(k.members), k.size, str(k)))
        run_id = 0
        for key in keys:
            taking_part = [seq for devices, seq in sequences if not key.members.isdisjoint(devices)]
            found = [_cuts(seq, key, self.bucket_bytes) for seq in taking_part]
            shapes = {tuple((s.nbytes, s.dtype) for s in sums) for sums, _ in found}
            if len(shapes) != 1:
                continue  # the modules do not pair these sums one to one: leave them alone
            cuts = set().union(*(c for _, c in found)) | {len(found[0][0])}
            bounds = sorted(cuts)
            for start, stop in zip(bounds, bounds[1:]):
                if stop - start < 2:
                    continue
                for sums, _ in found:
                    for s in sums[start:stop]:
                        s.op.attributes[comm.COALESCE_ATTR] = IntegerAttr(run_id, i64)
                run_id += 1
