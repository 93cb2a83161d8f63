"""`autodiff`: reverse-mode differentiation of the step function at the logical level.

Finds `graph.output "LOSS"` (option `loss`, default "loss"), walks the ops that lead to it in
reverse, and appends the backward ops before `func.return`. The gradient of each parameter
becomes `graph.output "grad:NAME"`, which an optimizer pass consumes. Values used several
times get their gradient contributions summed with `graph.add`. With `loss_scale` S the
backward starts from S instead of 1 and each parameter's gradient is divided by S (static
loss scaling for float16). With `dynamic_scale` too, S is only the initial value of the
0-d float32 state `opt.loss_scale` (`graph.parameter {init = "full:S"}`, never differentiated)
that this pass adds: the backward starts from its value and each gradient is multiplied by its
reciprocal (`optim.mul_scalar`); the `dynamic-loss-scale` pass that follows updates it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType, f32
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass

from hspmd.dialects import graph, optim
from hspmd.ir.loss_scaling import SCALE_STATE
from hspmd.transforms.util import PassError, step_function, terminator
from hspmd.transforms.call_vjp import CallDifferentiator, is_float
from hspmd.transforms.scan_vjp import ScanDifferentiator
from hspmd.transforms.vjp_rules import Emitter, vjp

GRAD_PREFIX = "grad:"
#: the type of dynamic loss scaling's state (a float32 scalar, as GradScaler's)
SCALE_TYPE = TensorType(f32, ())


def grad_name(param: str) -> str:
    """Return the output name under which autodiff stores the gradient of `param`."""
    return GRAD_PREFIX + param


_LEAVES: tuple[type[Operation], ...] = (graph.ParameterOp, graph.InputOp, graph.ConstantOp)


def reverse_sweep(
    forward: list[Operation],
    seeds: dict[SSAValue, SSAValue],
    needs: set[SSAValue],
    before: Operation,
    calls: CallDifferentiator | None = None,
    scans: ScanDifferentiator | None = None,
) -> dict[SSAValue, SSAValue]:
    """Return the gradient of every value in `needs` reached from `seeds`, emitted before `before`.

    `forward` are the ops to differentiate, in program order; `seeds` maps values to their
    incoming gradients. Calls are differentiated through their callee's forward/backward pair,
    scans (`graph.scan`, stacked layers) through a reverse scan of it (`scan_vjp`).
    """
    emit = Emitter(before)
    grads = dict(seeds)

    def accumulate(value: SSAValue, g: SSAValue) -> None:
        grads[value] = emit(graph.AddOp(grads[value], g)) if value in grads else g

    for fop in reversed(forward):
        if isinstance(fop, (graph.OutputOp, graph.AssignOp, *_LEAVES)) or not fop.results:
            continue
        gs = [grads.get(r) for r in fop.results]
        if all(g is None for g in gs):
            continue
        if isinstance(fop, graph.ScanOp):
            if scans is None:
                raise PassError("autodiff: a graph.scan inside a layer function cannot be differentiated")
            fwd = scans.forward_scan(fop)
            for j, g in scans.backward_scan(fwd, gs, emit).items():
                if fwd.args[j] in needs:
                    accumulate(fwd.args[j], g)
            continue
        if isinstance(fop, func.CallOp):
            if calls is None:
                raise PassError("autodiff: a call outside a module")
            dys = [g if g is not None else emit(graph.ConstantOp(0.0, r.type)) for g, r in zip(gs, fop.results)]
            fwd = calls.forward_call(fop)
            for i, g in calls.backward_call(fwd, dys, emit).items():
                if fwd.operands[i] in needs:
                    accumulate(fwd.operands[i], g)
            continue
        for operand, make in zip(fop.operands, vjp(fop, gs, emit)):
            if make is not None and operand in needs:
                accumulate(operand, make())
    return grads


@dataclass(frozen=True)
class Autodiff(ModulePass):
    """Append the backward pass of `loss` and output the gradient of every parameter."""

    name = "autodiff"
    loss: str = "loss"
    loss_scale: float = 1.0
    dynamic_scale: bool = False

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        fn = step_function(op)
        block = fn.body.block
        outputs = [o for o in block.ops if isinstance(o, graph.OutputOp) and o.tensor_name.data == self.loss]
        if not outputs:
            raise PassError(f"autodiff: no graph.output named '{self.loss}'")
        loss = outputs[0].value
        if graph.tensor_shape(loss) != ():
            raise PassError(f"autodiff: the loss '{self.loss}' must be a scalar, its shape is {list(graph.tensor_shape(loss))}")
        if any(isinstance(o, graph.OutputOp) and o.tensor_name.data.startswith(GRAD_PREFIX) for o in block.ops):
            raise PassError("autodiff: the step already has gradient outputs")

        forward = [o for o in block.ops if o is not terminator(fn)]
        # values that depend on a parameter: only these need gradients
        needs: set[SSAValue] = set()
        for fop in forward:
            if isinstance(fop, graph.ParameterOp) or (any(v in needs for v in fop.operands) and not graph.stops_gradient(fop)):
                needs.update(r for r in fop.results if is_float(r))
        calls = CallDifferentiator(op, reverse_sweep)
        scans = ScanDifferentiator(calls)
        params = [o for o in block.ops if isinstance(o, graph.ParameterOp)]
        emit = Emitter(terminator(fn))
        seed, unscale = self._seed(params, loss, emit)  # a scaled loss keeps float16 gradients in range
        grads = reverse_sweep(forward, {loss: seed}, needs, terminator(fn), calls, scans)
        for param in params:
            g = grads.get(param.result)
            if g is None:
                g = emit(graph.ConstantOp(0.0, param.result.type))
            elif unscale is not None:
                g = emit(optim.MulScalarOp(g, unscale))
            elif self.loss_scale != 1.0:
                g = emit(graph.ScaleOp(g, 1.0 / self.loss_scale))
            block.insert_op_before(graph.OutputOp(grad_name(param.tensor_name.data), g), terminator(fn))
        calls.drop_unused()
        scans.finish(op)

    def _seed(self, params: list[graph.ParameterOp], loss: SSAValue, emit: Emitter) -> tuple[SSAValue, SSAValue | None]:
        """Return the backward's seed and, under dynamic scaling, the reciprocal of the scale
        that multiplies the gradients (None: the static scale divides them, if not 1)."""
        if not self.dynamic_scale:
            return emit(graph.ConstantOp(self.loss_scale, loss.type)), None
        if not (self.loss_scale > 0 and math.isfinite(self.loss_scale)):
            raise PassError(f"autodiff: option loss_scale={self.loss_scale} must be a finite number > 0")
        if any(p.tensor_name.data == SCALE_STATE for p in params):
            raise PassError(f"autodiff: the step already has a parameter named '{SCALE_STATE}'")
        scale = emit(graph.ParameterOp(SCALE_STATE, f"full:{self.loss_scale!r}", SCALE_TYPE))
        seed = scale if scale.type == loss.type else emit(graph.CastOp(scale, loss.type))
        return seed, emit(graph.DivOp(emit(graph.ConstantOp(1.0, SCALE_TYPE)), scale))
