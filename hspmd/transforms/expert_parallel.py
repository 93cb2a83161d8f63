"""Which parameters are expert weights, and how expert parallelism (`ep=`) lays them out.

An expert weight is a parameter that reaches the right operand of a `graph.expert_matmul`
(through casts, transposes that keep the expert dim first — a PyTorch weight stored
[E, out, in] — and the arguments of the function blocks that a layer is traced into). Under a group with `ep > 1` it is split along its expert dim 0 over the ep ranks,
replicated over dp, and split over tp as Megatron splits an MLP (expert tensor parallelism):
the first expert matmul's weight `[E, D, F]` along its output dim 2 (column-parallel), the
second's `[E, F, D]`, whose left operand comes from the first, along its input dim 1
(row-parallel, its product partial over tp). The group's devices form a mesh dp major, ep,
tp minor, so the layout `dup=dp, split(0)=ep, split(d)=tp` has one replicated axis (experts
replicated over both dp and tp would need two dup axes that are not neighbours, which one
device order cannot express). Everything
else (the tokens' all-to-alls into and out of the experts) follows from the sharding rules of
the mixture-of-experts ops (`dialects/graph/moe.py`) and the reshard lowering.
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
    return _traced_back(v)[0]


def _traced_back(v: SSAValue) -> tuple[SSAValue, list[int]]:
    """Return the value `v` comes from through casts and transposes that keep the expert dim 0
    first (an imported weight stored [E, out, in]), and the permutation from that value's dims
    to v's (v's dim i is its dim perm[i])."""
    perm = list(range(len(v.type.get_shape())))
    while True:
        op = v.owner
        if isinstance(op, graph.CastOp):
            v = op.input
        elif isinstance(op, graph.TransposeOp) and op.perm.get_values()[0] == 0:
            inner = list(op.perm.get_values())
            perm = [inner[p] for p in perm]
            v = op.input
        else:
            return v, perm


def _follows_an_expert_matmul(v: SSAValue) -> bool:
    """Return whether `v` is an expert matmul's product, through ops of one operand of its shape
    (the activation, casts); the arguments of function blocks are not followed."""
    while not isinstance(v, BlockArgument):
        op = v.owner
        if isinstance(op, graph.ExpertMatmulOp):
            return True
        if len(op.operands) != 1 or op.operands[0].type.get_shape() != v.type.get_shape():
            return False
        v = op.operands[0]
    return False


def expert_parameters(module: ModuleOp) -> set[str]:
    """Return the names of the step's parameters that are expert weights (see the module docstring)."""
    return set(expert_tp_dims(module))


def expert_tp_dims(module: ModuleOp) -> dict[str, int]:
    """Return {expert weight: the dim tp splits}: 1 for a weight whose matmul's left operand is
    another expert matmul's product (row-parallel), else 2 (column-parallel)."""
    step = step_function(module)
    names: dict[str, int] = {}

    def visit(fn: func.FuncOp, args: dict[int, str], seen: frozenset[str]) -> None:
        for op in fn.body.block.ops:
            if isinstance(op, graph.ExpertMatmulOp):
                rhs, perm = _traced_back(op.rhs)
                dim = perm[1 if _follows_an_expert_matmul(op.lhs) else 2]
                if isinstance(rhs, BlockArgument) and rhs.index in args:
                    names.setdefault(args[rhs.index], dim)
                elif isinstance(rhs.owner, graph.ParameterOp):
                    names.setdefault(rhs.owner.tensor_name.data, dim)
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


def expert_layout(group: StrategyGroup, tp_dim: int = 2) -> Layout:
    """Return an expert weight's layout in `group`: `split(0)` over ep, replicated over dp, and
    `split(tp_dim)` over tp (see `expert_tp_dims`)."""
    axes = [(a, d) for a, d in ((DUP, group.dp), (split(0), group.ep), (split(tp_dim), group.tp)) if d > 1]
    return Layout.spmd(group.devices, DistributedStates.of(*axes))


def uneven_experts_layout(strategy: Strategy, name: str, shape, tp_dim: int = 2) -> Layout:
    """Return an expert weight's layout where the groups hold different numbers of experts
    (`[0,1]: ep=2 experts=6 | [2]: ep=1 experts=2`): split along the expert dim across the
    groups by those numbers (`hetero=split(0)`), and inside each group as `expert_layout`."""
    shares = strategy.expert_shares
    assert shares is not None
    if shape[0] != sum(shares):
        raise PassError(f"apply-strategy: strategy '{strategy}' places {'+'.join(map(str, shares))} = {sum(shares)} "
                        f"experts but expert weight '{name}' has {shape[0]} (its dim 0); the groups' experts= "
                        "must add up to the model's experts")
    groups = tuple(Group(g.devices, expert_layout(g, tp_dim).groups[0].states) for g in strategy.groups)
    return Layout(groups, split(0), shares)
