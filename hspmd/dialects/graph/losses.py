"""Embeddings and losses: row lookup and its gradient, softmax and binary cross-entropy with
their gradients, one-hot labels and the label mask of an ignored index."""

from __future__ import annotations

from typing import ClassVar

from xdsl.dialects.builtin import (
    I64,
    IntegerAttr,
    TensorType,
    TypeAttribute,
)
from xdsl.ir import Attribute, SSAValue
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

from hspmd.dialects.graph.base import tensor_shape, check_same_shape, check_same_element_type, TensorOp, BinaryOp, UnaryOp, check_float, check_integer, int_attr

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


@irdl_op_definition
class EmbeddingOp(TensorOp):
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
        check_integer(self, self.ids, "ids")
        check_same_element_type(self, self.table, self.result)


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

    def __init__(self, ids: SSAValue, dy: SSAValue, result_type: Attribute):
        super().__init__(operands=[ids, dy], result_types=[result_type])

    def verify_(self) -> None:
        i, g, r = tensor_shape(self.ids), tensor_shape(self.dy), tensor_shape(self.result)
        if len(r) != 2 or g != (*i, r[1]):
            raise VerifyException(f"'{self.name}' needs ids [...] and dy [..., D] giving [V, D], "
                                  f"got {list(i)}, {list(g)} -> {list(r)}")
        check_integer(self, self.ids, "ids")
        check_same_element_type(self, self.dy, self.result)


@irdl_op_definition
class SoftmaxCrossEntropyOp(TensorOp):
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
        check_integer(self, self.labels, "labels")


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

    def __init__(self, logits: SSAValue, labels: SSAValue, dloss: SSAValue, ignore_index: int | None = None):
        props = {} if ignore_index is None else {"ignore_index": int_attr(ignore_index)}
        super().__init__(operands=[logits, labels, dloss], result_types=[logits.type], properties=props)

    def verify_(self) -> None:
        lg, lb, d = tensor_shape(self.logits), tensor_shape(self.labels), tensor_shape(self.dloss)
        if len(lg) < 1 or lb != lg[:-1] or d != lg[:-1] or tensor_shape(self.result) != lg:
            raise VerifyException(f"'{self.name}' needs logits [..., C], labels [...], dloss [...]")


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

    def __init__(self, labels: SSAValue, result_type: Attribute):
        super().__init__(operands=[labels], result_types=[result_type])

    def verify_(self) -> None:
        lb, r = tensor_shape(self.labels), tensor_shape(self.result)
        if len(r) != len(lb) + 1 or r[:-1] != lb:
            raise VerifyException(f"'{self.name}' needs labels [...] giving [..., C], got {list(lb)} -> {list(r)}")
        check_integer(self, self.labels, "labels")
        check_float(self, self.result)


@irdl_op_definition
class LabelMaskOp(UnaryOp):
    """1.0 where the integer `labels` differ from `ignore_index`, else 0.0 (a float result)."""

    name = "graph.label_mask"
    ignore_index = prop_def(IntegerAttr[I64])

    def __init__(self, labels: SSAValue, ignore_index: int, result_type: Attribute):
        super().__init__(labels, result_type, ignore_index=int_attr(ignore_index))

    def verify_(self) -> None:
        check_same_shape(self, self.input, self.result)
        check_integer(self, self.input, "labels")
        check_float(self, self.result)


@irdl_op_definition
class BinaryCrossEntropyOp(BinaryOp):
    """Elementwise binary cross-entropy of logits `z` (lhs) against labels `y` in [0, 1] (rhs):
    `max(z, 0) - z y + log(1 + exp(-|z|))`, which is `-(y log s + (1 - y) log(1 - s))` for
    `s = sigmoid(z)` without overflow or lost precision (torch's `binary_cross_entropy_with_logits`)."""

    name = "graph.binary_cross_entropy"


@irdl_op_definition
class BinaryCrossEntropyGradOp(TensorOp):
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
        check_same_shape(self, self.logits, self.labels, self.result)
        check_same_shape(self, self.dy, self.result)
