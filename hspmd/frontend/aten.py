"""ATen ops as hspmd ops: one translator per ATen op of `torch.export`'s graph (`torch_import`).

A translator gets the importer's context and the node's arguments, in which every value the
graph computes is either an `hs.Tensor` of the trace (it depends on the batch or on a
parameter) or a concrete PyTorch value (a tensor made from buffers and constants alone, a
number, a list), and returns the node's value. Nodes whose arguments are all concrete never
reach a translator: the importer evaluates them with PyTorch (a rotary table, a causal mask,
position ids), and a concrete tensor enters the program, where a translated op needs it, as
`graph.constant` (a splat) or `graph.literal`.

Which hspmd op answers to an ATen op is a fact of the op (`ATEN` on its class,
`hspmd/dialects/interfaces.py`); `TRANSLATORS` here says how the arguments map, and
`tests/test_torch_import.py` checks that the two agree. `IDENTITY` lists the ATen ops that are
no op in a program of values (copies, aliases, layout changes in memory, metadata asserts).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence

import numpy as np

from hspmd.dialects import graph
from hspmd.dialects.graph.arithmetic import cast, divide, power
from hspmd.dialects.graph.activations import erf, exp, gelu, log, relu, rsqrt, sigmoid, silu, sqrt, tanh
from hspmd.dialects.graph.embedding import embedding
from hspmd.dialects.graph.losses import cross_entropy
from hspmd.dialects.graph.matmul import matmul
from hspmd.dialects.graph.norms import layer_norm, rms_norm
from hspmd.dialects.graph.positions import dropout
from hspmd.dialects.graph.reductions import max as reduce_max
from hspmd.dialects.graph.shape import concat, slice as take, split
from hspmd.dialects.graph.softmax import causal_mask, softmax
from hspmd.dialects.traced import FLOAT_DTYPES
from hspmd.frontend.tracing import Tensor
from hspmd.ir.types import element_type

#: ATen ops that change nothing a program of values sees (the importer passes their input on)
IDENTITY = frozenset({
    "aten.alias.default", "aten.clone.default", "aten.contiguous.default",
    "aten.lift_fresh_copy.default", "aten.to.device",
})
#: ATen ops that check metadata only and make no value
ASSERTS = frozenset({"aten._assert_tensor_metadata.default", "aten._assert_scalar.default",
                     "aten.sym_constrain_range_for_size.default", "aten._assert_async.msg",
                     "aten._assert_async.default", "aten._functional_assert_async.msg"})


class Unsupported(Exception):
    """The node's op, or its arguments, are out of the importer's reach (the message says why)."""


class Context:
    """What a translator may use: the trace, the node's expected result (shape, dtype) and
    the way concrete values enter the program."""

    def __init__(self, tracer, lift: Callable, meta) -> None:
        self.tracer = tracer
        self.lift = lift  # (concrete tensor, dtype or None) -> Tensor
        self.meta = meta  # the node's FakeTensor (or a tuple of them), or None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.meta.shape)

    @property
    def dtype(self) -> str:
        return str(self.meta.dtype).replace("torch.", "")

    def tensor(self, x, dtype: str | None = None) -> Tensor:
        """Return `x` as a tensor of the trace (a concrete tensor or number is lifted)."""
        if isinstance(x, Tensor):
            return x
        return self.lift(x, dtype)


def _dims(d, ndim: int) -> list[int]:
    d = [d] if isinstance(d, int) else list(d)
    return sorted(x % ndim for x in d)


def cast_to(x: Tensor, dtype: str) -> Tensor:
    """Return tensor `x` in `dtype` (`graph.cast` where it differs)."""
    if x.dtype == dtype:
        return x
    from xdsl.dialects.builtin import TensorType

    return x.tracer.emit(graph.CastOp(x.value, TensorType(element_type(dtype), x.shape)))


def _as_operand(cx: Context, x, dtype: str):
    """A binary op's operand: a tensor (in the result's dtype, as PyTorch promotes it), a Python
    number (the op lifts it), a concrete tensor in the result's dtype."""
    if isinstance(x, Tensor):
        if x.dtype != dtype and dtype != "bool":
            return cast_to(x, dtype)
        return x
    if isinstance(x, (int, float)):
        return cx.tracer.constant(float(x), (), dtype) if dtype.startswith("int") else x
    if getattr(x, "ndim", None) == 0:
        return float(x.item())
    return cx.lift(x, dtype)


def _binary(fn: Callable) -> Callable:
    def translate(cx: Context, a, b, alpha=1):
        a, b = _as_operand(cx, a, cx.dtype), _as_operand(cx, b, cx.dtype)
        if alpha != 1:
            b = b * float(alpha)
        out = fn(a, b)
        return out if isinstance(out, Tensor) else cx.tensor(out, cx.dtype)
    return translate


def _add(a, b):
    return a + b if isinstance(a, Tensor) else b + a


def _sub(a, b):
    return a - b if isinstance(a, Tensor) else (b * -1.0) + a


def _mul(a, b):
    return a * b if isinstance(a, Tensor) else b * a


def _div(a, b):
    if isinstance(b, (int, float)):
        return a * (1.0 / b)
    return divide(a, b)


def rsub(cx: Context, a, b, alpha=1):
    """`b - alpha * a`."""
    return _binary(_sub)(cx, b, a * float(alpha) if alpha != 1 else a)


def neg(cx: Context, x):
    return x * -1.0


def pow_scalar(cx: Context, x, p):
    return x * x if p == 2 else power(x, float(p))


def reduce_sum(cx: Context, x, dims=None, keepdim=False, dtype=None):
    dims = list(range(x.ndim)) if dims is None or dims == [] else _dims(dims, x.ndim)
    return x.sum(dims).reshape(cx.shape)


def reduce_sum_all(cx: Context, x, dtype=None):
    return x.sum()


def mean(cx: Context, x, dims=None, keepdim=False, dtype=None):
    dims = list(range(x.ndim)) if dims is None or dims == [] else _dims(dims, x.ndim)
    return x.mean(dims).reshape(cx.shape)


def mean_all(cx: Context, x, dtype=None):
    return x.mean()


def amax(cx: Context, x, dims=(), keepdim=False):
    dims = list(range(x.ndim)) if not dims else _dims(dims, x.ndim)
    return reduce_max(x, dims).reshape(cx.shape)


def reshape(cx: Context, x, *args):
    return x.reshape(cx.shape)


def permute(cx: Context, x, perm):
    return x.transpose([p % x.ndim for p in perm])


def transpose(cx: Context, x, d0, d1):
    perm = list(range(x.ndim))
    d0, d1 = d0 % x.ndim, d1 % x.ndim
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return x.transpose(perm) if d0 != d1 else x


def t(cx: Context, x):
    return x.T if x.ndim == 2 else x


def expand(cx: Context, x, sizes, implicit=False):
    return x.broadcast_to(cx.shape)


def _dropout(cx: Context, x, p, train=True):
    return dropout(x, float(p)) if train and p > 0 else x


def linear(cx: Context, x, w, b=None):
    """`x @ w.T + b` (PyTorch keeps a linear layer's weight as [out, in])."""
    y = _matmul(x, cx.tensor(w).T)
    return y + cx.tensor(b) if b is not None else y


def addmm(cx: Context, b, x, w, beta=1, alpha=1):
    """`beta * b + alpha * (x @ w)`."""
    y = _matmul(x, cx.tensor(w))
    if alpha != 1:
        y = y * float(alpha)
    bias = cx.tensor(b)
    return y + (bias * float(beta) if beta != 1 else bias)


def _matmul(a: Tensor, b: Tensor) -> Tensor:
    """`a @ b` with NumPy's broadcasting of the batch dims and 1-d operands."""
    squeeze = []
    if a.ndim == 1:
        a, squeeze = a.reshape((1, a.shape[0])), [-2]
    if b.ndim == 1:
        b, squeeze = b.reshape((b.shape[0], 1)), squeeze + [-1]
    if b.ndim > 2 and a.shape[:-2] != b.shape[:-2]:
        batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
        a = a.broadcast_to((*batch, *a.shape[-2:]))
        b = b.broadcast_to((*batch, *b.shape[-2:]))
    y = matmul(a, b)
    if squeeze:
        shape = list(y.shape)
        for d in sorted((d % len(shape) for d in squeeze), reverse=True):
            del shape[d]
        y = y.reshape(shape)
    return y


def mm(cx: Context, a, b):
    return _matmul(cx.tensor(a), cx.tensor(b))


def _embedding(cx: Context, weight, ids, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """`weight[ids]`; a `padding_idx` row gets no gradient, as in PyTorch: its lookups are taken
    without their gradient (`select(ids != padding_idx, y, stop_gradient(y))`: the values are the
    row's, zero or not)."""
    from hspmd.dialects.graph import elementary as el
    from hspmd.dialects.graph.shape import stop_gradient

    weight, ids = cx.tensor(weight), cx.tensor(ids, "int64")
    y = embedding(weight, ids)
    if padding_idx is None or padding_idx < 0:
        return y
    keep = ids.tracer.emit(graph.LabelMaskOp(ids.value, int(padding_idx), _typed(weight, ids.shape)))
    return el.where(keep.reshape((*ids.shape, 1)).broadcast_to(y.shape), y, stop_gradient(y))


def _typed(like: Tensor, shape: Sequence[int]):
    from xdsl.dialects.builtin import TensorType

    return TensorType(like.value.type.element_type, list(shape))


def _layer_norm(cx: Context, x, shape, weight=None, bias=None, eps=1e-5, cudnn=True):
    if len(shape) != 1:
        raise Unsupported(f"layer_norm over the last {len(shape)} dims (hspmd normalises the last dim)")
    return layer_norm(x, cx.tensor(weight) if weight is not None else None,
                      cx.tensor(bias) if bias is not None else None, float(eps))


def _rms_norm(cx: Context, x, shape, weight=None, eps=None):
    if len(shape) != 1:
        raise Unsupported(f"rms_norm over the last {len(shape)} dims (hspmd normalises the last dim)")
    eps = float(np.finfo(np.float32).eps) if eps is None else float(eps)
    return rms_norm(x, cx.tensor(weight) if weight is not None else None, eps)


def _softmax(cx: Context, x, dim, half_to_float=False):
    return softmax(x, dim)


def _log_softmax(cx: Context, x, dim, half_to_float=False):
    """`x - max - log(sum(exp(x - max)))` along `dim`."""
    dim = dim % x.ndim
    shifted = x - reduce_max(x, [dim]).reshape(_kept(x.shape, dim)).broadcast_to(x.shape)
    total = exp(shifted).sum([dim]).reshape(_kept(x.shape, dim))
    return shifted - log(total).broadcast_to(x.shape)


def _kept(shape, dim: int) -> tuple[int, ...]:
    return tuple(1 if i == dim else s for i, s in enumerate(shape))


def _gelu(cx: Context, x, approximate="none"):
    return gelu(x, approximate=approximate)


def unary(fn: Callable) -> Callable:
    return lambda cx, x: fn(x)


def slice_step1(cx: Context, x, dim: int, begin: int, stop: int):
    """`x[begin:stop]` along `dim` (strided slices: `aten_index.strided_slice`)."""
    if begin == 0 and stop == x.shape[dim]:
        return x
    return take(x, dim, begin, max(begin, stop))


def select(cx: Context, x, dim, index):
    dim = dim % x.ndim
    index = index % x.shape[dim]
    return take(x, dim, index, index + 1).reshape(cx.shape)


def _split(cx: Context, x, size, dim=0):
    dim = dim % x.ndim
    n = x.shape[dim]
    sizes = [min(size, n - i) for i in range(0, n, size)] if isinstance(size, int) else list(size)
    return list(split(x, sizes, dim)) if len(sizes) > 1 else [x]


def _cat(cx: Context, xs, dim=0):
    parts = [x for x in xs if isinstance(x, Tensor) or x.numel() > 0]
    if len(parts) == 1:
        return cx.tensor(parts[0], cx.dtype)
    parts = [cx.tensor(x, cx.dtype) for x in parts]
    return concat(parts, dim % parts[0].ndim)


def where(cx: Context, cond, a, b):
    """`where(cond, a, b)` with a concrete condition: `a * m + b * (1 - m)` where both are tensors,
    `a * m + literal(where(cond, 0, b))` where `b` is concrete (exact, -inf included, for finite a)."""
    if isinstance(cond, Tensor):
        raise Unsupported("where() with a condition computed from the batch or the parameters "
                          "(hspmd has no boolean tensors)")
    import torch

    cond = cond.broadcast_to(cx.shape)
    m = cx.lift(cond.to(torch.float32), cx.dtype)
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.broadcast_to(cx.shape) * m + b.broadcast_to(cx.shape) * (1.0 - m)
    if isinstance(a, Tensor):
        rest = torch.where(cond, torch.zeros((), dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32))
        return a.broadcast_to(cx.shape) * m + cx.lift(rest, cx.dtype)
    keep = cx.lift((~cond).to(torch.float32), cx.dtype)
    rest = torch.where(cond, torch.as_tensor(a, dtype=torch.float32), torch.zeros((), dtype=torch.float32))
    return b.broadcast_to(cx.shape) * keep + cx.lift(rest, cx.dtype)


def masked_fill(cx: Context, x, mask, value):
    return where(cx, mask, value.item() if hasattr(value, "item") else value, x)


def sdpa(cx: Context, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """`softmax(q @ k^T * scale + mask) @ v` (`F.scaled_dot_product_attention`).

    A concrete boolean mask that keeps everything is no mask; one that is the lower triangle
    (broadcast over the batch and heads) is `graph.causal_mask`, as `is_causal` is; any other
    concrete mask is added as a literal of 0 and -inf; a boolean mask computed from the batch
    drops scores as `_masked_attention` says, an additive float one is added.
    """
    import torch

    q, k, v = cx.tensor(q), cx.tensor(k), cx.tensor(v)
    (tq, e), s = q.shape[-2:], k.shape[-2]
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k, v = _repeat_heads(k, q.shape[-3]), _repeat_heads(v, q.shape[-3])
    scale = 1.0 / math.sqrt(e) if scale is None else float(scale)
    scores = _matmul(q, k.transpose([*range(k.ndim - 2), k.ndim - 1, k.ndim - 2])) * scale
    causal = bool(is_causal)
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        mask = attn_mask
        if mask.dtype == torch.bool:
            lower = torch.ones(tq, s, dtype=torch.bool).tril()
            if bool(mask.all()):
                mask = None
            elif mask.shape[-2:] == (tq, s) and torch.equal(mask, lower.expand(mask.shape)):
                causal, mask = True, None
            else:
                mask = torch.zeros(mask.shape, dtype=torch.float32).masked_fill(~mask, float("-inf"))
        if mask is not None:
            scores = scores + cx.lift(mask, scores.dtype).broadcast_to(scores.shape)
    elif is_bool(attn_mask):
        return _masked_attention(scores, attn_mask, v, dropout_p)
    elif attn_mask is not None:
        if attn_mask.dtype not in FLOAT_DTYPES:
            raise Unsupported(f"scaled_dot_product_attention with an {attn_mask.dtype} mask computed from the batch "
                              "(give a boolean one, or an additive float mask, 0 to keep and -inf to drop)")
        scores = scores + attn_mask.broadcast_to(scores.shape)
    if causal:
        scores = causal_mask(scores)
    att = softmax(scores, -1)
    if dropout_p:
        att = dropout(att, float(dropout_p))
    return _matmul(att, v)


def _masked_attention(scores: Tensor, mask: Tensor, v: Tensor, dropout_p: float) -> Tensor:
    """`softmax(scores where mask else -inf) @ v` for a boolean mask from the batch (0.0/1.0), in
    float32: a dropped score is lowered by float32's largest number, which softmax turns into 0
    exactly while a row keeps any; a row that keeps none gives 0, as PyTorch's attention does
    (its safe softmax), not NaN."""
    low = scores.dtype
    keep = mask.broadcast_to(scores.shape)
    s32 = cast(scores, "float32") if low != "float32" else scores
    bias = (keep + -1.0) * float(np.finfo(np.float32).max)
    att = softmax(s32 + bias, -1)
    any_kept = reduce_max(mask, [mask.ndim - 1]).reshape((*mask.shape[:-1], 1))
    att = att * any_kept.broadcast_to(scores.shape)
    if low != "float32":
        att = cast(att, low)
    if dropout_p:
        att = dropout(att, float(dropout_p))
    return _matmul(att, v)


def is_bool(x) -> bool:
    """Return whether `x` is a traced boolean: a float tensor of 0.0 and 1.0 standing for a bool
    tensor of the exported graph (the importer marks the values PyTorch types bool, `as_bool`)."""
    return isinstance(x, Tensor) and getattr(x, "boolean", False)


def as_bool(x: Tensor) -> Tensor:
    """Return `x` (0.0/1.0 floats) marked as a boolean."""
    x.boolean = True
    return x


def _repeat_heads(x: Tensor, heads: int) -> Tensor:
    """[..., Hkv, S, E] -> [..., H, S, E], each key/value head repeated H/Hkv times in a row."""
    *lead, hkv, s, e = x.shape
    y = x.reshape((*lead, hkv, 1, s, e)).broadcast_to((*lead, hkv, heads // hkv, s, e))
    return y.reshape((*lead, heads, s, e))


def _cross_entropy(cx: Context, logits, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    if weight is not None or label_smoothing:
        raise Unsupported("cross_entropy with class weights or label smoothing")
    if reduction != 1:
        raise Unsupported("cross_entropy with reduction other than 'mean'")
    logits, target = cx.tensor(logits), cx.tensor(target, "int64")
    if logits.ndim != target.ndim + 1 or logits.shape[:-1] != target.shape:
        raise Unsupported(f"cross_entropy of logits {list(logits.shape)} (the classes must be the last dim)")
    return cross_entropy(logits, target, ignore_index=int(ignore_index))


def getitem(cx: Context, xs, i):
    return xs[i]


#: ATen op name -> translator (the hspmd ops that answer to each say so in their `ATEN`)
TRANSLATORS: dict[str, Callable] = {
    "aten.add.Tensor": _binary(_add), "aten.add.Scalar": _binary(_add),
    "aten.sub.Tensor": _binary(_sub), "aten.sub.Scalar": _binary(_sub), "aten.rsub.Scalar": rsub,
    "aten.rsub.Tensor": rsub,
    "aten.mul.Tensor": _binary(_mul), "aten.mul.Scalar": _binary(_mul),
    "aten.div.Tensor": _binary(_div), "aten.div.Scalar": _binary(_div),
    "aten.neg.default": neg,
    "aten.pow.Tensor_Scalar": pow_scalar,
    "aten.relu.default": unary(relu), "aten.exp.default": unary(exp), "aten.log.default": unary(log),
    "aten.sqrt.default": unary(sqrt), "aten.rsqrt.default": unary(rsqrt), "aten.tanh.default": unary(tanh),
    "aten.sigmoid.default": unary(sigmoid), "aten.silu.default": unary(silu), "aten.erf.default": unary(erf),
    "aten.gelu.default": _gelu,
    "aten.linear.default": linear, "aten.addmm.default": addmm, "aten.mm.default": mm, "aten.bmm.default": mm,
    "aten.matmul.default": mm,
    "aten.view.default": reshape, "aten.reshape.default": reshape, "aten._unsafe_view.default": reshape,
    "aten.unsqueeze.default": reshape, "aten.squeeze.dim": reshape, "aten.squeeze.dims": reshape,
    "aten.squeeze.default": reshape, "aten.flatten.using_ints": reshape, "aten.unflatten.int": reshape,
    "aten.permute.default": permute, "aten.transpose.int": transpose, "aten.t.default": t,
    "aten.select.int": select,
    "aten.split.Tensor": _split, "aten.split_with_sizes.default": _split,
    "aten.cat.default": _cat,
    "aten.expand.default": expand,
    "aten.sum.dim_IntList": reduce_sum, "aten.sum.default": reduce_sum_all,
    "aten.mean.dim": mean, "aten.mean.default": mean_all,
    "aten.amax.default": amax,
    "aten.softmax.int": _softmax, "aten._softmax.default": _softmax,
    "aten.log_softmax.int": _log_softmax, "aten._log_softmax.default": _log_softmax,
    "aten.scaled_dot_product_attention.default": sdpa,
    "aten.layer_norm.default": _layer_norm, "aten.rms_norm.default": _rms_norm,
    "aten.embedding.default": _embedding,
    "aten.dropout.default": _dropout,
    "aten.cross_entropy_loss.default": _cross_entropy,
    "aten.where.self": where, "aten.masked_fill.Scalar": masked_fill,
    "operator.getitem": getitem,
}


def aten_name(target) -> str:
    """Return the name the tables use for an FX node's target (`aten.linear.default`)."""
    if target is operator.getitem:
        return "operator.getitem"
    return str(target)
