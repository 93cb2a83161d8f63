"""Optimizers compiled into the step agree with hand-written NumPy (and PyTorch, when installed).

A 2-layer MLP in float64 (`relu(x @ w1 + b1) @ w2 + b2`, mean cross-entropy) is traced by
hand, compiled through `autodiff`, the optimizer's passes, and the annotated and physical
pipelines, and run for 5 steps. After every step its parameters must equal an independent
NumPy implementation of the same algorithm (gradients written out by hand, the optimizers
written from PyTorch's documented algorithms) to 1e-10. Where `torch` is importable the same
gradients also go through `torch.optim` and `clip_grad_norm_`.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hspmd.compiler import default_strategy
from hspmd.frontend.ops import cross_entropy, relu
from hspmd.frontend.optim import SGD, Adam, AdamW, Optimizer, WarmupCosine, WarmupLinear
from hspmd.frontend.tracing import Tracer
from hspmd.ir.init_spec import initial_value
from hspmd.dialects.levels import physical_groups, verify_annotated, verify_logical, verify_physical
from hspmd.runtime.checkpoint import gather_parameters
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.plan import build_plan
from hspmd.ir.lr_schedule import schedule_from_spec
from hspmd.runtime.worker import step_inputs
from hspmd.compiler import annotate, run_passes, to_physical

SEED = 3
STEPS = 5
B, D_IN, HIDDEN, CLASSES = 8, 5, 6, 3
INIT = "uniform:-0.6:0.6"
SHAPES = {"w1": (D_IN, HIDDEN), "b1": (HIDDEN,), "w2": (HIDDEN, CLASSES), "b2": (CLASSES,)}
TOL = dict(rtol=1e-10, atol=1e-12)


def make_batches(steps: int = STEPS) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(11)
    return [
        {"x": rng.standard_normal((B, D_IN)), "y": rng.integers(0, CLASSES, B).astype(np.int64)} for _ in range(steps)
    ]


BATCHES = make_batches()


# --------------------------------------------------------------------------------------
# Compiled


def trace_mlp():
    """Return the logical forward step of the MLP (parameters w1, b1, w2, b2; inputs x, y)."""
    tr = Tracer()
    p = {name: tr.parameter(name, shape, INIT, "float64") for name, shape in SHAPES.items()}
    x, y = tr.input("x", (B, D_IN), "float64"), tr.input("y", (B,), "int64")
    logits = relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    tr.output("loss", cross_entropy(logits, y))
    return tr.finish()


def compile_mlp(opt: Optimizer, n: int):
    """Return the physical step of the MLP trained by `opt`, data parallel over `n` devices."""
    module = trace_mlp()
    run_passes(module, "autodiff," + opt.pipeline())
    verify_logical(module)
    annotate(module, default_strategy(n))
    verify_annotated(module)
    to_physical(module)
    verify_physical(module)
    return module


def run_compiled(opt: Optimizer, n: int = 1, steps: int = STEPS) -> list[dict[str, np.ndarray]]:
    """Return the global parameters (and optimizer state) after each step, as rank 0 sees them."""
    physical = compile_mlp(opt, n)
    config = {"lr_schedule": opt.schedule_spec()}

    def rank(comm):
        ((_, module),) = [g for g in physical_groups(physical) if comm.rank in g[0]]
        plan = build_plan(next(o for o in module.walk() if o.name == "func.func"), comm.rank, comm)
        state = plan.initial_state(SEED)
        names = {leaf.name for leaf in plan.inputs}
        history = []
        for step, batch in enumerate(BATCHES[:steps], 1):
            plan.run(state, plan.local_batch({**batch, **step_inputs(step, config, names)}))
            history.append(gather_parameters(plan, state, comm))
        return history

    return run_spmd(n, rank, timeout=60.0)[0]


# --------------------------------------------------------------------------------------
# Hand-written NumPy reference


def initial_params() -> dict[str, np.ndarray]:
    return {name: initial_value(INIT, shape, "float64", name, SEED) for name, shape in SHAPES.items()}


def gradients(p: dict[str, np.ndarray], batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Return d(mean cross-entropy)/d(parameter) of the MLP, by hand."""
    x, y = batch["x"], batch["y"]
    h = x @ p["w1"] + p["b1"]
    a = np.maximum(h, 0)
    logits = a @ p["w2"] + p["b2"]
    e = np.exp(logits - logits.max(1, keepdims=True))
    g = e / e.sum(1, keepdims=True)
    g[np.arange(B), y] -= 1
    g /= B
    gh = (g @ p["w2"].T) * (h > 0)
    return {"w1": x.T @ gh, "b1": gh.sum(0), "w2": a.T @ g, "b2": g.sum(0)}


def clip(grads: dict[str, np.ndarray], max_norm: float) -> tuple[dict[str, np.ndarray], float]:
    """Return the gradients scaled as torch.nn.utils.clip_grad_norm_ does, and the factor."""
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
    coef = min(1.0, max_norm / (norm + 1e-6))
    return {k: g * coef for k, g in grads.items()}, coef


def reference(opt: Optimizer, steps: int = STEPS) -> tuple[list[dict[str, np.ndarray]], list[float]]:
    """Return the parameters and states after each step, and the clip factors, of NumPy training."""
    params, state, history, coefs = initial_params(), {}, [], []
    lr_at = schedule_from_spec(opt.schedule_spec())
    for t, batch in enumerate(BATCHES[:steps], 1):
        grads = gradients(params, batch)
        if opt.clip_grad_norm:
            grads, coef = clip(grads, opt.clip_grad_norm)
            coefs.append(coef)
        lr = lr_at(t)
        for k, p in params.items():
            g = grads[k]
            if isinstance(opt, SGD):  # torch.optim.SGD's algorithm, dampening 0
                if opt.weight_decay:
                    g = g + opt.weight_decay * p
                if opt.momentum:
                    buf = g if t == 1 else opt.momentum * state[f"opt.momentum.{k}"] + g
                    state[f"opt.momentum.{k}"] = buf
                    g = g + opt.momentum * buf if opt.nesterov else buf
                params[k] = p - lr * g
            else:  # torch.optim.Adam / AdamW
                beta1, beta2 = opt.betas
                if isinstance(opt, AdamW):
                    p = p * (1 - lr * opt.weight_decay)
                elif opt.weight_decay:
                    g = g + opt.weight_decay * p
                m = beta1 * state.get(f"opt.m.{k}", 0.0) + (1 - beta1) * g
                v = beta2 * state.get(f"opt.v.{k}", 0.0) + (1 - beta2) * g * g
                state[f"opt.m.{k}"], state[f"opt.v.{k}"] = m, v
                m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
                params[k] = p - lr * m_hat / (np.sqrt(v_hat) + opt.eps)
        history.append({**params, **state})
    return history, coefs


def torch_reference(opt: Optimizer, steps: int = STEPS) -> list[dict[str, np.ndarray]]:
    """Return the parameters after each step of torch.optim fed the hand-written gradients."""
    import torch

    params = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in initial_params().items()}
    if isinstance(opt, SGD):
        topt = torch.optim.SGD(
            params.values(), lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay, nesterov=opt.nesterov
        )
    else:
        cls = torch.optim.AdamW if isinstance(opt, AdamW) else torch.optim.Adam
        topt = cls(params.values(), lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)
    lr_at = schedule_from_spec(opt.schedule_spec())
    history = []
    for t, batch in enumerate(BATCHES[:steps], 1):
        grads = gradients({k: p.detach().numpy() for k, p in params.items()}, batch)
        for k, p in params.items():
            p.grad = torch.tensor(grads[k])
        if opt.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(list(params.values()), opt.clip_grad_norm)
        for group in topt.param_groups:
            group["lr"] = lr_at(t)
        topt.step()
        history.append({k: p.detach().numpy().copy() for k, p in params.items()})
    return history


# --------------------------------------------------------------------------------------
# Tests

OPTIMIZERS = {
    "sgd": SGD(0.5),
    "sgd-momentum": SGD(0.2, momentum=0.9),
    "sgd-nesterov": SGD(0.2, momentum=0.8, nesterov=True),
    "sgd-weight-decay": SGD(0.2, momentum=0.9, weight_decay=0.05),
    "sgd-weight-decay-no-momentum": SGD(0.3, weight_decay=0.1),
    "adam": Adam(0.05),
    "adam-l2": Adam(0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    "adamw": AdamW(0.05, weight_decay=0.1),
}
CLIP = 0.3  # small enough that every step of every optimizer here is clipped (asserted below)


def with_(opt: Optimizer, **changes) -> Optimizer:
    import dataclasses

    return dataclasses.replace(opt, **changes)


def check_history(got: list[dict], want: list[dict], what: str) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want), 1):
        for name, value in w.items():
            np.testing.assert_allclose(g[name], value, **TOL, err_msg=f"{what}: '{name}' after step {step}")


@pytest.mark.parametrize("clipped", [False, True], ids=["", "clip"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_compiled_optimizer_matches_numpy(name, clipped):
    opt = with_(OPTIMIZERS[name], clip_grad_norm=CLIP if clipped else None)
    want, coefs = reference(opt)
    if clipped:
        assert all(c < 1 for c in coefs), f"clipping was not active: {coefs}"
    got = run_compiled(opt)
    check_history(got, want, name)
    last = got[-1]
    assert int(last["opt.step"]) == STEPS
    if isinstance(opt, Adam):
        assert float(last["opt.beta1_pow"]) == pytest.approx(opt.betas[0] ** STEPS, rel=1e-14)
        assert float(last["opt.beta2_pow"]) == pytest.approx(opt.betas[1] ** STEPS, rel=1e-14)


SCHEDULED = {
    "adamw-warmup-cosine": AdamW(0.05, weight_decay=0.1, schedule=WarmupCosine(2, 4, min_lr=0.005)),
    "sgd-warmup-linear": SGD(0.3, momentum=0.9, schedule=WarmupLinear(1, 5)),
}


@pytest.mark.parametrize("name", list(SCHEDULED))
def test_scheduled_learning_rate_matches_numpy(name):
    opt = with_(SCHEDULED[name], clip_grad_norm=CLIP)
    assert "lr_input=true" in opt.pipeline()
    check_history(run_compiled(opt), reference(opt)[0], name)


@pytest.mark.parametrize("name", list(OPTIMIZERS) + list(SCHEDULED))
def test_pytorch_agrees_with_the_numpy_reference(name):
    pytest.importorskip("torch", reason="PyTorch is not installed; the NumPy reference is checked alone")
    opt = with_({**OPTIMIZERS, **SCHEDULED}[name], clip_grad_norm=CLIP)
    params = [{k: h[k] for k in SHAPES} for h in reference(opt)[0]]
    check_history(torch_reference(opt), params, f"torch {name}")
    plain = with_(opt, clip_grad_norm=None)
    check_history(torch_reference(plain), [{k: h[k] for k in SHAPES} for h in reference(plain)[0]], f"torch {name}")


@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_adamw_with_clipping_equals_one_device(n):
    opt = AdamW(0.05, weight_decay=0.1, clip_grad_norm=CLIP, schedule=WarmupCosine(1, 5))
    one = run_compiled(opt, 1)
    check_history(run_compiled(opt, n), one, f"{n} ranks vs 1")
    check_history(one, reference(opt)[0], "1 device vs NumPy")
