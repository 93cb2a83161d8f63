"""Embeddings and losses: row lookup and its gradient, softmax and binary cross-entropy with
their gradients, one-hot labels and the label mask of an ignored index."""

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

from hspmd.dialects.cuda_c import KernelCode, RowKernel, c_type, lit, put
from hspmd.dialects.dist import layout_of
from hspmd.dialects.graph.activations import sigmoid_values
from hspmd.dialects.graph.arithmetic import MulOp, ScaleOp, cast, divide
from hspmd.dialects.graph.base import (
    BinaryOp,
    TensorOp,
    UnaryOp,
    check_float,
    check_integer,
    check_same_element_type,
    check_same_shape,
    int_attr,
    result_dtype,
    result_shape,
    tensor_shape,
)
from hspmd.dialects.interfaces import Kernel, KernelContext
from hspmd.dialects.op_rule import OpRule, elementwise_rule, factors
from hspmd.dialects.traced import REDUCED_PRECISION, as_tensor, fail, require_float, typed
from hspmd.ir.layout import PARTIAL

__all__ = [
    "EmbeddingOp",
    "EmbeddingGradOp",
    "SoftmaxCrossEntropyOp",
    "SoftmaxCrossEntropyGradOp",
    "OneHotOp",
    "LabelMaskOp",
    "BinaryCrossEntropyOp",
    "BinaryCrossEntropyGradOp",
]


# ----------------------------------------------------------------------------- a split vocabulary


def _annotated(op: Operation, rank: int):
    """Return (global shape, layout) of `op`'s result from its `global_type`, or None where the
    op runs whole (logical IR, a one-device program, or a rank the layout does not name)."""
    typ = getattr(op, "global_type", None)
    layout = layout_of(typ) if typ is not None else None
    if layout is None or rank not in layout.devices:
        return None
    return typ.get_shape(), layout  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- embeddings


#: groups of more repeats of one id than this are summed one group at a time (`np.add.reduce`);
#: the others in one vectorized pass per repeat
_SCATTER_PASSES = 16


def scatter_add_rows(out: np.ndarray, index: np.ndarray, rows: np.ndarray, native=None) -> np.ndarray:
    """Add row i of `rows` into row `index[i]` of `out`, in place, in the order of i; return `out`.

    The same bits as `np.add.at(out, index, rows)` (each row of `out` gets its rows added one
    by one in order). With `native` (the runtime's `hspmd.runtime.native`, as a kernel gets it
    in `KernelContext.native`; None: NumPy only) in one C++ pass where its library is built
    (`native.scatter_add_rows`: 0.1 ms against 1.1-1.4 ms for GPT-tiny's 2048 ids). Else
    about 9x faster than `np.add.at` on a GPT's ids: the rows are grouped by index (a
    stable sort) and the k-th row of every group is added in one vectorized pass, so the
    passes number the most repeats of one index among the groups of at most `_SCATTER_PASSES`
    rows. A larger group (a byte-level GPT's space: hundreds of repeats) is added into its row
    of `out` row after row on its own (`np.add.reduce`, `reduceat` and `accumulate` over the
    leading axis sum pairwise or cast differently for some shapes and dtypes: other bits).
    """
    if index.size == 0 or native is not None and native.scatter_add_rows(out, index, rows):
        return out
    order = np.argsort(index, kind="stable")
    sorted_index = index[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_index[1:] != sorted_index[:-1])))
    counts = np.diff(np.append(starts, index.size))
    grouped = rows[order]
    targets = sorted_index[starts]
    large = counts > _SCATTER_PASSES
    for t, s, c in zip(targets[large], starts[large], counts[large]):
        acc = out[t]
        for row in grouped[s:s + c]:
            np.add(acc, row, out=acc)
    small = ~large
    for k in range(int(counts[small].max(initial=0))):
        more = small & (counts > k)
        out[targets[more]] += grouped[starts[more] + k]
    return out


def embedding_grad_values(ids: np.ndarray, dy: np.ndarray, vocab: int, native=None) -> np.ndarray:
    """Scatter-add the rows of `dy` into a zero [vocab, D] table at `ids` (in the order of the ids;
    `native` as for `scatter_add_rows`)."""
    out = np.zeros((vocab, dy.shape[-1]), dtype=dy.dtype)
    return scatter_add_rows(out, ids.reshape(-1), dy.reshape(-1, dy.shape[-1]), native)


@irdl_op_definition
class EmbeddingOp(TensorOp):
    """Row lookup `table[ids]`: table [V, D], integer ids [...] -> [..., D]."""

    name = "graph.embedding"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.embedding.default",)
    table = operand_def(TensorType)
    ids = operand_def(TensorType)
    result = result_def(TensorType)
    global_type = opt_prop_def(TypeAttribute)
    traits = traits_def(Pure())
    #: a vocabulary-split table gives a partial result (each rank looks up the rows it owns,
    #: zeros elsewhere): the kernel finds its rows' offset from the result's annotated layout
    RECORDS_GLOBAL_TYPE: ClassVar[bool] = True
    FRONTEND: ClassVar[tuple[str, ...]] = ("embedding",)

    def __init__(self, table: SSAValue, ids: SSAValue, result_type: Attribute):
        super().__init__(operands=[table, ids], result_types=[result_type])

    def verify_(self) -> None:
        t, i, r = tensor_shape(self.table), tensor_shape(self.ids), tensor_shape(self.result)
        if len(t) != 2 or r != (*i, t[1]):
            raise VerifyException(f"'{self.name}' needs table [V, D] and ids [...] giving [..., D], "
                                  f"got {list(t)}, {list(i)} -> {list(r)}")
        check_integer(self, self.ids, "ids")
        check_same_element_type(self, self.table, self.result)

    def sharding_rule(self) -> OpRule:
        # vocabulary-parallel (Megatron): a table split along V gives each rank the rows it
        # owns and zeros for other ids, so `v`, missing from the result, leaves partial sums.
        # Not linear in the table: a partial result then always means a split vocabulary
        # (the kernel reads its rows' offset from the partial coordinate).
        b = factors("b", len(tensor_shape(self.ids)))
        return OpRule((("v", "e"), b), ((*b, "e"),))

    def vjp(self, gs, emit):
        g = gs[0]
        return [lambda: emit(EmbeddingGradOp(self.ids, g, self.table.type)), None]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        """`table[ids]`; with a vocabulary-split table (a partial result) the rows this rank owns,
        zeros for the other ids: its table piece starts at (its coordinate on the partial axis) * rows."""
        rank = ctx.rank
        found = _annotated(self, rank)
        part = None
        if found is not None:
            layout = found[1]
            for group in layout.groups:
                if rank in group.devices:
                    part = group.states.coords(group.devices.index(rank)).get(PARTIAL)
        if part is None:
            return lambda table, ids: table[ids]

        def lookup(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
            local = ids - part * table.shape[0]
            inside = (local >= 0) & (local < table.shape[0])
            out = table[np.where(inside, local, 0)]
            out[~inside] = 0
            return out

        return lookup


@irdl_op_definition
class EmbeddingGradOp(TensorOp):
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
    NO_VJP: ClassVar[str] = "a gradient op (no second derivatives)"

    def __init__(self, ids: SSAValue, dy: SSAValue, result_type: Attribute):
        super().__init__(operands=[ids, dy], result_types=[result_type])

    def verify_(self) -> None:
        i, g, r = tensor_shape(self.ids), tensor_shape(self.dy), tensor_shape(self.result)
        if len(r) != 2 or g != (*i, r[1]):
            raise VerifyException(f"'{self.name}' needs ids [...] and dy [..., D] giving [V, D], "
                                  f"got {list(i)}, {list(g)} -> {list(r)}")
        check_integer(self, self.ids, "ids")
        check_same_element_type(self, self.dy, self.result)

    def sharding_rule(self) -> OpRule:
        # the id dims are summed over: split, they leave partial sums;
        # a result split along V scatters only its ids' rows
        b = factors("b", len(tensor_shape(self.ids)))
        return OpRule((b, (*b, "e")), (("v", "e"),), frozenset({1}))

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        """Scatter-add `dy` at `ids` into this rank's rows of the table gradient (all rows, or the
        vocabulary range its result piece covers when the result is split along V)."""
        rank, native = ctx.rank, ctx.native
        vocab = result_shape(self)[0]
        found = _annotated(self, rank)
        start = found[1].slices(rank, found[0])[0].start if found is not None else 0
        if start == 0 and (found is None or found[0][0] == vocab):
            return lambda ids, dy: embedding_grad_values(ids, dy, vocab, native)

        def grad(ids: np.ndarray, dy: np.ndarray) -> np.ndarray:
            local = ids.reshape(-1) - start
            inside = (local >= 0) & (local < vocab)
            out = np.zeros((vocab, dy.shape[-1]), dtype=dy.dtype)
            return scatter_add_rows(out, local[inside], dy.reshape(-1, dy.shape[-1])[inside], native)

        return grad


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
        found = _annotated(self, rank)
        start = found[1].slices(rank, found[0])[-1].start if found is not None else 0
        classes = np.arange(start, start + shape[-1])
        return lambda labels: (labels[..., None] == classes).astype(dtype)


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


def embedding(table, ids):
    """Return `table[ids]`: table [V, D] float, integer ids [...] -> [..., D]."""
    table, ids = as_tensor(table, "embedding"), as_tensor(ids, "embedding")
    if table.ndim != 2:
        raise fail("embedding", f"the table must be [V, D], got {list(table.shape)}")
    if not ids.dtype.startswith("int"):
        raise fail("embedding", f"ids must be integers, got {ids.dtype}")
    require_float(table, "embedding")
    return table.tracer.emit(EmbeddingOp(table.value, ids.value, typed(table, (*ids.shape, table.shape[1]))))


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
