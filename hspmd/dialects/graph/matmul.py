"""Products: `graph.matmul` (plain and batched) and `graph.matmul_rhs_grad` (a weight's gradient)."""

from __future__ import annotations


from xdsl.dialects.builtin import (
    TensorType,
)
from xdsl.ir import Attribute, SSAValue
from xdsl.irdl import (
    irdl_op_definition,
    operand_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.graph.base import tensor_shape, check_same_element_type, TensorOp

__all__ = [
    "MatmulBase",
    "MatmulOp",
    "MatmulRhsGradOp",
]


class MatmulBase(TensorOp):
    """Base of the products `graph.matmul` and `graph.expert_matmul` (one verifier, one kernel)."""

    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, lhs: SSAValue, rhs: SSAValue, result_type: Attribute):
        super().__init__(operands=[lhs, rhs], result_types=[result_type])

    def verify_(self) -> None:
        a, b, r = tensor_shape(self.lhs), tensor_shape(self.rhs), tensor_shape(self.result)
        ok = len(a) >= 2 and len(b) >= 2 and a[-1] == b[-2] and (len(b) == 2 or b[:-2] == a[:-2])
        if not ok or r != (*a[:-2], a[-2], b[-1]):
            raise VerifyException(f"'{self.name}' cannot multiply {list(a)} by {list(b)} into {list(r)}")
        check_same_element_type(self, self.lhs, self.rhs, self.result)


@irdl_op_definition
class MatmulOp(MatmulBase):
    """Batched `lhs @ rhs`: [..., m, k] x [..., k, n] -> [..., m, n] (the same batch dims), or
    [..., m, k] x [k, n] -> [..., m, n] (a 2-D right operand, e.g. a weight applied to
    [B, T, D] activations). With no batch dims it is the plain 2-D product."""

    name = "graph.matmul"


@irdl_op_definition
class MatmulRhsGradOp(TensorOp):
    """`sum over batch dims of lhs^T @ dy`: [..., m, k], [..., m, n] -> [k, n].

    The gradient of a 2-D right operand of a batched matmul: every batch dim and `m` are
    contracted (splitting any of them leaves partial sums, so data parallelism over the batch
    needs one all-reduce of the weight gradient, as for a 2-D matmul)."""

    name = "graph.matmul_rhs_grad"
    lhs = operand_def(TensorType)
    dy = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, lhs: SSAValue, dy: SSAValue, result_type: Attribute):
        super().__init__(operands=[lhs, dy], result_types=[result_type])

    def verify_(self) -> None:
        a, g, r = tensor_shape(self.lhs), tensor_shape(self.dy), tensor_shape(self.result)
        if len(a) < 2 or a[:-1] != g[:-1] or len(g) != len(a) or r != (a[-1], g[-1]):
            raise VerifyException(f"'{self.name}' needs lhs [..., m, k] and dy [..., m, n] giving [k, n], "
                                  f"got {list(a)}, {list(g)} -> {list(r)}")
        check_same_element_type(self, self.lhs, self.dy, self.result)
