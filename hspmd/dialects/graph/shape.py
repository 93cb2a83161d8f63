"""Shape and layout ops: transpose, reshape, broadcast, slice, split and concat (views where they can be)."""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from xdsl.dialects.builtin import (
    I64,
    DenseArrayBase,
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
    var_operand_def,
    var_result_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.cuda_c import KernelCode, c_type, contiguous_strides, flat_kernel, kernel_params, offset_expr
from hspmd.dialects.graph.base import (
    TensorOp,
    UnaryOp,
    check_dim,
    check_same_element_type,
    i64_array,
    int_attr,
    shared_grad,
    tensor_shape,
)
from hspmd.dialects.graph.leaves import ConstantOp, grad_or_zeros
from hspmd.dialects.interfaces import OUT, Emit, Kernel, KernelContext, OutFacts, takes_out
from hspmd.dialects.op_rule import OpRule, factors
from hspmd.dialects.traced import as_tensor, fail, norm_dim, typed

__all__ = [
    "TransposeOp",
    "ReshapeOp",
    "SliceOp",
    "SplitOp",
    "ConcatOp",
    "StopGradientOp",
]


@irdl_op_definition
class TransposeOp(UnaryOp):
    """Permutes dimensions: result dim i is input dim `perm[i]`."""

    name = "graph.transpose"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.permute.default", "aten.transpose.int", "aten.t.default",)
    perm = prop_def(DenseArrayBase)
    FRONTEND: ClassVar[tuple[str, ...]] = ("Tensor.transpose", "Tensor.T")

    def __init__(self, input: SSAValue, perm: Sequence[int], result_type: Attribute):
        super().__init__(input, result_type, perm=i64_array(perm))

    def verify_(self) -> None:
        perm = self.perm.get_values()
        shape = tensor_shape(self.input)
        if sorted(perm) != list(range(len(shape))):
            raise VerifyException(f"'graph.transpose' perm {list(perm)} is not a permutation of {len(shape)} dims")
        if tensor_shape(self.result) != tuple(shape[p] for p in perm):
            raise VerifyException("'graph.transpose' result shape does not match the permuted input shape")

    def sharding_rule(self) -> OpRule:
        d = factors("d", len(tensor_shape(self.input)))
        return OpRule((d,), (tuple(d[p] for p in self.perm.get_values()),), frozenset({0}))

    def vjp(self, gs, emit):
        perm = self.perm.get_values()
        inverse = [perm.index(i) for i in range(len(perm))]
        return [lambda: emit(TransposeOp(gs[0], inverse, self.input.type))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        perm = tuple(self.perm.get_values())
        return lambda x: np.transpose(x, perm)  # a view

    def cuda_kernel(self, name: str) -> KernelCode:
        """A copy in the permuted order (a device array is contiguous: a transposed view is not)."""
        src = contiguous_strides(tensor_shape(self.input))
        strides = [src[p] for p in self.perm.get_values()]
        return flat_kernel(name, self, c_type(self.result.type),
                           f"out0[i] = in0[{offset_expr('i', tensor_shape(self.result), strides)}];")


@irdl_op_definition
class ReshapeOp(UnaryOp):
    """Same elements in row-major order, another shape (the result type's)."""

    name = "graph.reshape"
    #: a device array is contiguous, so a reshape is a view there too (no kernel)
    DEVICE_VIEW: ClassVar[bool] = True
    ATEN: ClassVar[tuple[str, ...]] = (
        "aten.view.default",
        "aten.reshape.default",
        "aten._unsafe_view.default",
        "aten.unsqueeze.default",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.squeeze.default",
        "aten.flatten.using_ints",
        "aten.unflatten.int",
    )
    FRONTEND: ClassVar[tuple[str, ...]] = ("Tensor.reshape",)

    def verify_(self) -> None:
        if math.prod(tensor_shape(self.input)) != math.prod(tensor_shape(self.result)):
            raise VerifyException(
                f"'graph.reshape' cannot reshape {list(tensor_shape(self.input))} "
                f"into {list(tensor_shape(self.result))}"
            )

    def sharding_rule(self) -> OpRule:
        src, dst, extents = reshape_factors(tensor_shape(self.input), tensor_shape(self.result))
        blocked = frozenset(f for f in (*src, *dst) if f.startswith("r"))
        return OpRule((src,), (dst,), frozenset({0}), blocked=blocked, extents=extents)

    def vjp(self, gs, emit):
        return [lambda: emit(ReshapeOp(gs[0], self.input.type))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        shape = tensor_shape(self.result)
        return lambda x: x.reshape(shape)


@irdl_op_definition
class SliceOp(UnaryOp):
    """`x[..., start:start + n, ...]` along `dim`, n the result's size there."""

    name = "graph.slice"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.slice.Tensor", "aten.select.int",)
    dim = prop_def(IntegerAttr[I64])
    start = prop_def(IntegerAttr[I64])
    FRONTEND: ClassVar[tuple[str, ...]] = ("slice",)

    def __init__(self, input: SSAValue, dim: int, start: int, result_type: Attribute):
        super().__init__(input, result_type, dim=int_attr(dim), start=int_attr(start))

    def verify_(self) -> None:
        src, dst = tensor_shape(self.input), tensor_shape(self.result)
        d = check_dim(self, self.dim, len(src))
        start = self.start.value.data
        same_rest = len(src) == len(dst) and all(a == b for i, (a, b) in enumerate(zip(src, dst)) if i != d)
        if not same_rest or start < 0 or start + dst[d] > src[d]:
            raise VerifyException(f"'{self.name}' cannot take {list(dst)} at {start} along dim {d} of {list(src)}")
        check_same_element_type(self, self.input, self.result)

    def sharding_rule(self) -> OpRule:
        return _pieces_rule(self)

    def vjp(self, gs, emit):
        d, start = self.dim.value.data, self.start.value.data
        return [lambda: zeros_around(emit, gs[0], tensor_shape(self.input), d, start)]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        d, start = self.dim.value.data, self.start.value.data
        stop = start + tensor_shape(self.result)[d]
        index = tuple([builtins.slice(None)] * d + [builtins.slice(start, stop)])  # `slice` is hs.slice here
        return lambda x: x[index]  # a view

    def cuda_kernel(self, name: str) -> KernelCode:
        strides = contiguous_strides(tensor_shape(self.input))
        base = self.start.value.data * strides[self.dim.value.data]
        return flat_kernel(name, self, c_type(self.result.type),
                           f"out0[i] = in0[{base}L + {offset_expr('i', tensor_shape(self.result), strides)}];")


@irdl_op_definition
class SplitOp(TensorOp):
    """Consecutive pieces of `input` along `dim`; the results' sizes there sum to the input's."""

    name = "graph.split"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.split.Tensor", "aten.split_with_sizes.default",)
    input = operand_def(TensorType)
    outputs = var_result_def(TensorType)
    dim = prop_def(IntegerAttr[I64])
    traits = traits_def(Pure())
    FRONTEND: ClassVar[tuple[str, ...]] = ("split",)

    def __init__(self, input: SSAValue, dim: int, result_types: Sequence[Attribute]):
        super().__init__(operands=[input], result_types=[list(result_types)], properties={"dim": int_attr(dim)})

    def verify_(self) -> None:
        src = tensor_shape(self.input)
        d = check_dim(self, self.dim, len(src))
        shapes = [tensor_shape(r) for r in self.outputs]
        ok = bool(shapes) and all(len(s) == len(src) and all(a == b for i, (a, b) in enumerate(zip(s, src)) if i != d)
                                  for s in shapes)
        if not ok or sum(s[d] for s in shapes) != src[d]:
            raise VerifyException(f"'{self.name}' of {list(src)} along dim {d} cannot give {[list(s) for s in shapes]}")
        check_same_element_type(self, self.input, *self.outputs)

    def sharding_rule(self) -> OpRule:
        return _pieces_rule(self)

    def vjp(self, gs, emit):
        d = self.dim.value.data
        return [lambda: emit(ConcatOp([grad_or_zeros(emit, gs, self, i) for i in range(len(gs))], d, self.input.type))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        d = self.dim.value.data
        bounds = np.cumsum([r.type.get_shape()[d] for r in self.outputs])[:-1].tolist()
        if not bounds:  # one result: the plan stores the array itself, not a tuple
            return lambda x: x
        return lambda x: tuple(np.split(x, bounds, axis=d))  # views

    def cuda_kernel(self, name: str) -> KernelCode:
        """One launch per piece: a copy of its slice of the input."""
        d, strides = self.dim.value.data, contiguous_strides(tensor_shape(self.input))
        functions, launches, start = [], [], 0
        for k, r in enumerate(self.outputs):
            shape = tensor_shape(r)
            functions.append(f"HS_KERNEL void {name}_{k}({', '.join(kernel_params(self))}) {{\n"
                             f"  HS_FOR(i, n0) out{k}[i] = in0[{start * strides[d]}L + {offset_expr('i', shape, strides)}];\n}}\n")
            launches.append(f"elementwise {name}_{k} {math.prod(shape)} 0")
            start += shape[d]
        return KernelCode(f"// {name}: graph.split\n" + "".join(functions), launches)


@irdl_op_definition
class ConcatOp(TensorOp):
    """The operands joined along `dim` (same shapes elsewhere)."""

    name = "graph.concat"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.cat.default", "aten.slice_scatter.default",
                                       "aten.select_scatter.default", "aten.constant_pad_nd.default")
    inputs = var_operand_def(TensorType)
    result = result_def(TensorType)
    dim = prop_def(IntegerAttr[I64])
    traits = traits_def(Pure())
    OUT_FACTS: ClassVar[OutFacts] = OUT
    FRONTEND: ClassVar[tuple[str, ...]] = ("concat",)

    def __init__(self, inputs: Sequence[SSAValue], dim: int, result_type: Attribute):
        super().__init__(operands=[list(inputs)], result_types=[result_type], properties={"dim": int_attr(dim)})

    def verify_(self) -> None:
        dst = tensor_shape(self.result)
        d = check_dim(self, self.dim, len(dst))
        shapes = [tensor_shape(x) for x in self.inputs]
        ok = bool(shapes) and all(len(s) == len(dst) and all(a == b for i, (a, b) in enumerate(zip(s, dst)) if i != d)
                                  for s in shapes)
        if not ok or sum(s[d] for s in shapes) != dst[d]:
            raise VerifyException(f"'{self.name}' cannot join {[list(s) for s in shapes]} along dim {d} into {list(dst)}")
        check_same_element_type(self, *self.inputs, self.result)

    def sharding_rule(self) -> OpRule:
        return _pieces_rule(self)

    def vjp(self, gs, emit):
        g, d = gs[0], self.dim.value.data
        if len(self.inputs) == 1:
            return [lambda: g]
        parts = shared_grad(emit, lambda: SplitOp(g, d, [x.type for x in self.inputs]))
        return [(lambda i=i: parts().results[i]) for i in range(len(self.inputs))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        d = self.dim.value.data
        return takes_out(lambda *xs, out=None: concat_values(xs, d, out))

    def cuda_kernel(self, name: str) -> KernelCode:
        """One launch per operand: a copy into its slice of the result."""
        d, strides = self.dim.value.data, contiguous_strides(tensor_shape(self.result))
        functions, launches, start = [], [], 0
        for k, x in enumerate(self.inputs):
            shape = tensor_shape(x)
            functions.append(f"HS_KERNEL void {name}_{k}({', '.join(kernel_params(self))}) {{\n"
                             f"  HS_FOR(i, n0) out0[{start * strides[d]}L + {offset_expr('i', shape, strides)}] = in{k}[i];\n}}\n")
            launches.append(f"elementwise {name}_{k} {math.prod(shape)} 0")
            start += shape[d]
        return KernelCode(f"// {name}: graph.concat\n" + "".join(functions), launches)


def _pieces_rule(op: Operation) -> OpRule:
    """The rule of slice, split and concat: offsets are global along `dim`, so it is kept whole."""
    d = factors("d", len(tensor_shape(op.results[0])))
    blocked = frozenset({d[op.dim.value.data]})  # type: ignore[attr-defined]
    return OpRule(tuple(d for _ in op.operands), tuple(d for _ in op.results),
                  frozenset(range(len(op.operands))), joint=True, blocked=blocked)


# ----------------------------------------------------------------------------- helpers of the facts


def reshape_factors(
    src: Sequence[int], dst: Sequence[int]
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[str, int], ...]]:
    """Return (source factors, result factors, extents) for a reshape.

    Dims kept whole at the same offset (stride) share a factor. A dim that is the product of
    consecutive dims of the other side ending at the same offset (`[B,T,D] -> [B,T,H,hd]`,
    D = H*hd, or the reverse merge) shares its factor with the MAJOR of those sub-dims: a split
    of D into k contiguous chunks is a split of H into k chunks exactly when k divides H, so the
    factor's extent is H (`extents`) and a degree that does not divide it is not offered. The
    minor sub-dims, and dims matched in no way, get blocked factors (`rs*`, `rd*`).
    """

    def offsets(shape):
        out, acc = [], 1
        for s in reversed(shape):
            out.append(acc)
            acc *= s
        return list(reversed(out))

    so, do = offsets(src), offsets(dst)
    shared: dict[int, int] = {}  # source dim -> result dim with the same factor
    for i, (s, o) in enumerate(zip(src, so)):
        for j, (t, p) in enumerate(zip(dst, do)):
            if s == t and o == p and j not in shared.values():
                shared[i] = j
                break
    extents: list[tuple[str, int]] = []

    def merge(big, big_off, small, small_off, taken_big, taken_small):
        """Yield (big dim, major small dim) where big dim = product of consecutive small dims."""
        for i, (s, o) in enumerate(zip(big, big_off)):
            if i in taken_big or s == 1:
                continue
            for j in range(len(small)):
                prod, k = 1, j
                while k < len(small) and prod < s:
                    prod *= small[k]
                    k += 1
                if k - j >= 2 and prod == s and small_off[k - 1] == o and small[j] > 1 \
                        and not any(x in taken_small for x in range(j, k)):
                    yield i, j
                    taken_small.update(range(j, k))
                    break

    used_src, used_dst = set(shared), set(shared.values())
    for i, j in list(merge(src, so, dst, do, used_src, used_dst)):  # one source dim -> several result dims
        shared[i] = j
        used_src.add(i)
        extents.append((f"f{j}", dst[j]))
    for j, i in list(merge(dst, do, src, so, used_dst, used_src)):  # several source dims -> one result dim
        shared[i] = j
        extents.append((f"f{j}", src[i]))
    a = tuple(f"f{shared[i]}" if i in shared else f"rs{i}" for i in range(len(src)))
    b = tuple(f"f{j}" if j in shared.values() else f"rd{j}" for j in range(len(dst)))
    return a, b, tuple(extents)


def transpose_last_two(emit, x: SSAValue) -> SSAValue:
    """Emit `x` with its last two dims swapped (a `graph.transpose`) and return it."""
    shape = tensor_shape(x)
    n = len(shape)
    perm = [*range(n - 2), n - 1, n - 2]
    return emit(TransposeOp(x, perm, TensorType(x.type.element_type, [shape[p] for p in perm])))  # type: ignore[attr-defined]


def zeros_around(emit: Emit, g: SSAValue, full: Sequence[int], dim: int, start: int) -> SSAValue:
    """Return `g` placed at `start` along `dim` in zeros of shape `full` (a concat with zeros)."""
    parts = []
    before, after = start, full[dim] - start - tensor_shape(g)[dim]
    for size, piece in ((before, None), (None, g), (after, None)):
        if piece is not None:
            parts.append(piece)
        elif size:
            shape = list(full)
            shape[dim] = size
            parts.append(emit(ConstantOp(0.0, TensorType(g.type.element_type, shape))))  # type: ignore[attr-defined]
    if len(parts) == 1:
        return g
    return emit(ConcatOp(parts, dim, TensorType(g.type.element_type, full)))  # type: ignore[attr-defined]


def concat_values(xs: tuple[np.ndarray, ...], axis: int, out: np.ndarray | None = None) -> np.ndarray:
    """`np.concatenate(xs, axis)`; into `out`, an operand that already is its part of `out` (the
    same view: a matmul wrote it there, `schedule.placement`) is not copied."""
    if out is None:
        return np.concatenate(xs, axis=axis)
    axis %= out.ndim
    start = 0
    for x in xs:
        part = out[(builtins.slice(None),) * axis + (builtins.slice(start, start + x.shape[axis]),)]
        start += x.shape[axis]
        if not (x.ctypes.data == part.ctypes.data and x.strides == part.strides and x.shape == part.shape):
            np.copyto(part, x)
    return out


# ----------------------------------------------------------------------------- frontend


def slice(x, dim: int, start: int, stop: int):  # noqa: A001 - hs.slice, as documented
    """Return `x[..., start:stop, ...]` along `dim` (0 <= start < stop <= size; no steps)."""
    x = as_tensor(x, "slice")
    d = norm_dim(x, dim, "slice")
    if not 0 <= start < stop <= x.shape[d]:
        raise fail("slice", f"[{start}:{stop}] is not a non-empty range of dim {d} (size {x.shape[d]})")
    if (start, stop) == (0, x.shape[d]):
        return x
    shape = list(x.shape)
    shape[d] = stop - start
    return x.tracer.emit(SliceOp(x.value, d, start, typed(x, shape)))


def split(x, sizes: Sequence[int], dim: int = 0):
    """Return consecutive pieces of `x` along `dim` with the given sizes (they sum to its size)."""
    x = as_tensor(x, "split")
    d = norm_dim(x, dim, "split")
    sizes = [int(s) for s in sizes]
    if not sizes or any(s < 1 for s in sizes) or sum(sizes) != x.shape[d]:
        raise fail("split", f"sizes {sizes} do not add up to dim {d} of {list(x.shape)}")
    types = []
    for s in sizes:
        shape = list(x.shape)
        shape[d] = s
        types.append(typed(x, shape))
    return x.tracer.emit_all(SplitOp(x.value, d, types))


def concat(xs: Sequence, dim: int = 0):
    """Return the tensors joined along `dim` (same shapes and dtypes elsewhere)."""
    xs = [as_tensor(x, "concat") for x in xs]
    if not xs:
        raise fail("concat", "needs at least one tensor")
    first = xs[0]
    d = norm_dim(first, dim, "concat")
    for x in xs[1:]:
        same = x.ndim == first.ndim and all(a == b for i, (a, b) in enumerate(zip(x.shape, first.shape)) if i != d)
        if not same or x.dtype != first.dtype:
            raise fail("concat", f"cannot join {[list(t.shape) for t in xs]} ({', '.join(t.dtype for t in xs)}) "
                                 f"along dim {d}")
    if len(xs) == 1:
        return first
    shape = list(first.shape)
    shape[d] = sum(x.shape[d] for x in xs)
    return first.tracer.emit(ConcatOp([x.value for x in xs], d, typed(first, shape)))


@irdl_op_definition
class StopGradientOp(UnaryOp):
    """The same values, with no gradient flowing back through them (PyTorch's `detach`)."""

    name = "graph.stop_gradient"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.detach.default",)
    STOPS_GRADIENT: ClassVar[bool] = True
    FRONTEND: ClassVar[tuple[str, ...]] = ("stop_gradient",)

    def verify_(self) -> None:
        if self.input.type != self.result.type:
            raise VerifyException(f"'{self.name}' keeps its operand's type")

    def sharding_rule(self) -> OpRule:
        d = factors("d", len(tensor_shape(self.input)))
        return OpRule((d,), (d,), frozenset({0}))

    def vjp(self, gs, emit):
        return [None]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        return lambda x: x

    def cuda_expr(self, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
        stmts.append(f"const {t} {out[0]} = {a[0]};")


def stop_gradient(x):
    """Return x's values with no gradient flowing back through them (`torch.detach`)."""
    x = as_tensor(x, "stop_gradient")
    return x.tracer.emit(StopGradientOp(x.value))
