"""What the `graph` ops share: tensor shapes and types, verifier checks, and the base op classes.

Every op works on builtin `tensor<...>` values. At the logical level the shapes are global;
at the annotated level the same ops carry a `#dist.layout` in each tensor type's encoding;
at the physical level the shapes are the local shapes of one rank. Shape rules hold at every
level, which is why no op stores a shape of its own: the result type is the shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

from xdsl.dialects.builtin import (
    AnyFloat,
    DenseArrayBase,
    Float32Type,
    Float64Type,
    FloatAttr,
    IntegerAttr,
    IntegerType,
    TensorType,
    i64,
)
from xdsl.ir import Attribute, Operation, SSAValue
from xdsl.irdl import (
    IRDLOperation,
    ParsePropInAttrDict,
    operand_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.cuda_c import EmitError
from hspmd.dialects.dist import layout_of
from hspmd.dialects.interfaces import Emit
from hspmd.dialects.op_rule import OpRule, elementwise_rule
from hspmd.ir.types import dtype_name

__all__ = [
    "tensor_shape",
    "tensor_type",
    "i64_array",
    "stops_gradient",
    "check_same_shape",
    "check_same_element_type",
    "TensorOp",
    "BinaryOp",
    "UnaryOp",
    "check_float",
    "check_integer",
    "check_dim",
    "int_attr",
    "float_attr",
    "ElementwiseOp",
    "UnaryGradOp",
    "FLOAT_TYPES",
]


def tensor_shape(value: SSAValue | Attribute) -> tuple[int, ...]:
    """Return the shape of a tensor value or type."""
    typ = value.type if isinstance(value, SSAValue) else value
    if not isinstance(typ, TensorType):
        raise VerifyException(f"expected a tensor type, got {typ}")
    return typ.get_shape()


def tensor_type(element_type: Attribute, shape: Sequence[int], encoding: Attribute | None = None) -> TensorType:
    """Return `tensor<shape x element_type>` with an optional encoding (a layout)."""
    if encoding is None:
        return TensorType(element_type, shape)
    return TensorType(element_type, shape, encoding)


def i64_array(values: Sequence[int]) -> DenseArrayBase:
    """Return `array<i64: ...>` holding `values`."""
    return DenseArrayBase.from_list(i64, list(values))


def stops_gradient(op: Operation) -> bool:
    """Return whether `op`'s results carry no gradient (a routing mask: piecewise constant)."""
    return bool(getattr(op, "STOPS_GRADIENT", False))


def check_same_shape(op: Operation, *values: SSAValue) -> None:
    shapes = {tensor_shape(v) for v in values}
    if len(shapes) != 1:
        raise VerifyException(f"'{op.name}' needs operands and result of one shape, got {sorted(shapes)}")


def check_same_element_type(op: Operation, *values: SSAValue) -> None:
    types = {v.type.element_type for v in values}  # type: ignore[attr-defined]
    if len(types) != 1:
        raise VerifyException(f"'{op.name}' needs one element type, got {', '.join(map(str, types))}")


class TensorOp(IRDLOperation):
    """Base of ops whose text is `operands attr-dict : (types) -> type`."""

    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "operands attr-dict `:` functional-type(operands, results)"


class BinaryOp(TensorOp):
    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, lhs: SSAValue, rhs: SSAValue, result_type: Attribute | None = None):
        super().__init__(operands=[lhs, rhs], result_types=[result_type or lhs.type])

    def verify_(self) -> None:
        check_same_shape(self, self.lhs, self.rhs, self.result)
        check_same_element_type(self, self.lhs, self.rhs, self.result)


class UnaryOp(TensorOp):
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, input: SSAValue, result_type: Attribute | None = None, **props: Attribute):
        super().__init__(operands=[input], result_types=[result_type or input.type], properties=props)


def check_float(op: Operation, *values: SSAValue) -> None:
    for v in values:
        if not isinstance(v.type.element_type, AnyFloat):  # type: ignore[attr-defined]
            raise VerifyException(f"'{op.name}' needs float tensors, got {v.type}")


def check_integer(op: Operation, value: SSAValue, what: str) -> None:
    if not isinstance(value.type.element_type, IntegerType):  # type: ignore[attr-defined]
        raise VerifyException(f"'{op.name}' needs integer {what}, got {value.type}")


def check_dim(op: Operation, dim: IntegerAttr, rank: int) -> int:
    d = dim.value.data
    if not 0 <= d < rank:
        raise VerifyException(f"'{op.name}' dim {d} is not a dim of a {rank}-d tensor")
    return d


def int_attr(value: int) -> IntegerAttr:
    """Return `value : i64`."""
    return IntegerAttr(int(value), i64)


def float_attr(value: float) -> FloatAttr:
    """Return `value : f64`."""
    return FloatAttr(float(value), Float64Type())


class ElementwiseOp(UnaryOp):
    """A float elementwise op: result of the input's shape and element type (any split fits)."""

    def sharding_rule(self) -> OpRule:
        return elementwise_rule(self)

    def verify_(self) -> None:
        check_same_shape(self, self.input, self.result)
        check_same_element_type(self, self.input, self.result)
        check_float(self, self.input)


class UnaryGradOp(BinaryOp):
    """`f'(at) * dy` for an elementwise `f`: `lhs` is the forward input (or result), `rhs` the
    incoming gradient."""

    def __init__(self, at: SSAValue, dy: SSAValue, **props: Attribute):
        IRDLOperation.__init__(self, operands=[at, dy], result_types=[dy.type], properties=props)

    NO_VJP: ClassVar[str] = "a gradient op (no second derivatives)"

    def sharding_rule(self) -> OpRule:
        return elementwise_rule(self, frozenset({1}))  # linear in the incoming gradient


FLOAT_TYPES = (Float32Type, Float64Type)


# ----------------------------------------------------------------------------- helpers of the facts


def result_shape(op: Operation) -> tuple[int, ...]:
    """Return the shape of `op`'s first result."""
    return op.results[0].type.get_shape()  # type: ignore[attr-defined]


def result_dtype(op: Operation) -> np.dtype:
    """Return the NumPy dtype of `op`'s first result."""
    return np.dtype(dtype_name(op.results[0].type))


def shared_grad(emit: Emit, make: Callable[[], Operation]) -> Callable[[], Operation]:
    """Return a maker that emits the op `make` builds once, and then hands back the same op (the
    gradients of several operands that one backward op computes together)."""
    made: list[Operation] = []

    def get() -> Operation:
        if not made:
            made.append(make())
            emit(made[0])
        return made[0]

    return get


def whole_piece(op: Operation) -> bool:
    """Return whether every rank holds `op`'s whole result (no `global_type`, or a layout that
    neither splits it nor holds partial sums): then a kernel that reads global positions (a
    dropout mask, a vocabulary range) is the same on every rank."""
    typ = getattr(op, "global_type", None)
    layout = layout_of(typ) if typ is not None else None
    if layout is None:
        return True
    return len(layout.groups) == 1 and all(axis.kind == "dup" for axis, _ in layout.groups[0].states.axes)


def piece_starts(op: Operation) -> dict[int, tuple[int, ...]]:
    """Return, per rank of `op`'s result layout, where its piece starts in the global tensor
    along each dim: the rank values (`cuda_c.KernelCode.rank_values`) of a GPU kernel that
    reads global positions; {} where every rank holds the whole result (`whole_piece`)."""
    if whole_piece(op):
        return {}
    typ = op.global_type  # type: ignore[attr-defined]
    layout, shape = layout_of(typ), typ.get_shape()
    return {r: tuple(s.start or 0 for s in layout.slices(r, shape)) for r in layout.devices}


