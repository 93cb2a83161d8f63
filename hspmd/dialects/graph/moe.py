"""Mixture of experts: the experts' products, top-k routing with capacity, dispatch and combine."""

from __future__ import annotations

from typing import ClassVar

from xdsl.dialects.builtin import (
    I64,
    IntegerAttr,
    TensorType,
)
from xdsl.ir import Attribute, Operation, SSAValue
from xdsl.irdl import (
    irdl_op_definition,
    operand_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.graph.base import tensor_shape, check_same_element_type, TensorOp, UnaryOp, check_float, int_attr
from hspmd.dialects.graph.matmul import MatmulBase

__all__ = [
    "ExpertMatmulOp",
    "ExpertMatmulRhsGradOp",
    "MoeRouteOp",
    "MoeDispatchOp",
    "MoeCombineOp",
    "MoeWeightsGradOp",
]


@irdl_op_definition
class ExpertMatmulOp(MatmulBase):
    """Each expert's tokens times its own weight: [E, m, k] x [E, k, n] -> [E, m, n].

    The product of a batched `graph.matmul` over the expert dim E; a separate op because it
    is laid out otherwise: the operand split along E (the expert weight, under expert
    parallelism) keeps its place and the tokens are moved to it (an all-to-all), where a
    batched matmul would gather the weight instead."""

    name = "graph.expert_matmul"

    def verify_(self) -> None:
        super().verify_()
        a, b = tensor_shape(self.lhs), tensor_shape(self.rhs)
        if len(a) != 3 or len(b) != 3:
            raise VerifyException(f"'{self.name}' needs [E, m, k] x [E, k, n], got {list(a)} x {list(b)}")


@irdl_op_definition
class ExpertMatmulRhsGradOp(TensorOp):
    """`lhs[e]^T @ dy[e]` per expert: [E, m, k], [E, m, n] -> [E, k, n], the gradient of an expert
    weight (its own op, rather than a matmul of a transpose, so that the backward uses the
    tokens the forward moved to the experts as they are, with no second all-to-all)."""

    name = "graph.expert_matmul_rhs_grad"
    lhs = operand_def(TensorType)
    dy = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, lhs: SSAValue, dy: SSAValue, result_type: Attribute):
        super().__init__(operands=[lhs, dy], result_types=[result_type])

    def verify_(self) -> None:
        a, g, r = tensor_shape(self.lhs), tensor_shape(self.dy), tensor_shape(self.result)
        if len(a) != 3 or len(g) != 3 or a[:2] != g[:2] or r != (a[0], a[2], g[2]):
            raise VerifyException(f"'{self.name}' needs lhs [E, m, k] and dy [E, m, n] giving [E, k, n], "
                                  f"got {list(a)}, {list(g)} -> {list(r)}")
        check_same_element_type(self, self.lhs, self.dy, self.result)


@irdl_op_definition
class MoeRouteOp(UnaryOp):
    """Top-k routing with capacity: router probabilities [G, S, E] -> dispatch mask [G, S, E, C].

    Within each routing group g (a sequence), every token s picks its `top_k` most probable
    experts (ties: the lower expert index). Choices are placed in order of rank (all first
    choices of the group, then all second ones, as GShard does) and, within a rank, in token
    order: a choice takes the next free slot c of its expert's C slots, or is dropped when they
    are full. `mask[g, s, e, c]` is 1.0 where token s sits in slot c of expert e. The mask
    depends only on the group's own probabilities, so a batch split over devices drops the
    same tokens as one device. It has no gradient (`STOPS_GRADIENT`)."""

    name = "graph.moe_route"
    top_k = prop_def(IntegerAttr[I64])
    STOPS_GRADIENT: ClassVar[bool] = True

    def __init__(self, probs: SSAValue, top_k: int, result_type: Attribute):
        super().__init__(probs, result_type, top_k=int_attr(top_k))

    def verify_(self) -> None:
        p, r = tensor_shape(self.input), tensor_shape(self.result)
        if len(p) != 3 or len(r) != 4 or r[:3] != p:
            raise VerifyException(f"'{self.name}' needs probabilities [G, S, E] giving [G, S, E, C], "
                                  f"got {list(p)} -> {list(r)}")
        if not 1 <= self.top_k.value.data <= p[2]:
            raise VerifyException(f"'{self.name}' top_k={self.top_k.value.data} is not in 1..{p[2]} experts")
        check_float(self, self.input, self.result)
        check_same_element_type(self, self.input, self.result)


def _moe_shapes(op: Operation, tokens: SSAValue, experts: SSAValue, weights: SSAValue) -> None:
    """Check tokens [G, S, D], expert slots [E, G, C, D] and slot weights [G, S, E, C] agree."""
    t, x, w = tensor_shape(tokens), tensor_shape(experts), tensor_shape(weights)
    ok = len(t) == 3 and len(x) == 4 and len(w) == 4
    ok = ok and w[:2] == t[:2] and x == (w[2], t[0], w[3], t[2])
    if not ok:
        raise VerifyException(f"'{op.name}' needs tokens [G, S, D], expert slots [E, G, C, D] and weights "
                              f"[G, S, E, C], got {list(t)}, {list(x)}, {list(w)}")
    check_same_element_type(op, tokens, experts, weights)


@irdl_op_definition
class MoeDispatchOp(TensorOp):
    """Tokens into expert slots: `out[e, g, c] = sum_s mask[g, s, e, c] * x[g, s]`,
    x [G, S, D], mask [G, S, E, C] -> [E, G, C, D]."""

    name = "graph.moe_dispatch"
    x = operand_def(TensorType)
    mask = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, mask: SSAValue, result_type: Attribute):
        super().__init__(operands=[x, mask], result_types=[result_type])

    def verify_(self) -> None:
        _moe_shapes(self, self.x, self.result, self.mask)


@irdl_op_definition
class MoeCombineOp(TensorOp):
    """Expert slots back to tokens: `out[g, s] = sum_{e, c} weights[g, s, e, c] * y[e, g, c]`,
    y [E, G, C, D], weights [G, S, E, C] -> [G, S, D] (the transpose of `graph.moe_dispatch`)."""

    name = "graph.moe_combine"
    y = operand_def(TensorType)
    weights = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, y: SSAValue, weights: SSAValue, result_type: Attribute):
        super().__init__(operands=[y, weights], result_types=[result_type])

    def verify_(self) -> None:
        _moe_shapes(self, self.result, self.y, self.weights)


@irdl_op_definition
class MoeWeightsGradOp(TensorOp):
    """`out[g, s, e, c] = sum_d t[g, s, d] * y[e, g, c, d]`: t [G, S, D], y [E, G, C, D] ->
    [G, S, E, C], the gradient of the slot weights of `graph.moe_combine` (t the incoming
    gradient) and of the mask of `graph.moe_dispatch` (t the tokens, y the incoming gradient)."""

    name = "graph.moe_weights_grad"
    t = operand_def(TensorType)
    y = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, t: SSAValue, y: SSAValue, result_type: Attribute):
        super().__init__(operands=[t, y], result_types=[result_type])

    def verify_(self) -> None:
        _moe_shapes(self, self.t, self.y, self.result)
