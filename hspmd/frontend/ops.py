"""The functional op set of the frontend: `hs.relu(x)`, `hs.cross_entropy(logits, labels)`, ...

The functions stand beside their ops (each op's `FRONTEND` names them, in its family module of
`hspmd.dialects`: `hs.gelu` is `hspmd.dialects.graph.activations.gelu`); this module gathers
every one of them under its name, so that a new op's function needs no line here. Each checks
shapes and dtypes (a `TraceError` names the script line, the function and the shapes) and
appends ops through the tensor's tracer. It also gives `Tensor` the operators that are such
functions (`a / b`, `a ** p`, `a @ b`, `x.max(dims)`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from hspmd.dialects.context import hspmd_dialects
from hspmd.dialects.interfaces import frontend_names
from hspmd.frontend.tracing import Tensor


def frontend_functions() -> dict[str, Callable]:
    """Return every function that an op names in its `FRONTEND`, by name (the functions stand
    beside their ops, in the ops' modules; the methods of `Tensor` and `Tracer` aside)."""
    functions: dict[str, Callable] = {}
    for op in (op for dialect in hspmd_dialects() for op in dialect.operations):
        for name in frontend_names(op):
            if "." not in name:  # `Tensor.__add__`, `Tracer.parameter`: methods of the tracing classes
                functions[name] = getattr(sys.modules[op.__module__], name)
    return functions


FUNCTIONS = frontend_functions()
globals().update(FUNCTIONS)
__all__ = sorted({*FUNCTIONS, "frontend_functions"})


def _install_operators(cls: type) -> None:
    """Give `Tensor` the operators and methods that are functions of ops (`/`, `**`, `@`,
    `x.max`): `tracing` defines the tensor and the operators it emits itself, the ops' modules
    the functions built on them, so neither imports the other's functions back."""
    divide, power, matmul, maximum = (FUNCTIONS[name] for name in ("divide", "power", "matmul", "max"))
    cls.__truediv__ = lambda self, other: divide(self, other)
    cls.__rtruediv__ = lambda self, other: divide(other, self)
    cls.__pow__ = lambda self, exponent: power(self, exponent)
    cls.__matmul__ = lambda self, other: matmul(self, self._lift(other, "matmul"))
    cls.__rmatmul__ = lambda self, other: matmul(self._lift(other, "matmul"), self)
    cls.max = lambda self, dims=None: maximum(self, dims)


_install_operators(Tensor)
