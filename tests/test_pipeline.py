"""Pipeline parallelism: `pipeline-split` cuts the step into stages; the runtime walks the schedule.

MLP and GPT on `[0,1]: pp=2` train with exactly the losses and final parameters of one device;
activations go forward and their gradients backward with comm.send/recv; each stage holds and
updates only its parameters. With m micro-batches (GPipe or 1F1B order) the gradients are
summed before the update and the numbers equal one device's to round-off. A stage's program
has one forward and one backward whatever m; the plan lays out the schedule's actions (the
pure functions of `hspmd.ir.pipeline_schedule`, also checked here).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import EXAMPLES
from xdsl.dialects import func

from hspmd.ir.stacked_names import layer_names
from hspmd.dialects import comm, graph, pipeline
from hspmd.compiler import compile_script, write_bundle
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.dialects.levels import physical_groups
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.comm.inprocess import InProcessCommunicator
from hspmd.codegen.schedule.flatten import flatten
from hspmd.runtime.plan import build_plan
from hspmd.ir.pipeline_schedule import (
    PipelineScheduleError,
    check_schedule,
    gpipe,
    in_flight,
    one_f_one_b,
)
from hspmd.runtime.worker import train
from hspmd.transforms.util import PassError

STEPS = 3
SMALL = {
    "mlp.py": ["batch_size=16", "hidden=32"],
    "gpt.py": ["model.d_model=32", "model.seq_len=8", "model.heads=4", "model.layers=2", "data.batch_size=4",
              "optim.warmup=1"],
    "llama.py": ["model.d_model=32", "model.seq_len=8", "model.heads=2", "model.layers=2", "data.batch_size=4",
                "optim.warmup=1"],
}
_reference: dict[str, object] = {}


def _script(example: str, extra=()):
    return load_script(os.path.join(EXAMPLES, example), parse_overrides(SMALL[example] + [f"steps={STEPS}", *extra]))


def _train(tmp_path, example: str, strategy: str, n: int, extra=(), **kw):
    bundle = tmp_path / f"{example}-{n}-{'-'.join(extra)}-{kw.get('microbatches', 1)}"
    write_bundle(compile_script(_script(example, extra), strategy, n, **kw), str(bundle))
    return run_spmd(n, lambda c: train(str(bundle), c, steps=STEPS, quiet=True), timeout=300)


def _one_device(tmp_path, example: str):
    if example not in _reference:
        _reference[example] = _train(tmp_path, example, "[0]: dp=1", 1)[0]
    return _reference[example]


def _stage_params(compiled) -> list[set[str]]:
    return [{o.tensor_name.data for o in g.walk() if isinstance(o, graph.ParameterOp)}
            for _, g in physical_groups(compiled.physical)]


@pytest.mark.parametrize("example, strategy, n, m, schedule", [
    ("mlp.py", "[0,1]: pp=2", 2, 1, "gpipe"),
    ("gpt.py", "[0,1]: pp=2", 2, 1, "gpipe"),
    ("mlp.py", "[0,1]: pp=2", 2, 4, "gpipe"),
    ("gpt.py", "[0,1]: pp=2", 2, 4, "gpipe"),
    ("mlp.py", "[0-2]: pp=3", 3, 4, "1f1b"),
    ("gpt.py", "[0,1]: pp=2", 2, 4, "1f1b"),
])
def test_pipeline_equals_one_device(tmp_path, example, strategy, n, m, schedule):
    ref = _one_device(tmp_path, example)
    ranks = _train(tmp_path, example, strategy, n, microbatches=m, pipeline_schedule=schedule)
    print(f"\n{example} {strategy} m={m} {schedule}: losses {ranks[0].losses} (1 device {ref.losses})")
    for r in ranks:  # every stage reports the loss (the last stage sends it)
        np.testing.assert_allclose(r.losses, ref.losses, rtol=1e-5)
    got = ranks[0].params
    assert set(got) == set(ref.params)
    # with m=1 every stage computes exactly the 1-device numbers; micro-batches sum gradients in
    # another order, and Adam may move an element whose gradient is at round-off level by part of lr
    atol = 0 if m == 1 else 5e-5
    for name, value in ref.params.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5 if m > 1 else 0, atol=atol, err_msg=name)


def test_mixed_precision_stages_hold_the_layers_float32_stages_hold(tmp_path):
    """Under bfloat16 each parameter is cast where a layer reads it: the stages still hold the
    parameters their layers read (the head and final norm on the last stage, not on the first
    through their casts), as in float32, and the pipeline gives the 1-device bfloat16 losses."""
    extra = ["model.layers=4", "precision='bfloat16'"]
    f32 = compile_script(_script("gpt.py", ["model.layers=4"]), "[0,1]: pp=2", 2)
    bf16 = compile_script(_script("gpt.py", extra), "[0,1]: pp=2", 2)
    assert _stage_params(bf16) == _stage_params(f32)
    assert "head.weight" in _stage_params(bf16)[1] and "wte.weight" in _stage_params(bf16)[0]
    ref = _train(tmp_path, "gpt.py", "[0]: dp=1", 1, extra)[0]
    for r in _train(tmp_path, "gpt.py", "[0,1]: pp=2", 2, extra):
        np.testing.assert_allclose(r.losses, ref.losses, rtol=1e-5)


def _stage_ops(compiled) -> list[list[tuple[str, list[str]]]]:
    """Return each stage's functions with the names of their ops, in order."""
    return [[(f.sym_name.data, [o.name for o in f.walk()]) for f in g.body.block.ops]
            for _, g in physical_groups(compiled.physical)]


@pytest.mark.parametrize("strategy, n, m, schedule", [
    ("[0,1]: pp=2", 2, 2, "1f1b"),
    ("[0-3]: dp=2 pp=2", 4, 2, "gpipe"),
])
def test_dropout_in_micro_batches_equals_one_device(tmp_path, strategy, n, m, schedule):
    """A micro-batch's dropout masks are keyed by its rows' indices in the whole batch: one device's."""
    extra = ["model.dropout=0.2"]
    ref = _train(tmp_path, "gpt.py", "[0]: dp=1", 1, extra)[0]
    ranks = _train(tmp_path, "gpt.py", strategy, n, extra, microbatches=m, pipeline_schedule=schedule)
    for r in ranks:
        np.testing.assert_allclose(r.losses, ref.losses, rtol=1e-5)
    compiled = compile_script(_script("gpt.py", extra), strategy, n, microbatches=m, pipeline_schedule=schedule)
    drops = [o for o in compiled.physical.walk() if isinstance(o, graph.DropoutOp)]
    assert drops and all(o.microbatches.value.data == m and o.microbatch_dim.value.data == 0 for o in drops)


def test_stage_programs_do_not_grow_with_micro_batches():
    """One forward and one backward per stage; the micro-batch count is an attribute the runtime reads."""
    ops = {m: _stage_ops(compile_script(_script("gpt.py", ["data.batch_size=8"]), "[0,1]: pp=2", 2,
                                        microbatches=m, pipeline_schedule="1f1b")) for m in (1, 2, 4, 8)}
    assert ops[1] == ops[2] == ops[4] == ops[8]
    compiled = compile_script(_script("gpt.py"), "[0,1]: pp=2", 2, microbatches=4)
    (_, g0), (_, g1) = physical_groups(compiled.physical)
    for g, name in ((g0, "ids@mb"), (g1, "targets@mb")):
        inputs = {o.tensor_name.data: o.result.type.get_shape() for o in g.walk() if isinstance(o, graph.InputOp)}
        assert inputs == {name: (4, 1, 8), "lr": ()}  # the batch as 4 micro-batches of 1 row
        (run,) = [o for o in g.walk() if isinstance(o, pipeline.RunOp)]
        assert run.schedule.data == "gpipe" and run.ints()[:3] == (0 if g is g0 else 1, 2, 4)
        assert sorted(f.sym_name.data for f in g.walk() if isinstance(f, func.FuncOp)) == \
            ["Block_0_bwd", "Block_0_fwd", "pipeline_backward", "pipeline_forward", "train_step"]


def _p2p_order(compiled, stage: int) -> list[str]:
    """Return the sends and receives of activations (and their gradients) in the order the plan of a
    stage's first rank runs them: the schedule as the runtime walks it."""
    _, group = physical_groups(compiled.physical)[stage]
    step = next(f for f in group.body.block.ops if isinstance(f, func.FuncOp) and f.sym_name.data == "train_step")
    flat = flatten(step)
    return [n.op.name[5:] for n in flat.nodes if isinstance(n.op, (comm.SendOp, comm.RecvOp))
            and len(n.op.operands[0].type.get_shape() if isinstance(n.op, comm.SendOp)
                    else n.op.result.type.get_shape()) == 3]


def test_runtime_walks_the_schedule():
    gpipe_ = compile_script(_script("gpt.py"), "[0,1]: pp=2", 2, microbatches=4)
    one_f = compile_script(_script("gpt.py"), "[0,1]: pp=2", 2, microbatches=4, pipeline_schedule="1f1b")
    # stage 0 sends activation i after F(i) and receives gradient i in B(i)
    assert _p2p_order(gpipe_, 0) == ["send"] * 4 + ["recv"] * 4
    assert _p2p_order(one_f, 0) == ["send", "send", "recv", "send", "recv", "send", "recv", "recv"]
    assert _p2p_order(one_f, 1) == ["recv", "send"] * 4  # F0 B0 F1 B1 ...
    # 1F1B keeps at most 2 micro-batches' activations on stage 0, GPipe all 4: the plan's peak shows it
    peaks = {name: [build_plan(next(f for f in g.body.block.ops if isinstance(f, func.FuncOp)
                                    and f.sym_name.data == "train_step"), d[0],
                               InProcessCommunicator.create_world(2)[d[0]], allocate=False).peak_bytes
                    for d, g in physical_groups(c.physical)] for name, c in (("gpipe", gpipe_), ("1f1b", one_f))}
    assert peaks["1f1b"][0] < peaks["gpipe"][0]


def test_bad_micro_batches_are_refused():
    with pytest.raises(PassError, match="input 'ids' has batch dim 4, which 3 micro-batches do not divide"):
        compile_script(_script("gpt.py"), "[0,1]: pp=2", 2, microbatches=3)
    with pytest.raises(PassError, match="unknown schedule 'zigzag'"):
        compile_script(_script("gpt.py"), "[0,1]: pp=2", 2, microbatches=2, pipeline_schedule="zigzag")


def test_stages_hold_their_layers_and_pass_activations():
    compiled = compile_script(_script("gpt.py"), "[0,1]: pp=2", 2)
    first, last = _stage_params(compiled)
    # the stacked layers cut at the stage boundary: each stage's piece of every stack
    assert "wte.weight" in first and "blocks.[0:1].attn.qkv.weight" in first and "opt.m.blocks.[0:1].mlp.fc.weight" in first
    assert "head.weight" in last and "blocks.[1:2].attn.qkv.weight" in last and "ln_f.weight" in last
    assert not (first & last) - {"opt.step", "opt.beta1_pow", "opt.beta2_pow"}
    (_, g0), (_, g1) = physical_groups(compiled.physical)
    sends0 = [o.input.type.get_shape() for o in g0.walk() if isinstance(o, comm.SendOp)]
    sends1 = [o.input.type.get_shape() for o in g1.walk() if isinstance(o, comm.SendOp)]
    assert [s for s in sends0 if s] == [(4, 8, 32)]  # the activation after block 0
    assert (4, 8, 32) in sends1  # its gradient
    assert sum(1 for s in sends0 if not s) == 1  # and the scalar of gradient-norm clipping
    assert not any(isinstance(o, (comm.AllReduceOp, comm.AllGatherOp)) for o in compiled.physical.walk())


def test_more_stages_than_layers_is_refused():
    with pytest.raises(PassError) as err:
        compile_script(_script("gpt.py", ["model.layers=2"]), "[0-2]: pp=3", 3)
    text = str(err.value)
    assert "pp=3" in text and "2 layers" in text, text


# ----------------------------------------------------------------------------- schedules


@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
@pytest.mark.parametrize("stages, m", [(1, 1), (2, 1), (2, 4), (3, 2), (4, 8), (4, 3)])
def test_schedules_are_complete_and_run(make, stages, m):
    schedule = make(stages, m)
    assert len(schedule) == stages
    order = check_schedule(schedule, m)
    assert len(order) == 2 * stages * m
    seen = set()
    for s, (kind, i) in order:  # dependencies between stages hold in the global order
        if kind == "F" and s > 0:
            assert (s - 1, ("F", i)) in seen
        if kind == "B":
            assert (s, ("F", i)) in seen
            if s + 1 < stages:
                assert (s + 1, ("B", i)) in seen
        seen.add((s, (kind, i)))


@pytest.mark.parametrize("stages, m", [(2, 4), (4, 8), (4, 3), (3, 1)])
def test_in_flight_micro_batches(stages, m):
    for s, acts in enumerate(gpipe(stages, m)):
        assert in_flight(acts) == m
    for s, acts in enumerate(one_f_one_b(stages, m)):
        assert in_flight(acts) <= min(stages - s, m)
        assert in_flight(acts) <= stages


def test_one_f_one_b_order():
    assert one_f_one_b(2, 4) == [
        [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)],
        [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)],
    ]


def test_bad_schedules_are_refused():
    with pytest.raises(PipelineScheduleError, match="backward comes before its forward"):
        check_schedule([[("B", 0), ("F", 0)]], 1)
    with pytest.raises(PipelineScheduleError, match="once"):
        check_schedule([[("F", 0)]], 1)
    with pytest.raises(PipelineScheduleError, match="cannot go on"):  # stage 1 waits for F1, stage 0 for B0
        check_schedule([[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 1), ("F", 0), ("B", 0), ("B", 1)]], 2)
    with pytest.raises(PipelineScheduleError, match="stages >= 1"):
        gpipe(0, 2)


# ----------------------------------------------------------------------------- the pipeline.run op

_RUN = """builtin.module {
  func.func @train_step(%0: tensor<4xf32>, %1: tensor<2x3xi32>) {
    %2, %3 = pipeline.run @pipeline_forward, @pipeline_backward(%0) (%1) {schedule = "SCHED", stage = 0 : i64, stages = 2 : i64, microbatches = M : i64, stash = 1 : i64} : (tensor<4xf32>) (tensor<2x3xi32>) -> (tensor<4xf32>, tensor<4xf32>)
    func.return
  }
  func.func @pipeline_forward(%0: tensor<4xf32>, %1: tensor<3xi32>) -> (tensor<4xf32>, tensor<4xf32>) {
    func.return %0, %0 : tensor<4xf32>, tensor<4xf32>
  }
  func.func @pipeline_backward(%0: tensor<4xf32>, %1: tensor<3xi32>, %2: tensor<4xf32>) -> tensor<4xf32> {
    func.return %2 : tensor<4xf32>
  }
}
"""


def test_pipeline_run_prints_parses_and_verifies():
    from hspmd.dialects.context import IRTextError, parse_module

    text = _RUN.replace("SCHED", "1f1b").replace("M :", "2 :")
    module = parse_module(text)
    assert str(module) + "\n" == text
    (run,) = [o for o in module.walk() if isinstance(o, pipeline.RunOp)]
    assert pipeline.actions(run) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    for bad, words in [
        (text.replace('"1f1b"', '"zigzag"'), "unknown schedule 'zigzag'"),
        (text.replace("microbatches = 2", "microbatches = 3"), "leading dim of 3"),
        (text.replace("@pipeline_backward(%0)", "@nowhere(%0)"), "no @nowhere"),
        (text.replace("stash = 1", "stash = 0"), "stashed results"),
    ]:
        with pytest.raises(IRTextError, match=words):
            parse_module(bad)


def test_stages_are_balanced_by_cost():
    from hspmd.transforms.pipeline.balance import balanced_counts as _balanced_counts

    assert _balanced_counts([10] * 4, 0, 0, 2) == (2, 2)
    assert _balanced_counts([10] * 4, 1, 0, 3) == (1, 2, 1)  # the embedding's cost keeps stage 0 light
    assert _balanced_counts([10] * 3, 0, 0, 2) == (2, 1)  # a tie: the earlier stage takes more
    assert _balanced_counts([10] * 3, 0, 5, 2) == (2, 1)
    assert _balanced_counts([40, 10, 10, 10], 0, 0, 2) == (1, 3)
    compiled = compile_script(_script("gpt.py", ["model.layers=6"]), "[0-3]: pp=4", 4)
    blocks = [len(layer_names(next(n for n in names if n.startswith("blocks.") and n.endswith("ln1.weight"))))
              for names in _stage_params(compiled)]  # each stage's piece of the stacks: its layers
    assert blocks == [1, 2, 2, 1]  # the first and last stages also run the embedding and the head
