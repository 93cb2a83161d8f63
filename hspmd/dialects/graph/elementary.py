"""Elementary functions and comparisons: sin, cos, ... (each with its derivative), abs, floor and
the other piecewise-constant ones, maximum and minimum, atan2, comparisons, and select (`where`).

hspmd has no boolean tensors: a comparison gives a float tensor of 0.0 and 1.0, which
`graph.select` reads as its condition (nonzero: true) and which the arithmetic ops combine
(`and` is a product, `not` is `1 - c`). Piecewise-constant functions (the comparisons, sign,
floor, ceil, round, trunc) carry no gradient (`STOPS_GRADIENT`), as in PyTorch.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
from xdsl.dialects.builtin import StringAttr, TensorType
from xdsl.ir import Attribute, SSAValue
from xdsl.irdl import irdl_op_definition, operand_def, prop_def, result_def, traits_def
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.cuda_c import KernelCode, c_type, flat_kernel, put
from hspmd.dialects.graph.activations import ExpOp
from hspmd.dialects.graph.arithmetic import AddOp, DivOp, MulOp, PowOp, ScaleOp, SubOp
from hspmd.dialects.graph.base import (
    BinaryOp,
    ElementwiseOp,
    TensorOp,
    check_float,
    check_same_element_type,
    check_same_shape,
)
from hspmd.dialects.graph.leaves import ConstantOp
from hspmd.dialects.interfaces import ANY, Kernel, KernelContext, OutFacts
from hspmd.dialects.op_rule import OpRule, elementwise_rule
from hspmd.dialects.traced import as_tensor, fail, float_unary

__all__ = [
    "SinOp", "CosOp", "TanOp", "AsinOp", "AcosOp", "AtanOp", "SinhOp", "CoshOp", "AsinhOp", "AcoshOp",
    "AtanhOp", "AbsOp", "Log1pOp", "Expm1Op", "Log2Op", "Log10Op",
    "SignOp", "FloorOp", "CeilOp", "RoundOp", "TruncOp",
    "MaximumOp", "MinimumOp", "Atan2Op", "CompareOp", "SelectOp",
]


class _Elementary(ElementwiseOp):
    """A float elementwise function: one NumPy ufunc, one C function (`hs_<C>` of
    `codegen/hs_common.cuh`), and its derivative `derivative(emit)` as a value (the gradient is
    the incoming gradient times it)."""

    OUT_FACTS: ClassVar[OutFacts] = ANY
    UFUNC: ClassVar[np.ufunc]
    C: ClassVar[str]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return self.UFUNC

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], f"hs_{self.C}({a[0]})")

    def derivative(self, emit) -> SSAValue:
        raise NotImplementedError

    def vjp(self, gs, emit):
        return [lambda: emit(MulOp(gs[0], self.derivative(emit)))]


def _const(emit, like: SSAValue, value: float) -> SSAValue:
    return emit(ConstantOp(value, like.type))


def _square(emit, x: SSAValue) -> SSAValue:
    return emit(MulOp(x, x))


@irdl_op_definition
class SinOp(_Elementary):
    """Elementwise `sin(x)`."""

    name = "graph.sin"
    UFUNC: ClassVar[np.ufunc] = np.sin
    C: ClassVar[str] = "sin"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.sin.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("sin",)

    def derivative(self, emit):
        return emit(CosOp(self.input))


@irdl_op_definition
class CosOp(_Elementary):
    """Elementwise `cos(x)`."""

    name = "graph.cos"
    UFUNC: ClassVar[np.ufunc] = np.cos
    C: ClassVar[str] = "cos"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.cos.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("cos",)

    def derivative(self, emit):
        return emit(ScaleOp(emit(SinOp(self.input)), -1.0))


@irdl_op_definition
class TanOp(_Elementary):
    """Elementwise `tan(x)`."""

    name = "graph.tan"
    UFUNC: ClassVar[np.ufunc] = np.tan
    C: ClassVar[str] = "tan"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.tan.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("tan",)

    def derivative(self, emit):  # 1 + tan^2
        return emit(AddOp(_square(emit, self.result), _const(emit, self.result, 1.0)))


@irdl_op_definition
class AsinOp(_Elementary):
    """Elementwise `asin(x)`."""

    name = "graph.asin"
    UFUNC: ClassVar[np.ufunc] = np.arcsin
    C: ClassVar[str] = "asin"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.asin.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("asin",)

    def derivative(self, emit):  # (1 - x^2)^-1/2
        return emit(PowOp(emit(SubOp(_const(emit, self.input, 1.0), _square(emit, self.input))), -0.5))


@irdl_op_definition
class AcosOp(_Elementary):
    """Elementwise `acos(x)`."""

    name = "graph.acos"
    UFUNC: ClassVar[np.ufunc] = np.arccos
    C: ClassVar[str] = "acos"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.acos.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("acos",)

    def derivative(self, emit):  # -(1 - x^2)^-1/2
        one_minus = emit(SubOp(_const(emit, self.input, 1.0), _square(emit, self.input)))
        return emit(ScaleOp(emit(PowOp(one_minus, -0.5)), -1.0))


@irdl_op_definition
class AtanOp(_Elementary):
    """Elementwise `atan(x)`."""

    name = "graph.atan"
    UFUNC: ClassVar[np.ufunc] = np.arctan
    C: ClassVar[str] = "atan"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.atan.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("atan",)

    def derivative(self, emit):  # 1 / (1 + x^2)
        return emit(PowOp(emit(AddOp(_square(emit, self.input), _const(emit, self.input, 1.0))), -1.0))


@irdl_op_definition
class SinhOp(_Elementary):
    """Elementwise `sinh(x)`."""

    name = "graph.sinh"
    UFUNC: ClassVar[np.ufunc] = np.sinh
    C: ClassVar[str] = "sinh"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.sinh.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("sinh",)

    def derivative(self, emit):
        return emit(CoshOp(self.input))


@irdl_op_definition
class CoshOp(_Elementary):
    """Elementwise `cosh(x)`."""

    name = "graph.cosh"
    UFUNC: ClassVar[np.ufunc] = np.cosh
    C: ClassVar[str] = "cosh"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.cosh.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("cosh",)

    def derivative(self, emit):
        return emit(SinhOp(self.input))


@irdl_op_definition
class AsinhOp(_Elementary):
    """Elementwise `asinh(x)`."""

    name = "graph.asinh"
    UFUNC: ClassVar[np.ufunc] = np.arcsinh
    C: ClassVar[str] = "asinh"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.asinh.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("asinh",)

    def derivative(self, emit):  # (x^2 + 1)^-1/2
        return emit(PowOp(emit(AddOp(_square(emit, self.input), _const(emit, self.input, 1.0))), -0.5))


@irdl_op_definition
class AcoshOp(_Elementary):
    """Elementwise `acosh(x)`."""

    name = "graph.acosh"
    UFUNC: ClassVar[np.ufunc] = np.arccosh
    C: ClassVar[str] = "acosh"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.acosh.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("acosh",)

    def derivative(self, emit):  # (x^2 - 1)^-1/2
        return emit(PowOp(emit(SubOp(_square(emit, self.input), _const(emit, self.input, 1.0))), -0.5))


@irdl_op_definition
class AtanhOp(_Elementary):
    """Elementwise `atanh(x)`."""

    name = "graph.atanh"
    UFUNC: ClassVar[np.ufunc] = np.arctanh
    C: ClassVar[str] = "atanh"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.atanh.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("atanh",)

    def derivative(self, emit):  # 1 / (1 - x^2)
        return emit(PowOp(emit(SubOp(_const(emit, self.input, 1.0), _square(emit, self.input))), -1.0))


@irdl_op_definition
class AbsOp(_Elementary):
    """Elementwise `|x|` (its gradient at 0 is 0, as PyTorch's)."""

    name = "graph.abs"
    UFUNC: ClassVar[np.ufunc] = np.abs
    C: ClassVar[str] = "abs"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.abs.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("abs",)

    def derivative(self, emit):
        return emit(SignOp(self.input))


@irdl_op_definition
class Log1pOp(_Elementary):
    """Elementwise `log(1 + x)`, exact for small x."""

    name = "graph.log1p"
    UFUNC: ClassVar[np.ufunc] = np.log1p
    C: ClassVar[str] = "log1p"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.log1p.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("log1p",)

    def derivative(self, emit):
        return emit(PowOp(emit(AddOp(self.input, _const(emit, self.input, 1.0))), -1.0))


@irdl_op_definition
class Expm1Op(_Elementary):
    """Elementwise `exp(x) - 1`, exact for small x."""

    name = "graph.expm1"
    UFUNC: ClassVar[np.ufunc] = np.expm1
    C: ClassVar[str] = "expm1"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.expm1.default", "aten.elu.default")
    FRONTEND: ClassVar[tuple[str, ...]] = ("expm1",)

    def derivative(self, emit):
        return emit(ExpOp(self.input))


@irdl_op_definition
class Log2Op(_Elementary):
    """Elementwise base-2 logarithm."""

    name = "graph.log2"
    UFUNC: ClassVar[np.ufunc] = np.log2
    C: ClassVar[str] = "log2"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.log2.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("log2",)

    def derivative(self, emit):
        return emit(ScaleOp(emit(PowOp(self.input, -1.0)), 1.0 / math.log(2.0)))


@irdl_op_definition
class Log10Op(_Elementary):
    """Elementwise base-10 logarithm."""

    name = "graph.log10"
    UFUNC: ClassVar[np.ufunc] = np.log10
    C: ClassVar[str] = "log10"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.log10.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("log10",)

    def derivative(self, emit):
        return emit(ScaleOp(emit(PowOp(self.input, -1.0)), 1.0 / math.log(10.0)))


class _Piecewise(_Elementary):
    """A piecewise-constant function: no gradient (PyTorch's is zero)."""

    STOPS_GRADIENT: ClassVar[bool] = True

    def vjp(self, gs, emit):
        return [None]


@irdl_op_definition
class SignOp(_Piecewise):
    """Elementwise sign: -1, 0 or 1."""

    name = "graph.sign"
    UFUNC: ClassVar[np.ufunc] = np.sign
    C: ClassVar[str] = "sign"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.sign.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("sign",)

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], f"({a[0]} > ({t})0) ? ({t})1 : (({a[0]} < ({t})0) ? ({t})-1 : {a[0]})")


@irdl_op_definition
class FloorOp(_Piecewise):
    """Elementwise floor."""

    name = "graph.floor"
    UFUNC: ClassVar[np.ufunc] = np.floor
    C: ClassVar[str] = "floor"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.floor.default", "aten.remainder.Tensor", "aten.remainder.Scalar")
    FRONTEND: ClassVar[tuple[str, ...]] = ("floor",)


@irdl_op_definition
class CeilOp(_Piecewise):
    """Elementwise ceiling."""

    name = "graph.ceil"
    UFUNC: ClassVar[np.ufunc] = np.ceil
    C: ClassVar[str] = "ceil"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.ceil.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("ceil",)


@irdl_op_definition
class RoundOp(_Piecewise):
    """Elementwise rounding to the nearest integer, halves to even (as PyTorch and NumPy)."""

    name = "graph.round"
    UFUNC: ClassVar[np.ufunc] = np.rint
    C: ClassVar[str] = "rint"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.round.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("round",)


@irdl_op_definition
class TruncOp(_Piecewise):
    """Elementwise rounding toward zero."""

    name = "graph.trunc"
    UFUNC: ClassVar[np.ufunc] = np.trunc
    C: ClassVar[str] = "trunc"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.trunc.default", "aten.fmod.Tensor", "aten.fmod.Scalar")
    FRONTEND: ClassVar[tuple[str, ...]] = ("trunc",)


# ----------------------------------------------------------------------------- two operands


class _FloatBinary(BinaryOp):
    OUT_FACTS: ClassVar[OutFacts] = ANY

    def verify_(self) -> None:
        super().verify_()
        check_float(self, self.lhs)

    def sharding_rule(self) -> OpRule:
        return elementwise_rule(self)


class _Extremum(_FloatBinary):
    """The larger (`PREDICATE` "gt") or smaller ("lt") of two, NaN winning; a tie sends half the
    gradient to each, as PyTorch does."""

    PREDICATE: ClassVar[str]

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        op = ">" if self.PREDICATE == "gt" else "<"
        put(stmts, t, out[0], f"({a[0]} {op} {a[1]} || {a[0]} != {a[0]}) ? {a[0]} : {a[1]}")

    def vjp(self, gs, emit):
        def share() -> SSAValue:  # 1 where lhs wins, 1/2 on ties
            wins = emit(CompareOp(self.lhs, self.rhs, self.PREDICATE, self.lhs.type))
            ties = emit(CompareOp(self.lhs, self.rhs, "eq", self.lhs.type))
            return emit(AddOp(wins, emit(ScaleOp(ties, 0.5))))

        made: list[SSAValue] = []

        def lhs() -> SSAValue:
            if not made:
                made.append(emit(MulOp(gs[0], share())))
            return made[0]

        return [lhs, lambda: emit(SubOp(gs[0], lhs()))]


@irdl_op_definition
class MaximumOp(_Extremum):
    """Elementwise larger of two (NaN wins); a tie sends half the gradient to each, as PyTorch."""

    name = "graph.maximum"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.maximum.default", "aten.clamp.default", "aten.clamp.Tensor",
                                       "aten.hardtanh.default")
    FRONTEND: ClassVar[tuple[str, ...]] = ("maximum",)
    PREDICATE: ClassVar[str] = "gt"

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return np.maximum


@irdl_op_definition
class MinimumOp(_Extremum):
    """Elementwise smaller of two (NaN wins); a tie sends half the gradient to each."""

    name = "graph.minimum"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.minimum.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("minimum",)
    PREDICATE: ClassVar[str] = "lt"

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return np.minimum


@irdl_op_definition
class Atan2Op(_FloatBinary):
    """Elementwise `atan2(y, x)` (lhs y, rhs x): the angle of the point (x, y)."""

    name = "graph.atan2"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.atan2.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("atan2",)

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return np.arctan2

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], f"hs_atan2({a[0]}, {a[1]})")

    def vjp(self, gs, emit):  # d/dy = x / r^2, d/dx = -y / r^2
        def over_r2(v: SSAValue) -> SSAValue:
            r2 = emit(AddOp(_square(emit, self.lhs), _square(emit, self.rhs)))
            return emit(DivOp(emit(MulOp(gs[0], v)), r2))

        return [lambda: over_r2(self.rhs), lambda: emit(ScaleOp(over_r2(self.lhs), -1.0))]


#: a comparison's predicate -> its NumPy ufunc and C operator
PREDICATES = {"eq": (np.equal, "=="), "ne": (np.not_equal, "!="), "lt": (np.less, "<"), "le": (np.less_equal, "<="),
              "gt": (np.greater, ">"), "ge": (np.greater_equal, ">=")}


@irdl_op_definition
class CompareOp(TensorOp):
    """`lhs PREDICATE rhs` elementwise, as 1.0 (true) and 0.0 (false) in the result's float type;
    the operands (of one shape and type) may be integers. No gradient."""

    name = "graph.compare"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.eq.Tensor", "aten.eq.Scalar", "aten.ne.Tensor", "aten.ne.Scalar",
                                       "aten.lt.Tensor", "aten.lt.Scalar", "aten.le.Tensor", "aten.le.Scalar",
                                       "aten.gt.Tensor", "aten.gt.Scalar", "aten.ge.Tensor", "aten.ge.Scalar",
                                       "aten.isnan.default", "aten.isinf.default")
    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    predicate = prop_def(StringAttr)
    traits = traits_def(Pure())
    STOPS_GRADIENT: ClassVar[bool] = True
    FRONTEND: ClassVar[tuple[str, ...]] = ("compare",)

    def __init__(self, lhs: SSAValue, rhs: SSAValue, predicate: str, result_type: Attribute):
        super().__init__(operands=[lhs, rhs], result_types=[result_type],
                         properties={"predicate": StringAttr(predicate)})

    def verify_(self) -> None:
        check_same_shape(self, self.lhs, self.rhs, self.result)
        check_same_element_type(self, self.lhs, self.rhs)
        check_float(self, self.result)
        if self.predicate.data not in PREDICATES:
            raise VerifyException(f"'{self.name}' predicate must be one of {sorted(PREDICATES)}")

    def sharding_rule(self) -> OpRule:
        return elementwise_rule(self)

    def vjp(self, gs, emit):
        return [None, None]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        ufunc, dtype = PREDICATES[self.predicate.data][0], self.result.type.element_type
        from hspmd.ir.types import dtype_name

        out = np.dtype(dtype_name(dtype))
        return lambda a, b: ufunc(a, b).astype(out)

    def cuda_kernel(self, name: str) -> KernelCode:
        op = PREDICATES[self.predicate.data][1]
        return flat_kernel(name, self, c_type(self.result.type), f"out0[i] = (in0[i] {op} in1[i]) ? (T)1 : (T)0;")


@irdl_op_definition
class SelectOp(TensorOp):
    """`where(cond, a, b)`: `a` where the float condition is nonzero, else `b` (exact, infinities
    included). The gradient goes to the operand picked; the condition has none."""

    name = "graph.select"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.where.self", "aten.masked_fill.Scalar", "aten.masked_fill.Tensor",
                                       "aten.logical_and.default", "aten.logical_or.default",
                                       "aten.logical_not.default", "aten.logical_xor.default",
                                       "aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor",
                                       "aten.bitwise_not.default", "aten.bitwise_xor.Tensor",
                                       "aten.leaky_relu.default", "aten.bitwise_and.Scalar",
                                       "aten.bitwise_or.Scalar", "aten.bitwise_xor.Scalar")
    cond = operand_def(TensorType)
    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    FRONTEND: ClassVar[tuple[str, ...]] = ("where",)

    def __init__(self, cond: SSAValue, lhs: SSAValue, rhs: SSAValue):
        super().__init__(operands=[cond, lhs, rhs], result_types=[lhs.type])

    def verify_(self) -> None:
        check_same_shape(self, self.cond, self.lhs, self.rhs, self.result)
        check_same_element_type(self, self.lhs, self.rhs, self.result)
        check_float(self, self.cond)

    def sharding_rule(self) -> OpRule:
        return elementwise_rule(self, frozenset({1, 2}))

    def vjp(self, gs, emit):
        zero = lambda: _const(emit, gs[0], 0.0)  # noqa: E731
        return [None, lambda: emit(SelectOp(self.cond, gs[0], zero())),
                lambda: emit(SelectOp(self.cond, zero(), gs[0]))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return lambda c, a, b: np.where(c != 0, a, b)

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], f"({a[0]} != ({t})0) ? {a[1]} : {a[2]}")


# ----------------------------------------------------------------------------- frontend


def _binary(cls, a, b, op: str):
    a, b = as_tensor(a, op), as_tensor(b, op)
    if a.dtype != b.dtype or a.shape != b.shape:
        shape = np.broadcast_shapes(a.shape, b.shape) if a.dtype == b.dtype else None
        if shape is None:
            raise fail(op, f"operands {list(a.shape)} {a.dtype} and {list(b.shape)} {b.dtype} differ in dtype")
        a, b = a.broadcast_to(shape), b.broadcast_to(shape)
    return a.tracer.emit(cls(a.value, b.value))


def maximum(a, b):
    """Return the elementwise larger of two tensors (broadcast)."""
    return _binary(MaximumOp, a, b, "maximum")


def minimum(a, b):
    """Return the elementwise smaller of two tensors (broadcast)."""
    return _binary(MinimumOp, a, b, "minimum")


def atan2(y, x):
    """Return `atan2(y, x)` elementwise."""
    return _binary(Atan2Op, y, x, "atan2")


def compare(a, b, predicate: str, dtype: str = "float32"):
    """Return `a PREDICATE b` ("eq", "ne", "lt", "le", "gt", "ge") as 1.0/0.0 of `dtype` (broadcast)."""
    from hspmd.ir.types import element_type

    a, b = as_tensor(a, "compare"), as_tensor(b, "compare")
    if predicate not in PREDICATES:
        raise fail("compare", f"predicate {predicate!r} is not one of {sorted(PREDICATES)}")
    if a.dtype != b.dtype:
        raise fail("compare", f"operands have dtypes {a.dtype} and {b.dtype}")
    shape = np.broadcast_shapes(a.shape, b.shape)
    a, b = a.broadcast_to(shape), b.broadcast_to(shape)
    return a.tracer.emit(CompareOp(a.value, b.value, predicate, TensorType(element_type(dtype), shape)))


def where(cond, a, b):
    """Return `a` where the float `cond` is nonzero, else `b` (broadcast)."""
    cond, a, b = as_tensor(cond, "where"), as_tensor(a, "where"), as_tensor(b, "where")
    if a.dtype != b.dtype:
        raise fail("where", f"operands have dtypes {a.dtype} and {b.dtype}")
    shape = np.broadcast_shapes(cond.shape, a.shape, b.shape)
    cond, a, b = (v.broadcast_to(shape) for v in (cond, a, b))
    return a.tracer.emit(SelectOp(cond.value, a.value, b.value))


def _unary(cls, op: str):
    def fn(x):
        return float_unary(cls, x, op)

    fn.__name__ = fn.__qualname__ = op
    fn.__doc__ = f"Return `{op}(x)` elementwise ({cls.__doc__.splitlines()[0]})"
    return fn


sin, cos, tan = _unary(SinOp, "sin"), _unary(CosOp, "cos"), _unary(TanOp, "tan")
asin, acos, atan = _unary(AsinOp, "asin"), _unary(AcosOp, "acos"), _unary(AtanOp, "atan")
sinh, cosh = _unary(SinhOp, "sinh"), _unary(CoshOp, "cosh")
asinh, acosh, atanh = _unary(AsinhOp, "asinh"), _unary(AcoshOp, "acosh"), _unary(AtanhOp, "atanh")
abs, log1p, expm1 = _unary(AbsOp, "abs"), _unary(Log1pOp, "log1p"), _unary(Expm1Op, "expm1")  # noqa: A001
log2, log10 = _unary(Log2Op, "log2"), _unary(Log10Op, "log10")
sign, floor, ceil = _unary(SignOp, "sign"), _unary(FloorOp, "floor"), _unary(CeilOp, "ceil")
round, trunc = _unary(RoundOp, "round"), _unary(TruncOp, "trunc")  # noqa: A001
