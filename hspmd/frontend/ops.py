"""The functional op set of the frontend: `hs.relu(x)`, `hs.cross_entropy(logits, labels)`, ...

Each function checks shapes and dtypes (a `TraceError` names the script line, the op and the
shapes) and appends `graph` ops through the tensor's tracer. Tensors' operators (`a @ b`,
`a / b`, `a ** p`, `x.max(dims)`) end here too.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from xdsl.dialects.builtin import TensorType

from hspmd.dialects import graph
from hspmd.dialects.context import hspmd_dialects
from hspmd.dialects.interfaces import frontend_names
from hspmd.frontend.tracing import Tensor, Tracer, fail
from hspmd.ir.types import element_type

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _tensor(x, op: str) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if hasattr(x, "traced"):  # a Parameter bound to the running trace
        return x.traced(op)
    raise fail(op, f"expected a tensor, got {type(x).__name__}")


def _float(x: Tensor, op: str) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise fail(op, f"needs a float tensor, got {x.dtype}")


def _typed(x: Tensor, shape: Sequence[int]) -> TensorType:
    return TensorType(x.value.type.element_type, tuple(shape))


def _dim(x: Tensor, dim: int, op: str) -> int:
    if not -x.ndim <= dim < x.ndim:
        raise fail(op, f"dim {dim} is out of range for a {x.ndim}-d tensor of shape {list(x.shape)}")
    return dim % x.ndim


# ----------------------------------------------------------------------------- products


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Return `a @ b`: [..., m, k] x [..., k, n] (same batch dims) or [..., m, k] x [k, n]."""
    a, b = _tensor(a, "matmul"), _tensor(b, "matmul")
    ok = a.ndim >= 2 and b.ndim >= 2 and a.shape[-1] == b.shape[-2]
    ok = ok and (b.ndim == 2 or b.shape[:-2] == a.shape[:-2])
    if not ok:
        raise fail("matmul", f"cannot multiply {list(a.shape)} by {list(b.shape)} "
                             "(needs [..., m, k] x [..., k, n] with the same batch dims, or [..., m, k] x [k, n])")
    if a.dtype != b.dtype:
        raise fail("matmul", f"operands have dtypes {a.dtype} and {b.dtype}")
    return a.tracer.emit(graph.MatmulOp(a.value, b.value, _typed(a, (*a.shape[:-1], b.shape[-1]))))


def expert_matmul(x: Tensor, w: Tensor) -> Tensor:
    """Return each expert's tokens times its weight: [E, m, k] x [E, k, n] -> [E, m, n]."""
    x, w = _tensor(x, "expert_matmul"), _tensor(w, "expert_matmul")
    if x.ndim != 3 or w.ndim != 3 or x.shape[0] != w.shape[0] or x.shape[2] != w.shape[1]:
        raise fail("expert_matmul", f"cannot multiply {list(x.shape)} by {list(w.shape)} (needs [E, m, k] x [E, k, n])")
    if x.dtype != w.dtype:
        raise fail("expert_matmul", f"operands have dtypes {x.dtype} and {w.dtype}")
    return x.tracer.emit(graph.ExpertMatmulOp(x.value, w.value, _typed(x, (*x.shape[:2], w.shape[2]))))


def moe_route(probs: Tensor, top_k: int, capacity: int) -> Tensor:
    """Return the dispatch mask [G, S, E, C] of router probabilities [G, S, E]: each token's
    `top_k` experts, placed in each expert's `capacity` slots per group, the rest dropped
    (see `graph.moe_route`). It has no gradient."""
    probs = _tensor(probs, "moe_route")
    _float(probs, "moe_route")
    if probs.ndim != 3:
        raise fail("moe_route", f"needs router probabilities [groups, tokens, experts], got {list(probs.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= probs.shape[2]:
        raise fail("moe_route", f"top_k={top_k!r} must be an integer in 1..{probs.shape[2]} (the experts)")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise fail("moe_route", f"capacity={capacity!r} must be an integer >= 1")
    return probs.tracer.emit(graph.MoeRouteOp(probs.value, top_k, _typed(probs, (*probs.shape, capacity))))


def moe_dispatch(x: Tensor, mask: Tensor) -> Tensor:
    """Return tokens x [G, S, D] placed in expert slots [E, G, C, D] by `mask` [G, S, E, C]."""
    x, mask = _tensor(x, "moe_dispatch"), _tensor(mask, "moe_dispatch")
    if x.ndim != 3 or mask.ndim != 4 or mask.shape[:2] != x.shape[:2] or x.dtype != mask.dtype:
        raise fail("moe_dispatch", f"needs tokens [G, S, D] and a mask [G, S, E, C] of one dtype, "
                                   f"got {list(x.shape)} {x.dtype} and {list(mask.shape)} {mask.dtype}")
    g, s, e, c = mask.shape
    return x.tracer.emit(graph.MoeDispatchOp(x.value, mask.value, _typed(x, (e, g, c, x.shape[2]))))


def moe_combine(y: Tensor, weights: Tensor) -> Tensor:
    """Return expert slots y [E, G, C, D] summed back to tokens [G, S, D] with `weights` [G, S, E, C]."""
    y, weights = _tensor(y, "moe_combine"), _tensor(weights, "moe_combine")
    ok = y.ndim == 4 and weights.ndim == 4 and y.dtype == weights.dtype
    ok = ok and (weights.shape[2], weights.shape[0], weights.shape[3]) == y.shape[:3]
    if not ok:
        raise fail("moe_combine", f"needs expert slots [E, G, C, D] and weights [G, S, E, C] of one dtype, "
                                  f"got {list(y.shape)} {y.dtype} and {list(weights.shape)} {weights.dtype}")
    g, s = weights.shape[:2]
    return y.tracer.emit(graph.MoeCombineOp(y.value, weights.value, _typed(y, (g, s, y.shape[3]))))


# ----------------------------------------------------------------------------- elementwise


def _unary(cls, x, op: str, **kwargs) -> Tensor:
    x = _tensor(x, op)
    _float(x, op)
    return x.tracer.emit(cls(x.value, **kwargs))


def binary_cross_entropy_with_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Return the mean over all elements of `-(y log sigmoid(z) + (1 - y) log(1 - sigmoid(z)))`.

    One `graph.binary_cross_entropy` op per element, `max(z, 0) - z y + log(1 + exp(-|z|))` (as
    torch's `binary_cross_entropy_with_logits`), which neither overflows nor loses the small
    losses of confident logits, then the mean; `labels` are floats in [0, 1] of the logits' shape.
    """
    logits, labels = _tensor(logits, "binary_cross_entropy_with_logits"), _tensor(labels, "binary_cross_entropy_with_logits")
    if logits.shape != labels.shape:
        raise fail("binary_cross_entropy_with_logits",
                   f"logits {list(logits.shape)} and labels {list(labels.shape)} need the same shape")
    _float(logits, "binary_cross_entropy_with_logits")
    _float(labels, "binary_cross_entropy_with_logits")
    per = logits.tracer.emit(graph.BinaryCrossEntropyOp(logits.value, labels.value))
    return per.mean()


# Like autocast: with float16/bfloat16 inputs, these ops compute in float32 and give back the
# input's dtype (cross-entropy gives float32): their sums and exponentials need the range.
REDUCED_PRECISION = ("float16", "bfloat16")


# ----------------------------------------------------------------------------- normalisation


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Return `exp(x) / sum(exp(x))` along `dim` (computed stably)."""
    x = _tensor(x, "softmax")
    _float(x, "softmax")
    if x.dtype in REDUCED_PRECISION:
        return cast(softmax(cast(x, "float32"), dim), x.dtype)
    return x.tracer.emit(graph.SoftmaxOp(x.value, _dim(x, dim, "softmax")))


def _vector(x: Tensor, v, op: str, what: str, fill: float) -> Tensor:
    """Return `v` as a [n] tensor for x [..., n] (None: a constant `fill`)."""
    n = x.shape[-1]
    if v is None:
        return x.tracer.constant(fill, (n,), x.dtype)
    v = _tensor(v, op)
    if v.shape != (n,):
        raise fail(op, f"{what} must have shape [{n}] for x of shape {list(x.shape)}, got {list(v.shape)}")
    if v.dtype != x.dtype:
        raise fail(op, f"{what} has dtype {v.dtype}, x has {x.dtype}")
    return v


def layer_norm(x: Tensor, weight=None, bias=None, eps: float = 1e-5) -> Tensor:
    """Return `(x - mean) / sqrt(var + eps) * weight + bias` over the last dim (biased var)."""
    x = _tensor(x, "layer_norm")
    _float(x, "layer_norm")
    if x.ndim < 1:
        raise fail("layer_norm", "needs x [..., n]")
    if x.dtype in REDUCED_PRECISION:
        up = [None if v is None else cast(_tensor(v, "layer_norm"), "float32") for v in (weight, bias)]
        return cast(layer_norm(cast(x, "float32"), up[0], up[1], eps), x.dtype)
    w = _vector(x, weight, "layer_norm", "weight", 1.0)
    b = _vector(x, bias, "layer_norm", "bias", 0.0)
    return x.tracer.emit(graph.LayerNormOp(x.value, w.value, b.value, float(eps)))


def rms_norm(x: Tensor, weight=None, eps: float = 1e-6) -> Tensor:
    """Return `x * rsqrt(mean(x^2) + eps) * weight` over the last dim (LLaMA's RMSNorm)."""
    x = _tensor(x, "rms_norm")
    _float(x, "rms_norm")
    if x.ndim < 1:
        raise fail("rms_norm", "needs x [..., n]")
    if x.dtype in REDUCED_PRECISION:
        up = None if weight is None else cast(_tensor(weight, "rms_norm"), "float32")
        return cast(rms_norm(cast(x, "float32"), up, eps), x.dtype)
    w = _vector(x, weight, "rms_norm", "weight", 1.0)
    return x.tracer.emit(graph.RmsNormOp(x.value, w.value, float(eps)))


# ----------------------------------------------------------------------------- indexing


def embedding(table: Tensor, ids: Tensor) -> Tensor:
    """Return `table[ids]`: table [V, D] float, integer ids [...] -> [..., D]."""
    table, ids = _tensor(table, "embedding"), _tensor(ids, "embedding")
    if table.ndim != 2:
        raise fail("embedding", f"the table must be [V, D], got {list(table.shape)}")
    if not ids.dtype.startswith("int"):
        raise fail("embedding", f"ids must be integers, got {ids.dtype}")
    _float(table, "embedding")
    return table.tracer.emit(graph.EmbeddingOp(table.value, ids.value, _typed(table, (*ids.shape, table.shape[1]))))


def causal_mask(scores: Tensor) -> Tensor:
    """Return scores [..., Tq, Tk] with entries whose key index j > query index i set to -inf."""
    scores = _tensor(scores, "causal_mask")
    if scores.ndim < 2:
        raise fail("causal_mask", f"needs scores [..., Tq, Tk], got {list(scores.shape)}")
    _float(scores, "causal_mask")
    return scores.tracer.emit(graph.CausalMaskOp(scores.value))


def slice(x: Tensor, dim: int, start: int, stop: int) -> Tensor:  # noqa: A001 - hs.slice, as documented
    """Return `x[..., start:stop, ...]` along `dim` (0 <= start < stop <= size; no steps)."""
    x = _tensor(x, "slice")
    d = _dim(x, dim, "slice")
    if not 0 <= start < stop <= x.shape[d]:
        raise fail("slice", f"[{start}:{stop}] is not a non-empty range of dim {d} (size {x.shape[d]})")
    if (start, stop) == (0, x.shape[d]):
        return x
    shape = list(x.shape)
    shape[d] = stop - start
    return x.tracer.emit(graph.SliceOp(x.value, d, start, _typed(x, shape)))


def split(x: Tensor, sizes: Sequence[int], dim: int = 0) -> list[Tensor]:
    """Return consecutive pieces of `x` along `dim` with the given sizes (they sum to its size)."""
    x = _tensor(x, "split")
    d = _dim(x, dim, "split")
    sizes = [int(s) for s in sizes]
    if not sizes or any(s < 1 for s in sizes) or sum(sizes) != x.shape[d]:
        raise fail("split", f"sizes {sizes} do not add up to dim {d} of {list(x.shape)}")
    types = []
    for s in sizes:
        shape = list(x.shape)
        shape[d] = s
        types.append(_typed(x, shape))
    op = graph.SplitOp(x.value, d, types)
    x.tracer.emit_void(op)
    return [Tensor(r, x.tracer) for r in op.results]


def concat(xs: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Return the tensors joined along `dim` (same shapes and dtypes elsewhere)."""
    xs = [_tensor(x, "concat") for x in xs]
    if not xs:
        raise fail("concat", "needs at least one tensor")
    first = xs[0]
    d = _dim(first, dim, "concat")
    for x in xs[1:]:
        same = x.ndim == first.ndim and all(a == b for i, (a, b) in enumerate(zip(x.shape, first.shape)) if i != d)
        if not same or x.dtype != first.dtype:
            raise fail("concat", f"cannot join {[list(t.shape) for t in xs]} ({', '.join(t.dtype for t in xs)}) "
                                 f"along dim {d}")
    if len(xs) == 1:
        return first
    shape = list(first.shape)
    shape[d] = sum(x.shape[d] for x in xs)
    return first.tracer.emit(graph.ConcatOp([x.value for x in xs], d, _typed(first, shape)))


# ----------------------------------------------------------------------------- reductions


def max(x: Tensor, dims: int | Sequence[int] | None = None) -> Tensor:  # noqa: A001 - hs.max, like x.max
    """Return the maximum over `dims` (all dims if None). Its gradient goes to the positions
    holding the maximum, split evenly between ties."""
    x = _tensor(x, "max")
    _float(x, "max")
    if dims is None:
        dims = list(range(x.ndim))
    dims = [dims] if isinstance(dims, int) else list(dims)
    norm = sorted({_dim(x, d, "max") for d in dims})
    shape = [s for i, s in enumerate(x.shape) if i not in norm]
    return x.tracer.emit(graph.ReduceMaxOp(x.value, norm, _typed(x, shape)))


# ----------------------------------------------------------------------------- positions, randomness


def rope(x: Tensor, base: float = 10000.0) -> Tensor:
    """Return the rotary position embedding of x [B, T, H, Dh] (HuggingFace LLaMA convention:
    `x * cos + rotate_half(x) * sin`, `inv_freq = base ** (-arange(0, Dh, 2) / Dh)`)."""
    x = _tensor(x, "rope")
    _float(x, "rope")
    if x.ndim < 3 or x.shape[-1] % 2:
        raise fail("rope", f"needs x [B, T, H, Dh] with Dh even, got {list(x.shape)}")
    return x.tracer.emit(graph.RopeOp(x.value, float(base)))


STEP_INPUT = "step"


def step_tensor(tracer: Tracer) -> Tensor:
    """Return the scalar int64 input "step" of the training step (made on first use).

    The runtime must feed it each step (the batch needs a "step" entry). A tracer that is not
    the step's (a function module's) may provide `rng_counter()`, a scalar int64 tensor of its
    own function, to stand for it.
    """
    hook = getattr(tracer, "rng_counter", None)
    if callable(hook):
        return hook()
    if tracer.block.args:  # a function body: no graph.input can live here
        raise fail("dropout", "dropout inside a function module needs the step passed in; not supported yet")
    for op in tracer.block.ops:
        if isinstance(op, graph.InputOp) and op.tensor_name.data == STEP_INPUT:
            if op.result.type != TensorType(element_type("int64"), ()):
                raise fail("dropout", f"the input '{STEP_INPUT}' must be a scalar int64")
            return Tensor(op.result, tracer)
    return tracer.input(STEP_INPUT, (), "int64")


def dropout(x: Tensor, rate: float, seed: int = 0) -> Tensor:
    """Return `x * keep / (1 - rate)` with a random keep mask of probability `1 - rate`.

    The mask is a counter-based hash of (seed, a per-op salt, the scalar int64 input "step",
    the element's global index), so it is the same however x is sharded, differs from step
    to step, and the backward pass reuses it. `rate = 0` returns x itself.
    """
    x = _tensor(x, "dropout")
    _float(x, "dropout")
    if not 0.0 <= rate < 1.0:
        raise fail("dropout", f"rate must be in [0, 1), got {rate}")
    if rate == 0.0:
        return x
    step = step_tensor(x.tracer)
    salt = sum(1 for op in x.tracer.block.ops if isinstance(op, graph.DropoutOp))
    return x.tracer.emit(graph.DropoutOp(x.value, step.value, float(rate), int(seed), salt))


# ----------------------------------------------------------------------------- losses


def cross_entropy(logits: Tensor, labels: Tensor, ignore_index: int | None = None) -> Tensor:
    """Return the mean softmax cross-entropy of `logits` [..., C] against integer `labels` [...].

    With `ignore_index`, samples labelled so are left out: the mean is over the others (their
    count is computed at run time, so it stays right when the batch is split).
    """
    logits, labels = _tensor(logits, "cross_entropy"), _tensor(labels, "cross_entropy")
    if logits.ndim < 1 or labels.shape != logits.shape[:-1]:
        raise fail("cross_entropy", f"needs logits [..., C] and labels [...], got {list(logits.shape)} "
                                    f"and {list(labels.shape)}")
    if not labels.dtype.startswith("int"):
        raise fail("cross_entropy", f"labels must be integers, got {labels.dtype}")
    _float(logits, "cross_entropy")
    if logits.dtype in REDUCED_PRECISION:
        logits = cast(logits, "float32")
    ignore = None if ignore_index is None else int(ignore_index)
    per_sample = logits.tracer.emit(
        graph.SoftmaxCrossEntropyOp(logits.value, labels.value, _typed(logits, labels.shape), ignore)
    )
    if ignore is None:
        return per_sample.mean()
    mask = logits.tracer.emit(graph.LabelMaskOp(labels.value, ignore, _typed(logits, labels.shape)))
    return divide(per_sample.sum(), mask.sum())


def frontend_functions() -> dict[str, Callable]:
    """Return every function that an op names in its `FRONTEND`, by name (the functions stand
    beside their ops, in the ops' modules; the methods of `Tensor` and `Tracer` aside)."""
    functions: dict[str, Callable] = {}
    for op in (op for dialect in hspmd_dialects() for op in dialect.operations):
        for name in frontend_names(op):
            if "." not in name:  # `Tensor.__add__`, `Tracer.parameter`: methods of the tracing classes
                functions[name] = getattr(sys.modules[op.__module__], name)
    return functions


globals().update(frontend_functions())


def _install_operators(cls: type) -> None:
    """Give `Tensor` the operators and methods that are ops of this module (`/`, `**`, `@`,
    `x.max`): `tracing` defines the tensor and the operators it emits itself, this module the ops
    built on them, so neither module imports the other's functions back."""
    cls.__truediv__ = lambda self, other: divide(self, other)
    cls.__rtruediv__ = lambda self, other: divide(other, self)
    cls.__pow__ = lambda self, exponent: power(self, exponent)
    cls.__matmul__ = lambda self, other: matmul(self, self._lift(other, "matmul"))
    cls.__rmatmul__ = lambda self, other: matmul(self._lift(other, "matmul"), self)
    cls.max = lambda self, dims=None: max(self, dims)


_install_operators(Tensor)
