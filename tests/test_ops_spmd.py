"""The transformer op set on N ranks computes the one-device numbers, whatever the layouts.

Each case traces a small step `loss = sum(op(...) * c)` (forward, and the backward through
`autodiff`), then every leaf (parameters, inputs, labels, ids, the dropout step) is given a
random single-group layout over 1-4 in-process ranks (splits, dup, any order, sometimes a
permuted device order). The compiled program's every output on every rank (the loss, the
result `y`, every `grad:NAME`) must equal the one-device run in float64 (rtol 1e-10). This
checks each op's sharding rule: a rule that allowed a split it cannot compute locally, or
forgot that a reduction leaves partial sums, gives wrong numbers here.

The machinery (compiling under given leaf layouts, running on in-process ranks, the states a
leaf may take) is the one of tests/test_spmd_property.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from test_spmd_property import _all_states, _declined, _show, check_outputs, compile_step, run_step

import hspmd as hs
from hspmd.frontend.tracing import Tracer
from hspmd.ir.layout import Layout
from hspmd.transforms.autodiff import Autodiff
from hspmd.transforms.util import PassError


class Leaves:
    """The leaves of one case: parameters (with their init) and inputs (with their data)."""

    def __init__(self, tracer: Tracer, seed: int) -> None:
        self.t = tracer
        self.rng = np.random.default_rng(seed)
        self.batch: dict[str, np.ndarray] = {}

    def param(self, name, shape, init="normal:0.5"):
        return self.t.parameter(name, tuple(shape), init, "float64")

    def input(self, name, shape, value=None, dtype="float64"):
        self.batch[name] = self.rng.standard_normal(shape) if value is None else value
        return self.t.input(name, tuple(shape), dtype)


# ----------------------------------------------------------------------------- cases


def matmul_weight(L):
    return L.input("x", (4, 2, 4)) @ L.param("w", (4, 8))


def matmul_batched(L):
    q, k = L.param("q", (2, 4, 4, 2)), L.input("k", (2, 4, 4, 2))
    return hs.matmul(q, k.transpose((0, 1, 3, 2)))


def elementwise(L):
    x = L.param("x", (4, 8), "uniform:0.5:2.0")
    d = L.param("d", (8,), "uniform:0.5:2.0")
    y = hs.exp(x * 0.3) + hs.log(x) + hs.sqrt(x) * hs.rsqrt(x + 1.0) + hs.tanh(x) + hs.silu(x) + hs.sigmoid(x)
    y = y + hs.gelu(x, approximate="tanh") + hs.gelu(x) + x ** 3 + x / d + 1.0 / x - x
    return hs.cast(hs.cast(y, "float32"), "float64") * x


def softmax_last(L):
    return hs.softmax(L.param("x", (4, 2, 8)), -1)


def softmax_first(L):
    return hs.softmax(L.param("x", (4, 8)), 0)


def layer_norm(L):
    return hs.layer_norm(L.input("x", (4, 2, 8)) * L.param("s", (4, 2, 8)), L.param("g", (8,)), L.param("b", (8,)))


def rms_norm(L):
    return hs.rms_norm(L.param("x", (4, 2, 8)), L.param("g", (8,)))


def embedding(L):
    ids = L.input("ids", (4, 2), L.rng.integers(0, 8, size=(4, 2)), "int64")
    return hs.embedding(L.param("table", (8, 4)), ids)


def causal_attention(L):
    return hs.softmax(hs.causal_mask(L.param("s", (2, 2, 4, 4))), -1)


def split_concat_slice(L):
    x = L.param("x", (4, 8))
    a, b, c = hs.split(x, [2, 4, 2], 1)
    y = hs.concat([c * 2.0, a], 1)  # b unused: its gradient is zeros
    return hs.concat([y, hs.slice(x, 1, 2, 6)], 0)


def reduce_max(L):
    x = L.param("x", (4, 2, 8))
    return x.max(2) * hs.max(x, [0, 2]).sum()


def cross_entropy(L):
    labels = L.rng.integers(0, 8, size=(4, 2))
    labels = np.where(L.rng.random((4, 2)) < 0.3, -100, labels)
    labels[0, 0] = 1
    y = L.input("labels", (4, 2), labels, "int64")
    return hs.cross_entropy(L.param("logits", (4, 2, 8)), y, ignore_index=-100)


def cross_entropy_mean(L):
    y = L.input("labels", (4, 2), L.rng.integers(0, 4, size=(4, 2)), "int64")
    return hs.cross_entropy(L.param("logits", (4, 2, 4)), y)


def rope(L):
    return hs.rope(L.param("x", (2, 4, 2, 4)))


def dropout(L):
    x = L.param("x", (4, 8))
    y = hs.dropout(x, 0.5, seed=3)
    L.batch["step"] = np.int64(7)
    return hs.dropout(y * 2.0, 0.25)


def attention_block(L):
    b, t, h, hd = 2, 4, 2, 2
    d = h * hd
    x = L.input("x", (b, t, d))
    q, k, v = hs.split(hs.layer_norm(x, L.param("g", (d,)), L.param("bias", (d,))) @ L.param("w", (d, 3 * d)),
                       [d, d, d], 2)
    q, k, v = (z.reshape((b, t, h, hd)) for z in (q, k, v))
    q, k = hs.rope(q), hs.rope(k)
    q, k, v = (z.transpose((0, 2, 1, 3)) for z in (q, k, v))
    att = hs.softmax(hs.causal_mask(q @ k.transpose((0, 1, 3, 2)) * (1 / math.sqrt(hd))), -1)
    y = (att @ v).transpose((0, 2, 1, 3)).reshape((b, t, d))
    return y @ L.param("proj", (d, d)) + x


def moe_layer(L):
    """Routing, dispatch, experts and combine of a mixture of experts (the router's probabilities
    an input, so the routing does not depend on a parameter's gradient)."""
    probs = L.input("p", (4, 4, 4), L.rng.dirichlet(np.ones(4), size=(4, 4)))
    mask = hs.moe_route(probs, 2, 2)
    slots = hs.moe_dispatch(L.input("x", (4, 4, 2)), mask).reshape((4, 8, 2))
    out = hs.expert_matmul(hs.tanh(hs.expert_matmul(slots, L.param("w1", (4, 2, 4)))), L.param("w2", (4, 4, 2)))
    return hs.moe_combine(out.reshape((4, 4, 2, 2)), mask * L.input("gw", (4, 4, 4, 2)))


CASES = {f.__name__: f for f in (
    moe_layer,
    matmul_weight, matmul_batched, elementwise, softmax_last, softmax_first, layer_norm, rms_norm, embedding,
    causal_attention, split_concat_slice, reduce_max, cross_entropy, cross_entropy_mean, rope, dropout,
    attention_block,
)}


def trace_case(name: str, seed: int):
    """Return (logical step with autodiff, leaf shapes, batch) of case `name`."""
    t = Tracer()
    leaves = Leaves(t, seed)
    y = CASES[name](leaves)
    if y.ndim == 0:
        loss = y
    else:
        loss = (y * leaves.input("c", y.shape)).sum()
    t.output("loss", loss)
    t.output("y", y)
    module = t.finish()
    Autodiff().apply(None, module)
    shapes = {op.tensor_name.data: op.result.type.get_shape() for op in module.walk()
              if op.name in ("graph.parameter", "graph.input")}
    return module, shapes, leaves.batch


@st.composite
def layouts_for(draw, shapes: dict[str, tuple[int, ...]]):
    """Draw (number of ranks, a layout per leaf)."""
    n = draw(st.sampled_from([1, 2, 2, 3, 4, 4]))
    permuted = n > 1 and draw(st.integers(0, 5)) == 0
    layouts = {}
    for leaf, shape in shapes.items():
        devices = draw(st.permutations(range(n))) if permuted else range(n)
        layouts[leaf] = Layout.spmd(devices, draw(st.sampled_from(_all_states(shape, n))))
    event(f"n={n}")
    return n, layouts


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=15, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_ops_on_n_ranks_equal_one_device(name, data, seed):
    logical, shapes, batch = trace_case(name, seed)
    n, layouts = data.draw(layouts_for(shapes))
    ref_module = compile_step(logical, {leaf: Layout.replicated((0,)) for leaf in layouts})
    (ref,) = run_step(ref_module, 1, batch)
    try:
        physical = compile_step(logical, layouts)
    except (PassError, NotImplementedError) as err:
        reason = _declined(err)
        if reason is None:
            raise
        event(f"declined: {reason}")
        assume(False)
    check_outputs(run_step(physical, n, batch), ref, f"{name} on {n} ranks, layouts {_show(layouts)}")


def test_every_case_on_4_ranks_data_parallel():
    """Each case once with every leaf split along its first dim where it can be (data parallel)."""
    from hspmd.ir.layout import DistributedStates, split

    for name in CASES:
        logical, shapes, batch = trace_case(name, 0)
        layouts = {leaf: (Layout.spmd(range(4), DistributedStates.of((split(0), 4))) if shape and shape[0] % 4 == 0
                          else Layout.replicated(range(4))) for leaf, shape in shapes.items()}
        ref_module = compile_step(logical, {leaf: Layout.replicated((0,)) for leaf in layouts})
        (ref,) = run_step(ref_module, 1, batch)
        check_outputs(run_step(compile_step(logical, layouts), 4, batch), ref, f"{name} data parallel")


@pytest.mark.parametrize("name", sorted(CASES))
def test_physical_text_round_trips(name):
    """Every op of every case prints and parses back at the logical and physical levels (the
    worker parses its group's physical program, dropout's global_type included)."""
    from hspmd.dialects.context import module_text, parse_module
    from hspmd.ir.layout import DistributedStates, split

    logical, shapes, batch = trace_case(name, 0)
    text = module_text(logical)
    assert module_text(parse_module(text)) == text
    layouts = {leaf: (Layout.spmd(range(2), DistributedStates.of((split(0), 2))) if shape and shape[0] % 2 == 0
                      else Layout.replicated(range(2))) for leaf, shape in shapes.items()}
    physical = compile_step(logical, layouts)
    text = module_text(physical)
    again = parse_module(text)
    assert module_text(again) == text
    (ref,) = run_step(compile_step(logical, {leaf: Layout.replicated((0,)) for leaf in layouts}), 1, batch)
    check_outputs(run_step(again, 2, batch), ref, f"{name} parsed back")
