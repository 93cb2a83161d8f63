"""ATen's elementwise functions, comparisons and logic as hspmd ops (the importer's `aten.py` has
the linear algebra, views, norms, attention and the loss).

A boolean tensor of the exported graph (a comparison, a mask computed from the batch) is, in the
program, a float32 tensor of 0.0 and 1.0: `graph.compare` makes it, `graph.select` reads it as a
condition (`where`, `masked_fill`), and logic is arithmetic on it (`and` a product, `or` a
maximum, `not` `1 - x`). The importer casts a translated value to the dtype PyTorch gives the
node where they differ (`coerce`), so a boolean summed or cast to an integer is PyTorch's integer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from hspmd.dialects import graph
from hspmd.dialects.graph import elementary as el
from hspmd.dialects.graph.activations import exp, log, sqrt
from hspmd.dialects.graph.arithmetic import divide, power
from hspmd.dialects.graph.positions import dropout
from hspmd.dialects.graph.reductions import max as reduce_max
from hspmd.frontend.aten import Context, Unsupported, cast_to
from hspmd.frontend.tracing import Tensor
from hspmd.ir.types import element_type

BOOL = "float32"  # the dtype a boolean tensor of the exported graph has in the program


def is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def coerce(x, torch_dtype) -> object:
    """Return translated tensor `x` in the dtype PyTorch gives its node (`torch_dtype`): a boolean
    is a float 0/1 tensor (`BOOL`), a float or integer of PyTorch's dtype otherwise."""
    if not isinstance(x, Tensor) or torch_dtype is None:
        return x
    want = str(torch_dtype).replace("torch.", "")
    if want == "bool":
        x = x if is_float(x.dtype) else cast_to(x, BOOL)
        x.boolean = True  # PyTorch's value is a boolean: a mask of 0/1, not numbers to add (`is_boolean`)
        return x
    if want not in ("float16", "bfloat16", "float32", "float64", "int32", "int64"):
        return x
    return cast_to(x, want)


def is_boolean(x) -> bool:
    """Return whether translated tensor `x` stands for a boolean tensor of PyTorch's (0.0/1.0)."""
    return bool(getattr(x, "boolean", False))


def operand(cx: Context, x, dtype: str, shape) -> Tensor:
    """Return `x` (a tensor, a concrete tensor or a number) as a tensor of `dtype` broadcast to `shape`."""
    if isinstance(x, Tensor):
        return cast_to(x, dtype).broadcast_to(shape)
    if isinstance(x, (bool, int, float)):
        return x_const(cx, float(x), dtype, shape)
    return cx.lift(x, dtype).broadcast_to(shape)


def x_const(cx: Context, value: float, dtype: str, shape) -> Tensor:
    return cx.tracer.constant(value, tuple(shape), dtype)


def _common(*xs) -> str:
    """Return the dtype PyTorch's type promotion gives operands `xs` (tensors, concrete tensors,
    numbers): the widest float among the tensors, else float32 if a float number, else int64."""
    dtypes = [x.dtype if isinstance(x, Tensor) else str(x.dtype).replace("torch.", "") for x in xs
              if isinstance(x, Tensor) or hasattr(x, "dtype")]
    floats = [d for d in dtypes if is_float(d)]
    if floats:
        return max(floats, key=lambda d: ("float16", "bfloat16", "float32", "float64").index(d))
    if any(isinstance(x, float) for x in xs):
        return "float32"
    return "int64" if any(d.startswith("int") for d in dtypes) else BOOL


def _shape(*xs) -> tuple[int, ...]:
    return tuple(np.broadcast_shapes(*(tuple(getattr(x, "shape", ())) for x in xs)))


# ----------------------------------------------------------------------------- dtypes


def to_dtype(cx: Context, x, *args, **kwargs):
    """`Tensor.to(dtype)`, `.float()`, `.long()`, `.bool()`, `type_as`: a cast where the dtype changes
    (to a boolean: `x != 0`, unless x is a comparison already)."""
    if cx.dtype == "bool":
        return x if isinstance(x.value.owner, graph.CompareOp) else compare_to(cx, x, 0, "ne")
    return cast_to(x, cx.dtype)


# ----------------------------------------------------------------------------- functions


def unary(fn: Callable) -> Callable:
    """A float function of one operand (an integer operand becomes float32 first, as PyTorch does)."""
    def translate(cx: Context, x):
        return fn(x if is_float(x.dtype) else cast_to(x, "float32"))
    return translate


def reciprocal(cx: Context, x):
    return power(unary(lambda v: v)(cx, x), -1.0)


def _extremum(cls) -> Callable:
    def translate(cx: Context, a, b):
        dtype, shape = _common(a, b), _shape(a, b)
        return cx.tracer.emit(cls(operand(cx, a, dtype, shape).value, operand(cx, b, dtype, shape).value))
    return translate


def clamp(cx: Context, x, lo=None, hi=None):
    """`min(max(x, lo), hi)` (either bound may be None)."""
    dtype = cx.dtype
    y = cast_to(x, dtype) if isinstance(x, Tensor) else cx.lift(x, dtype)
    if lo is not None:
        y = _extremum(graph.MaximumOp)(cx, y, lo)
    if hi is not None:
        y = _extremum(graph.MinimumOp)(cx, y, hi)
    return y


def hardtanh(cx: Context, x, lo=-1.0, hi=1.0):
    return clamp(cx, x, lo, hi)


def atan2(cx: Context, y, x):
    return _extremum(graph.Atan2Op)(cx, y, x)


def elu(cx: Context, x, alpha=1.0, scale=1.0, input_scale=1.0):
    """`scale * x` where x > 0, else `scale * alpha * (exp(x * input_scale) - 1)`."""
    neg = el.expm1(x * float(input_scale)) * float(alpha * scale)
    return el.where(compare_to(cx, x, 0.0, "gt"), x * float(scale), neg)


def leaky_relu(cx: Context, x, slope=0.01):
    return el.where(compare_to(cx, x, 0.0, "gt"), x, x * float(slope))


def pow_tensor(cx: Context, x, p):
    """`x ** p` with a tensor exponent: `power` where p is one concrete number, else `exp(p log x)`."""
    if not isinstance(p, Tensor) and getattr(p, "numel", lambda: 0)() and bool((p == p.reshape(-1)[0]).all()):
        return power(x, float(p.reshape(-1)[0]))
    dtype = cx.dtype
    return exp(operand(cx, p, dtype, cx.shape) * log(operand(cx, x, dtype, cx.shape)))


def pow_scalar_base(cx: Context, base, x):
    """`base ** x` for a number `base`: `exp(x ln base)`."""
    return exp(cast_to(x, cx.dtype) * math.log(float(base)))


def _rounded_div(rounding: str | None, a: Tensor, b: Tensor) -> Tensor:
    q = divide(a, b)
    return q if rounding is None else el.floor(q) if rounding == "floor" else el.trunc(q)


def div_mode(cx: Context, a, b, rounding_mode=None):
    """`a / b` rounded down (`floor`) or toward zero (`trunc`), in float; an integer result is cast back."""
    dtype = _common(a, b)
    work = dtype if is_float(dtype) else "float64"
    shape = _shape(a, b)
    return _rounded_div(rounding_mode, operand(cx, a, work, shape), operand(cx, b, work, shape))


def remainder(cx: Context, a, b):
    """`a - b * floor(a / b)` (Python's modulo, as PyTorch's `remainder`)."""
    work = _common(a, b) if is_float(_common(a, b)) else "float64"
    shape = _shape(a, b)
    a, b = operand(cx, a, work, shape), operand(cx, b, work, shape)
    return a - b * _rounded_div("floor", a, b)


def fmod(cx: Context, a, b):
    """`a - b * trunc(a / b)` (C's fmod)."""
    work = _common(a, b) if is_float(_common(a, b)) else "float64"
    shape = _shape(a, b)
    a, b = operand(cx, a, work, shape), operand(cx, b, work, shape)
    return a - b * _rounded_div("trunc", a, b)


# ----------------------------------------------------------------------------- comparisons and logic


def compare_to(cx: Context, a, b, predicate: str) -> Tensor:
    """`a PREDICATE b` as a float 0/1 tensor (operands promoted to their common dtype)."""
    dtype, shape = _common(a, b), _shape(a, b)
    from xdsl.dialects.builtin import TensorType

    lhs, rhs = operand(cx, a, dtype, shape), operand(cx, b, dtype, shape)
    return lhs.tracer.emit(graph.CompareOp(lhs.value, rhs.value, predicate, TensorType(element_type(BOOL), shape)))


def comparison(predicate: str) -> Callable:
    return lambda cx, a, b: compare_to(cx, a, b, predicate)


def isnan(cx: Context, x):
    return compare_to(cx, x, x, "ne")


def isinf(cx: Context, x):
    return compare_to(cx, el.abs(x), math.inf, "eq")


def _flag(cx: Context, x, shape) -> Tensor:
    """A boolean operand as a float 0/1 tensor of `shape`."""
    if isinstance(x, Tensor):
        if not is_float(x.dtype):
            raise Unsupported(f"bitwise logic on {x.dtype} values (hspmd takes booleans: masks)")
        return x.broadcast_to(shape)
    return operand(cx, x, BOOL, shape)


def logical_and(cx: Context, a, b):
    shape = _shape(a, b)
    return _flag(cx, a, shape) * _flag(cx, b, shape)


def logical_or(cx: Context, a, b):
    shape = _shape(a, b)
    return el.maximum(_flag(cx, a, shape), _flag(cx, b, shape))


def logical_xor(cx: Context, a, b):
    shape = _shape(a, b)
    return compare_to(cx, _flag(cx, a, shape), _flag(cx, b, shape), "ne")


def logical_not(cx: Context, x):
    return 1.0 - _flag(cx, x, x.shape)


def where(cx: Context, cond, a, b):
    """`where(cond, a, b)`: a concrete condition as `aten.where` does it (products with literals,
    which the attention patterns know); a traced one with `graph.select`."""
    from hspmd.frontend import aten

    if not isinstance(cond, Tensor):
        return aten.where(cx, cond, a, b)
    dtype, shape = cx.dtype, cx.shape
    return el.where(_flag(cx, cond, shape), operand(cx, a, dtype, shape), operand(cx, b, dtype, shape))


def masked_fill(cx: Context, x, mask, value):
    value = value.item() if hasattr(value, "item") and not isinstance(value, Tensor) else value
    return where(cx, mask, value, x)


def any_(cx: Context, x, dims=None, keepdim=False):
    """Whether any element along `dims` (all dims: None) is true: the maximum of the 0/1 values."""
    dims = list(range(x.ndim)) if dims is None or dims == [] else sorted({d % x.ndim for d in
                                                                          ([dims] if isinstance(dims, int) else dims)})
    return reduce_max(compare_to(cx, x, 0.0, "ne"), dims).reshape(cx.shape)


def amin(cx: Context, x, dims=(), keepdim=False):
    dims = list(range(x.ndim)) if not dims else sorted({d % x.ndim for d in dims})
    return (reduce_max(x * -1.0, dims) * -1.0).reshape(cx.shape)


def extremum_all(sign: float) -> Callable:
    """The largest (`sign` 1) or smallest (-1) element (`torch.max(x)`, `torch.min(x)` without a
    dim); an integer tensor's through float64 (exact up to 2**53)."""
    def translate(cx: Context, x):
        if not x.ndim:
            return x
        y = x if is_float(x.dtype) else cast_to(x, "float64")
        m = (reduce_max(y * sign, list(range(y.ndim))) * sign).reshape(cx.shape)
        return m if y is x else cast_to(m, x.dtype)
    return translate


def var(cx: Context, x, dims=None, *args, correction=None, keepdim=False, unbiased=None):
    """Variance along `dims`: mean of squared deviations times n / (n - correction)."""
    if args:  # var.dim(x, dims, unbiased, keepdim)
        unbiased = args[0]
        keepdim = args[1] if len(args) > 1 else keepdim
    dims = list(range(x.ndim)) if dims is None or dims == [] else sorted({d % x.ndim for d in
                                                                          ([dims] if isinstance(dims, int) else dims)})
    c = float(1 if correction is None and unbiased is not False else (correction or 0))
    n = int(np.prod([x.shape[d] for d in dims]))
    kept = tuple(1 if i in dims else s for i, s in enumerate(x.shape))
    dev = x - x.mean(dims).reshape(kept).broadcast_to(x.shape)
    return ((dev * dev).sum(dims) * (1.0 / max(n - c, 0.0) if n > c else math.inf)).reshape(cx.shape)


def vector_norm(cx: Context, x, ord=2, dims=None, keepdim=False, dtype=None):
    """`torch.linalg.vector_norm`: the `ord`-norm of `x` along `dims` (all dims: None): sqrt of
    the sum of squares for 2, the sum of |x| for 1, the largest (smallest) |x| for inf (-inf),
    the count of nonzeros for 0, else `sum(|x| ** ord) ** (1 / ord)`."""
    dims = list(range(x.ndim)) if dims is None or dims == [] else sorted({d % x.ndim for d in
                                                                          ([dims] if isinstance(dims, int) else dims)})
    x = cast_to(x, dtype or cx.dtype)
    if not x.ndim:
        dims = []
    a = el.abs(x)
    p = float(ord)
    if p == 2:
        y = sqrt((x * x).sum(dims))
    elif p == 1:
        y = a.sum(dims)
    elif p == math.inf:
        y = reduce_max(a, dims)
    elif p == -math.inf:
        y = reduce_max(a * -1.0, dims) * -1.0
    elif p == 0:
        y = compare_to(cx, x, 0.0, "ne").sum(dims)
    else:
        y = power(power(a, p).sum(dims), 1.0 / p)
    return y.reshape(cx.shape)


def native_layer_norm(cx: Context, x, shape, weight=None, bias=None, eps=1e-5):
    """(layer_norm(x), mean, 1 / std) over the last dim, the statistics kept as [..., 1]."""
    from hspmd.frontend import aten

    out = aten.TRANSLATORS["aten.layer_norm.default"](cx_first(cx), x, shape, weight, bias, eps)
    kept = (*x.shape[:-1], 1)
    mu = x.mean([x.ndim - 1]).reshape(kept)
    dev = x - mu.broadcast_to(x.shape)
    rstd = power((dev * dev).mean([x.ndim - 1]).reshape(kept) + float(eps), -0.5)
    return out, mu, rstd


def cx_first(cx: Context) -> Context:
    """Return `cx` for the first result of a node of several (its shape and dtype)."""
    meta = cx.meta[0] if isinstance(cx.meta, (tuple, list)) else cx.meta
    return Context(cx.tracer, cx.lift, meta)


# ----------------------------------------------------------------------------- made from a shape alone


def full_like(cx: Context, x, value, **kwargs):
    """A tensor of the node's shape and dtype filled with `value` (a traced `x` gives only its shape)."""
    dtype = cx.dtype if cx.dtype != "bool" else BOOL
    return x_const(cx, float(value), dtype, cx.shape)


def fill(cx: Context, x, value):
    if isinstance(value, Tensor):
        return value.broadcast_to(cx.shape)
    return full_like(cx, x, value.item() if hasattr(value, "item") else value)


def copy(cx: Context, dst, src, non_blocking=False):
    """`dst.copy_(src)` as a value: `src` in `dst`'s dtype and shape."""
    return operand(cx, src, cx.dtype if cx.dtype != "bool" else BOOL, cx.shape)


def detach(cx: Context, x):
    """The values without their gradient (`graph.stop_gradient`; integers have none anyway)."""
    from hspmd.dialects.graph.shape import stop_gradient

    return stop_gradient(x) if is_float(x.dtype) else x


def native_dropout(cx: Context, x, p, train=True):
    """(dropout of x, None): the mask is PyTorch's own output, which hspmd's dropout keeps inside."""
    out = dropout(x, float(p)) if train and p and p > 0 else x
    return out, None


#: ATen op name -> translator
TRANSLATORS: dict[str, Callable] = {
    "aten.to.dtype": to_dtype, "aten.to.dtype_layout": to_dtype, "aten._to_copy.default": to_dtype,
    "aten.type_as.default": to_dtype,
    **{f"aten.{n}.default": unary(getattr(el, n)) for n in (
        "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "abs", "log1p",
        "expm1", "log2", "log10", "sign", "floor", "ceil", "round", "trunc")},
    "aten.reciprocal.default": reciprocal,
    "aten.maximum.default": _extremum(graph.MaximumOp), "aten.minimum.default": _extremum(graph.MinimumOp),
    "aten.clamp.default": clamp, "aten.clamp.Tensor": clamp, "aten.hardtanh.default": hardtanh,
    "aten.atan2.default": atan2, "aten.elu.default": elu, "aten.leaky_relu.default": leaky_relu,
    "aten.pow.Tensor_Tensor": pow_tensor, "aten.pow.Scalar": pow_scalar_base,
    "aten.div.Tensor_mode": div_mode, "aten.div.Scalar_mode": div_mode,
    "aten.remainder.Tensor": remainder, "aten.remainder.Scalar": remainder,
    "aten.fmod.Tensor": fmod, "aten.fmod.Scalar": fmod,
    **{f"aten.{p}.{k}": comparison(p) for p in ("eq", "ne", "lt", "le", "gt", "ge") for k in ("Tensor", "Scalar")},
    "aten.isnan.default": isnan, "aten.isinf.default": isinf,
    "aten.logical_and.default": logical_and, "aten.logical_or.default": logical_or,
    "aten.logical_xor.default": logical_xor, "aten.logical_not.default": logical_not,
    "aten.bitwise_and.Tensor": logical_and, "aten.bitwise_or.Tensor": logical_or,
    "aten.bitwise_xor.Tensor": logical_xor, "aten.bitwise_not.default": logical_not,
    "aten.bitwise_and.Scalar": logical_and, "aten.bitwise_or.Scalar": logical_or,
    "aten.bitwise_xor.Scalar": logical_xor, "aten.native_layer_norm.default": native_layer_norm,
    "aten.where.self": where, "aten.masked_fill.Scalar": masked_fill, "aten.masked_fill.Tensor": masked_fill,
    "aten.any.default": any_, "aten.any.dim": any_, "aten.any.dims": any_,
    "aten.amin.default": amin, "aten.var.correction": var, "aten.var.dim": var,
    "aten.linalg_vector_norm.default": vector_norm,
    "aten.max.default": extremum_all(1.0), "aten.min.default": extremum_all(-1.0),
    "aten.full_like.default": full_like, "aten.fill.Scalar": fill, "aten.fill.Tensor": fill,
    "aten.copy.default": copy, "aten.native_dropout.default": native_dropout, "aten.detach.default": detach,
    "hspmd.stop_gradient.default": detach,
}
