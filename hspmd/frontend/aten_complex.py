"""Complex values in the PyTorch importer: a complex tensor as a real one with a trailing dim of 2.

hspmd's IR has no complex dtype. A complex tensor of the exported graph, of shape S, is traced as
a real tensor of shape (*S, 2), its real part at [..., 0] and its imaginary part at [..., 1] (the
layout `torch.view_as_real` gives), in the dtype of its parts (complex64: float32, complex128:
float64); the `Tensor` carries `complex = True`. So `view_as_complex` and `view_as_real` pass the
value on, a view of a complex tensor is the same view of the pairs (its dims shifted by the
trailing 2), and arithmetic is real arithmetic on the two parts: gradients flow through the real
ops. Rotary embeddings written with complex exponentials (DeepSeek-V2:
`view_as_real(view_as_complex(x) * freqs_cis)`) import this way.

A node is complex where PyTorch types its value complex or one of its operands is; the importer
translates it with `TRANSLATORS` here, and stops with one line naming any other op on complex
values (`abs`, a Fourier transform, a product of complex matrices).
"""

from __future__ import annotations

from collections.abc import Callable

from hspmd.dialects.graph.elementary import cos, sin
from hspmd.dialects.graph.arithmetic import divide
from hspmd.dialects.graph.shape import concat, slice as take
from hspmd.frontend import aten, aten_index
from hspmd.frontend.aten import Context, Unsupported, cast_to
from hspmd.frontend.tracing import Tensor

#: a complex dtype -> the dtype of its parts
PART_DTYPES = {"complex32": "float16", "complex64": "float32", "complex128": "float64"}


def is_complex(x) -> bool:
    """Return whether `x` is a complex value: a traced one (`as_complex`), a concrete complex tensor
    or a Python complex number."""
    if isinstance(x, Tensor):
        return bool(getattr(x, "complex", False))
    if isinstance(x, complex):
        return True
    return bool(getattr(getattr(x, "dtype", None), "is_complex", False))


def as_complex(x: Tensor) -> Tensor:
    """Return a new traced value of `x`'s pairs (..., 2), marked complex."""
    if x.shape[-1:] != (2,):
        raise Unsupported(f"a complex value traced as {list(x.shape)} (its parts need a trailing dim of 2)")
    out = Tensor(x.value, x.tracer)
    out.complex = True
    return out


def involves(meta, args, kwargs) -> bool:
    """Return whether a node is complex: PyTorch types its value complex, or an operand is complex."""
    if _complex_meta(meta):
        return True
    return any(is_complex(x) for x in _flat((args, kwargs)))


def _flat(x):
    if isinstance(x, (list, tuple)):
        for v in x:
            yield from _flat(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _flat(v)
    else:
        yield x


def _complex_meta(meta) -> bool:
    return bool(getattr(getattr(meta, "dtype", None), "is_complex", False))


def traced_shape(meta) -> tuple[int, ...] | None:
    """Return the shape a node's value is traced with: PyTorch's, and (2,) more for a complex one."""
    if meta is None or not hasattr(meta, "shape"):
        return None
    shape = tuple(int(s) for s in meta.shape)
    return (*shape, 2) if _complex_meta(meta) else shape


def _part_dtype(cx: Context) -> str:
    want = PART_DTYPES.get(cx.dtype)
    if want is None:
        raise Unsupported(f"a {cx.dtype} value where a complex one is expected")
    return want


def _pairs_context(cx: Context) -> Context:
    """Return a context whose expected result is the pairs' real tensor (*S, 2) in the parts' dtype
    (a list of them for an op of several results)."""
    import torch

    def pairs_meta(m):
        if isinstance(m, (list, tuple)):
            return type(m)(pairs_meta(v) for v in m)
        part = PART_DTYPES[str(m.dtype).replace("torch.", "")]
        return torch.empty((*m.shape, 2), dtype=getattr(torch, part), device="meta")

    return Context(cx.tracer, cx.lift, pairs_meta(cx.meta))


def pairs(cx: Context, x, dtype: str) -> Tensor | float | complex:
    """Return complex operand `x` as traced pairs in `dtype` (a concrete complex tensor is lifted);
    a number stays a number."""
    if isinstance(x, (int, float, complex)):
        return x
    if isinstance(x, Tensor):
        if not is_complex(x):
            raise Unsupported("a real tensor where a complex one is expected")
        return as_complex(cast_to(x, dtype))
    import torch

    if not x.dtype.is_complex:
        raise Unsupported("a real tensor where a complex one is expected")
    return as_complex(cx.lift(torch.view_as_real(x.resolve_conj()), dtype))


def _parts(z: Tensor, shape) -> tuple[Tensor, Tensor]:
    """Return the real and imaginary parts of pairs `z` broadcast to complex shape `shape`, each (*shape, 1)."""
    z = z.broadcast_to((*shape, 2))
    last = len(shape)
    return take(z, last, 0, 1), take(z, last, 1, 2)


def _spread(x: Tensor, shape) -> Tensor:
    """Return real tensor `x` broadcast to complex shape `shape`, as (*shape, 1)."""
    return x.reshape((*x.shape, 1)).broadcast_to((*shape, 1))


def _join(cx: Context, re, im) -> Tensor:
    """The complex value of parts `re`, `im` (tensors (*S, 1) of the node's shape S, or numbers)."""
    dtype, shape = _part_dtype(cx), (*cx.shape, 1)
    re, im = (p.broadcast_to(shape) if isinstance(p, Tensor) else cx.tracer.constant(float(p), shape, dtype)
              for p in (re, im))
    return as_complex(concat([re, im], len(shape) - 1))


def _re_im(cx: Context, x) -> tuple:
    """Return operand `x` as (real part, imaginary part), each a tensor (*S, 1) or a number (a real
    operand's imaginary part is 0.0)."""
    dtype, shape = _part_dtype(cx), cx.shape
    if isinstance(x, (int, float, complex, bool)) or not isinstance(x, Tensor) and getattr(x, "ndim", None) == 0:
        z = complex(x.item() if hasattr(x, "item") else x)
        return z.real, z.imag
    if is_complex(x):
        return _parts(pairs(cx, x, dtype), shape)
    x = cast_to(x, dtype) if isinstance(x, Tensor) else cx.lift(x, dtype)
    return _spread(x, shape), 0.0


def _times(u, v):
    """`u * v` of parts (tensors or numbers); a part times the number 0 is the number 0."""
    if not isinstance(u, Tensor):
        u, v = v, u
    if not isinstance(u, Tensor):
        return u * v
    if isinstance(v, Tensor):
        return u * v
    return 0.0 if v == 0 else u if v == 1 else u * float(v)


def _plus(u, v):
    """`u + v` of parts (tensors or numbers)."""
    if not isinstance(u, Tensor):
        u, v = v, u
    if not isinstance(u, Tensor) or isinstance(v, Tensor):
        return u + v
    return u if v == 0 else u + float(v)


def _over(cx: Context, u, t: Tensor):
    """`u / t` of a part `u` (tensor or number) by a real tensor `t`."""
    if not isinstance(u, Tensor):
        if u == 0:
            return 0.0
        u = cx.tracer.constant(float(u), t.shape, t.dtype)
    return divide(u.broadcast_to(t.shape), t)


def _is_number(x) -> bool:
    return isinstance(x, (int, float, complex, bool))


# ----------------------------------------------------------------------------- arithmetic


def mul(cx: Context, a, b):
    """`a * b`: (ar br - ai bi, ar bi + ai br) on the parts."""
    (ar, ai), (br, bi) = _re_im(cx, a), _re_im(cx, b)
    return _join(cx, _plus(_times(ar, br), _times(_times(ai, bi), -1.0)), _plus(_times(ar, bi), _times(ai, br)))


def div(cx: Context, a, b):
    """`a / b`: `a * conj(b) / |b|^2` (a real divisor divides each part)."""
    if _is_number(b):
        return mul(cx, a, 1.0 / complex(b))
    (ar, ai), (br, bi) = _re_im(cx, a), _re_im(cx, b)
    if not isinstance(bi, Tensor):  # a real divisor
        return _join(cx, _over(cx, ar, br), _over(cx, ai, br))
    norm = br * br + bi * bi
    re = _plus(_times(ar, br), _times(ai, bi))
    im = _plus(_times(ai, br), _times(_times(ar, bi), -1.0))
    return _join(cx, _over(cx, re, norm), _over(cx, im, norm))


def _signed_sum(cx: Context, a, b, scale):
    """`a + scale * b`; a real operand adds to the real part only."""
    if isinstance(scale, complex):
        raise Unsupported("a complex alpha")
    (ar, ai), (br, bi) = _re_im(cx, a), _re_im(cx, b)
    return _join(cx, _plus(ar, _times(br, scale)), _plus(ai, _times(bi, scale)))


def add(cx: Context, a, b, alpha=1):
    return _signed_sum(cx, a, b, alpha)


def sub(cx: Context, a, b, alpha=1):
    return _signed_sum(cx, a, b, -alpha)


def rsub(cx: Context, a, b, alpha=1):
    """`b - alpha * a`."""
    return _signed_sum(cx, b, a, -alpha)


def neg(cx: Context, x):
    re, im = _re_im(cx, x)
    return _join(cx, _times(re, -1.0), _times(im, -1.0))


def conj(cx: Context, x):
    """The conjugate: the imaginary part negated."""
    re, im = _re_im(cx, x)
    return _join(cx, re, _times(im, -1.0))


def sum_dims(cx: Context, x, dims=None, keepdim=False, dtype=None):
    """A sum of complex values over `dims`: each part summed."""
    z = pairs(cx, x, _part_dtype(cx))
    n = z.ndim - 1
    dims = [dims] if isinstance(dims, int) else list(dims or range(n))
    dims = [d % n for d in dims]
    return as_complex(z.sum(sorted(dims)).reshape((*cx.shape, 2)))


# ----------------------------------------------------------------------------- making and taking apart


def view_as_complex(cx: Context, x):
    """Real pairs (..., 2) seen as complex: the same value, marked."""
    return as_complex(cast_to(x, _part_dtype(cx)))


def view_as_real(cx: Context, x):
    """Complex values seen as their pairs (..., 2): the same value, unmarked."""
    z = pairs(cx, x, cx.dtype)
    return Tensor(z.value, z.tracer)


def polar(cx: Context, magnitude, angle):
    """`magnitude * (cos(angle), sin(angle))`."""
    dtype = _part_dtype(cx)
    r, t = (_real_tensor(cx, v, dtype) for v in (magnitude, angle))
    r, t = _spread(r, cx.shape), _spread(t, cx.shape)
    return _join(cx, r * cos(t), r * sin(t))


def make_complex(cx: Context, real, imag):
    """`torch.complex(real, imag)`."""
    dtype = _part_dtype(cx)
    return _join(cx, *(_spread(_real_tensor(cx, v, dtype), cx.shape) for v in (real, imag)))


def _real_tensor(cx: Context, x, dtype: str) -> Tensor:
    if isinstance(x, Tensor):
        return cast_to(x, dtype)
    return cx.lift(x, dtype)


def to_dtype(cx: Context, x, *args, **kwargs):
    """A cast to the node's dtype: a complex one casts the parts (a real value gets imaginary part 0);
    a real one keeps the real part, as PyTorch does (it warns that it discards the imaginary part)."""
    if cx.dtype in PART_DTYPES:
        dtype = _part_dtype(cx)
        if is_complex(x):
            return pairs(cx, x, dtype)
        return _join(cx, _spread(cast_to(x, dtype), cx.shape), 0.0)
    re, _ = _parts(x, cx.shape)
    want = cx.dtype
    if want not in ("float16", "bfloat16", "float32", "float64"):
        raise Unsupported(f"a complex value cast to {want}")
    return cast_to(re.reshape(cx.shape), want)


# ----------------------------------------------------------------------------- views


def _on_pairs(translate: Callable, dims: tuple[int, ...] = ()) -> Callable:
    """A view of complex values: real `translate` on the pairs, the dim arguments at `dims`
    (positions after the tensor) taken modulo the complex rank, so they never reach the trailing 2."""

    def on_pairs(cx: Context, x, *args, **kwargs):
        z = pairs(cx, x, x.dtype)  # a view keeps the dtype
        n = z.ndim - 1
        args = list(args)
        for i in dims:
            if i < len(args) and isinstance(args[i], int):
                args[i] = args[i] % n
        if "dim" in kwargs and isinstance(kwargs["dim"], int):
            kwargs["dim"] = kwargs["dim"] % n
        out = translate(_pairs_context(cx), z, *args, **kwargs)
        if isinstance(out, (list, tuple)):
            return [as_complex(o) for o in out]
        if not isinstance(out, Tensor):  # an empty piece: concrete, as PyTorch has it
            import torch

            return torch.empty(cx.shape, dtype=getattr(torch, cx.dtype))
        return as_complex(out)

    on_pairs.__name__ = on_pairs.__qualname__ = f"pairs_{getattr(translate, '__name__', 'view')}"
    return on_pairs


def permute(cx: Context, x, perm):
    z = pairs(cx, x, _part_dtype(cx))
    n = z.ndim - 1
    return as_complex(z.transpose([p % n for p in perm] + [n]))


def t(cx: Context, x):
    z = pairs(cx, x, _part_dtype(cx))
    return as_complex(z.transpose([1, 0, 2])) if z.ndim == 3 else as_complex(z)


def cat(cx: Context, xs, dim=0):
    dtype = _part_dtype(cx)
    parts = [pairs(cx, x, dtype) for x in xs if isinstance(x, Tensor) or x.numel() > 0]
    if len(parts) == 1:
        return parts[0]
    return as_complex(concat(parts, dim % (parts[0].ndim - 1)))


_RESHAPE = _on_pairs(aten.reshape)

#: ATen op name -> translator, for nodes with complex values (`involves`)
TRANSLATORS: dict[str, Callable] = {
    "aten.view_as_complex.default": view_as_complex, "aten.view_as_real.default": view_as_real,
    "aten.polar.default": polar, "aten.complex.default": make_complex,
    "aten.mul.Tensor": mul, "aten.mul.Scalar": mul, "aten.div.Tensor": div, "aten.div.Scalar": div,
    "aten.add.Tensor": add, "aten.add.Scalar": add, "aten.sub.Tensor": sub, "aten.sub.Scalar": sub,
    "aten.rsub.Scalar": rsub, "aten.rsub.Tensor": rsub,
    "aten.neg.default": neg, "aten._conj.default": conj, "aten.conj_physical.default": conj,
    "aten._conj_physical.default": conj,
    "aten.sum.dim_IntList": sum_dims,
    "aten._to_copy.default": to_dtype, "aten.to.dtype": to_dtype, "aten.to.dtype_layout": to_dtype,
    "aten.type_as.default": to_dtype,
    **dict.fromkeys(("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
                     "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default",
                     "aten.flatten.using_ints", "aten.unflatten.int"), _RESHAPE),
    "aten.expand.default": _on_pairs(aten.expand),
    "aten.permute.default": permute, "aten.transpose.int": _on_pairs(aten.transpose, (0, 1)), "aten.t.default": t,
    "aten.select.int": _on_pairs(aten.select, (0,)),
    "aten.slice.Tensor": _on_pairs(aten_index.slice_any_step, (0,)),
    "aten.split.Tensor": _on_pairs(aten._split, (1,)), "aten.split_with_sizes.default": _on_pairs(aten._split, (1,)),
    "aten.cat.default": cat, "operator.getitem": aten.getitem,
}
