"""Activation recompute (`recompute=block|selective`, `hs.checkpoint`): fewer residuals kept
between forward and backward, the same gradients bit for bit."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from models import Parallel, Reference, check_pair, model_specs

import hspmd as hs
from hspmd.compiler import compile_script
from hspmd.dialects.levels import physical_groups
from hspmd.frontend.script import load_script
from hspmd.ir.strategy import StrategyError, parse_strategy
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.plan import build_plan
from hspmd.runtime.worker import split_microbatches, step_inputs
from hspmd.transforms.recompute import RECOMPUTE_ATTR

ROOT = os.path.join(os.path.dirname(__file__), "..")
GPT = os.path.join(ROOT, "examples", "gpt.py")
SMALL = {"model.layers": 2, "model.d_model": 32, "model.heads": 2, "model.seq_len": 16, "data.batch_size": 4}


def _functions(module) -> dict:
    return {o.sym_name.data: o for o in module.body.block.ops if hasattr(o, "sym_name")}


def _gradients(script, strategy: str) -> dict[str, np.ndarray]:
    """Return one step's loss and gradients of `script` on one device under `strategy`."""
    compiled = compile_script(script, strategy, 1, optimizer=False)
    ((_, group),) = physical_groups(compiled.physical)
    fn = next(o for o in group.body.block.ops if getattr(o, "sym_name", None) is not None
              and o.sym_name.data == "train_step")
    out = run_spmd(1, lambda comm: _one_step(fn, script, compiled, comm), timeout=120)[0]
    return out


def _one_step(fn, script, compiled, comm):
    plan = build_plan(fn, comm.rank, comm)
    config = {**script.config, "lr_schedule": compiled.lr_schedule}
    state, batches = plan.initial_state(0), script.batches()
    names = {leaf.name: leaf.global_shape for leaf in plan.inputs}
    batch = split_microbatches({**next(batches), **step_inputs(1, config, names)}, names)
    return {k: np.array(v) for k, v in plan.run(state, plan.local_batch(batch)).items()}


def test_strategy_key():
    s = parse_strategy("[0,1]: dp=2 recompute=block | [2]: recompute=selective")
    assert [g.recompute for g in s.groups] == ["block", "selective"]
    assert str(s) == "[0,1]: dp=2 recompute=block | [2]: dp=1 recompute=selective"
    assert parse_strategy("[0]: dp=1").groups[0].recompute == "none"
    with pytest.raises(StrategyError, match="recompute=full is not a recompute mode"):
        parse_strategy("[0]: recompute=full")


@pytest.mark.parametrize("mode", ["block", "selective"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gpt_gradients_equal_and_residuals_shrink(mode, dropout):
    script = load_script(GPT, {**SMALL, "model.dropout": dropout})
    plain = _gradients(script, "[0]: dp=1")
    again = _gradients(script, f"[0]: recompute={mode}")
    assert plain.keys() == again.keys()
    for k in plain:
        np.testing.assert_array_equal(again[k], plain[k], err_msg=k)
    compiled = compile_script(script, f"[0]: recompute={mode}", 1)
    base = compile_script(script, "[0]: dp=1", 1)
    kept = [(o.results, b.results) for o, b in zip(compiled.logical.walk(), base.logical.walk())
            if o.name == "graph.scan" and "_fwd" in o.callee.root_reference.data][0]
    # the forward scan keeps fewer stacked residuals: block only each layer's input
    assert len(kept[0]) < len(kept[1])
    if mode == "block":
        assert len(kept[0]) == 2  # the carried output and each layer's input
    bwd = _functions(compiled.annotated)["Block_0_bwd"]
    assert bwd.attributes[RECOMPUTE_ATTR].data == mode
    names = {o.name for o in bwd.walk()}
    assert "graph.softmax" in names  # attention's softmax runs again in the backward


def test_checkpoint_marks_a_function():
    def mlp(x, w1, w2):
        return hs.relu(x @ w1) @ w2

    from hspmd.frontend.tracing import Tracer

    tracer = Tracer()
    x = tracer.input("x", (4, 8), "float32")
    w1 = tracer.parameter("w1", (8, 16), "normal:0.1")
    w2 = tracer.parameter("w2", (16, 8), "normal:0.1")
    y = hs.checkpoint(mlp, x, w1, w2)
    assert y.shape == (4, 8)
    module = tracer.finish()
    (callee,) = [f for n, f in _functions(module).items() if n != "train_step"]
    assert callee.attributes[RECOMPUTE_ATTR].data == "block"
    with pytest.raises(hs.TraceError):
        hs.checkpoint(mlp, x, w1)  # w2 missing: the function's own error, as a trace error


@pytest.mark.parametrize("strategy,n,m", [("[0,1]: dp=2 recompute=block", 2, 1),
                                          ("[0,1]: tp=2 recompute=selective", 2, 1),
                                          ("[0,1]: pp=2 recompute=block", 2, 4),
                                          ("[0,1]: dp=2 recompute=block share=2 | [2]: dp=1 share=1", 3, 1)])
def test_generated_model_parallel(strategy, n, m):
    from generated_model import DEFAULT_SPEC

    spec = {**DEFAULT_SPEC, "dropout": 0.1, "layers": 2}
    out = check_pair(Reference(spec), Parallel(strategy, n, m, "1f1b" if m > 1 else "gpipe"))
    assert out.refused is None, out.refused


@settings(max_examples=6, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(spec=model_specs(max_layers=3))
def test_random_models_recompute_gradients(spec):
    from models import _script

    script = _script(spec)
    plain = _gradients(script, "[0]: dp=1")
    for mode in ("block", "selective"):
        again = _gradients(script, f"[0]: recompute={mode}")
        assert plain.keys() == again.keys()
        for k in plain:
            np.testing.assert_array_equal(again[k], plain[k], err_msg=f"{mode}: {k}")


def test_planned_memory_shows_what_recompute_and_zero3_save():
    from hspmd.codegen.schedule.analysis import format_memory_rows, memory_rows

    script = load_script(GPT, {**SMALL, "model.layers": 4})
    rows = {s: memory_rows(compile_script(script, s, 2).physical)[0]
            for s in ("[0,1]: dp=2", "[0,1]: dp=2 recompute=block", "[0,1]: dp=2 recompute=selective",
                      "[0,1]: dp=2 zero=3 recompute=block")}
    base, block, sel, both = rows.values()
    assert block.activations * 2 < base.activations and sel.activations < base.activations
    assert block.parameters == base.parameters and both.parameters * 2 == base.parameters
    assert both.optimizer_states < 0.51 * base.optimizer_states and both.gradients * 2 == base.gradients
    assert both.peak < base.peak
    text = format_memory_rows([both], "under zero=3")
    assert "activations" in text and "peak" in text


def test_recompute_on_the_emulated_gpu_gives_the_plain_runs_losses(tmp_path):
    import json

    from conftest import EXAMPLES, run_cli

    sets = [a for k, v in {**SMALL, "model.dropout": 0.1}.items() for a in ("--set", f"{k}={v}")]
    logs = {}
    for mode in ("none", "block", "selective"):
        log = tmp_path / f"{mode}.jsonl"
        run_cli("hspmd", "run", "-n", "1", os.path.join(EXAMPLES, "gpt.py"), "--device", "cuda", "--steps", "3",
                "--strategy", f"[0]: recompute={mode}", "--log", str(log), *sets, check=True, timeout=600,
                env={"HSPMD_EMULATE_GPU": "1"})
        logs[mode] = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert logs["block"] == logs["none"] and logs["selective"] == logs["none"]


CHECKPOINTED = """
import numpy as np

import hspmd as hs

config = {"batch_size": 16, "steps": 10, "seed": 0, "lr": 0.1, "checkpoint": True}


class Model(hs.nn.Module):
    def __init__(self, use):
        self.use = use
        self.first = hs.nn.Linear(8, 16)
        self.second = hs.nn.Linear(16, 16)
        self.head = hs.nn.Linear(16, 4)

    def forward(self, x):
        mlp = lambda a, w: hs.tanh(a @ w) * 2.0
        if self.use:
            h = hs.checkpoint(self.first, x)
            h = hs.checkpoint(mlp, hs.relu(h), self.second.weight)
        else:
            h = mlp(hs.relu(self.first(x)), self.second.weight)
        return self.head(h)


def model(config):
    return Model(config["checkpoint"])


def loss(model, batch):
    return hs.cross_entropy(model(batch["x"]), batch["y"])


def batches(config):
    rng = np.random.default_rng(0)
    while True:
        yield {"x": rng.standard_normal((16, 8)).astype(np.float32), "y": rng.integers(0, 4, 16).astype(np.int32)}
"""


def test_checkpointed_functions_give_the_same_gradients(tmp_path):
    path = tmp_path / "checkpointed.py"
    path.write_text(CHECKPOINTED)
    marked_script = load_script(str(path), {})
    compiled = compile_script(marked_script, "[0]: dp=1", 1)
    marked = [n for n, f in _functions(compiled.logical).items() if RECOMPUTE_ATTR in f.attributes]
    assert any(n.startswith("Linear") for n in marked) and any(n.startswith("checkpoint_") for n in marked), marked
    again = _gradients(marked_script, "[0]: dp=1")
    base = _gradients(load_script(str(path), {"checkpoint": False}), "[0]: dp=1")
    assert again.keys() == base.keys() and len(base) > 3
    for k in base:
        np.testing.assert_array_equal(again[k], base[k], err_msg=k)
