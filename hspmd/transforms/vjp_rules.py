"""Gradient rules of the `graph` ops, used by the `autodiff` pass.

`vjp(op, gs, emit)` returns, per operand, a maker of that operand's gradient given the
gradients `gs` of the op's results (one per result, None where a result has no gradient);
`emit` inserts the backward ops. Makers are called only for operands that need a gradient,
so no dead backward ops appear. A rule that needs the gradient of a result that has none
materialises zeros (`graph.constant 0`) with `_grad`. Backward ops are mostly dedicated
`*_grad` ops (one op per forward op, possibly with several results, such as
`layer_norm_grad` -> dx, dweight, dbias), which NumPy runs fast and a fuser can take whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from xdsl.dialects.builtin import TensorType
from xdsl.ir import Operation, SSAValue

from hspmd.dialects import dist, graph
from hspmd.transforms.util import PassError


class Emitter:
    """Inserts ops before the step function's return and hands back their results."""

    def __init__(self, before: Operation) -> None:
        self.before = before

    def __call__(self, op: Operation) -> SSAValue:
        self.before.parent_block().insert_op_before(op, self.before)  # type: ignore[union-attr]
        return op.results[0] if op.results else None  # type: ignore[return-value]


def _like(value: SSAValue, shape) -> TensorType:
    return TensorType(value.type.element_type, shape)  # type: ignore[attr-defined]


def _shape(value: SSAValue) -> tuple[int, ...]:
    return value.type.get_shape()  # type: ignore[attr-defined]


def _transpose(emit: Emitter, x: SSAValue) -> SSAValue:
    """Swap the last two dims of `x`."""
    shape = _shape(x)
    n = len(shape)
    perm = [*range(n - 2), n - 1, n - 2]
    return emit(graph.TransposeOp(x, perm, _like(x, [shape[p] for p in perm])))


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


def _grad(emit: Emitter, gs: Sequence[SSAValue | None], op: Operation, i: int) -> SSAValue:
    """Return the gradient of result `i`, or zeros of its type where it has none."""
    g = gs[i]
    return g if g is not None else emit(graph.ConstantOp(0.0, op.results[i].type))  # type: ignore[arg-type]


def _shared(emit: Emitter, make: Callable[[], Operation]) -> Callable[[], Operation]:
    """Return a maker that emits the op `make` builds once, and then hands back the same op."""
    made: list[Operation] = []

    def get() -> Operation:
        if not made:
            made.append(make())
            emit(made[0])
        return made[0]

    return get


def _zeros_around(emit: Emitter, g: SSAValue, full: Sequence[int], dim: int, start: int) -> SSAValue:
    """Return `g` placed at `start` along `dim` in zeros of shape `full` (a concat with zeros)."""
    parts = []
    before, after = start, full[dim] - start - _shape(g)[dim]
    for size, piece in ((before, None), (None, g), (after, None)):
        if piece is not None:
            parts.append(piece)
        elif size:
            shape = list(full)
            shape[dim] = size
            parts.append(emit(graph.ConstantOp(0.0, _like(g, shape))))
    if len(parts) == 1:
        return g
    return emit(graph.ConcatOp(parts, dim, _like(g, full)))


Thunk = Callable[[], SSAValue]


def vjp(op: Operation, gs: Sequence[SSAValue | None], emit: Emitter) -> list[Thunk | None]:
    """Return, per operand of `op`, a maker of its gradient given the result gradients `gs`.

    `gs[i]` is the gradient of result i, None where it has none (not all None). Makers are
    called only for operands that need a gradient, so no dead backward ops appear.
    """
    own = getattr(op, "vjp", None)
    if callable(own):
        return own(gs, emit)
    g = gs[0] if len(gs) == 1 else None
    match op:
        case dist.AnnotateOp():  # the gradient of an annotated value is laid out alike
            return [lambda: emit(dist.AnnotateOp(g, op.axes(), op.layout.data if op.layout is not None else None))]
        case graph.AddOp():
            return [lambda: g, lambda: g]
        case graph.SubOp():
            return [lambda: g, lambda: emit(graph.ScaleOp(g, -1.0))]
        case graph.MulOp():
            return [lambda: emit(graph.MulOp(g, op.rhs)), lambda: emit(graph.MulOp(g, op.lhs))]
        case graph.DivOp():
            return [
                lambda: emit(graph.DivOp(g, op.rhs)),
                lambda: emit(graph.ScaleOp(emit(graph.DivOp(emit(graph.MulOp(g, op.result)), op.rhs)), -1.0)),
            ]
        case graph.ScaleOp():
            return [lambda: emit(graph.ScaleOp(g, op.factor.value.data))]
        case graph.ReluOp():
            return [lambda: emit(graph.ReluGradOp(op.input, g))]
        case graph.ExpertMatmulOp():  # the same op on the gradients, so they stay where the experts are
            return [lambda: emit(graph.ExpertMatmulOp(g, _transpose(emit, op.rhs), op.lhs.type)),
                    lambda: emit(graph.ExpertMatmulRhsGradOp(op.lhs, g, op.rhs.type))]
        case graph.MoeRouteOp():  # piecewise constant: no gradient
            return [None]
        case graph.MoeDispatchOp():
            return [lambda: emit(graph.MoeCombineOp(g, op.mask, op.x.type)),
                    lambda: emit(graph.MoeWeightsGradOp(op.x, g, op.mask.type))]
        case graph.MoeCombineOp():
            return [lambda: emit(graph.MoeDispatchOp(g, op.weights, op.y.type)),
                    lambda: emit(graph.MoeWeightsGradOp(g, op.y, op.weights.type))]
        case graph.MatmulOp():
            a, b = _shape(op.lhs), _shape(op.rhs)
            if len(b) == 2 and len(a) > 2:  # a weight applied to batched activations
                rhs_grad = lambda: emit(graph.MatmulRhsGradOp(op.lhs, g, op.rhs.type))  # noqa: E731
            else:
                rhs_grad = lambda: emit(graph.MatmulOp(_transpose(emit, op.lhs), g, op.rhs.type))  # noqa: E731
            return [lambda: emit(graph.MatmulOp(g, _transpose(emit, op.rhs), op.lhs.type)), rhs_grad]
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
        case graph.ReduceMaxOp():
            return [lambda: emit(graph.ReduceMaxGradOp(op.input, op.result, g, op.dims.get_values()))]
        case graph.ExpOp():
            return [lambda: emit(graph.MulOp(g, op.result))]
        case graph.LogOp():
            return [lambda: emit(graph.DivOp(g, op.input))]
        case graph.SqrtOp():
            return [lambda: emit(graph.ScaleOp(emit(graph.DivOp(g, op.result)), 0.5))]
        case graph.RsqrtOp():  # d/dx x^-1/2 = -1/2 y^3
            return [lambda: emit(graph.ScaleOp(emit(graph.MulOp(g, emit(graph.PowOp(op.result, 3.0)))), -0.5))]
        case graph.TanhOp():
            return [lambda: emit(graph.TanhGradOp(op.result, g))]
        case graph.BinaryCrossEntropyOp():  # d/dz = sigmoid(z) - y, d/dy = -z
            return [lambda: emit(graph.BinaryCrossEntropyGradOp(op.lhs, op.rhs, g)),
                    lambda: emit(graph.ScaleOp(emit(graph.MulOp(g, op.lhs)), -1.0))]
        case graph.SigmoidOp():
            return [lambda: emit(graph.SigmoidGradOp(op.result, g))]
        case graph.SiluOp():
            return [lambda: emit(graph.SiluGradOp(op.input, g))]
        case graph.GeluOp():
            return [lambda: emit(graph.GeluGradOp(op.input, g, op.approximate.data))]
        case graph.PowOp():
            return [lambda: emit(graph.PowGradOp(op.input, g, op.exponent.value.data))]
        case graph.CastOp():
            return [lambda: emit(graph.CastOp(g, op.input.type))]
        case graph.SoftmaxOp():
            return [lambda: emit(graph.SoftmaxGradOp(op.result, g, op.dim.value.data))]
        case graph.LayerNormOp():
            ln = _shared(emit, lambda: graph.LayerNormGradOp(op.x, op.weight, g, op.eps.value.data))
            return [lambda: ln().results[0], lambda: ln().results[1], lambda: ln().results[2]]
        case graph.RmsNormOp():
            rms = _shared(emit, lambda: graph.RmsNormGradOp(op.x, op.weight, g, op.eps.value.data))
            return [lambda: rms().results[0], lambda: rms().results[1]]
        case graph.EmbeddingOp():
            return [lambda: emit(graph.EmbeddingGradOp(op.ids, g, op.table.type)), None]
        case graph.CausalMaskOp():
            return [lambda: emit(graph.CausalMaskOp(g, 0.0))]
        case graph.SliceOp():
            d, start = op.dim.value.data, op.start.value.data
            return [lambda: _zeros_around(emit, g, _shape(op.input), d, start)]
        case graph.SplitOp():
            d = op.dim.value.data
            return [lambda: emit(graph.ConcatOp([_grad(emit, gs, op, i) for i in range(len(gs))], d, op.input.type))]
        case graph.ConcatOp():
            d = op.dim.value.data
            if len(op.inputs) == 1:
                return [lambda: g]
            parts = _shared(emit, lambda: graph.SplitOp(g, d, [x.type for x in op.inputs]))
            return [(lambda i=i: parts().results[i]) for i in range(len(op.inputs))]
        case graph.SoftmaxCrossEntropyOp():
            ignore = op.ignore_index.value.data if op.ignore_index is not None else None
            return [lambda: emit(graph.SoftmaxCrossEntropyGradOp(op.logits, op.labels, g, ignore)), None]
        case graph.LabelMaskOp() | graph.OneHotOp():
            return [None]
        case graph.RopeOp():
            return [lambda: emit(graph.RopeGradOp(g, op.base.value.data))]
        case graph.RopeGradOp():
            return [lambda: emit(graph.RopeOp(g, op.base.value.data))]
        case graph.DropoutOp():  # the same mask and scale: the same op on the gradient
            rate, seed, salt = op.rate.value.data, op.seed.value.data, op.salt.value.data
            return [lambda: emit(graph.DropoutOp(g, op.step, rate, seed, salt)), None]
    raise PassError(f"autodiff: no gradient rule for '{op.name}'")
