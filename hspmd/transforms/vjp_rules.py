"""Gradient rules of the `graph` ops, used by the `autodiff` pass.

`vjp(op, g, emit)` returns, per operand, a maker of that operand's gradient given the
gradient `g` of the op's result; `emit` inserts the backward ops. Makers are called only for
operands that need a gradient, so no dead backward ops appear.
"""

from __future__ import annotations

from collections.abc import Callable

from xdsl.dialects.builtin import TensorType
from xdsl.ir import Operation, SSAValue

from hspmd.dialects import graph
from hspmd.transforms.util import PassError


class Emitter:
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


def _transpose(emit: Emitter, x: SSAValue) -> SSAValue:
    a, b = _shape(x)
    return emit(graph.TransposeOp(x, [1, 0], _like(x, (b, a))))


def _unbroadcast(emit: Emitter, g: SSAValue, op: graph.BroadcastOp) -> SSAValue:
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


def vjp(op: Operation, g: SSAValue, emit: Emitter) -> list[Thunk | None]:
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
