"""Heterogeneous data parallelism (HetSeq-style): device groups with unequal batch shares.

`[0,1]: dp=2 share=3 | [2]: dp=1 share=1` on 3 ranks: parameters replicated in every group,
the batch split 3:1 across the groups and over dp inside a group. The MLP and the GPT train
with the losses and final parameters of the 1-device run; the weight gradients are partial
sums per group (`hetero=partial`) that one flat all_reduce over all devices makes whole.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from conftest import EXAMPLES, run_cli
from test_spmd_property import _run_mlp, check_property, make_batch, programs
from hspmd.dialects import graph
from hspmd.dialects.dist import ReshardOp, layout_of
from hspmd.compiler import compile_script, write_bundle
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.ir.layout import DUP, DistributedStates, Group, Layout, LayoutError, apportion, split
from hspmd.runtime.checkpoint import load_checkpoint
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.worker import train
from hspmd.transforms.util import PassError

STEPS = 4
HETERO = "[0,1]: dp=2 share=3 | [2]: dp=1 share=1"
SMALL = {
    "mlp.py": ["batch_size=16", "hidden=32"],  # 16 rows: 12 (6 per rank) and 4
    "gpt.py": ["model.d_model=32", "model.seq_len=8", "model.heads=4", "model.layers=2", "data.batch_size=8",
              "optim.warmup=1"],  # 8 sequences: 6 (3 per rank) and 2
}

_reference: dict[str, object] = {}


def _script(example: str, extra=()):
    return load_script(os.path.join(EXAMPLES, example), parse_overrides(SMALL[example] + [f"steps={STEPS}", *extra]))


def _train(tmp_path, example: str, strategy: str, n: int, optimizer=True, extra=()):
    bundle = tmp_path / f"{example}-{n}-{abs(hash((strategy, optimizer is True, extra)))}"
    write_bundle(compile_script(_script(example, extra), strategy, n, optimizer=optimizer), str(bundle))
    return run_spmd(n, lambda comm: train(str(bundle), comm, steps=STEPS, quiet=True, keep_outputs=True),
                    timeout=300)


@pytest.mark.parametrize("example", ["mlp.py", "gpt.py"])
def test_hetero_data_parallel_equals_one_device(tmp_path, example):
    if example not in _reference:
        _reference[example] = _train(tmp_path, example, "[0]: dp=1", 1)[0]
    ref = _reference[example]
    ranks = _train(tmp_path, example, HETERO, 3)
    print(f"\n{example} {HETERO}: losses {ranks[0].losses} (1 device {ref.losses})")
    for got in ranks:  # every rank sees the global loss
        assert len(got.losses) == STEPS
        np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-4)
    got = ranks[0]
    assert set(got.params) == set(ref.params)
    # as in test_tensor_parallel: Adam may move round-off-level gradients by a part of lr
    atol = 5e-5 if example == "gpt.py" else 1e-6
    for name, value in ref.params.items():
        np.testing.assert_allclose(got.params[name], value, rtol=1e-5, atol=atol, err_msg=name)


@pytest.mark.parametrize("strategy", ["[0,1]: dp=2 share=3 | [2]: dp=1 share=1", "[0]: dp=1 share=1 | [1,2]: dp=2 share=1",
                                      "[0]: dp=1 share=5 | [1]: dp=1 share=3 | [2]: dp=1 share=1"])
def test_unequal_shares_give_the_one_device_gradient(tmp_path, strategy):
    """The loss is sum(per-sample) * (1/B) with the global B, so no reweighting by share is needed:
    the groups' partial gradients (each over its own rows, already scaled by 1/B) sum to the gradient."""
    ref = _train(tmp_path, "mlp.py", "[0]: dp=1", 1, optimizer=False)[0]
    ranks = _train(tmp_path, "mlp.py", strategy, 3, optimizer=False)
    for got in ranks:
        for step in range(STEPS):
            for name, value in ref.outputs[step].items():
                np.testing.assert_allclose(got.outputs[step][name], value, rtol=1e-5, atol=1e-7, err_msg=name)


def test_layouts_and_collectives():
    compiled = compile_script(_script("mlp.py"), HETERO, 3)
    ops = {o.tensor_name.data: o for o in compiled.annotated.walk() if isinstance(o, (graph.ParameterOp, graph.InputOp))}
    assert str(layout_of(ops["layers.0.weight"].result)) == "[0,1]: dup=2 | [2]: dup=1 ; hetero=dup"
    assert str(layout_of(ops["x"].result)) == "[0,1]: split(0)=2 | [2]: dup=1 ; hetero=split(0), shares=3:1"
    # the weight gradients (matmuls over the batch dim) and the loss are partial across groups
    reshards = {(str(layout_of(o.input)), str(layout_of(o.result))) for o in compiled.annotated.walk()
                if isinstance(o, ReshardOp)}
    assert reshards == {("[0,1]: partial=2 | [2]: dup=1 ; hetero=partial", "[0,1]: dup=2 | [2]: dup=1 ; hetero=dup")}
    for devices, module in [(d, m) for d, m in _groups(compiled.physical)]:
        comms = [(o.name, tuple(tuple(g) for g in o.rank_groups)) for o in module.walk() if o.dialect_name() == "comm"]
        # the loss and the 6 gradients: one flat all_reduce each over every device
        assert comms == [("comm.all_reduce", ((0, 1, 2),))] * 7, (devices, comms)
        x = next(o for o in module.walk() if isinstance(o, graph.InputOp) and o.tensor_name.data == "x")
        assert x.result.type.get_shape()[0] == (6 if devices == (0, 1) else 4)


def test_sharding_rules_across_groups():
    """Elementwise ops keep the batch split across groups; a reduction over the batch dim (the
    loss's sum, a weight gradient's contraction) gives partial sums per group, partial also
    inside a group where the batch was split there; the loss is scaled by 1/B with the global B."""
    compiled = compile_script(_script("mlp.py"), HETERO, 3)
    step = next(o for o in compiled.annotated.walk() if o.name == "func.func")
    lay = [(o, str(layout_of(o.results[0]))) for o in step.body.block.ops if o.results and o.name.startswith("graph.")]
    split_rows = "[0,1]: split(0)=2 | [2]: dup=1 ; hetero=split(0), shares=3:1"
    partial = "[0,1]: partial=2 | [2]: dup=1 ; hetero=partial"
    assert all(text == split_rows for o, text in lay if o.name in ("graph.relu", "graph.relu_grad"))
    assert [text for o, text in lay if o.name == "graph.reduce_sum"] == [partial] * 4  # the loss, 3 bias gradients
    assert [text for o, text in lay if o.name == "graph.matmul"].count(partial) == 3  # dW of the 3 layers
    # the transposed activations are split along dim 1 across groups, by the same shares
    assert "[0,1]: split(1)=2 | [2]: dup=1 ; hetero=split(1), shares=3:1" in {text for o, text in lay}
    loss_scale = next(o for o, text in lay if o.name == "graph.scale" and text == partial)
    assert loss_scale.factor.value.data == 1 / 16  # the global batch, not a group's rows


def _groups(module):
    from hspmd.dialects.levels import physical_groups

    return physical_groups(module)


def test_rows_a_group_cannot_split_are_refused_with_one_message():
    with pytest.raises(PassError) as err:  # 16 rows 1:15 -> 1 and 15; one row cannot feed dp=3
        compile_script(_script("mlp.py"), "[0-2]: dp=3 share=1 | [3]: dp=1 share=15", 4)
    text = str(err.value)
    assert "'x'" in text and "[16, 64]" in text and "1:15" in text and "1+15" in text and "dp=3" in text, text


@pytest.mark.mpi
def test_mpi_three_ranks_hetero_equal_one_rank(tmp_path):
    mlp = os.path.join(EXAMPLES, "mlp.py")
    for n, strategy in (("1", "[0]: dp=1"), ("3", HETERO)):
        run_cli("hspmd", "run", "-n", n, mlp, "--strategy", strategy, "--steps", "5",
                "--log", str(tmp_path / f"log{n}.jsonl"), "--checkpoint", str(tmp_path / f"ck{n}.npz"),
                check=True, timeout=300)
    logs = {n: [json.loads(line)["loss"] for line in open(tmp_path / f"log{n}.jsonl")] for n in ("1", "3")}
    assert len(logs["3"]) == 5
    np.testing.assert_allclose(logs["3"], logs["1"], rtol=1e-5)
    p1, _ = load_checkpoint(str(tmp_path / "ck1.npz"))
    p3, _ = load_checkpoint(str(tmp_path / "ck3.npz"))
    for name in p1:
        np.testing.assert_allclose(p3[name], p1[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shares", [(3, 1), (1, 1), (1, 3)])
def test_hetero_mlp_program_outputs_batch_split_values_through_an_uneven_all_gather(shares):
    """The property test's MLP (float64, tight tolerances) on hetero layouts: its output `y` is
    split across groups by shares and gathered by one all_gather whose members' extents differ."""
    groups = (Group((0, 1), DistributedStates.of((DUP, 2))), Group((2,), DistributedStates()))
    rep = Layout(groups, DUP)
    batch = Layout(tuple(Group(g.devices, DistributedStates.of((split(0), len(g.devices)))) for g in groups),
                   split(0), shares)
    comms = _run_mlp({"x0": batch, "w1": rep, "w2": rep, "w3": rep, "x4": batch}, 3)
    assert ("comm.all_reduce", ((0, 1, 2),)) in comms  # the partial gradients and loss
    assert ("comm.all_gather", ((0, 1, 2),)) in comms  # y, 8 rows apportioned by shares


# --------------------------------------------------------------------------------------
# Property: random small programs, inputs split across groups by random shares


@st.composite
def hetero_cases(draw):
    """Draw (program, leaf layouts, ranks, batch seed): inputs hetero split(0) by random shares over
    2-3 groups of 1-2 devices (split(0) inside a group), parameters replicated in every group."""
    prog = draw(programs())
    sizes = [draw(st.integers(1, 2)) for _ in range(draw(st.integers(2, 3)))]
    shares = tuple(draw(st.integers(1, 3)) for _ in sizes)
    at, groups = 0, []
    for s in sizes:
        groups.append(tuple(range(at, at + s)))
        at += s
    rep = Layout(tuple(Group(g, DistributedStates.of((DUP, len(g)))) for g in groups), DUP)
    split_rows = Layout(tuple(Group(g, DistributedStates.of((split(0), len(g)))) for g in groups), split(0), shares)
    layouts = {}
    for name, (kind, shape, _) in prog.leaves.items():
        lay = split_rows if kind == "input" and shape else rep
        try:
            lay.check_shape(shape)
        except LayoutError:
            lay = rep
        if any(r == 0 for r in apportion(shape[0], shares)) if lay is split_rows else False:
            lay = rep
        layouts[name] = lay
    event(f"groups {sizes}, shares {shares}")
    return prog, layouts, at, draw(st.integers(0, 2**16))


@settings(max_examples=int(os.environ.get("HSPMD_PROPERTY_EXAMPLES", "25")), deadline=None)
@given(hetero_cases())
def test_random_programs_with_hetero_batch_split_equal_one_device(case):
    prog, layouts, n, seed = case
    check_property(prog, layouts, n, make_batch(prog, seed))
