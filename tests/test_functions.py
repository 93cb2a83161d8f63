"""Repeated layers as functions: traced once, called per layer, same numbers as inlined."""

from __future__ import annotations

import numpy as np
import pytest

import hspmd as hs
from hspmd.frontend.nn import bind_parameters
from hspmd.frontend.tracing import Tracer
from hspmd.dialects.context import module_text, parse_module
from hspmd.dialects.levels import physical_groups
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.plan import build_plan
from hspmd.compiler import annotate, run_passes, to_physical


class Block(hs.nn.Module):
    function = True

    def __init__(self, d):
        self.fc = hs.nn.Linear(d, d)

    def forward(self, x):
        return hs.relu(self.fc(x)) + x


class Net(hs.nn.Module):
    def __init__(self, layers, d, as_function):
        self.blocks = [Block(d) for _ in range(layers)]
        for b in self.blocks:
            b.function = as_function
        self.head = hs.nn.Linear(d, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def trace(layers, as_function, batch=4):
    model = Net(layers, 4, as_function)
    t = Tracer()
    with bind_parameters(model, t):
        x = t.input("x", (batch, 4), "float32")
        y = t.input("y", (batch,), "int32")
        t.output("loss", hs.cross_entropy(model(x), y))
    return t.finish()


def run(module, n, outputs=("loss",)):
    annotate(module, f"[0-{n - 1}]: dp={n}" if n > 2 else f"[{','.join(map(str, range(n)))}]: dp={n}")
    to_physical(module)
    ((_, group),) = physical_groups(module)
    step = next(o for o in group.body.block.ops if o.sym_name.data == "train_step")
    batch = {"x": np.arange(16.0).reshape(4, 4) / 10, "y": np.array([0, 2, 1, 1])}

    def body(comm):
        plan = build_plan(step, comm.rank, comm)
        out = plan.run(plan.initial_state(0), plan.local_batch(batch))
        return {k: out[k] for k in outputs}

    return run_spmd(n, body)


def test_one_function_per_repeated_layer_and_a_call_per_use():
    text = module_text(trace(3, True))
    assert text.count("func.func private @Block_0") == 1
    assert text.count("func.call @Block_0") == 3
    parse_module(text)


def test_ir_size_does_not_grow_with_layers_except_for_calls_and_parameters():
    def count(module):
        return sum(1 for _ in module.walk())

    small, big = count(trace(2, True)), count(trace(48, True))
    per_layer = 3  # two graph.parameter ops and one func.call
    assert big - small == 46 * per_layer


@pytest.mark.parametrize("n", [1, 2, 4])
def test_calls_give_the_numbers_of_inlined_layers(n):
    inlined = run(trace(3, False), 1)[0]["loss"]
    for out in run(trace(3, True), n):
        np.testing.assert_allclose(out["loss"], inlined, rtol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_gradients_through_calls_equal_inlined_gradients(n):
    names = ["loss"] + [f"grad:blocks.{i}.fc.{w}" for i in range(3) for w in ("weight", "bias")] + ["grad:head.weight"]
    inlined_module, called_module = trace(3, False), trace(3, True)
    for m in (inlined_module, called_module):
        run_passes(m, "autodiff")
    text = module_text(called_module)
    assert "@Block_0_fwd" in text and "@Block_0_bwd" in text and "func.func private @Block_0(" not in text
    assert text.count("func.call @Block_0_bwd") == 3
    inlined = run(inlined_module, 1, names)[0]
    for out in run(called_module, n, names):
        for k in names:
            np.testing.assert_allclose(out[k], inlined[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_a_call_with_other_argument_layouts_gets_its_own_unresharded_copy():
    from hspmd.dialects.dist import with_layout
    from hspmd.ir.layout_text import parse_layout

    class Act(hs.nn.Module):
        function = True

        def forward(self, x):
            return hs.relu(x) * 2.0

    t = Tracer()
    a, b = t.input("a", (4, 4), "float32"), t.input("b", (4, 4), "float32")
    layer = Act()
    t.output("ya", layer(a))
    t.output("yb", layer(b))
    module = t.finish()
    from xdsl.rewriter import Rewriter

    for op, text in zip([o for o in module.walk() if o.name == "graph.input"], ["[0,1]: split(0)=2", "[0,1]: split(1)=2"]):
        Rewriter.replace_value_with_new_type(op.result, with_layout(op.result.type, parse_layout(text)))
    run_passes(module, "propagate-layouts,insert-reshard")
    text = module_text(module)
    assert "func.call @Act_0(" in text and "func.call @Act_0_l1(" in text
    callees = text[text.index("func.func private"):]
    assert "dist.reshard" not in callees, callees
