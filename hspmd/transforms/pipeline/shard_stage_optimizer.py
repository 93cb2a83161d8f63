"""`shard-stage-optimizer`: ZeRO (stages 1 to 3) over the data-parallel ranks of each pipeline stage.

`shard-stage-optimizer` runs after `pipeline-split` on the stage modules of a
pipeline whose stages hold dp x tp devices (dp major, tp minor: the dp groups of a stage
are `[stage[d*tp + t] for d]` for each tp rank t). `[0-7]: dp=2 pp=2 zero=1` compiles to it.
For each parameter update (`optim.adam`, `optim.sgd`) whose parameter's layout
`shard-optimizer-state` would split over dp (`sharded_state_layout`: along the first dim dp
divides that tp does not split):

* the gradient's all-reduce over the dp groups (after the stage's `pipeline.run` sums the
  micro-batches, or inside its backward with one micro-batch) becomes a reduce-scatter along
  that dim: each dp rank keeps the sum of its slice only;
* the optimizer states (`opt.m.NAME`, `opt.v.NAME`, `opt.momentum.NAME`) hold that slice
  only: their layout is the sharded one (checkpoints gather them like any parameter);
* the update runs on the slice (`comm.local_split` of the parameter) and the new parameter is
  all-gathered (`comm.all_gather`) before its assignment.

Under `zero=3` the parameter holds the slice too (its `graph.parameter` has the slice's type and
the sharded layout, so checkpoints save pieces): it is all-gathered once per step, just before the
first op of the step that reads it (the `pipeline.run`, which passes it to every micro-batch's
forward and backward), the update reads the slice itself (no `comm.local_split`) and the assign
writes the slice (no gather after the update). Once per step rather than per micro-batch is
FSDP's choice under pipelines (`docs/passes.md`, ZeRO-3): the micro-batches' gradients are summed
on the stage's whole weights anyway, and 2m gathers a step would be exposed in the pipeline.
Parameters updated without states (plain SGD) are sliced under `zero=3` as well.

The gradient's sum is bitwise the all-reduce's slice (both are left folds in group order) and
the update is elementwise, so the run computes the numbers of the pipeline without ZeRO.
With gradient clipping each `optim.sum_squares` of a sharded gradient squares the slice: a
partial sum over the dp ranks, and one of a gradient left whole is zeroed on all but the first
dp rank (`comm.local_zero`), so the norm's left fold stays a partial sum (also across stages,
position by position), all-reduced over the dp ranks just before `optim.clip_coef`.
Parameters whose update does not read such a gradient (no all-reduce over dp, or a gradient
used elsewhere) keep their states whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from hspmd.dialects import comm, graph, optim, pipeline
from hspmd.dialects.dist import layout_of, with_layout
from hspmd.dialects.levels import physical_groups
from hspmd.transforms.optimizer import STATE_PREFIX
from hspmd.transforms.shard_optimizer_state import sharded_state_layout
from hspmd.ir.stacked_names import is_stacked
from hspmd.transforms.util import PassError, module_strategy

_UPDATES = (optim.AdamOp, optim.SGDOp)


def _shard_type(typ: TensorType, dim: int, dp: int) -> TensorType:
    shape = list(typ.get_shape())
    shape[dim] //= dp
    return TensorType(typ.element_type, shape)


def _recreate(op: Operation, operands: list[SSAValue], result_types: list) -> Operation:
    """Return a new op of `op`'s kind and properties with other operands and result types, in its place."""
    new = type(op).create(operands=operands, result_types=result_types, properties=dict(op.properties),
                          attributes=dict(op.attributes))
    Rewriter.insert_op(new, InsertPoint.before(op))
    for old, r in zip(op.results, new.results):
        old.replace_all_uses_with(r)
    op.detach()
    op.erase()
    return new


@dataclass
class _Stage:
    """One stage module being sharded: its step, run, backward and dp groups."""

    step: func.FuncOp
    run: pipeline.RunOp
    backward: func.FuncOp
    groups: list[list[int]]
    dp: int

    def is_dp_all_reduce(self, op: Operation | None) -> bool:
        return isinstance(op, comm.AllReduceOp) and sorted(map(sorted, op.rank_groups)) == sorted(
            map(sorted, self.groups))

    def grad_all_reduce(self, grad: SSAValue) -> tuple[comm.AllReduceOp, int | None] | None:
        """Return (the dp all-reduce that makes `grad`, its run result index when it is in the backward)."""
        if self.is_dp_all_reduce(grad.owner) and grad.owner.parent_op() is self.step:  # type: ignore[union-attr]
            return grad.owner, None  # type: ignore[return-value]
        if grad.owner is self.run:
            k = list(self.run.results).index(grad)  # type: ignore[arg-type]
            n_forward = len(self.run.results) - len(self.backward.function_type.outputs.data)
            if k >= n_forward:
                ret = self.backward.body.block.last_op
                value = ret.operands[k - n_forward]  # type: ignore[union-attr]
                if self.is_dp_all_reduce(value.owner) and len(list(value.uses)) == 1:
                    return value.owner, k  # type: ignore[return-value]
        return None


def _shard_stage(module: ModuleOp, devices: tuple[int, ...], dp: int, tp: int, zero: int = 1) -> None:
    if len(devices) != dp * tp:
        raise PassError(f"shard-stage-optimizer: a stage on devices {list(devices)} does not hold dp={dp} x tp={tp}")
    funcs = {f.sym_name.data: f for f in module.body.block.ops if isinstance(f, func.FuncOp)}
    step = funcs.get("train_step")
    runs = [o for o in step.body.block.ops if isinstance(o, pipeline.RunOp)] if step else []
    if len(runs) != 1:
        raise PassError("shard-stage-optimizer: a stage module needs a @train_step with one pipeline.run")
    stage = _Stage(step, runs[0], funcs[runs[0].backward.root_reference.data],  # type: ignore[arg-type]
                   [[devices[d * tp + t] for d in range(dp)] for t in range(tp)], dp)
    sharded_squares: set[Operation] = set()
    for update in [o for o in step.body.block.ops if isinstance(o, _UPDATES)]:  # type: ignore[union-attr]
        sharded_squares |= _shard_update(stage, update, tp, zero == 3)
    if not sharded_squares:
        return
    for sq in [o for o in step.walk() if isinstance(o, optim.SumSquaresOp)]:  # type: ignore[union-attr]
        # a whole gradient's square counts on the first dp rank only
        if sq not in sharded_squares:
            zero = comm.LocalZeroOp(sq.result, stage.groups, sq.result.type)
            Rewriter.insert_op(zero, InsertPoint.after(sq))
            sq.result.replace_uses_with_if(zero.result, lambda use: use.operation is not zero)
    for coef in [o for o in step.walk() if isinstance(o, optim.ClipCoefOp)]:  # type: ignore[union-attr]
        total = comm.AllReduceOp(coef.total, stage.groups, coef.total.type)
        Rewriter.insert_op(total, InsertPoint.before(coef))
        coef.operands[0] = total.result


def _shard_update(stage: _Stage, update: Operation, tp: int, params: bool = False) -> set[Operation]:
    """Shard one update (see the module docstring), with `params` (zero=3) the parameter too;
    return the sum_squares ops that now square a slice."""
    param = update.operands[0]
    if not isinstance(param.owner, graph.ParameterOp):
        return set()
    typ = param.owner.properties["global_type"]
    layout = layout_of(typ) if isinstance(typ, TensorType) else None
    first = 1 if is_stacked(param.owner.tensor_name.data) else 0  # type: ignore[union-attr]  # not the layers' dim
    sharded = sharded_state_layout(layout, tuple(typ.get_shape()), stage.dp, tp, first) if layout else None  # type: ignore
    if sharded is None:
        return set()
    dim = sharded.groups[0].states.axes[0][0].dim
    # the gradient: the update's, through the clipping's scalings, from an all-reduce over dp
    grad, scalings = update.operands[1], []
    while isinstance(grad.owner, optim.MulScalarOp):
        scalings.append(grad.owner)
        grad = grad.owner.input
    found = stage.grad_all_reduce(grad)
    if found is None:
        return set()
    reduce, k = found
    users = {u.operation for v in [grad, *(s.result for s in scalings)] for u in v.uses}
    if not users <= {update, *scalings} | {u for u in users if isinstance(u, optim.SumSquaresOp)}:
        return set()  # the gradient is used whole elsewhere: keep it
    states = [v.owner for v in update.operands[2:] if isinstance(v.owner, graph.ParameterOp)
              and v.owner.tensor_name.data.startswith(STATE_PREFIX)]
    if not states and not params:
        return set()  # (plain SGD: nothing to shard, as in shard-optimizer-state)
    full = param.type
    shard = _shard_type(full, dim, stage.dp)  # type: ignore[arg-type]
    # the reduce-scatter in the all-reduce's place (in the step, or in the backward and the run)
    scatter = comm.ReduceScatterOp(reduce.input, stage.groups, shard, dim=dim)
    Rewriter.insert_op(scatter, InsertPoint.before(reduce))
    reduce.result.replace_all_uses_with(scatter.result)
    reduce.detach()
    reduce.erase()
    if k is not None:
        grad = _retype_run_result(stage, k, shard)
    else:
        grad = scatter.result
    squared = {u.operation for u in grad.uses if isinstance(u.operation, optim.SumSquaresOp)}
    for s in reversed(scalings):  # the clipping's scalings on the slice
        grad = _recreate(s, [grad, s.operands[1]], [shard]).results[0]
        squared |= {u.operation for u in grad.uses if isinstance(u.operation, optim.SumSquaresOp)}
    # the states hold the slice; the update runs on the parameter's slice; the result is gathered
    for st in states:
        new_state = graph.ParameterOp(st.tensor_name.data, st.init.data, shard,  # type: ignore[union-attr]
                                      with_layout(TensorType(full.element_type, typ.get_shape()), sharded))  # type: ignore
        Rewriter.insert_op(new_state, InsertPoint.before(st))  # type: ignore[arg-type]
        st.result.replace_all_uses_with(new_state.result)  # type: ignore[union-attr]
        st.detach()  # type: ignore[union-attr]
        st.erase()  # type: ignore[union-attr]
    if params:
        piece = _shard_parameter(stage, param.owner, shard, sharded, dim)  # type: ignore[arg-type]
    else:
        piece = comm.LocalSplitOp(param, stage.groups, shard, dim=dim).result
        Rewriter.insert_op(piece.owner, InsertPoint.before(update))
    operands = [piece, grad, *update.operands[2:]]
    types = [shard if r.type == full else r.type for r in update.results]
    new = _recreate(update, operands, types)
    if not params:
        gathered = comm.AllGatherOp(new.results[0], stage.groups, full, dim=dim)
        Rewriter.insert_op(gathered, InsertPoint.after(new))
        new.results[0].replace_uses_with_if(gathered.result, lambda use: use.operation is not gathered)
    return squared


def _shard_parameter(stage: _Stage, param: graph.ParameterOp, shard: TensorType, sharded, dim: int) -> SSAValue:
    """Make `param` hold its dp slice between steps (zero=3): gathered once per step, just before
    the first op of the step that reads it whole (the stage's `pipeline.run`, or an op before it);
    return the slice, which the update reads and the assign writes."""
    typ = param.properties["global_type"]
    new_param = graph.ParameterOp(param.tensor_name.data, param.init.data, shard,
                                  with_layout(TensorType(typ.element_type, typ.get_shape()), sharded))  # type: ignore
    Rewriter.insert_op(new_param, InsertPoint.before(param))
    block = stage.step.body.block  # (a parameter is read in the step's block only: the run passes it on)
    first = min((u.operation for u in param.result.uses), key=block.get_operation_index)
    gathered = comm.AllGatherOp(new_param.result, stage.groups, param.result.type, dim=dim)
    Rewriter.insert_op(gathered, InsertPoint.before(first))
    param.result.replace_all_uses_with(gathered.result)
    param.detach()
    param.erase()
    return new_param.result


def _retype_run_result(stage: _Stage, k: int, shard: TensorType) -> SSAValue:
    """Give result k of the stage's run (one of its backward's) the slice's type; return the new result."""
    run, backward = stage.run, stage.backward
    ret = backward.body.block.last_op
    outputs = [v.type for v in ret.operands]  # type: ignore[union-attr]
    backward.function_type = func.FunctionType.from_lists(list(backward.function_type.inputs.data), outputs)
    types = [r.type for r in run.results]
    types[k] = shard
    stage.run = _recreate(run, list(run.operands), types)  # type: ignore[assignment]
    return stage.run.results[k]


@dataclass(frozen=True)
class ShardStageOptimizer(ModulePass):
    """Shard the optimizer states of every pipeline stage over its dp ranks (see the module docstring)."""

    name = "shard-stage-optimizer"

    #: the id of the module's strategy to read (None: its only one)
    strategy_id: int | None = None

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        record = module_strategy(op, self.strategy_id, self.name)
        if len(record.strategy.groups) != 1:
            return  # (ZeRO in a pipeline beside other groups is refused when the strategy is applied)
        group = record.strategy.groups[0]
        if group.pp == 1 or not group.zero or group.dp == 1:
            return
        for devices, module in physical_groups(op):
            if pipeline.STAGE_ATTR in module.attributes and pipeline.SINGLE_STAGE_ATTR not in module.attributes:
                _shard_stage(module, devices, group.dp, group.tp, group.zero)


__all__ = ["ShardStageOptimizer"]
