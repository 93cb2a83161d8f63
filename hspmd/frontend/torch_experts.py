"""transformers' expert layers as hspmd's mixture-of-experts ops: routing, dispatch, experts, combine.

transformers writes a mixture-of-experts layer as a router (a linear layer, softmax or sigmoid,
`topk`: plain ops, which the importer translates as they are) and an experts module holding
every expert's weights as 3-d tensors (`gate_up_proj [E, 2F, D]`, `down_proj [E, D, F]`, the
classes made with `@use_experts_implementation`), called with the tokens, each token's chosen
experts and their weights. Its own implementations loop over experts with data-dependent
shapes (`nonzero`) or grouped products, which a static program cannot hold.

While the importer exports a model, `experts_as_moe_ops` gives each such module a forward
written with four operators of the `hspmd` library (`torch.ops.hspmd.*`), which the importer
translates one for one into the graph ops of `docs/moe.md`:

```
choice = one_hot(top_k_index, E).sum(1)          [G, S, E]  0/1, no gradient
mask   = moe_route(choice, k, C=S)               [G, S, E, C]   every choice kept: dropless
slots  = moe_dispatch(tokens [G, S, D], mask)    [E, G, C, D]
h      = expert_matmul(slots, w1) ...            the module's own gate and activation
out    = expert_matmul(h, w2)                    [E, G*C, D]
y      = moe_combine(out, mask * weights)        [G, S, D]
```

Each routing group G is one sequence of the batch (its rows `S` tokens); the capacity C = S
holds every token, so no choice is dropped and the layer computes what transformers computes
(the empty slots hold zeros, which the combine weighs by zero). Under `ep=` the expert weights
split along E and the tokens move by all-to-all, as for `hs.nn.MoE`.

The router's `topk` breaks ties by the lower expert; PyTorch's order of ties is unspecified, so
a router that ties (a weight of zero, as AFMoE's starts) can route to other experts than
PyTorch does (`docs/torch-import.md`).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator

import numpy as np

from hspmd.dialects.graph.moe import expert_matmul, moe_combine, moe_dispatch, moe_route, moe_route_values
from hspmd.frontend.aten import Context
from hspmd.frontend.aten_math import cast_to

#: the library of hspmd's operators in PyTorch
LIBRARY = "hspmd"


def _define_ops() -> None:
    """Define `torch.ops.hspmd.{moe_route, moe_dispatch, expert_matmul, moe_combine}` once, with
    PyTorch implementations of what the graph ops compute (the export needs only their shapes)."""
    import torch

    if hasattr(torch.ops, LIBRARY) and hasattr(getattr(torch.ops, LIBRARY), "moe_dispatch"):
        return

    @torch.library.custom_op(f"{LIBRARY}::moe_route", mutates_args=(),
                             schema="(Tensor probs, int top_k, int capacity) -> Tensor")
    def route(probs, top_k, capacity):
        out = moe_route_values(probs.detach().double().numpy(), top_k, capacity)
        return torch.from_numpy(np.ascontiguousarray(out)).to(probs.dtype)

    @route.register_fake
    def _(probs, top_k, capacity):
        return probs.new_empty((*probs.shape, capacity))

    @torch.library.custom_op(f"{LIBRARY}::moe_dispatch", mutates_args=(), schema="(Tensor x, Tensor mask) -> Tensor")
    def dispatch(x, mask):
        return torch.einsum("gsec,gsd->egcd", mask, x).contiguous()

    @dispatch.register_fake
    def _(x, mask):
        g, s, e, c = mask.shape
        return x.new_empty((e, g, c, x.shape[-1]))

    @torch.library.custom_op(f"{LIBRARY}::expert_matmul", mutates_args=(), schema="(Tensor x, Tensor w) -> Tensor")
    def experts(x, w):
        return torch.bmm(x, w)

    @experts.register_fake
    def _(x, w):
        return x.new_empty((x.shape[0], x.shape[1], w.shape[2]))

    @torch.library.custom_op(f"{LIBRARY}::moe_combine", mutates_args=(), schema="(Tensor y, Tensor weights) -> Tensor")
    def combine(y, weights):
        return torch.einsum("egcd,gsec->gsd", y, weights).contiguous()

    @combine.register_fake
    def _(y, weights):
        return y.new_empty((weights.shape[0], weights.shape[1], y.shape[-1]))


def is_experts_module(module) -> bool:
    """Return whether `module` is a transformers experts module (`@use_experts_implementation`)."""
    return all(hasattr(module, a) for a in ("has_gate", "is_transposed", "down_proj", "num_experts")) and \
        getattr(module, "down_proj", None) is not None and getattr(module.down_proj, "ndim", 0) == 3


def _forward(groups: int) -> Callable:
    """Return an experts module's forward through hspmd's operators, with `groups` routing groups."""
    import torch

    ops = getattr(torch.ops, LIBRARY)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        d = hidden_states.shape[-1]
        tokens = hidden_states.reshape(-1, d)
        n, e, k = tokens.shape[0], self.num_experts, top_k_index.shape[-1]
        g = groups if n % groups == 0 else 1
        s = n // g
        picked = torch.nn.functional.one_hot(top_k_index.reshape(n, k), e).to(tokens.dtype)  # [N, k, E]
        choice = picked.sum(1).reshape(g, s, e)
        weight = (picked * top_k_weights.reshape(n, k, 1).to(tokens.dtype)).sum(1).reshape(g, s, e, 1)
        mask = ops.moe_route(choice, k, s)  # C = S: every choice has a slot
        slots = ops.moe_dispatch(tokens.reshape(g, s, d), mask).reshape(e, g * s, d)
        up = self.gate_up_proj if self.has_gate else self.up_proj
        h = ops.expert_matmul(slots, up if self.is_transposed else up.transpose(1, 2))
        if self.has_bias:
            h = h + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[:, None, :]
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        out = ops.expert_matmul(h, self.down_proj if self.is_transposed else self.down_proj.transpose(1, 2))
        if self.has_bias:
            out = out + self.down_proj_bias[:, None, :]
        if getattr(self, "has_post_expert_norm", False):
            out = self.post_expert_norm(out)
        y = ops.moe_combine(out.reshape(e, g, s, d), mask * weight)
        return y.reshape(n, d).to(hidden_states.dtype)

    return forward


@contextlib.contextmanager
def experts_as_moe_ops(module, groups: int) -> Iterator[int]:
    """Within the block, every experts module of `module` computes through hspmd's operators
    (`groups` routing groups: the batch's sequences); yields how many it found."""
    found = [m for m in module.modules() if is_experts_module(m)]
    if found:
        _define_ops()
    forward = _forward(max(int(groups), 1))
    for m in found:
        m.forward = types.MethodType(forward, m)
    try:
        yield len(found)
    finally:
        for m in found:
            m.__dict__.pop("forward", None)


# ----------------------------------------------------------------------------- the importer's translators


def _route(cx: Context, probs, top_k, capacity):
    return moe_route(cast_to(probs, "float32") if probs.dtype != "float32" else probs, int(top_k), int(capacity))


def _dispatch(cx: Context, x, mask):
    return moe_dispatch(x, cast_to(mask, x.dtype))


def _experts(cx: Context, x, w):
    return expert_matmul(x, cx.tensor(w))


def _combine(cx: Context, y, weights):
    return moe_combine(y, cast_to(weights, y.dtype))


#: operator name -> translator (the graph ops of `dialects/graph/moe.py`)
TRANSLATORS: dict[str, Callable] = {
    f"{LIBRARY}.moe_route.default": _route,
    f"{LIBRARY}.moe_dispatch.default": _dispatch,
    f"{LIBRARY}.expert_matmul.default": _experts,
    f"{LIBRARY}.moe_combine.default": _combine,
}
