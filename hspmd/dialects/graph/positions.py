"""Ops whose values depend on positions: rotary position embeddings and counter-based dropout."""

from __future__ import annotations

from typing import ClassVar

from xdsl.dialects.builtin import (
    I64,
    DenseArrayBase,
    FloatAttr,
    IntegerAttr,
    TensorType,
    TypeAttribute,
)
from xdsl.ir import SSAValue
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

from hspmd.dialects.graph.base import tensor_shape, check_same_shape, TensorOp, UnaryOp, check_float, check_integer, int_attr, float_attr

__all__ = [
    "RopeOp",
    "RopeGradOp",
    "DropoutOp",
]


class _Rope(UnaryOp):
    base = prop_def(FloatAttr)

    def __init__(self, input: SSAValue, base: float = 10000.0):
        super().__init__(input, base=float_attr(base))

    def verify_(self) -> None:
        check_same_shape(self, self.input, self.result)
        check_float(self, self.input)
        shape = tensor_shape(self.input)
        if len(shape) < 3 or shape[-1] % 2:
            raise VerifyException(f"'{self.name}' needs x [..., T, H, Dh] with Dh even, got {list(shape)}")


@irdl_op_definition
class RopeOp(_Rope):
    """Rotary position embedding of x [..., T, H, Dh] (HuggingFace LLaMA `rotate_half` form):
    `x * cos + rotate_half(x) * sin`, angles `t * base ** (-2i / Dh)` for position t (dim -3)
    and `i < Dh / 2`, repeated for both halves of Dh."""

    name = "graph.rope"


@irdl_op_definition
class RopeGradOp(_Rope):
    """The transposed rotation of `graph.rope` (same base): `dy * cos - rotate_half(dy) * sin`."""

    name = "graph.rope_grad"


@irdl_op_definition
class DropoutOp(TensorOp):
    """`x * keep / (1 - rate)`: `keep` is a counter-based random mask, a pure function of
    (`seed`, `salt`, the scalar integer `step`, the element's index in the global tensor), so it
    does not depend on how the tensor is sharded. `salt` tells dropouts of one step apart.
    `global_type` is set at the physical level (the annotated type of the result: global shape
    and layout), where the kernel finds its piece's global offset from it. In a pipeline
    stage's forward or backward, `microbatches` m and `microbatch_dim` d say that `global_type`
    is one micro-batch: the whole tensor has m of them along dim d, and the runtime tells the
    kernel which one it runs (so the masks are those of one device). Beside other device groups
    (a union layout) the op keeps the stage-shaped step's layout over virtual devices instead,
    with `microbatch_ranks` and `stage_ranks` as on `comm.exchange`: the rank at stage position
    q draws micro-batch i's mask as virtual device `microbatch_ranks[i * len(stage_ranks) + q]`."""

    name = "graph.dropout"
    input = operand_def(TensorType)
    step = operand_def(TensorType)
    result = result_def(TensorType)
    rate = prop_def(FloatAttr)
    seed = prop_def(IntegerAttr[I64])
    salt = prop_def(IntegerAttr[I64])
    global_type = opt_prop_def(TypeAttribute)
    microbatches = opt_prop_def(IntegerAttr[I64])
    microbatch_dim = opt_prop_def(IntegerAttr[I64])
    microbatch_ranks = opt_prop_def(DenseArrayBase)
    stage_ranks = opt_prop_def(DenseArrayBase)
    traits = traits_def(Pure())
    #: specialize-groups records the annotated result type in `global_type`
    RECORDS_GLOBAL_TYPE: ClassVar[bool] = True

    def __init__(self, input: SSAValue, step: SSAValue, rate: float, seed: int, salt: int):
        super().__init__(
            operands=[input, step],
            result_types=[input.type],
            properties={"rate": float_attr(rate), "seed": int_attr(seed), "salt": int_attr(salt)},
        )

    def verify_(self) -> None:
        check_same_shape(self, self.input, self.result)
        check_float(self, self.input)
        if tensor_shape(self.step) != ():
            raise VerifyException(f"'{self.name}' needs a scalar integer step")
        check_integer(self, self.step, "step")
        if not 0.0 <= self.rate.value.data < 1.0:
            raise VerifyException(f"'{self.name}' rate must be in [0, 1), got {self.rate.value.data}")
