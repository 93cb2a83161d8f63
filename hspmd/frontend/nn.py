"""Neural-network modules written as for one device: parameters named by the module tree.

A `Module` holds `Parameter`s and sub-modules as attributes; `named_parameters()` gives
names such as `layers.0.weight`, which strategies and checkpoints use. During a trace each
parameter is bound to the `graph.parameter` value made for it (see `bind_parameters`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from hspmd.frontend.ops import relu
from hspmd.frontend.tracing import Tensor, Tracer, fail


class Parameter:
    """A trainable tensor: shape, dtype and initialiser text (`normal:0.02`, `zeros`, ...)."""

    def __init__(self, shape: Sequence[int], init: str = "zeros", dtype: str = "float32") -> None:
        self.shape = tuple(int(s) for s in shape)
        self.init = init
        self.dtype = dtype
        self._traced: Tensor | None = None

    def traced(self, op: str = "use") -> Tensor:
        """Return the tensor this parameter is bound to in the running trace."""
        if self._traced is None:
            raise fail(op, "a parameter was used outside a trace (call the model inside the loss function)")
        return self._traced

    def __repr__(self) -> str:
        return f"Parameter(shape={self.shape}, init={self.init!r})"

    # operators forward to the bound tensor, so modules can write `x @ self.weight`
    def __getattr__(self, item):
        if item.startswith("_"):
            raise AttributeError(item)
        return getattr(self.traced(item), item)

    def __matmul__(self, o):
        return self.traced("matmul") @ o

    def __rmatmul__(self, o):
        return o @ self.traced("matmul")

    def __add__(self, o):
        return self.traced("add") + o

    def __radd__(self, o):
        return o + self.traced("add")

    def __mul__(self, o):
        return self.traced("mul") * o

    def __rmul__(self, o):
        return o * self.traced("mul")


class Module:
    """Base class of models: attributes that are Parameters or Modules form the tree.

    A subclass that sets `function = True` is traced once into a function and called per
    use (see `hspmd.frontend.functions`): set it on repeated layers such as transformer blocks.
    """

    function = False

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """Yield (dotted name, parameter) in attribute definition order."""
        for key, value in vars(self).items():
            name = f"{prefix}{key}"
            if isinstance(value, Parameter):
                yield name, value
            elif isinstance(value, Module):
                yield from value.named_parameters(name + ".")
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    if isinstance(item, Module):
                        yield from item.named_parameters(f"{name}.{i}.")
                    elif isinstance(item, Parameter):
                        yield f"{name}.{i}", item

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def __call__(self, *args, **kwargs):
        if self.function and not kwargs and args and all(isinstance(a, Tensor) for a in args):
            from hspmd.frontend.functions import call_module

            return call_module(args[0].tracer, self, args)
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must define forward()")


@contextmanager
def bind_parameters(model: Module, tracer: Tracer, compute_dtype: str | None = None):
    """Within the block, every parameter of `model` stands for a `graph.parameter` value.

    With `compute_dtype` (float16 or bfloat16), floating parameters stay master weights in
    their own dtype and the model sees them cast to `compute_dtype`.
    """
    from hspmd.frontend.ops import cast

    params = list(model.named_parameters())
    try:
        for name, p in params:
            p._traced = tracer.parameter(name, p.shape, p.init, p.dtype)
            if compute_dtype and p.dtype.startswith("float") and p.dtype != compute_dtype:
                p._traced = cast(p._traced, compute_dtype)
        yield
    finally:
        for _, p in params:
            p._traced = None


class Linear(Module):
    """`y = x @ weight + bias` over the last dim, weight [in, out].

    Initialised uniform(±1/sqrt(in)) like PyTorch, or with `init` for the weight (then the
    bias starts at zero), e.g. `init="normal:0.02"` as GPT-2 does.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, init: str | None = None) -> None:
        bound = 1.0 / math.sqrt(in_features)
        default = f"uniform:{-bound!r}:{bound!r}"
        self.weight = Parameter((in_features, out_features), init or default)
        self.bias = Parameter((out_features,), "zeros" if init else default) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        y = x @ self.weight
        return y + self.bias.traced("add") if self.bias is not None else y


class ReLU(Module):
    """Elementwise `max(x, 0)`."""

    def forward(self, x: Tensor) -> Tensor:
        return relu(x)


class Sequential(Module):
    """Applies its modules in order; parameters are named `layers.I.NAME`."""

    def __init__(self, *layers: Module) -> None:
        self.layers = list(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Embedding(Module):
    """Rows of `weight` [num, dim] looked up by integer ids: [...] -> [..., dim]."""

    def __init__(self, num: int, dim: int, init: str = "normal:1.0") -> None:
        self.weight = Parameter((num, dim), init)

    def forward(self, ids: Tensor) -> Tensor:
        from hspmd.frontend.ops import embedding

        return embedding(self.weight.traced("embedding"), ids)


class LayerNorm(Module):
    """Normalises the last dim to zero mean and unit variance, then scales and shifts."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        self.weight = Parameter((dim,), "ones")
        self.bias = Parameter((dim,), "zeros")
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        from hspmd.frontend.ops import layer_norm

        return layer_norm(x, self.weight.traced("layer_norm"), self.bias.traced("layer_norm"), self.eps)


class RMSNorm(Module):
    """`x * rsqrt(mean(x^2, last dim) + eps) * weight`, as LLaMA normalises."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        self.weight = Parameter((dim,), "ones")
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        from hspmd.frontend.ops import rms_norm

        return rms_norm(x, self.weight.traced("rms_norm"), self.eps)



class MoE(Module):
    """A mixture-of-experts MLP on x [B, T, D] (Switch/GShard): a router, E expert MLPs, the combine.

    Every sequence is one routing group: a token goes to its `top_k` most probable experts
    (softmax of `x @ router`), each expert takes at most `capacity = ceil(top_k * T *
    capacity_factor / E)` tokens per sequence (later tokens are dropped: they contribute 0,
    so the residual around the layer carries them), and an expert's output is weighted by
    its router probability. Expert e is `gelu(x @ w1[e]) @ w2[e]` (tanh GELU, no biases).
    Routing per sequence makes the dropped tokens the same however the batch is split over
    devices, so expert parallelism (`ep=`) gives the numbers of one device.

    `forward` returns (y, aux): `aux` is the load-balancing loss, `E * mean over sequences of
    sum_e f_e * P_e`, f_e the fraction of the sequence's top_k * T choices kept at expert e
    and P_e its mean router probability (1.0 when routing is uniform); add it, scaled, to the
    training loss.
    """

    def __init__(self, d_model: int, d_ff: int, experts: int, top_k: int = 1, capacity_factor: float = 1.0,
                 init_std: float = 0.02, out_std: float | None = None) -> None:
        if experts < 1 or not 1 <= top_k <= experts or capacity_factor <= 0:
            raise ValueError(f"MoE needs experts >= 1, 1 <= top_k <= experts and capacity_factor > 0, "
                             f"got experts={experts}, top_k={top_k}, capacity_factor={capacity_factor}")
        self.experts = experts
        self.top_k = top_k
        self.capacity_factor = float(capacity_factor)
        self.router = Parameter((d_model, experts), f"normal:{init_std!r}")
        self.w1 = Parameter((experts, d_model, d_ff), f"normal:{init_std!r}")
        self.w2 = Parameter((experts, d_ff, d_model), f"normal:{(out_std or init_std)!r}")

    def capacity(self, tokens: int) -> int:
        """Return the slots each expert has per routing group of `tokens` tokens."""
        return max(1, math.ceil(self.top_k * tokens * self.capacity_factor / self.experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        from hspmd.dialects.graph import BroadcastOp
        from hspmd.frontend import ops

        b, t, d = x.shape
        e, c = self.experts, self.capacity(t)
        probs = ops.softmax(x @ self.router.traced("moe"), -1)  # [B, T, E]
        mask = ops.moe_route(probs, self.top_k, c)  # [B, T, E, C]
        spread = x.tracer.emit(BroadcastOp(probs.value, [0, 1, 2], mask.value.type))
        gates = mask * spread
        slots = ops.moe_dispatch(x, mask).reshape((e, b * c, d))
        hidden = ops.gelu(ops.expert_matmul(slots, self.w1.traced("moe")), approximate="tanh")
        out = ops.expert_matmul(hidden, self.w2.traced("moe")).reshape((e, b, c, d))
        y = ops.moe_combine(out, gates)
        kept = mask.sum([1, 3])  # [B, E] choices kept per expert
        mean_prob = probs.sum([1])  # [B, E], times T
        aux = (kept * mean_prob).sum([0, 1]) * (e / (b * t * t * self.top_k))
        return y, aux
