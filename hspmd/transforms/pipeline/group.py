"""The pipelined group of a physical module, as the pipeline passes find and check it.

`find_group(module, pipe, m, what)` locates the stage-shaped group module of one pipelined group
(`virtual.Pipeline`), checks its shape, and returns a `PipelinedGroup`: the `StageMesh`, its
functions and `@train_step`, the class of each collective (`stage_mesh.classify_collective`),
the leaves split over the micro-batches; `op_kinds` says which ops run once per micro-batch.
Both `assign-pipeline-stages` and `outline-pipeline-stages` start here, so they read the same
facts from the same IR.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation

from hspmd.dialects import comm, graph
from hspmd.dialects.dist import layout_of
from hspmd.dialects.levels import physical_groups
from hspmd.transforms.pipeline.devices import comm_devices
from hspmd.transforms.pipeline.stage_mesh import (LOCAL, MAPPED, MEET, SPLIT, VLOCAL, XMEET, XPOST, XSPAN, ZERO,
                                                  StageMesh, classify_collective, stage_layout)
from hspmd.transforms.pipeline.virtual import Pipeline
from hspmd.transforms.util import PassError, StrategyLimitError

__all__ = ["Collectives", "PipelinedGroup", "find_group", "forward_end", "op_kinds"]

#: comm op -> (its class, the stage positions of its groups)
Collectives = dict[Operation, tuple[str, tuple[tuple[int, ...], ...]]]


@dataclass
class PipelinedGroup:
    """One pipelined group's stage-shaped module and what the passes know of it."""

    mesh: StageMesh
    module: ModuleOp  # the group module of the virtual devices
    others: list[tuple[tuple[int, ...], ModuleOp]]  # the other groups (devices, module)
    functions: list[func.FuncOp]
    step: func.FuncOp
    ops: list[Operation]  # the step's ops without the return
    collectives: Collectives
    leaves: dict[Operation, bool]  # parameter or input -> split over the micro-batches


def _stage_devices(pipe: Pipeline) -> tuple[tuple[int, ...], ...]:
    devices, pp, tp = pipe.devices, pipe.pp, pipe.tp
    if pp < 2 or len(devices) % pp:
        raise PassError(f"pipeline-split: pp={pp} stages do not divide the {len(devices)} devices "
                        f"{list(devices)} (and a pipeline needs pp >= 2)")
    size = len(devices) // pp
    if tp < 1 or size % tp:
        raise PassError(f"pipeline-split: tp={tp} does not divide the {size} devices of a stage")
    return tuple(devices[s * size:(s + 1) * size] for s in range(pp))


def _group_module(op: ModuleOp, pipe: Pipeline, m: int, size: int):
    """Return (virtual devices, group module, the other groups)."""
    groups = physical_groups(op)
    others: list[tuple[tuple[int, ...], ModuleOp]] = []
    dp = size // pipe.tp
    if pipe.union is not None:  # a pipelined group beside other groups
        want = pipe.virtual(m)
        mine = [g for g in groups if g[0] == want]
        if len(mine) != 1 or len(want) != m * size:
            raise PassError(f"pipeline-split: virtual devices {list(want)} must be the devices of one group of the "
                            f"input, {m} micro-batch(es) x {size} devices of a stage (it has groups "
                            f"{[list(g) for g, _ in groups]})")
        others = [g for g in groups if g[0] != want]
        groups = mine
        if set(pipe.devices) & {d for g, _ in others for d in g}:
            raise PassError(f"pipeline-split: devices {list(pipe.devices)} overlap another group's "
                            f"{[list(g) for g, _ in others]}")
    if len(groups) != 1 or len(groups[0][0]) != m * size:
        raise PassError(f"pipeline-split: the input must be the physical IR of one group of {m * size} devices, "
                        f"{m} micro-batch(es) x {size} devices of a stage (`[0-{m * size - 1}]: dp={m * dp} "
                        f"tp={pipe.tp}` before the split) (it has groups {[list(g) for g, _ in groups]}); "
                        "with other device groups beside it, name its devices with virtual=...")
    (virtual, group), = groups
    if op is group:
        raise PassError("pipeline-split: the physical module must hold its group module (run specialize-groups)")
    return virtual, group, others


def _classify(functions: list[func.FuncOp], step: func.FuncOp, mesh: StageMesh) -> Collectives:
    collectives: Collectives = {}
    for f in functions:
        for o in f.walk():
            if o.dialect_name() != "comm":
                continue
            if not hasattr(o, "rank_groups") and not (isinstance(o, comm.ExchangeOp)
                                                      and comm_devices(o) & mesh.foreign):
                raise PassError(f"pipeline-split: '{o.name}' in the one-group step: only collectives are "
                                "supported there (point-to-point messages are the split's own)")
            collectives[o] = classify_collective(o, mesh)
            if f is not step and collectives[o][0] not in (LOCAL, MAPPED, VLOCAL):
                # a limit of the split, not a broken input: a layer whose ops mix the batch's rows
                # gathers across the micro-batches, which are virtual devices beside other groups
                raise StrategyLimitError(f"pipeline-split: '{o.name}' in @{f.sym_name.data} spans micro-batches or "
                                         "device groups, which only the step itself may (a layer whose ops mix the "
                                         "batch's rows, in a pipelined group beside other device groups): run that "
                                         "group without pp, or the pipeline on its own")
    return collectives


def _leaves(ops: list[Operation], mesh: StageMesh) -> dict[Operation, bool]:
    """Return parameter or input -> whether it comes in micro-batches (one micro-batch: every batch input)."""
    leaves: dict[Operation, bool] = {}
    for o in ops:
        if isinstance(o, (graph.ParameterOp, graph.InputOp)):
            what = f"{'parameter' if isinstance(o, graph.ParameterOp) else 'input'} '{o.tensor_name.data}'"
            _, dim = stage_layout(layout_of(o.properties["global_type"]), mesh, 0, what)  # type: ignore[arg-type]
            leaves[o] = dim is not None or (mesh.microbatches == 1 and isinstance(o, graph.InputOp)
                                            and len(o.result.type.get_shape()) > 0)
            if dim is not None and (isinstance(o, graph.ParameterOp) or dim != 0):
                raise PassError(f"pipeline-split: {what} is split over the micro-batches along dim {dim}; "
                                "only batch inputs may be, along dim 0 (ZeRO is not combined with pipeline "
                                "stages)")
    return leaves


def find_group(op: ModuleOp, pipe: Pipeline, m: int) -> PipelinedGroup:
    """Return the stage-shaped group of pipelined group `pipe` (m micro-batches) in physical module `op`."""
    stage_devices = _stage_devices(pipe)
    virtual, group, others = _group_module(op, pipe, m, len(stage_devices[0]))
    foreign = frozenset(d for g, _ in others for d in g)
    if foreign & set(virtual):
        raise PassError(f"pipeline-split: the virtual devices {list(virtual)} overlap another group's")
    mesh = StageMesh(stage_devices, tuple(virtual), m, foreign)
    functions = [f for f in group.body.block.ops if isinstance(f, func.FuncOp)]
    step = next((f for f in functions if f.sym_name.data == "train_step"), None)
    if step is None:
        raise PassError("pipeline-split: the group has no @train_step")
    ops = [o for o in step.body.block.ops if not isinstance(o, func.ReturnOp)]
    collectives = _classify(functions, step, mesh)
    return PipelinedGroup(mesh, group, others, functions, step, ops, collectives, _leaves(ops, mesh))


def forward_end(ops: list[Operation], what: str = "pipeline-split") -> int:
    """Return the index after the step's `graph.output "loss"` (the end of the forward)."""
    end = next((i + 1 for i, o in enumerate(ops) if isinstance(o, graph.OutputOp)
                and o.tensor_name.data == "loss"), None)
    if end is None:
        raise PassError(f"{what}: the step has no graph.output \"loss\" (the end of the forward)")
    return end


def op_kinds(ops: list[Operation], collectives: Collectives,
             leaves: dict[Operation, bool], microbatches: int) -> dict[Operation, str]:
    """Return op -> "mb" (runs once per micro-batch: it depends on an input split over the
    micro-batches), "post" (after the accumulation: it depends on an all-reduce over the
    micro-batches) or "step" (once). Resolves each XSPAN in `collectives` into XMEET or XPOST."""
    kind: dict[Operation, str] = {}
    for o in ops:
        c = collectives.get(o, (LOCAL, ()))[0]
        if c in (XSPAN, ZERO, XPOST):  # across micro-batches (and groups): by what the operand is
            x = o.operands[0].owner
            k = kind.get(x, "step") if isinstance(x, Operation) else "step"
            if c == ZERO and k == "mb":
                raise PassError(f"pipeline-split: '{o.name}' zeroes all but one micro-batch's value before it is "
                                "summed over them; a pipelined stage cannot")
            if c == XSPAN and k != "mb":
                if not isinstance(x, Operation) or collectives.get(x, (LOCAL, ()))[0] != ZERO:
                    raise PassError(f"pipeline-split: '{o.name}' sums across device groups a value that every "
                                    "micro-batch holds whole; a pipelined stage cannot")
                collectives[o] = (XPOST, ())  # only micro-batch 0's copy is not zero: one sum across groups
            elif c == XSPAN:
                collectives[o] = (XMEET, ())  # the micro-batches' sum, then the sum across groups
        c = collectives.get(o, (LOCAL, ()))[0]
        if c in (MEET, XMEET) or o.dialect_name() == "optim":  # the update comes last
            kind[o] = "post"
        elif c == VLOCAL:  # each micro-batch's own piece
            kind[o] = "mb"
        elif o in leaves:
            kind[o] = "mb" if leaves[o] else "step"
        elif collectives.get(o, (LOCAL, ()))[0] == SPLIT:  # micro-batch i's slice: one per micro-batch
            if kind.get(o.operands[0].owner) == "post":
                raise PassError(f"pipeline-split: '{o.name}' splits a value summed over the micro-batches "
                                "across them again")
            kind[o] = "mb"
        else:
            ks = {kind.get(v.owner, "step") for v in o.operands}
            kind[o] = "post" if "post" in ks else "mb" if "mb" in ks else "step"
            if kind[o] == "mb" and isinstance(o, (graph.AssignOp, graph.OutputOp)) and microbatches == 1:
                kind[o] = "post"  # one micro-batch: its value is the sum over the micro-batches
            elif kind[o] == "mb" and isinstance(o, (graph.AssignOp, graph.OutputOp)):
                raise PassError(f"pipeline-split: '{o.name}' \"{o.tensor_name.data}\" would be one value per "
                                "micro-batch; only values summed over the micro-batches can be outputs or assigned")
    return kind


