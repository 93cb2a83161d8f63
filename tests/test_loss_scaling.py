"""Dynamic loss scaling (`loss_scale="dynamic"`): PyTorch's GradScaler as training state.

A step whose gradients hold an inf or nan leaves parameters and optimizer state bit-identical
and halves the scale; after `growth_interval` good steps the scale doubles; the decision is the
same on every rank of a distributed program (the gradients' global sum of squares), the scale
is checkpointed, and bad settings are one ScriptError.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import EXAMPLES, run_cli, train_plan, train_step

from hspmd.codegen import cpu_compile
from hspmd.compiler import compile_ps, compile_script, run_passes, write_bundle
from hspmd.dialects import graph, optim
from hspmd.dialects.context import IRTextError, module_text, parse_module
from hspmd.frontend.script import (
    ScriptError,
    load_script,
    loss_scale,
    parse_overrides,
    set_config,
)
from hspmd.ir.loss_scaling import (
    GOOD_STEPS_STATE,
    SCALE_STATE,
    DynamicScaling,
    next_scale,
)
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.cuda.emulated import EmulatedDevice
from hspmd.runtime.cuda.plan import build_device_plan
from hspmd.runtime.plan import build_plan
from hspmd.runtime.worker import CheckpointOptions, train
from hspmd.transforms.util import PassError

GPT = os.path.join(EXAMPLES, "gpt.py")
TINY = ["model.d_model=32", "model.seq_len=16", "model.layers=2", "data.batch_size=4", "optim.warmup=2",
        "precision=float16", "loss_scale=dynamic"]
#: far past float16's range: the first steps overflow, each halving the scale, until it fits
HUGE = 2.0**24


def _bundle(tmp_path, strategy="[0]: dp=1", n=1, optimizer=True, **config):
    script = load_script(GPT, parse_overrides(TINY))
    script.config.update(config)
    compiled = compile_script(script, strategy, n, optimizer=optimizer)
    path = tmp_path / ("b" + "".join(c for c in f"{strategy}{optimizer}{sorted(config.items())}" if c.isalnum()))
    write_bundle(compiled, str(path))
    return str(path), compiled


def _train(bundle, n=1, steps=4, **options):
    return run_spmd(n, lambda comm: train(bundle, comm, steps=steps, quiet=True, **options), timeout=300)


def _scalar(result, name) -> float:
    return float(np.asarray(result.params[name]).reshape(-1)[0])


def test_an_overflowing_step_is_skipped_and_the_scale_halves(tmp_path):
    frozen, _ = _bundle(tmp_path, optimizer=False, loss_scale_init=2.0**40)  # no update: the initial values
    initial = _train(frozen, steps=1)[0].params
    bundle, compiled = _bundle(tmp_path, loss_scale_init=2.0**40)
    assert "optim.where_finite" in module_text(compiled.logical)
    skipped = _train(bundle, steps=2)[0]
    assert _scalar(skipped, SCALE_STATE) == 2.0**38 and _scalar(skipped, "opt.step") == 0
    for name, value in initial.items():
        if not name.startswith("opt."):
            np.testing.assert_array_equal(skipped.params[name], value, err_msg=name)
    assert all(not v.any() for k, v in skipped.params.items() if k.startswith(("opt.m.", "opt.v.")))


def _skips(scales: list[float], final: float) -> list[bool]:
    """Return, per step, whether it was skipped: the scale after it is lower (growth is off)."""
    after = [*scales[1:], final]
    assert all(a in (s, s * 0.5) for s, a in zip(scales, after)), scales
    return [a < s for s, a in zip(scales, after)]


@pytest.mark.parametrize("kernels", ["cpu", "numpy"])
def test_training_proceeds_once_the_scale_fits(tmp_path, kernels):
    bundle, _ = _bundle(tmp_path, loss_scale_init=HUGE)
    log = tmp_path / "a.jsonl"
    result = _train(bundle, steps=14, log=str(log), kernels=kernels)[0]
    scales = [json.loads(line)["loss_scale"] for line in log.read_text().splitlines()]  # each step's scale
    skipped = _skips(scales, _scalar(result, SCALE_STATE))
    assert scales[0] == HUGE and skipped[:4] == [True] * 4 and not all(skipped)
    assert _scalar(result, "opt.step") == skipped.count(False)
    good = next((k for k, s in enumerate(reversed(skipped)) if s), len(skipped))
    assert _scalar(result, GOOD_STEPS_STATE) == good
    assert np.isfinite(result.losses).all() and result.losses[-1] < result.losses[0] - 0.05


def test_the_scale_grows_after_the_growth_interval(tmp_path):
    bundle, _ = _bundle(tmp_path, loss_scale_init=256.0, loss_scale_growth_interval=2, loss_scale_growth_factor=4.0)
    result = _train(bundle, steps=5)[0]
    assert _scalar(result, "opt.step") == 5
    assert _scalar(result, SCALE_STATE) == 256.0 * 4.0**2 and _scalar(result, GOOD_STEPS_STATE) == 1


def test_next_scale_is_gradscalers_rule():
    f32 = np.float32
    assert next_scale(8.0, 5.0, False, 2.0, 0.5, 3, f32) == (4.0, 0.0)
    assert next_scale(8.0, 1.0, True, 2.0, 0.5, 3, f32) == (8.0, 2.0)
    assert next_scale(8.0, 2.0, True, 2.0, 0.5, 3, f32) == (16.0, 0.0)
    assert next_scale(3e38, 2.0, True, 2.0, 0.5, 3, f32) == (3e38, 0.0)  # growth past float32: kept


#: two overflowing steps (2**34, 2**24), then 2**14, far below where this model's float16 gradients
#: overflow (about 2**17): 1 device and 2 ranks, rounding differently, take the same decisions
CLEAR = {"loss_scale_init": 2.0**34, "loss_scale_backoff_factor": 2.0**-10}


def _rank_runs(strategy: str, n: int, steps: int, **config) -> list[tuple[list[float], dict]]:
    """Return each rank's (losses, final local state) of `steps` steps of its compiled kernel plan."""
    script = load_script(GPT, parse_overrides(TINY))
    script.config.update(config)
    compiled = compile_script(script, strategy, n)
    ((_, module),) = compiled.kernel_groups()
    return run_spmd(n, lambda comm: train_plan(build_plan(train_step(module), comm.rank, comm), script, compiled, steps),
                    timeout=300)


def _states(state: dict) -> list[float]:
    return [float(np.asarray(state[name]).reshape(-1)[0]) for name in (SCALE_STATE, GOOD_STEPS_STATE, "opt.step")]


@pytest.mark.parametrize("strategy", ["[0,1]: dp=2", "[0,1]: tp=2"])
def test_two_ranks_skip_the_same_steps_and_give_the_one_device_losses(strategy):
    ((losses, state),) = _rank_runs("[0]: dp=1", 1, 8, **CLEAR)
    assert _states(state) == [2.0**14, 6, 6]  # two skipped steps, six good ones
    for rank_losses, rank_state in _rank_runs(strategy, 2, 8, **CLEAR):
        assert _states(rank_state) == _states(state), strategy
        np.testing.assert_allclose(rank_losses, losses, rtol=1e-3)


def test_a_pipeline_skips_the_same_steps(tmp_path):
    """Two stages (their stacked layers cut, each stage's gradients summed into the total) give
    the one-device decisions and losses."""
    one = _train(_bundle(tmp_path, **CLEAR)[0], steps=6)[0]
    staged = _train(_bundle(tmp_path, "[0,1]: pp=2", 2, microbatches=2, **CLEAR)[0], n=2, steps=6)[0]
    for name in (SCALE_STATE, GOOD_STEPS_STATE, "opt.step"):
        assert _scalar(staged, name) == _scalar(one, name), name
    np.testing.assert_allclose(staged.losses, one.losses, rtol=1e-3)


def test_parameter_servers_refuse_dynamic_scaling_in_one_line():
    script = load_script(os.path.join(EXAMPLES, "mlp.py"), {"loss_scale": "dynamic"})
    with pytest.raises(PassError, match="loss_scale='dynamic' skips a step on any non-finite gradient"):
        compile_ps(script, "[0,1]: dp=2 comm=ps", 1)


def test_tensor_parallel_ranks_agree_where_one_rank_alone_could_overflow():
    """Near float16's limit (the scale at 2**17 overflows on some steps only) each rank holds a piece
    of a split gradient, and the ranks still take one decision: the global sum of squares."""
    runs = _rank_runs("[0,1]: tp=2", 2, 14, loss_scale_init=HUGE)
    (losses0, state0), (losses1, state1) = runs
    assert _states(state0) == _states(state1) and 0 < _states(state0)[2] < 14
    assert losses0 == losses1


@pytest.mark.skipif(cpu_compile.find_compiler() is None, reason="no C++ compiler: kernels cannot be built")
def test_the_emulated_gpu_takes_the_cpus_decisions():
    """The GPU program (every op a CUDA kernel, here built for the CPU) skips the same steps and
    holds the same scale as the CPU's kernel plan, with its losses."""
    script = load_script(GPT, parse_overrides(TINY))
    script.config.update(CLEAR)
    compiled = compile_script(script, "[0]: dp=1", 1)
    ((_, module),) = compiled.device_groups()
    assert "update_loss_scale" in str(module)
    losses, state = train_plan(build_device_plan(train_step(module), 0, EmulatedDevice()), script, compiled, 4)
    ((cpu_losses, cpu_state),) = _rank_runs("[0]: dp=1", 1, 4, **CLEAR)
    assert _states(state) == _states(cpu_state) == [2.0**14, 2, 2]
    np.testing.assert_allclose(losses, cpu_losses, rtol=2e-3)


def test_a_checkpoint_keeps_the_scale(tmp_path):
    bundle, _ = _bundle(tmp_path, loss_scale_init=HUGE, loss_scale_growth_interval=3)
    straight = _train(bundle, steps=8)[0]
    ck = str(tmp_path / "ck")
    half = _train(bundle, steps=4, checkpoints=CheckpointOptions(directory=ck, every=4))[0]
    resumed = _train(bundle, steps=8, checkpoints=CheckpointOptions(resume=ck))[0]
    assert _scalar(half, SCALE_STATE) != HUGE  # the checkpoint holds a changed scale
    assert resumed.losses == straight.losses[4:]
    for name in (SCALE_STATE, GOOD_STEPS_STATE, "opt.step"):
        assert _scalar(resumed, name) == _scalar(straight, name), name


def test_dynamic_scaling_in_float32_gives_the_unscaled_losses(tmp_path):
    """Allowed with any precision: in float32 no step overflows, and scaling by powers of two is exact."""
    plain = _train(_bundle(tmp_path, precision="float32", loss_scale=None)[0], steps=4)[0]
    dynamic = _train(_bundle(tmp_path, precision="float32", loss_scale_growth_interval=2)[0], steps=4)[0]
    assert _scalar(dynamic, "opt.step") == 4 and _scalar(dynamic, SCALE_STATE) == 65536.0 * 4
    np.testing.assert_allclose(dynamic.losses, plain.losses, rtol=1e-6)


def _scaling(**config):
    script = load_script(GPT, parse_overrides(TINY))
    script.config.update(config)
    return loss_scale(script)


def test_the_config_gives_gradscalers_defaults_or_a_static_scale():
    assert _scaling() == DynamicScaling(65536.0, 2.0, 0.5, 2000)
    assert _scaling(loss_scale_growth_interval=10.0).growth_interval == 10
    assert _scaling(loss_scale=None) == 1024.0 and _scaling(loss_scale=8) == 8.0


@pytest.mark.parametrize("config, message", [
    ({"loss_scale": "dynamc"}, "config loss_scale='dynamc': expected a positive number or 'dynamic'"),
    ({"loss_scale": 0}, "config loss_scale=0: expected a positive number or 'dynamic'"),
    ({"loss_scale_init": -1.0}, "config loss_scale_init=-1.0: expected a finite number > 0"),
    ({"loss_scale_growth_factor": 1.0}, "config loss_scale_growth_factor=1.0: expected a finite number > 1"),
    ({"loss_scale_backoff_factor": 2}, r"config loss_scale_backoff_factor=2: expected a number in \(0, 1\)"),
    ({"loss_scale_growth_interval": 0}, r"config loss_scale_growth_interval=0: expected a whole number in \[1, "),
    ({"loss_scale_growth_interval": 2.5}, "config loss_scale_growth_interval=2.5: expected a whole number"),
    ({"loss_scale_init": "big"}, "config loss_scale_init='big': expected a number"),
    ({"loss_scale": 1024, "loss_scale_init": 8}, "config loss_scale_init: applies to loss_scale='dynamic' only"),
])
def test_bad_settings_are_one_script_error(config, message):
    with pytest.raises(ScriptError, match=message):
        _scaling(**config)


def test_set_takes_dynamic_and_its_settings_in_any_script():
    config = {"loss_scale": 8, "model": {}}
    for key, value in (("loss_scale", "dynamic"), ("loss_scale_growth_interval", 5)):
        set_config(config, key, value)
    assert config == {"loss_scale": "dynamic", "loss_scale_growth_interval": 5, "model": {}}


def test_a_bad_setting_on_the_command_line_is_one_line():
    r = run_cli("hspmd", "run", "-n", "1", GPT, "--steps", "1", "--set", "loss_scale=dynamic",
                "--set", "loss_scale_growth_interval=0")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "hspmd: error: config loss_scale_growth_interval=0: expected a whole number in [1, 16777216]"]


# ----------------------------------------------------------------------------- the IR


STEP = """
builtin.module {
  func.func @train_step() {
    %w = graph.parameter "w" {init = "ones"} : tensor<4x3xf32>
    %x = graph.input "x" : tensor<4x3xf32>
    %p = graph.mul %w, %x : (tensor<4x3xf32>, tensor<4x3xf32>) -> tensor<4x3xf32>
    %l = graph.reduce_sum %p {dims = array<i64: 0, 1>} : (tensor<4x3xf32>) -> tensor<f32>
    graph.output "loss", %l : tensor<f32>
    func.return
  }
}
"""


def _step(spec: str):
    module = parse_module(STEP)
    run_passes(module, spec)
    return module


def test_the_passes_print_parse_and_guard_every_update():
    module = _step("autodiff{loss_scale=8.0 dynamic_scale=true},dynamic-loss-scale{growth_interval=3},"
                   "clip-grad-norm{max_norm=1.0},adam")
    text = str(module)
    assert str(parse_module(text)) == text
    assert 'graph.parameter "opt.loss_scale" {init = "full:8.0"}' in text
    assert "growth_interval = 3" in text
    guarded = {op.tensor_name.data for op in module.walk() if isinstance(op, graph.AssignOp)
               and isinstance(op.value.owner, optim.WhereFiniteOp)}
    assert guarded == {"w", "opt.m.w", "opt.v.w", "opt.step", "opt.beta1_pow", "opt.beta2_pow"}
    assert sum(isinstance(op, optim.SumSquaresOp) for op in module.walk()) == 1  # clipping reuses the total


@pytest.mark.parametrize("spec, message", [
    ("autodiff,dynamic-loss-scale", "no 0-d state 'opt.loss_scale'; run 'autodiff{dynamic_scale=true}' first"),
    ("autodiff{dynamic_scale=true},adam,dynamic-loss-scale", "no gradient outputs"),
    ("autodiff{dynamic_scale=true},dynamic-loss-scale,dynamic-loss-scale", "already has a dynamic loss scale update"),
    ("autodiff{dynamic_scale=true},dynamic-loss-scale{backoff_factor=1.0}", r"backoff_factor=1.0: expected a number in \(0, 1\)"),
    ("autodiff{dynamic_scale=true},dynamic-loss-scale{growth_interval=0}", "growth_interval=0"),
    ("autodiff{dynamic_scale=true loss_scale=-2.0}", "loss_scale=-2.0 must be a finite number > 0"),
])
def test_the_passes_refuse_misuse(spec, message):
    with pytest.raises(PassError, match=message):
        _step(spec)


def test_the_update_op_verifies_its_settings():
    body = ("%0, %1 = optim.update_loss_scale %s, %s, %t {growth_factor = 0.5 : f64, backoff_factor = 0.5 : f64,"
            " growth_interval = 2 : i64} : (tensor<f32>, tensor<f32>, tensor<f64>) -> (tensor<f32>, tensor<f32>)")
    with pytest.raises(IRTextError, match="growth_factor=0.5: expected a finite number > 1"):
        parse_module(f"builtin.module {{\n  func.func @f(%s: tensor<f32>, %t: tensor<f64>) {{\n    {body}\n"
                     "    func.return\n  }\n}\n")
