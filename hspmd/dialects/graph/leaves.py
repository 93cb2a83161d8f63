"""Leaves and stores of a step: parameters, inputs, constants, iota, outputs and parameter updates.

Parameters, inputs, outputs and parameter updates are named ops, so a training step is one
`func.func` with no arguments and the runtime binds names to buffers.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from xdsl.dialects.builtin import (
    I64,
    Float64Type,
    FloatAttr,
    IntegerAttr,
    StringAttr,
    TensorType,
    TypeAttribute,
)
from xdsl.ir import Attribute, Operation, SSAValue
from xdsl.irdl import (
    IRDLOperation,
    ParsePropInAttrDict,
    irdl_op_definition,
    operand_def,
    opt_prop_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.dist import layout_of
from hspmd.dialects.cuda_c import KernelCode, c_type, flat_kernel, global_index, rank_defaults, rank_value
from hspmd.dialects.graph.base import check_integer, int_attr, piece_starts, result_dtype, tensor_shape
from hspmd.dialects.interfaces import Emit, Kernel, KernelContext
from hspmd.ir.types import dtype_name

__all__ = [
    "ParameterOp",
    "InputOp",
    "ConstantOp",
    "LiteralOp",
    "IotaOp",
    "OutputOp",
    "AssignOp",
]


@irdl_op_definition
class ParameterOp(IRDLOperation):
    """A trainable parameter, named after its place in the module tree (`fc1.weight`).

    `init` says how the runtime creates its initial value (`zeros`, `ones`, `full:VALUE`,
    `normal:STD`, `uniform:LO:HI`); `global_type` is set at the physical level, where the
    result type is the local piece, and records the annotated type (global shape + layout).
    """

    name = "graph.parameter"
    NO_SHARDING_RULE: ClassVar[str] = "Parameters are laid out by the strategy (apply-strategy), not by a rule"
    NO_VJP: ClassVar[str] = "a leaf: autodiff outputs its gradient"
    NO_KERNEL: ClassVar[str] = "the plan binds it to the parameter's buffer"
    FRONTEND: ClassVar[tuple[str, ...]] = ("Tracer.parameter",)
    irdl_options = (ParsePropInAttrDict(),)
    tensor_name = prop_def(StringAttr)
    init = prop_def(StringAttr)
    global_type = opt_prop_def(TypeAttribute)
    result = result_def(TensorType)
    assembly_format = "$tensor_name attr-dict `:` type($result)"

    def __init__(self, tensor_name: str, init: str, result_type: Attribute, global_type: Attribute | None = None):
        props: dict[str, Attribute] = {"tensor_name": StringAttr(tensor_name), "init": StringAttr(init)}
        if global_type is not None:
            props["global_type"] = global_type
        super().__init__(properties=props, result_types=[result_type])

    def verify_(self) -> None:
        from hspmd.ir.init_spec import parse_init_spec

        try:
            parse_init_spec(self.init.data)
        except ValueError as err:
            raise VerifyException(str(err)) from None


@irdl_op_definition
class InputOp(IRDLOperation):
    """A named input of the step (a batch tensor); `global_type` as for parameters."""

    name = "graph.input"
    NO_SHARDING_RULE: ClassVar[str] = "Inputs are laid out by the strategy (apply-strategy), not by a rule"
    NO_VJP: ClassVar[str] = "a leaf: no gradient"
    NO_KERNEL: ClassVar[str] = "the plan binds it to the batch's array"
    FRONTEND: ClassVar[tuple[str, ...]] = ("Tracer.input",)
    irdl_options = (ParsePropInAttrDict(),)
    tensor_name = prop_def(StringAttr)
    global_type = opt_prop_def(TypeAttribute)
    result = result_def(TensorType)
    assembly_format = "$tensor_name attr-dict `:` type($result)"

    def __init__(self, tensor_name: str, result_type: Attribute, global_type: Attribute | None = None):
        props: dict[str, Attribute] = {"tensor_name": StringAttr(tensor_name)}
        if global_type is not None:
            props["global_type"] = global_type
        super().__init__(properties=props, result_types=[result_type])


@irdl_op_definition
class ConstantOp(IRDLOperation):
    """A tensor whose every element is `value` (a splat)."""

    name = "graph.constant"
    NO_SHARDING_RULE: ClassVar[str] = "a splat: replicated, or whatever layout its user wants"
    NO_VJP: ClassVar[str] = "a constant: no gradient"
    NO_KERNEL: ClassVar[str] = "the plan makes it once"
    FRONTEND: ClassVar[tuple[str, ...]] = ("Tracer.constant",)
    #: made from a traced tensor's shape alone
    ATEN: ClassVar[tuple[str, ...]] = ("aten.full_like.default", "aten.fill.Scalar", "aten.fill.Tensor")
    irdl_options = (ParsePropInAttrDict(),)
    value = prop_def(FloatAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "attr-dict `:` type($result)"

    def __init__(self, value: float, result_type: TensorType):
        super().__init__(
            properties={"value": FloatAttr(float(value), Float64Type())}, result_types=[result_type]
        )


@irdl_op_definition
class LiteralOp(IRDLOperation):
    """A tensor given element by element: a constant of the model that is not a splat (the
    rotary tables, position ids or a mask an imported PyTorch module computes from its
    buffers alone, `hspmd.frontend.torch_import`).

    `data` holds the elements' bytes, little-endian in row-major order, as hexadecimal text (as
    MLIR prints a large `dense<"0x...">`), so the IR keeps every bit. Like `graph.iota` it is
    laid out as its users want and `global_type` records the annotated type at the physical
    level: each rank makes its own piece.
    """

    name = "graph.literal"
    NO_SHARDING_RULE: ClassVar[str] = "a constant: laid out as its users want (a rank makes its piece)"
    NO_VJP: ClassVar[str] = "a constant: no gradient"
    FRONTEND: ClassVar[tuple[str, ...]] = ("Tracer.literal",)
    irdl_options = (ParsePropInAttrDict(),)
    data = prop_def(StringAttr)
    global_type = opt_prop_def(TypeAttribute)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$data attr-dict `:` type($result)"
    RECORDS_GLOBAL_TYPE: ClassVar[bool] = True

    def __init__(self, values: np.ndarray, result_type: TensorType):
        data = np.ascontiguousarray(values, dtype=np.dtype(dtype_name(result_type)).newbyteorder("<")).tobytes()
        super().__init__(properties={"data": StringAttr(data.hex())}, result_types=[result_type])

    def values(self) -> np.ndarray:
        """Return the global tensor the op holds."""
        typ = self.global_type if self.global_type is not None else self.result.type
        dtype = np.dtype(dtype_name(typ)).newbyteorder("<")
        flat = np.frombuffer(bytes.fromhex(self.data.data), dtype=dtype)
        return flat.astype(dtype.newbyteorder("="), copy=True).reshape(typ.get_shape())  # type: ignore[attr-defined]

    def verify_(self) -> None:
        typ = self.global_type if self.global_type is not None else self.result.type
        size = int(np.prod(typ.get_shape())) * np.dtype(dtype_name(typ)).itemsize  # type: ignore[attr-defined]
        if len(self.data.data) != 2 * size:
            raise VerifyException(f"'{self.name}' holds {len(self.data.data) // 2} bytes; {typ} needs {size}")

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        """This rank's piece of the tensor (the whole where the op records no global type)."""
        values = self.values()
        layout = layout_of(self.global_type) if self.global_type is not None else None
        if layout is not None:
            values = np.require(values[layout.slices(ctx.rank, values.shape)], None, "C")
        return lambda: values.copy()

    def cuda_kernel(self, name: str) -> KernelCode:
        """The elements as a constant array of the kernel (exact: floats as hexadecimal literals)."""
        starts = piece_starts(self)  # a piece: the rank's items of the whole table
        values = self.values().reshape(-1)
        t = c_type(self.result.type)

        def literal(v) -> str:
            if values.dtype.kind != "f":
                return str(int(v))
            v = float(v)
            return "HS_NAN" if v != v else ("HS_INF" if v > 0 else "-HS_INF") if v in (float("inf"), -float("inf")) \
                else v.hex()

        items = ", ".join(literal(v) for v in values) or "0"
        if not starts:
            code = flat_kernel(name, self, t, f"out0[i] = {name}_data[i];")
        else:
            index = global_index(name, tensor_shape(self.result), self.values().shape)
            code = flat_kernel(name, self, t, f"{index}\n    out0[i] = {name}_data[gi];")
        table = f"__device__ const {t} {name}_data[{max(values.size, 1)}] = {{{items}}};\n"
        defaults = rank_defaults(name, [0] * len(tensor_shape(self.result))) if starts else ""
        return KernelCode(defaults + table + code.source, code.launches, rank_values=starts)


@irdl_op_definition
class IotaOp(IRDLOperation):
    """A 1-d integer tensor counting up: element i is `start + i * step` (`jax.lax.iota`).

    `stack-layers` makes the per-layer counters of stacked layers with it (a dropout's random
    stream differs per layer: layer i draws from `step + (i << 32)`). It is replicated: every
    device makes the whole (small) tensor.
    """

    name = "graph.iota"
    NO_SHARDING_RULE: ClassVar[str] = "replicated: every device makes the whole (small) tensor"
    NO_VJP: ClassVar[str] = "integers: no gradient"
    NO_FRONTEND: ClassVar[str] = "made by stack-layers (per-layer counters)"
    irdl_options = (ParsePropInAttrDict(),)
    start = prop_def(IntegerAttr[I64])
    step = prop_def(IntegerAttr[I64])
    global_type = opt_prop_def(TypeAttribute)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "attr-dict `:` type($result)"
    #: specialize-groups records the annotated result type in `global_type` (a rank makes its piece)
    RECORDS_GLOBAL_TYPE: ClassVar[bool] = True

    def __init__(self, start: int, step: int, result_type: TensorType):
        super().__init__(properties={"start": int_attr(start), "step": int_attr(step)}, result_types=[result_type])

    def verify_(self) -> None:
        if len(tensor_shape(self.result)) != 1:
            raise VerifyException(f"'{self.name}' makes a 1-d tensor, not {self.result.type}")
        check_integer(self, self.result, "result")

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        """This rank's piece of `start + i * step` (the whole where the op records no global type,
        at the logical level)."""
        typ = self.global_type if self.global_type is not None else self.result.type
        (n,) = typ.get_shape()  # type: ignore[attr-defined]
        values = (np.arange(n, dtype=np.int64) * self.step.value.data + self.start.value.data).astype(result_dtype(self))
        layout = layout_of(typ) if self.global_type is not None else None
        if layout is not None:
            values = np.require(values[layout.slices(ctx.rank, (n,))], None, "C")
        return lambda: values.copy()

    def cuda_kernel(self, name: str) -> KernelCode:
        start, step = self.start.value.data, self.step.value.data
        starts = piece_starts(self)  # a piece: its items count on from where it starts
        code = flat_kernel(name, self, c_type(self.result.type),
                           f"out0[i] = (T)({start}LL + (i + {rank_value(name, 0)}) * {step}LL);")
        return KernelCode(rank_defaults(name, [0]) + code.source, code.launches, rank_values=starts)


@irdl_op_definition
class OutputOp(IRDLOperation):
    """Marks a value the step returns under a name (the loss, a gradient)."""

    name = "graph.output"
    NO_SHARDING_RULE: ClassVar[str] = "a store: takes its operand's layout"
    NO_VJP: ClassVar[str] = "a store: autodiff starts from the loss output"
    NO_KERNEL: ClassVar[str] = "the plan returns the value"
    FRONTEND: ClassVar[tuple[str, ...]] = ("Tracer.output",)
    irdl_options = (ParsePropInAttrDict(),)
    tensor_name = prop_def(StringAttr)
    value = operand_def(TensorType)
    assembly_format = "$tensor_name `,` $value attr-dict `:` type($value)"

    def __init__(self, tensor_name: str, value: SSAValue | Operation):
        super().__init__(properties={"tensor_name": StringAttr(tensor_name)}, operands=[value])


@irdl_op_definition
class AssignOp(IRDLOperation):
    """Stores a new value into a named parameter at the end of the step."""

    name = "graph.assign"
    NO_SHARDING_RULE: ClassVar[str] = "a store: takes the parameter's layout"
    NO_VJP: ClassVar[str] = "a store: written after the gradients"
    NO_KERNEL: ClassVar[str] = "the plan writes the parameter's buffer"
    NO_FRONTEND: ClassVar[str] = "written by the optimizer passes"
    irdl_options = (ParsePropInAttrDict(),)
    tensor_name = prop_def(StringAttr)
    value = operand_def(TensorType)
    assembly_format = "$tensor_name `,` $value attr-dict `:` type($value)"

    def __init__(self, tensor_name: str, value: SSAValue | Operation):
        super().__init__(properties={"tensor_name": StringAttr(tensor_name)}, operands=[value])


def grad_or_zeros(emit: Emit, gs, op: Operation, i: int) -> SSAValue:
    """Return the gradient `gs[i]` of `op`'s result `i`, or zeros of its type where it has none."""
    g = gs[i]
    return g if g is not None else emit(ConstantOp(0.0, op.results[i].type))  # type: ignore[arg-type]
