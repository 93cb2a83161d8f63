"""`shard-optimizer-state`: ZeRO-style sharding of the optimizer states over data parallelism.

`shard-optimizer-state` runs after `apply-strategy` (whose strategy it reads from the module:
`[0-3]: dp=4 zero=2` below) and before `propagate-layouts`. Every per-parameter optimizer state `graph.parameter "opt.KIND.NAME"`
shaped like parameter NAME (`opt.m.*`, `opt.v.*`, `opt.momentum.*`) gets, in its type, a
layout split over the group's dp mesh axis along its first dim that dp divides; the
parameters themselves keep apply-strategy's layouts. The mesh is dp major, tp minor, so with
`dp=2 tp=2` a state is `split(d)=2` (dp) followed by its parameter's tp axis: a replicated
parameter's state becomes `split(d)=2, dup=2`, a column-parallel weight's (`dup=2, split(1)=2`)
becomes `split(0)=2, split(1)=2`. The dim split over tp is never chosen for dp (the layout
algebra names each axis once). A state with no such dim (a scalar, or dims dp does not
divide) keeps its parameter's layout, i.e. stays replicated over dp.

Nothing else changes: `optim.sgd`/`optim.adam` are elementwise, so propagation runs the
update on the state's shards. The partial gradient then needs `partial -> split`
(reduce-scatter), the replicated parameter `dup -> split` (a local slice), and the
`graph.assign` of the updated shard needs the parameter's layout (all-gather): ZeRO stage 2's
communication. In a strategy of several device groups, each group with `zero` splits its part of a state
over its own dp (a union layout, hetero=dup); the other groups keep theirs. Under uneven tp (one
group laid out over its tp sub-groups, `uneven_tensor_parallel`) each sub-group's part is split
over the dp ranks it holds, along a dim of that part dp divides.

Under expert parallelism (`ep`) the batch is split over dp*ep ranks, so a state is split over
all of them (`split(d)=dp*ep`, the group's `batch_ranks`) where its parameter is replicated
over them; an expert weight is already split over ep (`dup=dp, split(0)=ep, split(t)=tp`,
`transforms/expert_parallel.py`), so its states split its dup axis, dp, along another dim:
`split(d)=dp, split(0)=ep, split(t)=tp`.

`zero=1` and `zero=2` compile to the same program: the gradient is only ever
consumed by the sharded update, so all-reducing it whole (stage 1) would do strictly more work
than the reduce-scatter that propagation picks, and the IR has no separate gradient buffer
whose memory stage 2 would save. `zero=0` (or dp=1) leaves the module as it is.

With gradient clipping the gradient also feeds the global norm (`optim.sum_squares`), which
propagation alone would satisfy by all-reducing it whole; the pass therefore reshards each
clipped gradient to its state's layout where norm and clip read it, so it is
reduce-scattered, each rank squares its own shard (a partial scalar), and only the norm's
scalar is all-reduced.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass
from xdsl.rewriter import InsertPoint, Rewriter

from hspmd.dialects import dist, graph, optim
from hspmd.dialects.dist import layout_of, with_layout
from hspmd.ir.strategy import Strategy, StrategyGroup
from hspmd.ir.layout import DUP, DistributedStates, Layout, split
from hspmd.transforms.expert_parallel import expert_layout
from hspmd.transforms.optimizer import STATE_PREFIX
from hspmd.transforms.pipeline.virtual import annotation_strategy
from hspmd.ir.stacked_names import is_stacked
from hspmd.transforms.util import PassError, module_strategy, step_function


def _owner(name: str) -> str | None:
    """Return NAME of a per-parameter state `opt.KIND.NAME`, else None."""
    if not name.startswith(STATE_PREFIX):
        return None
    parts = name.split(".", 2)
    return parts[2] if len(parts) == 3 and parts[2] else None


def sharded_state_layout(layout: Layout, shape: tuple[int, ...], dp: int, tp: int, first: int = 0) -> Layout | None:
    """Return `layout` (a parameter's, on a dp-major/tp-minor mesh) split over dp, or None if it cannot be.

    Dims before `first` are never split (a stacked parameter's layers, `first=1`: each layer's
    state is split as it would be unstacked, so checkpoints and switches see per-layer pieces).

    >>> from hspmd.ir.layout import Layout
    >>> str(sharded_state_layout(Layout.replicated((0, 1, 2, 3)), (6, 8), 4, 1))
    '[0-3]: split(1)=4'
    >>> str(sharded_state_layout(Layout.spmd((0, 1, 2, 3), DistributedStates.of((DUP, 2), (split(1), 2))), (8, 6), 2, 2))
    '[0-3]: split(0)=2, split(1)=2'
    >>> sharded_state_layout(Layout.replicated((0, 1)), (3,), 2, 1) is None
    True
    """
    if dp <= 1 or len(layout.groups) != 1:
        return None
    states = layout.groups[0].states
    if states.is_partial or states.degree(DUP) < dp:
        return None
    tp_dims = [d for d, k in states.split_dims.items() if k > 1]
    if len(tp_dims) > 1 or (tp_dims and states.degree(split(tp_dims[0])) != tp):
        return None
    tp_axis = split(tp_dims[0]) if tp_dims else DUP
    for d, size in enumerate(shape):
        if d < first or d in tp_dims or size % dp:
            continue
        new = Layout.spmd(layout.groups[0].devices, DistributedStates.of((split(d), dp), (tp_axis, tp)))
        new.check_shape(shape, "optimizer state")
        return new
    return None


def sharded_expert_state_layout(layout: Layout, shape: tuple[int, ...], dp: int, first: int = 0) -> Layout | None:
    """Return an expert weight's layout (`dup=dp` major, then its ep and tp splits) with the dup
    axis split along the first dim that no other axis splits and dp divides, or None.

    >>> ds = DistributedStates.of((DUP, 2), (split(0), 2), (split(2), 2))
    >>> str(sharded_expert_state_layout(Layout.spmd(tuple(range(8)), ds), (4, 6, 8), 2))
    '[0-7]: split(1)=2, split(0)=2, split(2)=2'
    """
    if dp <= 1 or len(layout.groups) != 1:
        return None
    axes = layout.groups[0].states.axes
    if not axes or axes[0] != (DUP, dp):
        return None
    taken = {a.dim for a, _ in axes if a.kind == "split"}
    for d, size in enumerate(shape):
        if d < first or d in taken or size % dp:
            continue
        new = Layout.spmd(layout.groups[0].devices, DistributedStates.of((split(d), dp), *axes[1:]))
        new.check_shape(shape, "optimizer state")
        return new
    return None


def _is_expert(states: DistributedStates, g: StrategyGroup) -> bool:
    return g.ep > 1 and any(states == expert_layout(g, d).groups[0].states for d in (1, 2))


def group_state_layout(layout: Layout, shape: tuple[int, ...], g: StrategyGroup, first: int = 0) -> Layout | None:
    """Return a one-group parameter layout's ZeRO state layout in group `g` (see the module docstring), or None."""
    if _is_expert(layout.groups[0].states, g):
        return sharded_expert_state_layout(layout, shape, g.dp, first)
    return sharded_state_layout(layout, shape, g.batch_ranks, g.tp, first)


def _sharded_union(layout: Layout, shape: tuple[int, ...], strategy: Strategy, first: int = 0) -> Layout | None:
    """Return a parameter's layout over several groups with each ZeRO group's part split over its dp
    (`sharded_state_layout` per group; the other groups keep theirs), or None when no part changes."""
    if len(layout.groups) != len(strategy.groups):
        return None
    groups, changed = [], False
    for part, g in zip(layout.groups, strategy.groups):
        new = group_state_layout(Layout.spmd(part.devices, part.states), shape, g, first) if g.zero else None
        groups.append(new.groups[0] if new is not None else part)
        changed |= new is not None
    return Layout(tuple(groups), layout.hetero, layout.shares) if changed else None


def _sharded_subgroups(layout: Layout, shape: tuple[int, ...], dp: int, first: int = 0) -> Layout | None:
    """Return a one-group strategy's parameter layout laid out over tp sub-groups (uneven tp,
    `uneven_tensor_parallel`) with each sub-group's part split over its dp, or None when none changes."""
    groups, changed = [], False
    for gi, part in enumerate(layout.groups):
        new = sharded_state_layout(Layout.spmd(part.devices, part.states), layout.group_shape(gi, shape), dp, 1, first)
        groups.append(new.groups[0] if new is not None else part)
        changed |= new is not None
    return Layout(tuple(groups), layout.hetero, layout.shares) if changed else None


def shard_states(module: ModuleOp, strategy: Strategy) -> dict[str, str]:
    """Shard the optimizer states of `module` as `strategy` says; return {state: its layout or why not}."""
    if not any(g.zero for g in strategy.groups):
        return {}
    if any(g.pp != 1 for g in strategy.groups):
        raise PassError(f"shard-optimizer-state: strategy '{strategy}': ZeRO with pipeline parallelism "
                        "is not supported here (pp=1); pipeline stages shard theirs with shard-stage-optimizer")
    union = len(strategy.groups) > 1
    group = strategy.groups[0]
    ops = [o for o in step_function(module).body.block.ops if isinstance(o, graph.ParameterOp)]
    shapes = {o.tensor_name.data: tuple(o.result.type.get_shape()) for o in ops}
    report: dict[str, str] = {}
    for op in ops:
        name = op.tensor_name.data
        owner = _owner(name)
        shape = shapes[name]
        if owner is None or shapes.get(owner) != shape:
            continue
        layout = layout_of(op.result)
        if layout is None:
            raise PassError(f"shard-optimizer-state: state '{name}' has no layout; run 'apply-strategy' first")
        first = 1 if is_stacked(name) else 0  # a stacked state: each layer's split as unstacked
        if union:
            new = _sharded_union(layout, shape, strategy, first)
        elif len(layout.groups) > 1:  # uneven tp: the group's tp sub-groups, each split over dp
            new = _sharded_subgroups(layout, shape, group.batch_ranks, first)
        else:
            new = group_state_layout(layout, shape, group, first)
        if new is None:
            report[name] = f"kept {layout}: no dim of {list(shape)} that dp divides and tp does not split"
            continue
        report[name] = str(new)
        Rewriter.replace_value_with_new_type(op.result, with_layout(op.result.type, new))
    _shard_clipped_gradients(module)
    return report


def _shard_clipped_gradients(module: ModuleOp) -> None:
    """Lay each clipped gradient out like its sharded optimizer state.

    With clipping the update reads `optim.mul_scalar(g, coef)` and the norm reads
    `optim.sum_squares(g)`. Left to propagation, g would be all-reduced whole for the norm
    and then sliced for the update; laid out like the state (split over dp), g is
    reduce-scattered instead, each rank squares its own shard (a partial scalar) and only the
    scalar sum is all-reduced: ZeRO's communication with clipping too.
    """
    for op in step_function(module).body.block.ops:
        if not isinstance(op, (optim.AdamOp, optim.SGDOp)):
            continue
        shape, param_layout = op.param.type.get_shape(), layout_of(op.param)
        sharded = [layout_of(v) for v in op.operands[2:]
                   if isinstance(v.owner, graph.ParameterOp) and v.type.get_shape() == shape
                   and layout_of(v) not in (None, param_layout)]
        clip = op.grad.owner
        if not sharded or not isinstance(clip, optim.MulScalarOp):
            continue
        g = clip.operands[0]
        if layout_of(g) is not None or isinstance(g.owner, dist.ReshardOp):
            continue
        # a reshard to the state's layout, read by the norm and the clip (g's producer may be a
        # call, whose result types follow its callee, so g itself keeps its type)
        to = dist.ReshardOp(g, with_layout(g.type, sharded[0]))
        Rewriter.insert_op(to, InsertPoint.after(g.owner))
        g.replace_uses_with_if(to.result, lambda use: use.operation is not to and isinstance(
            use.operation, (optim.MulScalarOp, optim.SumSquaresOp)))


@dataclass(frozen=True)
class ShardOptimizerState(ModulePass):
    """Split the optimizer states over the dp mesh axis (ZeRO stages 1 and 2)."""

    name = "shard-optimizer-state"
    #: the id of the module's strategy to read (None: its only one)
    strategy_id: int | None = None

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        strategy = annotation_strategy(module_strategy(op, self.strategy_id, self.name))
        if any(g.zero for g in strategy.groups):
            shard_states(op, strategy)
