"""ATen's indexing ops as hspmd ops: indexing with tensors, gather and scatter, top-k and sorting,
cumulative sums, strided slices, pads, repeats and flips.

`x[i]`, `x[:, i]`, `x[i, j]` (`aten.index.Tensor`) become one `graph.take` of x with its indexed
dims merged into one and the index tensors merged into one index of that dim (`i * n1 + j`);
`gather` is `graph.take_along`; the writes (`index_put`, `scatter`, `index_add`, `scatter_add`)
are scatter-adds into zeros (`graph.take_grad`, `graph.take_along_grad`), added to the base where
they accumulate and selected over it where they overwrite. A boolean index computed from the
batch (`x[mask]`) has a data-dependent shape and is refused, except where it writes one value
(`x[mask] = v`, a `masked_fill`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hspmd.dialects import graph
from hspmd.dialects.graph import elementary as el
from hspmd.dialects.graph.indexing import cumsum as hs_cumsum, take, take_along, take_along_grad, take_grad, topk
from hspmd.dialects.graph.shape import concat, slice as take_slice
from hspmd.frontend.aten import Context, Unsupported
from hspmd.frontend.aten_math import cast_to, compare_to, is_float, operand
from hspmd.frontend.tracing import Tensor


def _int_tensor(cx: Context, idx) -> Tensor:
    """Return an index (a traced integer tensor, or a concrete one lifted) as an int64 tensor."""
    if isinstance(idx, Tensor):
        if is_float(idx.dtype):
            raise Unsupported("indexing with a boolean mask computed from the batch (its result's shape "
                              "depends on the data)")
        return idx
    return cx.lift(idx, "int64")


def _concrete_index(idx):
    """Return a concrete index as int64 (a boolean mask as the indices it holds)."""
    import torch

    if idx.dtype == torch.bool:
        return None
    return idx.to(torch.int64)


def _int_const(cx: Context, value: int, shape) -> Tensor:
    return cx.tracer.constant(float(value), tuple(shape), "int64")


def _wrapped(cx: Context, idx: Tensor, n: int) -> Tensor:
    """Return `idx` with negative indices counted from the end (idx + n where idx < 0)."""
    negative = cast_to(compare_to(cx, idx, 0, "lt"), "int64")
    return idx.broadcast_binary(negative.broadcast_binary(_int_const(cx, n, ()), graph.MulOp, "mul"), graph.AddOp, "add")


def _merged_index(cx: Context, x: Tensor, dims: list[int], indices: list) -> tuple[Tensor, Tensor]:
    """Return x with `dims` (adjacent, in order) merged into one dim and the index of that dim
    (`i0 * n1 * n2 + i1 * n2 + i2`, the indices broadcast together)."""
    import torch

    shape = tuple(np.broadcast_shapes(*(tuple(i.shape) for i in indices)))
    sizes = [x.shape[d] for d in dims]
    if len(dims) == 1:
        flat = indices[0]
        flat = _int_tensor(cx, flat).broadcast_to(shape) if isinstance(flat, Tensor) else cx.lift(flat.expand(shape), "int64")
        return x, flat
    if all(not isinstance(i, Tensor) for i in indices):  # concrete: merge with PyTorch
        total = torch.zeros(shape, dtype=torch.int64)
        for i, n in zip(indices, sizes):
            total = total * n + torch.where(i < 0, i + n, i).expand(shape)
        flat = cx.lift(total, "int64")
    else:
        flat = None
        for i, n in zip(indices, sizes):
            term = _wrapped(cx, _int_tensor(cx, i).broadcast_to(shape), n)
            flat = term if flat is None else \
                flat.broadcast_binary(_int_const(cx, n, ()), graph.MulOp, "mul").broadcast_binary(term, graph.AddOp, "add")
    merged = x.reshape((*x.shape[:dims[0]], int(np.prod(sizes)), *x.shape[dims[-1] + 1:]))
    return merged, flat


def _prepare(cx: Context, x, indices: list) -> tuple[Tensor, int, Tensor, list]:
    """Return (x moved and merged, the merged dim, its index, concrete index tensors) for an
    index list of `x[...]` (None: a whole dim)."""
    x = x if isinstance(x, Tensor) else cx.lift(x, None)
    indices = list(indices) + [None] * (x.ndim - len(indices))
    given = []
    for i in indices:
        if i is None or isinstance(i, Tensor):
            given.append(i)
        else:
            c = _concrete_index(i)
            if c is None:
                raise Unsupported("indexing with a boolean mask (its result's shape depends on its values)")
            given.append(c)
    dims = [d for d, i in enumerate(given) if i is not None]
    if dims != list(range(dims[0], dims[-1] + 1)):  # apart: PyTorch puts the index dims first
        order = dims + [d for d in range(x.ndim) if d not in dims]
        x = x.transpose(order)
        given = [given[d] for d in order]
        dims = list(range(len(dims)))
    merged, flat = _merged_index(cx, x, dims, [given[d] for d in dims])
    return merged, dims[0], flat, given


def index(cx: Context, x, indices):
    """`x[indices]` with index tensors (None for a whole dim)."""
    merged, dim, flat, _ = _prepare(cx, x, indices)
    return take(merged, flat, dim).reshape(cx.shape)


def index_select(cx: Context, x, dim, idx):
    x = x if isinstance(x, Tensor) else cx.lift(x, None)
    return take(x, _int_tensor(cx, idx), dim % x.ndim)


def index_put(cx: Context, x, indices, values, accumulate=False):
    """`x[indices] = values` (or `+=` with `accumulate`): a scatter-add into zeros, added to x or
    selected over it. A boolean mask from the batch with one value is a `masked_fill`."""
    x = x if isinstance(x, Tensor) else cx.lift(x, cx.dtype)
    if len(indices) == 1 and isinstance(indices[0], Tensor) and is_float(indices[0].dtype):
        mask = indices[0]
        size = int(np.prod(values.shape)) if hasattr(values, "shape") else 1
        if size != 1 or accumulate:
            raise Unsupported("x[mask] = values with a mask computed from the batch (more than one value)")
        mask = mask.reshape((*mask.shape, *([1] * (x.ndim - mask.ndim)))).broadcast_to(x.shape)
        return el.where(mask, operand(cx, values.reshape(()) if isinstance(values, Tensor) else values,
                                      x.dtype, x.shape), x)
    merged, dim, flat, _ = _prepare(cx, x, indices)
    if merged.shape != x.shape and merged.ndim != x.ndim - len([i for i in indices if i is not None]) + 1:
        raise Unsupported("index_put with index tensors that are not adjacent")
    target = (*merged.shape[:dim], *flat.shape, *merged.shape[dim + 1:])
    vals = operand(cx, values, x.dtype, target)
    added = take_grad(flat, vals, merged.shape[dim], dim).reshape(x.shape)
    if accumulate:
        return x + added
    hits = take_grad(flat, cx.tracer.constant(1.0, target, x.dtype), merged.shape[dim], dim).reshape(x.shape)
    return el.where(hits, added, x)


def index_add(cx: Context, x, dim, idx, src, alpha=1):
    x = x if isinstance(x, Tensor) else cx.lift(x, cx.dtype)
    src = operand(cx, src, x.dtype, getattr(src, "shape", ()))
    if alpha != 1:
        src = src * float(alpha)
    d = dim % x.ndim
    return x + take_grad(_int_tensor(cx, idx), src, x.shape[d], d)


def _sliced_to(x: Tensor, shape, skip: int) -> Tensor:
    """Return x cut to `shape` in every dim but `skip` (gather and scatter read only that much)."""
    for d, n in enumerate(shape):
        if d != skip and x.shape[d] != n:
            x = take_slice(x, d, 0, n)
    return x


def gather(cx: Context, x, dim, idx, sparse_grad=False):
    x = x if isinstance(x, Tensor) else cx.lift(x, None)
    idx = _int_tensor(cx, idx)
    d = dim % x.ndim
    return take_along(_sliced_to(x, idx.shape, d), idx, d)


def _scattered(cx: Context, base, dim, idx, src) -> tuple[Tensor, Tensor, Tensor, int]:
    base = base if isinstance(base, Tensor) else cx.lift(base, cx.dtype)
    idx = _int_tensor(cx, idx)
    d = dim % base.ndim
    src = operand(cx, src, base.dtype, getattr(src, "shape", ()) or idx.shape)
    src = _sliced_to(src.broadcast_to(idx.shape) if src.ndim == 0 else src, idx.shape, -1)
    added = take_along_grad(idx, src, base.shape[d], d)
    hits = take_along_grad(idx, cx.tracer.constant(1.0, idx.shape, base.dtype), base.shape[d], d)
    full = [n if k == d else base.shape[k] for k, n in enumerate(added.shape)]
    if tuple(full) != added.shape:  # an index smaller than the base in other dims: pad with zeros
        added, hits = _padded(cx, added, base.shape), _padded(cx, hits, base.shape)
    return base, added, hits, d


def _padded(cx: Context, x: Tensor, shape) -> Tensor:
    for d, n in enumerate(shape):
        if x.shape[d] < n:
            rest = list(x.shape)
            rest[d] = n - x.shape[d]
            x = concat([x, cx.tracer.constant(0.0, tuple(rest), x.dtype)], d)
    return x


def scatter(cx: Context, base, dim, idx, src, reduce=None):
    """`base.scatter(dim, idx, src)`: src's values where an index points, base elsewhere."""
    if reduce is not None:
        raise Unsupported(f"scatter with reduce={reduce!r}")
    base, added, hits, _ = _scattered(cx, base, dim, idx, src)
    if not isinstance(src, Tensor) and getattr(src, "ndim", 1) == 0 or isinstance(src, (int, float)):
        value = operand(cx, float(src), base.dtype, base.shape)  # one value: duplicates do not matter
        return el.where(hits, value, base)
    return el.where(hits, added, base)


def scatter_add(cx: Context, base, dim, idx, src):
    base, added, _, _ = _scattered(cx, base, dim, idx, src)
    return base + added


def scatter_reduce(cx: Context, base, dim, idx, src, reduce, include_self=True):
    """`scatter_reduce` with "sum" or "mean" (the maxima and products are refused)."""
    if reduce not in ("sum", "mean"):
        raise Unsupported(f"scatter_reduce with reduce={reduce!r} (hspmd scatters sums)")
    base, added, hits, _ = _scattered(cx, base, dim, idx, src)
    kept = base if include_self else el.where(hits, cx.tracer.constant(0.0, base.shape, base.dtype), base)
    total = kept + added
    if reduce == "sum":
        return total
    count = hits + (1.0 if include_self else 0.0)
    return el.where(hits, total / el.maximum(count, cx.tracer.constant(1.0, count.shape, count.dtype)), base)


# ----------------------------------------------------------------------------- top-k, sorting, arg-extremes


def _last(x: Tensor, dim: int) -> tuple[Tensor, list[int] | None]:
    d = dim % x.ndim
    if d == x.ndim - 1:
        return x, None
    perm = [k for k in range(x.ndim) if k != d] + [d]
    return x.transpose(perm), [perm.index(k) for k in range(x.ndim)]


def _top(x: Tensor, k: int, dim: int, largest: bool) -> tuple[Tensor, Tensor]:
    moved, back = _last(x, dim)
    values, indices = topk(moved if largest else moved * -1.0, k)
    if not largest:
        values = values * -1.0
    if back is not None:
        values, indices = values.transpose(back), indices.transpose(back)
    return values, indices


def topk_(cx: Context, x, k, dim=-1, largest=True, sorted=True):
    x = x if is_float(x.dtype) else cast_to(x, "float32")
    return _top(x, int(k), dim, bool(largest))


def sort(cx: Context, x, dim=-1, descending=False, stable=False):
    x = x if is_float(x.dtype) else cast_to(x, "float32")
    return _top(x, x.shape[dim], dim, bool(descending))


def _extreme(largest: bool) -> Callable:
    def translate(cx: Context, x, dim, keepdim=False):
        values, indices = _top(x, 1, dim, largest)
        shape = cx.meta[0].shape if isinstance(cx.meta, (tuple, list)) else None
        shape = tuple(int(s) for s in shape) if shape is not None else values.shape
        return values.reshape(shape), indices.reshape(shape)
    return translate


def _arg(largest: bool) -> Callable:
    def translate(cx: Context, x, dim=None, keepdim=False):
        x = x if is_float(x.dtype) else cast_to(x, "float32")
        if dim is None:
            x, dim = x.reshape((-1,)), 0
        return _top(x, 1, dim, largest)[1].reshape(cx.shape)
    return translate


def cumsum(cx: Context, x, dim, dtype=None):
    work = cx.dtype if is_float(cx.dtype) else "float64"
    return hs_cumsum(cast_to(x, work), dim)


# ----------------------------------------------------------------------------- slices, pads, repeats, flips


def strided_slice(cx: Context, x: Tensor, dim: int, begin: int, stop: int, step: int) -> Tensor:
    """`x[begin:stop:step]` along `dim`: a reshape and a slice where the stride divides what is
    left, else a take of the positions."""
    count = len(range(begin, stop, step))
    if count == 0:
        raise Unsupported("an empty slice")
    n = x.shape[dim]
    end = begin + count * step
    if end <= n:
        piece = take_slice(x, dim, begin, end) if (begin, end) != (0, n) else x
        split = piece.reshape((*x.shape[:dim], count, step, *x.shape[dim + 1:]))
        return take_slice(split, dim + 1, 0, 1).reshape((*x.shape[:dim], count, *x.shape[dim + 1:]))
    positions = np.arange(begin, stop, step, dtype=np.int64)
    return take(x, cx.tracer.literal(positions), dim)


def slice_scatter(cx: Context, base, src, dim=0, start=None, end=None, step=1):
    """`base` with `src` written into `base[start:end:step]` along `dim`."""
    base = base if isinstance(base, Tensor) else cx.lift(base, cx.dtype)
    d = dim % base.ndim
    begin, stop, stride = slice(start, end, step).indices(base.shape[d])
    src = operand(cx, src, base.dtype, (*base.shape[:d], len(range(begin, stop, stride)), *base.shape[d + 1:]))
    if stride == 1:
        parts = [take_slice(base, d, 0, begin)] if begin else []
        parts.append(src)
        if stop < base.shape[d]:
            parts.append(take_slice(base, d, stop, base.shape[d]))
        return concat(parts, d) if len(parts) > 1 else src
    positions = cx.tracer.literal(np.arange(begin, stop, stride, dtype=np.int64))
    hits = take_grad(positions, cx.tracer.constant(1.0, src.shape, base.dtype), base.shape[d], d)
    return el.where(hits, take_grad(positions, src, base.shape[d], d), base)


def select_scatter(cx: Context, base, src, dim, index):
    base = base if isinstance(base, Tensor) else cx.lift(base, cx.dtype)
    d = dim % base.ndim
    i = index % base.shape[d]
    shape = (*base.shape[:d], 1, *base.shape[d + 1:])
    src = operand(cx, src, base.dtype, tuple(s for k, s in enumerate(shape) if k != d)).reshape(shape)
    return slice_scatter(cx, base, src, d, i, i + 1, 1)


def constant_pad_nd(cx: Context, x, pad, value=0.0):
    """Pads (last dim first: `(left, right, ...)`) of `value`; negative ones cut."""
    for k in range(len(pad) // 2):
        d = x.ndim - 1 - k
        left, right = pad[2 * k], pad[2 * k + 1]
        if left < 0:
            x = take_slice(x, d, -left, x.shape[d])
        if right < 0:
            x = take_slice(x, d, 0, x.shape[d] + right)
        parts = []
        for size, at_end in ((left, False), (right, True)):
            if size > 0:
                shape = list(x.shape)
                shape[d] = size
                parts.append((at_end, cx.tracer.constant(float(value), tuple(shape), x.dtype)))
        if parts:
            x = concat([p for e, p in parts if not e] + [x] + [p for e, p in parts if e], d)
    return x


def repeat(cx: Context, x, repeats):
    """`x.repeat(*repeats)`: each dim tiled (`repeats` may add leading dims)."""
    x = x.reshape((*([1] * (len(repeats) - x.ndim)), *x.shape))
    tiled = x.reshape(tuple(v for s in x.shape for v in (1, s)))
    shape = tuple(v for r, s in zip(repeats, x.shape) for v in (r, s))
    return tiled.broadcast_to(shape).reshape(tuple(r * s for r, s in zip(repeats, x.shape)))


def flip(cx: Context, x, dims):
    for d in dims:
        d = d % x.ndim
        x = take(x, cx.tracer.literal(np.arange(x.shape[d] - 1, -1, -1, dtype=np.int64)), d)
    return x


def diagonal(cx: Context, x, offset=0, dim1=0, dim2=1):
    """The diagonal of dims `dim1`, `dim2` (shifted by `offset`), as a new last dim."""
    d1, d2 = dim1 % x.ndim, dim2 % x.ndim
    n1, n2 = x.shape[d1], x.shape[d2]
    rows = np.arange(max(0, -offset), min(n1, n2 - offset), dtype=np.int64)
    perm = [k for k in range(x.ndim) if k not in (d1, d2)] + [d1, d2]
    flat = x.transpose(perm).reshape((*[x.shape[k] for k in perm[:-2]], n1 * n2))
    return take(flat, cx.tracer.literal(rows * n2 + rows + offset), flat.ndim - 1)


def unfold(cx: Context, x, dim, size, step):
    """`Tensor.unfold`: the windows of `size` along `dim`, `step` apart, in a new last dim (a short
    causal convolution's windows: Inkling-2's), one take of their positions."""
    if x.ndim == 0:
        return x.reshape((1,))
    d = dim % x.ndim
    count = (x.shape[d] - size) // step + 1
    positions = (np.arange(count)[:, None] * step + np.arange(size)[None, :]).reshape(-1).astype(np.int64)
    windows = take(x, cx.tracer.literal(positions), d)
    shape = (*x.shape[:d], count, size, *x.shape[d + 1:])
    perm = [k for k in range(len(shape)) if k != d + 1] + [d + 1]
    return windows.reshape(shape).transpose(perm)


def slice_any_step(cx: Context, x, dim=0, start=None, end=None, step=1):
    """`aten.slice.Tensor` of any step."""
    from hspmd.frontend import aten

    d = dim % x.ndim
    begin, stop, stride = slice(start, end, step).indices(x.shape[d])
    if len(range(begin, stop, stride)) == 0:  # an empty piece (Phi-3's rotary pass-through of none):
        import torch  # a concrete empty tensor, which `cat` drops and PyTorch evaluates at import

        shape = list(x.shape)
        shape[d] = 0
        return torch.empty(shape, dtype=getattr(torch, x.dtype))
    if stride == 1:
        return aten.slice_step1(cx, x, d, begin, stop)
    return strided_slice(cx, x, d, begin, stop, stride)


#: ATen op name -> translator
TRANSLATORS: dict[str, Callable] = {
    "aten.index.Tensor": index, "aten.index_select.default": index_select, "aten.index_put.default": index_put,
    "aten.index_add.default": index_add, "aten.gather.default": gather, "aten.scatter.src": scatter,
    "aten.scatter.value": scatter, "aten.scatter_add.default": scatter_add, "aten.scatter_reduce.two": scatter_reduce,
    "aten.topk.default": topk_, "aten.sort.default": sort, "aten.max.dim": _extreme(True),
    "aten.min.dim": _extreme(False), "aten.argmax.default": _arg(True), "aten.argmin.default": _arg(False),
    "aten.cumsum.default": cumsum, "aten.slice.Tensor": slice_any_step, "aten.slice_scatter.default": slice_scatter,
    "aten.select_scatter.default": select_scatter, "aten.constant_pad_nd.default": constant_pad_nd,
    "aten.repeat.default": repeat, "aten.flip.default": flip, "aten.diagonal.default": diagonal,
    "aten.unfold.default": unfold,
}

