"""Elementwise arithmetic: add, sub, mul, div, scale, cast and pow (with its gradient)."""

from __future__ import annotations


from xdsl.dialects.builtin import (
    Float64Type,
    FloatAttr,
)
from xdsl.ir import SSAValue
from xdsl.irdl import (
    irdl_op_definition,
    prop_def,
)

from hspmd.dialects.graph.base import check_same_shape, BinaryOp, UnaryOp, check_float, float_attr, ElementwiseOp, UnaryGradOp


@irdl_op_definition
class AddOp(BinaryOp):
    """Elementwise `lhs + rhs` (same shapes; broadcast first with `graph.broadcast`)."""

    name = "graph.add"


@irdl_op_definition
class SubOp(BinaryOp):
    """Elementwise `lhs - rhs`."""

    name = "graph.sub"


@irdl_op_definition
class MulOp(BinaryOp):
    """Elementwise `lhs * rhs`."""

    name = "graph.mul"


@irdl_op_definition
class DivOp(BinaryOp):
    """Elementwise `lhs / rhs` (same shapes)."""

    name = "graph.div"


@irdl_op_definition
class ScaleOp(UnaryOp):
    """Elementwise `x * factor` for a compile-time constant `factor`."""

    name = "graph.scale"
    factor = prop_def(FloatAttr)

    def __init__(self, input: SSAValue, factor: float):
        super().__init__(input, factor=FloatAttr(float(factor), Float64Type()))

    def verify_(self) -> None:
        check_same_shape(self, self.input, self.result)


@irdl_op_definition
class CastOp(UnaryOp):
    """Elementwise conversion to the result type's element type (same shape)."""

    name = "graph.cast"

    def verify_(self) -> None:
        check_same_shape(self, self.input, self.result)
        check_float(self, self.input, self.result)


@irdl_op_definition
class PowOp(ElementwiseOp):
    """Elementwise `x ** exponent` for a compile-time constant exponent."""

    name = "graph.pow"
    exponent = prop_def(FloatAttr)

    def __init__(self, input: SSAValue, exponent: float):
        super().__init__(input, exponent=float_attr(exponent))


@irdl_op_definition
class PowGradOp(UnaryGradOp):
    """`dy * exponent * x ** (exponent - 1)`: the gradient of `graph.pow` at `x`."""

    name = "graph.pow_grad"
    exponent = prop_def(FloatAttr)

    def __init__(self, at: SSAValue, dy: SSAValue, exponent: float):
        super().__init__(at, dy, exponent=float_attr(exponent))
