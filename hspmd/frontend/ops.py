"""The functional op set of the frontend: `hs.relu(x)`, `hs.cross_entropy(logits, labels)`, ...

Each function checks shapes and dtypes (a `TraceError` names the script line, the op and the
shapes) and appends `graph` ops through the tensor's tracer.
"""

from __future__ import annotations

from xdsl.dialects.builtin import TensorType

from hspmd.dialects import graph
from hspmd.frontend.tracing import Tensor, fail


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Return `a @ b` for 2-D tensors."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise fail("matmul", f"cannot multiply {list(a.shape)} by {list(b.shape)}")
    if a.dtype != b.dtype:
        raise fail("matmul", f"operands have dtypes {a.dtype} and {b.dtype}")
    typ = TensorType(a.value.type.element_type, (a.shape[0], b.shape[1]))
    return a.tracer.emit(graph.MatmulOp(a.value, b.value, typ))


def relu(x: Tensor) -> Tensor:
    """Return `max(x, 0)` elementwise."""
    return x.tracer.emit(graph.ReluOp(x.value))


def cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Return the mean softmax cross-entropy of `logits` [B, C] against integer `labels` [B]."""
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise fail("cross_entropy", f"needs logits [B, C] and labels [B], got {list(logits.shape)} and {list(labels.shape)}")
    if not labels.dtype.startswith("int"):
        raise fail("cross_entropy", f"labels must be integers, got {labels.dtype}")
    per_sample = logits.tracer.emit(
        graph.SoftmaxCrossEntropyOp(logits.value, labels.value, TensorType(logits.value.type.element_type, labels.shape))
    )
    return per_sample.mean()
