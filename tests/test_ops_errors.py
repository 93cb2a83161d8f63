"""Bad input to the transformer ops: a TraceError naming the script line, the op and the shapes."""

from __future__ import annotations

import inspect

import pytest

import hspmd as hs
from hspmd.frontend.tracing import Tracer


def _line() -> int:
    return inspect.currentframe().f_back.f_lineno  # type: ignore[union-attr]


@pytest.fixture
def t():
    return Tracer()


def test_matmul_shape_mismatch_names_the_line(t):
    x, w = t.input("x", (2, 3, 4), "float32"), t.parameter("w", (5, 6), "zeros")
    with pytest.raises(hs.TraceError) as err:
        line = _line(); x @ w  # noqa: E702
    assert f"test_ops_errors.py:{line}: matmul: cannot multiply [2, 3, 4] by [5, 6]" in str(err.value)
    y = t.input("y", (3, 4, 5), "float32")
    with pytest.raises(hs.TraceError, match=r"matmul: cannot multiply \[2, 3, 4\] by \[3, 4, 5\]"):
        hs.matmul(x, y)  # batch dims differ


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda t, x: hs.layer_norm(x, t.parameter("g", (5,), "ones")), r"layer_norm: weight must have shape \[4\]"),
        (lambda t, x: hs.rms_norm(x, t.parameter("g", (4,), "ones", "float64")), r"rms_norm: weight has dtype float64"),
        (lambda t, x: hs.cross_entropy(x, t.input("l", (2,), "int64")), r"cross_entropy: needs logits \[..., C\]"),
        (lambda t, x: hs.cross_entropy(x, t.input("l", (2, 3), "float32")), r"labels must be integers"),
        (lambda t, x: hs.split(x, [1, 2], 2), r"split: sizes \[1, 2\] do not add up to dim 2"),
        (lambda t, x: hs.concat([x, t.input("z", (2, 4, 4), "float32")], 2), r"concat: cannot join"),
        (lambda t, x: hs.slice(x, 1, 2, 2), r"slice: \[2:2\] is not a non-empty range"),
        (lambda t, x: hs.softmax(x, 3), r"softmax: dim 3 is out of range"),
        (lambda t, x: hs.embedding(t.parameter("e", (4, 2), "zeros"), x), r"embedding: ids must be integers"),
        (lambda t, x: hs.rope(x.reshape((2, 3, 4, 1))), r"rope: needs x \[B, T, H, Dh\] with Dh even"),
        (lambda t, x: hs.gelu(x, approximate="fast"), r"gelu: approximate must be one of"),
        (lambda t, x: hs.dropout(x, 1.0), r"dropout: rate must be in \[0, 1\)"),
        (lambda t, x: hs.cast(x, "int32"), r"cast: dtype must be one of"),
        (lambda t, x: x ** x, r"pow: the exponent must be a Python number"),
        (lambda t, x: x / t.input("z", (3, 3), "float32"), r"div: shapes \[2, 3, 4\] and \[3, 3\] do not broadcast"),
        (lambda t, x: x.max(5), r"max: dim 5 is out of range"),
    ],
)
def test_bad_input_raises_trace_error(t, make, message):
    x = t.input("x", (2, 3, 4), "float32")
    with pytest.raises(hs.TraceError, match=message) as err:
        make(t, x)
    assert "test_ops_errors.py:" in str(err.value)


def test_dropout_inside_a_function_module_draws_a_different_mask_per_call(t):
    import numpy as np

    from hspmd.dialects.levels import physical_groups
    from hspmd.runtime.comm import InProcessCommunicator
    from hspmd.runtime.plan import build_plan
    from hspmd.compiler import annotate, to_physical

    class Drop(hs.nn.Module):
        function = True

        def forward(self, x):
            return hs.dropout(x, 0.5)

    x = t.input("x", (8, 8), "float32")
    layer = Drop()
    first, second = layer(x), layer(x)
    t.output("a", first)
    t.output("b", second)
    module = t.finish()
    annotate(module, "[0]: dp=1")
    to_physical(module)
    ((_, group),) = physical_groups(module)
    step = next(o for o in group.body.block.ops if o.sym_name.data == "train_step")
    (comm,) = InProcessCommunicator.create_world(1)
    plan = build_plan(step, 0, comm)
    batch = {"x": np.ones((8, 8), np.float32), "step": np.array(1, np.int64)}
    out = plan.run({}, plan.local_batch(batch))
    assert set(np.unique(out["a"])) <= {0.0, 2.0} and not np.array_equal(out["a"], out["b"])
    batch["step"] = np.array(2, np.int64)
    assert not np.array_equal(plan.run({}, plan.local_batch(batch))["a"], out["a"])
