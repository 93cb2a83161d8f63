"""Gradients through calls: a callee split into a forward that saves residuals and a backward.

For a function `@F(args) -> ys` that the step calls (a repeated layer), `autodiff` makes

    @F_fwd(args) -> (ys, residuals)          the body of F, also returning what the backward needs
    @F_bwd(dys, residuals) -> d(float args)  the backward of F's body

once per callee, replaces each forward `func.call @F` by `func.call @F_fwd`, and adds a
`func.call @F_bwd` to the backward pass. Residuals are the values of F's body (its
arguments included) that the backward reads, so nothing is computed twice. Calls inside F
are split the same way. A callee marked for recompute (`transforms/recompute.py`) keeps fewer
residuals: the ops that made the others run again at the top of `@F_bwd`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, StringAttr, TensorType, _FloatType
from xdsl.ir import BlockArgument, Operation, SSAValue

from hspmd.dialects import graph
from hspmd.transforms.recompute import RECOMPUTE_ATTR, recompute_mode, recomputed_ops
from hspmd.transforms.util import PassError, callee_of


def is_float(value: SSAValue) -> bool:
    """Return whether `value` is a floating-point tensor (the values that get gradients)."""
    t = value.type
    return isinstance(t, TensorType) and isinstance(t.element_type, _FloatType)


@dataclass
class SplitFunction:
    """The forward/backward pair of one callee."""

    forward: func.FuncOp
    backward: func.FuncOp
    num_results: int
    num_residuals: int
    float_args: list[int]


@dataclass
class CallDifferentiator:
    """Splits callees once each and rewrites calls; `sweep` is autodiff's reverse sweep."""

    module: ModuleOp
    sweep: Callable
    splits: dict[str, SplitFunction] = field(default_factory=dict)

    def split(self, callee: func.FuncOp) -> SplitFunction:
        """Return the forward/backward pair of `callee`, making it on first use."""
        name = callee.sym_name.data
        if name not in self.splits:
            self.splits[name] = self._split(callee)
        return self.splits[name]

    def _split(self, callee: func.FuncOp) -> SplitFunction:
        name = callee.sym_name.data
        combined = callee.clone()
        block = combined.body.block
        ret = block.last_op
        assert isinstance(ret, func.ReturnOp)
        ys = list(ret.operands)
        params = list(block.args)
        forward_ops = [o for o in block.ops if o is not ret]
        dys = [block.insert_arg(y.type, len(block.args)) for y in ys]
        needs: set[SSAValue] = {a for a in params if is_float(a)}
        for o in forward_ops:
            if any(v in needs for v in o.operands) and not graph.stops_gradient(o):
                needs.update(r for r in o.results if is_float(r))
        seeds: dict[SSAValue, SSAValue] = {}
        fence = graph.ConstantOp(0.0, TensorType(ys[0].type.element_type, ()))  # the forward ends here
        marker = graph.ConstantOp(0.0, TensorType(ys[0].type.element_type, ()))  # insertion point
        block.insert_op_before(fence, ret)
        block.insert_op_before(marker, ret)
        for y, dy in zip(ys, dys):
            if y in seeds:
                add = graph.AddOp(seeds[y], dy)
                block.insert_op_before(add, marker)
                seeds[y] = add.result
            else:
                seeds[y] = dy
        grads = self.sweep(forward_ops, seeds, needs, marker, self)
        float_args = [i for i, a in enumerate(params) if is_float(a)]
        arg_grads = []
        for i in float_args:
            g = grads.get(params[i])
            if g is None:
                zero = graph.ConstantOp(0.0, params[i].type)
                block.insert_op_before(zero, marker)
                g = zero.result
            arg_grads.append(g)
        forward_ops = []  # the sweep made a call's forward a call of its callee's forward
        for o in block.ops:
            if o is fence:
                break
            forward_ops.append(o)
            if isinstance(o, func.CallOp):
                self._pass_through(o)
        forward_set = set(forward_ops)
        backward_ops = [o for o in block.ops if o not in forward_set and o not in (ret, marker, fence)]
        residuals = self._residuals(backward_ops, dys, arg_grads)
        mode = recompute_mode(callee)
        again = recomputed_ops(forward_ops, residuals, mode)
        if again:  # computed again in the backward: their operands are the residuals instead
            backward_ops = again + backward_ops
            residuals = self._residuals(backward_ops, dys, arg_grads)
        for o in (marker, fence):
            o.detach()
            o.erase()

        fwd = self._forward(callee, params, forward_ops, [*ret.operands, *residuals], f"{name}_fwd")
        bwd = self._backward(combined, backward_ops, residuals, dys, arg_grads, ret, f"{name}_bwd")
        if mode != "none":
            bwd.attributes[RECOMPUTE_ATTR] = StringAttr(mode)
        for f in (fwd, bwd):
            self.module.body.block.insert_op_after(f, callee)
        return SplitFunction(fwd, bwd, len(ys), len(residuals), float_args)

    def _pass_through(self, call: func.CallOp) -> None:
        """Let the backward read an argument of `call` (a call of a split forward in a function)
        where the callee returns it as is (a weight kept for the backward), not the call's result:
        so a scan over the function keeps no stacked copy of a weight it already has."""
        split = self.forward_of(call)
        if split is None:
            return
        ret = split.forward.body.block.last_op
        assert isinstance(ret, func.ReturnOp)
        for r, v in enumerate(ret.operands):
            if isinstance(v, BlockArgument) and v.block is split.forward.body.block:
                call.results[r].replace_all_uses_with(call.operands[v.index])

    @staticmethod
    def _residuals(backward_ops: list, dys: list[SSAValue], arg_grads: list[SSAValue]) -> list[SSAValue]:
        """Return the values `backward_ops` read that they do not make (nor are incoming gradients)."""
        produced = {r for o in backward_ops for r in o.results} | set(dys)
        residuals: list[SSAValue] = []
        for o in backward_ops:
            for v in o.operands:
                if v not in produced and v not in residuals:
                    residuals.append(v)
        for g in arg_grads:
            if g not in produced and g not in residuals:
                residuals.append(g)  # a gradient that is a forward value (identity paths)
        return residuals

    @staticmethod
    def _forward(callee: func.FuncOp, params: list[SSAValue], forward_ops: list[Operation],
                 outputs: list[SSAValue], name: str) -> func.FuncOp:
        """Return a function as `callee` (its attributes) computing `forward_ops` (of a copy of it
        with arguments `params`: the calls in it now of their callees' forwards) and returning
        `outputs` (its results, then the residuals)."""
        fwd = callee.clone()
        block = fwd.body.block
        for o in reversed(list(block.ops)):
            o.detach()
            o.erase()
        mapper: dict[SSAValue, SSAValue] = dict(zip(params, block.args))
        for o in forward_ops:
            block.add_op(o.clone(value_mapper=mapper))
        block.add_op(func.ReturnOp(*[mapper.get(v, v) for v in outputs]))
        fwd.sym_name = StringAttr(name)
        fwd.update_function_type()
        fwd.sym_visibility = StringAttr("private")
        return fwd

    @staticmethod
    def _backward(combined: func.FuncOp, backward_ops, residuals, dys, arg_grads, ret, name: str) -> func.FuncOp:
        """Turn `combined` (forward + backward) into `@name(dys, residuals) -> arg grads`."""
        block = combined.body.block
        new_args = [block.insert_arg(r.type, len(block.args)) for r in residuals]
        for r, a in zip(residuals, new_args):
            r.replace_uses_with_if(a, lambda use: use.operation in backward_ops or use.operation is ret)
        new_ret = func.ReturnOp(*[new_args[residuals.index(g)] if g in residuals else g for g in arg_grads])
        block.insert_op_before(new_ret, ret)
        ret.detach()
        ret.erase()
        keep = set(backward_ops) | {new_ret}
        for o in reversed(list(block.ops)):
            if o not in keep:
                if any(r.uses for r in o.results):
                    raise PassError(f"autodiff: @{name}: a forward value escaped into the backward")
                o.detach()
                o.erase()
        wanted = [*new_args, *dys]
        for a in list(block.args):
            if a not in wanted:
                block.erase_arg(a)
        # the arguments are the incoming gradients, then the residuals
        order = [block.args.index(a) for a in (*dys, *new_args)]
        if order != list(range(len(order))):
            raise PassError(f"autodiff: @{name}: unexpected argument order")
        combined.sym_name = StringAttr(name)
        combined.update_function_type()
        combined.sym_visibility = StringAttr("private")
        return combined

    def forward_call(self, call: func.CallOp) -> func.CallOp:
        """Replace forward `call` by a call of the callee's forward; return the new call."""
        split = self.split(callee_of(call, self.module))
        types = split.forward.function_type.outputs.data
        new = func.CallOp(split.forward.sym_name.data, list(call.operands), types)
        call.parent_block().insert_op_before(new, call)  # type: ignore[union-attr]
        for old, r in zip(call.results, new.results):
            old.replace_all_uses_with(r)
        call.detach()
        call.erase()
        return new

    def backward_call(self, fwd_call: func.CallOp, dys: list[SSAValue], emit) -> dict[int, SSAValue]:
        """Emit the backward call for `fwd_call` and return {operand index: its gradient}."""
        split = self.forward_of(fwd_call)
        assert split is not None
        residuals = list(fwd_call.results[split.num_results :])
        types = split.backward.function_type.outputs.data
        call = func.CallOp(split.backward.sym_name.data, [*dys, *residuals], types)
        emit.before.parent_block().insert_op_before(call, emit.before)
        return dict(zip(split.float_args, call.results))

    def drop_unused(self) -> None:
        """Erase the callees that were split and are no longer called (a function that only an
        erased one called, too)."""
        erased = True
        while erased:
            called = {o.callee.root_reference.data for o in self.module.walk() if isinstance(o, (func.CallOp, graph.ScanOp))}
            erased = False
            for f in list(self.module.body.block.ops):
                if isinstance(f, func.FuncOp) and f.sym_name.data in self.splits and f.sym_name.data not in called:
                    f.detach()
                    f.erase()
                    erased = True

    def forward_of(self, call: func.CallOp) -> SplitFunction | None:
        """Return the split whose forward `call` calls (None: it calls no split forward)."""
        name = call.callee.root_reference.data
        return next((s for s in self.splits.values() if s.forward.sym_name.data == name), None)

    def is_forward(self, call: func.CallOp) -> bool:
        """Return whether `call` already calls a split forward."""
        return self.forward_of(call) is not None

