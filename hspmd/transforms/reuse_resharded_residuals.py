"""`reuse-resharded-residuals`: keep a residual in the layout its backward needs when the
forward already resharded it so.

After `insert-reshard`, a layer's forward `@F_fwd` may reshard a value `v` (a mixture of
experts' tokens into the experts' layout: an all-to-all) and also return `v` as a residual,
which `@F_bwd` reshards to the same layout again before using it. This pass makes `@F_fwd`
return the resharded value instead and removes the backward's reshard: one collective fewer
per such residual and call, the same numbers.

Only where it costs no memory: the resharded piece must be no larger than the residual's
(an all-to-all or a local split, not a gather: sequence parallelism keeps its residuals split
and gathers them again, on purpose). Only residuals that every call of `@F_fwd` (in any
function) passes to calls of `@F_bwd` alone, at one argument, whose every use in `@F_bwd` is
such a reshard.

    func.func private @F_fwd(...) -> (..., L1) { %r = dist.reshard %v : L1 -> L2 ... return ..., %v }
    func.func private @F_bwd(..., %a: L1) { %s = dist.reshard %a : L1 -> L2 ... uses of %s }
becomes
    func.func private @F_fwd(...) -> (..., L2) { %r = dist.reshard %v ... return ..., %r }
    func.func private @F_bwd(..., %a: L2) { ... uses of %a }
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, SymbolRefAttr, TensorType
from xdsl.ir import Attribute, OpResult
from xdsl.passes import ModulePass
from xdsl.rewriter import Rewriter

from hspmd.dialects.dist import ReshardOp, layout_of
from hspmd.transforms.util import step_function


def _largest_piece(typ: Attribute) -> int | None:
    """Return the elements of the largest local piece of a laid-out tensor type (None without a layout)."""
    lay = layout_of(typ) if isinstance(typ, TensorType) else None
    if lay is None:
        return None
    shape = typ.get_shape()  # type: ignore[attr-defined]
    return max(math.prod(lay.local_shape(d, shape)) for d in lay.devices)


@dataclass(frozen=True)
class ReuseReshardedResiduals(ModulePass):
    """Return residuals from `@F_fwd` in the layout `@F_bwd` reshards them to (see the module docstring)."""

    name = "reuse-resharded-residuals"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        funcs = {f.sym_name.data: f for f in op.body.block.ops if isinstance(f, func.FuncOp)}
        step_function(op)  # the module must have a step function
        # every call, those in functions too (a period of stacked layers calls its layers'): a
        # result another function returns is used otherwise, so its residual stays as it is
        calls = [c for c in op.walk() if isinstance(c, func.CallOp)]
        # (fwd, result k) -> the set of (bwd, argument j) its uses are; None if used otherwise
        links: dict[tuple[str, int], set[tuple[str, int]] | None] = defaultdict(set)
        for call in calls:
            for k, res in enumerate(call.results):
                key = (call.callee.string_value(), k)
                for use in res.uses:
                    user = use.operation
                    if isinstance(user, func.CallOp) and links[key] is not None:
                        links[key].add((user.callee.string_value(), use.index))  # type: ignore[union-attr]
                    else:
                        links[key] = None
        for (fwd_name, k), targets in links.items():
            if not targets or len(targets) != 1 or fwd_name not in funcs:
                continue
            ((bwd_name, j),) = targets
            fed = [c.operands[j] for c in calls if c.callee.string_value() == bwd_name]
            if bwd_name in funcs and bwd_name != fwd_name and all(
                    isinstance(x, OpResult) and x.index == k and isinstance(x.op, func.CallOp)
                    and x.op.callee.string_value() == fwd_name for x in fed):
                self._reuse(funcs[fwd_name], k, funcs[bwd_name], j, calls)

    @staticmethod
    def _reuse(fwd: func.FuncOp, k: int, bwd: func.FuncOp, j: int, calls: list[func.CallOp]) -> None:
        ret = fwd.body.block.last_op
        assert isinstance(ret, func.ReturnOp)
        v = ret.operands[k]
        arg = bwd.body.block.args[j]
        uses = [u.operation for u in arg.uses]
        if not uses or not all(isinstance(u, ReshardOp) for u in uses):
            return
        want = {u.result.type for u in uses}
        if len(want) != 1:
            return
        (typ,) = want
        made = next((u.operation for u in v.uses if isinstance(u.operation, ReshardOp)
                     and u.operation.result.type == typ), None)
        before, after = _largest_piece(v.type), _largest_piece(typ)
        if made is None or before is None or after is None or after > before:
            return
        ret.operands[k] = made.result
        fwd.update_function_type()
        new_arg = Rewriter.replace_value_with_new_type(arg, typ)
        for reshard in uses:
            reshard.result.replace_all_uses_with(new_arg)
            reshard.detach()
            reshard.erase()
        bwd.update_function_type()
        for call in calls:
            if call.callee == SymbolRefAttr(fwd.sym_name.data):
                res = call.results[k]
                assert isinstance(res, OpResult)
                Rewriter.replace_value_with_new_type(res, typ)
