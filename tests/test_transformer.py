"""GPT and LLaMA model scripts: they train, their IR stays small, --set reaches nested config."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from conftest import EXAMPLES, run_cli
from hspmd.compiler import compile_script, write_bundle
from hspmd.frontend.script import ScriptError, load_script, parse_overrides
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.worker import train

FAST = ["model.d_model=64", "model.seq_len=32", "data.batch_size=8"]


@pytest.mark.parametrize("example", ["gpt.py", "llama.py"])
def test_example_trains_on_one_and_two_ranks_alike(tmp_path, example):
    script = load_script(os.path.join(EXAMPLES, example), parse_overrides(FAST + ["steps=40", "optim.warmup=5"]))
    results = {}
    for n, strategy in ((1, "[0]: dp=1"), (2, "[0,1]: dp=2")):
        bundle = tmp_path / f"b{n}"
        write_bundle(compile_script(script, strategy, n), str(bundle))
        results[n] = run_spmd(n, lambda comm: train(str(bundle), comm, quiet=True), timeout=600)[0]
    losses = results[1].losses
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses  # from ~5.5 (ln 256) well down
    np.testing.assert_allclose(results[2].losses, losses, rtol=1e-4)


def _ops(module):
    return sum(1 for _ in module.walk())


def _function_ops(module):
    from xdsl.dialects import func

    return {f.sym_name.data: _ops(f) for f in module.body.block.ops if isinstance(f, func.FuncOp) and f.sym_name.data != "train_step"}


@pytest.mark.parametrize("example", ["gpt.py", "llama.py"])
def test_stacked_layers_keep_the_ir_the_same_size_at_any_depth(example):
    modules = {}
    for layers in (2, 3, 48):
        script = load_script(os.path.join(EXAMPLES, example), parse_overrides([f"model.layers={layers}"]))
        start = time.perf_counter()
        modules[layers] = compile_script(script, "[0]: dp=1", 1)
        print(f"\n{example}: {layers} layers stacked, compiled in {time.perf_counter() - start:.2f} s")
    for level in ("logical", "annotated", "physical"):  # the same ops at every depth: only the stacking dims differ
        counts = {layers: _ops(getattr(c, level)) for layers, c in modules.items()}
        assert len(set(counts.values())) == 1, (level, counts)
    assert _function_ops(modules[2].logical) == _function_ops(modules[48].logical)


@pytest.mark.parametrize("example", ["gpt.py", "llama.py"])
def test_repeated_layers_stay_small_in_the_ir(example):
    """Without stacking (a pipeline's program, `stack_layers=False`): one call per layer, one traced block."""
    sizes = {}
    for layers in (2, 3, 48):
        script = load_script(os.path.join(EXAMPLES, example), parse_overrides([f"model.layers={layers}"]))
        start = time.perf_counter()
        compiled = compile_script(script, "[0]: dp=1", 1, stack_layers=False)
        sizes[layers] = (compiled.logical, time.perf_counter() - start)
    two, three, many = (sizes[k][0] for k in (2, 3, 48))
    print(f"\n{example}: logical ops 2 layers {_ops(two)}, 48 layers {_ops(many)}; "
          f"compile 48 layers {sizes[48][1]:.2f} s")
    # the layer functions are the same whatever the depth ...
    assert _function_ops(two) == _function_ops(many)
    # ... the step function holds no copy of a layer's computation ...
    assert _compute_ops(two) == _compute_ops(many)
    # ... and each further layer adds the same ops: two calls, its parameters and their updates
    per_layer = _ops(three) - _ops(two)
    assert _ops(many) - _ops(two) == 46 * per_layer
    assert dict(_step_ops(three) - _step_ops(two)) == {"func.call": 2}


_PER_PARAMETER = ("graph.parameter", "graph.assign", "graph.output", "optim.adam", "optim.sum_squares", "optim.mul_scalar", "graph.add")


def _step(module):
    from xdsl.dialects import func

    return next(f for f in module.body.block.ops if isinstance(f, func.FuncOp) and f.sym_name.data == "train_step")


def _compute_ops(module) -> dict:
    """Return {op name: count} of the step function's ops that compute (not per-parameter bookkeeping)."""
    from collections import Counter

    return Counter(o.name for o in _step(module).walk() if o.name not in (*_PER_PARAMETER, "func.call", "func.func"))


def _step_ops(module) -> dict:
    """Return {op name: count} of the step function's ops that are neither per-parameter nor calls' growth."""
    from collections import Counter

    counts = Counter(o.name for o in _step(module).walk() if o.name not in _PER_PARAMETER)
    return counts


def test_set_reaches_nested_config_and_rejects_unknown_keys():
    script = load_script(os.path.join(EXAMPLES, "gpt.py"), parse_overrides(["model.layers=3", "steps=7"]))
    assert script.config["model"]["layers"] == 3 and script.config["steps"] == 7
    with pytest.raises(ScriptError, match="no key 'layer'"):
        load_script(os.path.join(EXAMPLES, "gpt.py"), parse_overrides(["model.layer=3"]))
    with pytest.raises(ScriptError, match="no section 'modle'"):
        load_script(os.path.join(EXAMPLES, "gpt.py"), parse_overrides(["modle.layers=3"]))
    with pytest.raises(ScriptError, match="expected a number"):
        load_script(os.path.join(EXAMPLES, "gpt.py"), parse_overrides(["model.layers=many"]))


def test_cli_compiles_a_48_layer_gpt_quickly(tmp_path):
    d = tmp_path / "gpt48"
    start = time.perf_counter()
    run_cli("hspmd", "compile", os.path.join(EXAMPLES, "gpt.py"), "--set", "model.layers=48", "--dump-dir", str(d),
            check=True, timeout=300)
    elapsed = time.perf_counter() - start
    logical = (d / "logical.mlir").read_text()
    # the 48 layers stacked: one scan of the block's forward, one of its backward
    assert logical.count("graph.scan @Block_0_fwd") == 1 and logical.count("func.func private @Block_0_fwd") == 1
    assert logical.count("length = 48 : i64") == 2 and "blocks.[0:48].attn.qkv.weight" in logical
    print(f"\nhspmd compile gpt.py --set model.layers=48: {elapsed:.1f} s, logical.mlir {len(logical)} bytes")


def test_cli_runs_gpt_with_a_log(tmp_path):
    log = tmp_path / "log.jsonl"
    run_cli("hspmd", "run", "-n", "2", os.path.join(EXAMPLES, "gpt.py"), "--steps", "3", "--log", str(log),
            "--set", "model.d_model=32", "--set", "model.seq_len=16", "--set", "data.batch_size=4",
            check=True, timeout=300)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all("lr" in r and "loss" in r for r in records)


def test_model_script_that_fails_to_trace_names_line_op_and_shapes(tmp_path):
    src = open(os.path.join(EXAMPLES, "gpt.py")).read().replace(
        "    return lm_loss(model, batch)", "    return hs.cross_entropy(batch['ids'] @ batch['ids'], batch['targets'])"
    )
    s = tmp_path / "bad.py"
    s.write_text(src)
    proc = run_cli("hspmd", "compile", str(s))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"{s}:" in proc.stderr and "matmul" in proc.stderr, proc.stderr
