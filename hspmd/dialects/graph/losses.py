"""Losses: softmax and binary cross-entropy with their gradients, one-hot labels and the label
mask of an ignored index."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from xdsl.dialects.builtin import (
    I64,
    IntegerAttr,
    TensorType,
    TypeAttribute,
)
from xdsl.ir import Attribute, Operation, SSAValue
from xdsl.irdl import (
    irdl_op_definition,
    operand_def,
    opt_prop_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.cuda_c import KernelCode, RowKernel, c_type, flat_kernel, lit, put, rank_defaults, rank_value
from hspmd.dialects.graph.activations import sigmoid_values
from hspmd.dialects.graph.arithmetic import MulOp, ScaleOp, cast, divide
from hspmd.dialects.graph.base import (
    BinaryOp,
    TensorOp,
    UnaryOp,
    check_float,
    check_integer,
    check_same_shape,
    int_attr,
    piece_starts,
    result_dtype,
    result_shape,
    tensor_shape,
)
from hspmd.dialects.graph.embedding import annotated_piece
from hspmd.dialects.interfaces import Kernel, KernelContext
from hspmd.dialects.op_rule import OpRule, elementwise_rule, factors
from hspmd.dialects.traced import (
    REDUCED_PRECISION,
    as_tensor,
    fail,
    require_float,
    typed,
)

__all__ = [
    "SoftmaxCrossEntropyOp",
    "SoftmaxCrossEntropyGradOp",
    "OneHotOp",
    "LabelMaskOp",
    "BinaryCrossEntropyOp",
    "BinaryCrossEntropyGradOp",
]


# ----------------------------------------------------------------------------- softmax cross-entropy


def _valid(labels: np.ndarray, ignore_index: int | None) -> np.ndarray | None:
    return None if ignore_index is None else labels != ignore_index


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def softmax_cross_entropy_values(logits: np.ndarray, labels: np.ndarray,
                                 ignore_index: int | None = None) -> np.ndarray:
    """Return the per-sample loss `logsumexp(logits) - logits[label]` over the last dim (0 where
    the label is `ignore_index`)."""
    valid = _valid(labels, ignore_index)
    idx = labels.astype(np.int64) if valid is None else np.where(valid, labels, 0).astype(np.int64)
    peak = logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(logits - peak).sum(axis=-1)) + peak[..., 0]
    loss = lse - np.take_along_axis(logits, idx[..., None], axis=-1)[..., 0]
    if valid is not None:
        loss = np.where(valid, loss, 0)
    return np.asarray(loss, dtype=logits.dtype)


def softmax_cross_entropy_grad_values(
    logits: np.ndarray, labels: np.ndarray, dloss: np.ndarray, ignore_index: int | None = None
) -> np.ndarray:
    """Return `(softmax(logits) - onehot(labels)) * dloss[..., None]` (0 rows where ignored)."""
    valid = _valid(labels, ignore_index)
    idx = labels.astype(np.int64) if valid is None else np.where(valid, labels, 0).astype(np.int64)
    p = _softmax(logits, -1)
    np.put_along_axis(p, idx[..., None], np.take_along_axis(p, idx[..., None], axis=-1) - 1, axis=-1)
    scale = dloss if valid is None else np.where(valid, dloss, 0)
    return (p * scale[..., None]).astype(logits.dtype)


_XENT = """\
// {name}: softmax cross-entropy per row
HS_KERNEL void {name}(XPARAM, const L* __restrict__ labels, T* __restrict__ loss, long rows, long cols) {
  HS_ROWS(r, rows) {
    XDECL
    T m = -HS_INF;
    HS_COLS_MAX(j, cols, m) m = hs_max(m, XLOAD[j]);
    m = hs_block_max(m);
    T s = 0;
    HS_COLS_SUM(j, cols, s) s += hs_exp(XLOAD[j] - m);
    s = hs_block_sum(s);
    if (threadIdx.x == 0) {
      const long lab = (long)labels[r];
      const T picked = (lab >= 0 && lab < cols) ? XLOAD[lab] : (T)HS_NAN;
      const T value = (hs_log(s) + m) - picked;
      loss[r] = {ignored} ? (T)0 : value;
    }
  }
}
"""

_XENT_GRAD = """\
// {name}: softmax cross-entropy backward
HS_KERNEL void {name}(XPARAM, const L* __restrict__ labels, const T* __restrict__ dloss,
                      T* __restrict__ dx, long rows, long cols) {
  HS_ROWS(r, rows) {
    XDECL
    T* dr = dx + r * cols;
    T m = -HS_INF;
    HS_COLS_MAX(j, cols, m) m = hs_max(m, XLOAD[j]);
    m = hs_block_max(m);
    T s = 0;
    HS_COLS_SUM(j, cols, s) {
      const T e = hs_exp(XLOAD[j] - m);
      dr[j] = e;
      s += e;
    }
    const T inv = (T)1 / hs_block_sum(s);
    const long lab = (long)labels[r];
    // a label out of range gives NaN (NumPy raises an IndexError)
    const T scale = {ignored} ? (T)0 : ((lab >= 0 && lab < cols) ? dloss[r] : (T)HS_NAN);
    HS_COLS(j, cols) dr[j] = (dr[j] * inv - (j == lab ? (T)1 : (T)0)) * scale;
  }
}
"""


def _ignore_index(op: Operation) -> int | None:
    """Return the `ignore_index` of a softmax cross-entropy op (None where it has none)."""
    return op.ignore_index.value.data if op.ignore_index is not None else None  # type: ignore[attr-defined]


def _xent_row(op: Operation, rk: RowKernel, template: str) -> KernelCode:
    """Return the row kernel of a softmax cross-entropy op (or its gradient) from `template`: the
    labels' C type for `L`, and whether a row's label is the ignored index for `{ignored}`."""
    lab = c_type(op.operands[1].type)
    ignore = _ignore_index(op)
    ignored = "false" if ignore is None else f"(labels[r] == ({lab}){ignore})"
    src = rk.fill(template, ignored=ignored).replace("const L*", f"const {lab}*")
    return KernelCode(src, rk.launch(), [])


@irdl_op_definition
class SoftmaxCrossEntropyOp(TensorOp):
    """Per-sample loss `logsumexp(logits[s]) - logits[s, labels[s]]`: [..., C], [...] -> [...].

    With `ignore_index`, samples whose label equals it get loss 0."""

    name = "graph.softmax_cross_entropy"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.cross_entropy_loss.default",)
    logits = operand_def(TensorType)
    labels = operand_def(TensorType)
    result = result_def(TensorType)
    ignore_index = opt_prop_def(IntegerAttr[I64])
    traits = traits_def(Pure())
    CUDA_ROW_PROLOGUE: ClassVar[bool] = True
    FRONTEND: ClassVar[tuple[str, ...]] = ("cross_entropy",)

    def __init__(self, logits: SSAValue, labels: SSAValue, result_type: Attribute, ignore_index: int | None = None):
        props = {} if ignore_index is None else {"ignore_index": int_attr(ignore_index)}
        super().__init__(operands=[logits, labels], result_types=[result_type], properties=props)

    def verify_(self) -> None:
        lg, lb, r = tensor_shape(self.logits), tensor_shape(self.labels), tensor_shape(self.result)
        if len(lg) < 1 or lb != lg[:-1] or r != lg[:-1]:
            raise VerifyException(f"'{self.name}' needs logits [..., C] and labels [...], got {list(lg)} and {list(lb)}")
        check_integer(self, self.labels, "labels")

    def sharding_rule(self) -> OpRule:
        b = factors("b", len(tensor_shape(self.labels)))
        return OpRule(((*b, "c"), b), (b,), blocked=frozenset({"c"}))

    def vjp(self, gs, emit):
        g = gs[0]
        ignore = _ignore_index(self)
        return [lambda: emit(SoftmaxCrossEntropyGradOp(self.logits, self.labels, g, ignore)), None]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        ignore = _ignore_index(self)
        return lambda logits, labels: softmax_cross_entropy_values(logits, labels, ignore)

    def cuda_row(self, rk: RowKernel) -> KernelCode:
        return _xent_row(self, rk, _XENT)


@irdl_op_definition
class SoftmaxCrossEntropyGradOp(TensorOp):
    """`(softmax(logits) - onehot(labels)) * dloss[..., None]`: the gradient w.r.t. the logits
    (0 for samples whose label is `ignore_index`)."""

    name = "graph.softmax_cross_entropy_grad"
    logits = operand_def(TensorType)
    labels = operand_def(TensorType)
    dloss = operand_def(TensorType)
    result = result_def(TensorType)
    ignore_index = opt_prop_def(IntegerAttr[I64])
    traits = traits_def(Pure())
    NO_VJP: ClassVar[str] = "a gradient op (no second derivatives)"
    CUDA_ROW_PROLOGUE: ClassVar[bool] = True

    def __init__(self, logits: SSAValue, labels: SSAValue, dloss: SSAValue, ignore_index: int | None = None):
        props = {} if ignore_index is None else {"ignore_index": int_attr(ignore_index)}
        super().__init__(operands=[logits, labels, dloss], result_types=[logits.type], properties=props)

    def verify_(self) -> None:
        lg, lb, d = tensor_shape(self.logits), tensor_shape(self.labels), tensor_shape(self.dloss)
        if len(lg) < 1 or lb != lg[:-1] or d != lg[:-1] or tensor_shape(self.result) != lg:
            raise VerifyException(f"'{self.name}' needs logits [..., C], labels [...], dloss [...]")

    def sharding_rule(self) -> OpRule:
        b = factors("b", len(tensor_shape(self.labels)))
        return OpRule(((*b, "c"), b, b), ((*b, "c"),), frozenset({2}), blocked=frozenset({"c"}))

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        ignore = _ignore_index(self)
        return lambda logits, labels, dloss: softmax_cross_entropy_grad_values(logits, labels, dloss, ignore)

    def cuda_row(self, rk: RowKernel) -> KernelCode:
        return _xent_row(self, rk, _XENT_GRAD)


# ----------------------------------------------------------------------------- labels


@irdl_op_definition
class OneHotOp(TensorOp):
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
    NO_FRONTEND: ClassVar[str] = "made by vocab-parallel (a cross-entropy over a split vocabulary)"

    def __init__(self, labels: SSAValue, result_type: Attribute):
        super().__init__(operands=[labels], result_types=[result_type])

    def verify_(self) -> None:
        lb, r = tensor_shape(self.labels), tensor_shape(self.result)
        if len(r) != len(lb) + 1 or r[:-1] != lb:
            raise VerifyException(f"'{self.name}' needs labels [...] giving [..., C], got {list(lb)} -> {list(r)}")
        check_integer(self, self.labels, "labels")
        check_float(self, self.result)

    def sharding_rule(self) -> OpRule:  # classes are global indices along the last dim: any split is fine
        b = factors("b", len(tensor_shape(self.labels)))
        return OpRule((b,), ((*b, "c"),))

    def vjp(self, gs, emit):
        return [None]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        """`labels[..., None] == classes` for the classes (global indices along the last dim) of this piece."""
        rank = ctx.rank
        shape, dtype = result_shape(self), result_dtype(self)
        found = annotated_piece(self, rank)
        start = found[1].slices(rank, found[0])[-1].start if found is not None else 0
        classes = np.arange(start, start + shape[-1])
        return lambda labels: (labels[..., None] == classes).astype(dtype)

    def cuda_kernel(self, name: str) -> KernelCode:
        classes = result_shape(self)[-1]
        starts = piece_starts(self)  # a piece split along C: its classes start where it starts
        last = len(result_shape(self)) - 1
        code = flat_kernel(name, self, c_type(self.result.type),
                           f"out0[i] = ((long)in0[i / {classes}L] == i % {classes}L + {rank_value(name, last)}) "
                           "? (T)1 : (T)0;")
        return KernelCode(rank_defaults(name, [0] * (last + 1)) + code.source, code.launches, rank_values=starts)


@irdl_op_definition
class LabelMaskOp(UnaryOp):
    """1.0 where the integer `labels` differ from `ignore_index`, else 0.0 (a float result)."""

    name = "graph.label_mask"
    ignore_index = prop_def(IntegerAttr[I64])
    #: cross_entropy(..., ignore_index=i) counts the samples it keeps with it (so does vocab-parallel)
    FRONTEND: ClassVar[tuple[str, ...]] = ("cross_entropy",)

    def __init__(self, labels: SSAValue, ignore_index: int, result_type: Attribute):
        super().__init__(labels, result_type, ignore_index=int_attr(ignore_index))

    def verify_(self) -> None:
        check_same_shape(self, self.input, self.result)
        check_integer(self, self.input, "labels")
        check_float(self, self.result)

    def sharding_rule(self) -> OpRule:
        return elementwise_rule(self)

    def vjp(self, gs, emit):
        return [None]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        ignore, dtype = self.ignore_index.value.data, result_dtype(self)
        return lambda labels: (labels != ignore).astype(dtype)

    def cuda_kernel(self, name: str) -> KernelCode:
        return flat_kernel(name, self, c_type(self.result.type),
                           f"out0[i] = ((long)in0[i] != {self.ignore_index.value.data}L) ? (T)1 : (T)0;")


# ----------------------------------------------------------------------------- binary cross-entropy


@irdl_op_definition
class BinaryCrossEntropyOp(BinaryOp):
    """Elementwise binary cross-entropy of logits `z` (lhs) against labels `y` in [0, 1] (rhs):
    `max(z, 0) - z y + log(1 + exp(-|z|))`, which is `-(y log s + (1 - y) log(1 - s))` for
    `s = sigmoid(z)` without overflow or lost precision (torch's `binary_cross_entropy_with_logits`)."""

    name = "graph.binary_cross_entropy"
    FRONTEND: ClassVar[tuple[str, ...]] = ("binary_cross_entropy_with_logits",)

    def sharding_rule(self) -> OpRule:
        return elementwise_rule(self)

    def vjp(self, gs, emit):  # d/dz = sigmoid(z) - y, d/dy = -z
        g = gs[0]
        return [lambda: emit(BinaryCrossEntropyGradOp(self.lhs, self.rhs, g)),
                lambda: emit(ScaleOp(emit(MulOp(g, self.lhs)), -1.0))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return lambda z, y: np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        (z, y), r = a, out[0]
        stmts.append(f"const {t} {r}_p = {z} > ({t})0 ? {z} : ({t})0;")  # max(z, 0); -|z| = z - 2 max(z, 0)
        put(stmts, t, r, f"{r}_p - {z} * {y} + hs_log({lit(1.0, t)} + hs_exp({z} - {lit(2.0, t)} * {r}_p))")


@irdl_op_definition
class BinaryCrossEntropyGradOp(TensorOp):
    """`(sigmoid(z) - y) * dy`: the gradient of `graph.binary_cross_entropy` with respect to `z`."""

    name = "graph.binary_cross_entropy_grad"
    logits = operand_def(TensorType)
    labels = operand_def(TensorType)
    dy = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    NO_VJP: ClassVar[str] = "a gradient op (no second derivatives)"

    def __init__(self, logits: SSAValue, labels: SSAValue, dy: SSAValue):
        super().__init__(operands=[logits, labels, dy], result_types=[logits.type])

    def verify_(self) -> None:
        check_same_shape(self, self.logits, self.labels, self.result)
        check_same_shape(self, self.dy, self.result)

    def sharding_rule(self) -> OpRule:  # linear in the incoming gradient
        return elementwise_rule(self, frozenset({2}))

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return lambda z, y, dy: (sigmoid_values(z) - y) * dy

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        put(stmts, t, out[0], f"(hs_sigmoid({a[0]}) - {a[1]}) * {a[2]}")


# ----------------------------------------------------------------------------- frontend


def cross_entropy(logits, labels, ignore_index: int | None = None):
    """Return the mean softmax cross-entropy of `logits` [..., C] against integer `labels` [...].

    With `ignore_index`, samples labelled so are left out: the mean is over the others (their
    count is computed at run time, so it stays right when the batch is split).
    """
    logits, labels = as_tensor(logits, "cross_entropy"), as_tensor(labels, "cross_entropy")
    if logits.ndim < 1 or labels.shape != logits.shape[:-1]:
        raise fail("cross_entropy", f"needs logits [..., C] and labels [...], got {list(logits.shape)} "
                                    f"and {list(labels.shape)}")
    if not labels.dtype.startswith("int"):
        raise fail("cross_entropy", f"labels must be integers, got {labels.dtype}")
    require_float(logits, "cross_entropy")
    if logits.dtype in REDUCED_PRECISION:
        logits = cast(logits, "float32")
    ignore = None if ignore_index is None else int(ignore_index)
    per_sample = logits.tracer.emit(
        SoftmaxCrossEntropyOp(logits.value, labels.value, typed(logits, labels.shape), ignore)
    )
    if ignore is None:
        return per_sample.mean()
    mask = logits.tracer.emit(LabelMaskOp(labels.value, ignore, typed(logits, labels.shape)))
    return divide(per_sample.sum(), mask.sum())


def binary_cross_entropy_with_logits(logits, labels):
    """Return the mean over all elements of `-(y log sigmoid(z) + (1 - y) log(1 - sigmoid(z)))`.

    One `graph.binary_cross_entropy` op per element, `max(z, 0) - z y + log(1 + exp(-|z|))` (as
    torch's `binary_cross_entropy_with_logits`), which neither overflows nor loses the small
    losses of confident logits, then the mean; `labels` are floats in [0, 1] of the logits' shape.
    """
    logits = as_tensor(logits, "binary_cross_entropy_with_logits")
    labels = as_tensor(labels, "binary_cross_entropy_with_logits")
    if logits.shape != labels.shape:
        raise fail("binary_cross_entropy_with_logits",
                   f"logits {list(logits.shape)} and labels {list(labels.shape)} need the same shape")
    require_float(logits, "binary_cross_entropy_with_logits")
    require_float(labels, "binary_cross_entropy_with_logits")
    per = logits.tracer.emit(BinaryCrossEntropyOp(logits.value, labels.value))
    return per.mean()
