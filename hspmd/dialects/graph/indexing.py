"""Indexing with tensors: take and take-along (gathers), their scatter-add transposes, top-k, cumsum.

`graph.take` is NumPy's `np.take(x, indices, axis=dim)` (PyTorch's `index_select` and the
one-index case of `x[..., idx, ...]`), `graph.take_along` NumPy's `np.take_along_axis` (PyTorch's
`gather`); each has its transpose, a scatter-add into zeros (`graph.take_grad`,
`graph.take_along_grad`), which is also how `index_add`, `scatter_add` and `index_put` with
accumulation are written. `graph.topk` gives the k largest values along the last dim with their
indices (ties: the lower index first), `graph.cumsum` running sums along a dim.

Indices are integer tensors (negative ones count from the end, as in PyTorch); an index out
of range reads NaN on a device (NumPy raises).
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
from xdsl.dialects.builtin import I64, IntegerAttr, TensorType, i64
from xdsl.ir import Attribute, SSAValue
from xdsl.irdl import irdl_op_definition, operand_def, prop_def, result_def, traits_def
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.cuda_c import KernelCode, c_type, contiguous_strides, flat_kernel
from hspmd.dialects.graph.base import (
    TensorOp,
    UnaryOp,
    check_dim,
    check_integer,
    check_same_element_type,
    int_attr,
    tensor_shape,
)
from hspmd.dialects.interfaces import Kernel, KernelContext
from hspmd.dialects.op_rule import OpRule, factors
from hspmd.dialects.traced import as_tensor, fail, norm_dim, typed

__all__ = [
    "TakeOp",
    "TakeGradOp",
    "TakeAlongOp",
    "TakeAlongGradOp",
    "TopkOp",
    "CumsumOp",
]


def _coords(index: str, shape, skip: int | None = None) -> list[str]:
    """Return C expressions of the coordinates (one per dim of `shape`) of the element whose
    row-major flat index is the C expression `index`."""
    strides = contiguous_strides(shape)
    return [f"(({index} / {s}L) % {n}L)" for n, s in zip(shape, strides)]


def _flat(coords: list[str], shape) -> str:
    """Return the C expression of the row-major flat index of `coords` in `shape`."""
    strides = contiguous_strides(shape)
    return " + ".join(f"({c}) * {s}L" for c, s in zip(coords, strides)) or "0"


def _wrap(k: str, n: int) -> str:
    """Return the C expression of index `k` along a dim of size n, negative ones from the end."""
    return f"({k} < 0 ? {k} + {n}L : {k})"


# ----------------------------------------------------------------------------- take


@irdl_op_definition
class TakeOp(TensorOp):
    """`np.take(x, indices, axis=dim)`: x [A..., n, B...], integer indices [I...] -> [A..., I..., B...]."""

    name = "graph.take"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.index.Tensor", "aten.index_select.default", "aten.flip.default",
                                       "aten.diagonal.default", "aten.unfold.default")
    x = operand_def(TensorType)
    indices = operand_def(TensorType)
    result = result_def(TensorType)
    dim = prop_def(IntegerAttr[I64])
    traits = traits_def(Pure())
    FRONTEND: ClassVar[tuple[str, ...]] = ("take",)

    def __init__(self, x: SSAValue, indices: SSAValue, dim: int, result_type: Attribute):
        super().__init__(operands=[x, indices], result_types=[result_type], properties={"dim": int_attr(dim)})

    def verify_(self) -> None:
        x, i, r = tensor_shape(self.x), tensor_shape(self.indices), tensor_shape(self.result)
        d = check_dim(self, self.dim, len(x))
        if r != (*x[:d], *i, *x[d + 1:]):
            raise VerifyException(f"'{self.name}' of {list(x)} along {d} at indices {list(i)} is "
                                  f"{[*x[:d], *i, *x[d + 1:]]}, got {list(r)}")
        check_integer(self, self.indices, "indices")
        check_same_element_type(self, self.x, self.result)

    def sharding_rule(self) -> OpRule:  # the indexed dim stays whole; the others pass through
        x, d = tensor_shape(self.x), self.dim.value.data
        a, i, b = factors("a", d), factors("i", len(tensor_shape(self.indices))), factors("b", len(x) - d - 1)
        return OpRule(((*a, "n", *b), i), ((*a, *i, *b),), frozenset({0}), blocked=frozenset({"n"}))

    def vjp(self, gs, emit):
        g = gs[0]
        return [lambda: emit(TakeGradOp(self.indices, g, self.dim.value.data, self.x.type)), None]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        d = self.dim.value.data
        return lambda x, idx: np.take(x, idx, axis=d)

    def cuda_kernel(self, name: str) -> KernelCode:
        x, i = tensor_shape(self.x), tensor_shape(self.indices)
        d, ni, post = self.dim.value.data, math.prod(i), math.prod(x[self.dim.value.data + 1:])
        body = (f"const long b = i % {post}L, j = (i / {post}L) % {max(ni, 1)}L, a = i / ({post}L * {max(ni, 1)}L);\n"
                f"    const long k = (long)in1[j], kk = {_wrap('k', x[d])};\n"
                f"    out0[i] = (kk >= 0 && kk < {x[d]}L) ? in0[(a * {x[d]}L + kk) * {post}L + b] : (T)HS_NAN;")
        return flat_kernel(name, self, c_type(self.result.type), body)


@irdl_op_definition
class TakeGradOp(TensorOp):
    """The transpose of `graph.take`: `dy` [A..., I..., B...] scatter-added at `indices` along
    `dim` into zeros of the result's shape [A..., n, B...] (in the order of the indices)."""

    name = "graph.take_grad"
    indices = operand_def(TensorType)
    dy = operand_def(TensorType)
    result = result_def(TensorType)
    dim = prop_def(IntegerAttr[I64])
    traits = traits_def(Pure())
    ATEN: ClassVar[tuple[str, ...]] = ("aten.index_add.default", "aten.index_put.default")
    FRONTEND: ClassVar[tuple[str, ...]] = ("take_grad",)

    def __init__(self, indices: SSAValue, dy: SSAValue, dim: int, result_type: Attribute):
        super().__init__(operands=[indices, dy], result_types=[result_type], properties={"dim": int_attr(dim)})

    def verify_(self) -> None:
        r, i, g = tensor_shape(self.result), tensor_shape(self.indices), tensor_shape(self.dy)
        d = check_dim(self, self.dim, len(r))
        if g != (*r[:d], *i, *r[d + 1:]):
            raise VerifyException(f"'{self.name}' needs dy {[*r[:d], *i, *r[d + 1:]]} for {list(r)} along {d} "
                                  f"at indices {list(i)}, got {list(g)}")
        check_integer(self, self.indices, "indices")
        check_same_element_type(self, self.dy, self.result)

    def sharding_rule(self) -> OpRule:  # split index dims leave partial sums
        r, d = tensor_shape(self.result), self.dim.value.data
        a, i, b = factors("a", d), factors("i", len(tensor_shape(self.indices))), factors("b", len(r) - d - 1)
        return OpRule((i, (*a, *i, *b)), ((*a, "n", *b),), frozenset({1}), blocked=frozenset({"n"}))

    def vjp(self, gs, emit):
        g = gs[0]
        return [None, lambda: emit(TakeOp(g, self.indices, self.dim.value.data, self.dy.type))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        d, shape = self.dim.value.data, tensor_shape(self.result)

        def scatter(idx: np.ndarray, dy: np.ndarray) -> np.ndarray:
            out = np.zeros(shape, dy.dtype)
            np.add.at(out, (slice(None),) * d + (idx,), dy)
            return out

        return scatter

    def cuda_kernel(self, name: str) -> KernelCode:
        """Per element of the result: the sum, in the order of the indices, of the rows of `dy`
        whose index is its row (no atomics: the bits of the NumPy kernel)."""
        r, i = tensor_shape(self.result), tensor_shape(self.indices)
        d, ni, post = self.dim.value.data, math.prod(i), math.prod(r[self.dim.value.data + 1:])
        body = (f"const long b = i % {post}L, k = (i / {post}L) % {r[d]}L, a = i / ({post}L * {r[d]}L);\n"
                f"    T acc = 0;\n"
                f"    for (long j = 0; j < {ni}L; ++j) {{\n"
                f"      const long q = (long)in0[j];\n"
                f"      if ({_wrap('q', r[d])} == k) acc += in1[(a * {ni}L + j) * {post}L + b];\n"
                f"    }}\n"
                f"    out0[i] = acc;")
        return flat_kernel(name, self, c_type(self.result.type), body)


# ----------------------------------------------------------------------------- take along a dim


def _along_coords(shape, d: int, index: str) -> tuple[list[str], str]:
    """Return the coordinates of flat index `index` in `shape` and the one along `d`."""
    coords = _coords(index, shape)
    return coords, coords[d]


@irdl_op_definition
class TakeAlongOp(TensorOp):
    """`np.take_along_axis(x, indices, axis=dim)` (PyTorch's `gather`): x and indices agree on
    every dim but `dim`; the result has the indices' shape."""

    name = "graph.take_along"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.gather.default",)
    x = operand_def(TensorType)
    indices = operand_def(TensorType)
    result = result_def(TensorType)
    dim = prop_def(IntegerAttr[I64])
    traits = traits_def(Pure())
    FRONTEND: ClassVar[tuple[str, ...]] = ("take_along",)

    def __init__(self, x: SSAValue, indices: SSAValue, dim: int, result_type: Attribute):
        super().__init__(operands=[x, indices], result_types=[result_type], properties={"dim": int_attr(dim)})

    def verify_(self) -> None:
        x, i, r = tensor_shape(self.x), tensor_shape(self.indices), tensor_shape(self.result)
        d = check_dim(self, self.dim, len(x))
        if len(i) != len(x) or any(a != b for k, (a, b) in enumerate(zip(x, i)) if k != d) or r != i:
            raise VerifyException(f"'{self.name}' needs x and indices equal but along dim {d}, giving the "
                                  f"indices' shape: got {list(x)}, {list(i)} -> {list(r)}")
        check_integer(self, self.indices, "indices")
        check_same_element_type(self, self.x, self.result)

    def sharding_rule(self) -> OpRule:
        x, d = tensor_shape(self.x), self.dim.value.data
        f = factors("d", len(x))
        xs = tuple("n" if k == d else v for k, v in enumerate(f))
        return OpRule((xs, f), (f,), frozenset({0}), blocked=frozenset({"n"}))

    def vjp(self, gs, emit):
        g = gs[0]
        return [lambda: emit(TakeAlongGradOp(self.indices, g, self.dim.value.data, self.x.type)), None]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        d = self.dim.value.data
        return lambda x, idx: np.take_along_axis(x, np.where(idx < 0, idx + x.shape[d], idx), axis=d)

    def cuda_kernel(self, name: str) -> KernelCode:
        x, i = tensor_shape(self.x), tensor_shape(self.indices)
        d = self.dim.value.data
        coords = _coords("i", i)
        coords[d] = "kk"
        body = (f"const long k = (long)in1[i], kk = {_wrap('k', x[d])};\n"
                f"    out0[i] = (kk >= 0 && kk < {x[d]}L) ? in0[{_flat(coords, x)}] : (T)HS_NAN;")
        return flat_kernel(name, self, c_type(self.result.type), body)


@irdl_op_definition
class TakeAlongGradOp(TensorOp):
    """The transpose of `graph.take_along` (PyTorch's `scatter_add` into zeros): `dy` (the
    indices' shape) added at `indices` along `dim` into zeros of the result's shape."""

    name = "graph.take_along_grad"
    indices = operand_def(TensorType)
    dy = operand_def(TensorType)
    result = result_def(TensorType)
    dim = prop_def(IntegerAttr[I64])
    traits = traits_def(Pure())
    ATEN: ClassVar[tuple[str, ...]] = ("aten.scatter_add.default", "aten.scatter.src", "aten.scatter.value",
                                       "aten.scatter_reduce.two")
    FRONTEND: ClassVar[tuple[str, ...]] = ("take_along_grad",)

    def __init__(self, indices: SSAValue, dy: SSAValue, dim: int, result_type: Attribute):
        super().__init__(operands=[indices, dy], result_types=[result_type], properties={"dim": int_attr(dim)})

    def verify_(self) -> None:
        r, i, g = tensor_shape(self.result), tensor_shape(self.indices), tensor_shape(self.dy)
        d = check_dim(self, self.dim, len(r))
        if len(i) != len(r) or g != i or any(a != b for k, (a, b) in enumerate(zip(r, i)) if k != d):
            raise VerifyException(f"'{self.name}' needs indices and dy of one shape, equal to the result's but "
                                  f"along dim {d}: got {list(i)}, {list(g)} -> {list(r)}")
        check_integer(self, self.indices, "indices")
        check_same_element_type(self, self.dy, self.result)

    def sharding_rule(self) -> OpRule:
        r, d = tensor_shape(self.result), self.dim.value.data
        f = factors("d", len(r))
        rs = tuple("n" if k == d else v for k, v in enumerate(f))
        return OpRule((f, f), (rs,), frozenset({1}), blocked=frozenset({"n"}))

    def vjp(self, gs, emit):
        g = gs[0]
        return [None, lambda: emit(TakeAlongOp(g, self.indices, self.dim.value.data, self.dy.type))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        d, shape = self.dim.value.data, tensor_shape(self.result)

        def scatter(idx: np.ndarray, dy: np.ndarray) -> np.ndarray:
            out = np.zeros(shape, dy.dtype)
            where = list(np.indices(idx.shape, sparse=True))
            where[d] = np.where(idx < 0, idx + shape[d], idx)
            np.add.at(out, tuple(where), dy)
            return out

        return scatter

    def cuda_kernel(self, name: str) -> KernelCode:
        r, i = tensor_shape(self.result), tensor_shape(self.indices)
        d = self.dim.value.data
        coords = _coords("i", r)
        at = list(coords)
        at[d] = "j"
        body = (f"const long k = {coords[d]};\n"
                f"    T acc = 0;\n"
                f"    for (long j = 0; j < {i[d]}L; ++j) {{\n"
                f"      const long q = (long)in0[{_flat(at, i)}];\n"
                f"      if ({_wrap('q', r[d])} == k) acc += in1[{_flat(at, i)}];\n"
                f"    }}\n"
                f"    out0[i] = acc;")
        return flat_kernel(name, self, c_type(self.result.type), body)


# ----------------------------------------------------------------------------- top-k


def topk_values(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Return the k largest values along the last dim, largest first (ties: the lower index), and
    their indices (int64)."""
    order = np.argsort(-x, axis=-1, kind="stable")[..., :k] if x.dtype.kind != "u" else \
        np.argsort(x, axis=-1, kind="stable")[..., ::-1][..., :k]
    return np.take_along_axis(x, order, axis=-1), order.astype(np.int64)


@irdl_op_definition
class TopkOp(TensorOp):
    """The k largest values along the last dim and their indices: x [..., n] -> values [..., k],
    indices [..., k] (int64), largest first, ties the lower index first (a stable sort: k = n
    sorts). The values' gradient goes back to the places they came from; the indices have none."""

    name = "graph.topk"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.topk.default", "aten.sort.default", "aten.max.dim", "aten.min.dim",
                                       "aten.argmax.default", "aten.argmin.default")
    input = operand_def(TensorType)
    values = result_def(TensorType)
    indices = result_def(TensorType)
    traits = traits_def(Pure())
    FRONTEND: ClassVar[tuple[str, ...]] = ("topk",)

    def __init__(self, input: SSAValue, k: int):
        shape = (*tensor_shape(input)[:-1], k)
        super().__init__(operands=[input], result_types=[TensorType(input.type.element_type, shape),
                                                         TensorType(i64, shape)])

    def verify_(self) -> None:
        x, v, i = tensor_shape(self.input), tensor_shape(self.values), tensor_shape(self.indices)
        if not x or v != i or v[:-1] != x[:-1] or not 1 <= v[-1] <= x[-1]:
            raise VerifyException(f"'{self.name}' of {list(x)} needs values and indices [..., k] with k in "
                                  f"1..{x[-1] if x else 0}, got {list(v)}, {list(i)}")
        check_same_element_type(self, self.input, self.values)
        check_integer(self, self.indices, "indices")

    def sharding_rule(self) -> OpRule:
        b = factors("b", len(tensor_shape(self.input)) - 1)
        return OpRule(((*b, "n"),), ((*b, "k"), (*b, "k")), blocked=frozenset({"n", "k"}))

    def vjp(self, gs, emit):
        g = gs[0]
        if g is None:
            return [None]
        last = len(tensor_shape(self.input)) - 1
        return [lambda: emit(TakeAlongGradOp(self.indices, g, last, self.input.type))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        k = tensor_shape(self.values)[-1]
        return lambda x: topk_values(x, k)

    def cuda_kernel(self, name: str) -> KernelCode:
        """A thread per input element: its rank in its row (how many are larger, or equal and
        before it); ranks below k write their value and index there."""
        x = tensor_shape(self.input)
        n, k = x[-1], tensor_shape(self.values)[-1]
        body = (f"const long row = i / {n}L, j = i % {n}L;\n"
                f"    const T v = (T)in0[i];\n"
                f"    long r = 0;\n"
                f"    for (long l = 0; l < {n}L; ++l) {{\n"
                f"      const T w = (T)in0[row * {n}L + l];\n"
                f"      r += (w > v || (w == v && l < j)) ? 1 : 0;\n"
                f"    }}\n"
                f"    if (r < {k}L) {{ out0[row * {k}L + r] = in0[i]; out1[row * {k}L + r] = (int64_t)j; }}")
        return flat_kernel(name, self, c_type(self.input.type), body, n=math.prod(x))


# ----------------------------------------------------------------------------- cumulative sums


@irdl_op_definition
class CumsumOp(UnaryOp):
    """Running sums along `dim`: `out[..., j, ...] = sum_{l <= j} x[..., l, ...]` (with `reverse`,
    over `l >= j`: the transpose, which is the gradient)."""

    name = "graph.cumsum"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.cumsum.default",)
    dim = prop_def(IntegerAttr[I64])
    reverse = prop_def(IntegerAttr[I64])
    FRONTEND: ClassVar[tuple[str, ...]] = ("cumsum",)

    def __init__(self, input: SSAValue, dim: int, reverse: bool = False, result_type: Attribute | None = None):
        super().__init__(input, result_type, dim=int_attr(dim), reverse=int_attr(int(reverse)))

    def verify_(self) -> None:
        check_dim(self, self.dim, len(tensor_shape(self.input)))
        if tensor_shape(self.input) != tensor_shape(self.result):
            raise VerifyException(f"'{self.name}' keeps the shape {list(tensor_shape(self.input))}")

    def sharding_rule(self) -> OpRule:
        f = factors("d", len(tensor_shape(self.input)))
        return OpRule((f,), (f,), frozenset({0}), blocked=frozenset({f[self.dim.value.data]}))

    def vjp(self, gs, emit):
        g = gs[0]
        return [lambda: emit(CumsumOp(g, self.dim.value.data, not self.reverse.value.data, self.input.type))]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        d, rev, dtype = self.dim.value.data, bool(self.reverse.value.data), np.dtype(_dtype(self.result.type))
        if rev:
            return lambda x: np.flip(np.cumsum(np.flip(x, d), axis=d, dtype=dtype), d)
        return lambda x: np.cumsum(x, axis=d, dtype=dtype)

    def cuda_kernel(self, name: str) -> KernelCode:
        shape, d = tensor_shape(self.input), self.dim.value.data
        n, post = shape[d], math.prod(shape[d + 1:])
        lo, hi = ("j", f"{n}L") if self.reverse.value.data else ("0", "j + 1")
        body = (f"const long j = (i / {post}L) % {n}L, base = i - j * {post}L;\n"
                f"    T acc = 0;\n"
                f"    for (long l = {lo}; l < {hi}; ++l) acc += (T)in0[base + l * {post}L];\n"
                f"    out0[i] = acc;")
        return flat_kernel(name, self, c_type(self.result.type), body)


def _dtype(typ) -> str:
    from hspmd.ir.types import dtype_name

    return dtype_name(typ)


# ----------------------------------------------------------------------------- frontend


def _indices(x, indices, op: str):
    x, indices = as_tensor(x, op), as_tensor(indices, op)
    if not indices.dtype.startswith("int"):
        raise fail(op, f"indices must be integers, got {indices.dtype}")
    return x, indices


def take(x, indices, dim: int = 0):
    """Return `np.take(x, indices, axis=dim)`: the slices of x along `dim` at integer `indices`
    (of any shape, negative ones from the end) -> x.shape[:dim] + indices.shape + x.shape[dim+1:]."""
    x, indices = _indices(x, indices, "take")
    d = norm_dim(x, dim, "take")
    return x.tracer.emit(TakeOp(x.value, indices.value, d, typed(x, (*x.shape[:d], *indices.shape, *x.shape[d + 1:]))))


def take_grad(indices, dy, size: int, dim: int = 0):
    """Return the transpose of `take` along `dim` (of size `size`): `dy` scatter-added at `indices`
    into zeros (PyTorch's `index_add` into zeros)."""
    dy, indices = _indices(dy, indices, "take_grad")
    d = norm_dim(dy, dim, "take_grad")
    shape = (*dy.shape[:d], size, *dy.shape[d + indices.ndim:])
    if tuple(dy.shape) != (*shape[:d], *indices.shape, *shape[d + 1:]):
        raise fail("take_grad", f"dy {list(dy.shape)} does not hold indices {list(indices.shape)} at dim {d}")
    return dy.tracer.emit(TakeGradOp(indices.value, dy.value, d, typed(dy, shape)))


def take_along(x, indices, dim: int):
    """Return `np.take_along_axis(x, indices, axis=dim)` (PyTorch's `gather`)."""
    x, indices = _indices(x, indices, "take_along")
    d = norm_dim(x, dim, "take_along")
    if indices.ndim != x.ndim or any(a != b for k, (a, b) in enumerate(zip(x.shape, indices.shape)) if k != d):
        raise fail("take_along", f"x {list(x.shape)} and indices {list(indices.shape)} must agree but along dim {d}")
    return x.tracer.emit(TakeAlongOp(x.value, indices.value, d, typed(x, indices.shape)))


def take_along_grad(indices, dy, size: int, dim: int):
    """Return the transpose of `take_along`: `dy` added at `indices` along `dim` into zeros whose
    size there is `size` (PyTorch's `scatter_add` into zeros)."""
    dy, indices = _indices(dy, indices, "take_along_grad")
    d = norm_dim(dy, dim, "take_along_grad")
    if indices.shape != dy.shape:
        raise fail("take_along_grad", f"indices {list(indices.shape)} and dy {list(dy.shape)} differ")
    shape = tuple(size if k == d else s for k, s in enumerate(dy.shape))
    return dy.tracer.emit(TakeAlongGradOp(indices.value, dy.value, d, typed(dy, shape)))


def topk(x, k: int):
    """Return (values, indices) of the k largest entries along the last dim (largest first, ties:
    the lower index first; indices int64)."""
    x = as_tensor(x, "topk")
    if not x.ndim or isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= x.shape[-1]:
        raise fail("topk", f"k={k!r} must be in 1..{x.shape[-1] if x.ndim else 0} (the last dim of {list(x.shape)})")
    values, indices = x.tracer.emit_all(TopkOp(x.value, k))
    return values, indices


def cumsum(x, dim: int):
    """Return the running sums of x along `dim`."""
    x = as_tensor(x, "cumsum")
    return x.tracer.emit(CumsumOp(x.value, norm_dim(x, dim, "cumsum")))
