"""The `graph` dialect: logical tensor operations of a training step.

Every op works on builtin `tensor<...>` values. At the logical level the shapes are global;
at the annotated level the same ops carry a `#dist.layout` in each tensor type's encoding;
at the physical level the shapes are the local shapes of one rank. Shape rules below hold
at every level, which is why no op stores a shape of its own: the result type is the shape.

Parameters, inputs, outputs and parameter updates are named ops, so a training step is one
`func.func` with no arguments and the runtime binds names to buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

from xdsl.dialects.builtin import (
    DenseArrayBase,
    Float32Type,
    Float64Type,
    FloatAttr,
    IntegerType,
    StringAttr,
    TensorType,
    TypeAttribute,
    i64,
)
from xdsl.ir import Attribute, Dialect, Operation, SSAValue
from xdsl.irdl import (
    IRDLOperation,
    ParsePropInAttrDict,
    irdl_op_definition,
    operand_def,
    opt_prop_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

__all__ = ["Graph"]


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


def _same_shape(op: Operation, *values: SSAValue) -> None:
    shapes = {tensor_shape(v) for v in values}
    if len(shapes) != 1:
        raise VerifyException(f"'{op.name}' needs operands and result of one shape, got {sorted(shapes)}")


def _same_element_type(op: Operation, *values: SSAValue) -> None:
    types = {v.type.element_type for v in values}  # type: ignore[attr-defined]
    if len(types) != 1:
        raise VerifyException(f"'{op.name}' needs one element type, got {', '.join(map(str, types))}")


class _TensorOp(IRDLOperation):
    """Base of ops whose text is `operands attr-dict : (types) -> type`."""

    irdl_options = (ParsePropInAttrDict(),)
    assembly_format = "operands attr-dict `:` functional-type(operands, results)"


# ----------------------------------------------------------------------------- leaves


@irdl_op_definition
class ParameterOp(IRDLOperation):
    """A trainable parameter, named after its place in the module tree (`fc1.weight`).

    `init` says how the runtime creates its initial value (`zeros`, `ones`,
    `normal:STD`, `uniform:LO:HI`); `global_type` is set at the physical level, where the
    result type is the local piece, and records the annotated type (global shape + layout).
    """

    name = "graph.parameter"
    irdl_options = (ParsePropInAttrDict(),)
    tensor_name = prop_def(StringAttr)
    init = prop_def(StringAttr)
    global_type = opt_prop_def(TypeAttribute)
    result = result_def(TensorType)
    assembly_format = "$tensor_name attr-dict `:` type($result)"

    def __init__(self, tensor_name: str, init: str, result_type: Attribute, global_type: Attribute | None = None):
        props: dict[str, Attribute] = {"tensor_name": StringAttr(tensor_name), "init": StringAttr(init)}
        if global_type is not None:
            props["global_type"] = global_type
        super().__init__(properties=props, result_types=[result_type])

    def verify_(self) -> None:
        from hspmd.ir.init_spec import parse_init_spec

        try:
            parse_init_spec(self.init.data)
        except ValueError as err:
            raise VerifyException(str(err)) from None


@irdl_op_definition
class InputOp(IRDLOperation):
    """A named input of the step (a batch tensor); `global_type` as for parameters."""

    name = "graph.input"
    irdl_options = (ParsePropInAttrDict(),)
    tensor_name = prop_def(StringAttr)
    global_type = opt_prop_def(TypeAttribute)
    result = result_def(TensorType)
    assembly_format = "$tensor_name attr-dict `:` type($result)"

    def __init__(self, tensor_name: str, result_type: Attribute, global_type: Attribute | None = None):
        props: dict[str, Attribute] = {"tensor_name": StringAttr(tensor_name)}
        if global_type is not None:
            props["global_type"] = global_type
        super().__init__(properties=props, result_types=[result_type])


@irdl_op_definition
class ConstantOp(IRDLOperation):
    """A tensor whose every element is `value` (a splat)."""

    name = "graph.constant"
    irdl_options = (ParsePropInAttrDict(),)
    value = prop_def(FloatAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "attr-dict `:` type($result)"

    def __init__(self, value: float, result_type: TensorType):
        super().__init__(
            properties={"value": FloatAttr(float(value), Float64Type())}, result_types=[result_type]
        )


@irdl_op_definition
class OutputOp(IRDLOperation):
    """Marks a value the step returns under a name (the loss, a gradient)."""

    name = "graph.output"
    irdl_options = (ParsePropInAttrDict(),)
    tensor_name = prop_def(StringAttr)
    value = operand_def(TensorType)
    assembly_format = "$tensor_name `,` $value attr-dict `:` type($value)"

    def __init__(self, tensor_name: str, value: SSAValue | Operation):
        super().__init__(properties={"tensor_name": StringAttr(tensor_name)}, operands=[value])


@irdl_op_definition
class AssignOp(IRDLOperation):
    """Stores a new value into a named parameter at the end of the step."""

    name = "graph.assign"
    irdl_options = (ParsePropInAttrDict(),)
    tensor_name = prop_def(StringAttr)
    value = operand_def(TensorType)
    assembly_format = "$tensor_name `,` $value attr-dict `:` type($value)"

    def __init__(self, tensor_name: str, value: SSAValue | Operation):
        super().__init__(properties={"tensor_name": StringAttr(tensor_name)}, operands=[value])


# ----------------------------------------------------------------------------- compute


class _Binary(_TensorOp):
    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, lhs: SSAValue, rhs: SSAValue, result_type: Attribute | None = None):
        super().__init__(operands=[lhs, rhs], result_types=[result_type or lhs.type])

    def verify_(self) -> None:
        _same_shape(self, self.lhs, self.rhs, self.result)
        _same_element_type(self, self.lhs, self.rhs, self.result)


@irdl_op_definition
class AddOp(_Binary):
    """Elementwise `lhs + rhs` (same shapes; broadcast first with `graph.broadcast`)."""

    name = "graph.add"


@irdl_op_definition
class SubOp(_Binary):
    """Elementwise `lhs - rhs`."""

    name = "graph.sub"


@irdl_op_definition
class MulOp(_Binary):
    """Elementwise `lhs * rhs`."""

    name = "graph.mul"


@irdl_op_definition
class ReluGradOp(_Binary):
    """`rhs * (lhs > 0)`: the gradient of relu at `lhs` applied to the incoming gradient `rhs`."""

    name = "graph.relu_grad"


class _Unary(_TensorOp):
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, input: SSAValue, result_type: Attribute | None = None, **props: Attribute):
        super().__init__(operands=[input], result_types=[result_type or input.type], properties=props)


@irdl_op_definition
class ReluOp(_Unary):
    """Elementwise `max(x, 0)`."""

    name = "graph.relu"

    def verify_(self) -> None:
        _same_shape(self, self.input, self.result)


@irdl_op_definition
class ScaleOp(_Unary):
    """Elementwise `x * factor` for a compile-time constant `factor`."""

    name = "graph.scale"
    factor = prop_def(FloatAttr)

    def __init__(self, input: SSAValue, factor: float):
        super().__init__(input, factor=FloatAttr(float(factor), Float64Type()))

    def verify_(self) -> None:
        _same_shape(self, self.input, self.result)


@irdl_op_definition
class MatmulOp(_TensorOp):
    """`lhs @ rhs` for 2-D tensors: [m, k] x [k, n] -> [m, n]."""

    name = "graph.matmul"
    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, lhs: SSAValue, rhs: SSAValue, result_type: Attribute):
        super().__init__(operands=[lhs, rhs], result_types=[result_type])

    def verify_(self) -> None:
        a, b, r = tensor_shape(self.lhs), tensor_shape(self.rhs), tensor_shape(self.result)
        if len(a) != 2 or len(b) != 2 or a[1] != b[0] or r != (a[0], b[1]):
            raise VerifyException(f"'graph.matmul' cannot multiply {list(a)} by {list(b)} into {list(r)}")


@irdl_op_definition
class TransposeOp(_Unary):
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
class ReshapeOp(_Unary):
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
class BroadcastOp(_Unary):
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


class _Reduce(_Unary):
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
class SoftmaxCrossEntropyOp(_TensorOp):
    """Per-sample loss `logsumexp(logits[b]) - logits[b, labels[b]]`: [B, C], [B] -> [B]."""

    name = "graph.softmax_cross_entropy"
    logits = operand_def(TensorType)
    labels = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, logits: SSAValue, labels: SSAValue, result_type: Attribute):
        super().__init__(operands=[logits, labels], result_types=[result_type])

    def verify_(self) -> None:
        lg, lb, r = tensor_shape(self.logits), tensor_shape(self.labels), tensor_shape(self.result)
        if len(lg) != 2 or lb != lg[:1] or r != lg[:1]:
            raise VerifyException(f"'{self.name}' needs logits [B, C] and labels [B], got {list(lg)} and {list(lb)}")
        if not isinstance(self.labels.type.element_type, IntegerType):  # type: ignore[attr-defined]
            raise VerifyException(f"'{self.name}' needs integer labels")


@irdl_op_definition
class SoftmaxCrossEntropyGradOp(_TensorOp):
    """`(softmax(logits) - onehot(labels)) * dloss[:, None]`: the gradient w.r.t. the logits."""

    name = "graph.softmax_cross_entropy_grad"
    logits = operand_def(TensorType)
    labels = operand_def(TensorType)
    dloss = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, logits: SSAValue, labels: SSAValue, dloss: SSAValue):
        super().__init__(operands=[logits, labels, dloss], result_types=[logits.type])

    def verify_(self) -> None:
        lg, lb, d = tensor_shape(self.logits), tensor_shape(self.labels), tensor_shape(self.dloss)
        if len(lg) != 2 or lb != lg[:1] or d != lg[:1] or tensor_shape(self.result) != lg:
            raise VerifyException(f"'{self.name}' needs logits [B, C], labels [B], dloss [B]")


FLOAT_TYPES = (Float32Type, Float64Type)

Graph = Dialect(
    "graph",
    [
        ParameterOp,
        InputOp,
        ConstantOp,
        OutputOp,
        AssignOp,
        AddOp,
        SubOp,
        MulOp,
        ReluOp,
        ReluGradOp,
        ScaleOp,
        MatmulOp,
        TransposeOp,
        ReshapeOp,
        BroadcastOp,
        ReduceSumOp,
        SoftmaxCrossEntropyOp,
        SoftmaxCrossEntropyGradOp,
    ],
    [],
)
