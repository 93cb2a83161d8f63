"""Elementwise functions and activations with their gradients: relu, exp, log, sqrt, rsqrt,
tanh, sigmoid, silu, gelu, erf."""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import numpy as np
from xdsl.dialects.builtin import StringAttr
from xdsl.ir import SSAValue
from xdsl.irdl import irdl_op_definition, prop_def
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.cuda_c import lit, put
from hspmd.dialects.graph.arithmetic import DivOp, MulOp, PowOp, ScaleOp
from hspmd.dialects.graph.base import BinaryOp, ElementwiseOp, UnaryGradOp, UnaryOp, check_same_shape, result_shape
from hspmd.dialects.interfaces import ANY, FIRST, OUT, Kernel, KernelContext, OutFacts, overwrites_first, rowwise
from hspmd.dialects.op_rule import OpRule, factors
from hspmd.dialects.traced import as_tensor, fail, float_unary

__all__ = [
    "ReluOp",
    "ReluGradOp",
    "ExpOp",
    "LogOp",
    "SqrtOp",
    "RsqrtOp",
    "TanhOp",
    "TanhGradOp",
    "SigmoidOp",
    "SigmoidGradOp",
    "SiluOp",
    "SiluGradOp",
    "GELU_APPROXIMATIONS",
    "GeluOp",
    "GeluGradOp",
    "ErfOp",
]



class _UfuncOp(ElementwiseOp):
    """A float elementwise op that is one NumPy ufunc (`out` may be its operand) and one C call."""

    OUT_FACTS: ClassVar[OutFacts] = ANY
    UFUNC: ClassVar[np.ufunc]
    C_FUNCTION: ClassVar[str]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return self.UFUNC

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], f"{self.C_FUNCTION}({a[0]})")


@irdl_op_definition
class ReluOp(UnaryOp):
    """Elementwise `max(x, 0)`."""

    name = "graph.relu"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.relu.default",)
    OUT_FACTS: ClassVar[OutFacts] = FIRST
    FRONTEND: ClassVar[tuple[str, ...]] = ("relu",)

    def verify_(self) -> None:
        check_same_shape(self, self.input, self.result)

    def sharding_rule(self) -> OpRule:
        d = factors("d", len(result_shape(self)))
        return OpRule((d,), (d,))

    def vjp(self, gs, emit):
        return [lambda: emit(ReluGradOp(self.input, gs[0]))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return overwrites_first(rowwise(lambda x, out=None: np.maximum(x, x.dtype.type(0), out=out)))

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], f"({a[0]} > ({t})0 || {a[0]} != {a[0]}) ? {a[0]} : ({t})0")


@irdl_op_definition
class ReluGradOp(BinaryOp):
    """`rhs * (lhs > 0)`: the gradient of relu at `lhs` applied to the incoming gradient `rhs`."""

    name = "graph.relu_grad"
    NO_VJP: ClassVar[str] = "a gradient op (no second derivatives)"

    def sharding_rule(self) -> OpRule:
        d = factors("d", len(result_shape(self)))
        return OpRule((d, d), (d,), frozenset({1}))

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return lambda x, dy: np.where(x > 0, dy, 0).astype(dy.dtype)

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], f"{a[0]} > ({t})0 ? {a[1]} : ({t})0")


@irdl_op_definition
class ExpOp(_UfuncOp):
    """Elementwise `exp(x)`."""

    name = "graph.exp"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.exp.default", "aten.pow.Tensor_Tensor", "aten.pow.Scalar")
    UFUNC: ClassVar[np.ufunc] = np.exp
    C_FUNCTION: ClassVar[str] = "hs_exp"
    FRONTEND: ClassVar[tuple[str, ...]] = ("exp",)

    def vjp(self, gs, emit):
        return [lambda: emit(MulOp(gs[0], self.result))]


@irdl_op_definition
class LogOp(_UfuncOp):
    """Elementwise natural `log(x)`."""

    name = "graph.log"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.log.default", "aten.log_softmax.int", "aten._log_softmax.default",)
    UFUNC: ClassVar[np.ufunc] = np.log
    C_FUNCTION: ClassVar[str] = "hs_log"
    FRONTEND: ClassVar[tuple[str, ...]] = ("log",)

    def vjp(self, gs, emit):
        return [lambda: emit(DivOp(gs[0], self.input))]


@irdl_op_definition
class SqrtOp(_UfuncOp):
    """Elementwise `sqrt(x)`."""

    name = "graph.sqrt"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.sqrt.default",)
    UFUNC: ClassVar[np.ufunc] = np.sqrt
    C_FUNCTION: ClassVar[str] = "hs_sqrt"
    FRONTEND: ClassVar[tuple[str, ...]] = ("sqrt",)

    def vjp(self, gs, emit):
        return [lambda: emit(ScaleOp(emit(DivOp(gs[0], self.result)), 0.5))]


@irdl_op_definition
class RsqrtOp(ElementwiseOp):
    """Elementwise `1 / sqrt(x)`."""

    name = "graph.rsqrt"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.rsqrt.default",)
    OUT_FACTS: ClassVar[OutFacts] = FIRST
    FRONTEND: ClassVar[tuple[str, ...]] = ("rsqrt",)

    def vjp(self, gs, emit):  # d/dx x^-1/2 = -1/2 y^3
        return [lambda: emit(ScaleOp(emit(MulOp(gs[0], emit(PowOp(self.result, 3.0)))), -0.5))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        @overwrites_first
        @rowwise
        def rsqrt(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
            out = np.sqrt(x, out=out)
            return np.divide(1, out, out=out)

        return rsqrt

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], f"({t})1 / hs_sqrt({a[0]})")


@irdl_op_definition
class TanhOp(_UfuncOp):
    """Elementwise `tanh(x)`."""

    name = "graph.tanh"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.tanh.default",)
    UFUNC: ClassVar[np.ufunc] = np.tanh
    C_FUNCTION: ClassVar[str] = "hs_tanh"
    FRONTEND: ClassVar[tuple[str, ...]] = ("tanh",)

    def vjp(self, gs, emit):
        return [lambda: emit(TanhGradOp(self.result, gs[0]))]


@irdl_op_definition
class TanhGradOp(UnaryGradOp):
    """`dy * (1 - y^2)` at the result `y` of `graph.tanh`."""

    name = "graph.tanh_grad"
    OUT_FACTS: ClassVar[OutFacts] = FIRST

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        @overwrites_first
        @rowwise
        def tanh_grad(y: np.ndarray, dy: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
            out = np.multiply(y, y, out=out)
            np.subtract(1, out, out=out)
            return np.multiply(dy, out, out=out)

        return tanh_grad

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], f"{a[1]} * ({lit(1.0, t)} - {a[0]} * {a[0]})")


def sigmoid_values(x: np.ndarray) -> np.ndarray:
    """Return `1 / (1 + exp(-x))` (exp of -|x| only: no overflow warnings for large |x|)."""
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


@irdl_op_definition
class SigmoidOp(ElementwiseOp):
    """Elementwise `1 / (1 + exp(-x))`."""

    name = "graph.sigmoid"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.sigmoid.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("sigmoid",)

    def vjp(self, gs, emit):
        return [lambda: emit(SigmoidGradOp(self.result, gs[0]))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return sigmoid_values

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], f"hs_sigmoid({a[0]})")


@irdl_op_definition
class SigmoidGradOp(UnaryGradOp):
    """`dy * y * (1 - y)` at the result `y` of `graph.sigmoid`."""

    name = "graph.sigmoid_grad"

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return lambda y, dy: dy * (y * (1 - y))

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], f"{a[1]} * ({a[0]} * ({lit(1.0, t)} - {a[0]}))")


@irdl_op_definition
class SiluOp(ElementwiseOp):
    """Elementwise `x * sigmoid(x)` (SiLU, swish)."""

    name = "graph.silu"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.silu.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("silu",)

    def vjp(self, gs, emit):
        return [lambda: emit(SiluGradOp(self.input, gs[0]))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return lambda x: x * sigmoid_values(x)

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], f"{a[0]} * hs_sigmoid({a[0]})")


@irdl_op_definition
class SiluGradOp(UnaryGradOp):
    """`dy * s * (1 + x (1 - s))`, `s = sigmoid(x)`: the gradient of `graph.silu` at `x`."""

    name = "graph.silu_grad"

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        def silu_grad(x: np.ndarray, dy: np.ndarray) -> np.ndarray:
            s = sigmoid_values(x)
            return dy * (s * (1 + x * (1 - s)))

        return silu_grad

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        one, r = lit(1.0, t), out[0]
        stmts.append(f"const {t} {r}_s = hs_sigmoid({a[0]});")
        put(stmts, t, r, f"{a[1]} * ({r}_s * ({one} + {a[0]} * ({one} - {r}_s)))")


# ----------------------------------------------------------------------------- erf and gelu


def erf_series(x: np.ndarray) -> np.ndarray:
    """erf for float64 arrays without SciPy, to about 1e-15 absolute.

    |x| < 3: `2/sqrt(pi) exp(-x^2) sum_n 2^n x^(2n+1) / (1*3*...*(2n+1))` (all terms positive,
    no cancellation; 80 terms suffice); |x| >= 3: `1 - erfc` with erfc's continued fraction
    `exp(-x^2)/sqrt(pi) / (x + 1/2 / (x + 1 / (x + 3/2 / (x + ...))))` (60 levels).
    """
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    small = np.minimum(a, 3.0)
    term = small.copy()
    total = small.copy()
    x2 = small * small
    for n in range(1, 80):
        term = term * (2 * x2) / (2 * n + 1)
        total += term
    series = 2 / math.sqrt(math.pi) * np.exp(-x2) * total
    big = np.maximum(a, 3.0)
    frac = big.copy()
    for k in range(60, 0, -1):
        frac = big + (k / 2) / frac
    tail = 1 - np.exp(-big * big) / math.sqrt(math.pi) / frac
    return np.sign(x) * np.where(a < 3.0, series, tail)


@functools.cache
def _scipy_erf():
    """Return SciPy's erf (faster and exact; SciPy is optional), None without SciPy. Imported on
    first use: `scipy.special` takes a third of a second to import, and most processes (every
    command line, every rank) never compute an erf."""
    try:
        from scipy.special import erf
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    return erf


def erf_values(x: np.ndarray) -> np.ndarray:
    """Elementwise error function (SciPy's where installed, else `erf_series`), in x's dtype."""
    erf = _scipy_erf()
    if erf is not None:
        return erf(x).astype(x.dtype, copy=False)
    return erf_series(x).astype(x.dtype, copy=False)


@irdl_op_definition
class ErfOp(ElementwiseOp):
    """Elementwise error function `erf(x) = 2/sqrt(pi) * integral_0^x exp(-t^2) dt`."""

    name = "graph.erf"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.erf.default",)
    FRONTEND: ClassVar[tuple[str, ...]] = ("erf",)

    def vjp(self, gs, emit):  # d/dx erf(x) = 2/sqrt(pi) exp(-x^2)
        density = lambda: emit(ExpOp(emit(ScaleOp(emit(MulOp(self.input, self.input)), -1.0))))  # noqa: E731
        return [lambda: emit(ScaleOp(emit(MulOp(gs[0], density())), 2.0 / math.sqrt(math.pi)))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return erf_values

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], f"hs_erf({a[0]})")


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715
GELU_APPROXIMATIONS = ("none", "tanh")


def _tanh_inner(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Fill `out` with `tanh(sqrt(2/pi) * (x + 0.044715 x^3))` (the tanh GELU's t), in place."""
    np.multiply(x, x, out=out)
    out *= x
    out *= _GELU_C
    out += x
    out *= _SQRT_2_OVER_PI
    return np.tanh(out, out=out)


def gelu_values(x: np.ndarray, approximate: str, out: np.ndarray | None = None) -> np.ndarray:
    """GELU: exact `x Phi(x)` (approximate="none") or the tanh form (approximate="tanh").

    The tanh form runs in place in `out`, one pass per operation and no temporaries.
    """
    if approximate == "tanh":
        out = _tanh_inner(x, np.empty_like(x) if out is None else out)
        out += 1
        out *= x
        out *= 0.5
        return out
    y = 0.5 * x * (1 + erf_values(x / math.sqrt(2.0)))
    if out is None:
        return y
    np.copyto(out, y)
    return out


def gelu_grad_values(x: np.ndarray, dy: np.ndarray, approximate: str, out: np.ndarray | None = None) -> np.ndarray:
    """`dy * gelu'(x)`; the tanh form with two temporaries, the rest in place in `out`."""
    if approximate == "tanh":
        t = _tanh_inner(x, np.empty_like(dy) if out is None else out)
        b = np.multiply(t, t)  # b = 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 c x^2)
        np.subtract(1, b, out=b)
        h = np.multiply(x, 0.5)
        b *= h
        b *= _SQRT_2_OVER_PI
        np.multiply(x, 3 * _GELU_C, out=h)
        h *= x
        h += 1
        b *= h
        t += 1  # 0.5 (1 + t) + b
        t *= 0.5
        t += b
        t *= dy
        return t
    cdf = 0.5 * (1 + erf_values(x / math.sqrt(2.0)))
    d = cdf + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    y = (dy * d).astype(dy.dtype, copy=False)
    if out is None:
        return y
    np.copyto(out, y)
    return out


@irdl_op_definition
class GeluOp(ElementwiseOp):
    """Elementwise GELU: `x * Phi(x)` (`approximate = "none"`, with erf) or the tanh form
    `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` (`approximate = "tanh"`, GPT-2)."""

    name = "graph.gelu"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.gelu.default",)
    approximate = prop_def(StringAttr)
    OUT_FACTS: ClassVar[OutFacts] = OUT
    FRONTEND: ClassVar[tuple[str, ...]] = ("gelu",)

    def __init__(self, input: SSAValue, approximate: str = "none"):
        super().__init__(input, approximate=StringAttr(approximate))

    def verify_(self) -> None:
        super().verify_()
        if self.approximate.data not in GELU_APPROXIMATIONS:
            raise VerifyException(f"'{self.name}' approximate must be one of {GELU_APPROXIMATIONS}")

    def vjp(self, gs, emit):
        return [lambda: emit(GeluGradOp(self.input, gs[0], self.approximate.data))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        approximate = self.approximate.data
        return rowwise(lambda x, out=None: gelu_values(x, approximate, out))

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        x, one = a[0], lit(1.0, t)
        if self.approximate.data == "tanh":
            # 0.5 x (1 + tanh(y)) = x / (1 + exp(-2y)): one exp, no cancellation for x < 0
            y = f"{lit(_SQRT_2_OVER_PI, t)} * ({x} + {lit(_GELU_C, t)} * ({x} * {x} * {x}))"
            put(stmts, t, out[0], f"{x} / ({one} + hs_exp({lit(-2.0, t)} * ({y})))")
        else:
            put(stmts, t, out[0], f"{lit(0.5, t)} * {x} * ({one} + hs_erf({x} / {lit(math.sqrt(2.0), t)}))")


@irdl_op_definition
class GeluGradOp(UnaryGradOp):
    """The gradient of `graph.gelu` (same `approximate`) at `x`, times `dy`."""

    name = "graph.gelu_grad"
    approximate = prop_def(StringAttr)
    OUT_FACTS: ClassVar[OutFacts] = OUT

    def __init__(self, at: SSAValue, dy: SSAValue, approximate: str):
        super().__init__(at, dy, approximate=StringAttr(approximate))

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        approximate = self.approximate.data
        return rowwise(lambda x, dy, out=None: gelu_grad_values(x, dy, approximate, out))

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        (x, dy), r, one = a, out[0], lit(1.0, t)
        if self.approximate.data == "tanh":
            # with s = sigmoid(2y) (so tanh(y) = 2s - 1): gelu' = s + 2 x s (1 - s) c (1 + 3 k x^2)
            y = f"{lit(_SQRT_2_OVER_PI, t)} * ({x} + {lit(_GELU_C, t)} * ({x} * {x} * {x}))"
            stmts.append(f"const {t} {r}_s = {one} / ({one} + hs_exp({lit(-2.0, t)} * ({y})));")
            stmts.append(
                f"const {t} {r}_d = {r}_s + {lit(2.0, t)} * {x} * {r}_s * ({one} - {r}_s)"
                f" * {lit(_SQRT_2_OVER_PI, t)} * ({one} + {lit(3 * _GELU_C, t)} * {x} * {x});"
            )
        else:
            stmts.append(f"const {t} {r}_c = {lit(0.5, t)} * ({one} + hs_erf({x} / {lit(math.sqrt(2.0), t)}));")
            stmts.append(
                f"const {t} {r}_d = {r}_c + {x} * hs_exp({lit(-0.5, t)} * {x} * {x}) / {lit(math.sqrt(2 * math.pi), t)};"
            )
        put(stmts, t, r, f"{dy} * {r}_d")


# ----------------------------------------------------------------------------- frontend


def relu(x):
    """Return `max(x, 0)` elementwise."""
    x = as_tensor(x, "relu")
    return x.tracer.emit(ReluOp(x.value))


def exp(x):
    """Return `exp(x)` elementwise."""
    return float_unary(ExpOp, x, "exp")


def log(x):
    """Return the natural `log(x)` elementwise."""
    return float_unary(LogOp, x, "log")


def sqrt(x):
    """Return `sqrt(x)` elementwise."""
    return float_unary(SqrtOp, x, "sqrt")


def rsqrt(x):
    """Return `1 / sqrt(x)` elementwise."""
    return float_unary(RsqrtOp, x, "rsqrt")


def tanh(x):
    """Return `tanh(x)` elementwise."""
    return float_unary(TanhOp, x, "tanh")


def sigmoid(x):
    """Return `1 / (1 + exp(-x))` elementwise."""
    return float_unary(SigmoidOp, x, "sigmoid")


def silu(x):
    """Return `x * sigmoid(x)` elementwise (SiLU / swish)."""
    return float_unary(SiluOp, x, "silu")


def gelu(x, approximate: str = "none"):
    """Return GELU of x: exact (`approximate="none"`, with erf) or the tanh form (`"tanh"`)."""
    if approximate not in GELU_APPROXIMATIONS:
        raise fail("gelu", f"approximate must be one of {', '.join(GELU_APPROXIMATIONS)}, got {approximate!r}")
    return float_unary(GeluOp, x, "gelu", approximate=approximate)


def erf(x):
    """Return the error function of x elementwise (`torch.erf`, `scipy.special.erf`)."""
    return float_unary(ErfOp, x, "erf")
