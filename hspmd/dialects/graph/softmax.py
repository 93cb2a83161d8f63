"""Attention's row ops: softmax over a dim (with its gradient) and the causal mask of scores."""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
from xdsl.dialects.builtin import (
    I64,
    FloatAttr,
    IntegerAttr,
)
from xdsl.ir import SSAValue
from xdsl.irdl import (
    irdl_op_definition,
    prop_def,
)
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.cuda_c import (
    EmitError,
    KernelCode,
    Prologue,
    RowKernel,
    c_type,
    contiguous_strides,
    kernel_params,
    lit,
    offset_expr,
    prop,
    put,
    retype,
    shape,
)
from hspmd.dialects.graph.arithmetic import cast
from hspmd.dialects.graph.base import (
    UnaryGradOp,
    UnaryOp,
    check_dim,
    check_float,
    check_same_shape,
    float_attr,
    int_attr,
    result_shape,
    tensor_shape,
)
from hspmd.dialects.interfaces import (
    FIRST,
    OUT,
    Kernel,
    KernelContext,
    OutFacts,
    along,
    by_rows,
    overwrites_first,
    rowwise,
    takes_out,
)
from hspmd.dialects.op_rule import OpRule, factors
from hspmd.dialects.traced import REDUCED_PRECISION, as_tensor, fail, norm_dim, require_float

__all__ = [
    "SoftmaxOp",
    "SoftmaxGradOp",
    "CausalMaskOp",
]


# ----------------------------------------------------------------------------- NumPy kernels


def softmax_values(x: np.ndarray, axis: int, out: np.ndarray | None = None) -> np.ndarray:
    """`exp(x - max) / sum(exp(x - max))` along `axis`, in place in `out`."""
    out = np.subtract(x, x.max(axis=axis, keepdims=True), out=out)
    np.exp(out, out=out)
    out /= out.sum(axis=axis, keepdims=True)
    return out


def softmax_grad_values(y: np.ndarray, dy: np.ndarray, axis: int, out: np.ndarray | None = None) -> np.ndarray:
    """`y * (dy - sum(dy * y))` along `axis`, in place in `out`."""
    out = np.multiply(dy, y, out=out)
    s = out.sum(axis=axis, keepdims=True)
    np.subtract(dy, s, out=out)
    out *= y
    return out


def causal_mask_kernel(value: float) -> Kernel:
    """Return the kernel setting `value` above the diagonal of the last two dims, `x` elsewhere
    (it takes `out=`, which may be `x` itself)."""
    cache: dict[tuple[int, int], np.ndarray] = {}

    @takes_out
    def mask(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        key = x.shape[-2:]
        if key not in cache:
            tq, tk = key
            cache[key] = np.arange(tk)[None, :] > np.arange(tq)[:, None]
        if out is None:
            return np.where(cache[key], x.dtype.type(value), x)
        if out.ctypes.data != x.ctypes.data or out.strides != x.strides:  # not in place
            np.copyto(out, x)
        np.copyto(out, x.dtype.type(value), where=cache[key])
        return out

    return mask


# ----------------------------------------------------------------------------- CUDA C row kernels


_SOFTMAX = """\
// {name}: softmax over the last dim
HS_KERNEL void {name}(XPARAM, T* __restrict__ y, long rows, long cols) {
  HS_ROWS(r, rows) {
    XDECL
    T* yr = y + r * cols;
    LIVE
    T m = -HS_INF;
    HS_COLS_MAX(j, live, m) m = hs_max(m, XLOAD[j]);
    m = hs_block_max(m);
    T s = 0;
    HS_COLS_SUM(j, live, s) {
      const T e = hs_exp(XLOAD[j] - m);
      yr[j] = e;
      s += e;
    }
    const T inv = (T)1 / hs_block_sum(s);  // one division a row (within 1 ulp of NumPy's e / sum)
    HS_COLS(j, live) yr[j] = yr[j] * inv;
    TAIL
  }
}
"""

# Softmax after a causal mask of -inf: the columns j > r % Tq are -inf, their results exactly 0;
# the row's loops stop after its last unmasked column (HS_LIVE_COLS: rounded up to whole CPU
# vectors, the masked columns before that bound still go through the loops as -inf) and the rest
# of the row is written as 0. The same values; half the work of a causal row on average.
_CAUSAL_LIVE = "const long live = HS_LIVE_COLS(r % {tq}L + 1, cols);"
_CAUSAL_TAIL = "HS_COLS(j, cols - live) yr[live + j] = (T)0;"

_SOFTMAX_GRAD = """\
// {name}: softmax backward y * (dy - sum(dy * y)) over the last dim
HS_KERNEL void {name}(const T* __restrict__ y, const T* __restrict__ dy, T* __restrict__ dx, long rows, long cols) {
  HS_ROWS(r, rows) {
    const T* yr = y + r * cols;
    const T* gr = dy + r * cols;
    T* dr = dx + r * cols;
    T s = 0;
    HS_COLS_SUM(j, cols, s) s += gr[j] * yr[j];
    s = hs_block_sum(s);
    HS_COLS(j, cols) dr[j] = yr[j] * (gr[j] - s);
  }
}
"""


def _causal_rows(prologue: Prologue | None) -> int | None:
    """Return Tq where `prologue`'s result is a causal mask of -inf (entries j > r % Tq are
    -inf, whatever the ops before it computed), else None."""
    if prologue is None:
        return None
    last = prologue.output.owner
    if isinstance(last, CausalMaskOp) and prop(last, "value") == -math.inf:
        return shape(last.result)[-2]
    return None


def _check_last_dim(op: SoftmaxOp | SoftmaxGradOp) -> None:
    """Raise EmitError unless `op` works over the last dim (the only one a row kernel does)."""
    if op.dim.value.data != len(shape(op.operands[0])) - 1:
        raise EmitError("softmax over a dim other than the last")


# ----------------------------------------------------------------------------- ops


@irdl_op_definition
class SoftmaxOp(UnaryOp):
    """`exp(x - max) / sum(exp(x - max))` along `dim`."""

    name = "graph.softmax"
    ATEN: ClassVar[tuple[str, ...]] = (
        "aten.softmax.int",
        "aten._softmax.default",
        "aten.scaled_dot_product_attention.default",
    )
    dim = prop_def(IntegerAttr[I64])
    OUT_FACTS: ClassVar[OutFacts] = FIRST
    CUDA_ROW_PROLOGUE: ClassVar[bool] = True
    FRONTEND: ClassVar[tuple[str, ...]] = ("softmax",)

    def __init__(self, input: SSAValue, dim: int):
        super().__init__(input, dim=int_attr(dim))

    def verify_(self) -> None:
        check_same_shape(self, self.input, self.result)
        check_float(self, self.input)
        check_dim(self, self.dim, len(tensor_shape(self.input)))

    def sharding_rule(self) -> OpRule:
        d = factors("d", len(result_shape(self)))
        return OpRule((d,), (d,), blocked=frozenset({d[self.dim.value.data]}))

    def vjp(self, gs, emit):
        g = gs[0]
        return [lambda: emit(SoftmaxGradOp(self.result, g, self.dim.value.data))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        axis = self.dim.value.data
        rows = along(axis, len(result_shape(self)))
        axis = -1 if rows is rowwise else axis  # row blocks come as 2-D views
        return overwrites_first(rows(lambda x, out=None: softmax_values(x, axis, out)))

    def cuda_kernel(self, name: str) -> KernelCode:
        """A softmax over any dim (`cuda_row` is the last dim's): a block per row along `dim`."""
        return _strided_softmax(name, self, False)

    def cuda_row(self, rk: RowKernel) -> KernelCode:
        _check_last_dim(self)
        src = rk.fill(_SOFTMAX)
        tq = _causal_rows(rk.prologue)
        live, tail = (_CAUSAL_LIVE.replace("{tq}", str(tq)), _CAUSAL_TAIL) if tq else ("const long live = cols;", "")
        src = src.replace("    LIVE\n", f"    {live}\n").replace("    TAIL\n", f"    {tail}\n" if tail else "")
        return KernelCode(src, rk.launch())


@irdl_op_definition
class SoftmaxGradOp(UnaryGradOp):
    """`y * (dy - sum(dy * y, dim))`: the gradient of `graph.softmax` given its result `y`."""

    name = "graph.softmax_grad"
    dim = prop_def(IntegerAttr[I64])
    OUT_FACTS: ClassVar[OutFacts] = OUT

    def __init__(self, y: SSAValue, dy: SSAValue, dim: int):
        super().__init__(y, dy, dim=int_attr(dim))

    def verify_(self) -> None:
        super().verify_()
        check_dim(self, self.dim, len(tensor_shape(self.lhs)))

    def sharding_rule(self) -> OpRule:
        d = factors("d", len(result_shape(self)))
        return OpRule((d, d), (d,), frozenset({1}), blocked=frozenset({d[self.dim.value.data]}))

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        axis = self.dim.value.data
        rows = along(axis, len(result_shape(self)))
        axis = -1 if rows is rowwise else axis  # row blocks come as 2-D views
        return rows(lambda y, dy, out=None: softmax_grad_values(y, dy, axis, out))

    def cuda_kernel(self, name: str) -> KernelCode:
        return _strided_softmax(name, self, True)

    def cuda_row(self, rk: RowKernel) -> KernelCode:
        _check_last_dim(self)
        return KernelCode(rk.fill(_SOFTMAX_GRAD), rk.launch())


@irdl_op_definition
class CausalMaskOp(UnaryOp):
    """Scores [..., Tq, Tk]: entries with key index j > query index i become `value` (-inf in
    the forward pass, so that softmax gives them 0; 0.0 for the gradient)."""

    name = "graph.causal_mask"
    value = prop_def(FloatAttr)
    OUT_FACTS: ClassVar[OutFacts] = FIRST
    #: the fused statement reads the row `r` and column `j` of the element (a kernel by rows)
    CUDA_NEEDS_ROWS: ClassVar[bool] = True
    FRONTEND: ClassVar[tuple[str, ...]] = ("causal_mask",)

    def __init__(self, input: SSAValue, value: float = float("-inf")):
        super().__init__(input, value=float_attr(value))

    def verify_(self) -> None:
        check_same_shape(self, self.input, self.result)
        check_float(self, self.input)
        if len(tensor_shape(self.input)) < 2:
            raise VerifyException(f"'{self.name}' needs scores [..., Tq, Tk]")

    def sharding_rule(self) -> OpRule:  # the mask compares global query and key indices: keep them whole
        d = factors("d", len(result_shape(self)))
        linear = frozenset({0}) if self.value.value.data == 0.0 else frozenset()
        return OpRule((d,), (d,), linear, blocked=frozenset(d[-2:]))

    def vjp(self, gs, emit):
        g = gs[0]
        return [lambda: emit(CausalMaskOp(g, 0.0))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        mask = overwrites_first(causal_mask_kernel(self.value.value.data))
        return by_rows(mask) if len(result_shape(self)) > 2 else mask

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        tq = shape(self.result)[-2]
        value = lit(prop(self, "value"), t)
        put(stmts, t, out[0], f"(j > r % {tq}L) ? {value} : {a[0]}")


# ----------------------------------------------------------------------------- frontend


def softmax(x, dim: int = -1):
    """Return `exp(x) / sum(exp(x))` along `dim` (computed stably)."""
    x = as_tensor(x, "softmax")
    require_float(x, "softmax")
    if x.dtype in REDUCED_PRECISION:
        return cast(softmax(cast(x, "float32"), dim), x.dtype)
    return x.tracer.emit(SoftmaxOp(x.value, norm_dim(x, dim, "softmax")))


def causal_mask(scores):
    """Return scores [..., Tq, Tk] with entries whose key index j > query index i set to -inf."""
    scores = as_tensor(scores, "causal_mask")
    if scores.ndim < 2:
        raise fail("causal_mask", f"needs scores [..., Tq, Tk], got {list(scores.shape)}")
    require_float(scores, "causal_mask")
    return scores.tracer.emit(CausalMaskOp(scores.value))


def _strided_softmax(name: str, op, grad: bool) -> KernelCode:
    """A softmax (`grad`: its gradient) along `op.dim` of a contiguous tensor: a block per row
    (every other dim's index), its threads striding along the dim."""
    dims = tensor_shape(op.results[0])
    d = op.dim.value.data
    strides = contiguous_strides(dims)
    others = [k for k in range(len(dims)) if k != d]
    base = offset_expr("r", [dims[k] for k in others], [strides[k] for k in others])
    at = f"base + j * {strides[d]}L"
    if grad:  # y * (dy - sum(dy * y))
        body = (f"    T s = 0;\n    HS_COLS_SUM(j, n1, s) s += in1[{at}] * in0[{at}];\n    s = hs_block_sum(s);\n"
                f"    HS_COLS(j, n1) out0[{at}] = in0[{at}] * (in1[{at}] - s);\n")
    else:
        body = (f"    T m = -HS_INF;\n    HS_COLS_MAX(j, n1, m) m = hs_max(m, in0[{at}]);\n    m = hs_block_max(m);\n"
                f"    T s = 0;\n    HS_COLS_SUM(j, n1, s) {{ const T e = hs_exp(in0[{at}] - m); out0[{at}] = e; s += e; }}\n"
                f"    const T inv = (T)1 / hs_block_sum(s);\n    HS_COLS(j, n1) out0[{at}] = out0[{at}] * inv;\n")
    src = (f"// {name}: {op.name} along dim {d}\n"
           f"HS_KERNEL void {name}({', '.join(kernel_params(op))}) {{\n"
           f"  HS_ROWS(r, n0) {{\n    const long base = {base};\n" + body + "  }\n}\n")
    rows = max(1, int(np.prod([dims[k] for k in others])))
    return KernelCode(retype(src, c_type(op.results[0].type)), [f"row {name} {rows} {dims[d]}"])
