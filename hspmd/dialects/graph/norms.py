"""Normalisation over the last dim: layer norm and RMS norm, with their gradients."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from xdsl.dialects.builtin import (
    FloatAttr,
    TensorType,
)
from xdsl.ir import Operation, SSAValue
from xdsl.irdl import (
    irdl_op_definition,
    operand_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.cuda_c import EmitError, KernelCode, RowKernel, fill, lit, prop, shape
from hspmd.dialects.graph.arithmetic import cast
from hspmd.dialects.graph.base import (
    TensorOp,
    check_float,
    check_same_element_type,
    check_same_shape,
    float_attr,
    result_shape,
    shared_grad,
    tensor_shape,
)
from hspmd.dialects.interfaces import FIRST, FRESH, OUT, Kernel, KernelContext, OutFacts, overwrites_first, rowwise, takes_out
from hspmd.dialects.op_rule import OpRule, last_dim_rule
from hspmd.dialects.traced import REDUCED_PRECISION, as_tensor, fail, require_float

__all__ = [
    "LayerNormOp",
    "LayerNormGradOp",
    "RmsNormOp",
    "RmsNormGradOp",
]


# ----------------------------------------------------------------------------- NumPy kernels


def _uniform(*arrays: np.ndarray) -> bool:
    """Return whether the arrays share one float32/float64 dtype (the in-place paths' condition)."""
    return arrays[0].dtype in (np.float32, np.float64) and all(a.dtype == arrays[0].dtype for a in arrays)


def _into(value: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """Return `value`, or `out` filled with it."""
    if out is None:
        return value
    np.copyto(out, value)
    return out


def layer_norm_values(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float,
                      out: np.ndarray | None = None) -> np.ndarray:
    """`(x - mean) / sqrt(var + eps) * weight + bias` over the last dim (in place in `out`)."""
    if not _uniform(x, weight, bias):  # mixed precision: compute in the promoted dtype, round once
        mean = x.mean(axis=-1, keepdims=True)
        xc = x - mean
        var = (xc * xc).mean(axis=-1, keepdims=True)
        return _into((xc / np.sqrt(var + eps) * weight + bias).astype(x.dtype, copy=False), out)
    out = np.subtract(x, x.mean(axis=-1, keepdims=True), out=out)
    sq = np.multiply(out, out)
    std = sq.mean(axis=-1, keepdims=True)
    del sq
    std += eps
    np.sqrt(std, out=std)
    out /= std
    out *= weight
    out += bias
    return out


def layer_norm_grad_values(x: np.ndarray, weight: np.ndarray, dy: np.ndarray, eps: float, out=None):
    """Return (dx, dweight, dbias) of `layer_norm_values` (written into the three arrays of `out`
    if given)."""
    lead = tuple(range(x.ndim - 1))
    if not _uniform(x, weight, dy):  # mixed precision: compute in the promoted dtype, round once
        mean = x.mean(axis=-1, keepdims=True)
        xc = x - mean
        rstd = 1 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + eps)
        xhat = xc * rstd
        g = dy * weight
        dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
        res = (dx.astype(x.dtype, copy=False), np.asarray((dy * xhat).sum(axis=lead), dtype=x.dtype),
               np.asarray(dy.sum(axis=lead), dtype=x.dtype))
        return res if out is None else tuple(_into(r, o) for r, o in zip(res, out))
    dx, dweight, dbias = out if out is not None else (np.empty(x.shape, x.dtype), None, None)
    if not dx.flags.c_contiguous:  # a strided out: compute in a C array, then copy
        res = layer_norm_grad_values(x, weight, dy, eps, (np.empty(x.shape, x.dtype), dweight, dbias))
        np.copyto(dx, res[0])
        return dx, res[1], res[2]
    cols = x.shape[-1]
    rows = x.size // max(cols, 1)
    x2, dy2, dx2 = (np.reshape(a, (rows, cols)) for a in (x, dy, dx))  # dx2: a view of dx
    prod = np.empty(x.shape, x.dtype)  # dy * xhat, summed whole below (the same sum as one call's)
    prod2 = prod.reshape(rows, cols)
    step = max(1, _BLOCK_ELEMENTS // max(cols, 1))
    for lo in range(0, rows, step):  # blocks of rows, so that the temporaries stay in cache
        hi = min(lo + step, rows)
        xb, dyb, dxb = x2[lo:hi], dy2[lo:hi], dx2[lo:hi]
        xhat = np.subtract(xb, xb.mean(axis=-1, keepdims=True))
        np.multiply(xhat, xhat, out=dxb)
        rstd = dxb.mean(axis=-1, keepdims=True)
        rstd += eps
        np.sqrt(rstd, out=rstd)
        np.divide(1, rstd, out=rstd)
        xhat *= rstd
        g = np.multiply(dyb, weight)
        np.multiply(g, xhat, out=dxb)  # dx = rstd * (g - mean(g) - xhat * mean(g xhat))
        m2 = dxb.mean(axis=-1, keepdims=True)
        np.multiply(xhat, m2, out=dxb)
        g -= g.mean(axis=-1, keepdims=True)
        np.subtract(g, dxb, out=dxb)
        dxb *= rstd
        np.multiply(dyb, xhat, out=prod2[lo:hi])
    dweight = np.sum(prod, axis=lead, out=dweight)
    dbias = np.sum(dy, axis=lead, out=dbias)
    return dx, dweight, dbias


#: rows of a row-wise kernel that blocks itself are taken this many elements at a time
_BLOCK_ELEMENTS = 1 << 15


def rms_norm_values(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dim."""
    r = 1 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return (x * r * weight).astype(x.dtype, copy=False)


def rms_norm_grad_values(x: np.ndarray, weight: np.ndarray, dy: np.ndarray, eps: float):
    """Return (dx, dweight) of `rms_norm_values`."""
    lead = tuple(range(x.ndim - 1))
    r = 1 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    g = dy * weight
    dx = r * g - x * (r**3) * (g * x).mean(axis=-1, keepdims=True)
    dweight = np.asarray((dy * x * r).sum(axis=lead), dtype=x.dtype)
    return dx.astype(x.dtype, copy=False), dweight


# ----------------------------------------------------------------------------- CUDA C row kernels


_MOMENTS = """\
    T s = 0;
    HS_COLS_SUM(j, cols, s) s += XLOAD[j];
    const T mean = hs_block_sum(s) / (T)cols;
    T q = 0;
    HS_COLS_SUM(j, cols, q) {
      const T d = XLOAD[j] - mean;
      q += d * d;
    }
    const T var = hs_block_sum(q) / (T)cols;
"""

_LAYER_NORM = """\
// {name}: layer norm over the last dim
HS_KERNEL void {name}(XPARAM, const T* __restrict__ w, const T* __restrict__ b, T* __restrict__ y,
                      long rows, long cols) {
  HS_ROWS(r, rows) {
    XDECL
    T* yr = y + r * cols;
{moments}    const T rstd = (T)1 / hs_sqrt(var + {eps});  // one division a row (within 1 ulp of NumPy's x / den)
    HS_COLS(j, cols) yr[j] = (XLOAD[j] - mean) * rstd * w[j] + b[j];
  }
}
"""

_LAYER_NORM_GRAD = """\
// {name}: layer norm backward: dx per row, then dweight/dbias per column
HS_KERNEL void {name}_rows(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ dy,
                           T* __restrict__ dx, T* __restrict__ dw, T* __restrict__ db,
                           T* __restrict__ mean_out, T* __restrict__ rstd_out, long rows, long cols) {
  HS_ROWS(r, rows) {
    const T* xr = x + r * cols;
    const T* gr = dy + r * cols;
    T* dr = dx + r * cols;
{moments}    const T rstd = (T)1 / hs_sqrt(var + {eps});
    T sg = 0, sgx = 0;
    HS_COLS_SUM(j, cols, sg) sg += gr[j] * w[j];
    HS_COLS_SUM(j, cols, sgx) sgx += gr[j] * w[j] * ((xr[j] - mean) * rstd);
    const T mg = hs_block_sum(sg) / (T)cols;
    const T mgx = hs_block_sum(sgx) / (T)cols;
    HS_COLS(j, cols) dr[j] = rstd * (gr[j] * w[j] - mg - ((xr[j] - mean) * rstd) * mgx);
    if (threadIdx.x == 0) {
      mean_out[r] = mean;
      rstd_out[r] = rstd;
    }
  }
}
HS_KERNEL void {name}_cols(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ dy,
                           T* __restrict__ dx, T* __restrict__ dw, T* __restrict__ db,
                           T* __restrict__ mean, T* __restrict__ rstd, long cols, long rows) {
  // each thread sums its columns [c0, c1) over the rows in order (a GPU thread: one column)
  HS_COLUMN_RANGE(c0, c1, cols) {
    for (long c = c0; c < c1; ++c) dw[c] = db[c] = (T)0;
    for (long r = 0; r < rows; ++r) {
      const T m = mean[r], s = rstd[r];
      const T* xr = x + r * cols;
      const T* gr = dy + r * cols;
      HS_SIMD for (long c = c0; c < c1; ++c) {
        dw[c] += gr[c] * ((xr[c] - m) * s);
        db[c] += gr[c];
      }
    }
  }
}
"""

_RMS_NORM = """\
// {name}: RMS norm over the last dim
HS_KERNEL void {name}(XPARAM, const T* __restrict__ w, T* __restrict__ y, long rows, long cols) {
  HS_ROWS(r, rows) {
    XDECL
    T* yr = y + r * cols;
    T q = 0;
    HS_COLS_SUM(j, cols, q) q += XLOAD[j] * XLOAD[j];
    const T rr = (T)1 / hs_sqrt(hs_block_sum(q) / (T)cols + {eps});
    HS_COLS(j, cols) yr[j] = XLOAD[j] * rr * w[j];
  }
}
"""

_RMS_NORM_GRAD = """\
// {name}: RMS norm backward: dx per row, then dweight per column
HS_KERNEL void {name}_rows(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ dy,
                           T* __restrict__ dx, T* __restrict__ dw, T* __restrict__ rstd_out, long rows, long cols) {
  HS_ROWS(r, rows) {
    const T* xr = x + r * cols;
    const T* gr = dy + r * cols;
    T* dr = dx + r * cols;
    T q = 0;
    HS_COLS_SUM(j, cols, q) q += xr[j] * xr[j];
    const T rr = (T)1 / hs_sqrt(hs_block_sum(q) / (T)cols + {eps});
    T sgx = 0;
    HS_COLS_SUM(j, cols, sgx) sgx += gr[j] * w[j] * xr[j];
    const T mgx = hs_block_sum(sgx) / (T)cols;
    HS_COLS(j, cols) dr[j] = rr * (gr[j] * w[j]) - xr[j] * (rr * rr * rr) * mgx;
    if (threadIdx.x == 0) rstd_out[r] = rr;
  }
}
HS_KERNEL void {name}_cols(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ dy,
                           T* __restrict__ dx, T* __restrict__ dw, T* __restrict__ rstd, long cols, long rows) {
  HS_COLUMN_RANGE(c0, c1, cols) {
    for (long c = c0; c < c1; ++c) dw[c] = (T)0;
    for (long r = 0; r < rows; ++r) {
      const T s = rstd[r];
      const T* xr = x + r * cols;
      const T* gr = dy + r * cols;
      HS_SIMD for (long c = c0; c < c1; ++c) dw[c] += gr[c] * xr[c] * s;
    }
  }
}
"""


def _norm_source(op: Operation, rk: RowKernel, template: str, **kw: str) -> str:
    """Return `template` (of a norm op over the last dim) filled for `rk`: the placeholders `kw`
    first, then its eps, name and extents; EmitError unless the weight (and a layer norm's bias)
    is [cols]."""
    cols = rk.cols
    eps = lit(prop(op, "eps"), rk.t)
    src = fill(fill(template, **kw), eps=eps, name=rk.name, rows=str(rk.rows), cols=str(cols))
    if shape(op.operands[1]) != (cols,):
        raise EmitError(f"'{op.name}' weight is not [{cols}]")
    if isinstance(op, LayerNormOp) and shape(op.operands[2]) != (cols,):
        raise EmitError(f"'{op.name}' bias is not [{cols}]")
    return src


def _two_pass_launches(rk: RowKernel) -> list[str]:
    """Return the launches of a norm gradient: dx by rows, then the weight gradients by columns."""
    return [f"row {rk.name}_rows {rk.rows} {rk.cols}", f"elementwise {rk.name}_cols {rk.cols} {rk.rows}"]


# ----------------------------------------------------------------------------- ops


@irdl_op_definition
class LayerNormOp(TensorOp):
    """`(x - mean) / sqrt(var + eps) * weight + bias` over the last dim (biased variance):
    x [..., n], weight [n], bias [n] -> [..., n]."""

    name = "graph.layer_norm"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.layer_norm.default", "aten.native_layer_norm.default")
    x = operand_def(TensorType)
    weight = operand_def(TensorType)
    bias = operand_def(TensorType)
    result = result_def(TensorType)
    eps = prop_def(FloatAttr)
    traits = traits_def(Pure())
    OUT_FACTS: ClassVar[OutFacts] = FIRST
    CUDA_ROW_PROLOGUE: ClassVar[bool] = True
    FRONTEND: ClassVar[tuple[str, ...]] = ("layer_norm",)

    def __init__(self, x: SSAValue, weight: SSAValue, bias: SSAValue, eps: float):
        super().__init__(operands=[x, weight, bias], result_types=[x.type], properties={"eps": float_attr(eps)})

    def verify_(self) -> None:
        x, w, b = tensor_shape(self.x), tensor_shape(self.weight), tensor_shape(self.bias)
        if not x or w != x[-1:] or b != x[-1:]:
            raise VerifyException(f"'{self.name}' needs x [..., n], weight [n], bias [n], got {list(x)}, {list(w)}, {list(b)}")
        check_same_shape(self, self.x, self.result)
        check_same_element_type(self, self.x, self.weight, self.bias, self.result)
        check_float(self, self.x)

    def sharding_rule(self) -> OpRule:
        return last_dim_rule(self, (True, False, False), (True,))

    def vjp(self, gs, emit):
        g = gs[0]
        ln = shared_grad(emit, lambda: LayerNormGradOp(self.x, self.weight, g, self.eps.value.data))
        return [lambda: ln().results[0], lambda: ln().results[1], lambda: ln().results[2]]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        eps = self.eps.value.data
        rows = rowwise if len(result_shape(self)) > 1 else takes_out
        return overwrites_first(rows(lambda x, w, b, out=None: layer_norm_values(x, w, b, eps, out)))

    def cuda_row(self, rk: RowKernel) -> KernelCode:
        return KernelCode(_norm_source(self, rk, _LAYER_NORM, moments=_MOMENTS), rk.launch())


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
    NO_VJP: ClassVar[str] = "a gradient op (no second derivatives)"
    OUT_FACTS: ClassVar[OutFacts] = OUT

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

    def sharding_rule(self) -> OpRule:  # linear in dy, but a partial dy is reduced first (below)
        return last_dim_rule(self, (True, False, True), (True, False, False))

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        eps = self.eps.value.data
        return takes_out(lambda x, w, dy, out=None: layer_norm_grad_values(x, w, dy, eps, out))

    def cuda_row(self, rk: RowKernel) -> KernelCode:
        src = _norm_source(self, rk, _LAYER_NORM_GRAD, moments=_MOMENTS)
        return KernelCode(src, _two_pass_launches(rk), [rk.rows, rk.rows])


@irdl_op_definition
class RmsNormOp(TensorOp):
    """`x / sqrt(mean(x^2) + eps) * weight` over the last dim (LLaMA): x [..., n], weight [n]."""

    name = "graph.rms_norm"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.rms_norm.default",)
    x = operand_def(TensorType)
    weight = operand_def(TensorType)
    result = result_def(TensorType)
    eps = prop_def(FloatAttr)
    traits = traits_def(Pure())
    OUT_FACTS: ClassVar[OutFacts] = FRESH
    CUDA_ROW_PROLOGUE: ClassVar[bool] = True
    FRONTEND: ClassVar[tuple[str, ...]] = ("rms_norm",)

    def __init__(self, x: SSAValue, weight: SSAValue, eps: float):
        super().__init__(operands=[x, weight], result_types=[x.type], properties={"eps": float_attr(eps)})

    def verify_(self) -> None:
        x, w = tensor_shape(self.x), tensor_shape(self.weight)
        if not x or w != x[-1:]:
            raise VerifyException(f"'{self.name}' needs x [..., n] and weight [n], got {list(x)}, {list(w)}")
        check_same_shape(self, self.x, self.result)
        check_same_element_type(self, self.x, self.weight, self.result)
        check_float(self, self.x)

    def sharding_rule(self) -> OpRule:
        return last_dim_rule(self, (True, False), (True,))

    def vjp(self, gs, emit):
        g = gs[0]
        rms = shared_grad(emit, lambda: RmsNormGradOp(self.x, self.weight, g, self.eps.value.data))
        return [lambda: rms().results[0], lambda: rms().results[1]]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        eps = self.eps.value.data
        return lambda x, w: rms_norm_values(x, w, eps)

    def cuda_row(self, rk: RowKernel) -> KernelCode:
        return KernelCode(_norm_source(self, rk, _RMS_NORM), rk.launch())


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
    NO_VJP: ClassVar[str] = "a gradient op (no second derivatives)"
    OUT_FACTS: ClassVar[OutFacts] = FRESH

    def __init__(self, x: SSAValue, weight: SSAValue, dy: SSAValue, eps: float):
        super().__init__(operands=[x, weight, dy], result_types=[x.type, weight.type], properties={"eps": float_attr(eps)})

    def verify_(self) -> None:
        x, w = tensor_shape(self.x), tensor_shape(self.weight)
        if not x or w != x[-1:] or tensor_shape(self.dy) != x:
            raise VerifyException(f"'{self.name}' needs x [..., n], weight [n], dy [..., n]")
        check_same_shape(self, self.x, self.dx)
        check_same_shape(self, self.weight, self.dweight)

    def sharding_rule(self) -> OpRule:
        # Linear in dy, yet declared not: a partial dy (a column-parallel input's gradient) is
        # all-reduced here, as Megatron does, so the residual stream's gradient, the norm's
        # weight gradients and what the embeddings receive are whole, not partial sums that
        # each need a reduction of their own.
        return last_dim_rule(self, (True, False, True), (True, False))

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        eps = self.eps.value.data
        return lambda x, w, dy: rms_norm_grad_values(x, w, dy, eps)

    def cuda_row(self, rk: RowKernel) -> KernelCode:
        return KernelCode(_norm_source(self, rk, _RMS_NORM_GRAD), _two_pass_launches(rk), [rk.rows])


# ----------------------------------------------------------------------------- frontend


def _vector(x, v, op: str, what: str, fill: float):
    """Return `v` as a [n] tensor for x [..., n] (None: a constant `fill`)."""
    n = x.shape[-1]
    if v is None:
        return x.tracer.constant(fill, (n,), x.dtype)
    v = as_tensor(v, op)
    if v.shape != (n,):
        raise fail(op, f"{what} must have shape [{n}] for x of shape {list(x.shape)}, got {list(v.shape)}")
    if v.dtype != x.dtype:
        raise fail(op, f"{what} has dtype {v.dtype}, x has {x.dtype}")
    return v


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5):
    """Return `(x - mean) / sqrt(var + eps) * weight + bias` over the last dim (biased var)."""
    x = as_tensor(x, "layer_norm")
    require_float(x, "layer_norm")
    if x.ndim < 1:
        raise fail("layer_norm", "needs x [..., n]")
    if x.dtype in REDUCED_PRECISION:
        up = [None if v is None else cast(as_tensor(v, "layer_norm"), "float32") for v in (weight, bias)]
        return cast(layer_norm(cast(x, "float32"), up[0], up[1], eps), x.dtype)
    w = _vector(x, weight, "layer_norm", "weight", 1.0)
    b = _vector(x, bias, "layer_norm", "bias", 0.0)
    return x.tracer.emit(LayerNormOp(x.value, w.value, b.value, float(eps)))


def rms_norm(x, weight=None, eps: float = 1e-6):
    """Return `x * rsqrt(mean(x^2) + eps) * weight` over the last dim (LLaMA's RMSNorm)."""
    x = as_tensor(x, "rms_norm")
    require_float(x, "rms_norm")
    if x.ndim < 1:
        raise fail("rms_norm", "needs x [..., n]")
    if x.dtype in REDUCED_PRECISION:
        up = None if weight is None else cast(as_tensor(weight, "rms_norm"), "float32")
        return cast(rms_norm(cast(x, "float32"), up, eps), x.dtype)
    w = _vector(x, weight, "rms_norm", "weight", 1.0)
    return x.tracer.emit(RmsNormOp(x.value, w.value, float(eps)))
