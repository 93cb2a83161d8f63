"""Tracing: run a model written for one device on symbolic tensors and record the logical IR.

A `Tracer` owns one `func.func` being built; a `Tensor` is an SSA value of it plus the
tracer. Operators on tensors append `graph` ops. Shape errors raise `TraceError` naming the
line of the user's script that made the op, the op, and the shapes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.ir import Block, Region, SSAValue

from hspmd.dialects import graph
from hspmd.dialects.traced import TraceError, fail
from hspmd.ir.types import dtype_name, element_type

__all__ = ["Tensor", "TraceError", "Tracer", "broadcast_shape", "fail"]


class Tracer:
    """Builds the logical `func.func @train_step` one op at a time."""

    def __init__(self, func_name: str = "train_step", functions: dict | None = None) -> None:
        self.block = Block()
        self.func_name = func_name
        self.names: set[str] = set()
        # callee functions traced once and called per use (see hspmd.frontend.functions),
        # shared with the tracers of those functions
        self.functions: dict = {} if functions is None else functions
        self.call_counts: dict = {}  # calls made so far per function (for per-call counters)

    def emit(self, op) -> Tensor:
        """Append `op` and return its (single) result as a Tensor."""
        self.block.add_op(op)
        return Tensor(op.results[0], self)

    def emit_void(self, op) -> None:
        """Append `op`, whose results (if any) the caller does not need as tensors."""
        self.block.add_op(op)

    def tensor(self, value: SSAValue) -> Tensor:
        """Return `value`, a value of the function being built, as a Tensor."""
        return Tensor(value, self)

    def emit_all(self, op) -> list[Tensor]:
        """Append `op` and return all its results as Tensors."""
        self.block.add_op(op)
        return [Tensor(r, self) for r in op.results]

    def _claim(self, name: str) -> None:
        if name in self.names:
            raise fail("name", f"'{name}' is used twice")
        self.names.add(name)

    def parameter(self, name: str, shape: Sequence[int], init: str, dtype: str = "float32") -> Tensor:
        """Return a new named parameter of the step."""
        self._claim(name)
        return self.emit(graph.ParameterOp(name, init, TensorType(element_type(dtype), shape)))

    def input(self, name: str, shape: Sequence[int], dtype: str) -> Tensor:
        """Return a new named input of the step."""
        self._claim(name)
        return self.emit(graph.InputOp(name, TensorType(element_type(dtype), shape)))

    def output(self, name: str, value: Tensor) -> None:
        """Mark `value` as a named output of the step."""
        self.emit_void(graph.OutputOp(name, value.value))

    def constant(self, value: float, shape: Sequence[int] = (), dtype: str = "float32") -> Tensor:
        return self.emit(graph.ConstantOp(value, TensorType(element_type(dtype), shape)))

    def literal(self, values: np.ndarray) -> Tensor:
        """Return a constant tensor holding `values` element by element (`graph.literal`)."""
        values = np.asarray(values)
        return self.emit(graph.LiteralOp(values, TensorType(element_type(values.dtype), values.shape)))

    def finish(self) -> ModuleOp:
        """Return the module holding the traced function (the tracer is spent afterwards)."""
        self.block.add_op(func.ReturnOp())
        fn = func.FuncOp(self.func_name, ((), ()), Region(self.block))
        return ModuleOp([fn, *(f for f in self.functions.values())])


def broadcast_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """Return the NumPy broadcast of two shapes, or None if they do not broadcast."""
    out = []
    for x, y in zip(reversed((1,) * (len(b) - len(a)) + a), reversed((1,) * (len(a) - len(b)) + b)):
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(reversed(out))


class Tensor:
    """A traced tensor: a value of the step function being built, with NumPy-like operators
    (`/`, `**`, `@` and `max` come with `hspmd.frontend.ops`, which every `import hspmd` loads)."""

    __array_priority__ = 100  # make `ndarray op Tensor` defer to Tensor

    def __init__(self, value: SSAValue, tracer: Tracer) -> None:
        self.value = value
        self.tracer = tracer

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.type.get_shape()  # type: ignore[attr-defined]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> str:
        return dtype_name(self.value.type)

    def __repr__(self) -> str:
        return f"Tensor(shape={self.shape}, dtype={self.dtype})"

    # -- helpers
    def _lift(self, other, op: str) -> Tensor:
        if isinstance(other, Tensor):
            return other
        if hasattr(other, "traced"):  # a Parameter bound to this trace
            return other.traced(op)
        if isinstance(other, (int, float)):
            return self.tracer.constant(float(other), (), self.dtype)
        raise fail(op, f"cannot combine a tensor with {type(other).__name__}")

    def broadcast_to(self, shape: Sequence[int]) -> Tensor:
        """Return this tensor broadcast (NumPy rules) to `shape`."""
        shape = tuple(shape)
        if self.shape == shape:
            return self
        if broadcast_shape(self.shape, shape) != shape:
            raise fail("broadcast", f"cannot broadcast {list(self.shape)} to {list(shape)}")
        offset = len(shape) - self.ndim
        src = self
        keep = [i for i, s in enumerate(self.shape) if s == shape[i + offset]]
        if len(keep) != self.ndim:  # drop size-1 dims that get stretched
            src = src.reshape([self.shape[i] for i in keep])
        dims = [i + offset for i in keep]
        return self.tracer.emit(graph.BroadcastOp(src.value, dims, TensorType(self.value.type.element_type, shape)))

    def broadcast_binary(self, other, cls, op: str, swap: bool = False) -> Tensor:
        """Return binary op `cls` (named `op` in errors) of this tensor and `other` (a tensor or a
        Python number) broadcast to a common shape, NumPy's way; `swap` puts `other` first."""
        other = self._lift(other, op)
        a, b = (other, self) if swap else (self, other)
        if a.dtype != b.dtype:
            raise fail(op, f"operands have dtypes {a.dtype} and {b.dtype}")
        shape = broadcast_shape(a.shape, b.shape)
        if shape is None:
            raise fail(op, f"shapes {list(a.shape)} and {list(b.shape)} do not broadcast")
        a, b = a.broadcast_to(shape), b.broadcast_to(shape)
        return self.tracer.emit(cls(a.value, b.value))

    def __add__(self, other):
        return self.broadcast_binary(other, graph.AddOp, "add")

    def __radd__(self, other):
        return self.broadcast_binary(other, graph.AddOp, "add", swap=True)

    def __sub__(self, other):
        return self.broadcast_binary(other, graph.SubOp, "sub")

    def __rsub__(self, other):
        return self.broadcast_binary(other, graph.SubOp, "sub", swap=True)

    def __mul__(self, other):
        if isinstance(other, (int, float)):
            return self.tracer.emit(graph.ScaleOp(self.value, float(other)))
        return self.broadcast_binary(other, graph.MulOp, "mul")

    def __rmul__(self, other):
        if isinstance(other, (int, float)):
            return self.tracer.emit(graph.ScaleOp(self.value, float(other)))
        return self.broadcast_binary(other, graph.MulOp, "mul", swap=True)

    def __neg__(self):
        return self * -1.0

    @property
    def T(self) -> Tensor:
        return self.transpose(list(reversed(range(self.ndim))))

    def transpose(self, perm: Sequence[int]) -> Tensor:
        perm = list(perm)
        if sorted(perm) != list(range(self.ndim)):
            raise fail("transpose", f"{perm} is not a permutation of the {self.ndim} dims of {list(self.shape)}")
        shape = [self.shape[p] for p in perm]
        return self.tracer.emit(graph.TransposeOp(self.value, perm, TensorType(self.value.type.element_type, shape)))

    def reshape(self, shape: Sequence[int]) -> Tensor:
        shape = list(shape)
        size = int(np.prod(self.shape))
        if shape.count(-1) == 1:
            rest = int(np.prod([s for s in shape if s != -1]))
            shape[shape.index(-1)] = size // rest if rest else 0
        if int(np.prod(shape)) != size:
            raise fail("reshape", f"cannot reshape {list(self.shape)} into {shape}")
        if tuple(shape) == self.shape:
            return self
        return self.tracer.emit(graph.ReshapeOp(self.value, TensorType(self.value.type.element_type, shape)))

    def sum(self, dims: int | Sequence[int] | None = None) -> Tensor:
        dims = _dims(dims, self.ndim, "sum")
        shape = [s for i, s in enumerate(self.shape) if i not in dims]
        return self.tracer.emit(graph.ReduceSumOp(self.value, dims, TensorType(self.value.type.element_type, shape)))

    def mean(self, dims: int | Sequence[int] | None = None) -> Tensor:
        dims = _dims(dims, self.ndim, "mean")
        count = int(np.prod([self.shape[d] for d in dims]))
        return self.sum(dims) * (1.0 / count)


def _dims(dims, ndim: int, op: str) -> list[int]:
    if dims is None:
        return list(range(ndim))
    dims = [dims] if isinstance(dims, int) else list(dims)
    norm = sorted({d % ndim if ndim else d for d in dims})
    if any(not -ndim <= d < ndim for d in dims):
        raise fail(op, f"dims {dims} out of range for a {ndim}-d tensor")
    return norm
