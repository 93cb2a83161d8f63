"""Attention's row ops: softmax over a dim (with its gradient) and the causal mask of scores."""

from __future__ import annotations


from xdsl.dialects.builtin import (
    I64,
    FloatAttr,
    IntegerAttr,
)
from xdsl.ir import SSAValue
from xdsl.irdl import (
    irdl_op_definition,
    prop_def,
)
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.graph.base import tensor_shape, check_same_shape, UnaryOp, check_float, check_dim, int_attr, float_attr, UnaryGradOp

__all__ = [
    "SoftmaxOp",
    "SoftmaxGradOp",
    "CausalMaskOp",
]


@irdl_op_definition
class SoftmaxOp(UnaryOp):
    """`exp(x - max) / sum(exp(x - max))` along `dim`."""

    name = "graph.softmax"
    dim = prop_def(IntegerAttr[I64])

    def __init__(self, input: SSAValue, dim: int):
        super().__init__(input, dim=int_attr(dim))

    def verify_(self) -> None:
        check_same_shape(self, self.input, self.result)
        check_float(self, self.input)
        check_dim(self, self.dim, len(tensor_shape(self.input)))


@irdl_op_definition
class SoftmaxGradOp(UnaryGradOp):
    """`y * (dy - sum(dy * y, dim))`: the gradient of `graph.softmax` given its result `y`."""

    name = "graph.softmax_grad"
    dim = prop_def(IntegerAttr[I64])

    def __init__(self, y: SSAValue, dy: SSAValue, dim: int):
        super().__init__(y, dy, dim=int_attr(dim))

    def verify_(self) -> None:
        super().verify_()
        check_dim(self, self.dim, len(tensor_shape(self.lhs)))


@irdl_op_definition
class CausalMaskOp(UnaryOp):
    """Scores [..., Tq, Tk]: entries with key index j > query index i become `value` (-inf in
    the forward pass, so that softmax gives them 0; 0.0 for the gradient)."""

    name = "graph.causal_mask"
    value = prop_def(FloatAttr)

    def __init__(self, input: SSAValue, value: float = float("-inf")):
        super().__init__(input, value=float_attr(value))

    def verify_(self) -> None:
        check_same_shape(self, self.input, self.result)
        check_float(self, self.input)
        if len(tensor_shape(self.input)) < 2:
            raise VerifyException(f"'{self.name}' needs scores [..., Tq, Tk]")
