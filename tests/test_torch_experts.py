"""transformers' expert layers imported through hspmd's MoE ops (`hspmd/frontend/torch_experts.py`),
against PyTorch, for a routing style the zoo's Mixtral and Qwen-MoE do not cover: AFMoE's (a sigmoid
router in float32, the top-k chosen on the scores plus a per-expert bias that does not weigh, the
chosen scores normalised and scaled by `route_scale`, a shared expert beside the routed ones).

A router whose weight is zero (AFMoE's initialisation) ties every expert for every token: hspmd
takes the lower experts, PyTorch's top-k whatever its sort leaves first (unspecified). The second
test shows that ties are the only difference: with PyTorch's top-k made stable, the numbers agree.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from conftest import run_imported

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install -e '.[torch]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[torch]')")

from torch.overrides import TorchFunctionMode  # noqa: E402

import hspmd as hs  # noqa: E402

D, TOKENS = 16, 8


class _Layer(torch.nn.Module):
    """AFMoE's expert layer (transformers' own classes) and a squared-error loss on it."""

    def __init__(self, router_std: float):
        super().__init__()
        from transformers import AfmoeConfig
        from transformers.models.afmoe.modeling_afmoe import AfmoeSparseMoeBlock

        config = AfmoeConfig(hidden_size=D, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                             num_shared_experts=1, route_scale=2.5, hidden_act="silu")
        config._experts_implementation = "eager"  # transformers' own loop (the import replaces it)
        torch.manual_seed(0)
        self.moe = AfmoeSparseMoeBlock(config)
        with torch.no_grad():
            for p in (self.moe.experts.gate_up_proj, self.moe.experts.down_proj):
                p.normal_(0.0, 0.3)
            self.moe.router.gate.weight.normal_(0.0, router_std)
            if router_std:  # a bias that changes the choice (not the weights): expert 3 picked more often
                self.moe.expert_bias.copy_(torch.tensor([0.0, -0.05, 0.02, 0.3]))

    def forward(self, x, y):
        return ((self.moe(x) - y) ** 2).mean()


def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((2, TOKENS // 2, D)).astype(np.float32),
            "y": rng.standard_normal((2, TOKENS // 2, D)).astype(np.float32)}


def _against_pytorch(layer: _Layer, mode=None) -> None:
    batch = _batch()
    program = hs.from_torch(layer, batch, lambda m, b: m(b["x"], b["y"]))
    names = {op.name for op in program.module.walk()}
    assert {"graph.moe_route", "graph.moe_dispatch", "graph.moe_combine"} <= names, "not through the MoE ops"
    out = run_imported(program, batch)
    with mode or contextlib.nullcontext():
        loss = layer(*(torch.as_tensor(batch[k]) for k in ("x", "y")))
    loss.backward()
    assert abs(float(out["loss"]) - loss.item()) <= 1e-5 * abs(loss.item()), (float(out["loss"]), loss.item())
    for name, p in layer.named_parameters():
        if p.grad is None:
            continue
        ours, theirs = out[f"grad:{name}"], p.grad.numpy()
        err = np.linalg.norm(ours - theirs) / (np.linalg.norm(theirs) + 1e-30)
        assert err <= 1e-4, (name, err)


def test_a_sigmoid_router_with_a_choice_bias_normalised_scaled_and_a_shared_expert_equals_pytorch():
    _against_pytorch(_Layer(router_std=0.5))


class _StableTopk(TorchFunctionMode):
    """PyTorch's top-k with ties broken as hspmd breaks them: the lower index first."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk):
            x, k = args[0], (args[1] if len(args) > 1 else kwargs["k"])
            order = torch.sort(x, dim=kwargs.get("dim", -1), descending=True, stable=True).indices[..., :k]
            return torch.gather(x, -1, order), order
        return func(*args, **kwargs)


def test_a_router_at_zero_ties_every_expert_and_hspmd_takes_the_lower_ones():
    layer = _Layer(router_std=0.0)
    assert not layer.moe.router.gate.weight.any()
    _against_pytorch(layer, _StableTopk())
