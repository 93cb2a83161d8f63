"""Which parameters are expert weights, and how expert parallelism (`ep=`) lays them out.

An expert weight is a parameter that reaches the right operand of a `graph.expert_matmul`
(through casts, and through the arguments of the function blocks that a layer is traced
into). Under a group with `ep > 1` it is split along its expert dim 0 over the ep ranks and
replicated over dp and tp; the group's devices form a mesh dp major, ep, tp minor. Everything
else (the tokens' all-to-alls into and out of the experts) follows from the sharding rules of
the mixture-of-experts ops (`dialects/sharding.py`) and the reshard lowering.
"""

from __future__ import annotations

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import BlockArgument, SSAValue

from hspmd.dialects import graph
from hspmd.ir.layout import DUP, DistributedStates, Group, Layout, split
from hspmd.ir.strategy import Strategy, StrategyGroup
from hspmd.transforms.util import PassError, callee_of, step_function


def _source(v: SSAValue) -> SSAValue:
    while isinstance(v.owner, graph.CastOp):
        v = v.owner.input
    return v


def expert_parameters(module: ModuleOp) -> set[str]:
    """Return the names of the step's parameters that are expert weights (see the module docstring)."""
    step = step_function(module)
    names: set[str] = set()

    def visit(fn: func.FuncOp, args: dict[int, str], seen: frozenset[str]) -> None:
        for op in fn.body.block.ops:
            if isinstance(op, graph.ExpertMatmulOp):
                rhs = _source(op.rhs)
                if isinstance(rhs, BlockArgument) and rhs.index in args:
                    names.add(args[rhs.index])
                elif isinstance(rhs.owner, graph.ParameterOp):
                    names.add(rhs.owner.tensor_name.data)
            elif isinstance(op, func.CallOp):
                callee = callee_of(op)
                if callee.sym_name.data in seen:
                    continue
                inner = {}
                for i, v in enumerate(op.operands):
                    v = _source(v)
                    if isinstance(v.owner, graph.ParameterOp):
                        inner[i] = v.owner.tensor_name.data
                    elif isinstance(v, BlockArgument) and v.index in args:
                        inner[i] = args[v.index]
                visit(callee, inner, seen | {callee.sym_name.data})

    visit(step, {}, frozenset())
    return names


def expert_layout(group: StrategyGroup) -> Layout:
    """Return an expert weight's layout in `group`: `split(0)` over ep, replicated over dp and tp."""
    axes = [(a, d) for a, d in ((DUP, group.dp), (split(0), group.ep), (DUP, group.tp)) if d > 1]
    if group.dp > 1 and group.tp > 1 and group.ep > 1:
        raise PassError(f"apply-strategy: group '{group}': expert parallelism with both dp > 1 and tp > 1 "
                        "is not supported yet (the experts would be replicated on two mesh axes that are "
                        "not neighbours); use dp and ep, or ep and tp")
    return Layout.spmd(group.devices, DistributedStates.of(*axes))


def uneven_experts_layout(strategy: Strategy, name: str, shape) -> Layout:
    """Return an expert weight's layout where the groups hold different numbers of experts
    (`[0,1]: ep=2 experts=6 | [2]: ep=1 experts=2`): split along the expert dim across the
    groups by those numbers (`hetero=split(0)`), and inside each group as `expert_layout`."""
    shares = strategy.expert_shares
    assert shares is not None
    if shape[0] != sum(shares):
        raise PassError(f"apply-strategy: strategy '{strategy}' places {'+'.join(map(str, shares))} = {sum(shares)} "
                        f"experts but expert weight '{name}' has {shape[0]} (its dim 0); the groups' experts= "
                        "must add up to the model's experts")
    groups = tuple(Group(g.devices, expert_layout(g).groups[0].states) for g in strategy.groups)
    return Layout(groups, split(0), shares)
