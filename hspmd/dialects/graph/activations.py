"""Elementwise functions and activations with their gradients: relu, exp, log, sqrt, rsqrt,
tanh, sigmoid, silu, gelu, erf."""

from __future__ import annotations


from xdsl.dialects.builtin import (
    StringAttr,
)
from xdsl.ir import SSAValue
from xdsl.irdl import (
    irdl_op_definition,
    prop_def,
)
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.graph.base import check_same_shape, BinaryOp, UnaryOp, ElementwiseOp, UnaryGradOp


@irdl_op_definition
class ReluOp(UnaryOp):
    """Elementwise `max(x, 0)`."""

    name = "graph.relu"

    def verify_(self) -> None:
        check_same_shape(self, self.input, self.result)


@irdl_op_definition
class ReluGradOp(BinaryOp):
    """`rhs * (lhs > 0)`: the gradient of relu at `lhs` applied to the incoming gradient `rhs`."""

    name = "graph.relu_grad"


@irdl_op_definition
class ExpOp(ElementwiseOp):
    """Elementwise `exp(x)`."""

    name = "graph.exp"


@irdl_op_definition
class LogOp(ElementwiseOp):
    """Elementwise natural `log(x)`."""

    name = "graph.log"


@irdl_op_definition
class SqrtOp(ElementwiseOp):
    """Elementwise `sqrt(x)`."""

    name = "graph.sqrt"


@irdl_op_definition
class RsqrtOp(ElementwiseOp):
    """Elementwise `1 / sqrt(x)`."""

    name = "graph.rsqrt"


@irdl_op_definition
class TanhOp(ElementwiseOp):
    """Elementwise `tanh(x)`."""

    name = "graph.tanh"


@irdl_op_definition
class TanhGradOp(UnaryGradOp):
    """`dy * (1 - y^2)` at the result `y` of `graph.tanh`."""

    name = "graph.tanh_grad"


@irdl_op_definition
class SigmoidOp(ElementwiseOp):
    """Elementwise `1 / (1 + exp(-x))`."""

    name = "graph.sigmoid"


@irdl_op_definition
class SigmoidGradOp(UnaryGradOp):
    """`dy * y * (1 - y)` at the result `y` of `graph.sigmoid`."""

    name = "graph.sigmoid_grad"


@irdl_op_definition
class SiluOp(ElementwiseOp):
    """Elementwise `x * sigmoid(x)` (SiLU, swish)."""

    name = "graph.silu"


@irdl_op_definition
class SiluGradOp(UnaryGradOp):
    """`dy * s * (1 + x (1 - s))`, `s = sigmoid(x)`: the gradient of `graph.silu` at `x`."""

    name = "graph.silu_grad"


GELU_APPROXIMATIONS = ("none", "tanh")


@irdl_op_definition
class GeluOp(ElementwiseOp):
    """Elementwise GELU: `x * Phi(x)` (`approximate = "none"`, with erf) or the tanh form
    `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` (`approximate = "tanh"`, GPT-2)."""

    name = "graph.gelu"
    approximate = prop_def(StringAttr)

    def __init__(self, input: SSAValue, approximate: str = "none"):
        super().__init__(input, approximate=StringAttr(approximate))

    def verify_(self) -> None:
        super().verify_()
        if self.approximate.data not in GELU_APPROXIMATIONS:
            raise VerifyException(f"'{self.name}' approximate must be one of {GELU_APPROXIMATIONS}")


@irdl_op_definition
class GeluGradOp(UnaryGradOp):
    """The gradient of `graph.gelu` (same `approximate`) at `x`, times `dy`."""

    name = "graph.gelu_grad"
    approximate = prop_def(StringAttr)

    def __init__(self, at: SSAValue, dy: SSAValue, approximate: str):
        super().__init__(at, dy, approximate=StringAttr(approximate))
