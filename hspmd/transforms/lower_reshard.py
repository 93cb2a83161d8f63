"""`lower-reshard`: replace each physical `dist.reshard` by the `comm` ops that perform it.

Runs on physical IR (after `specialize-groups`). `plan_transition` of the layout algebra
gives the primitive steps (partial->dup is one `comm.all_reduce`, split->dup one
`comm.all_gather`, ...); each becomes one comm op over explicit rank groups, and the local
shape after each step follows from the step (gathers grow a dim by the group size, scatters
and local splits shrink it).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass

from hspmd.dialects import comm, dist
from hspmd.ir.reshard_plan import CommStep, plan_transition
from hspmd.transforms.util import PassError


def _step_op(step: CommStep, value: SSAValue) -> Operation:
    """Return the comm op performing `step` on local `value`."""
    typ = value.type
    assert isinstance(typ, TensorType)
    shape = list(typ.get_shape())
    n = len(step.groups[0])
    kind = step.kind
    if kind in ("all_gather",):
        shape[step.dim] *= n
    elif kind in ("reduce_scatter", "local_split"):
        shape[step.dim] //= n
    elif kind == "all_to_all":
        shape[step.dim] //= n
        shape[step.src_dim] *= n
    out = TensorType(typ.element_type, shape)
    match kind:
        case "all_reduce":
            return comm.AllReduceOp(value, step.groups, out)
        case "all_gather":
            return comm.AllGatherOp(value, step.groups, out, dim=step.dim)
        case "reduce_scatter":
            return comm.ReduceScatterOp(value, step.groups, out, dim=step.dim)
        case "local_split":
            return comm.LocalSplitOp(value, step.groups, out, dim=step.dim)
        case "local_zero":
            return comm.LocalZeroOp(value, step.groups, out)
        case "all_to_all":
            return comm.AllToAllOp(value, step.groups, out, split_dim=step.dim, concat_dim=step.src_dim)
    raise PassError(f"lower-reshard: no comm op for step '{step}'")


@dataclass(frozen=True)
class LowerReshard(ModulePass):
    """Lower every `dist.reshard` that has `src`/`dst` layouts into comm ops."""

    name = "lower-reshard"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for reshard in [o for o in op.walk() if isinstance(o, dist.ReshardOp)]:
            if reshard.src is None:
                raise PassError("lower-reshard: a dist.reshard has no src/dst layouts; run specialize-groups first")
            src, dst = reshard.layouts()
            try:
                steps = plan_transition(src, dst)
            except NotImplementedError as err:
                raise PassError(f"lower-reshard: {err}") from None
            value: SSAValue = reshard.input
            block = reshard.parent_block()
            assert block is not None
            for step in steps:
                step_op = _step_op(step, value)
                block.insert_op_before(step_op, reshard)
                value = step_op.results[0]
            if value.type != reshard.result.type:
                raise PassError(
                    f"lower-reshard: '{src}' -> '{dst}' gives local shape {value.type} "
                    f"but the reshard promises {reshard.result.type}"
                )
            reshard.result.replace_all_uses_with(value)
            reshard.detach()
            reshard.erase()
