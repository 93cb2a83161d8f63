"""Reductions over dims: sum and max (with max's gradient)."""

from __future__ import annotations

from collections.abc import Sequence

from xdsl.dialects.builtin import (
    DenseArrayBase,
    TensorType,
)
from xdsl.ir import Attribute, SSAValue
from xdsl.irdl import (
    irdl_op_definition,
    operand_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.graph.base import tensor_shape, i64_array, check_same_shape, TensorOp, UnaryOp

__all__ = [
    "ReduceSumOp",
    "ReduceMaxOp",
    "ReduceMaxGradOp",
]


class _Reduce(UnaryOp):
    dims = prop_def(DenseArrayBase)

    def __init__(self, input: SSAValue, dims: Sequence[int], result_type: Attribute):
        super().__init__(input, result_type, dims=i64_array(dims))

    def verify_(self) -> None:
        dims = self.dims.get_values()
        src = tensor_shape(self.input)
        if list(dims) != sorted(set(dims)) or any(not 0 <= d < len(src) for d in dims):
            raise VerifyException(f"'{self.name}' dims {list(dims)} are not sorted dims of {list(src)}")
        expect = tuple(s for i, s in enumerate(src) if i not in dims)
        if tensor_shape(self.result) != expect:
            raise VerifyException(f"'{self.name}' of {list(src)} over {list(dims)} has shape {list(expect)}")


@irdl_op_definition
class ReduceSumOp(_Reduce):
    """Sum over `dims` (removed from the shape)."""

    name = "graph.reduce_sum"


@irdl_op_definition
class ReduceMaxOp(_Reduce):
    """Maximum over `dims` (removed from the shape)."""

    name = "graph.reduce_max"


@irdl_op_definition
class ReduceMaxGradOp(TensorOp):
    """The gradient of `graph.reduce_max` (same dims): `dy` goes to the positions of `x` equal
    to the maximum `y`, split evenly between ties."""

    name = "graph.reduce_max_grad"
    x = operand_def(TensorType)
    y = operand_def(TensorType)
    dy = operand_def(TensorType)
    result = result_def(TensorType)
    dims = prop_def(DenseArrayBase)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, y: SSAValue, dy: SSAValue, dims: Sequence[int]):
        super().__init__(operands=[x, y, dy], result_types=[x.type], properties={"dims": i64_array(dims)})

    def verify_(self) -> None:
        dims = self.dims.get_values()
        src = tensor_shape(self.x)
        kept = tuple(s for i, s in enumerate(src) if i not in dims)
        if tensor_shape(self.y) != kept or tensor_shape(self.dy) != kept:
            raise VerifyException(f"'{self.name}' needs y and dy of shape {list(kept)}")
        check_same_shape(self, self.x, self.result)
