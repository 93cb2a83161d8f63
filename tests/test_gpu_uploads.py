"""The next batch is made and uploaded while the GPU runs a step (`DevicePlan.run`'s `ahead`):
the same numbers as uploading each batch at its step, one upload per input per step, and the
worker's runs on the emulated device use it."""

from __future__ import annotations

import json
import os

import numpy as np
from conftest import EXAMPLES, run_cli, train_step

from hspmd.compiler import compile_script
from hspmd.frontend.script import load_script
from hspmd.runtime.cuda.emulated import EmulatedDevice
from hspmd.runtime.cuda.plan import build_device_plan
from hspmd.runtime.worker import step_inputs


class CountingDevice(EmulatedDevice):
    """The emulated device, counting the uploads to each pointer."""

    def __init__(self) -> None:
        super().__init__()
        self.uploads: dict[int, int] = {}

    def upload(self, ptr, array):
        self.uploads[ptr] = self.uploads.get(ptr, 0) + 1
        super().upload(ptr, array)


def _plan_and_batches():
    script = load_script(os.path.join(EXAMPLES, "mlp.py"))
    compiled = compile_script(script, "[0]: dp=1", 1)
    ((_, device),) = compiled.device_groups()
    config = {**script.config, "lr_schedule": compiled.lr_schedule}
    return script, device, config


def _local(plan, batches, config, n):
    names = {leaf.name for leaf in plan.inputs}
    return plan.local_batch({**next(batches), **step_inputs(n, config, names)})


def test_uploading_the_next_batch_during_a_step_gives_the_same_numbers_and_one_upload_each():
    script, device, config = _plan_and_batches()
    steps = 4
    plain = build_device_plan(train_step(device), 0, EmulatedDevice())
    state, batches = plain.initial_state(0), script.batches()
    ref = [float(plain.run(state, _local(plain, batches, config, n))["loss"]) for n in range(1, steps + 1)]

    counting = CountingDevice()
    plan = build_device_plan(train_step(device), 0, counting)
    assert plan.uploads_ahead
    state, batches = plan.initial_state(0), script.batches()
    made: list[int] = []
    ahead: dict = {}

    def make(n):
        def next_inputs():
            made.append(n)
            ahead[n] = _local(plan, batches, config, n)
            return ahead[n]
        return next_inputs

    inputs_ptrs = {a.ptr for a in plan.input_arrays.values()}
    counting.uploads.clear()
    losses = []
    inputs = _local(plan, batches, config, 1)
    for n in range(1, steps + 1):
        out = plan.run(state, inputs, ahead=make(n + 1) if n < steps else None)
        losses.append(float(out["loss"]))
        inputs = ahead.get(n + 1)
    assert losses == ref
    assert made == [2, 3, 4]
    assert {p: c for p, c in counting.uploads.items() if p in inputs_ptrs} == {p: steps for p in inputs_ptrs}


def test_a_run_given_other_inputs_than_the_staged_ones_uploads_them():
    script, device, config = _plan_and_batches()
    plan = build_device_plan(train_step(device), 0, EmulatedDevice())
    state, batches = plan.initial_state(0), script.batches()
    first = _local(plan, batches, config, 1)
    plan.run(state, first, ahead=lambda: _local(plan, script.batches(), config, 2))  # staged: batch 0 again
    second = _local(plan, batches, config, 2)
    a = float(plan.run(state, second)["loss"])
    ref_plan = build_device_plan(train_step(device), 0, EmulatedDevice())
    ref_state, ref_batches = ref_plan.initial_state(0), script.batches()
    ref_plan.run(ref_state, _local(ref_plan, ref_batches, config, 1))
    assert a == float(ref_plan.run(ref_state, _local(ref_plan, ref_batches, config, 2))["loss"])


def test_hspmd_run_on_the_emulated_gpu_logs_the_cpu_losses_with_batches_made_ahead(tmp_path):
    gpu, cpu = tmp_path / "gpu.jsonl", tmp_path / "cpu.jsonl"
    env = {"HSPMD_EMULATE_GPU": "1"}
    script = os.path.join(EXAMPLES, "mlp.py")
    run_cli("hspmd", "run", "-n", "1", script, "--device", "cuda", "--steps", "5", "--log", str(gpu), env=env, check=True)
    run_cli("hspmd", "run", "-n", "1", script, "--device", "cpu", "--steps", "5", "--log", str(cpu), env=env, check=True)
    read = [[json.loads(line)["loss"] for line in open(p)] for p in (gpu, cpu)]
    assert len(read[0]) == 5
    np.testing.assert_allclose(read[0], read[1], rtol=1e-6)
