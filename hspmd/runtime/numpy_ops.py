"""NumPy reference implementations of the `graph` ops, on local pieces.

Each maker takes the op (read once, when the plan is built) and returns a function of the
operand arrays, so that no xDSL object is touched while steps run.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from xdsl.ir import Operation

from hspmd.dialects import graph
from hspmd.ir.types import dtype_name

Kernel = Callable[..., np.ndarray]


def _result_shape(op: Operation) -> tuple[int, ...]:
    return op.results[0].type.get_shape()  # type: ignore[attr-defined]


def _result_dtype(op: Operation) -> np.dtype:
    return np.dtype(dtype_name(op.results[0].type))


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Return the per-sample loss `logsumexp(logits) - logits[label]`."""
    peak = logits.max(axis=1, keepdims=True)
    lse = np.log(np.exp(logits - peak).sum(axis=1)) + peak[:, 0]
    return (lse - np.take_along_axis(logits, labels[:, None].astype(np.int64), axis=1)[:, 0]).astype(logits.dtype)


def softmax_cross_entropy_grad(logits: np.ndarray, labels: np.ndarray, dloss: np.ndarray) -> np.ndarray:
    """Return `(softmax(logits) - onehot(labels)) * dloss[:, None]`."""
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    p[np.arange(len(labels)), labels] -= 1
    return (p * dloss[:, None]).astype(logits.dtype)


def kernel_for(op: Operation, rank: int = 0) -> Kernel:
    """Return the NumPy function that computes `op` from its operand arrays on `rank`.

    Most kernels ignore the rank; ops whose values depend on where a piece lies in the global
    tensor (counter-based dropout, positions) use it with the op's `global_type` layout.
    """
    match op:
        case graph.AddOp():
            return np.add
        case graph.SubOp():
            return np.subtract
        case graph.MulOp():
            return np.multiply
        case graph.ReluOp():
            return lambda x: np.maximum(x, 0)
        case graph.ReluGradOp():
            return lambda x, dy: np.where(x > 0, dy, 0).astype(dy.dtype)
        case graph.ScaleOp():
            factor = _result_dtype(op).type(op.factor.value.data)
            return lambda x: x * factor
        case graph.MatmulOp():
            return np.matmul
        case graph.TransposeOp():
            perm = op.perm.get_values()
            return lambda x: np.transpose(x, perm).copy()
        case graph.ReshapeOp():
            shape = _result_shape(op)
            return lambda x: x.reshape(shape)
        case graph.BroadcastOp():
            shape, dims = _result_shape(op), op.dims.get_values()
            placed = [1] * len(shape)

            def broadcast(x: np.ndarray) -> np.ndarray:
                view = list(placed)
                for i, d in enumerate(dims):
                    view[d] = x.shape[i]
                return np.broadcast_to(x.reshape(view), shape)

            return broadcast
        case graph.ReduceSumOp():
            dims = tuple(op.dims.get_values())
            dtype = _result_dtype(op)
            return lambda x: np.asarray(x.sum(axis=dims), dtype=dtype)
        case graph.SoftmaxCrossEntropyOp():
            return softmax_cross_entropy
        case graph.SoftmaxCrossEntropyGradOp():
            return softmax_cross_entropy_grad
    raise NotImplementedError(f"no NumPy kernel for '{op.name}'")
