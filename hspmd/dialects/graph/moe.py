"""Mixture of experts: the experts' products, top-k routing with capacity, dispatch and combine."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
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

from hspmd.dialects.cuda_c import KernelCode, RowKernel, c_type, flat_kernel
from hspmd.dialects.graph.base import (
    TensorOp,
    UnaryOp,
    check_float,
    check_same_element_type,
    int_attr,
    result_shape,
    tensor_shape,
)
from hspmd.dialects.graph.matmul import MatmulBase, matmul_values
from hspmd.dialects.graph.shape import transpose_last_two
from hspmd.dialects.interfaces import OUT, Kernel, KernelContext, OutFacts, takes_out
from hspmd.dialects.op_rule import OpRule
from hspmd.dialects.traced import as_tensor, fail, require_float, typed

__all__ = [
    "ExpertMatmulOp",
    "ExpertMatmulRhsGradOp",
    "MoeRouteOp",
    "MoeDispatchOp",
    "MoeCombineOp",
    "MoeWeightsGradOp",
]


# ----------------------------------------------------------------------------- the experts' products


@takes_out
def expert_matmul_rhs_grad_values(a: np.ndarray, g: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`a[e]^T g[e]` for every expert e: the gradient of the expert weights of `a @ w`."""
    return np.matmul(a.transpose(0, 2, 1), g, out=out)


@irdl_op_definition
class ExpertMatmulOp(MatmulBase):
    """Each expert's tokens times its own weight: [E, m, k] x [E, k, n] -> [E, m, n].

    The product of a batched `graph.matmul` over the expert dim E; a separate op because it
    is laid out otherwise: the operand split along E (the expert weight, under expert
    parallelism) keeps its place and the tokens are moved to it (an all-to-all), where a
    batched matmul would gather the weight instead."""

    name = "graph.expert_matmul"
    #: on a GPU a cuBLAS (strided batched) GEMM computes it, transposes as flags (`runtime/cuda/`)
    CUDA_GEMM: ClassVar[bool] = True
    OUT_FACTS: ClassVar[OutFacts] = OUT
    FRONTEND: ClassVar[tuple[str, ...]] = ("expert_matmul",)

    def verify_(self) -> None:
        super().verify_()
        a, b = tensor_shape(self.lhs), tensor_shape(self.rhs)
        if len(a) != 3 or len(b) != 3:
            raise VerifyException(f"'{self.name}' needs [E, m, k] x [E, k, n], got {list(a)} x {list(b)}")

    def sharding_rule(self) -> OpRule:
        return OpRule((("e", "i", "k"), ("e", "k", "j")), (("e", "i", "j"),), frozenset({0, 1}), joint=False,
                      lead="e")

    def vjp(self, gs, emit):  # the same op on the gradients, so they stay where the experts are
        g = gs[0]
        return [lambda: emit(ExpertMatmulOp(g, transpose_last_two(emit, self.rhs), self.lhs.type)),
                lambda: emit(ExpertMatmulRhsGradOp(self.lhs, g, self.rhs.type))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return matmul_values


@irdl_op_definition
class ExpertMatmulRhsGradOp(TensorOp):
    """`lhs[e]^T @ dy[e]` per expert: [E, m, k], [E, m, n] -> [E, k, n], the gradient of an expert
    weight (its own op, rather than a matmul of a transpose, so that the backward uses the
    tokens the forward moved to the experts as they are, with no second all-to-all)."""

    name = "graph.expert_matmul_rhs_grad"
    #: on a GPU a cuBLAS (strided batched) GEMM computes it, transposes as flags (`runtime/cuda/`)
    CUDA_GEMM: ClassVar[bool] = True
    lhs = operand_def(TensorType)
    dy = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    OUT_FACTS: ClassVar[OutFacts] = OUT
    NO_VJP: ClassVar[str] = "a gradient op (no second derivatives)"

    def __init__(self, lhs: SSAValue, dy: SSAValue, result_type: Attribute):
        super().__init__(operands=[lhs, dy], result_types=[result_type])

    def verify_(self) -> None:
        a, g, r = tensor_shape(self.lhs), tensor_shape(self.dy), tensor_shape(self.result)
        if len(a) != 3 or len(g) != 3 or a[:2] != g[:2] or r != (a[0], a[2], g[2]):
            raise VerifyException(f"'{self.name}' needs lhs [E, m, k] and dy [E, m, n] giving [E, k, n], "
                                  f"got {list(a)}, {list(g)} -> {list(r)}")
        check_same_element_type(self, self.lhs, self.dy, self.result)

    def sharding_rule(self) -> OpRule:  # m is contracted: split, it leaves partial sums
        return OpRule((("e", "m", "k"), ("e", "m", "n")), (("e", "k", "n"),), frozenset({0, 1}), joint=False,
                      lead="e")

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return expert_matmul_rhs_grad_values


# ----------------------------------------------------------------------------- routing


def moe_route_values(probs: np.ndarray, top_k: int, capacity: int) -> np.ndarray:
    """The dispatch mask [G, S, E, C] of `graph.moe_route`: top-k choices per token, placed rank
    by rank (all first choices, then all second ones) in token order, dropped past `capacity`."""
    g, s, e = probs.shape
    mask = np.zeros((g, s, e, capacity), dtype=probs.dtype)
    choices = np.argsort(-probs, axis=-1, kind="stable")[..., :top_k]  # ties: the lower expert
    used = np.zeros((g, 1, e), dtype=np.int64)  # slots taken per group and expert
    experts = np.arange(e)
    for rank in range(top_k):
        chosen = choices[..., rank]  # [G, S]
        onehot = chosen[..., None] == experts  # [G, S, E]
        slot = np.cumsum(onehot, axis=1) - 1 + used  # the slot each token would take at each expert
        used = used + onehot.sum(axis=1, keepdims=True)
        mine = np.take_along_axis(slot, chosen[..., None], axis=-1)[..., 0]  # [G, S]
        gi, si = np.nonzero(mine < capacity)
        mask[gi, si, chosen[gi, si], mine[gi, si]] = 1
    return mask


_MOE_ROUTE = """\
// {name}: top-{k} routing, {capacity} slots per expert; one block per routing group [{tokens}, {experts}]
HS_KERNEL void {name}(XPARAM, T* __restrict__ y, long rows, long cols) {
  HS_ROWS(r, rows) {
    XDECL
    T* yr = y + r * ({tokens}L * {experts}L * {capacity}L);
    HS_COLS(j, {tokens}L * {experts}L * {capacity}L) yr[j] = (T)0;
    __syncthreads();
    // a thread per expert fills its slots: choices rank by rank, tokens in order (as graph.moe_route)
    HS_COLS(e, {experts}) {
      long used = 0;
      for (long k = 0; k < {k}; ++k) {
        for (long s = 0; s < {tokens}; ++s) {
          // the k-th choice of token s: order by probability, then by the lower expert
          long pick = -1, prev = -1;
          T pv = (T)0, prevv = HS_INF;
          for (long t = 0; t <= k; ++t) {
            pick = -1;
            for (long c = 0; c < {experts}; ++c) {
              const T v = XLOAD[s * {experts}L + c];
              const bool after = v < prevv || (v == prevv && c > prev);
              if (after && (pick < 0 || v > pv)) {
                pick = c;
                pv = v;
              }
            }
            prev = pick;
            prevv = pv;
          }
          if (pick == e) {
            if (used < {capacity}) yr[(s * {experts}L + e) * {capacity}L + used] = (T)1;
            ++used;
          }
        }
      }
    }
    __syncthreads();
  }
}
"""


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
    FRONTEND: ClassVar[tuple[str, ...]] = ("moe_route",)

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

    def sharding_rule(self) -> OpRule:  # a group's routing needs its whole sequence and every expert
        return OpRule((("g", "s", "e"),), (("g", "s", "e", "c"),), blocked=frozenset({"s", "e", "c"}))

    def vjp(self, gs, emit):  # piecewise constant: no gradient
        return [None]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        top_k, capacity = self.top_k.value.data, result_shape(self)[-1]
        return lambda probs: moe_route_values(probs, top_k, capacity)

    def cuda_row_extents(self) -> tuple[int, int]:
        """A block per routing group: rows of [tokens, experts]."""
        s = tensor_shape(self.input)
        return s[0], s[1] * s[2]

    def cuda_row(self, rk: RowKernel) -> KernelCode:
        _, tokens, experts = tensor_shape(self.input)
        src = rk.fill(_MOE_ROUTE, k=str(self.top_k.value.data), capacity=str(tensor_shape(self.result)[-1]),
                      tokens=str(tokens), experts=str(experts))
        return KernelCode(src, rk.launch(), [])


# ----------------------------------------------------------------------------- dispatch and combine


def _slots_by_group(y: np.ndarray) -> np.ndarray:
    """Return expert slots [E, G, C, D] as [G, E*C, D]."""
    e, g, c, d = y.shape
    return np.ascontiguousarray(y.transpose(1, 0, 2, 3)).reshape(g, e * c, d)


def moe_dispatch_values(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """`out[e, g, c] = sum_s mask[g, s, e, c] x[g, s]`: [G, S, D], [G, S, E, C] -> [E, G, C, D]."""
    g, s, e, c = mask.shape
    slots = np.matmul(mask.reshape(g, s, e * c).transpose(0, 2, 1), x)  # [G, E*C, D]
    return np.ascontiguousarray(slots.reshape(g, e, c, -1).transpose(1, 0, 2, 3))


def moe_combine_values(y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """`out[g, s] = sum_{e, c} weights[g, s, e, c] y[e, g, c]`: [E, G, C, D], [G, S, E, C] -> [G, S, D]."""
    g, s, e, c = weights.shape
    return np.matmul(weights.reshape(g, s, e * c), _slots_by_group(y))


def moe_weights_grad_values(t: np.ndarray, y: np.ndarray) -> np.ndarray:
    """`out[g, s, e, c] = sum_d t[g, s, d] y[e, g, c, d]`: [G, S, D], [E, G, C, D] -> [G, S, E, C]."""
    e, g, c, _ = y.shape
    return np.matmul(t, _slots_by_group(y).transpose(0, 2, 1)).reshape(g, t.shape[1], e, c)


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
    FRONTEND: ClassVar[tuple[str, ...]] = ("moe_dispatch",)

    def __init__(self, x: SSAValue, mask: SSAValue, result_type: Attribute):
        super().__init__(operands=[x, mask], result_types=[result_type])

    def verify_(self) -> None:
        _moe_shapes(self, self.x, self.result, self.mask)

    def sharding_rule(self) -> OpRule:
        return OpRule((("g", "s", "d"), ("g", "s", "e", "c")), (("e", "g", "c", "d"),), frozenset({0, 1}),
                      joint=False)

    def vjp(self, gs, emit):
        g = gs[0]
        return [lambda: emit(MoeCombineOp(g, self.mask, self.x.type)),
                lambda: emit(MoeWeightsGradOp(self.x, g, self.mask.type))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return moe_dispatch_values

    def cuda_kernel(self, name: str) -> KernelCode:
        """Per slot element `out[e, g, c, d]`: the sum over the group's tokens s of mask * x."""
        e, g, c, d = tensor_shape(self.result)
        s = tensor_shape(self.x)[1]
        body = (f"const long dd = i % {d}L, cc = (i / {d}L) % {c}L, gg = (i / {c * d}L) % {g}L, ee = i / {g * c * d}L;\n"
                f"    T acc = 0;\n"
                f"    for (long s = 0; s < {s}L; ++s) acc += in1[((gg * {s}L + s) * {e}L + ee) * {c}L + cc] * in0[(gg * {s}L + s) * {d}L + dd];\n"
                f"    out0[i] = acc;")
        return flat_kernel(name, self, c_type(self.result.type), body)


@irdl_op_definition
class MoeCombineOp(TensorOp):
    """Expert slots back to tokens: `out[g, s] = sum_{e, c} weights[g, s, e, c] * y[e, g, c]`,
    y [E, G, C, D], weights [G, S, E, C] -> [G, S, D] (the transpose of `graph.moe_dispatch`)."""

    name = "graph.moe_combine"
    y = operand_def(TensorType)
    weights = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    FRONTEND: ClassVar[tuple[str, ...]] = ("moe_combine",)

    def __init__(self, y: SSAValue, weights: SSAValue, result_type: Attribute):
        super().__init__(operands=[y, weights], result_types=[result_type])

    def verify_(self) -> None:
        _moe_shapes(self, self.result, self.y, self.weights)

    def sharding_rule(self) -> OpRule:  # the tokens' side (weights) leads: expert outputs come back by all-to-all
        return OpRule((("e", "g", "c", "d"), ("g", "s", "e", "c")), (("g", "s", "d"),), frozenset({0, 1}),
                      joint=False, lead=1)

    def vjp(self, gs, emit):
        g = gs[0]
        return [lambda: emit(MoeDispatchOp(g, self.weights, self.y.type)),
                lambda: emit(MoeWeightsGradOp(g, self.y, self.weights.type))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return moe_combine_values

    def cuda_kernel(self, name: str) -> KernelCode:
        """Per token element `out[g, s, d]`: the sum over the slots (e, c) of weights * y."""
        e, g, c, d = tensor_shape(self.y)
        s = tensor_shape(self.result)[1]
        body = (f"const long dd = i % {d}L, ss = (i / {d}L) % {s}L, gg = i / {s * d}L;\n"
                f"    T acc = 0;\n"
                f"    for (long ee = 0; ee < {e}L; ++ee)\n"
                f"      for (long cc = 0; cc < {c}L; ++cc)\n"
                f"        acc += in1[((gg * {s}L + ss) * {e}L + ee) * {c}L + cc] * in0[((ee * {g}L + gg) * {c}L + cc) * {d}L + dd];\n"
                f"    out0[i] = acc;")
        return flat_kernel(name, self, c_type(self.result.type), body)


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
    NO_VJP: ClassVar[str] = "a gradient op (no second derivatives)"

    def __init__(self, t: SSAValue, y: SSAValue, result_type: Attribute):
        super().__init__(operands=[t, y], result_types=[result_type])

    def verify_(self) -> None:
        _moe_shapes(self, self.t, self.y, self.result)

    def sharding_rule(self) -> OpRule:
        return OpRule((("g", "s", "d"), ("e", "g", "c", "d")), (("g", "s", "e", "c"),), frozenset({0, 1}),
                      joint=False, lead=0)

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return moe_weights_grad_values

    def cuda_kernel(self, name: str) -> KernelCode:
        """Per weight `out[g, s, e, c]`: the dot product over d of t[g, s] and y[e, g, c]."""
        e, g, c, d = tensor_shape(self.y)
        s = tensor_shape(self.t)[1]
        body = (f"const long cc = i % {c}L, ee = (i / {c}L) % {e}L, ss = (i / {e * c}L) % {s}L, gg = i / {s * e * c}L;\n"
                f"    T acc = 0;\n"
                f"    for (long dd = 0; dd < {d}L; ++dd) acc += in0[(gg * {s}L + ss) * {d}L + dd] * in1[((ee * {g}L + gg) * {c}L + cc) * {d}L + dd];\n"
                f"    out0[i] = acc;")
        return flat_kernel(name, self, c_type(self.result.type), body)


# ----------------------------------------------------------------------------- frontend


def expert_matmul(x, w):
    """Return each expert's tokens times its weight: [E, m, k] x [E, k, n] -> [E, m, n]."""
    x, w = as_tensor(x, "expert_matmul"), as_tensor(w, "expert_matmul")
    if x.ndim != 3 or w.ndim != 3 or x.shape[0] != w.shape[0] or x.shape[2] != w.shape[1]:
        raise fail("expert_matmul", f"cannot multiply {list(x.shape)} by {list(w.shape)} (needs [E, m, k] x [E, k, n])")
    if x.dtype != w.dtype:
        raise fail("expert_matmul", f"operands have dtypes {x.dtype} and {w.dtype}")
    return x.tracer.emit(ExpertMatmulOp(x.value, w.value, typed(x, (*x.shape[:2], w.shape[2]))))


def moe_route(probs, top_k: int, capacity: int):
    """Return the dispatch mask [G, S, E, C] of router probabilities [G, S, E]: each token's
    `top_k` experts, placed in each expert's `capacity` slots per group, the rest dropped
    (see `graph.moe_route`). It has no gradient."""
    probs = as_tensor(probs, "moe_route")
    require_float(probs, "moe_route")
    if probs.ndim != 3:
        raise fail("moe_route", f"needs router probabilities [groups, tokens, experts], got {list(probs.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= probs.shape[2]:
        raise fail("moe_route", f"top_k={top_k!r} must be an integer in 1..{probs.shape[2]} (the experts)")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise fail("moe_route", f"capacity={capacity!r} must be an integer >= 1")
    return probs.tracer.emit(MoeRouteOp(probs.value, top_k, typed(probs, (*probs.shape, capacity))))


def moe_dispatch(x, mask):
    """Return tokens x [G, S, D] placed in expert slots [E, G, C, D] by `mask` [G, S, E, C]."""
    x, mask = as_tensor(x, "moe_dispatch"), as_tensor(mask, "moe_dispatch")
    if x.ndim != 3 or mask.ndim != 4 or mask.shape[:2] != x.shape[:2] or x.dtype != mask.dtype:
        raise fail("moe_dispatch", f"needs tokens [G, S, D] and a mask [G, S, E, C] of one dtype, "
                                   f"got {list(x.shape)} {x.dtype} and {list(mask.shape)} {mask.dtype}")
    g, s, e, c = mask.shape
    return x.tracer.emit(MoeDispatchOp(x.value, mask.value, typed(x, (e, g, c, x.shape[2]))))


def moe_combine(y, weights):
    """Return expert slots y [E, G, C, D] summed back to tokens [G, S, D] with `weights` [G, S, E, C]."""
    y, weights = as_tensor(y, "moe_combine"), as_tensor(weights, "moe_combine")
    ok = y.ndim == 4 and weights.ndim == 4 and y.dtype == weights.dtype
    ok = ok and (weights.shape[2], weights.shape[0], weights.shape[3]) == y.shape[:3]
    if not ok:
        raise fail("moe_combine", f"needs expert slots [E, G, C, D] and weights [G, S, E, C] of one dtype, "
                                  f"got {list(y.shape)} {y.dtype} and {list(weights.shape)} {weights.dtype}")
    g, s = weights.shape[:2]
    return y.tracer.emit(MoeCombineOp(y.value, weights.value, typed(y, (g, s, y.shape[3]))))
