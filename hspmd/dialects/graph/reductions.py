"""Reductions over dims and their transposes: sum and broadcast, max and max's gradient."""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
from xdsl.dialects.builtin import DenseArrayBase, TensorType
from xdsl.ir import Attribute, SSAValue
from xdsl.irdl import irdl_op_definition, operand_def, prop_def, result_def, traits_def
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.cuda_c import KernelCode, c_type, contiguous_strides, flat_kernel, kernel_params, offset_expr, retype
from hspmd.dialects.graph.base import TensorOp, UnaryOp, check_same_shape, i64_array, result_dtype, tensor_shape
from hspmd.dialects.graph.shape import ReshapeOp
from hspmd.dialects.interfaces import FRESH, OUT, Emit, Kernel, KernelContext, OutFacts, takes_out
from hspmd.dialects.op_rule import OpRule, factors
from hspmd.dialects.traced import as_tensor, norm_dim, require_float, typed
from hspmd.ir.types import dtype_name

__all__ = [
    "ReduceSumOp",
    "BroadcastOp",
    "ReduceMaxOp",
    "ReduceMaxGradOp",
]


class _Reduce(UnaryOp):
    dims = prop_def(DenseArrayBase)

    def __init__(self, input: SSAValue, dims: Sequence[int], result_type: Attribute):
        super().__init__(input, result_type, dims=i64_array(dims))

    def verify_(self) -> None:
        dims = self.dims.get_values()
        src = tensor_shape(self.input)
        if list(dims) != sorted(set(dims)) or any(not 0 <= d < len(src) for d in dims):
            raise VerifyException(f"'{self.name}' dims {list(dims)} are not sorted dims of {list(src)}")
        expect = tuple(s for i, s in enumerate(src) if i not in dims)
        if tensor_shape(self.result) != expect:
            raise VerifyException(f"'{self.name}' of {list(src)} over {list(dims)} has shape {list(expect)}")


@irdl_op_definition
class ReduceSumOp(_Reduce):
    """Sum over `dims` (removed from the shape)."""

    name = "graph.reduce_sum"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.sum.dim_IntList", "aten.sum.default", "aten.mean.dim",
                                       "aten.mean.default", "aten.var.correction", "aten.var.dim",
                                       "aten.linalg_vector_norm.default")
    FRONTEND: ClassVar[tuple[str, ...]] = ("Tensor.sum", "Tensor.mean")

    def sharding_rule(self) -> OpRule:
        d = factors("d", len(tensor_shape(self.input)))
        dims = set(self.dims.get_values())
        return OpRule((d,), (tuple(f for i, f in enumerate(d) if i not in dims),), frozenset({0}))

    def vjp(self, gs, emit):
        dims = set(self.dims.get_values())
        kept = [d for d in range(len(tensor_shape(self.input))) if d not in dims]
        return [lambda: emit(BroadcastOp(gs[0], kept, self.input.type))]

    def _same_dtype(self) -> bool:
        return dtype_name(self.input.type) == dtype_name(self.result.type)

    def out_facts(self) -> OutFacts:
        return OUT if self._same_dtype() else FRESH  # sums in its own dtype into out=; a cast sum allocates

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        dims = tuple(self.dims.get_values())
        dtype = result_dtype(self)
        if self._same_dtype():
            return takes_out(lambda x, out=None: np.sum(x, axis=dims, out=out))
        return lambda x: np.asarray(x.sum(axis=dims), dtype=dtype)

    def cuda_kernel(self, name: str) -> KernelCode:
        """A block per result element, its threads summing the reduced elements (in the result's type)."""
        return _reduce_kernel(name, self, "sum")

@irdl_op_definition
class BroadcastOp(UnaryOp):
    """Broadcasts to the result shape; input dim i becomes result dim `dims[i]` (size equal or 1)."""

    name = "graph.broadcast"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.expand.default", "aten.copy.default", "aten.repeat.default")
    dims = prop_def(DenseArrayBase)
    FRONTEND: ClassVar[tuple[str, ...]] = ("Tensor.broadcast_to",)

    def __init__(self, input: SSAValue, dims: Sequence[int], result_type: Attribute):
        super().__init__(input, result_type, dims=i64_array(dims))

    def verify_(self) -> None:
        dims = self.dims.get_values()
        src, dst = tensor_shape(self.input), tensor_shape(self.result)
        if len(dims) != len(src) or list(dims) != sorted(set(dims)) or any(d >= len(dst) for d in dims):
            raise VerifyException(f"'graph.broadcast' dims {list(dims)} do not map {list(src)} into {list(dst)}")
        for i, d in enumerate(dims):
            if src[i] not in (1, dst[d]):
                raise VerifyException(f"'graph.broadcast' cannot stretch dim {i} of {list(src)} to {list(dst)}")

    def sharding_rule(self) -> OpRule:
        dims = self.dims.get_values()
        src_shape, dst_shape = tensor_shape(self.input), tensor_shape(self.result)
        out = list(factors("o", len(dst_shape)))
        src = tuple(out[d] if src_shape[i] == dst_shape[d] else f"one{i}" for i, d in enumerate(dims))
        return OpRule((src,), (tuple(out),), frozenset({0}))

    def vjp(self, gs, emit):
        return [lambda: unbroadcast(emit, gs[0], self)]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        shape, dims = tensor_shape(self.result), self.dims.get_values()
        placed = [1] * len(shape)

        def broadcast(x: np.ndarray) -> np.ndarray:
            view = list(placed)
            for i, d in enumerate(dims):
                view[d] = x.shape[i]
            return np.broadcast_to(x.reshape(view), shape)

        return broadcast

    def cuda_kernel(self, name: str) -> KernelCode:
        """The broadcast written out (a fused kernel reads through it instead: `cuda_read_index`)."""
        dims, src = self.dims.get_values(), tensor_shape(self.input)
        in_strides = contiguous_strides(src)
        strides = [0] * len(tensor_shape(self.result))
        for i, d in enumerate(dims):
            strides[d] = in_strides[i] if src[i] != 1 else 0
        return flat_kernel(name, self, c_type(self.result.type),
                           f"out0[i] = in0[{offset_expr('i', tensor_shape(self.result), strides)}];")

    def cuda_read_index(self, cols: int) -> str:
        """Return the C expression of the input offset read at result position (row r, column j)
        of the result seen as rows of `cols` (its last dim): a fused kernel reads through the
        broadcast instead of materialising it."""
        out_shape, in_shape = tensor_shape(self.result), tensor_shape(self.input)
        dims = list(self.dims.get_values())
        in_strides = [math.prod(in_shape[k + 1:]) for k in range(len(in_shape))]
        terms = []
        for k, d in enumerate(dims):
            if in_shape[k] == 1:
                continue
            if d == len(out_shape) - 1:
                terms.append(f"j * {in_strides[k]}L" if in_strides[k] != 1 else "j")
            else:
                row_stride = math.prod(out_shape[d + 1:-1])  # rows per step of dim d
                terms.append(f"((r / {row_stride}L) % {out_shape[d]}L) * {in_strides[k]}L")
        return " + ".join(terms) or "0"


@irdl_op_definition
class ReduceMaxOp(_Reduce):
    """Maximum over `dims` (removed from the shape)."""

    name = "graph.reduce_max"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.amax.default", "aten.any.default", "aten.any.dim", "aten.any.dims",
                                       "aten.amin.default", "aten.max.default", "aten.min.default")
    FRONTEND: ClassVar[tuple[str, ...]] = ("max", "Tensor.max")

    def sharding_rule(self) -> OpRule:  # a max of pieces is not a sum: reduced dims stay whole
        d = factors("d", len(tensor_shape(self.input)))
        dims = set(self.dims.get_values())
        kept = tuple(f for i, f in enumerate(d) if i not in dims)
        return OpRule((d,), (kept,), blocked=frozenset(d[i] for i in dims))

    def vjp(self, gs, emit):
        return [lambda: emit(ReduceMaxGradOp(self.input, self.result, gs[0], self.dims.get_values()))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        dims = tuple(self.dims.get_values())
        return lambda x: np.asarray(x.max(axis=dims))

    def cuda_kernel(self, name: str) -> KernelCode:
        return _reduce_kernel(name, self, "max")


@irdl_op_definition
class ReduceMaxGradOp(TensorOp):
    """The gradient of `graph.reduce_max` (same dims): `dy` goes to the positions of `x` equal
    to the maximum `y`, split evenly between ties."""

    name = "graph.reduce_max_grad"
    NO_VJP: ClassVar[str] = "a gradient op (no second derivatives)"
    x = operand_def(TensorType)
    y = operand_def(TensorType)
    dy = operand_def(TensorType)
    result = result_def(TensorType)
    dims = prop_def(DenseArrayBase)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, y: SSAValue, dy: SSAValue, dims: Sequence[int]):
        super().__init__(operands=[x, y, dy], result_types=[x.type], properties={"dims": i64_array(dims)})

    def verify_(self) -> None:
        dims = self.dims.get_values()
        src = tensor_shape(self.x)
        kept = tuple(s for i, s in enumerate(src) if i not in dims)
        if tensor_shape(self.y) != kept or tensor_shape(self.dy) != kept:
            raise VerifyException(f"'{self.name}' needs y and dy of shape {list(kept)}")
        check_same_shape(self, self.x, self.result)

    def sharding_rule(self) -> OpRule:
        d = factors("d", len(tensor_shape(self.x)))
        dims = set(self.dims.get_values())
        kept = tuple(f for i, f in enumerate(d) if i not in dims)
        return OpRule((d, kept, kept), (d,), frozenset({2}), blocked=frozenset(d[i] for i in dims))

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        dims = tuple(self.dims.get_values())
        return lambda x, y, dy: reduce_max_grad_values(x, y, dy, dims)

    def cuda_kernel(self, name: str) -> KernelCode:
        """A block per element of `y`: count the ties over the reduced elements, then share `dy`."""
        base, offset, rows, cols = _reduced_indexing(tensor_shape(self.x), self.dims.get_values())
        t = c_type(self.result.type)
        src = (f"// {name}: graph.reduce_max_grad\n"
               f"HS_KERNEL void {name}({', '.join(kernel_params(self))}) {{\n"
               f"  HS_ROWS(r, n0) {{\n"
               f"    const long base = {base};\n"
               f"    const T top = in1[r];\n"
               f"    T count = 0;\n"
               f"    HS_COLS_SUM(j, n1, count) count += (in0[base + {offset}] == top) ? (T)1 : (T)0;\n"
               f"    count = hs_block_sum(count);\n"
               f"    const T share = in2[r] / count;\n"
               f"    HS_COLS(j, n1) {{\n"
               f"      const long o = base + {offset};\n"
               f"      out0[o] = (in0[o] == top) ? share : (T)0;\n"
               f"    }}\n  }}\n}}\n")
        return KernelCode(retype(src, t), [f"row {name} {rows} {cols}"])


def reduce_max_grad_values(x: np.ndarray, y: np.ndarray, dy: np.ndarray, dims: tuple[int, ...]) -> np.ndarray:
    """`dy` to the positions of `x` holding the maximum `y` over `dims`; ties share it evenly."""
    hit = x == np.expand_dims(y, dims)
    count = hit.sum(axis=dims, keepdims=True)
    return (hit * (np.expand_dims(dy, dims) / count)).astype(dy.dtype, copy=False)


def unbroadcast(emit: Emit, g: SSAValue, op: BroadcastOp) -> SSAValue:
    """Return `g` summed back to the broadcast `op`'s input shape."""
    src = tensor_shape(op.input)
    dims = op.dims.get_values()
    kept = {d for i, d in enumerate(dims) if src[i] != 1 or tensor_shape(op.result)[d] == 1}
    summed = [d for d in range(len(tensor_shape(g))) if d not in kept]
    if summed:
        shape = [s for d, s in enumerate(tensor_shape(g)) if d not in summed]
        g = emit(ReduceSumOp(g, summed, TensorType(g.type.element_type, shape)))  # type: ignore[attr-defined]
    if tensor_shape(g) != src:
        g = emit(ReshapeOp(g, TensorType(g.type.element_type, src)))  # type: ignore[attr-defined]
    return g


# ----------------------------------------------------------------------------- frontend


def max(x, dims: int | Sequence[int] | None = None):  # noqa: A001 - hs.max, like x.max
    """Return the maximum over `dims` (all dims if None). Its gradient goes to the positions
    holding the maximum, split evenly between ties."""
    x = as_tensor(x, "max")
    require_float(x, "max")
    if dims is None:
        dims = list(range(x.ndim))
    dims = [dims] if isinstance(dims, int) else list(dims)
    norm = sorted({norm_dim(x, d, "max") for d in dims})
    shape = [s for i, s in enumerate(x.shape) if i not in norm]
    return x.tracer.emit(ReduceMaxOp(x.value, norm, typed(x, shape)))


def _reduced_indexing(shape: tuple[int, ...], dims) -> tuple[str, str, int, int]:
    """Return (C expression of row `r`'s base offset, of the offset of its `j`-th reduced element
    from there, rows, columns) of a reduction of a contiguous `shape` over `dims`: a row per kept
    element, a column per reduced one."""
    strides = contiguous_strides(shape)
    kept = [k for k in range(len(shape)) if k not in dims]
    reduced = [k for k in range(len(shape)) if k in dims]
    base = offset_expr("r", [shape[k] for k in kept], [strides[k] for k in kept])
    offset = offset_expr("j", [shape[k] for k in reduced], [strides[k] for k in reduced])
    return base, offset, builtins.max(math.prod(shape[k] for k in kept), 1), math.prod(shape[k] for k in reduced)  # `max` is hs.max here


def _reduce_kernel(name: str, op: UnaryOp, kind: str) -> KernelCode:
    """A row kernel reducing `op`'s operand over its dims into its result (in the result's type)."""
    base, offset, rows, cols = _reduced_indexing(tensor_shape(op.input), op.dims.get_values())  # type: ignore[attr-defined]
    t = c_type(op.result.type)  # type: ignore[attr-defined]
    if kind == "sum":
        init, step, block = "(T)0", f"acc += (T)in0[base + {offset}];", "hs_block_sum(acc)"
        loop = "HS_COLS_SUM(j, n1, acc)"
    else:
        init, step, block = "-HS_INF", f"acc = hs_max(acc, (T)in0[base + {offset}]);", "hs_block_max(acc)"
        loop = "HS_COLS_MAX(j, n1, acc)"
    src = (f"// {name}: {op.name}\n"
           f"HS_KERNEL void {name}({', '.join(kernel_params(op))}) {{\n"
           f"  HS_ROWS(r, n0) {{\n"
           f"    const long base = {base};\n"
           f"    T acc = {init};\n"
           f"    {loop} {step}\n"
           f"    acc = {block};\n"
           f"    if (threadIdx.x == 0) out0[r] = acc;\n"
           f"  }}\n}}\n")
    return KernelCode(retype(src, t), [f"row {name} {rows} {builtins.max(cols, 1)}"])
