"""`shard-parameters`: ZeRO stage 3, every parameter split over data parallelism, gathered where used.

Runs after `shard-optimizer-state` and before `propagate-layouts` (the compiler adds both for a
group with `zero=3`). Every parameter of such a group (not its optimizer states, which
`shard-optimizer-state` splits already) gets in its type the layout its states have: split over
the group's dp mesh axis along its first dim dp divides and tp does not split
(`shard_optimizer_state.group_state_layout`; a stacked parameter's layers are never split). So
each dp rank holds 1/dp of each parameter, of its gradient's reduction and of its states.

Where a parameter is read, it is gathered back first: a `dist.reshard` to the layout the
parameter had (apply-strategy's: replicated over dp, its tp split kept) is put

* in a layer function (a `func.call` or `graph.scan` callee, reached through the call's
  operand; a stacked parameter's slice in a scan): once at the top of each body that computes
  with it, so each layer's weights are gathered just before its forward, again inside its
  backward (`@F_bwd` reads the sharded operand, never a gathered copy kept from the forward),
  and freed after the body's last use of them;
* in the step itself (embedding, final norm, head): before each op that reads it, so the
  forward's copy is not kept alive until the backward.

The update (`optim.*`) and `graph.assign` read the shard: propagation then reduce-scatters each
gradient into its shard (`partial -> split`; a stacked parameter's inside the backward scan, each
layer's as its backward makes it, so no whole stacked gradient is ever held), the update runs on
the shard only, and nothing is all-gathered after the step. A group without `zero=3` keeps its parameters as they are (in a
strategy of several groups each `zero=3` group splits its part over its own dp). Under expert
parallelism a parameter replicated over the dp*ep batch ranks is split over all of them, and an
expert weight keeps its ep (and tp) split and is split over dp only (its states' layouts,
`group_state_layout`), so its gathers run over the dp ranks. Pipeline stages do not come here
(their step is annotated over micro-batches x dp): `shard-stage-optimizer` slices their parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Block, Operation, OpResult, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import Rewriter

from hspmd.dialects import dist, graph
from hspmd.dialects.dist import layout_of, with_layout
from hspmd.ir.layout import Layout
from hspmd.ir.stacked_names import is_stacked
from hspmd.ir.strategy import Strategy
from hspmd.transforms.optimizer import STATE_PREFIX
from hspmd.transforms.pipeline.virtual import annotation_strategy
from hspmd.transforms.shard_optimizer_state import group_state_layout
from hspmd.transforms.util import PassError, callee_of, module_strategy, step_function

#: users that read a parameter's shard as it is: the update, the assign of its new value
_SHARD_READERS = (graph.AssignOp, graph.OutputOp, dist.ReshardOp)


def sharded_parameter_layout(layout: Layout, shape: tuple[int, ...], strategy: Strategy,
                             first: int = 0) -> Layout | None:
    """Return a parameter's layout with each `zero=3` group's part split over that group's dp, or
    None when no part changes (dims dp does not divide, or no group asks for zero=3)."""
    if len(layout.groups) == 1 and len(strategy.groups) == 1:
        g = strategy.groups[0]
        return group_state_layout(layout, shape, g, first) if g.zero == 3 else None
    if len(layout.groups) != len(strategy.groups):
        return None  # uneven tp's sub-groups: kept whole
    groups, changed = [], False
    for part, g in zip(layout.groups, strategy.groups):
        new = group_state_layout(Layout.spmd(part.devices, part.states), shape, g, first) if g.zero == 3 else None
        groups.append(new.groups[0] if new is not None else part)
        changed |= new is not None
    return Layout(tuple(groups), layout.hetero, layout.shares) if changed else None


@dataclass
class _Gatherer:
    """Follows sharded values into the functions they are passed to and gathers them where read."""

    module: ModuleOp
    step: func.FuncOp
    #: each function argument (or value) already handled -> the layout it is gathered to
    done: dict[SSAValue, Layout]

    def follow(self, value: SSAValue, whole: Layout, name: str) -> None:
        """Gather `value` (a shard of `name`, whose whole layout is `whole`) where it is computed with."""
        if value in self.done:
            if self.done[value] != whole:
                raise PassError(f"shard-parameters: '{name}' reaches a function argument that another parameter "
                                f"reaches with another layout ({self.done[value]} vs {whole})")
            return
        self.done[value] = whole
        readers: dict[Block, list[Operation]] = {}
        for use in list(value.uses):
            user = use.operation
            if isinstance(user, _SHARD_READERS) or user.name.startswith("optim."):
                continue
            if isinstance(user, func.CallOp):
                self.follow(callee_of(user).body.block.args[use.index], whole, name)
            elif isinstance(user, graph.ScanOp):
                kind = user.arg_kind(use.index)
                arg = callee_of(user).body.block.args[use.index]
                self.follow(arg, whole.shift_dims(-1) if kind == "stacked" else whole, name)
            elif isinstance(user, func.ReturnOp):
                self._returned(user, use.index, whole, name)
            else:
                readers.setdefault(user.parent_block(), []).append(user)  # type: ignore[arg-type]
        for block, users in readers.items():
            per_op = block is self.step.body.block  # the step: a copy per reader (forward and backward apart)
            groups = [[u] for u in users] if per_op else [users]
            for group in groups:
                first = min(group, key=lambda o: block.get_operation_index(o))
                gather = dist.ReshardOp(value, with_layout(value.type, whole))
                Rewriter.insert_op(gather, _before(first))
                members = set(group)
                value.replace_uses_with_if(gather.result, lambda use, m=members: use.operation in m)

    def _returned(self, ret: func.ReturnOp, index: int, whole: Layout, name: str) -> None:
        """Follow a shard a function returns (a forward returning its weight as a residual) to its callers."""
        fn = ret.parent_op()
        assert isinstance(fn, func.FuncOp)
        callee = fn.sym_name.data
        for o in self.module.walk():
            if isinstance(o, graph.ScanOp) and o.callee.root_reference.data == callee:
                raise PassError(f"shard-parameters: @{callee} returns the shard of '{name}' from a scan")
            if isinstance(o, func.CallOp) and o.callee.root_reference.data == callee:
                self.follow(o.results[index], whole, name)


def _before(op: Operation):
    from xdsl.rewriter import InsertPoint

    return InsertPoint.before(op)


def shard_parameters(module: ModuleOp, strategy: Strategy) -> dict[str, str]:
    """Split the parameters of the `zero=3` groups of `strategy` and gather them where read (module
    docstring); return {parameter: its layout, or why it was kept}."""
    if not any(g.zero == 3 for g in strategy.groups):
        return {}
    if any(g.pp != 1 for g in strategy.groups):
        raise PassError(f"shard-parameters: strategy '{strategy}': zero=3 with pipeline parallelism is not "
                        "supported here (pp=1); pipeline stages shard theirs with shard-stage-optimizer")
    step = step_function(module)
    gatherer = _Gatherer(module, step, {})
    report: dict[str, str] = {}
    for op in list(step.body.block.ops):
        if not isinstance(op, graph.ParameterOp):
            continue
        name = op.tensor_name.data
        if name.startswith(STATE_PREFIX):
            continue
        layout = layout_of(op.result)
        if layout is None:
            raise PassError(f"shard-parameters: parameter '{name}' has no layout; run 'apply-strategy' first")
        shape = tuple(op.result.type.get_shape())
        new = sharded_parameter_layout(layout, shape, strategy, 1 if is_stacked(name) else 0)
        if new is None:
            report[name] = f"kept {layout}: no dim of {list(shape)} that dp divides and tp does not split"
            continue
        report[name] = str(new)
        Rewriter.replace_value_with_new_type(op.result, with_layout(op.result.type, new))
        gatherer.follow(op.result, layout, name)
        for use in list(op.result.uses):
            if use.operation.name.startswith("optim.") and use.index == 0:
                _scatter_in_layer(module, use.operation.operands[1], new)
    return report


def _scatter_in_layer(module: ModuleOp, grad: SSAValue, shard: Layout) -> None:
    """Reduce-scatter a stacked parameter's gradient inside the backward scan that makes it, one
    layer at a time (the scan then stacks shards, not whole partial sums): a reshard to the
    shard's layout (one layer's) before the callee returns it. `grad` is what the update reads:
    the scan's result, or a reshard or clipping (`optim.mul_scalar`) of it."""
    while isinstance(grad.owner, dist.ReshardOp) or grad.owner.name == "optim.mul_scalar":
        grad = grad.owner.operands[0]
    scan = grad.owner
    if not isinstance(scan, graph.ScanOp) or not isinstance(grad, OpResult):
        return
    if grad.index in dict((k, j) for j, k in scan.carries()):
        return
    callee = callee_of(scan)
    ret = callee.body.block.last_op
    assert isinstance(ret, func.ReturnOp)
    value = ret.operands[grad.index]
    to = dist.ReshardOp(value, with_layout(value.type, shard.shift_dims(-1)))
    Rewriter.insert_op(to, _before(ret))
    ret.operands = [to.result if i == grad.index else v for i, v in enumerate(ret.operands)]
    callee.update_function_type()


@dataclass(frozen=True)
class ShardParameters(ModulePass):
    """Split each parameter over the dp mesh axis and gather it where it is read (ZeRO stage 3)."""

    name = "shard-parameters"
    #: the id of the module's strategy to read (None: its only one)
    strategy_id: int | None = None

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        shard_parameters(op, annotation_strategy(module_strategy(op, self.strategy_id, self.name)))


__all__ = ["ShardParameters", "shard_parameters", "sharded_parameter_layout"]
