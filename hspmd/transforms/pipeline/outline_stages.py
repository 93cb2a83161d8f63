"""`outline-pipeline-stages`: cut a stage-shaped step whose ops carry their stages into stage modules.

Input: the output of `assign-pipeline-stages` (every op of each pipelined group's `@train_step`
has `pipeline.stage = S`, -1 for free ops). For each pipelined group (`group=K`: only the
K-th) its group module is replaced, where it stood, by one group module per stage
(`hspmd.devices` the stage's devices, `hspmd.pipeline_stage`, `hspmd.microbatches`), each with:

* `@train_step`: the ops that do not depend on the batch (parameters, their views, copies of
  free ops: "pre"), one `pipeline.run` of `@pipeline_forward`/`@pipeline_backward` on each
  micro-batch in the schedule's order (its results: the values summed over the micro-batches),
  then what follows the sums ("post": the all-reduces over the stage's dp ranks, the update,
  outputs and assignments); `@pipeline_forward` / `@pipeline_backward` hold one micro-batch's
  forward / backward ops (`stage_builder.py`); the callees, on the stage's devices;
* collectives inside one micro-batch on the stage's devices; an all-reduce over the
  micro-batches becomes the run's sum, then an all-reduce over the stage's dp ranks; a local
  split across them a slice per micro-batch (`stage_mesh.py` classifies them); a batch input
  `x@mb`, the batch viewed as `[m, rows / m, ...]`;
* **messages**: a value used on another stage than its producer's is sent (`comm.send`) right
  after it is made and received (`comm.recv`) right before its first use, between the same
  position of both stages, each message with its own tag (1, 2, ...). A micro-batch's value may
  go from a forward to a later stage's forward, from a backward to an earlier stage's backward,
  or from a forward to any stage's backward; an assignment that needs another flow (an action
  waiting for one that the schedule runs after it) is refused naming the op. The k-th message
  with a tag is micro-batch k's; receives wait only for earlier actions, so no rank deadlocks.

Beside other device groups, each collective with them goes to the stage computing its
operand, renamed onto that stage's devices and marked `pipeline.cross = k` (its index among the
step's cross-group collectives) for `join-pipeline-groups`, which the other groups need next.
The `pipeline.stage` attributes are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerAttr, ModuleOp, StringAttr, i64
from xdsl.ir import Operation
from xdsl.passes import ModulePass

from hspmd.dialects import comm
from hspmd.dialects.pipeline import CROSS_ATTR, MICROBATCHES_ATTR, OP_STAGE_ATTR, STAGE_ATTR
from hspmd.dialects.levels import DEVICES_ATTR, devices_attr, physical_groups
from hspmd.transforms.pipeline.assign_stages import check_pipeline_schedule
from hspmd.transforms.pipeline.devices import remap_op
from hspmd.transforms.pipeline.group import PipelinedGroup, find_group, forward_end, op_kinds
from hspmd.transforms.pipeline.stage_builder import (BACKWARD_FN, FORWARD_FN, FREE, STEP, Message, StageBuilder,
                                                     StagePlan, StageProgram)
from hspmd.transforms.pipeline.stage_mesh import (CROSS, MAPPED, MEET, SPLIT, VLOCAL, XMEET, XPOST, StageMesh,
                                                  classify_collective, restage_global_types, run_as_virtual)
from hspmd.transforms.pipeline.virtual import selected_pipelines
from hspmd.transforms.util import PassError

__all__ = ["MAX_TAG", "OutlinePipelineStages", "outline_group", "read_stages"]

#: message tags are 1, 2, ...; MPI promises at least this many
MAX_TAG = 32767


def read_stages(ops: list[Operation], what: str = "outline-pipeline-stages") -> dict[Operation, int]:
    """Return op -> stage from the ops' `pipeline.stage` attributes, and drop them."""
    stages: dict[Operation, int] = {}
    for o in ops:
        attr = o.attributes.pop(OP_STAGE_ATTR, None)
        if not isinstance(attr, IntegerAttr):
            raise PassError(f"{what}: '{o.name}' in the pipelined @train_step has no integer {OP_STAGE_ATTR} "
                            "attribute (run assign-pipeline-stages first)")
        stages[o] = attr.value.data
    pp_ops = [o for o, s in stages.items() if s < FREE]
    if pp_ops:
        raise PassError(f"{what}: '{pp_ops[0].name}' has {OP_STAGE_ATTR} = {stages[pp_ops[0]]}; a stage is >= 0 "
                        "(or -1: free)")
    return stages


def plan_messages(plan: StagePlan, order: list[tuple[int, tuple[str, int]]]) -> dict[Message, int]:
    """Return (value, how, from stage, to stage) -> tag for every value a stage uses from another."""
    position = {sa: k for k, sa in enumerate(order)}
    messages: dict[Message, int] = {}
    for c in range(len(plan.mesh.stages)):
        for o in plan.ops:
            if not plan.runs_on(o, c):
                continue
            if plan.coll(o) in (MEET, XMEET):
                uses = [(o.operands[0], "sum")]
            elif plan.coll(o) == SPLIT:
                uses = [(o.operands[0], "one")]
            else:  # a micro-batch's value used after the run (one micro-batch) is its sum
                after = plan.region_of(o) == STEP
                uses = [(v, ("sum" if after else "mb") if isinstance(v.owner, Operation)
                         and plan.kind.get(v.owner) == "mb" else "one") for v in o.operands]
            for v, how in uses:
                t = plan.stage_of(v)
                if t in (FREE, c) or (v, how, t, c) in messages:
                    continue
                if how == "mb":
                    assert isinstance(v.owner, Operation)
                    made, used = plan.region_of(v.owner), plan.region_of(o)
                    if any(position[(t, (made, i))] > position[(c, (used, i))] for i in range(plan.mesh.microbatches)):
                        raise PassError(f"pipeline-split: '{v.owner.name}' on stage {t} is made in an action that "
                                        f"comes after the one of stage {c} that uses it; this stage assignment "
                                        f"does not fit the schedule")
                messages[(v, how, t, c)] = len(messages) + 1
    if len(messages) > MAX_TAG:
        raise PassError(f"pipeline-split: the stages exchange {len(messages)} different messages; message tags "
                        f"go up to {MAX_TAG}")
    return messages


def _callees_on_stage(functions: list[func.FuncOp], mesh: StageMesh, s: int) -> list[func.FuncOp]:
    """Return clones of the step's callees with their collectives (inside one micro-batch) on stage s."""
    out = [f.clone() for f in functions]
    for f in out:
        for o in f.walk():
            if o.dialect_name() != "comm":
                continue
            kind, positions = classify_collective(o, mesh)
            if kind == VLOCAL:
                run_as_virtual(o, mesh, s)
            elif kind == MAPPED:
                remap_op(o, mesh.device_map(s))
            else:
                o.properties["groups"] = comm.groups_attr(mesh.real(s, positions))
        restage_global_types(f.walk(), mesh, s)
    return out


def _stage_module(program: StageProgram, callees: list[func.FuncOp], devices: tuple[int, ...], s: int,
                  m: int) -> ModuleOp:
    fn = func.FuncOp("train_step", ((), ()))
    fn.body.block.add_ops([*program.step, func.ReturnOp()])
    return ModuleOp([fn, program.forward, program.backward, *callees],
                    attributes={DEVICES_ATTR: devices_attr(devices), STAGE_ATTR: IntegerAttr(s, i64),
                                MICROBATCHES_ATTR: IntegerAttr(m, i64)})


def _mark_cross(plan: StagePlan) -> None:
    """Mark each stage's stand-in for the step's k-th collective with other groups `pipeline.cross = k`."""
    cross = [o for o in plan.ops if plan.coll(o) in (CROSS, XMEET, XPOST)]
    for k, o in enumerate(cross):
        if o not in plan.placed:
            raise PassError(f"pipeline-split: internal error: the cross-group '{o.name}' went to no stage")
        plan.placed[o][1].attributes[CROSS_ATTR] = IntegerAttr(k, i64)


def outline_group(op: ModuleOp, g: PipelinedGroup, schedule: str) -> None:
    """Replace pipelined group `g`'s module in `op` by its stage modules (see the module docstring)."""
    mesh, m = g.mesh, g.mesh.microbatches
    pp = len(mesh.stages)
    order = check_pipeline_schedule(schedule, pp, m)
    stages = read_stages(g.ops)
    beyond = [o for o, s in stages.items() if s >= pp]
    if beyond:
        raise PassError(f"outline-pipeline-stages: '{beyond[0].name}' has {OP_STAGE_ATTR} = {stages[beyond[0]]}, "
                        f"but the pipeline has {pp} stages")
    kind = op_kinds(g.ops, g.collectives, g.leaves, m)
    taken = {f.sym_name.data for f in g.functions} & {FORWARD_FN, BACKWARD_FN}
    if taken:
        raise PassError(f"pipeline-split: the group already has a function @{', @'.join(sorted(taken))}; "
                        "those names are the stages' own")
    plan = StagePlan(g.ops, stages, mesh, schedule, g.collectives, g.leaves, kind, forward_end(g.ops))
    plan.set_messages(plan_messages(plan, order))
    programs = [StageBuilder(plan, s).build() for s in range(pp)]
    callees = [f for f in g.functions if f is not g.step]
    modules = [_stage_module(programs[s], _callees_on_stage(callees, mesh, s), mesh.stages[s], s, m)
               for s in range(pp)]
    if g.others:
        _mark_cross(plan)
    for module in modules:  # the stages where the one-group module was
        op.body.block.insert_op_before(module, g.module)
    g.module.detach()
    g.module.erase()
    for gi, (_, module) in enumerate(physical_groups(op)):
        module.sym_name = StringAttr(f"group{gi}")


@dataclass(frozen=True)
class OutlinePipelineStages(ModulePass):
    """Replace each pipelined group's stage-shaped module by one module per stage (`pipeline.run` of
    a forward and a backward over the micro-batches, send/recv between stages)."""

    name = "outline-pipeline-stages"

    #: the id of the module's strategy to read (None: its only one)
    strategy_id: int | None = None
    #: the pipelined group to outline (its index among the strategy's pipelined groups; None: all)
    group: int | None = None

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        record, pipes = selected_pipelines(op, self.strategy_id, self.group, self.name)
        for pipe in pipes:
            outline_group(op, find_group(op, pipe, record.microbatches), record.schedule)
