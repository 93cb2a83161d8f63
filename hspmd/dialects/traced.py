"""What an op's frontend function may use of a traced tensor, and the error it raises.

The functions users call (`hs.gelu(x)`, `hs.cross_entropy(logits, labels)`) stand beside their
ops (`FRONTEND` in `dialects/interfaces.py`); `hspmd.frontend.ops` gathers them. They see a
traced tensor through a small protocol, which `hspmd.frontend.tracing.Tensor` implements:

* `value` (its SSA value), `shape`, `ndim`, `dtype` (a name: "float32", "int64", ...);
* the operators and methods of `Tensor` (`+`, `*`, `@`, `sum`, `mean`, `reshape`,
  `broadcast_binary`, ...);
* `tracer`, the function being built: `emit(op)` appends an op and returns its first result as
  a tensor, `emit_all(op)` all its results, `emit_void(op)` none; `tensor(value)` makes a value
  of the function a tensor; `constant(value, shape, dtype)` and `input(name, shape, dtype)` make
  a constant and a named input; `block` is the block being built.

A model's `Parameter` bound to the running trace becomes a tensor with `as_tensor`.

Bad arguments raise `TraceError` through `fail`, which names the line of the user's script
that called the function, the function and what is wrong.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from xdsl.dialects.builtin import TensorType

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
#: Like autocast: with float16/bfloat16 inputs, softmax, the norms and cross-entropy compute in
#: float32 and give back the input's dtype (cross-entropy gives float32): their sums and
#: exponentials need the range.
REDUCED_PRECISION = ("float16", "bfloat16")


class TraceError(Exception):
    """A model script asked for something that cannot be traced; says where and why."""


def user_location() -> str:
    """Return `file:line` of the innermost caller outside the hspmd package."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_PACKAGE_DIR + os.sep):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>"


def fail(op: str, message: str) -> TraceError:
    """Return a TraceError for `op` located at the user's script line."""
    return TraceError(f"{user_location()}: {op}: {message}")


def as_tensor(x: Any, op: str) -> Any:
    """Return `x` as a traced tensor (a tensor itself, or a Parameter bound to the trace)."""
    if hasattr(x, "tracer") and hasattr(x, "value"):
        return x
    if hasattr(x, "traced"):  # a Parameter bound to the running trace
        return x.traced(op)
    raise fail(op, f"expected a tensor, got {type(x).__name__}")


def require_float(x: Any, op: str) -> None:
    """Raise unless tensor `x` holds floats."""
    if x.dtype not in FLOAT_DTYPES:
        raise fail(op, f"needs a float tensor, got {x.dtype}")


def typed(x: Any, shape: Sequence[int]) -> TensorType:
    """Return the tensor type of `shape` with the element type of tensor `x`."""
    return TensorType(x.value.type.element_type, tuple(shape))


def norm_dim(x: Any, dim: int, op: str) -> int:
    """Return `dim` (negative: from the end) as an index into `x`'s dims; raise if out of range."""
    if not -x.ndim <= dim < x.ndim:
        raise fail(op, f"dim {dim} is out of range for a {x.ndim}-d tensor of shape {list(x.shape)}")
    return dim % x.ndim


def float_unary(cls: type, x: Any, op: str, **kwargs: Any) -> Any:
    """Return `cls(x, **kwargs)` emitted on float tensor `x` (an elementwise op's frontend)."""
    x = as_tensor(x, op)
    require_float(x, op)
    return x.tracer.emit(cls(x.value, **kwargs))
