"""Every differentiable op of the transformer op set: autodiff gradients equal central finite
differences (in float64), over hypothesis-drawn shapes, in float64 and in float32.

Each case traces a tiny step `loss = sum(op(params...) * c)` (c a random input of the op's
result shape, so that no gradient is trivially zero), compiles it for one device and runs it.
For float32 the gradients of the float32 program are compared, loosely, with the finite
differences of the same program built in float64 from the same values.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hspmd as hs
from hspmd.frontend.tracing import Tracer
from hspmd.dialects.levels import physical_groups
from hspmd.runtime.comm import InProcessCommunicator
from hspmd.runtime.plan import build_plan
from hspmd.compiler import annotate, run_passes, to_physical

EPS = 1e-6
TOL64 = dict(rtol=1e-5, atol=1e-7)
TOL32 = dict(rtol=3e-3, atol=3e-4)
small = st.integers(1, 3)


class Builder:
    """Makes the leaves of one case: parameters (which get gradients) and inputs with data."""

    def __init__(self, tracer: Tracer, dtype: str, rng: np.random.Generator) -> None:
        self.t, self.dtype, self.rng = tracer, dtype, rng
        self.batch: dict[str, np.ndarray] = {}

    def param(self, name: str, shape, init: str = "normal:1.0"):
        return self.t.parameter(name, tuple(shape), init, self.dtype)

    def input(self, name: str, shape, value: np.ndarray, dtype: str | None = None):
        self.batch[name] = value
        return self.t.input(name, tuple(shape), dtype or self.dtype)


def compile_plan(module):
    run_passes(module, "autodiff")
    annotate(module, "[0]: dp=1")
    to_physical(module)
    (_, group), = physical_groups(module)
    fn = next(o for o in group.walk() if o.name == "func.func" and o.sym_name.data == "train_step")
    (comm,) = InProcessCommunicator.create_world(1)
    return build_plan(fn, 0, comm)


def trace(case, draw_values, dtype: str, seed: int):
    """Return (plan, batch) of `loss = sum(case(...) * c)` in `dtype`."""
    t = Tracer()
    b = Builder(t, dtype, np.random.default_rng(seed))
    y = case(b, draw_values)
    c = b.input("c", y.shape, np.random.default_rng(seed + 1).standard_normal(y.shape))
    t.output("loss", (y * c).sum())
    return compile_plan(t.finish()), b.batch


class Replay:
    """A hypothesis `draw` that records its values, and `replay()` gives them again in order."""

    def __init__(self, draw) -> None:
        self.draw, self.values = draw, []

    def __call__(self, strategy):
        self.values.append(self.draw(strategy))
        return self.values[-1]

    def replay(self):
        values = iter(self.values)
        return lambda strategy: next(values)


def check_case(case, draw, dtype: str, seed: int) -> None:
    recorder = Replay(draw)
    plan64, batch64 = trace(case, recorder, "float64", seed)
    draw_values = recorder.replay()
    state64 = plan64.initial_state(seed)
    if dtype == "float32":
        plan, batch = trace(case, draw_values, "float32", seed)
        state = {k: v.astype(np.float32) for k, v in state64.items()}
        state64 = {k: v.astype(np.float64) for k, v in state.items()}  # the same numbers in both
        tol = TOL32
    else:
        plan, batch, state, tol = plan64, batch64, state64, TOL64
    out = plan.run(dict(state), plan.local_batch(batch))
    local64 = plan64.local_batch(batch64)
    for name, value in state64.items():
        grad = out[f"grad:{name}"]
        assert grad.shape == value.shape and grad.dtype == np.dtype(dtype)
        numeric = np.zeros_like(value)
        for idx in np.ndindex(value.shape):
            for sign in (1, -1):
                bumped = dict(state64)
                bumped[name] = value.copy()
                bumped[name][idx] += sign * EPS
                numeric[idx] += sign * float(plan64.run(bumped, local64)["loss"])
        numeric /= 2 * EPS
        np.testing.assert_allclose(grad, numeric, **tol, err_msg=f"{case.__name__} {dtype} grad:{name}")


# ----------------------------------------------------------------------------- cases
# each takes the Builder and a hypothesis `draw`, and returns the op's result


def matmul_2d(b, draw):
    m, k, n = draw(small), draw(small), draw(small)
    return b.param("a", (m, k)) @ b.param("w", (k, n))


def matmul_batched(b, draw):
    batch = tuple(draw(st.lists(small, min_size=1, max_size=2)))
    m, k, n = draw(small), draw(small), draw(small)
    return hs.matmul(b.param("a", (*batch, m, k)), b.param("w", (*batch, k, n)))


def matmul_weight(b, draw):
    batch = tuple(draw(st.lists(small, min_size=1, max_size=2)))
    m, k, n = draw(small), draw(small), draw(small)
    return b.param("a", (*batch, m, k)) @ b.param("w", (k, n))


def divide(b, draw):
    shape = tuple(draw(st.lists(small, min_size=1, max_size=3)))
    den_shape = shape[-1:] if draw(st.booleans()) else shape
    return b.param("n", shape) / b.param("d", den_shape, "uniform:0.5:2.0")


def divide_number(b, draw):
    shape = tuple(draw(st.lists(small, min_size=1, max_size=2)))
    return 2.0 / b.param("d", shape, "uniform:0.5:2.0") - b.param("n", shape) / 4


def power(b, draw):
    p = draw(st.sampled_from([2, 3, 0.5, -1, 1.5, 0]))
    return b.param("x", tuple(draw(st.lists(small, min_size=1, max_size=3))), "uniform:0.5:2.0") ** p


def _unary(fn, init="normal:1.0"):
    def case(b, draw):
        return fn(b.param("x", tuple(draw(st.lists(small, min_size=1, max_size=3))), init))

    case.__name__ = getattr(fn, "__name__", "unary")
    return case


exp = _unary(hs.exp)
log = _unary(hs.log, "uniform:0.5:2.0")
sqrt = _unary(hs.sqrt, "uniform:0.5:2.0")
rsqrt = _unary(hs.rsqrt, "uniform:0.5:2.0")
tanh = _unary(hs.tanh)
sigmoid = _unary(hs.sigmoid, "normal:2.0")
bce = _unary(lambda z: hs.binary_cross_entropy_with_logits(z, z * 0.0 + 0.25), "normal:3.0")
silu = _unary(hs.silu, "normal:2.0")
gelu_tanh = _unary(lambda x: hs.gelu(x, approximate="tanh"), "normal:2.0")
gelu_erf = _unary(lambda x: hs.gelu(x, approximate="none"), "normal:2.0")
negate = _unary(lambda x: -x)


def softmax(b, draw):
    shape = tuple(draw(st.lists(small, min_size=1, max_size=3)))
    return hs.softmax(b.param("x", shape), draw(st.integers(-len(shape), len(shape) - 1)))


def layer_norm(b, draw):
    shape = (*draw(st.lists(small, min_size=0, max_size=2)), draw(st.integers(2, 5)))
    n = shape[-1]
    return hs.layer_norm(b.param("x", shape), b.param("g", (n,)), b.param("b", (n,)), eps=1e-5)


def rms_norm(b, draw):
    shape = (*draw(st.lists(small, min_size=0, max_size=2)), draw(st.integers(1, 5)))
    return hs.rms_norm(b.param("x", shape), b.param("g", (shape[-1],)), eps=1e-6)


def embedding(b, draw):
    vocab, dim = draw(st.integers(1, 5)), draw(small)
    ids_shape = tuple(draw(st.lists(small, min_size=1, max_size=2)))
    ids = b.input("ids", ids_shape, b.rng.integers(0, vocab, size=ids_shape), "int64")
    return hs.embedding(b.param("table", (vocab, dim)), ids)


def causal_attention(b, draw):
    lead = tuple(draw(st.lists(small, min_size=0, max_size=2)))
    tq, tk = draw(small), draw(small)
    return hs.softmax(hs.causal_mask(b.param("s", (*lead, tq, tk))), -1)


def slice_(b, draw):
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    d = draw(st.integers(0, len(shape) - 1))
    start = draw(st.integers(0, shape[d] - 1))
    stop = draw(st.integers(start + 1, shape[d]))
    return hs.slice(b.param("x", shape), d, start, stop)


def split(b, draw):
    shape = tuple(draw(st.lists(st.integers(2, 4), min_size=1, max_size=3)))
    d = draw(st.integers(0, len(shape) - 1))
    cut = draw(st.integers(1, shape[d] - 1))
    sizes = [cut, shape[d] - cut]
    pieces = hs.split(b.param("x", shape), sizes, d)
    used = draw(st.sampled_from([[0], [1], [0, 1], [1, 0]]))  # some pieces unused: zero gradients
    return hs.concat([pieces[i] * float(i + 2) for i in used], d)


def concat(b, draw):
    shape = list(draw(st.lists(small, min_size=1, max_size=3)))
    d = draw(st.integers(0, len(shape) - 1))
    parts = []
    for i in range(draw(st.integers(1, 3))):
        s = list(shape)
        s[d] = draw(small)
        parts.append(b.param(f"x{i}", s))
    return hs.concat(parts, d)


def reduce_max(b, draw):
    shape = tuple(draw(st.lists(small, min_size=1, max_size=3)))
    dims = draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape), unique=True))
    return b.param("x", shape).max(dims)


def cross_entropy(b, draw):
    lead = tuple(draw(st.lists(small, min_size=1, max_size=2)))
    classes = draw(st.integers(2, 4))
    labels = b.rng.integers(0, classes, size=lead)
    ignore = draw(st.booleans())
    if ignore:
        labels = np.where(b.rng.random(lead) < 0.3, -100, labels)
        labels.flat[0] = 0  # at least one label counts
    y = b.input("labels", lead, labels, "int64")
    return hs.cross_entropy(b.param("logits", (*lead, classes)), y, ignore_index=-100 if ignore else None)


def rope(b, draw):
    shape = (draw(small), draw(small), draw(small), 2 * draw(small))
    return hs.rope(b.param("x", shape), base=draw(st.sampled_from([10000.0, 10.0])))


def dropout(b, draw):
    shape = tuple(draw(st.lists(small, min_size=1, max_size=3)))
    y = hs.dropout(b.param("x", shape), draw(st.sampled_from([0.0, 0.3, 0.7])), seed=draw(st.integers(0, 5)))
    if "step" in b.t.names:
        b.batch["step"] = np.int64(draw(st.integers(0, 100)))
    return y


def attention_block(b, draw):
    """A tiny causal attention head: matmuls, mask, softmax, rope, all together."""
    bsz, t, h, hd = draw(small), draw(st.integers(1, 3)), draw(small), 2
    x = b.param("x", (bsz, t, h * hd))
    q, k, v = hs.split(x @ b.param("w", (h * hd, 3 * h * hd)), [h * hd] * 3, 2)
    q, k, v = (z.reshape((bsz, t, h, hd)) for z in (q, k, v))
    q, k = hs.rope(q), hs.rope(k)
    q, k, v = (z.transpose((0, 2, 1, 3)) for z in (q, k, v))
    att = hs.softmax(hs.causal_mask(q @ k.transpose((0, 1, 3, 2)) * (1 / math.sqrt(hd))), -1)
    return hs.rms_norm((att @ v).transpose((0, 2, 1, 3)).reshape((bsz, t, h * hd)))


def expert_matmul(b, draw):
    e, m, k, n = draw(small), draw(small), draw(small), draw(small)
    return hs.expert_matmul(b.param("a", (e, m, k)), b.param("w", (e, k, n)))


def moe_dispatch_combine(b, draw):
    """Tokens routed by a fixed mask (from input probabilities), through experts' slots and back."""
    g, s, e, d = draw(small), draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(small)
    top_k, capacity = draw(st.integers(1, e)), draw(st.integers(1, 3))
    probs = b.input("p", (g, s, e), b.rng.dirichlet(np.ones(e), size=(g, s)))
    mask = hs.moe_route(probs, top_k, capacity)
    slots = hs.moe_dispatch(b.param("x", (g, s, d)), mask)
    return hs.moe_combine(slots * b.param("scale", (e, g, capacity, d)), mask * b.param("w", (g, s, e, capacity)))


CASES = [
    expert_matmul, moe_dispatch_combine, matmul_2d, matmul_batched, matmul_weight, divide, divide_number, power, exp, log, sqrt, rsqrt, tanh,
    sigmoid, bce, silu, gelu_tanh, gelu_erf, negate, softmax, layer_norm, rms_norm, embedding, causal_attention, slice_,
    split, concat, reduce_max, cross_entropy, rope, dropout, attention_block,
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
@settings(max_examples=10, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(["float64", "float32"]), seed=st.integers(0, 2**16))
def test_gradient_matches_finite_differences(case, data, dtype, seed):
    check_case(case, data.draw, dtype, seed)


@settings(max_examples=5, deadline=None)
@given(shape=st.lists(small, min_size=0, max_size=3), seed=st.integers(0, 2**16))
def test_cast_gradient_is_cast_back(shape, seed):
    """d/dx sum(cast(x, f32) * c) = cast(c, f64): the gradient of a cast is a cast back."""
    t = Tracer()
    x = t.parameter("x", shape, "normal:1.0", "float64")
    c = t.input("c", shape, "float32")
    t.output("loss", (hs.cast(x, "float32") * c).sum())
    plan = compile_plan(t.finish())
    cval = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    out = plan.run(plan.initial_state(seed), plan.local_batch({"c": cval}))
    assert out["grad:x"].dtype == np.float64
    np.testing.assert_array_equal(out["grad:x"], cval.astype(np.float64))
