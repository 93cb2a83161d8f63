"""Element types: the map between IR element types and NumPy dtypes."""

from __future__ import annotations

import numpy as np
from xdsl.dialects.builtin import (
    BFloat16Type,
    Float16Type,
    Float32Type,
    Float64Type,
    IntegerType,
    TensorType,
    bf16,
    f16,
    f32,
    f64,
    i32,
    i64,
)
from xdsl.ir import Attribute

DTYPES: dict[str, Attribute] = {"float16": f16, "float32": f32, "float64": f64, "int32": i32, "int64": i64}
try:  # ml_dtypes gives NumPy a bfloat16 dtype; without it bfloat16 is not supported
    import ml_dtypes  # noqa: F401

    DTYPES["bfloat16"] = bf16
except ImportError:  # pragma: no cover - depends on the environment
    pass


def element_type(dtype: str | np.dtype) -> Attribute:
    """Return the IR element type for a NumPy dtype (name)."""
    name = np.dtype(dtype).name
    if name not in DTYPES:
        raise TypeError(f"dtype {name} is not supported (use one of {', '.join(DTYPES)})")
    return DTYPES[name]


def dtype_name(typ: Attribute) -> str:
    """Return the NumPy dtype name of an IR element type or tensor type."""
    if isinstance(typ, TensorType):
        typ = typ.element_type
    if isinstance(typ, Float16Type):
        return "float16"
    if isinstance(typ, BFloat16Type):
        return "bfloat16"
    if isinstance(typ, Float32Type):
        return "float32"
    if isinstance(typ, Float64Type):
        return "float64"
    if isinstance(typ, IntegerType):
        return f"int{typ.width.data}"
    raise TypeError(f"no NumPy dtype for {typ}")
