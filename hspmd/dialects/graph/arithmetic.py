"""Elementwise arithmetic: add, sub, mul, div, scale, cast and pow (with its gradient)."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from xdsl.dialects.builtin import Float64Type, FloatAttr, TensorType
from xdsl.ir import SSAValue
from xdsl.irdl import irdl_op_definition, prop_def

from hspmd.dialects.cuda_c import KernelCode, c_type, flat_kernel, lit, put
from hspmd.dialects.graph.base import (
    BinaryOp,
    ElementwiseOp,
    UnaryGradOp,
    UnaryOp,
    check_same_shape,
    float_attr,
    result_dtype,
    result_shape,
)
from hspmd.dialects.interfaces import ANY, FIRST, FRESH, Kernel, KernelContext, OutFacts, overwrites_first, rowwise
from hspmd.dialects.op_rule import OpRule, elementwise_rule, factors
from hspmd.dialects.traced import FLOAT_DTYPES, as_tensor, fail, require_float
from hspmd.ir.types import element_type

__all__ = [
    "AddOp",
    "SubOp",
    "MulOp",
    "DivOp",
    "ScaleOp",
    "CastOp",
    "PowOp",
    "PowGradOp",
]


class _Arithmetic(BinaryOp):
    """`lhs OP rhs` elementwise: a NumPy ufunc (`out` may be any operand) and one C operator."""

    OUT_FACTS: ClassVar[OutFacts] = ANY
    C_OPERATOR: ClassVar[str] = ""
    UFUNC: ClassVar[np.ufunc]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return self.UFUNC

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], f"{a[0]} {self.C_OPERATOR} {a[1]}")


@irdl_op_definition
class AddOp(_Arithmetic):
    """Elementwise `lhs + rhs` (same shapes; broadcast first with `graph.broadcast`)."""

    name = "graph.add"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.add.Tensor", "aten.add.Scalar",)
    C_OPERATOR: ClassVar[str] = "+"
    UFUNC: ClassVar[np.ufunc] = np.add
    FRONTEND: ClassVar[tuple[str, ...]] = ("Tensor.__add__",)

    def sharding_rule(self) -> OpRule:
        d = factors("d", len(result_shape(self)))
        return OpRule((d, d), (d,), frozenset({0, 1}), joint=True)

    def vjp(self, gs, emit):
        g = gs[0]
        return [lambda: g, lambda: g]


@irdl_op_definition
class SubOp(_Arithmetic):
    """Elementwise `lhs - rhs`."""

    name = "graph.sub"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.sub.Tensor", "aten.sub.Scalar", "aten.rsub.Scalar", "aten.rsub.Tensor",)
    C_OPERATOR: ClassVar[str] = "-"
    UFUNC: ClassVar[np.ufunc] = np.subtract
    FRONTEND: ClassVar[tuple[str, ...]] = ("Tensor.__sub__",)

    def sharding_rule(self) -> OpRule:
        d = factors("d", len(result_shape(self)))
        return OpRule((d, d), (d,), frozenset({0, 1}), joint=True)

    def vjp(self, gs, emit):
        g = gs[0]
        return [lambda: g, lambda: emit(ScaleOp(g, -1.0))]


@irdl_op_definition
class MulOp(_Arithmetic):
    """Elementwise `lhs * rhs`."""

    name = "graph.mul"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.mul.Tensor", "aten.mul.Scalar")
    C_OPERATOR: ClassVar[str] = "*"
    UFUNC: ClassVar[np.ufunc] = np.multiply
    FRONTEND: ClassVar[tuple[str, ...]] = ("Tensor.__mul__",)

    def sharding_rule(self) -> OpRule:
        d = factors("d", len(result_shape(self)))
        return OpRule((d, d), (d,), frozenset({0, 1}), joint=False)

    def vjp(self, gs, emit):
        g = gs[0]
        return [lambda: emit(MulOp(g, self.rhs)), lambda: emit(MulOp(g, self.lhs))]


@irdl_op_definition
class DivOp(_Arithmetic):
    """Elementwise `lhs / rhs` (same shapes)."""

    name = "graph.div"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.div.Tensor", "aten.div.Scalar", "aten.div.Tensor_mode",
                                       "aten.div.Scalar_mode")
    C_OPERATOR: ClassVar[str] = "/"
    UFUNC: ClassVar[np.ufunc] = np.divide
    FRONTEND: ClassVar[tuple[str, ...]] = ("divide",)

    def sharding_rule(self) -> OpRule:
        return elementwise_rule(self, frozenset({0}))  # linear in the numerator only

    def vjp(self, gs, emit):
        g = gs[0]
        return [
            lambda: emit(DivOp(g, self.rhs)),
            lambda: emit(ScaleOp(emit(DivOp(emit(MulOp(g, self.result)), self.rhs)), -1.0)),
        ]


@irdl_op_definition
class ScaleOp(UnaryOp):
    """Elementwise `x * factor` for a compile-time constant `factor`."""

    name = "graph.scale"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.neg.default",)
    factor = prop_def(FloatAttr)
    OUT_FACTS: ClassVar[OutFacts] = FIRST
    FRONTEND: ClassVar[tuple[str, ...]] = ("Tensor.__mul__",)

    def __init__(self, input: SSAValue, factor: float):
        super().__init__(input, factor=FloatAttr(float(factor), Float64Type()))

    def verify_(self) -> None:
        check_same_shape(self, self.input, self.result)

    def sharding_rule(self) -> OpRule:
        d = factors("d", len(result_shape(self)))
        return OpRule((d,), (d,), frozenset({0}))

    def vjp(self, gs, emit):
        return [lambda: emit(ScaleOp(gs[0], self.factor.value.data))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        factor = result_dtype(self).type(self.factor.value.data)
        return overwrites_first(rowwise(lambda x, out=None: np.multiply(x, factor, out=out)))

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], f"{a[0]} * {lit(float(self.factor.value.data), t)}")


@irdl_op_definition
class CastOp(UnaryOp):
    """Elementwise conversion to the result type's element type (same shape; a float becomes an
    integer rounded toward zero)."""

    name = "graph.cast"
    ATEN: ClassVar[tuple[str, ...]] = (
        "aten.to.dtype",
        "aten.to.dtype_layout",
        "aten._to_copy.default",
        "aten.type_as.default",
    )
    FRONTEND: ClassVar[tuple[str, ...]] = ("cast",)

    def verify_(self) -> None:  # between floats, and from and to integers (toward zero, as PyTorch)
        check_same_shape(self, self.input, self.result)

    def sharding_rule(self) -> OpRule:
        return elementwise_rule(self, frozenset({0}))

    def vjp(self, gs, emit):
        return [lambda: emit(CastOp(gs[0], self.input.type))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        dtype = result_dtype(self)
        return lambda x: x.astype(dtype)

    def cuda_kernel(self, name: str) -> KernelCode:
        return flat_kernel(name, self, c_type(self.result.type), "out0[i] = (T)in0[i];")


def _pow(exponent: float) -> Kernel:
    if exponent == 2.0:
        return lambda x: x * x
    if exponent == 1.0:
        return lambda x: x.copy()
    if exponent == 0.5:
        return np.sqrt
    if exponent == int(exponent):
        p = int(exponent)
        return lambda x: np.power(x, p) if p >= 0 else np.power(x, float(p))
    return lambda x: np.power(x, exponent)


def _pow_expr(x: str, p: float, t: str) -> str:
    if p == 2.0:
        return f"({x} * {x})"
    if p == 1.0:
        return x
    if p == 0.5:
        return f"hs_sqrt({x})"
    return f"hs_pow({x}, {lit(p, t)})"


@irdl_op_definition
class PowOp(ElementwiseOp):
    """Elementwise `x ** exponent` for a compile-time constant exponent."""

    name = "graph.pow"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.pow.Tensor_Scalar", "aten.reciprocal.default")
    exponent = prop_def(FloatAttr)
    FRONTEND: ClassVar[tuple[str, ...]] = ("power",)

    def __init__(self, input: SSAValue, exponent: float):
        super().__init__(input, exponent=float_attr(exponent))

    def vjp(self, gs, emit):
        return [lambda: emit(PowGradOp(self.input, gs[0], self.exponent.value.data))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return _pow(self.exponent.value.data)

    def out_facts(self) -> OutFacts:
        return ANY if self.exponent.value.data == 0.5 else FRESH  # x ** 0.5 is np.sqrt

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], _pow_expr(a[0], float(self.exponent.value.data), t))


@irdl_op_definition
class PowGradOp(UnaryGradOp):
    """`dy * exponent * x ** (exponent - 1)`: the gradient of `graph.pow` at `x`."""

    name = "graph.pow_grad"
    exponent = prop_def(FloatAttr)

    def __init__(self, at: SSAValue, dy: SSAValue, exponent: float):
        super().__init__(at, dy, exponent=float_attr(exponent))

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        exponent = self.exponent.value.data
        if exponent == 0.0:
            return lambda x, dy: np.zeros_like(dy)
        if exponent == 1.0:
            return lambda x, dy: dy.copy()
        lower = _pow(exponent - 1.0)
        return lambda x, dy: (dy * (lower(x) * x.dtype.type(exponent))).astype(dy.dtype, copy=False)

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        p = float(self.exponent.value.data)
        if p == 0.0:
            put(stmts, t, out[0], f"({t})0 * {a[1]}")
        elif p == 1.0:
            put(stmts, t, out[0], a[1])
        else:
            put(stmts, t, out[0], f"{a[1]} * ({_pow_expr(a[0], p - 1.0, t)} * {lit(p, t)})")


# ----------------------------------------------------------------------------- frontend


def power(x, exponent: float):
    """Return `x ** exponent` for a Python number `exponent` (also `x ** p`)."""
    if isinstance(exponent, bool) or not isinstance(exponent, (int, float)):
        raise fail("pow", f"the exponent must be a Python number, got {type(exponent).__name__}")
    x = as_tensor(x, "pow")
    if exponent == 1:
        return x
    require_float(x, "pow")
    return x.tracer.emit(PowOp(x.value, float(exponent)))


def divide(a, b):
    """Return `a / b` elementwise with NumPy broadcasting (also `a / b` on tensors)."""
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        return as_tensor(a, "div") * (1.0 / b)
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return as_tensor(b, "div").broadcast_binary(a, DivOp, "div", swap=True)
    return as_tensor(a, "div").broadcast_binary(as_tensor(b, "div"), DivOp, "div")


def cast(x, dtype: str):
    """Return x converted to `dtype` (float16, bfloat16, float32 or float64)."""
    x = as_tensor(x, "cast")
    if dtype not in FLOAT_DTYPES:
        raise fail("cast", f"dtype must be one of {', '.join(FLOAT_DTYPES)}, got {dtype!r}")
    require_float(x, "cast")
    if x.dtype == dtype:
        return x
    try:
        elt = element_type(dtype)
    except TypeError as err:
        raise fail("cast", str(err)) from None
    return x.tracer.emit(CastOp(x.value, TensorType(elt, x.shape)))
