"""Stacked layers (`stack-layers`, `graph.scan`): the same numbers as calls, IR flat in the layer count.

* stacked names and `Layout.shift_dims` (hypothesis);
* training with the layers stacked gives bit-identical parameters to the calls, for random
  models under each kind of strategy (1 device, dp, tp, sp, ZeRO, unlike groups, dp over rows
  it does not divide, pipelines) on the in-process communicator: a run tests one case of each
  kind (`_kind`), sampled by its seed (`HSPMD_TEST_SEED`, printed in pytest's header; the test ids
  name the cases), and successive runs cover every case;
* the physical IR does not grow with the layer count;
* a pipeline cuts the stacks at its stage boundaries;
* what stays calls: pipelines beside other groups, mixtures of experts, and chains that differ
  in more than their parameters and counters.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import EXAMPLES, sampled_kinds
from hspmd.compiler import compile_script, write_bundle
from hspmd.dialects import graph
from hspmd.dialects.levels import physical_groups
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.ir.layout import DUP, PARTIAL, DistributedStates, Layout, LayoutError, split
from hspmd.ir.stacked_names import is_stacked, layer_names, layer_range, slice_name, stack_name
from hspmd.runtime.comm import run_spmd
from hspmd.dialects.dist import layout_of
from hspmd.runtime.worker import CheckpointOptions, train

SMALL = ["model.d_model=32", "model.seq_len=8", "model.heads=4", "data.batch_size=4", "optim.warmup=1"]


# ----------------------------------------------------------------------------- names and layouts

@given(st.lists(st.sampled_from(["blocks", "h", "attn", "w", "b0"]), min_size=1, max_size=4),
       st.integers(0, 3), st.integers(0, 50), st.integers(2, 30), st.integers(1, 6), st.data())
def test_stack_name_round_trips(parts, where, start, count, step, data):
    where = min(where, len(parts))
    regular = data.draw(st.booleans())
    numbers = ([start + i * step for i in range(count)] if regular
               else sorted(data.draw(st.sets(st.integers(0, 200), min_size=2, max_size=30))))
    count = len(numbers)
    names = [".".join([*parts[:where], str(k), *parts[where:]]) for k in numbers]
    stacked = stack_name(names)
    assert stacked is not None and is_stacked(stacked)
    assert layer_names(stacked) == names
    assert list(layer_range(stacked)) == numbers
    if regular:
        assert (f":{step}]" in stacked) == (step > 1) and "," not in stacked  # one range, a step where it skips
    a = data.draw(st.integers(0, count - 1))
    b = data.draw(st.integers(a + 1, count))
    piece = slice_name(stacked, a, b)
    assert layer_names(piece) == names[a:b]
    assert b - a == 1 or piece == stack_name(names[a:b])  # a piece is named as its layers stacked


def test_layers_numbered_irregularly_stack_as_several_ranges():
    assert stack_name(["a.0.w", "a.2.w", "a.3.w"]) == "a.[0:4:2,3:4].w"
    assert stack_name([f"m.layers.{k}.w" for k in (0, 1, 2, 4, 5, 6, 7, 9, 10)]) == "m.layers.[0:3,4:8,9:11].w"
    assert layer_names("x.[0:2,5:9:2].w") == ["x.0.w", "x.1.w", "x.5.w", "x.7.w"]
    assert layer_range("x.[0:2,1:3].w") is None  # not counting up: no stacked name


@pytest.mark.parametrize("names", [
    ["a.0.w"],                    # one layer is no stack
    ["a.2.w", "a.0.w"],           # counting down
    ["a.0.w", "b.1.w"],           # two components differ
    ["a.0.w", "a.1.v"],
    ["a.00.w", "a.01.w"],         # not plain decimals
    ["a.x.w", "a.y.w"],
    ["a.[0:2].w", "a.[2:4].w"],   # already stacked
])
def test_names_that_do_not_stack(names):
    assert stack_name(names) is None


def test_plain_names_are_one_layer():
    assert layer_names("head.weight") == ["head.weight"] and layer_range("head.weight") is None
    assert layer_names("opt.m.blocks.[2:4].ln.weight") == ["opt.m.blocks.2.ln.weight", "opt.m.blocks.3.ln.weight"]


_axes = st.sampled_from([DUP, PARTIAL, split(0), split(1), split(2)])


@given(st.lists(st.tuples(_axes, st.integers(1, 3)), max_size=3, unique_by=lambda p: p[0]),
       st.integers(1, 4), st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)))
def test_shift_dims_lays_out_each_layer_as_one(axes, layers, base):
    states = DistributedStates(tuple(axes))
    layout = Layout.spmd(tuple(range(states.num_devices)), states)
    shape = tuple(b * max(1, dict(axes).get(split(d), 1)) for d, b in enumerate(base))
    stacked = layout.shift_dims(1)
    assert stacked.shift_dims(-1) == layout
    for device in layout.devices:  # each device holds every layer's piece, the stacking dim whole
        assert stacked.local_shape(device, (layers, *shape)) == (layers, *layout.local_shape(device, shape))
        assert stacked.slices(device, (layers, *shape))[1:] == layout.slices(device, shape)


def test_shift_dims_refuses_to_drop_a_split_dim():
    with pytest.raises(LayoutError, match="splits dim 0"):
        Layout.spmd((0, 1), DistributedStates.of((split(0), 2))).shift_dims(-1)


# ----------------------------------------------------------------------------- the same numbers

def _script(example: str, layers: int, extra=()):
    return load_script(os.path.join(EXAMPLES, example),
                       parse_overrides([*SMALL, f"model.layers={layers}", "steps=3", *extra]))


def _train(tmp_path, script, strategy: str, n: int, stack: bool, tag: str, kernels: str = "cpu"):
    bundle = tmp_path / f"{tag}-{'stacked' if stack else 'calls'}"
    compiled = compile_script(script, strategy, n, stack_layers=stack)
    assert any(isinstance(o, graph.ScanOp) for o in compiled.logical.walk()) == stack
    write_bundle(compiled, str(bundle))
    return run_spmd(n, lambda comm: train(str(bundle), comm, steps=3, quiet=True, kernels=kernels), timeout=300)[0]


# each kind of strategy once, with models, depths and kernels varied across them
CASES = [(1, "[0]: dp=1", "gpt.py", 3, 4, "numpy", []),
         (1, "[0]: dp=1", "gpt.py", 2, 4, "cpu", ["model.dropout=0.1"]),  # a per-layer counter, stacked
         (2, "[0,1]: dp=2", "llama.py", 2, 2, "cpu", ["precision=bfloat16"]),  # casts of stacked weights
         (2, "[0,1]: tp=2", "gpt.py", 4, 2, "cpu", []),
         (4, "[0-3]: dp=2 tp=2 sp=1", "llama.py", 3, 4, "cpu", []),
         (2, "[0,1]: dp=2 zero=1", "gpt.py", 2, 4, "numpy", []),
         (3, "[0,1]: tp=2 share=2 | [2]: tp=1 share=1", "gpt.py", 3, 2, "cpu", []),
         (3, "[0-2]: dp=3", "llama.py", 2, 4, "numpy", []),
         (2, "[0,1]: pp=2", "gpt.py", 3, 4, "cpu", ["microbatches=2", "model.dropout=0.1"]),
         (4, "[0-3]: tp=2 pp=2", "llama.py", 4, 2, "cpu", ["pipeline_schedule=1f1b"])]


def _kind(case) -> str:
    """The kind of strategy of a case: one device, dp, tp, sp, ZeRO, unlike groups or a pipeline."""
    strategy = case[1]
    return next(k for k in ("|", "pp=", "zero=", "sp=", "tp=", "dp=1", "dp=") if k in strategy)


@pytest.mark.parametrize("n, strategy, example, layers, heads, kernels, extra", sampled_kinds(CASES, _kind, "stack"))
def test_stacked_layers_train_the_bits_of_calls(tmp_path, n, strategy, example, layers, heads, kernels, extra):
    """A run tests one case of each kind (`_kind`) of `CASES`, sampled by its seed."""
    script = _script(example, layers, [f"model.heads={heads}", *extra])
    calls = _train(tmp_path, script, strategy, n, False, "a", kernels)
    stacked = _train(tmp_path, script, strategy, n, True, "b", kernels)
    assert stacked.losses == calls.losses
    assert set(stacked.params) == set(calls.params)  # per-layer names, as the calls have them
    for name, value in calls.params.items():
        np.testing.assert_array_equal(stacked.params[name], value, err_msg=name)


def test_a_stacked_run_resumes_as_a_pipeline(tmp_path):
    """A checkpoint of a stacked run names each layer: a pipeline, whose stages hold other pieces of
    the stacks, resumes it with the same losses."""
    script = _script("gpt.py", 4, ["steps=4"])
    whole = tmp_path / "whole"
    write_bundle(compile_script(script, "[0,1]: dp=2", 2), str(whole))
    ref = run_spmd(2, lambda comm: train(str(whole), comm, steps=4, quiet=True), timeout=300)[0]
    ck = tmp_path / "ck"
    run_spmd(2, lambda comm: train(str(whole), comm, steps=2, quiet=True,
                                   checkpoints=CheckpointOptions(directory=str(ck))), timeout=300)
    piped = tmp_path / "piped"
    compiled = compile_script(script, "[0,1]: pp=2 layers=3:1", 2)
    names = {o.tensor_name.data for o in compiled.physical.walk() if isinstance(o, graph.ParameterOp)}
    assert {"blocks.[0:3].attn.qkv.weight", "blocks.[3:4].attn.qkv.weight"} <= names
    write_bundle(compiled, str(piped))
    resumed = run_spmd(2, lambda comm: train(str(piped), comm, steps=4, quiet=True,
                                             checkpoints=CheckpointOptions(resume=str(ck))), timeout=300)[0]
    np.testing.assert_allclose(resumed.losses, ref.losses[2:], rtol=1e-5)


# ----------------------------------------------------------------------------- the IR

def _physical_bytes(layers: int, strategy: str = "[0]: dp=1", n: int = 1) -> int:
    compiled = compile_script(_script("gpt.py", layers), strategy, n)
    return sum(len(str(module)) for _, module in physical_groups(compiled.physical))


@pytest.mark.parametrize("strategy, n", [("[0]: dp=1", 1), ("[0-3]: dp=2 tp=2", 4)])
def test_physical_ir_does_not_grow_with_layers(strategy, n):
    small, large = _physical_bytes(2, strategy, n), _physical_bytes(16, strategy, n)
    assert large <= small * 1.02, (small, large)


def test_stacked_parameters_and_one_scan_each_way():
    compiled = compile_script(_script("gpt.py", 3), "[0,1]: tp=2", 2)
    params = {o.tensor_name.data: graph.tensor_shape(o.result) for o in compiled.logical.walk()
              if isinstance(o, graph.ParameterOp)}
    assert params["blocks.[0:3].attn.qkv.weight"] == (3, 32, 96)
    assert params["opt.m.blocks.[0:3].attn.qkv.weight"] == (3, 32, 96)
    assert not any(n.startswith("blocks.0.") for n in params)
    scans = [o for o in compiled.physical.walk() if isinstance(o, graph.ScanOp)]
    assert [s.is_reverse for s in scans] == [False, True]
    layouts = {o.tensor_name.data: str(layout_of(o.global_type)) for o in compiled.physical.walk()
               if isinstance(o, graph.ParameterOp)}
    assert layouts["blocks.[0:3].attn.qkv.weight"] == "[0,1]: split(2)=2"  # column-parallel, per layer
    assert layouts["blocks.[0:3].attn.proj.weight"] == "[0,1]: split(1)=2"  # row-parallel, per layer


@pytest.mark.parametrize("strategy, n, pieces", [("[0,1]: pp=2", 2, [(0, 4), (4, 8)]),
                                                  ("[0-2]: pp=3 layers=2:5:1", 3, [(0, 2), (2, 7), (7, 8)])])
def test_a_pipeline_cuts_the_stacks_at_its_stages(strategy, n, pieces):
    """Each stage holds its piece of every stack and one scan each way, whatever its layer count."""
    compiled = compile_script(_script("gpt.py", 8), strategy, n)
    for s, ((_, module), (a, b)) in enumerate(zip(physical_groups(compiled.physical), pieces)):
        names = {o.tensor_name.data for o in module.walk() if isinstance(o, graph.ParameterOp)}
        assert f"blocks.[{a}:{b}].mlp.fc.weight" in names and f"opt.m.blocks.[{a}:{b}].mlp.fc.weight" in names, s
        scans = [o for o in module.walk() if isinstance(o, graph.ScanOp)]
        assert sorted(o.is_reverse for o in scans) == [False, True] and {o.num_iterations for o in scans} == {b - a}
    assert not any(o.attributes.get("pipeline.layer_stage") for o in compiled.physical.walk())


def test_hetero_pipelines_and_moe_keep_their_calls():
    piped = compile_script(_script("gpt.py", 4, ["data.batch_size=6"]), "[0-3]: tp=2 pp=2 share=2 | [4,5]: tp=2", 6)
    assert not any(isinstance(o, graph.ScanOp) for o in piped.logical.walk())
    moe = load_script(os.path.join(EXAMPLES, "moe.py"), parse_overrides([*SMALL, "model.layers=4"]))
    compiled = compile_script(moe, "[0]: dp=1", 1)  # blocks alternate with MoE blocks: no chain
    assert not any(isinstance(o, graph.ScanOp) for o in compiled.logical.walk())
