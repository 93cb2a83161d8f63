"""Vocabulary-parallel cross-entropy (Megatron): the loss of logits split along the classes.

`graph.softmax_cross_entropy` keeps its class dim whole (its sharding rule blocks it), so logits
split over the vocabulary would be all-gathered in front of it. `split_cross_entropy(loss, tp)`
rewrites one loss and its gradients (`graph.softmax_cross_entropy_grad` of the same logits and
labels, the training step is already differentiated) into ops whose rules let the class dim
`c` stay split `tp` ways:

    m   = max(max(reshape(x, [..., tp, C/tp]), -1), -1)   per-row max, a stabiliser only
    z   = x - m                                             split along c
    e   = exp(z)
    s   = sum(e, -1)                                        partial over tp: one all-reduce
    zl  = sum(z * one_hot(labels), -1)                      partial over tp: one all-reduce
    loss = log(s) - zl                                      (times the label mask with ignore_index)
    dx  = (exp(z - log(s)) - one_hot(labels)) * dloss

Why no all-reduce-max collective: the max of a split dim is not a sum, and partial layouts
are sums (a max kind would need a new layout state and comm op). Instead the reshape puts each tp
rank's classes on one index of a new dim of extent tp (the reshape rule carries the class split
onto it), the inner max is local, and the outer max over that small dim gathers only
[..., tp] maxima (an all-gather of tp values per row instead of an all-reduce-max of one).
The stabiliser needs no gradient: the rewritten gradient is the exact softmax-minus-one-hot.
`graph.one_hot` finds its piece's classes from its annotated layout, so each rank picks the
label's logit only where it owns the label. With tp = 1 the program computes the same loss.
"""

from __future__ import annotations

from xdsl.dialects.builtin import TensorType
from xdsl.ir import Operation, SSAValue

from hspmd.dialects import graph


def _typed(like: SSAValue, shape) -> TensorType:
    return TensorType(like.type.element_type, shape)  # type: ignore[attr-defined]


def split_cross_entropy(loss: graph.SoftmaxCrossEntropyOp, tp: int) -> None:
    """Rewrite `loss` and the gradient ops of its logits into the vocabulary-parallel form (in place).

    `tp` must divide the class count (the caller checks: it is the head's split degree).
    """
    block = loss.parent_block()
    assert block is not None
    logits, labels = loss.logits, loss.labels
    shape = logits.type.get_shape()  # type: ignore[attr-defined]
    lead, classes = tuple(shape[:-1]), shape[-1]
    n = len(lead)
    ignore = loss.ignore_index.value.data if loss.ignore_index is not None else None

    def emit(op: Operation, before: Operation) -> SSAValue:
        block.insert_op_before(op, before)
        return op.results[0]

    def over_rows(v: SSAValue, before: Operation) -> SSAValue:  # [...] -> [..., C]
        return emit(graph.BroadcastOp(v, list(range(n)), _typed(v, shape)), before)

    chunks = emit(graph.ReshapeOp(logits, _typed(logits, (*lead, tp, classes // tp))), loss)
    chunk_max = emit(graph.ReduceMaxOp(chunks, [n + 1], _typed(logits, (*lead, tp))), loss)
    row_max = emit(graph.ReduceMaxOp(chunk_max, [n], _typed(logits, lead)), loss)
    z = emit(graph.SubOp(logits, over_rows(row_max, loss)), loss)
    e = emit(graph.ExpOp(z), loss)
    s = emit(graph.ReduceSumOp(e, [n], _typed(e, lead)), loss)
    hot = emit(graph.OneHotOp(labels, _typed(logits, shape)), loss)
    picked = emit(graph.ReduceSumOp(emit(graph.MulOp(z, hot), loss), [n], _typed(z, lead)), loss)
    log_s = emit(graph.LogOp(s), loss)  # not linear: the partial sums are all-reduced before it
    value = emit(graph.SubOp(log_s, picked), loss)
    mask = None
    if ignore is not None:
        mask = emit(graph.LabelMaskOp(labels, ignore, _typed(logits, lead)), loss)
        value = emit(graph.MulOp(value, mask), loss)
    loss.result.replace_all_uses_with(value)

    grads = [u.operation for u in list(logits.uses) if isinstance(u.operation, graph.SoftmaxCrossEntropyGradOp)
             and u.index == 0 and u.operation.labels == labels
             and (u.operation.ignore_index.value.data if u.operation.ignore_index is not None else None) == ignore]
    for grad in grads:
        dloss = grad.dloss
        if mask is not None:
            dloss = emit(graph.MulOp(dloss, mask), grad)
        probs = emit(graph.ExpOp(emit(graph.SubOp(z, over_rows(log_s, grad)), grad)), grad)
        dx = emit(graph.MulOp(emit(graph.SubOp(probs, hot), grad), over_rows(dloss, grad)), grad)
        grad.result.replace_all_uses_with(dx)
        grad.detach()
        grad.erase()
    loss.detach()
    loss.erase()
