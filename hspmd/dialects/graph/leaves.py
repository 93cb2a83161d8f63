"""Leaves and stores of a step: parameters, inputs, constants, iota, outputs and parameter updates.

Parameters, inputs, outputs and parameter updates are named ops, so a training step is one
`func.func` with no arguments and the runtime binds names to buffers.
"""

from __future__ import annotations

from typing import ClassVar

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

from hspmd.dialects.graph.base import tensor_shape, check_integer, int_attr

__all__ = [
    "ParameterOp",
    "InputOp",
    "ConstantOp",
    "IotaOp",
    "OutputOp",
    "AssignOp",
]


@irdl_op_definition
class ParameterOp(IRDLOperation):
    """A trainable parameter, named after its place in the module tree (`fc1.weight`).

    `init` says how the runtime creates its initial value (`zeros`, `ones`,
    `normal:STD`, `uniform:LO:HI`); `global_type` is set at the physical level, where the
    result type is the local piece, and records the annotated type (global shape + layout).
    """

    name = "graph.parameter"
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
class IotaOp(IRDLOperation):
    """A 1-d integer tensor counting up: element i is `start + i * step` (`jax.lax.iota`).

    `stack-layers` makes the per-layer counters of stacked layers with it (a dropout's random
    stream differs per layer: layer i draws from `step + (i << 32)`). It is replicated: every
    device makes the whole (small) tensor.
    """

    name = "graph.iota"
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


@irdl_op_definition
class OutputOp(IRDLOperation):
    """Marks a value the step returns under a name (the loss, a gradient)."""

    name = "graph.output"
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
    irdl_options = (ParsePropInAttrDict(),)
    tensor_name = prop_def(StringAttr)
    value = operand_def(TensorType)
    assembly_format = "$tensor_name `,` $value attr-dict `:` type($value)"

    def __init__(self, tensor_name: str, value: SSAValue | Operation):
        super().__init__(properties={"tensor_name": StringAttr(tensor_name)}, operands=[value])
