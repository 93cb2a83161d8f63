"""Shape and layout ops: transpose, reshape, broadcast, slice, split and concat (views where they can be)."""

from __future__ import annotations

from collections.abc import Sequence

from xdsl.dialects.builtin import (
    I64,
    DenseArrayBase,
    IntegerAttr,
    TensorType,
)
from xdsl.ir import Attribute, SSAValue
from xdsl.irdl import (
    irdl_op_definition,
    operand_def,
    prop_def,
    result_def,
    traits_def,
    var_operand_def,
    var_result_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.graph.base import tensor_shape, i64_array, check_same_element_type, TensorOp, UnaryOp, check_dim, int_attr

__all__ = [
    "TransposeOp",
    "ReshapeOp",
    "BroadcastOp",
    "SliceOp",
    "SplitOp",
    "ConcatOp",
]


@irdl_op_definition
class TransposeOp(UnaryOp):
    """Permutes dimensions: result dim i is input dim `perm[i]`."""

    name = "graph.transpose"
    perm = prop_def(DenseArrayBase)

    def __init__(self, input: SSAValue, perm: Sequence[int], result_type: Attribute):
        super().__init__(input, result_type, perm=i64_array(perm))

    def verify_(self) -> None:
        perm = self.perm.get_values()
        shape = tensor_shape(self.input)
        if sorted(perm) != list(range(len(shape))):
            raise VerifyException(f"'graph.transpose' perm {list(perm)} is not a permutation of {len(shape)} dims")
        if tensor_shape(self.result) != tuple(shape[p] for p in perm):
            raise VerifyException("'graph.transpose' result shape does not match the permuted input shape")


@irdl_op_definition
class ReshapeOp(UnaryOp):
    """Same elements in row-major order, another shape (the result type's)."""

    name = "graph.reshape"

    def verify_(self) -> None:
        import math

        if math.prod(tensor_shape(self.input)) != math.prod(tensor_shape(self.result)):
            raise VerifyException(
                f"'graph.reshape' cannot reshape {list(tensor_shape(self.input))} "
                f"into {list(tensor_shape(self.result))}"
            )


@irdl_op_definition
class BroadcastOp(UnaryOp):
    """Broadcasts to the result shape; input dim i becomes result dim `dims[i]` (size equal or 1)."""

    name = "graph.broadcast"
    dims = prop_def(DenseArrayBase)

    def __init__(self, input: SSAValue, dims: Sequence[int], result_type: Attribute):
        super().__init__(input, result_type, dims=i64_array(dims))

    def verify_(self) -> None:
        dims = self.dims.get_values()
        src, dst = tensor_shape(self.input), tensor_shape(self.result)
        if len(dims) != len(src) or list(dims) != sorted(set(dims)) or any(d >= len(dst) for d in dims):
            raise VerifyException(f"'graph.broadcast' dims {list(dims)} do not map {list(src)} into {list(dst)}")
        for i, d in enumerate(dims):
            if src[i] not in (1, dst[d]):
                raise VerifyException(f"'graph.broadcast' cannot stretch dim {i} of {list(src)} to {list(dst)}")


@irdl_op_definition
class SliceOp(UnaryOp):
    """`x[..., start:start + n, ...]` along `dim`, n the result's size there."""

    name = "graph.slice"
    dim = prop_def(IntegerAttr[I64])
    start = prop_def(IntegerAttr[I64])

    def __init__(self, input: SSAValue, dim: int, start: int, result_type: Attribute):
        super().__init__(input, result_type, dim=int_attr(dim), start=int_attr(start))

    def verify_(self) -> None:
        src, dst = tensor_shape(self.input), tensor_shape(self.result)
        d = check_dim(self, self.dim, len(src))
        start = self.start.value.data
        same_rest = len(src) == len(dst) and all(a == b for i, (a, b) in enumerate(zip(src, dst)) if i != d)
        if not same_rest or start < 0 or start + dst[d] > src[d]:
            raise VerifyException(f"'{self.name}' cannot take {list(dst)} at {start} along dim {d} of {list(src)}")
        check_same_element_type(self, self.input, self.result)


@irdl_op_definition
class SplitOp(TensorOp):
    """Consecutive pieces of `input` along `dim`; the results' sizes there sum to the input's."""

    name = "graph.split"
    input = operand_def(TensorType)
    outputs = var_result_def(TensorType)
    dim = prop_def(IntegerAttr[I64])
    traits = traits_def(Pure())

    def __init__(self, input: SSAValue, dim: int, result_types: Sequence[Attribute]):
        super().__init__(operands=[input], result_types=[list(result_types)], properties={"dim": int_attr(dim)})

    def verify_(self) -> None:
        src = tensor_shape(self.input)
        d = check_dim(self, self.dim, len(src))
        shapes = [tensor_shape(r) for r in self.outputs]
        ok = bool(shapes) and all(len(s) == len(src) and all(a == b for i, (a, b) in enumerate(zip(s, src)) if i != d)
                                  for s in shapes)
        if not ok or sum(s[d] for s in shapes) != src[d]:
            raise VerifyException(f"'{self.name}' of {list(src)} along dim {d} cannot give {[list(s) for s in shapes]}")
        check_same_element_type(self, self.input, *self.outputs)


@irdl_op_definition
class ConcatOp(TensorOp):
    """The operands joined along `dim` (same shapes elsewhere)."""

    name = "graph.concat"
    inputs = var_operand_def(TensorType)
    result = result_def(TensorType)
    dim = prop_def(IntegerAttr[I64])
    traits = traits_def(Pure())

    def __init__(self, inputs: Sequence[SSAValue], dim: int, result_type: Attribute):
        super().__init__(operands=[list(inputs)], result_types=[result_type], properties={"dim": int_attr(dim)})

    def verify_(self) -> None:
        dst = tensor_shape(self.result)
        d = check_dim(self, self.dim, len(dst))
        shapes = [tensor_shape(x) for x in self.inputs]
        ok = bool(shapes) and all(len(s) == len(dst) and all(a == b for i, (a, b) in enumerate(zip(s, dst)) if i != d)
                                  for s in shapes)
        if not ok or sum(s[d] for s in shapes) != dst[d]:
            raise VerifyException(f"'{self.name}' cannot join {[list(s) for s in shapes]} along dim {d} into {list(dst)}")
        check_same_element_type(self, *self.inputs, self.result)
