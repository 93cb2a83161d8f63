"""`assign-pipeline-stages`: decide each op's pipeline stage and write it into the IR.

Input: the physical IR of a pipelined strategy after `specialize-groups, lower-reshard` (the
step of each pipelined group annotated as one stage on virtual devices, `virtual.py`). For
each pipelined group (`group=K`: only the K-th), every op of its `@train_step` gets an
attribute `pipeline.stage = S : i64`, its stage, or `-1` for a *free* op that each stage which
needs it computes itself. `outline-pipeline-stages` reads them; a user may read or edit them
(`hspmd-opt -p ...,assign-pipeline-stages`).

* **layers** (`balance.py`): the forward `func.call`s of `*_fwd` block functions (else the
  parameter name prefixes); `layers="3,1"` in the strategy fixes the counts, else contiguous
  ranges balanced by forward cost. Fewer layers than stages is refused naming both numbers.
  Stacked layers come cut by stage (`cut-stacked-layers`): each piece's forward scan is one
  unit whose stage its `pipeline.layer_stage` gives (read and dropped here).
* **forward** ops (up to `graph.output "loss"`): the last stage among their operands and the
  parameters they read, directly or through casts (a parameter no layer claims goes to its
  first forward user's stage: the embedding to stage 0, the head to the last; a mixed-precision
  cast of it goes with its users);
* **backward and update** ops: the stage of a parameter they read; else the one stage all
  their operands come from, or the stage of a weight's transpose they use; a view (transpose,
  reshape, broadcast, cast) of forward values only goes to its users' last stage; else the
  first stage among their users (an activation's gradient is computed where its layer lives),
  never earlier than an action that runs before it would allow; `graph.assign` with its
  parameter; optimizer state `opt.<kind>.NAME` with parameter NAME;
* **free** values (constants, inputs, scalar optimizer state like `opt.step`, ops of only
  those): -1.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerAttr, ModuleOp, i64
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass

from hspmd.dialects import graph
from hspmd.dialects.pipeline import OP_STAGE_ATTR
from hspmd.ir.pipeline_schedule import SCHEDULES, PipelineScheduleError, check_schedule
from hspmd.transforms.pipeline.balance import layer_costs, layers_of, stage_of_layers
from hspmd.transforms.pipeline.cut_stacks import LAYER_STAGE_ATTR
from hspmd.transforms.pipeline.group import find_group, forward_end, op_kinds
from hspmd.transforms.pipeline.virtual import selected_pipelines
from hspmd.transforms.util import PassError

__all__ = ["FREE", "AssignPipelineStages", "assign_stages"]

FREE = -1
_UNDECIDED = -2
_DEFER = -99  # rule(): the reverse sweep decides
_VIEWS = (graph.TransposeOp, graph.ReshapeOp, graph.BroadcastOp, graph.CastOp)


class _Assignment:
    """op -> stage for one step, built in two sweeps (forward rules, then the undecided ops backwards)."""

    def __init__(self, ops: list[Operation], pp: int, param_stage: dict[str, int],
                 layer_ops: dict[Operation, int], end: int, post: set[Operation]):
        self.ops, self.pp, self.post = ops, pp, post
        self.param_stage, self.layer_ops = param_stage, layer_ops
        self.forward_ops = set(ops[:end])
        self.stage: dict[Operation, int] = {}
        self.undecided: list[Operation] = []
        self.views: list[Operation] = []
        self.pinned_ops: set[Operation] = set()  # backward ops that read a parameter

    def value_stage(self, v: SSAValue) -> int:
        return self.stage.get(v.owner, FREE) if isinstance(v.owner, Operation) else FREE

    def owner_of_state(self, name: str) -> int | None:
        if name in self.param_stage:
            return self.param_stage[name]
        if name.startswith("opt.") and name.count(".") >= 2:
            return self.param_stage.get(name.split(".", 2)[2])
        return None

    def sweep(self) -> None:
        """Decide every op the rules settle from its operands; mark the others undecided."""
        for o in self.ops:
            if isinstance(o, graph.ParameterOp):
                continue  # decided at the end, when a user settles it
            if isinstance(o, graph.AssignOp):
                s = self.owner_of_state(o.tensor_name.data)
                self.stage[o] = FREE if s is None else s
            elif isinstance(o, graph.OutputOp):
                self.stage[o] = FREE if o.tensor_name.data == "loss" else self.value_stage(o.value)
            else:
                s = self.rule(o)
                if s != _DEFER:
                    self.stage[o] = FREE if s is None else s

    def rule(self, o: Operation) -> int | None:
        """Return the stage of a compute op, None when free, _DEFER when its users decide."""
        if o in self.layer_ops:
            return self.layer_ops[o]
        if o in self.forward_ops and isinstance(o, graph.CastOp) and (p := _parameter_of(o.result)) is not None \
                and self.owner_of_state(p.tensor_name.data) is None:
            self.views.append(o)  # a mixed-precision cast of a parameter no layer claims: with its users,
            self.stage[o] = _UNDECIDED  # who claim the parameter as if they read it
            return _DEFER
        params = [p for v in o.operands if (p := _parameter_of(v)) is not None]
        pinned = [s for p in params if (s := self.owner_of_state(p.tensor_name.data)) is not None]
        others = {self.value_stage(v) for v in o.operands if _parameter_of(v) is None} - {FREE}
        if o in self.forward_ops:
            s = max([*pinned, *others], default=None)
            if s is None and params:
                s = 0
            unclaimed = [p for p in params if self.owner_of_state(p.tensor_name.data) is None]
            if s is not None:
                for p in unclaimed:
                    self.param_stage.setdefault(p.tensor_name.data, s)
            return s
        if pinned:
            self.pinned_ops.add(o)
            return max(pinned)
        # uses a weight's transpose (a view of a parameter): with the weight; not any result of an op
        # that reads a parameter (a norm's input gradient goes on to the stages before it)
        weights = [v.owner for v in o.operands if v.owner in self.pinned_ops and isinstance(v.owner, _VIEWS)]
        if weights:
            return max(self.stage[w] for w in weights)  # type: ignore[index]
        if isinstance(o, _VIEWS) and others and all(v.owner in self.forward_ops for v in o.operands
                                                    if self.value_stage(v) != FREE):
            self.views.append(o)  # a view of a forward value (a residual's transpose): with its users
        elif _UNDECIDED in others or len(others) > 1:
            self.undecided.append(o)
        else:
            return next(iter(others), None)
        self.stage[o] = _UNDECIDED  # not FREE: decided in the reverse sweep
        return _DEFER

    def resolve(self) -> None:
        """Decide the undecided ops from their users (backwards), then lift them up to where their
        operands allow. Backward values made in an action flow from later stages to earlier ones
        (B(i) runs on stage s+1 before stage s); values made after every action ("post") go anywhere."""
        stage, post = self.stage, self.post
        where = {o: i for i, o in enumerate(self.ops)}
        resolved = sorted([*self.undecided, *self.views], key=where.__getitem__)
        views = set(self.views)
        for o in reversed(resolved):
            users = [u.operation for r in o.results for u in r.uses
                     if u.operation in stage and not isinstance(u.operation, graph.OutputOp)]
            stages = {stage[u] for u in users} - {FREE, _UNDECIDED}
            floor = max({stage[u] for u in users if u not in post} - {FREE, _UNDECIDED}, default=0)
            if stages:
                stage[o] = max(stages) if o in views else max(min(stages), floor)
            else:  # nothing decided reads it (a gradient's last sum, read by its output only)
                backward = {self.value_stage(v) for v in o.operands
                            if v.owner not in self.forward_ops and v.owner not in post} - {FREE, _UNDECIDED}
                # backward values of several stages meet on the earliest (its action runs last)
                stage[o] = min(backward) if len(backward) > 1 and o not in post else \
                    max(self.value_stage(v) for v in o.operands)
        for o in resolved:  # then up to where its forward operands (else its operands) live, where allowed
            made = [v for v in o.operands if self.value_stage(v) != FREE]
            forward = {self.value_stage(v) for v in made if v.owner in self.forward_ops}
            backward = {self.value_stage(v) for v in made if v.owner not in self.forward_ops and v.owner not in post}
            if o in post:  # runs after every action, anywhere: with its one producer (a gradient's norm)
                up = self.value_stage(made[0]) if len(made) == 1 else FREE
            else:
                up = min(max(forward or backward, default=FREE), min(backward, default=self.pp))
            if up > stage[o]:
                stage[o] = up
        for o in self.ops:
            if isinstance(o, graph.ParameterOp):
                s = self.owner_of_state(o.tensor_name.data)
                stage[o] = FREE if s is None else s
            elif isinstance(o, graph.OutputOp) and o.tensor_name.data != "loss":
                stage[o] = max(self.value_stage(o.value), 0)


def _parameter_of(v: SSAValue) -> graph.ParameterOp | None:
    """Return the parameter `v` is, directly or through casts (mixed precision casts each
    parameter where the forward reads it), else None."""
    while isinstance(v.owner, graph.CastOp):
        v = v.owner.input
    return v.owner if isinstance(v.owner, graph.ParameterOp) else None


def assign_stages(ops: list[Operation], pp: int, counts: tuple[int, ...] | None = None,
                  post: set[Operation] | None = None) -> dict[Operation, int]:
    """Return op -> stage (FREE for ops every stage may compute itself); see the module docstring.

    `post` holds the ops that run after every action of the schedule (the update, the sums
    over micro-batches and what follows them)."""
    end = forward_end(ops)
    layers, layer_of_param, what = layers_of(ops, end)
    module = ops[0].parent_op().parent_op() if ops and ops[0].parent_op() is not None else None
    funcs = {f.sym_name.data: f for f in module.body.block.ops if isinstance(f, func.FuncOp)} \
        if isinstance(module, ModuleOp) else {}
    marks = [group[0].attributes.get(LAYER_STAGE_ATTR) if group else None for group in layers]
    if layers and all(isinstance(m, IntegerAttr) for m in marks):  # stacked layers cut by stage: as cut
        stage_of_layer = [m.value.data for m in marks]  # type: ignore[union-attr]
        for group in layers:
            del group[0].attributes[LAYER_STAGE_ATTR]
    else:
        costs = layer_costs(ops, end, layers, layer_of_param, funcs) if len(layers) >= pp else None
        stage_of_layer = stage_of_layers(len(layers), pp, counts, what, costs)
    param_stage = {name: stage_of_layer[k] for name, k in layer_of_param.items()}
    layer_ops = {o: stage_of_layer[k] for k, group in enumerate(layers) for o in group}
    assignment = _Assignment(ops, pp, param_stage, layer_ops, end, post or set())
    assignment.sweep()
    assignment.resolve()
    return assignment.stage


def check_pipeline_schedule(schedule: str, pp: int, m: int) -> list[tuple[int, tuple[str, int]]]:
    """Return the schedule's actions in one runnable order, or refuse it."""
    try:
        return check_schedule(SCHEDULES[schedule](pp, m), m)
    except PipelineScheduleError as err:
        raise PassError(f"pipeline-split: schedule '{schedule}': {err}") from None


@dataclass(frozen=True)
class AssignPipelineStages(ModulePass):
    """Write each op's pipeline stage (`pipeline.stage`) into the stage-shaped step of each pipelined group."""

    name = "assign-pipeline-stages"

    #: the id of the module's strategy to read (None: its only one)
    strategy_id: int | None = None
    #: the pipelined group to assign (its index among the strategy's pipelined groups; None: all)
    group: int | None = None

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        record, pipes = selected_pipelines(op, self.strategy_id, self.group, self.name)
        m = record.microbatches
        for pipe in pipes:
            g = find_group(op, pipe, m)
            check_pipeline_schedule(record.schedule, pipe.pp, m)
            post = {o for o, kind in op_kinds(g.ops, g.collectives, g.leaves, m).items() if kind == "post"}
            attrs = {s: IntegerAttr(s, i64) for s in range(FREE, pipe.pp)}  # one attribute object per stage
            for o, s in assign_stages(g.ops, pipe.pp, pipe.layers, post).items():
                o.attributes[OP_STAGE_ATTR] = attrs[s] if s in attrs else IntegerAttr(s, i64)
