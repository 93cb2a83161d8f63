"""`autodiff`: reverse-mode differentiation of the step function at the logical level.

Finds `graph.output "LOSS"` (option `loss`, default "loss"), walks the ops that lead to it in
reverse, and appends the backward ops before `func.return`. The gradient of each parameter
becomes `graph.output "grad:NAME"`, which an optimizer pass consumes. Values used several
times get their gradient contributions summed with `graph.add`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass

from hspmd.dialects import graph
from hspmd.transforms.util import PassError, step_function, terminator

GRAD_PREFIX = "grad:"


def grad_name(param: str) -> str:
    """Return the output name under which autodiff stores the gradient of `param`."""
    return GRAD_PREFIX + param


class _Emitter:
    """Inserts ops before the step function's return and hands back their results."""

    def __init__(self, before: Operation) -> None:
        self.before = before

    def __call__(self, op: Operation) -> SSAValue:
        self.before.parent_block().insert_op_before(op, self.before)  # type: ignore[union-attr]
        return op.results[0]


def _like(value: SSAValue, shape) -> TensorType:
    return TensorType(value.type.element_type, shape)  # type: ignore[attr-defined]


def _shape(value: SSAValue) -> tuple[int, ...]:
    return value.type.get_shape()  # type: ignore[attr-defined]


def _transpose(emit: _Emitter, x: SSAValue) -> SSAValue:
    a, b = _shape(x)
    return emit(graph.TransposeOp(x, [1, 0], _like(x, (b, a))))


def _unbroadcast(emit: _Emitter, g: SSAValue, op: graph.BroadcastOp) -> SSAValue:
    """Sum `g` back to the broadcast's input shape."""
    src = _shape(op.input)
    dims = op.dims.get_values()
    kept = {d for i, d in enumerate(dims) if src[i] != 1 or _shape(op.result)[d] == 1}
    summed = [d for d in range(len(_shape(g))) if d not in kept]
    if summed:
        shape = [s for d, s in enumerate(_shape(g)) if d not in summed]
        g = emit(graph.ReduceSumOp(g, summed, _like(g, shape)))
    if _shape(g) != src:
        g = emit(graph.ReshapeOp(g, _like(g, src)))
    return g


Thunk = Callable[[], SSAValue]


def _vjp(op: Operation, g: SSAValue, emit: _Emitter) -> list[Thunk | None]:
    """Return, per operand of `op`, a maker of its gradient given the gradient `g` of the result.

    Makers are called only for operands that need a gradient, so no dead backward ops appear.
    """
    match op:
        case graph.AddOp():
            return [lambda: g, lambda: g]
        case graph.SubOp():
            return [lambda: g, lambda: emit(graph.ScaleOp(g, -1.0))]
        case graph.MulOp():
            return [lambda: emit(graph.MulOp(g, op.rhs)), lambda: emit(graph.MulOp(g, op.lhs))]
        case graph.ScaleOp():
            return [lambda: emit(graph.ScaleOp(g, op.factor.value.data))]
        case graph.ReluOp():
            return [lambda: emit(graph.ReluGradOp(op.input, g))]
        case graph.MatmulOp():
            return [
                lambda: emit(graph.MatmulOp(g, _transpose(emit, op.rhs), op.lhs.type)),
                lambda: emit(graph.MatmulOp(_transpose(emit, op.lhs), g, op.rhs.type)),
            ]
        case graph.TransposeOp():
            perm = op.perm.get_values()
            inverse = [perm.index(i) for i in range(len(perm))]
            return [lambda: emit(graph.TransposeOp(g, inverse, op.input.type))]
        case graph.ReshapeOp():
            return [lambda: emit(graph.ReshapeOp(g, op.input.type))]
        case graph.BroadcastOp():
            return [lambda: _unbroadcast(emit, g, op)]
        case graph.ReduceSumOp():
            dims = set(op.dims.get_values())
            kept = [d for d in range(len(_shape(op.input))) if d not in dims]
            return [lambda: emit(graph.BroadcastOp(g, kept, op.input.type))]
        case graph.SoftmaxCrossEntropyOp():
            return [lambda: emit(graph.SoftmaxCrossEntropyGradOp(op.logits, op.labels, g)), None]
    raise PassError(f"autodiff: no gradient rule for '{op.name}'")


_LEAVES: tuple[type[Operation], ...] = (graph.ParameterOp, graph.InputOp, graph.ConstantOp)


@dataclass(frozen=True)
class Autodiff(ModulePass):
    """Append the backward pass of `loss` and output the gradient of every parameter."""

    name = "autodiff"
    loss: str = "loss"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        fn = step_function(op)
        block = fn.body.block
        outputs = [o for o in block.ops if isinstance(o, graph.OutputOp) and o.tensor_name.data == self.loss]
        if not outputs:
            raise PassError(f"autodiff: no graph.output named '{self.loss}'")
        loss = outputs[0].value
        if _shape(loss) != ():
            raise PassError(f"autodiff: the loss '{self.loss}' must be a scalar, its shape is {list(_shape(loss))}")
        if any(isinstance(o, graph.OutputOp) and o.tensor_name.data.startswith(GRAD_PREFIX) for o in block.ops):
            raise PassError("autodiff: the step already has gradient outputs")

        forward = [o for o in block.ops if o is not terminator(fn)]
        # values that depend on a parameter: only these need gradients
        needs: set[SSAValue] = set()
        for fop in forward:
            if isinstance(fop, graph.ParameterOp) or any(v in needs for v in fop.operands):
                needs.update(fop.results)
        emit = _Emitter(terminator(fn))
        grads: dict[SSAValue, SSAValue] = {loss: emit(graph.ConstantOp(1.0, loss.type))}

        def accumulate(value: SSAValue, g: SSAValue) -> None:
            grads[value] = emit(graph.AddOp(grads[value], g)) if value in grads else g

        for fop in reversed(forward):
            if isinstance(fop, (graph.OutputOp, graph.AssignOp, *_LEAVES)) or not fop.results:
                continue
            g = grads.get(fop.results[0])
            if g is None:
                continue
            for operand, make in zip(fop.operands, _vjp(fop, g, emit)):
                if make is not None and operand in needs:
                    accumulate(operand, make())

        for fop in forward:
            if isinstance(fop, graph.ParameterOp):
                name = fop.tensor_name.data
                g = grads.get(fop.result)
                if g is None:
                    g = emit(graph.ConstantOp(0.0, fop.result.type))
                block.insert_op_before(graph.OutputOp(grad_name(name), g), terminator(fn))
