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
from typing import ClassVar

from xdsl.dialects.builtin import (
    I64,
    AnyFloat,
    DenseArrayBase,
    Float32Type,
    Float64Type,
    FloatAttr,
    IntegerAttr,
    IntegerType,
    StringAttr,
    SymbolRefAttr,
    TensorType,
    TypeAttribute,
    UnitAttr,
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
    var_operand_def,
    var_result_def,
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


def stops_gradient(op: Operation) -> bool:
    """Return whether `op`'s results carry no gradient (a routing mask: piecewise constant)."""
    return bool(getattr(op, "STOPS_GRADIENT", False))


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
class IotaOp(IRDLOperation):
    """A 1-d integer tensor counting up: element i is `start + i * step` (`jax.lax.iota`).

    `stack-layers` makes the per-layer counters of stacked layers with it (a dropout's random
    stream differs per layer: layer i draws from `step + (i << 32)`). It is replicated: every
    device makes the whole (small) tensor.
    """

    name = "graph.iota"
    irdl_options = (ParsePropInAttrDict(),)
    start = prop_def(IntegerAttr[I64])
    step = prop_def(IntegerAttr[I64])
    global_type = opt_prop_def(TypeAttribute)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "attr-dict `:` type($result)"
    #: specialize-groups records the annotated result type in `global_type` (a rank makes its piece)
    RECORDS_GLOBAL_TYPE: ClassVar[bool] = True

    def __init__(self, start: int, step: int, result_type: TensorType):
        super().__init__(properties={"start": int_attr(start), "step": int_attr(step)}, result_types=[result_type])

    def verify_(self) -> None:
        if len(tensor_shape(self.result)) != 1:
            raise VerifyException(f"'{self.name}' makes a 1-d tensor, not {self.result.type}")
        _integer(self, self.result, "result")


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


class _Matmul(_TensorOp):
    """Base of the products `graph.matmul` and `graph.expert_matmul` (one verifier, one kernel)."""

    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, lhs: SSAValue, rhs: SSAValue, result_type: Attribute):
        super().__init__(operands=[lhs, rhs], result_types=[result_type])

    def verify_(self) -> None:
        a, b, r = tensor_shape(self.lhs), tensor_shape(self.rhs), tensor_shape(self.result)
        ok = len(a) >= 2 and len(b) >= 2 and a[-1] == b[-2] and (len(b) == 2 or b[:-2] == a[:-2])
        if not ok or r != (*a[:-2], a[-2], b[-1]):
            raise VerifyException(f"'{self.name}' cannot multiply {list(a)} by {list(b)} into {list(r)}")
        _same_element_type(self, self.lhs, self.rhs, self.result)


@irdl_op_definition
class MatmulOp(_Matmul):
    """Batched `lhs @ rhs`: [..., m, k] x [..., k, n] -> [..., m, n] (the same batch dims), or
    [..., m, k] x [k, n] -> [..., m, n] (a 2-D right operand, e.g. a weight applied to
    [B, T, D] activations). With no batch dims it is the plain 2-D product."""

    name = "graph.matmul"


@irdl_op_definition
class MatmulRhsGradOp(_TensorOp):
    """`sum over batch dims of lhs^T @ dy`: [..., m, k], [..., m, n] -> [k, n].

    The gradient of a 2-D right operand of a batched matmul: every batch dim and `m` are
    contracted (splitting any of them leaves partial sums, so data parallelism over the batch
    needs one all-reduce of the weight gradient, as for a 2-D matmul)."""

    name = "graph.matmul_rhs_grad"
    lhs = operand_def(TensorType)
    dy = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, lhs: SSAValue, dy: SSAValue, result_type: Attribute):
        super().__init__(operands=[lhs, dy], result_types=[result_type])

    def verify_(self) -> None:
        a, g, r = tensor_shape(self.lhs), tensor_shape(self.dy), tensor_shape(self.result)
        if len(a) < 2 or a[:-1] != g[:-1] or len(g) != len(a) or r != (a[-1], g[-1]):
            raise VerifyException(f"'{self.name}' needs lhs [..., m, k] and dy [..., m, n] giving [k, n], "
                                  f"got {list(a)}, {list(g)} -> {list(r)}")
        _same_element_type(self, self.lhs, self.dy, self.result)


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


def _float(op: Operation, *values: SSAValue) -> None:
    for v in values:
        if not isinstance(v.type.element_type, AnyFloat):  # type: ignore[attr-defined]
            raise VerifyException(f"'{op.name}' needs float tensors, got {v.type}")


def _integer(op: Operation, value: SSAValue, what: str) -> None:
    if not isinstance(value.type.element_type, IntegerType):  # type: ignore[attr-defined]
        raise VerifyException(f"'{op.name}' needs integer {what}, got {value.type}")


def _dim(op: Operation, dim: IntegerAttr, rank: int) -> int:
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


# ----------------------------------------------------------------------------- elementwise


class _Elementwise(_Unary):
    """A float elementwise op: result of the input's shape and element type."""

    def verify_(self) -> None:
        _same_shape(self, self.input, self.result)
        _same_element_type(self, self.input, self.result)
        _float(self, self.input)


@irdl_op_definition
class ExpOp(_Elementwise):
    """Elementwise `exp(x)`."""

    name = "graph.exp"


@irdl_op_definition
class LogOp(_Elementwise):
    """Elementwise natural `log(x)`."""

    name = "graph.log"


@irdl_op_definition
class SqrtOp(_Elementwise):
    """Elementwise `sqrt(x)`."""

    name = "graph.sqrt"


@irdl_op_definition
class RsqrtOp(_Elementwise):
    """Elementwise `1 / sqrt(x)`."""

    name = "graph.rsqrt"


@irdl_op_definition
class TanhOp(_Elementwise):
    """Elementwise `tanh(x)`."""

    name = "graph.tanh"


@irdl_op_definition
class SigmoidOp(_Elementwise):
    """Elementwise `1 / (1 + exp(-x))`."""

    name = "graph.sigmoid"


@irdl_op_definition
class SiluOp(_Elementwise):
    """Elementwise `x * sigmoid(x)` (SiLU, swish)."""

    name = "graph.silu"


GELU_APPROXIMATIONS = ("none", "tanh")


@irdl_op_definition
class GeluOp(_Elementwise):
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
class PowOp(_Elementwise):
    """Elementwise `x ** exponent` for a compile-time constant exponent."""

    name = "graph.pow"
    exponent = prop_def(FloatAttr)

    def __init__(self, input: SSAValue, exponent: float):
        super().__init__(input, exponent=float_attr(exponent))


@irdl_op_definition
class CastOp(_Unary):
    """Elementwise conversion to the result type's element type (same shape)."""

    name = "graph.cast"

    def verify_(self) -> None:
        _same_shape(self, self.input, self.result)
        _float(self, self.input, self.result)


@irdl_op_definition
class DivOp(_Binary):
    """Elementwise `lhs / rhs` (same shapes)."""

    name = "graph.div"


class _UnaryGrad(_Binary):
    """`f'(at) * dy` for an elementwise `f`: `lhs` is the forward input (or result), `rhs` the
    incoming gradient."""

    def __init__(self, at: SSAValue, dy: SSAValue, **props: Attribute):
        IRDLOperation.__init__(self, operands=[at, dy], result_types=[dy.type], properties=props)


@irdl_op_definition
class TanhGradOp(_UnaryGrad):
    """`dy * (1 - y^2)` at the result `y` of `graph.tanh`."""

    name = "graph.tanh_grad"


@irdl_op_definition
class SigmoidGradOp(_UnaryGrad):
    """`dy * y * (1 - y)` at the result `y` of `graph.sigmoid`."""

    name = "graph.sigmoid_grad"


@irdl_op_definition
class BinaryCrossEntropyOp(_Binary):
    """Elementwise binary cross-entropy of logits `z` (lhs) against labels `y` in [0, 1] (rhs):
    `max(z, 0) - z y + log(1 + exp(-|z|))`, which is `-(y log s + (1 - y) log(1 - s))` for
    `s = sigmoid(z)` without overflow or lost precision (torch's `binary_cross_entropy_with_logits`)."""

    name = "graph.binary_cross_entropy"


@irdl_op_definition
class BinaryCrossEntropyGradOp(_TensorOp):
    """`(sigmoid(z) - y) * dy`: the gradient of `graph.binary_cross_entropy` with respect to `z`."""

    name = "graph.binary_cross_entropy_grad"
    logits = operand_def(TensorType)
    labels = operand_def(TensorType)
    dy = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, logits: SSAValue, labels: SSAValue, dy: SSAValue):
        super().__init__(operands=[logits, labels, dy], result_types=[logits.type])

    def verify_(self) -> None:
        _same_shape(self, self.logits, self.labels, self.result)
        _same_shape(self, self.dy, self.result)


@irdl_op_definition
class SiluGradOp(_UnaryGrad):
    """`dy * s * (1 + x (1 - s))`, `s = sigmoid(x)`: the gradient of `graph.silu` at `x`."""

    name = "graph.silu_grad"


@irdl_op_definition
class GeluGradOp(_UnaryGrad):
    """The gradient of `graph.gelu` (same `approximate`) at `x`, times `dy`."""

    name = "graph.gelu_grad"
    approximate = prop_def(StringAttr)

    def __init__(self, at: SSAValue, dy: SSAValue, approximate: str):
        super().__init__(at, dy, approximate=StringAttr(approximate))


@irdl_op_definition
class PowGradOp(_UnaryGrad):
    """`dy * exponent * x ** (exponent - 1)`: the gradient of `graph.pow` at `x`."""

    name = "graph.pow_grad"
    exponent = prop_def(FloatAttr)

    def __init__(self, at: SSAValue, dy: SSAValue, exponent: float):
        super().__init__(at, dy, exponent=float_attr(exponent))


# ----------------------------------------------------------------------------- normalisation


@irdl_op_definition
class SoftmaxOp(_Unary):
    """`exp(x - max) / sum(exp(x - max))` along `dim`."""

    name = "graph.softmax"
    dim = prop_def(IntegerAttr[I64])

    def __init__(self, input: SSAValue, dim: int):
        super().__init__(input, dim=int_attr(dim))

    def verify_(self) -> None:
        _same_shape(self, self.input, self.result)
        _float(self, self.input)
        _dim(self, self.dim, len(tensor_shape(self.input)))


@irdl_op_definition
class SoftmaxGradOp(_UnaryGrad):
    """`y * (dy - sum(dy * y, dim))`: the gradient of `graph.softmax` given its result `y`."""

    name = "graph.softmax_grad"
    dim = prop_def(IntegerAttr[I64])

    def __init__(self, y: SSAValue, dy: SSAValue, dim: int):
        super().__init__(y, dy, dim=int_attr(dim))

    def verify_(self) -> None:
        super().verify_()
        _dim(self, self.dim, len(tensor_shape(self.lhs)))


@irdl_op_definition
class LayerNormOp(_TensorOp):
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
        _same_shape(self, self.x, self.result)
        _same_element_type(self, self.x, self.weight, self.bias, self.result)
        _float(self, self.x)


@irdl_op_definition
class LayerNormGradOp(_TensorOp):
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
        _same_shape(self, self.x, self.dx)
        _same_shape(self, self.weight, self.dweight, self.dbias)


@irdl_op_definition
class RmsNormOp(_TensorOp):
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
        _same_shape(self, self.x, self.result)
        _same_element_type(self, self.x, self.weight, self.result)
        _float(self, self.x)


@irdl_op_definition
class RmsNormGradOp(_TensorOp):
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
        _same_shape(self, self.x, self.dx)
        _same_shape(self, self.weight, self.dweight)


# ----------------------------------------------------------------------------- indexing


@irdl_op_definition
class EmbeddingOp(_TensorOp):
    """Row lookup `table[ids]`: table [V, D], integer ids [...] -> [..., D]."""

    name = "graph.embedding"
    table = operand_def(TensorType)
    ids = operand_def(TensorType)
    result = result_def(TensorType)
    global_type = opt_prop_def(TypeAttribute)
    traits = traits_def(Pure())
    #: a vocabulary-split table gives a partial result (each rank looks up the rows it owns,
    #: zeros elsewhere): the kernel finds its rows' offset from the result's annotated layout
    RECORDS_GLOBAL_TYPE: ClassVar[bool] = True

    def __init__(self, table: SSAValue, ids: SSAValue, result_type: Attribute):
        super().__init__(operands=[table, ids], result_types=[result_type])

    def verify_(self) -> None:
        t, i, r = tensor_shape(self.table), tensor_shape(self.ids), tensor_shape(self.result)
        if len(t) != 2 or r != (*i, t[1]):
            raise VerifyException(f"'{self.name}' needs table [V, D] and ids [...] giving [..., D], "
                                  f"got {list(t)}, {list(i)} -> {list(r)}")
        _integer(self, self.ids, "ids")
        _same_element_type(self, self.table, self.result)


@irdl_op_definition
class EmbeddingGradOp(_TensorOp):
    """Scatter-add `out[ids[...]] += dy[...]` into zeros [V, D] (V from the result type)."""

    name = "graph.embedding_grad"
    ids = operand_def(TensorType)
    dy = operand_def(TensorType)
    result = result_def(TensorType)
    global_type = opt_prop_def(TypeAttribute)
    traits = traits_def(Pure())
    #: a result split along V holds the rows of one vocabulary range: the kernel scatters only
    #: the ids in that range, at the offset the result's annotated layout gives
    RECORDS_GLOBAL_TYPE: ClassVar[bool] = True

    def __init__(self, ids: SSAValue, dy: SSAValue, result_type: Attribute):
        super().__init__(operands=[ids, dy], result_types=[result_type])

    def verify_(self) -> None:
        i, g, r = tensor_shape(self.ids), tensor_shape(self.dy), tensor_shape(self.result)
        if len(r) != 2 or g != (*i, r[1]):
            raise VerifyException(f"'{self.name}' needs ids [...] and dy [..., D] giving [V, D], "
                                  f"got {list(i)}, {list(g)} -> {list(r)}")
        _integer(self, self.ids, "ids")
        _same_element_type(self, self.dy, self.result)


@irdl_op_definition
class CausalMaskOp(_Unary):
    """Scores [..., Tq, Tk]: entries with key index j > query index i become `value` (-inf in
    the forward pass, so that softmax gives them 0; 0.0 for the gradient)."""

    name = "graph.causal_mask"
    value = prop_def(FloatAttr)

    def __init__(self, input: SSAValue, value: float = float("-inf")):
        super().__init__(input, value=float_attr(value))

    def verify_(self) -> None:
        _same_shape(self, self.input, self.result)
        _float(self, self.input)
        if len(tensor_shape(self.input)) < 2:
            raise VerifyException(f"'{self.name}' needs scores [..., Tq, Tk]")


@irdl_op_definition
class SliceOp(_Unary):
    """`x[..., start:start + n, ...]` along `dim`, n the result's size there."""

    name = "graph.slice"
    dim = prop_def(IntegerAttr[I64])
    start = prop_def(IntegerAttr[I64])

    def __init__(self, input: SSAValue, dim: int, start: int, result_type: Attribute):
        super().__init__(input, result_type, dim=int_attr(dim), start=int_attr(start))

    def verify_(self) -> None:
        src, dst = tensor_shape(self.input), tensor_shape(self.result)
        d = _dim(self, self.dim, len(src))
        start = self.start.value.data
        same_rest = len(src) == len(dst) and all(a == b for i, (a, b) in enumerate(zip(src, dst)) if i != d)
        if not same_rest or start < 0 or start + dst[d] > src[d]:
            raise VerifyException(f"'{self.name}' cannot take {list(dst)} at {start} along dim {d} of {list(src)}")
        _same_element_type(self, self.input, self.result)


@irdl_op_definition
class SplitOp(_TensorOp):
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
        d = _dim(self, self.dim, len(src))
        shapes = [tensor_shape(r) for r in self.outputs]
        ok = bool(shapes) and all(len(s) == len(src) and all(a == b for i, (a, b) in enumerate(zip(s, src)) if i != d)
                                  for s in shapes)
        if not ok or sum(s[d] for s in shapes) != src[d]:
            raise VerifyException(f"'{self.name}' of {list(src)} along dim {d} cannot give {[list(s) for s in shapes]}")
        _same_element_type(self, self.input, *self.outputs)


@irdl_op_definition
class ConcatOp(_TensorOp):
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
        d = _dim(self, self.dim, len(dst))
        shapes = [tensor_shape(x) for x in self.inputs]
        ok = bool(shapes) and all(len(s) == len(dst) and all(a == b for i, (a, b) in enumerate(zip(s, dst)) if i != d)
                                  for s in shapes)
        if not ok or sum(s[d] for s in shapes) != dst[d]:
            raise VerifyException(f"'{self.name}' cannot join {[list(s) for s in shapes]} along dim {d} into {list(dst)}")
        _same_element_type(self, *self.inputs, self.result)


# ----------------------------------------------------------------------------- reductions


@irdl_op_definition
class ReduceMaxOp(_Reduce):
    """Maximum over `dims` (removed from the shape)."""

    name = "graph.reduce_max"


@irdl_op_definition
class ReduceMaxGradOp(_TensorOp):
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
        _same_shape(self, self.x, self.result)


# ----------------------------------------------------------------------------- losses


@irdl_op_definition
class SoftmaxCrossEntropyOp(_TensorOp):
    """Per-sample loss `logsumexp(logits[s]) - logits[s, labels[s]]`: [..., C], [...] -> [...].

    With `ignore_index`, samples whose label equals it get loss 0."""

    name = "graph.softmax_cross_entropy"
    logits = operand_def(TensorType)
    labels = operand_def(TensorType)
    result = result_def(TensorType)
    ignore_index = opt_prop_def(IntegerAttr[I64])
    traits = traits_def(Pure())

    def __init__(self, logits: SSAValue, labels: SSAValue, result_type: Attribute, ignore_index: int | None = None):
        props = {} if ignore_index is None else {"ignore_index": int_attr(ignore_index)}
        super().__init__(operands=[logits, labels], result_types=[result_type], properties=props)

    def verify_(self) -> None:
        lg, lb, r = tensor_shape(self.logits), tensor_shape(self.labels), tensor_shape(self.result)
        if len(lg) < 1 or lb != lg[:-1] or r != lg[:-1]:
            raise VerifyException(f"'{self.name}' needs logits [..., C] and labels [...], got {list(lg)} and {list(lb)}")
        _integer(self, self.labels, "labels")


@irdl_op_definition
class SoftmaxCrossEntropyGradOp(_TensorOp):
    """`(softmax(logits) - onehot(labels)) * dloss[..., None]`: the gradient w.r.t. the logits
    (0 for samples whose label is `ignore_index`)."""

    name = "graph.softmax_cross_entropy_grad"
    logits = operand_def(TensorType)
    labels = operand_def(TensorType)
    dloss = operand_def(TensorType)
    result = result_def(TensorType)
    ignore_index = opt_prop_def(IntegerAttr[I64])
    traits = traits_def(Pure())

    def __init__(self, logits: SSAValue, labels: SSAValue, dloss: SSAValue, ignore_index: int | None = None):
        props = {} if ignore_index is None else {"ignore_index": int_attr(ignore_index)}
        super().__init__(operands=[logits, labels, dloss], result_types=[logits.type], properties=props)

    def verify_(self) -> None:
        lg, lb, d = tensor_shape(self.logits), tensor_shape(self.labels), tensor_shape(self.dloss)
        if len(lg) < 1 or lb != lg[:-1] or d != lg[:-1] or tensor_shape(self.result) != lg:
            raise VerifyException(f"'{self.name}' needs logits [..., C], labels [...], dloss [...]")


@irdl_op_definition
class OneHotOp(_TensorOp):
    """`1.0` where the last index equals the integer label, else `0.0`: labels [...] -> [..., C].

    The classes of a piece are its global indices along the last dim: a result split along C
    (a vocabulary-parallel loss) holds ones only for the labels in its range. `global_type`
    (set at the physical level) gives the kernel that range."""

    name = "graph.one_hot"
    labels = operand_def(TensorType)
    result = result_def(TensorType)
    global_type = opt_prop_def(TypeAttribute)
    traits = traits_def(Pure())
    RECORDS_GLOBAL_TYPE: ClassVar[bool] = True

    def __init__(self, labels: SSAValue, result_type: Attribute):
        super().__init__(operands=[labels], result_types=[result_type])

    def verify_(self) -> None:
        lb, r = tensor_shape(self.labels), tensor_shape(self.result)
        if len(r) != len(lb) + 1 or r[:-1] != lb:
            raise VerifyException(f"'{self.name}' needs labels [...] giving [..., C], got {list(lb)} -> {list(r)}")
        _integer(self, self.labels, "labels")
        _float(self, self.result)


@irdl_op_definition
class LabelMaskOp(_Unary):
    """1.0 where the integer `labels` differ from `ignore_index`, else 0.0 (a float result)."""

    name = "graph.label_mask"
    ignore_index = prop_def(IntegerAttr[I64])

    def __init__(self, labels: SSAValue, ignore_index: int, result_type: Attribute):
        super().__init__(labels, result_type, ignore_index=int_attr(ignore_index))

    def verify_(self) -> None:
        _same_shape(self, self.input, self.result)
        _integer(self, self.input, "labels")
        _float(self, self.result)


# ----------------------------------------------------------------------------- positions, randomness


class _Rope(_Unary):
    base = prop_def(FloatAttr)

    def __init__(self, input: SSAValue, base: float = 10000.0):
        super().__init__(input, base=float_attr(base))

    def verify_(self) -> None:
        _same_shape(self, self.input, self.result)
        _float(self, self.input)
        shape = tensor_shape(self.input)
        if len(shape) < 3 or shape[-1] % 2:
            raise VerifyException(f"'{self.name}' needs x [..., T, H, Dh] with Dh even, got {list(shape)}")


@irdl_op_definition
class RopeOp(_Rope):
    """Rotary position embedding of x [..., T, H, Dh] (HuggingFace LLaMA `rotate_half` form):
    `x * cos + rotate_half(x) * sin`, angles `t * base ** (-2i / Dh)` for position t (dim -3)
    and `i < Dh / 2`, repeated for both halves of Dh."""

    name = "graph.rope"


@irdl_op_definition
class RopeGradOp(_Rope):
    """The transposed rotation of `graph.rope` (same base): `dy * cos - rotate_half(dy) * sin`."""

    name = "graph.rope_grad"


@irdl_op_definition
class DropoutOp(_TensorOp):
    """`x * keep / (1 - rate)`: `keep` is a counter-based random mask, a pure function of
    (`seed`, `salt`, the scalar integer `step`, the element's index in the global tensor), so it
    does not depend on how the tensor is sharded. `salt` tells dropouts of one step apart.
    `global_type` is set at the physical level (the annotated type of the result: global shape
    and layout), where the kernel finds its piece's global offset from it. In a pipeline
    stage's forward or backward, `microbatches` m and `microbatch_dim` d say that `global_type`
    is one micro-batch: the whole tensor has m of them along dim d, and the runtime tells the
    kernel which one it runs (so the masks are those of one device). Beside other device groups
    (a union layout) the op keeps the stage-shaped step's layout over virtual devices instead,
    with `microbatch_ranks` and `stage_ranks` as on `comm.exchange`: the rank at stage position
    q draws micro-batch i's mask as virtual device `microbatch_ranks[i * len(stage_ranks) + q]`."""

    name = "graph.dropout"
    input = operand_def(TensorType)
    step = operand_def(TensorType)
    result = result_def(TensorType)
    rate = prop_def(FloatAttr)
    seed = prop_def(IntegerAttr[I64])
    salt = prop_def(IntegerAttr[I64])
    global_type = opt_prop_def(TypeAttribute)
    microbatches = opt_prop_def(IntegerAttr[I64])
    microbatch_dim = opt_prop_def(IntegerAttr[I64])
    microbatch_ranks = opt_prop_def(DenseArrayBase)
    stage_ranks = opt_prop_def(DenseArrayBase)
    traits = traits_def(Pure())
    #: specialize-groups records the annotated result type in `global_type`
    RECORDS_GLOBAL_TYPE: ClassVar[bool] = True

    def __init__(self, input: SSAValue, step: SSAValue, rate: float, seed: int, salt: int):
        super().__init__(
            operands=[input, step],
            result_types=[input.type],
            properties={"rate": float_attr(rate), "seed": int_attr(seed), "salt": int_attr(salt)},
        )

    def verify_(self) -> None:
        _same_shape(self, self.input, self.result)
        _float(self, self.input)
        if tensor_shape(self.step) != ():
            raise VerifyException(f"'{self.name}' needs a scalar integer step")
        _integer(self, self.step, "step")
        if not 0.0 <= self.rate.value.data < 1.0:
            raise VerifyException(f"'{self.name}' rate must be in [0, 1), got {self.rate.value.data}")


# ----------------------------------------------------------------------------- mixture of experts


@irdl_op_definition
class ExpertMatmulOp(_Matmul):
    """Each expert's tokens times its own weight: [E, m, k] x [E, k, n] -> [E, m, n].

    The product of a batched `graph.matmul` over the expert dim E; a separate op because it
    is laid out otherwise: the operand split along E (the expert weight, under expert
    parallelism) keeps its place and the tokens are moved to it (an all-to-all), where a
    batched matmul would gather the weight instead."""

    name = "graph.expert_matmul"

    def verify_(self) -> None:
        super().verify_()
        a, b = tensor_shape(self.lhs), tensor_shape(self.rhs)
        if len(a) != 3 or len(b) != 3:
            raise VerifyException(f"'{self.name}' needs [E, m, k] x [E, k, n], got {list(a)} x {list(b)}")


@irdl_op_definition
class ExpertMatmulRhsGradOp(_TensorOp):
    """`lhs[e]^T @ dy[e]` per expert: [E, m, k], [E, m, n] -> [E, k, n], the gradient of an expert
    weight (its own op, rather than a matmul of a transpose, so that the backward uses the
    tokens the forward moved to the experts as they are, with no second all-to-all)."""

    name = "graph.expert_matmul_rhs_grad"
    lhs = operand_def(TensorType)
    dy = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, lhs: SSAValue, dy: SSAValue, result_type: Attribute):
        super().__init__(operands=[lhs, dy], result_types=[result_type])

    def verify_(self) -> None:
        a, g, r = tensor_shape(self.lhs), tensor_shape(self.dy), tensor_shape(self.result)
        if len(a) != 3 or len(g) != 3 or a[:2] != g[:2] or r != (a[0], a[2], g[2]):
            raise VerifyException(f"'{self.name}' needs lhs [E, m, k] and dy [E, m, n] giving [E, k, n], "
                                  f"got {list(a)}, {list(g)} -> {list(r)}")
        _same_element_type(self, self.lhs, self.dy, self.result)


@irdl_op_definition
class MoeRouteOp(_Unary):
    """Top-k routing with capacity: router probabilities [G, S, E] -> dispatch mask [G, S, E, C].

    Within each routing group g (a sequence), every token s picks its `top_k` most probable
    experts (ties: the lower expert index). Choices are placed in order of rank (all first
    choices of the group, then all second ones, as GShard does) and, within a rank, in token
    order: a choice takes the next free slot c of its expert's C slots, or is dropped when they
    are full. `mask[g, s, e, c]` is 1.0 where token s sits in slot c of expert e. The mask
    depends only on the group's own probabilities, so a batch split over devices drops the
    same tokens as one device. It has no gradient (`STOPS_GRADIENT`)."""

    name = "graph.moe_route"
    top_k = prop_def(IntegerAttr[I64])
    STOPS_GRADIENT: ClassVar[bool] = True

    def __init__(self, probs: SSAValue, top_k: int, result_type: Attribute):
        super().__init__(probs, result_type, top_k=int_attr(top_k))

    def verify_(self) -> None:
        p, r = tensor_shape(self.input), tensor_shape(self.result)
        if len(p) != 3 or len(r) != 4 or r[:3] != p:
            raise VerifyException(f"'{self.name}' needs probabilities [G, S, E] giving [G, S, E, C], "
                                  f"got {list(p)} -> {list(r)}")
        if not 1 <= self.top_k.value.data <= p[2]:
            raise VerifyException(f"'{self.name}' top_k={self.top_k.value.data} is not in 1..{p[2]} experts")
        _float(self, self.input, self.result)
        _same_element_type(self, self.input, self.result)


def _moe_shapes(op: Operation, tokens: SSAValue, experts: SSAValue, weights: SSAValue) -> None:
    """Check tokens [G, S, D], expert slots [E, G, C, D] and slot weights [G, S, E, C] agree."""
    t, x, w = tensor_shape(tokens), tensor_shape(experts), tensor_shape(weights)
    ok = len(t) == 3 and len(x) == 4 and len(w) == 4
    ok = ok and w[:2] == t[:2] and x == (w[2], t[0], w[3], t[2])
    if not ok:
        raise VerifyException(f"'{op.name}' needs tokens [G, S, D], expert slots [E, G, C, D] and weights "
                              f"[G, S, E, C], got {list(t)}, {list(x)}, {list(w)}")
    _same_element_type(op, tokens, experts, weights)


@irdl_op_definition
class MoeDispatchOp(_TensorOp):
    """Tokens into expert slots: `out[e, g, c] = sum_s mask[g, s, e, c] * x[g, s]`,
    x [G, S, D], mask [G, S, E, C] -> [E, G, C, D]."""

    name = "graph.moe_dispatch"
    x = operand_def(TensorType)
    mask = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, mask: SSAValue, result_type: Attribute):
        super().__init__(operands=[x, mask], result_types=[result_type])

    def verify_(self) -> None:
        _moe_shapes(self, self.x, self.result, self.mask)


@irdl_op_definition
class MoeCombineOp(_TensorOp):
    """Expert slots back to tokens: `out[g, s] = sum_{e, c} weights[g, s, e, c] * y[e, g, c]`,
    y [E, G, C, D], weights [G, S, E, C] -> [G, S, D] (the transpose of `graph.moe_dispatch`)."""

    name = "graph.moe_combine"
    y = operand_def(TensorType)
    weights = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, y: SSAValue, weights: SSAValue, result_type: Attribute):
        super().__init__(operands=[y, weights], result_types=[result_type])

    def verify_(self) -> None:
        _moe_shapes(self, self.result, self.y, self.weights)


@irdl_op_definition
class MoeWeightsGradOp(_TensorOp):
    """`out[g, s, e, c] = sum_d t[g, s, d] * y[e, g, c, d]`: t [G, S, D], y [E, G, C, D] ->
    [G, S, E, C], the gradient of the slot weights of `graph.moe_combine` (t the incoming
    gradient) and of the mask of `graph.moe_dispatch` (t the tokens, y the incoming gradient)."""

    name = "graph.moe_weights_grad"
    t = operand_def(TensorType)
    y = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, t: SSAValue, y: SSAValue, result_type: Attribute):
        super().__init__(operands=[t, y], result_types=[result_type])

    def verify_(self) -> None:
        _moe_shapes(self, self.t, self.y, self.result)


# ----------------------------------------------------------------------------- repeated layers


def _slice_type(typ: Attribute) -> TensorType:
    """Return tensor type `typ` without its leading dim (one iteration's piece of a stacked value)."""
    assert isinstance(typ, TensorType)
    return TensorType(typ.element_type, typ.get_shape()[1:], typ.encoding)


def stacked_type(typ: Attribute, length: int, encoding: Attribute | None = None) -> TensorType:
    """Return tensor type `typ` with a leading dim of `length` (`length` iterations' pieces stacked);
    `encoding` replaces the type's (a layout with the stacking dim), None keeps none."""
    assert isinstance(typ, TensorType)
    return tensor_type(typ.element_type, (length, *typ.get_shape()), encoding)


@irdl_op_definition
class ScanOp(IRDLOperation):
    """Call `@callee` `length` times in a row (a stack of repeated layers), like `jax.lax.scan`.

    Each argument j of the callee is fed, per iteration i, by operand j:
    * `stacked` j: the operand has a leading dim of `length`; iteration i gets its slice i
      (a stacked parameter `blocks.[0:48].attn.proj.weight`, a stacked residual);
    * `carry_args[k]` j: iteration 0 gets the operand, iteration i > 0 the result
      `carry_results[k]` of iteration i-1 (the residual stream of a transformer);
    * otherwise the operand itself, every iteration (an invariant).
    The results are the callee's: a carried result is its value after the last iteration; any
    other result is stacked, iteration i's value as slice i. With `reverse`, the iterations run
    from `length`-1 down to 0 (the backward of a forward scan), each still reading and writing
    its own slice i.

        %x, %res = graph.scan @Block_0_fwd(%w, %x0) {length = 48 : i64, stacked = array<i64: 0>,
            carry_args = array<i64: 1>, carry_results = array<i64: 0>}
            : (tensor<48x128x128xf32>, tensor<16x64x128xf32>) -> (tensor<16x64x128xf32>, tensor<48x...>)

    The program holds one copy of the layer however many layers there are: IR size and compile
    time do not grow with the layer count (`stack-layers` makes scans, `docs/levels.md`).
    """

    name = "graph.scan"
    irdl_options = (ParsePropInAttrDict(),)
    args = var_operand_def(TensorType)
    outs = var_result_def(TensorType)
    callee = prop_def(SymbolRefAttr)
    length = prop_def(IntegerAttr[I64])
    stacked = prop_def(DenseArrayBase)
    carry_args = prop_def(DenseArrayBase)
    carry_results = prop_def(DenseArrayBase)
    reverse = opt_prop_def(UnitAttr)
    assembly_format = "$callee `(` $args `)` attr-dict `:` functional-type($args, $outs)"

    def __init__(self, callee: str, args: Sequence[SSAValue], result_types: Sequence[Attribute], *, length: int,
                 stacked: Sequence[int], carry_args: Sequence[int], carry_results: Sequence[int],
                 reverse: bool = False):
        props: dict[str, Attribute] = {
            "callee": SymbolRefAttr(callee), "length": int_attr(length), "stacked": i64_array(sorted(stacked)),
            "carry_args": i64_array(carry_args), "carry_results": i64_array(carry_results),
        }
        if reverse:
            props["reverse"] = UnitAttr()
        super().__init__(operands=[list(args)], result_types=[list(result_types)], properties=props)

    @property
    def num_iterations(self) -> int:
        """Return the number of iterations (`length`)."""
        return self.length.value.data

    @property
    def is_reverse(self) -> bool:
        """Return whether the iterations run from the last to the first."""
        return self.reverse is not None

    def stacked_args(self) -> tuple[int, ...]:
        """Return the indices of the stacked operands."""
        return tuple(self.stacked.get_values())  # type: ignore[arg-type]

    def carries(self) -> tuple[tuple[int, int], ...]:
        """Return (argument index, result index) of every carried value."""
        return tuple(zip(self.carry_args.get_values(), self.carry_results.get_values()))  # type: ignore[arg-type]

    def arg_kind(self, j: int) -> str:
        """Return how operand `j` feeds the callee: "stacked", "carry" or "invariant"."""
        if j in self.stacked_args():
            return "stacked"
        return "carry" if j in self.carry_args.get_values() else "invariant"

    def result_stacked(self, r: int) -> bool:
        """Return whether result `r` is stacked (not a carried value)."""
        return r not in self.carry_results.get_values()

    def callee_arg_types(self) -> list[TensorType]:
        """Return the type each callee argument gets per iteration (from the operands)."""
        stacked = self.stacked_args()
        return [_slice_type(v.type) if j in stacked else v.type for j, v in enumerate(self.args)]  # type: ignore

    def callee_result_types(self) -> list[TensorType]:
        """Return the type each callee result has per iteration (from the results)."""
        return [_slice_type(r.type) if self.result_stacked(k) else r.type for k, r in enumerate(self.outs)]  # type: ignore

    def verify_(self) -> None:
        n = self.num_iterations
        if n < 1:
            raise VerifyException(f"'{self.name}' needs length >= 1, has {n}")
        carry_args, carry_results = self.carry_args.get_values(), self.carry_results.get_values()
        if len(carry_args) != len(carry_results) or len(set(carry_args)) != len(carry_args) or len(
                set(carry_results)) != len(carry_results):
            raise VerifyException(f"'{self.name}' needs carry_args and carry_results of one length, each without repeats")
        stacked = self.stacked_args()
        if set(stacked) & set(carry_args):
            raise VerifyException(f"'{self.name}': an operand cannot be both stacked and carried")
        for j in (*stacked, *carry_args):
            if not 0 <= j < len(self.args):
                raise VerifyException(f"'{self.name}': operand index {j} out of range ({len(self.args)} operands)")
        for k in carry_results:
            if not 0 <= k < len(self.outs):
                raise VerifyException(f"'{self.name}': result index {k} out of range ({len(self.outs)} results)")
        for j in stacked:
            shape = tensor_shape(self.args[j])
            if not shape or shape[0] != n:
                raise VerifyException(f"'{self.name}': stacked operand {j} of type {self.args[j].type} needs a "
                                      f"leading dim of {n}")
        for k, r in enumerate(self.outs):
            shape = tensor_shape(r)
            if self.result_stacked(k) and (not shape or shape[0] != n):
                raise VerifyException(f"'{self.name}': stacked result {k} of type {r.type} needs a leading dim of {n}")
        for j, k in self.carries():
            a, b = self.args[j].type, self.outs[k].type
            if tensor_shape(a) != tensor_shape(b) or a.element_type != b.element_type:  # type: ignore[attr-defined]
                raise VerifyException(f"'{self.name}': carried operand {j} ({a}) and result {k} ({b}) differ")
        self._verify_callee()

    def _verify_callee(self) -> None:
        from xdsl.dialects import func
        from xdsl.dialects.builtin import ModuleOp

        module = self.parent_op()
        while module is not None and not isinstance(module, ModuleOp):
            module = module.parent_op()
        if module is None:
            return
        name = self.callee.root_reference.data
        fn = next((op for op in module.body.block.ops if isinstance(op, func.FuncOp) and op.sym_name.data == name),
                  None)
        if fn is None:
            raise VerifyException(f"'{self.name}': the module has no @{name}")

        def same(xs, ys) -> bool:  # shapes and element types (layouts differ by the stacking dim)
            return len(xs) == len(ys) and all(tensor_shape(x) == tensor_shape(y) and x.element_type == y.element_type
                                              for x, y in zip(xs, ys))

        if not same(self.callee_arg_types(), list(fn.function_type.inputs.data)):
            raise VerifyException(f"'{self.name}': its operands do not fit the arguments of @{name} "
                                  "(a stacked operand: the argument's type with a leading dim of the length)")
        if not same(self.callee_result_types(), list(fn.function_type.outputs.data)):
            raise VerifyException(f"'{self.name}': its results do not fit the results of @{name} "
                                  "(a stacked result: the callee's with a leading dim of the length)")


FLOAT_TYPES = (Float32Type, Float64Type)

Graph = Dialect(
    "graph",
    [
        ParameterOp,
        InputOp,
        ConstantOp,
        IotaOp,
        OutputOp,
        AssignOp,
        AddOp,
        SubOp,
        MulOp,
        DivOp,
        ReluOp,
        ReluGradOp,
        ScaleOp,
        MatmulOp,
        MatmulRhsGradOp,
        TransposeOp,
        ReshapeOp,
        BroadcastOp,
        ReduceSumOp,
        ReduceMaxOp,
        ReduceMaxGradOp,
        ExpOp,
        LogOp,
        SqrtOp,
        RsqrtOp,
        TanhOp,
        TanhGradOp,
        SigmoidOp,
        SigmoidGradOp,
        BinaryCrossEntropyOp,
        BinaryCrossEntropyGradOp,
        SiluOp,
        SiluGradOp,
        GeluOp,
        GeluGradOp,
        PowOp,
        PowGradOp,
        CastOp,
        SoftmaxOp,
        SoftmaxGradOp,
        LayerNormOp,
        LayerNormGradOp,
        RmsNormOp,
        RmsNormGradOp,
        EmbeddingOp,
        EmbeddingGradOp,
        CausalMaskOp,
        SliceOp,
        SplitOp,
        ConcatOp,
        SoftmaxCrossEntropyOp,
        SoftmaxCrossEntropyGradOp,
        OneHotOp,
        LabelMaskOp,
        RopeOp,
        RopeGradOp,
        DropoutOp,
        ExpertMatmulOp,
        ExpertMatmulRhsGradOp,
        MoeRouteOp,
        MoeDispatchOp,
        MoeCombineOp,
        MoeWeightsGradOp,
        ScanOp,
    ],
    [],
)
