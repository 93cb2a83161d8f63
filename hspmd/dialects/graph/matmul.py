"""Products: `graph.matmul` (plain and batched) and `graph.matmul_rhs_grad` (a weight's gradient)."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from xdsl.dialects.builtin import TensorType
from xdsl.ir import Attribute, SSAValue
from xdsl.irdl import irdl_op_definition, operand_def, result_def, traits_def
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.graph.base import TensorOp, check_same_element_type, tensor_shape
from hspmd.dialects.graph.shape import transpose_last_two
from hspmd.dialects.interfaces import OUT, Kernel, KernelContext, OutFacts, takes_out
from hspmd.dialects.op_rule import OpRule, factors
from hspmd.dialects.traced import as_tensor, fail, typed

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
    #: on a GPU a cuBLAS (strided batched) GEMM computes it, transposes as flags (`runtime/cuda/`)
    CUDA_GEMM: ClassVar[bool] = True
    ATEN: ClassVar[tuple[str, ...]] = ("aten.linear.default", "aten.addmm.default", "aten.mm.default",
                                       "aten.bmm.default", "aten.matmul.default", "aten.convolution.default")
    OUT_FACTS: ClassVar[OutFacts] = OUT
    FRONTEND: ClassVar[tuple[str, ...]] = ("matmul", "Tensor.__matmul__")

    def sharding_rule(self) -> OpRule:
        b = factors("b", len(tensor_shape(self.lhs)) - 2)  # batch dims: shared, so splitting them is free
        two_d = len(tensor_shape(self.rhs)) == 2
        rhs = ("k", "j") if two_d else (*b, "k", "j")
        weight = frozenset({"k", "j"}) if two_d else frozenset()  # times a 2-D weight
        return OpRule(((*b, "i", "k"), rhs), ((*b, "i", "j"),), frozenset({0, 1}), joint=False, prefer=weight)

    def vjp(self, gs, emit):
        g = gs[0]
        a, b = tensor_shape(self.lhs), tensor_shape(self.rhs)
        if len(b) == 2 and len(a) > 2:  # a weight applied to batched activations
            rhs_grad = lambda: emit(MatmulRhsGradOp(self.lhs, g, self.rhs.type))  # noqa: E731
        else:
            rhs_grad = lambda: emit(MatmulOp(transpose_last_two(emit, self.lhs), g, self.rhs.type))  # noqa: E731
        return [lambda: emit(MatmulOp(g, transpose_last_two(emit, self.rhs), self.lhs.type)), rhs_grad]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return matmul_values


@irdl_op_definition
class MatmulRhsGradOp(TensorOp):
    """`sum over batch dims of lhs^T @ dy`: [..., m, k], [..., m, n] -> [k, n].

    The gradient of a 2-D right operand of a batched matmul: every batch dim and `m` are
    contracted (splitting any of them leaves partial sums, so data parallelism over the batch
    needs one all-reduce of the weight gradient, as for a 2-D matmul)."""

    name = "graph.matmul_rhs_grad"
    #: on a GPU a cuBLAS (strided batched) GEMM computes it, transposes as flags (`runtime/cuda/`)
    CUDA_GEMM: ClassVar[bool] = True
    OUT_FACTS: ClassVar[OutFacts] = OUT
    NO_VJP: ClassVar[str] = "a gradient op (no second derivatives)"
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

    def sharding_rule(self) -> OpRule:  # batch dims and i are contracted: split, they leave partial sums
        b = factors("b", len(tensor_shape(self.lhs)) - 2)
        return OpRule(((*b, "i", "k"), (*b, "i", "j")), (("k", "j"),), frozenset({0, 1}), joint=False,
                      prefer=frozenset({"k", "j"}))

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return matmul_rhs_grad_values


# ----------------------------------------------------------------------------- kernels


@takes_out
def matmul_values(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`a @ b`; a batch of rows times one 2-D matrix is done as one 2-D product (one BLAS call).

    Transposed operands (views) go to BLAS as they are, without a copy, where NumPy can; so
    does an `out=` with strided rows (a result laid out for its consumer, `schedule.placement`)
    of a batch of products. Rows times a 2-D matrix into an `out=` that is not C-contiguous are
    computed as one product of the rows merged, then copied into `out`: product by product,
    OpenBLAS (its small-matrix kernels, from K = 32) and NumPy (a matrix-vector or dot product
    where a product has one row or column) add in other orders than for the rows merged, so the
    bits would depend on where the result is written.
    """
    if b.ndim == 2 and a.ndim > 2:
        rows = a.reshape(-1, a.shape[-1])  # a view when a's leading dims merge
        if out is None:
            return np.matmul(rows, b).reshape(*a.shape[:-1], b.shape[1])
        if out.flags.c_contiguous:
            np.matmul(rows, b, out=out.reshape(rows.shape[0], b.shape[1]))
        else:
            np.copyto(out, np.matmul(rows, b).reshape(out.shape))
        return out
    return np.matmul(a, b, out=out)


@takes_out
def matmul_rhs_grad_values(a: np.ndarray, g: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`a^T g` over all leading dims merged: the gradient of the right operand of `a @ w`."""
    return np.matmul(a.reshape(-1, a.shape[-1]).T, g.reshape(-1, g.shape[-1]), out=out)


# ----------------------------------------------------------------------------- frontend


def matmul(a, b):
    """Return `a @ b`: [..., m, k] x [..., k, n] (same batch dims) or [..., m, k] x [k, n]."""
    a, b = as_tensor(a, "matmul"), as_tensor(b, "matmul")
    ok = a.ndim >= 2 and b.ndim >= 2 and a.shape[-1] == b.shape[-2]
    ok = ok and (b.ndim == 2 or b.shape[:-2] == a.shape[:-2])
    if not ok:
        raise fail("matmul", f"cannot multiply {list(a.shape)} by {list(b.shape)} "
                             "(needs [..., m, k] x [..., k, n] with the same batch dims, or [..., m, k] x [k, n])")
    if a.dtype != b.dtype:
        raise fail("matmul", f"operands have dtypes {a.dtype} and {b.dtype}")
    return a.tracer.emit(MatmulOp(a.value, b.value, typed(a, (*a.shape[:-1], b.shape[-1]))))
