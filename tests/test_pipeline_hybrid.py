"""Pipeline stages with data and tensor parallelism inside (`[0-3]: dp=1 tp=2 pp=2`), given layer counts.

Each stage is a dp x tp mesh (devices stage-major, then dp, then tp): the stage programs keep
the tp collectives over the stage's tp ranks, sum the micro-batches' gradients locally and
all-reduce them over the stage's dp ranks, and pass activations between the same position
of adjacent stages. MLP and GPT train as on one device (losses, final parameters); the IR of
a stage does not grow with its dp degree; bad pipelines end in one message.
"""

from __future__ import annotations

import numpy as np
import pytest
from xdsl.dialects.builtin import TensorType, f32
from xdsl.ir import Block
from hypothesis import given, settings
from hypothesis import strategies as st
from test_pipeline import _one_device, _script, _stage_params, _train

from hspmd.dialects import comm, graph, pipeline
from hspmd.dialects.dist import layout_of
from hspmd.compiler import annotate_with_provenance, compile_script
from hspmd.transforms.pipeline.virtual import annotation_strategy, pipelines
from hspmd.ir.strategy import parse_strategy
from hspmd.ir.layout import DUP, DistributedStates, Layout, split
from hspmd.dialects.levels import physical_groups
from hspmd.transforms.pipeline.stage_mesh import LOCAL, MEET, SPLIT, StageMesh, classify_collective, stage_layout
from hspmd.transforms.util import PassError, StrategyLimitError


@pytest.mark.parametrize("example, strategy, n, m, schedule", [
    ("gpt.py", "[0-3]: dp=1 tp=2 pp=2", 4, 1, "gpipe"),
    ("gpt.py", "[0-3]: dp=2 pp=2", 4, 2, "gpipe"),
    ("gpt.py", "[0-3]: dp=1 tp=2 pp=2", 4, 4, "1f1b"),
    ("gpt.py", "[0-3]: dp=1 tp=2 pp=2 sp=1", 4, 2, "gpipe"),  # the sequence split over tp, per micro-batch
    ("mlp.py", "[0-7]: dp=2 tp=2 pp=2", 8, 2, "1f1b"),
    ("llama.py", "[0-3]: dp=1 tp=2 pp=2", 4, 2, "1f1b"),  # head-parallel q/k/v, RoPE, vocabulary-split head
])
def test_stages_with_dp_and_tp_equal_one_device(tmp_path, example, strategy, n, m, schedule):
    ref = _one_device(tmp_path, example)
    ranks = _train(tmp_path, example, strategy, n, microbatches=m, pipeline_schedule=schedule)
    for r in ranks:  # every rank of every stage reports the loss
        np.testing.assert_allclose(r.losses, ref.losses, rtol=1e-5)
    got = ranks[0].params  # gathered from every stage's pieces
    assert set(got) == set(ref.params)
    for name, value in ref.params.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=5e-5, err_msg=name)


def _collectives(module):
    return [o for o in module.walk() if o.dialect_name() == "comm" and hasattr(o, "rank_groups")]


def test_tensor_parallel_stages_keep_tp_collectives_on_their_devices():
    compiled = compile_script(_script("gpt.py"), "[0-3]: dp=1 tp=2 pp=2", 4, microbatches=2)
    (d0, g0), (d1, g1) = physical_groups(compiled.physical)
    assert (d0, d1) == ((0, 1), (2, 3))  # stage-major; a stage's devices are its tp pair
    for devices, group in ((d0, g0), (d1, g1)):
        colls = _collectives(group)
        assert colls and all(set(g) == set(devices) for o in colls for g in o.rank_groups)
        for o in group.walk():
            if isinstance(o, (comm.SendOp, comm.RecvOp)):  # between the same tp rank of both stages
                assert sorted(map(tuple, comm.groups_of(o.pairs))) in ([(0, 2), (1, 3)], [(2, 0), (3, 1)])
        leaves = {o.tensor_name.data: o.properties["global_type"] for o in group.walk()
                  if isinstance(o, (graph.ParameterOp, graph.InputOp))}
        block = "blocks.[0:1]" if devices == (0, 1) else "blocks.[1:2]"  # the stage's piece of the stacks
        qkv = leaves[f"{block}.attn.qkv.weight"]
        assert str(layout_of(qkv)) == f"[{devices[0]},{devices[1]}]: split(2)=2"  # column parallel in the stage
        batch = leaves["ids@mb" if devices == (0, 1) else "targets@mb"]  # the batch as 2 micro-batches
        assert batch.get_shape() == (2, 2, 8) and str(layout_of(batch)) == f"[{devices[0]},{devices[1]}]: dup=2"
    assert _stage_params(compiled)[0] & {"blocks.[0:1].mlp.fc.weight", "wte.weight"}


def test_data_parallel_stages_sum_micro_batches_then_all_reduce():
    compiled = compile_script(_script("gpt.py"), "[0-3]: dp=2 pp=2", 4, microbatches=2)
    (d0, g0), (d1, g1) = physical_groups(compiled.physical)
    assert (d0, d1) == ((0, 1), (2, 3))
    ids = [o for o in g0.walk() if isinstance(o, graph.InputOp) and o.tensor_name.data.startswith("ids")]
    assert [o.tensor_name.data for o in ids] == ["ids@mb"]  # 2 micro-batches of 2 rows, split over dp
    assert all(o.global_type.get_shape() == (2, 2, 8) and str(layout_of(o.global_type)) == "[0,1]: split(1)=2"
               and o.result.type.get_shape() == (2, 1, 8) for o in ids)
    reduces = [o for o in g1.walk() if isinstance(o, comm.AllReduceOp)]
    head = [o for o in reduces if o.input.type.get_shape() == (32, 256)]
    assert len(head) == 1 and head[0].rank_groups == ((2, 3),)  # once, after the local sum of 2 micro-batches
    assert isinstance(head[0].input.owner, pipeline.RunOp)  # the sum is a result of the stage's run


def _op_names(compiled):
    return [[o.name for o in g.walk()] for _, g in physical_groups(compiled.physical)]


def test_stage_program_does_not_grow_with_its_ranks():
    small = compile_script(_script("mlp.py"), "[0-3]: dp=2 pp=2", 4, microbatches=2)
    large = compile_script(_script("mlp.py"), "[0-7]: dp=4 pp=2", 8, microbatches=2)
    assert _op_names(small) == _op_names(large)
    tp = compile_script(_script("mlp.py"), "[0-7]: dp=1 tp=4 pp=2", 8)
    assert [len(n) for n in _op_names(tp)] == [len(n) for n in
                                                _op_names(compile_script(_script("mlp.py"), "[0-3]: tp=2 pp=2", 4))]


def test_given_layer_counts_place_the_layers():
    compiled = compile_script(_script("gpt.py", ["model.layers=4"]), "[0-3]: tp=2 layers=3:1", 4)
    first, last = _stage_params(compiled)
    assert "blocks.[0:3].attn.qkv.weight" in first  # the stacked layers cut 3:1
    assert "blocks.[3:4].attn.qkv.weight" in last and not any(n.startswith("blocks.[3") for n in first)
    balanced_first, _ = _stage_params(compile_script(_script("gpt.py", ["model.layers=4"]), "[0,1]: pp=2", 2))
    assert "blocks.[0:2].attn.qkv.weight" in balanced_first


def test_given_layers_train_like_one_device(tmp_path):
    ref = _one_device(tmp_path, "mlp.py")
    ranks = _train(tmp_path, "mlp.py", "[0,1]: layers=1:2", 2)  # layers.0 | layers.1, layers.2 (and the loss)
    for r in ranks:
        np.testing.assert_allclose(r.losses, ref.losses, rtol=1e-5)


@pytest.mark.parametrize("strategy, n, words", [
    ("[0,1]: layers=1:2", 2, ["layers=1:2", "3 layers", "2 layers", "add up to 2"]),
    ("[0-5]: tp=2 pp=3", 6, ["pp=3", "2 layers"]),
    ("[0-3]: pp=2 dp=2 zero=1 | [4]: dp=1", 5, ["zero=1", "pipeline beside other device groups", "pp=2"]),
    ("[0-5]: tp=3 pp=2", 6, ["tp=3"]),
])
def test_bad_hybrid_pipelines_are_refused_in_one_message(strategy, n, words):
    with pytest.raises(PassError) as err:
        compile_script(_script("gpt.py"), strategy, n)
    text = str(err.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_explain_shows_the_stage_shaped_annotated_step():
    compiled = compile_script(_script("gpt.py"), "[0-3]: dp=1 tp=2 pp=2", 4, microbatches=2)
    assert str(annotation_strategy(compiled.strategy)) == "[0-3]: dp=2 tp=2"
    module, provenance = annotate_with_provenance(compiled)
    qkv = next(o for o in module.walk() if isinstance(o, graph.ParameterOp)
               and o.tensor_name.data == "blocks.[0:2].attn.qkv.weight")  # stacked, cut into stages later
    assert str(layout_of(qkv.result)) == "[0-3]: dup=2, split(2)=2" and provenance


def test_pipeline_shape_is_stage_major_then_dp_then_tp():
    (pipe,) = pipelines(parse_strategy("[0-7]: dp=2 tp=2 pp=2"))
    assert pipe.stages == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert pipe.stage_strategy(2) == "[0-7]: dp=4 tp=2"
    assert pipe.stage_strategy(1) == "[0-3]: dp=2 tp=2"
    assert pipelines(parse_strategy("[0,1]: pp=2"))[0].stage_strategy(1) == "[0]: dp=1"
    assert pipelines(parse_strategy("[0,1]: dp=2")) == []


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 3), dp=st.integers(1, 3), tp=st.integers(1, 3), rows=st.integers(1, 3),
       batch=st.booleans(), first=st.integers(0, 1))
def test_stage_layouts_hold_what_the_virtual_devices_held(m, dp, tp, rows, batch, first):
    """Real position q of a stage holds what virtual position mb*S + q held (of micro-batch mb)."""
    size = dp * tp
    virtual = tuple(range(10, 10 + m * size))
    stage = tuple(range(100 + first * size, 100 + (first + 1) * size))
    mesh = StageMesh((tuple(range(100, 100 + size)), tuple(range(100 + size, 100 + 2 * size))), virtual, m)
    if batch:  # a batch input: split over micro-batches x dp, replicated over tp
        states, shape = DistributedStates.of((split(0), m * dp), (DUP, tp)), (m * dp * rows, 3)
    else:  # a column-parallel weight: replicated over micro-batches x dp, split over tp
        states, shape = DistributedStates.of((DUP, m * dp), (split(1), tp)), (3, tp * rows)
    real, dim = stage_layout(Layout.spmd(virtual, states), mesh, first, "'x'")
    per_mb = dim is not None
    assert per_mb == (batch and m > 1) and dim in (None, 0) and real.devices == stage
    real_shape = (shape[0] // m, shape[1]) if per_mb else shape
    for mb in range(m):
        for q in range(size):
            want = Layout.spmd(virtual, states).slices(virtual[mb * size + q], shape)
            got = real.slices(stage[q], real_shape)
            offset = mb * real_shape[0] if per_mb else 0
            assert (got[0].start + offset, got[0].stop + offset, got[1]) == (want[0].start, want[0].stop, want[1])


def test_a_layout_whose_major_axis_cannot_hold_the_micro_batches_is_refused():
    mesh = StageMesh(((0, 1, 2),), tuple(range(6)), 2)
    with pytest.raises(PassError, match="major mesh axis must have a degree divisible by 2"):
        stage_layout(Layout.spmd(tuple(range(6)), DistributedStates.of((split(1), 3), (DUP, 2))), mesh, 0, "'w'")


def _collective(make, groups):
    x = Block(arg_types=[TensorType(f32, [8, 4])]).args[0]
    return make(x, groups)


def test_collectives_are_classified_by_the_micro_batches_they_span():
    # 2 micro-batches x (dp=2, tp=2): virtual position p = mb*4 + d*2 + t
    mesh = StageMesh(((0, 1, 2, 3), (4, 5, 6, 7)), tuple(range(8)), 2)
    reduce = lambda x, g: comm.AllReduceOp(x, g, x.type)  # noqa: E731
    split_ = lambda x, g: comm.LocalSplitOp(x, g, TensorType(f32, [2, 4]), dim=0)  # noqa: E731
    gather = lambda x, g: comm.AllGatherOp(x, g, TensorType(f32, [16, 4]), dim=0)  # noqa: E731
    tp = [[0, 1], [2, 3], [4, 5], [6, 7]]
    dp = [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert classify_collective(_collective(reduce, tp), mesh) == (LOCAL, ((0, 1), (2, 3)))
    assert classify_collective(_collective(reduce, dp), mesh) == (MEET, ((0, 2), (1, 3)))
    assert classify_collective(_collective(reduce, [list(range(8))]), mesh) == (MEET, ((0, 1, 2, 3),))
    assert classify_collective(_collective(split_, dp), mesh) == (SPLIT, ((0, 2), (1, 3)))
    with pytest.raises(StrategyLimitError, match="spans micro-batches .*only all-reduces.*use microbatches=1"):
        classify_collective(_collective(gather, dp), mesh)
    with pytest.raises(PassError, match="spans some but not all"):  # micro-batch minor: not a split of micro-batches
        classify_collective(_collective(split_, [[0, 4, 2, 6], [1, 5, 3, 7]]), mesh)
