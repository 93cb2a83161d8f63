"""`multi-tensor`: the optimizer's per-parameter kernels of a GPU program in a few launches,
with the bits of the launches it replaces (on the emulated device, blocks of 1 and of 4 threads)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import EXAMPLES, train_plan, train_step

from hspmd.compiler import compile_script
from hspmd.dialects import kernel
from hspmd.frontend.script import load_script
from hspmd.runtime.cuda.emulated import EmulatedDevice
from hspmd.runtime.cuda.plan import build_device_plan
from hspmd.transforms import multi_tensor
from hspmd.transforms.device_kernels import device_module
from hspmd.transforms.multi_tensor import multi_tensor_module

CASES = {
    "gpt-adam": ("gpt.py", {"model.layers": 2, "model.d_model": 32, "model.heads": 2, "model.seq_len": 16}),
    "llama": ("llama.py", {"model.layers": 2, "model.d_model": 32, "model.seq_len": 16}),
    "mlp-sgd": ("mlp.py", {}),
}


def _programs(name: str):
    """Return (script, compiled, the device program without `multi-tensor`, with it)."""
    script_name, overrides = CASES[name]
    script = load_script(os.path.join(EXAMPLES, script_name), overrides)
    compiled = compile_script(script, "[0]: dp=1", 1)
    ((_, fused),) = compiled.kernel_groups()
    apart = fused.clone()
    device_module(apart)
    together = apart.clone()
    multi_tensor_module(together)
    return script, compiled, apart, together


def _optimizer_kernels(module) -> list[kernel.FusedOp]:
    return [op for op in module.walk() if isinstance(op, kernel.FusedOp)
            and any(o.dialect_name() == "optim" for o in op.body.block.ops)]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    return request.param, _programs(request.param)


def test_the_updates_of_all_parameters_are_one_launch(case):
    _, (_, compiled, apart, together) = case
    before, after = _optimizer_kernels(apart), _optimizer_kernels(together)
    merged = [op for op in after if op.pieces is not None]
    assert len(merged) >= 1 and len(after) < len(before)
    for op in merged:
        (launch,) = op.launch_list
        assert launch[0] == "row" and launch[3] == multi_tensor.CHUNK
        assert launch[2] == sum(-(-n // multi_tensor.CHUNK) for n in op.pieces.get_values())


def _same_bits(script, compiled, apart, together, team: int, steps: int) -> None:
    ref, ref_params = train_plan(build_device_plan(train_step(apart), 0, EmulatedDevice(team)), script, compiled, steps)
    got, params = train_plan(build_device_plan(train_step(together), 0, EmulatedDevice(team)), script, compiled, steps)
    assert got == ref
    for k in ref_params:
        np.testing.assert_array_equal(params[k], ref_params[k], err_msg=k)


def test_the_multi_tensor_launch_gives_the_bits_of_the_launches_it_replaces(case):
    _, programs = case
    _same_bits(*programs, team=1, steps=3)


def test_with_blocks_of_several_threads_each_piece_strides_over_its_chunk():
    """Blocks of 4 emulated threads (threadIdx striding a chunk, as on a GPU): the same bits."""
    _same_bits(*_programs("mlp-sgd"), team=4, steps=2)


def test_the_updates_stay_in_place(case):
    """The merged kernel writes p, m, v over the parameters' arrays, as the kernels it replaces
    did: the arena and the copies after the step do not grow."""
    _, (script, compiled, apart, together) = case
    a = build_device_plan(train_step(apart), 0, EmulatedDevice())
    b = build_device_plan(train_step(together), 0, EmulatedDevice())
    assert b.peak_bytes <= a.peak_bytes
    assert len(b.assign_copies) <= len(a.assign_copies)
    assert len(b.calls) < len(a.calls)


def test_launches_are_split_by_their_pieces_and_pointers(monkeypatch):
    script, compiled, apart, _ = _programs("gpt-adam")
    monkeypatch.setattr(multi_tensor, "MAX_PIECES", 3)
    few = apart.clone()
    multi_tensor_module(few)
    merged = [op for op in _optimizer_kernels(few) if op.pieces is not None]
    assert len(merged) >= 2 and all(len(op.pieces.get_values()) <= 3 for op in merged)
    monkeypatch.setattr(multi_tensor, "MAX_PIECES", 64)
    monkeypatch.setattr(multi_tensor, "MAX_POINTERS", 20)
    narrow = apart.clone()
    multi_tensor_module(narrow)
    for op in _optimizer_kernels(narrow):
        if op.pieces is not None:
            assert len(op.inputs) + len(op.outputs) <= 20
    ref = train_plan(build_device_plan(train_step(apart), 0, EmulatedDevice()), script, compiled, 2)[0]
    assert train_plan(build_device_plan(train_step(few), 0, EmulatedDevice()), script, compiled, 2)[0] == ref
    assert train_plan(build_device_plan(train_step(narrow), 0, EmulatedDevice()), script, compiled, 2)[0] == ref


def test_the_multi_tensor_kernels_compile_with_nvrtc():
    from hspmd.codegen.nvrtc_check import check_module, nvrtc_status

    ok, why = nvrtc_status()
    if not ok:
        pytest.skip(f"NVRTC is not available here: {why}")
    *_, together = _programs("gpt-adam")
    assert all(size > 0 for size in check_module(together).values())


@pytest.mark.gpu
def test_on_a_gpu_the_multi_tensor_launch_gives_the_bits_of_the_launches_it_replaces(gpu):
    script, compiled, apart, together = _programs("gpt-adam")
    ref, ref_params = train_plan(build_device_plan(train_step(apart), 0, gpu), script, compiled, 3)
    got, params = train_plan(build_device_plan(train_step(together), 0, gpu), script, compiled, 3)
    assert got == ref
    for k in ref_params:
        np.testing.assert_array_equal(params[k], ref_params[k], err_msg=k)
