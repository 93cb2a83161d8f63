"""Normalisation over the last dim: layer norm and RMS norm, with their gradients."""

from __future__ import annotations


from xdsl.dialects.builtin import (
    FloatAttr,
    TensorType,
)
from xdsl.ir import SSAValue
from xdsl.irdl import (
    irdl_op_definition,
    operand_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.graph.base import tensor_shape, check_same_shape, check_same_element_type, TensorOp, check_float, float_attr

__all__ = [
    "LayerNormOp",
    "LayerNormGradOp",
    "RmsNormOp",
    "RmsNormGradOp",
]


@irdl_op_definition
class LayerNormOp(TensorOp):
    """`(x - mean) / sqrt(var + eps) * weight + bias` over the last dim (biased variance):
    x [..., n], weight [n], bias [n] -> [..., n]."""

    name = "graph.layer_norm"
    x = operand_def(TensorType)
    weight = operand_def(TensorType)
    bias = operand_def(TensorType)
    result = result_def(TensorType)
    eps = prop_def(FloatAttr)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, weight: SSAValue, bias: SSAValue, eps: float):
        super().__init__(operands=[x, weight, bias], result_types=[x.type], properties={"eps": float_attr(eps)})

    def verify_(self) -> None:
        x, w, b = tensor_shape(self.x), tensor_shape(self.weight), tensor_shape(self.bias)
        if not x or w != x[-1:] or b != x[-1:]:
            raise VerifyException(f"'{self.name}' needs x [..., n], weight [n], bias [n], got {list(x)}, {list(w)}, {list(b)}")
        check_same_shape(self, self.x, self.result)
        check_same_element_type(self, self.x, self.weight, self.bias, self.result)
        check_float(self, self.x)


@irdl_op_definition
class LayerNormGradOp(TensorOp):
    """The gradients of `graph.layer_norm` (same eps) at `x`, `weight`, given `dy`:
    results dx [..., n], dweight [n], dbias [n] (the latter two summed over the leading dims)."""

    name = "graph.layer_norm_grad"
    x = operand_def(TensorType)
    weight = operand_def(TensorType)
    dy = operand_def(TensorType)
    dx = result_def(TensorType)
    dweight = result_def(TensorType)
    dbias = result_def(TensorType)
    eps = prop_def(FloatAttr)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, weight: SSAValue, dy: SSAValue, eps: float):
        super().__init__(
            operands=[x, weight, dy], result_types=[x.type, weight.type, weight.type], properties={"eps": float_attr(eps)}
        )

    def verify_(self) -> None:
        x, w = tensor_shape(self.x), tensor_shape(self.weight)
        if not x or w != x[-1:] or tensor_shape(self.dy) != x:
            raise VerifyException(f"'{self.name}' needs x [..., n], weight [n], dy [..., n]")
        check_same_shape(self, self.x, self.dx)
        check_same_shape(self, self.weight, self.dweight, self.dbias)


@irdl_op_definition
class RmsNormOp(TensorOp):
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dim (LLaMA): x [..., n], weight [n]."""

    name = "graph.rms_norm"
    x = operand_def(TensorType)
    weight = operand_def(TensorType)
    result = result_def(TensorType)
    eps = prop_def(FloatAttr)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, weight: SSAValue, eps: float):
        super().__init__(operands=[x, weight], result_types=[x.type], properties={"eps": float_attr(eps)})

    def verify_(self) -> None:
        x, w = tensor_shape(self.x), tensor_shape(self.weight)
        if not x or w != x[-1:]:
            raise VerifyException(f"'{self.name}' needs x [..., n] and weight [n], got {list(x)}, {list(w)}")
        check_same_shape(self, self.x, self.result)
        check_same_element_type(self, self.x, self.weight, self.result)
        check_float(self, self.x)


@irdl_op_definition
class RmsNormGradOp(TensorOp):
    """The gradients of `graph.rms_norm` (same eps): dx [..., n], dweight [n] (summed over the
    leading dims)."""

    name = "graph.rms_norm_grad"
    x = operand_def(TensorType)
    weight = operand_def(TensorType)
    dy = operand_def(TensorType)
    dx = result_def(TensorType)
    dweight = result_def(TensorType)
    eps = prop_def(FloatAttr)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, weight: SSAValue, dy: SSAValue, eps: float):
        super().__init__(operands=[x, weight, dy], result_types=[x.type, weight.type], properties={"eps": float_attr(eps)})

    def verify_(self) -> None:
        x, w = tensor_shape(self.x), tensor_shape(self.weight)
        if not x or w != x[-1:] or tensor_shape(self.dy) != x:
            raise VerifyException(f"'{self.name}' needs x [..., n], weight [n], dy [..., n]")
        check_same_shape(self, self.x, self.dx)
        check_same_shape(self, self.weight, self.dweight)
