"""NumPy reference implementations of the `graph` ops, on local pieces.

Each maker takes the op (read once, when the plan is built) and returns a function of the
operand arrays, so that no xDSL object is touched while steps run. Multi-result ops return a
tuple. Kernels compute in the operands' dtype unless a comment says otherwise.

Kernels marked with `@takes_out` also accept `out=` (an array of the result's shape and
dtype, or a tuple of them for several results): they fill it and return it. The plan hands
them buffers it reuses from step to step; NumPy ufuncs (np.add, np.exp, ...) take `out=`
natively. Which ops get buffers is decided with the schedule from
`hspmd.codegen.schedule.kernel_facts`, which must say what these markers say. View ops
(transpose, broadcast, split, slice, reshape) return views of their operand, not copies: the
schedule tracks the aliasing.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from xdsl.ir import Operation

from hspmd.dialects import graph
from hspmd.dialects.interfaces import KernelContext
from hspmd.ir.types import dtype_name
from hspmd.runtime import native as _native

Kernel = Callable[..., np.ndarray]


def takes_out(fn: Kernel) -> Kernel:
    """Mark kernel `fn` as accepting `out=` (see the module docstring); return it."""
    fn.accepts_out = True  # type: ignore[attr-defined]
    return fn


def by_rows(fn: Kernel) -> Kernel:
    """Mark `out=` kernel `fn` as parallel along dim 0: rows of its result along dim 0 depend
    only on the same rows of its operands with that leading extent (the plan may run blocks
    of rows on threads)."""
    fn.accepts_out = True  # type: ignore[attr-defined]
    fn.row_parallel = True  # type: ignore[attr-defined]
    return fn


def overwrites_first(fn: Kernel) -> Kernel:
    """Mark `out=` kernel `fn` as correct when `out` is its first operand (it reads each element
    of the first operand before writing that element of `out`); return it."""
    fn.inplace_safe = True  # type: ignore[attr-defined]
    return fn


def rowwise(fn: Kernel) -> Kernel:
    """Mark `out=` kernel `fn` as row-wise over all leading dims: each row (last dim) of its
    results depends only on the same row of its operands of the result's leading dims, and on
    operands of rank <= 1 (elementwise kernels, softmax or a norm over the last dim). The plan
    may run it by small blocks of rows (cache-sized) and on threads; the bits are the same."""
    by_rows(fn)
    fn.rowwise = True  # type: ignore[attr-defined]
    return fn


def _result_shape(op: Operation) -> tuple[int, ...]:
    return op.results[0].type.get_shape()  # type: ignore[attr-defined]


def _result_dtype(op: Operation) -> np.dtype:
    return np.dtype(dtype_name(op.results[0].type))


# ----------------------------------------------------------------------------- losses


def _valid(labels: np.ndarray, ignore_index: int | None) -> np.ndarray | None:
    return None if ignore_index is None else labels != ignore_index


def softmax_cross_entropy(logits: np.ndarray, labels: np.ndarray, ignore_index: int | None = None) -> np.ndarray:
    """Return the per-sample loss `logsumexp(logits) - logits[label]` over the last dim (0 where
    the label is `ignore_index`)."""
    valid = _valid(labels, ignore_index)
    idx = labels.astype(np.int64) if valid is None else np.where(valid, labels, 0).astype(np.int64)
    peak = logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(logits - peak).sum(axis=-1)) + peak[..., 0]
    loss = lse - np.take_along_axis(logits, idx[..., None], axis=-1)[..., 0]
    if valid is not None:
        loss = np.where(valid, loss, 0)
    return np.asarray(loss, dtype=logits.dtype)


def softmax_cross_entropy_grad(
    logits: np.ndarray, labels: np.ndarray, dloss: np.ndarray, ignore_index: int | None = None
) -> np.ndarray:
    """Return `(softmax(logits) - onehot(labels)) * dloss[..., None]` (0 rows where ignored)."""
    valid = _valid(labels, ignore_index)
    idx = labels.astype(np.int64) if valid is None else np.where(valid, labels, 0).astype(np.int64)
    p = _softmax(logits, -1)
    np.put_along_axis(p, idx[..., None], np.take_along_axis(p, idx[..., None], axis=-1) - 1, axis=-1)
    scale = dloss if valid is None else np.where(valid, dloss, 0)
    return (p * scale[..., None]).astype(logits.dtype)


# ----------------------------------------------------------------------------- elementwise


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # exp of -|x| only: no overflow warnings for large |x|
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


def _erf_series(x: np.ndarray) -> np.ndarray:
    """erf for float64 arrays without SciPy, to about 1e-15 absolute.

    |x| < 3: `2/sqrt(pi) exp(-x^2) sum_n 2^n x^(2n+1) / (1*3*...*(2n+1))` (all terms positive,
    no cancellation; 80 terms suffice); |x| >= 3: `1 - erfc` with erfc's continued fraction
    `exp(-x^2)/sqrt(pi) / (x + 1/2 / (x + 1 / (x + 3/2 / (x + ...))))` (60 levels).
    """
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    small = np.minimum(a, 3.0)
    term = small.copy()
    total = small.copy()
    x2 = small * small
    for n in range(1, 80):
        term = term * (2 * x2) / (2 * n + 1)
        total += term
    series = 2 / math.sqrt(math.pi) * np.exp(-x2) * total
    big = np.maximum(a, 3.0)
    frac = big.copy()
    for k in range(60, 0, -1):
        frac = big + (k / 2) / frac
    tail = 1 - np.exp(-big * big) / math.sqrt(math.pi) / frac
    return np.sign(x) * np.where(a < 3.0, series, tail)


try:  # SciPy's erf is faster and exact; it is optional
    from scipy.special import erf as _scipy_erf
except ImportError:  # pragma: no cover - depends on the environment
    _scipy_erf = None


def erf(x: np.ndarray) -> np.ndarray:
    """Elementwise error function (SciPy's where installed, else `_erf_series`), in x's dtype."""
    if _scipy_erf is not None:
        return _scipy_erf(x).astype(x.dtype, copy=False)
    return _erf_series(x).astype(x.dtype, copy=False)


@takes_out
def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
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
def matmul_rhs_grad(a: np.ndarray, g: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`a^T g` over all leading dims merged: the gradient of the right operand of `a @ w`."""
    return np.matmul(a.reshape(-1, a.shape[-1]).T, g.reshape(-1, g.shape[-1]), out=out)


def concat(xs: tuple[np.ndarray, ...], axis: int, out: np.ndarray | None = None) -> np.ndarray:
    """`np.concatenate(xs, axis)`; into `out`, an operand that already is its part of `out` (the
    same view: a matmul wrote it there, `schedule.placement`) is not copied."""
    if out is None:
        return np.concatenate(xs, axis=axis)
    axis %= out.ndim
    start = 0
    for x in xs:
        part = out[(slice(None),) * axis + (slice(start, start + x.shape[axis]),)]
        start += x.shape[axis]
        if not (x.ctypes.data == part.ctypes.data and x.strides == part.strides and x.shape == part.shape):
            np.copyto(part, x)
    return out


@takes_out
def expert_matmul_rhs_grad(a: np.ndarray, g: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`a[e]^T g[e]` for every expert e: the gradient of the expert weights of `a @ w`."""
    return np.matmul(a.transpose(0, 2, 1), g, out=out)


def _tanh_inner(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Fill `out` with `tanh(sqrt(2/pi) * (x + 0.044715 x^3))` (the tanh GELU's t), in place."""
    np.multiply(x, x, out=out)
    out *= x
    out *= _GELU_C
    out += x
    out *= _SQRT_2_OVER_PI
    return np.tanh(out, out=out)


def gelu(x: np.ndarray, approximate: str, out: np.ndarray | None = None) -> np.ndarray:
    """GELU: exact `x Phi(x)` (approximate="none") or the tanh form (approximate="tanh").

    The tanh form runs in place in `out`, one pass per operation and no temporaries.
    """
    if approximate == "tanh":
        out = _tanh_inner(x, np.empty_like(x) if out is None else out)
        out += 1
        out *= x
        out *= 0.5
        return out
    y = 0.5 * x * (1 + erf(x / math.sqrt(2.0)))
    if out is None:
        return y
    np.copyto(out, y)
    return out


def gelu_grad(x: np.ndarray, dy: np.ndarray, approximate: str, out: np.ndarray | None = None) -> np.ndarray:
    """`dy * gelu'(x)`; the tanh form with two temporaries, the rest in place in `out`."""
    if approximate == "tanh":
        t = _tanh_inner(x, np.empty_like(dy) if out is None else out)
        b = np.multiply(t, t)  # b = 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 c x^2)
        np.subtract(1, b, out=b)
        h = np.multiply(x, 0.5)
        b *= h
        b *= _SQRT_2_OVER_PI
        np.multiply(x, 3 * _GELU_C, out=h)
        h *= x
        h += 1
        b *= h
        t += 1  # 0.5 (1 + t) + b
        t *= 0.5
        t += b
        t *= dy
        return t
    cdf = 0.5 * (1 + erf(x / math.sqrt(2.0)))
    d = cdf + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    y = (dy * d).astype(dy.dtype, copy=False)
    if out is None:
        return y
    np.copyto(out, y)
    return out


def _pow(exponent: float) -> Kernel:
    if exponent == 2.0:
        return lambda x: x * x
    if exponent == 1.0:
        return lambda x: x.copy()
    if exponent == 0.5:
        return np.sqrt
    if exponent == int(exponent):
        p = int(exponent)
        return lambda x: np.power(x, p) if p >= 0 else np.power(x, float(p))
    return lambda x: np.power(x, exponent)


def _pow_grad(exponent: float) -> Kernel:
    if exponent == 0.0:
        return lambda x, dy: np.zeros_like(dy)
    if exponent == 1.0:
        return lambda x, dy: dy.copy()
    lower = _pow(exponent - 1.0)
    factor = exponent
    return lambda x, dy: (dy * (lower(x) * x.dtype.type(factor))).astype(dy.dtype, copy=False)


# ----------------------------------------------------------------------------- normalisation


def _uniform(*arrays: np.ndarray) -> bool:
    """Return whether the arrays share one float32/float64 dtype (the in-place paths' condition)."""
    return arrays[0].dtype in (np.float32, np.float64) and all(a.dtype == arrays[0].dtype for a in arrays)


def _into(value: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """Return `value`, or `out` filled with it."""
    if out is None:
        return value
    np.copyto(out, value)
    return out


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float,
               out: np.ndarray | None = None) -> np.ndarray:
    """`(x - mean) / sqrt(var + eps) * weight + bias` over the last dim (in place in `out`)."""
    if not _uniform(x, weight, bias):  # mixed precision: compute in the promoted dtype, round once
        mean = x.mean(axis=-1, keepdims=True)
        xc = x - mean
        var = (xc * xc).mean(axis=-1, keepdims=True)
        return _into((xc / np.sqrt(var + eps) * weight + bias).astype(x.dtype, copy=False), out)
    out = np.subtract(x, x.mean(axis=-1, keepdims=True), out=out)
    sq = np.multiply(out, out)
    std = sq.mean(axis=-1, keepdims=True)
    del sq
    std += eps
    np.sqrt(std, out=std)
    out /= std
    out *= weight
    out += bias
    return out


def layer_norm_grad(x: np.ndarray, weight: np.ndarray, dy: np.ndarray, eps: float, out=None):
    """Return (dx, dweight, dbias) of `layer_norm` (written into the three arrays of `out` if given)."""
    lead = tuple(range(x.ndim - 1))
    if not _uniform(x, weight, dy):  # mixed precision: compute in the promoted dtype, round once
        mean = x.mean(axis=-1, keepdims=True)
        xc = x - mean
        rstd = 1 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + eps)
        xhat = xc * rstd
        g = dy * weight
        dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))
        res = (dx.astype(x.dtype, copy=False), np.asarray((dy * xhat).sum(axis=lead), dtype=x.dtype),
               np.asarray(dy.sum(axis=lead), dtype=x.dtype))
        return res if out is None else tuple(_into(r, o) for r, o in zip(res, out))
    dx, dweight, dbias = out if out is not None else (np.empty(x.shape, x.dtype), None, None)
    if not dx.flags.c_contiguous:  # a strided out: compute in a C array, then copy
        res = layer_norm_grad(x, weight, dy, eps, (np.empty(x.shape, x.dtype), dweight, dbias))
        np.copyto(dx, res[0])
        return dx, res[1], res[2]
    cols = x.shape[-1]
    rows = x.size // max(cols, 1)
    x2, dy2, dx2 = (np.reshape(a, (rows, cols)) for a in (x, dy, dx))  # dx2: a view of dx
    prod = np.empty(x.shape, x.dtype)  # dy * xhat, summed whole below (the same sum as one call's)
    prod2 = prod.reshape(rows, cols)
    step = max(1, _BLOCK_ELEMENTS // max(cols, 1))
    for lo in range(0, rows, step):  # blocks of rows, so that the temporaries stay in cache
        hi = min(lo + step, rows)
        xb, dyb, dxb = x2[lo:hi], dy2[lo:hi], dx2[lo:hi]
        xhat = np.subtract(xb, xb.mean(axis=-1, keepdims=True))
        np.multiply(xhat, xhat, out=dxb)
        rstd = dxb.mean(axis=-1, keepdims=True)
        rstd += eps
        np.sqrt(rstd, out=rstd)
        np.divide(1, rstd, out=rstd)
        xhat *= rstd
        g = np.multiply(dyb, weight)
        np.multiply(g, xhat, out=dxb)  # dx = rstd * (g - mean(g) - xhat * mean(g xhat))
        m2 = dxb.mean(axis=-1, keepdims=True)
        np.multiply(xhat, m2, out=dxb)
        g -= g.mean(axis=-1, keepdims=True)
        np.subtract(g, dxb, out=dxb)
        dxb *= rstd
        np.multiply(dyb, xhat, out=prod2[lo:hi])
    dweight = np.sum(prod, axis=lead, out=dweight)
    dbias = np.sum(dy, axis=lead, out=dbias)
    return dx, dweight, dbias


#: rows of a row-wise kernel that blocks itself are taken this many elements at a time
_BLOCK_ELEMENTS = 1 << 15


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    r = 1 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return (x * r * weight).astype(x.dtype, copy=False)


def rms_norm_grad(x: np.ndarray, weight: np.ndarray, dy: np.ndarray, eps: float):
    lead = tuple(range(x.ndim - 1))
    r = 1 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    g = dy * weight
    dx = r * g - x * (r**3) * (g * x).mean(axis=-1, keepdims=True)
    dweight = np.asarray((dy * x * r).sum(axis=lead), dtype=x.dtype)
    return dx.astype(x.dtype, copy=False), dweight


# ----------------------------------------------------------------------------- indexing


#: groups of more repeats of one id than this are summed one group at a time (`np.add.reduce`);
#: the others in one vectorized pass per repeat
_SCATTER_PASSES = 16


def scatter_add_rows(out: np.ndarray, index: np.ndarray, rows: np.ndarray, native: bool = True) -> np.ndarray:
    """Add row i of `rows` into row `index[i]` of `out`, in place, in the order of i; return `out`.

    The same bits as `np.add.at(out, index, rows)` (each row of `out` gets its rows added one
    by one in order). With `native` (default) in one C++ pass where the runtime's library is
    built (`native.scatter_add_rows`: 0.1 ms against 1.1-1.4 ms for GPT-tiny's 2048 ids). Else
    about 9x faster than `np.add.at` on a GPT's ids: the rows are grouped by index (a
    stable sort) and the k-th row of every group is added in one vectorized pass, so the
    passes number the most repeats of one index among the groups of at most `_SCATTER_PASSES`
    rows. A larger group (a byte-level GPT's space: hundreds of repeats) is added into its row
    of `out` row after row on its own (`np.add.reduce`, `reduceat` and `accumulate` over the
    leading axis sum pairwise or cast differently for some shapes and dtypes: other bits).
    """
    if index.size == 0 or native and _native.scatter_add_rows(out, index, rows):
        return out
    order = np.argsort(index, kind="stable")
    sorted_index = index[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_index[1:] != sorted_index[:-1])))
    counts = np.diff(np.append(starts, index.size))
    grouped = rows[order]
    targets = sorted_index[starts]
    large = counts > _SCATTER_PASSES
    for t, s, c in zip(targets[large], starts[large], counts[large]):
        acc = out[t]
        for row in grouped[s:s + c]:
            np.add(acc, row, out=acc)
    small = ~large
    for k in range(int(counts[small].max(initial=0))):
        more = small & (counts > k)
        out[targets[more]] += grouped[starts[more] + k]
    return out


def embedding_grad(ids: np.ndarray, dy: np.ndarray, vocab: int) -> np.ndarray:
    """Scatter-add the rows of `dy` into a zero [vocab, D] table at `ids` (in the order of the ids)."""
    out = np.zeros((vocab, dy.shape[-1]), dtype=dy.dtype)
    return scatter_add_rows(out, ids.reshape(-1), dy.reshape(-1, dy.shape[-1]))


def causal_mask(value: float) -> Kernel:
    """`value` above the diagonal of the last two dims, `x` elsewhere."""
    cache: dict[tuple[int, int], np.ndarray] = {}

    @takes_out
    def mask(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        key = x.shape[-2:]
        if key not in cache:
            tq, tk = key
            cache[key] = np.arange(tk)[None, :] > np.arange(tq)[:, None]
        if out is None:
            return np.where(cache[key], x.dtype.type(value), x)
        if out.ctypes.data != x.ctypes.data or out.strides != x.strides:  # not in place
            np.copyto(out, x)
        np.copyto(out, x.dtype.type(value), where=cache[key])
        return out

    return mask


def softmax(x: np.ndarray, axis: int, out: np.ndarray | None = None) -> np.ndarray:
    """`exp(x - max) / sum(exp(x - max))` along `axis`, in place in `out`."""
    out = np.subtract(x, x.max(axis=axis, keepdims=True), out=out)
    np.exp(out, out=out)
    out /= out.sum(axis=axis, keepdims=True)
    return out


def softmax_grad(y: np.ndarray, dy: np.ndarray, axis: int, out: np.ndarray | None = None) -> np.ndarray:
    """`y * (dy - sum(dy * y))` along `axis`, in place in `out`."""
    out = np.multiply(dy, y, out=out)
    s = out.sum(axis=axis, keepdims=True)
    np.subtract(dy, s, out=out)
    out *= y
    return out


def reduce_max_grad(dims: tuple[int, ...]) -> Kernel:
    """`dy` to the arg-max positions; ties share it evenly."""

    def grad(x: np.ndarray, y: np.ndarray, dy: np.ndarray) -> np.ndarray:
        hit = x == np.expand_dims(y, dims)
        count = hit.sum(axis=dims, keepdims=True)
        return (hit * (np.expand_dims(dy, dims) / count)).astype(dy.dtype, copy=False)

    return grad


def rope_tables(positions: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """Return cos and sin [T, 1, Dh] (float64) of the HuggingFace LLaMA rotary embedding."""
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    freqs = np.outer(np.arange(positions, dtype=np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)[:, None, :]
    return np.cos(emb), np.sin(emb)


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rope(base: float, sign: float) -> Kernel:
    """`x * cos + sign * rotate_half(x) * sin` (sign -1: the transposed rotation)."""
    cache: dict[tuple[int, int, np.dtype], tuple[np.ndarray, np.ndarray]] = {}

    def apply(x: np.ndarray) -> np.ndarray:
        key = (x.shape[-3], x.shape[-1], x.dtype)
        if key not in cache:
            cos, sin = rope_tables(x.shape[-3], x.shape[-1], base)
            cache[key] = (cos.astype(x.dtype), (sign * sin).astype(x.dtype))
        cos, sin = cache[key]
        return x * cos + _rotate_half(x) * sin

    return apply


# ----------------------------------------------------------------------------- dropout

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a bijection of uint64 with good avalanche."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def dropout_key(seed: int, salt: int, step: int) -> np.uint64:
    """Return the per-(seed, salt, step) key of the dropout hash."""
    with np.errstate(over="ignore"):
        k = np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
        for word in (salt, step):
            k = _mix64(k + _GOLDEN) ^ np.array([word & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
        return _mix64(k + _GOLDEN)[0]


def dropout_uniform(key: np.uint64, index: np.ndarray) -> np.ndarray:
    """Return uniforms in [0, 1) (float64, 53 bits): `mix64(key + (index + 1) * golden) >> 11`."""
    with np.errstate(over="ignore"):
        z = _mix64(key + (index.astype(np.uint64) + np.uint64(1)) * _GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)


def global_indices(local_shape, global_shape, slices) -> np.ndarray:
    """Return the row-major global index (uint64) of every element of a local piece."""
    idx = np.zeros(local_shape, dtype=np.uint64)
    stride = 1
    for d in reversed(range(len(global_shape))):
        view = [1] * len(local_shape)
        view[d] = local_shape[d]
        start = slices[d].start or 0
        idx += (np.arange(start, start + local_shape[d], dtype=np.uint64) * np.uint64(stride)).reshape(view)
        stride *= int(global_shape[d])
    return idx


def dropout(op: graph.DropoutOp, rank: int, microbatch: int = 0) -> Kernel:
    """`x * keep / (1 - rate)`, keep = uniform(seed, salt, step, global index) >= rate.

    An op of a pipeline stage's forward or backward (`microbatches` m and `microbatch_dim` d
    set) holds micro-batch `microbatch` of a tensor whose dim d is m times its global type's:
    its elements take their indices in that whole tensor, so the masks are one device's. The
    kernel's `for_microbatch(i)` returns the kernel of micro-batch i.
    """
    from hspmd.dialects.dist import layout_of

    rate = op.rate.value.data
    if rate == 0.0:
        return lambda x, step: x
    seed, salt = op.seed.value.data, op.salt.value.data
    local_shape = _result_shape(op)
    typ = op.global_type
    if typ is None:  # logical or a one-device program: the piece is the whole tensor
        slices = tuple(slice(0, s) for s in local_shape)
        global_shape = local_shape
    else:
        global_shape = typ.get_shape()  # type: ignore[attr-defined]
        layout = layout_of(typ)
        me = rank
        if op.microbatch_ranks is not None and op.stage_ranks is not None:  # as the micro-batch's virtual device
            stage = tuple(op.stage_ranks.get_values())
            me = tuple(op.microbatch_ranks.get_values())[microbatch * len(stage) + stage.index(rank)]
        slices = layout.slices(me, global_shape) if layout is not None else tuple(slice(0, s) for s in global_shape)
    if op.microbatches is not None and op.microbatch_dim is not None:
        m, d = op.microbatches.value.data, op.microbatch_dim.value.data
        shift = microbatch * global_shape[d]
        slices = tuple(slice((sl.start or 0) + shift, (sl.stop or global_shape[d]) + shift) if k == d else sl
                       for k, sl in enumerate(slices))
        global_shape = tuple(n * m if k == d else n for k, n in enumerate(global_shape))
    index = global_indices(local_shape, global_shape, slices)
    scale = 1.0 / (1.0 - rate)

    def apply(x: np.ndarray, step: np.ndarray) -> np.ndarray:
        keep = dropout_uniform(dropout_key(seed, salt, int(step)), index) >= rate
        return np.where(keep, x * x.dtype.type(scale), x.dtype.type(0))

    apply.for_microbatch = lambda i: dropout(op, rank, i)  # type: ignore[attr-defined]
    return apply


# ----------------------------------------------------------------------------- a split vocabulary


def _annotated(op: Operation, rank: int):
    """Return (global shape, layout) of `op`'s result from its `global_type`, or None where the
    op runs whole (logical IR, a one-device program, or a rank the layout does not name)."""
    from hspmd.dialects.dist import layout_of

    typ = getattr(op, "global_type", None)
    layout = layout_of(typ) if typ is not None else None
    if layout is None or rank not in layout.devices:
        return None
    return typ.get_shape(), layout  # type: ignore[attr-defined]


def embedding(op: graph.EmbeddingOp, rank: int) -> Kernel:
    """`table[ids]`; with a vocabulary-split table (a partial result) the rows this rank owns,
    zeros for the other ids: its table piece starts at (its coordinate on the partial axis) * rows."""
    from hspmd.ir.layout import PARTIAL

    found = _annotated(op, rank)
    part = None
    if found is not None:
        layout = found[1]
        for group in layout.groups:
            if rank in group.devices:
                part = group.states.coords(group.devices.index(rank)).get(PARTIAL)
    if part is None:
        return lambda table, ids: table[ids]

    def lookup(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
        local = ids - part * table.shape[0]
        inside = (local >= 0) & (local < table.shape[0])
        out = table[np.where(inside, local, 0)]
        out[~inside] = 0
        return out

    return lookup


def embedding_grad_kernel(op: graph.EmbeddingGradOp, rank: int) -> Kernel:
    """Scatter-add `dy` at `ids` into this rank's rows of the table gradient (all rows, or the
    vocabulary range its result piece covers when the result is split along V)."""
    vocab = _result_shape(op)[0]
    found = _annotated(op, rank)
    start = found[1].slices(rank, found[0])[0].start if found is not None else 0
    if start == 0 and (found is None or found[0][0] == vocab):
        return lambda ids, dy: embedding_grad(ids, dy, vocab)

    def grad(ids: np.ndarray, dy: np.ndarray) -> np.ndarray:
        local = ids.reshape(-1) - start
        inside = (local >= 0) & (local < vocab)
        out = np.zeros((vocab, dy.shape[-1]), dtype=dy.dtype)
        return scatter_add_rows(out, local[inside], dy.reshape(-1, dy.shape[-1])[inside])

    return grad


def one_hot(op: graph.OneHotOp, rank: int) -> Kernel:
    """`labels[..., None] == classes` for the classes (global indices along the last dim) of this piece."""
    shape, dtype = _result_shape(op), _result_dtype(op)
    found = _annotated(op, rank)
    start = found[1].slices(rank, found[0])[-1].start if found is not None else 0
    classes = np.arange(start, start + shape[-1])
    return lambda labels: (labels[..., None] == classes).astype(dtype)


# ----------------------------------------------------------------------------- mixture of experts


def moe_route(probs: np.ndarray, top_k: int, capacity: int) -> np.ndarray:
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


def _slots_by_group(y: np.ndarray) -> np.ndarray:
    """Return expert slots [E, G, C, D] as [G, E*C, D]."""
    e, g, c, d = y.shape
    return np.ascontiguousarray(y.transpose(1, 0, 2, 3)).reshape(g, e * c, d)


def moe_dispatch(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """`out[e, g, c] = sum_s mask[g, s, e, c] x[g, s]`: [G, S, D], [G, S, E, C] -> [E, G, C, D]."""
    g, s, e, c = mask.shape
    slots = np.matmul(mask.reshape(g, s, e * c).transpose(0, 2, 1), x)  # [G, E*C, D]
    return np.ascontiguousarray(slots.reshape(g, e, c, -1).transpose(1, 0, 2, 3))


def moe_combine(y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """`out[g, s] = sum_{e, c} weights[g, s, e, c] y[e, g, c]`: [E, G, C, D], [G, S, E, C] -> [G, S, D]."""
    g, s, e, c = weights.shape
    return np.matmul(weights.reshape(g, s, e * c), _slots_by_group(y))


def moe_weights_grad(t: np.ndarray, y: np.ndarray) -> np.ndarray:
    """`out[g, s, e, c] = sum_d t[g, s, d] y[e, g, c, d]`: [G, S, D], [E, G, C, D] -> [G, S, E, C]."""
    e, g, c, _ = y.shape
    return np.matmul(t, _slots_by_group(y).transpose(0, 2, 1)).reshape(g, t.shape[1], e, c)


# ----------------------------------------------------------------------------- dispatch


def _along(axis: int, ndim: int) -> Callable[[Kernel], Kernel]:
    """Return the marker of a kernel that reduces along `axis` of an `ndim`-dimensional result."""
    axis %= ndim
    return rowwise if axis == ndim - 1 else by_rows if axis != 0 else takes_out


def _iota(op: graph.IotaOp, rank: int = 0) -> Kernel:
    """Return the kernel of `graph.iota`: this rank's piece of `start + i * step` (the whole where
    the op records no global type, at the logical level)."""
    from hspmd.dialects.dist import layout_of

    typ = op.global_type if op.global_type is not None else op.result.type
    (n,) = typ.get_shape()  # type: ignore[attr-defined]
    values = (np.arange(n, dtype=np.int64) * op.step.value.data + op.start.value.data).astype(_result_dtype(op))
    layout = layout_of(typ) if op.global_type is not None else None
    if layout is not None:
        values = np.ascontiguousarray(values[layout.slices(rank, (n,))])
    return lambda: values.copy()


def kernel_for(op: Operation, rank: int = 0) -> Kernel:
    """Return the NumPy function that computes `op` from its operand arrays on `rank`.

    Most kernels ignore the rank; ops whose values depend on where a piece lies in the global
    tensor (counter-based dropout) use it with the op's `global_type` layout.
    """
    own = getattr(op, "numpy_kernel", None)
    if callable(own):
        return own(KernelContext(rank, _native))
    fn = _iota(op, rank) if isinstance(op, graph.IotaOp) else _pointwise_or_shape_kernel(op)
    if fn is None:
        fn = _layer_kernel(op, rank)
    if fn is None:
        raise NotImplementedError(f"no NumPy kernel for '{op.name}'")
    return fn


def _pointwise_or_shape_kernel(op: Operation) -> Kernel | None:
    """Return the kernel of an elementwise, matmul, reduction or view op (None for other ops)."""
    match op:
        case graph.AddOp():
            return np.add
        case graph.SubOp():
            return np.subtract
        case graph.MulOp():
            return np.multiply
        case graph.DivOp():
            return np.divide
        case graph.ReluOp():
            return overwrites_first(rowwise(lambda x, out=None: np.maximum(x, x.dtype.type(0), out=out)))
        case graph.ReluGradOp():
            return lambda x, dy: np.where(x > 0, dy, 0).astype(dy.dtype)
        case graph.ScaleOp():
            factor = _result_dtype(op).type(op.factor.value.data)
            return overwrites_first(rowwise(lambda x, out=None: np.multiply(x, factor, out=out)))
        case graph.MatmulOp() | graph.ExpertMatmulOp():
            return matmul
        case graph.MatmulRhsGradOp():
            return matmul_rhs_grad
        case graph.ExpertMatmulRhsGradOp():
            return expert_matmul_rhs_grad
        case graph.TransposeOp():
            perm = tuple(op.perm.get_values())
            return lambda x: np.transpose(x, perm)  # a view
        case graph.ReshapeOp():
            shape = _result_shape(op)
            return lambda x: x.reshape(shape)
        case graph.BroadcastOp():
            shape, dims = _result_shape(op), op.dims.get_values()
            placed = [1] * len(shape)

            def broadcast(x: np.ndarray) -> np.ndarray:
                view = list(placed)
                for i, d in enumerate(dims):
                    view[d] = x.shape[i]
                return np.broadcast_to(x.reshape(view), shape)

            return broadcast
        case graph.ReduceSumOp():
            dims = tuple(op.dims.get_values())
            dtype = _result_dtype(op)
            if np.dtype(dtype_name(op.operands[0].type)) == dtype:
                return takes_out(lambda x, out=None: np.sum(x, axis=dims, out=out))
            return lambda x: np.asarray(x.sum(axis=dims), dtype=dtype)
        case graph.ReduceMaxOp():
            dims = tuple(op.dims.get_values())
            return lambda x: np.asarray(x.max(axis=dims))
        case graph.ReduceMaxGradOp():
            return reduce_max_grad(tuple(op.dims.get_values()))
        case graph.ExpOp():
            return np.exp
        case graph.LogOp():
            return np.log
        case graph.SqrtOp():
            return np.sqrt
        case graph.RsqrtOp():

            @overwrites_first
            @rowwise
            def rsqrt(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
                out = np.sqrt(x, out=out)
                return np.divide(1, out, out=out)

            return rsqrt
        case graph.TanhOp():
            return np.tanh
        case graph.TanhGradOp():

            @overwrites_first
            @rowwise
            def tanh_grad(y: np.ndarray, dy: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
                out = np.multiply(y, y, out=out)
                np.subtract(1, out, out=out)
                return np.multiply(dy, out, out=out)

            return tanh_grad
        case graph.SigmoidOp():
            return _sigmoid
        case graph.BinaryCrossEntropyOp():
            return lambda z, y: np.maximum(z, 0) - z * y + np.log1p(np.exp(-np.abs(z)))
        case graph.BinaryCrossEntropyGradOp():
            return lambda z, y, dy: (_sigmoid(z) - y) * dy
        case graph.SigmoidGradOp():
            return lambda y, dy: dy * (y * (1 - y))
        case graph.SiluOp():
            return lambda x: x * _sigmoid(x)
        case graph.SiluGradOp():

            def silu_grad(x: np.ndarray, dy: np.ndarray) -> np.ndarray:
                s = _sigmoid(x)
                return dy * (s * (1 + x * (1 - s)))

            return silu_grad
        case graph.GeluOp():
            approximate = op.approximate.data
            return rowwise(lambda x, out=None: gelu(x, approximate, out))
        case graph.GeluGradOp():
            approximate = op.approximate.data
            return rowwise(lambda x, dy, out=None: gelu_grad(x, dy, approximate, out))
        case graph.PowOp():
            return _pow(op.exponent.value.data)
        case graph.PowGradOp():
            return _pow_grad(op.exponent.value.data)
        case graph.CastOp():
            dtype = _result_dtype(op)
            return lambda x: x.astype(dtype)
    return None


def _layer_kernel(op: Operation, rank: int) -> Kernel | None:
    """Return the kernel of a softmax, norm, embedding, loss, slicing or dropout op (None for other ops)."""
    match op:
        case graph.SoftmaxOp():
            axis = op.dim.value.data
            rows = _along(axis, len(_result_shape(op)))
            axis = -1 if rows is rowwise else axis  # row blocks come as 2-D views
            return overwrites_first(rows(lambda x, out=None: softmax(x, axis, out)))
        case graph.SoftmaxGradOp():
            axis = op.dim.value.data
            rows = _along(axis, len(_result_shape(op)))
            axis = -1 if rows is rowwise else axis  # row blocks come as 2-D views
            return rows(lambda y, dy, out=None: softmax_grad(y, dy, axis, out))
        case graph.LayerNormOp():
            eps = op.eps.value.data
            rows = rowwise if len(_result_shape(op)) > 1 else takes_out
            return overwrites_first(rows(lambda x, w, b, out=None: layer_norm(x, w, b, eps, out)))
        case graph.LayerNormGradOp():
            eps = op.eps.value.data
            return takes_out(lambda x, w, dy, out=None: layer_norm_grad(x, w, dy, eps, out))
        case graph.RmsNormOp():
            eps = op.eps.value.data
            return lambda x, w: rms_norm(x, w, eps)
        case graph.RmsNormGradOp():
            eps = op.eps.value.data
            return lambda x, w, dy: rms_norm_grad(x, w, dy, eps)
        case graph.EmbeddingOp():
            return embedding(op, rank)
        case graph.EmbeddingGradOp():
            return embedding_grad_kernel(op, rank)
        case graph.OneHotOp():
            return one_hot(op, rank)
        case graph.CausalMaskOp():
            mask = overwrites_first(causal_mask(op.value.value.data))
            return by_rows(mask) if len(_result_shape(op)) > 2 else mask
        case graph.SliceOp():
            d, start = op.dim.value.data, op.start.value.data
            stop = start + _result_shape(op)[d]
            index = tuple([slice(None)] * d + [slice(start, stop)])
            return lambda x: x[index]  # a view
        case graph.SplitOp():
            d = op.dim.value.data
            bounds = np.cumsum([r.type.get_shape()[d] for r in op.outputs])[:-1].tolist()
            if not bounds:  # one result: the plan stores the array itself, not a tuple
                return lambda x: x
            return lambda x: tuple(np.split(x, bounds, axis=d))  # views
        case graph.ConcatOp():
            d = op.dim.value.data
            return takes_out(lambda *xs, out=None: concat(xs, d, out))
        case graph.SoftmaxCrossEntropyOp():
            ignore = op.ignore_index.value.data if op.ignore_index is not None else None
            return lambda logits, labels: softmax_cross_entropy(logits, labels, ignore)
        case graph.SoftmaxCrossEntropyGradOp():
            ignore = op.ignore_index.value.data if op.ignore_index is not None else None
            return lambda logits, labels, dloss: softmax_cross_entropy_grad(logits, labels, dloss, ignore)
        case graph.LabelMaskOp():
            ignore, dtype = op.ignore_index.value.data, _result_dtype(op)
            return lambda labels: (labels != ignore).astype(dtype)
        case graph.RopeOp():
            return rope(op.base.value.data, 1.0)
        case graph.RopeGradOp():
            return rope(op.base.value.data, -1.0)
        case graph.DropoutOp():
            return dropout(op, rank)
        case graph.MoeRouteOp():
            top_k, capacity = op.top_k.value.data, _result_shape(op)[-1]
            return lambda probs: moe_route(probs, top_k, capacity)
        case graph.MoeDispatchOp():
            return moe_dispatch
        case graph.MoeCombineOp():
            return moe_combine
        case graph.MoeWeightsGradOp():
            return moe_weights_grad
    return None
