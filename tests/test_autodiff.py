"""Reverse-mode gradients agree with central finite differences (float64, random graphs)."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import hspmd as hs
from hspmd.frontend.tracing import Tracer
from hspmd.dialects.levels import physical_groups
from hspmd.runtime.comm import InProcessCommunicator
from hspmd.runtime.plan import build_plan
from hspmd.compiler import annotate, run_passes, to_physical

OPS = ["matmul", "add_bias", "relu", "mul", "transpose", "scale", "sub", "reshape", "sum_dim"]


def build(ops, shape, with_ce):
    """Trace a step: x (input) and one parameter per op that needs one; returns the module."""
    t = Tracer()
    x = t.input("x", shape, "float64")
    labels = t.input("y", (shape[0],), "int32") if with_ce else None
    h = x
    for i, op in enumerate(ops):
        rows, cols = h.shape if h.ndim == 2 else (h.shape[0], 1)
        if h.ndim == 1:
            h = h.reshape((rows, 1))
        if op == "matmul":
            h = h @ t.parameter(f"w{i}", (cols, 3), "normal:0.5", "float64")
        elif op == "add_bias":
            h = h + t.parameter(f"b{i}", (cols,), "normal:0.5", "float64")
        elif op == "relu":
            h = hs.relu(h + 0.1)
        elif op == "mul":
            h = h * t.parameter(f"m{i}", (rows, cols), "normal:1.0", "float64")
        elif op == "transpose":
            h = h.T
        elif op == "scale":
            h = h * 0.7
        elif op == "sub":
            h = t.parameter(f"s{i}", (rows, cols), "normal:1.0", "float64") - h
        elif op == "reshape":
            h = h.reshape((cols, rows))
        elif op == "sum_dim":
            h = h.sum(1).reshape((rows, 1))
    if with_ce:
        if h.shape[0] != shape[0] and h.shape[1] == shape[0]:
            h = h.T
        elif h.shape[0] != shape[0]:
            h = h.reshape((shape[0], -1)) if (h.shape[0] * h.shape[1]) % shape[0] == 0 else h.sum().reshape((1, 1))
        if h.shape[0] != shape[0]:
            assume(False)
        loss = hs.cross_entropy(h, labels)
    else:
        loss = (h * h).sum() * 0.5
    t.output("loss", loss)
    module = t.finish()
    run_passes(module, "autodiff")
    return module, (h.shape[1] if with_ce else 0)


def run_once(module, params, batch):
    compiled = module.clone()
    annotate(compiled, "[0]: dp=1")
    to_physical(compiled)
    (_, group), = physical_groups(compiled)
    fn = next(o for o in group.walk() if o.name == "func.func")
    (comm,) = InProcessCommunicator.create_world(1)
    plan = build_plan(fn, 0, comm)
    state = dict(params) if params is not None else plan.initial_state(3)
    return plan, state, plan.run(dict(state), plan.local_batch(batch))


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=4),
    rows=st.sampled_from([2, 3, 4]),
    cols=st.sampled_from([2, 3]),
    with_ce=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_gradients_match_finite_differences(ops, rows, cols, with_ce, seed):
    module, classes = build(ops, (rows, cols), with_ce)
    rng = np.random.default_rng(seed)
    batch = {"x": rng.normal(size=(rows, cols))}
    if with_ce:
        batch["y"] = rng.integers(0, classes, size=rows).astype(np.int32)
    plan, state, out = run_once(module, None, batch)
    eps = 1e-6
    for name, value in state.items():
        grad = out[f"grad:{name}"]
        assert grad.shape == value.shape
        numeric = np.zeros_like(value)
        for idx in np.ndindex(value.shape):
            for sign in (1, -1):
                bumped = dict(state)
                bumped[name] = value.copy()
                bumped[name][idx] += sign * eps
                numeric[idx] += sign * float(plan.run(bumped, plan.local_batch(batch))["loss"])
        numeric /= 2 * eps
        np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-7, err_msg=f"{ops} {name}")
