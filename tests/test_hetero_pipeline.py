"""Heterogeneous pipelines: one pipelined group beside groups without stages (`join-pipeline-groups`).

`[0,1]: pp=2 share=1 | [2]: dp=1 share=1` and friends, and pipelines with different stage counts
side by side (`[0,1]: pp=2 | [2-5]: pp=4`), train like one device (in-process ranks), with one
micro-batch or several (GPipe, 1F1B; tensor parallelism only with one);
each stage's cross-group collectives (gradient sums, the loss sum) name its own real devices,
and the other group issues the same collectives, per stage, in the same order. A rendezvous
simulation of every rank's blocking operations (collectives, sends, receives, exchanges) over
the compiled programs finds no deadlock for random strategies. Bad inputs end in one message.

Sampled per run (`HSPMD_TEST_SEED`, printed in pytest's header; the test ids name the cases): the
training sweeps run one case of each kind (per example; with micro-batches: the MLP, GPT with tp
stages, GPT with dropout, another GPT pipeline) and one of the pipelines with different stage
counts; successive runs cover every case.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import sampled_kinds
from test_pipeline import _one_device, _script, _stage_params, _train
from xdsl.dialects import func

from hspmd.dialects import comm, graph, pipeline
from hspmd.compiler import compile_script
from hspmd.dialects.levels import physical_groups
from hspmd.transforms.pipeline.devices import comm_signature, executed_ops, partners
from hspmd.dialects.pipeline import STAGE_ATTR
from hspmd.transforms.util import PassError


@pytest.mark.parametrize("example, strategy, n", sampled_kinds([
    ("mlp.py", "[0,1]: pp=2 share=1 | [2]: dp=1 share=1", 3),
    ("mlp.py", "[0]: dp=1 share=3 | [1-3]: pp=3 share=1", 4),  # the pipelined group second, 3 stages
    ("mlp.py", "[0,1]: pp=2 share=1 | [2]: dp=1 share=1 | [3]: dp=1 share=2", 4),  # two groups beside it
    ("gpt.py", "[0,1]: pp=2 share=3 | [2]: pp=1 share=1", 3),
    ("gpt.py", "[0-3]: tp=2 pp=2 share=1 | [4,5]: tp=2 share=1", 6),
], lambda case: case[0], "hetero-pipeline"))
def test_hetero_pipeline_equals_one_device(tmp_path, example, strategy, n):
    """A run tests one case of each example, sampled by its seed."""
    ref = _one_device(tmp_path, example)
    ranks = _train(tmp_path, example, strategy, n)
    for r in ranks:
        np.testing.assert_allclose(r.losses, ref.losses, rtol=1e-4)
    assert ranks[0].params.keys() == ref.params.keys()
    # gathered from the stages' and the other group's pieces (a misplaced piece is off by the weights'
    # scale, ~1e-2; the tolerance is for Adam, which turns round-off in tiny gradients, such as GPT's
    # key bias, zero in exact arithmetic, into steps of up to a learning rate)
    for name, value in ref.params.items():
        np.testing.assert_allclose(ranks[0].params[name], value, rtol=1e-3, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("strategy, n, m, schedule", sampled_kinds([
    ("[0,1]: pp=2 share=1 | [2-5]: pp=4 share=1", 6, 2, "1f1b"),
    ("[0-3]: dp=2 pp=2 share=1 | [4-7]: pp=4 share=1", 8, 1, "gpipe"),
    ("[0-3]: pp=4 share=3 | [4-6]: pp=3 layers=2:1:1 share=1", 7, 2, "1f1b"),
], lambda case: "stage counts", "hetero-pipeline-stages"))
def test_pipelines_with_different_stage_counts_equal_one_device(tmp_path, strategy, n, m, schedule):
    """A run tests one of the three (6 to 8 ranks of a 4-layer GPT: the longest cases here),
    sampled by its seed."""
    extra = ["model.layers=4", "data.batch_size=8"]
    ref = _train(tmp_path, "gpt.py", "[0]: dp=1", 1, extra)[0]
    compiled = compile_script(_script("gpt.py", extra), strategy, n, microbatches=m, pipeline_schedule=schedule)
    assert deadlock_free(compiled.physical)
    ranks = _train(tmp_path, "gpt.py", strategy, n, extra, microbatches=m, pipeline_schedule=schedule)
    for r in ranks:
        np.testing.assert_allclose(r.losses, ref.losses, rtol=1e-4)


def _microbatch_kind(case) -> str:
    example, strategy, *_, extra = case
    return "mlp" if example == "mlp.py" else "dropout" if extra[:1] == ["model.dropout=0.2"] else \
        "tp" if "tp=" in strategy else "gpt"


@pytest.mark.parametrize("example, strategy, n, m, schedule, extra", sampled_kinds([
    ("gpt.py", "[0,1]: pp=2 share=1 | [2]: dp=1 share=1", 3, 2, "gpipe", []),
    ("gpt.py", "[0,1]: pp=2 share=3 | [2]: dp=1 share=1", 3, 3, "1f1b", []),
    ("gpt.py", "[0-3]: dp=2 pp=2 share=1 | [4,5]: dp=2 share=1", 6, 2, "1f1b", ["data.batch_size=8"]),
    ("mlp.py", "[0]: dp=1 share=1 | [1-4]: dp=2 pp=2 share=3", 5, 3, "gpipe", []),  # more micro-batches than stages
    # Hetu v2's flagship shape with micro-batches: tp inside the stages and beside them
    ("gpt.py", "[0-3]: tp=2 pp=2 share=2 | [4,5]: tp=2 share=1", 6, 2, "1f1b", ["data.batch_size=12"]),
    # dropout: each micro-batch draws its rows' masks as its virtual device (one device's masks)
    ("gpt.py", "[0,1]: pp=2 share=3 | [2]: dp=1 share=1", 3, 2, "gpipe", ["model.dropout=0.2", "data.batch_size=8"]),
], _microbatch_kind, "hetero-pipeline-microbatches"))
def test_hetero_pipeline_with_micro_batches_equals_one_device(tmp_path, example, strategy, n, m, schedule, extra):
    """A run tests one case of each kind (`_microbatch_kind`), sampled by its seed."""
    ref = _train(tmp_path, example, "[0]: dp=1", 1, extra)[0] if extra else _one_device(tmp_path, example)
    ranks = _train(tmp_path, example, strategy, n, extra, microbatches=m, pipeline_schedule=schedule)
    for r in ranks:
        np.testing.assert_allclose(r.losses, ref.losses, rtol=1e-4)
    stages = [g for _, g in physical_groups(compile_script(_script(example, extra), strategy, n, microbatches=m,
                                                            pipeline_schedule=schedule).physical)
              if g.attributes["hspmd.microbatches"].value.data == m]
    assert len(stages) == 2  # the stages run m micro-batches: each views its group's rows as m slices
    for g in stages:
        (run,) = [o for o in g.walk() if isinstance(o, pipeline.RunOp)]
        assert run.microbatched and all(v.type.get_shape()[0] == m for v in run.microbatched)
        assert any(isinstance(v.owner, graph.ReshapeOp) or isinstance(v.owner.operands[0].owner, graph.ReshapeOp)
                   for v in run.microbatched)


def _named_devices(physical) -> set[int]:
    """Return every device the physical IR names: rank groups, send/recv pairs, layouts."""
    from xdsl.dialects.builtin import TensorType

    from hspmd.dialects.dist import LayoutAttr, layout_of

    out: set[int] = set()
    for op in physical.walk():
        for value in op.properties.values():
            if isinstance(value, LayoutAttr):
                out |= set(value.data.devices)
            elif isinstance(value, TensorType) and layout_of(value) is not None:
                out |= set(layout_of(value).devices)
        if op.dialect_name() == "comm" and "groups" in op.properties:
            out |= {d for g in op.rank_groups for d in g}
        if isinstance(op, (comm.SendOp, comm.RecvOp)):
            out |= {d for p in comm.groups_of(op.pairs) for d in p}
    return out


@pytest.mark.parametrize("strategy, n, m", [
    ("[0]: dp=1 share=1 | [1-4]: dp=2 pp=2 share=3", 5, 3),  # virtual devices 1-6: 5 and 6 are not real
    ("[0-3]: tp=2 pp=2 share=2 | [4,5]: tp=2 share=1", 6, 1),
])
def test_programs_name_only_real_devices(strategy, n, m):
    compiled = compile_script(_script("gpt.py", ["data.batch_size=8"]), strategy, n, microbatches=m)
    assert _named_devices(compiled.physical) == set(range(n))


def _step(module) -> func.FuncOp:
    return next(f for f in module.body.block.ops if isinstance(f, func.FuncOp) and f.sym_name.data == "train_step")


def _crossing(devices, module) -> list:
    """Return the step's collectives (not sends/receives) with devices outside `devices`, in the order
    a rank runs them."""
    own = set(devices)
    return [o for o in executed_ops(module) if o.dialect_name() == "comm" and partners(o, own)
            and not isinstance(o, (comm.SendOp, comm.RecvOp))]


def test_cross_group_collectives_name_the_stage_that_owns_them():
    compiled = compile_script(_script("gpt.py"), "[0-3]: tp=2 pp=2 share=2 | [4,5]: tp=2 share=1", 6)
    groups = physical_groups(compiled.physical)
    assert [d for d, _ in groups] == [(0, 1), (2, 3), (4, 5)]
    assert all(STAGE_ATTR in g.attributes for _, g in groups)  # the other group: a one-stage pipeline
    first, last, other = _stage_params(compiled)
    assert "blocks.0.attn.qkv.weight" in first and "blocks.1.attn.qkv.weight" in last
    assert other == first | last
    (_, b) = groups[2]
    b_cross = _crossing((4, 5), b)
    for s, (devices, stage) in enumerate(groups[:2]):
        mine = _crossing(devices, stage)
        assert mine, f"stage {s} has no collective with the other group"
        for o in mine:  # the stage's real devices and the other group's, nothing else
            assert partners(o, set(devices)) <= {4, 5}
        # the other group issues exactly this stage's collectives, in this stage's order
        with_stage = [o for o in b_cross if partners(o, {4, 5}) & set(devices)]
        assert [comm_signature(o) for o in with_stage] == [comm_signature(o) for o in mine]
    assert all(partners(o, {4, 5}) in ({0, 1}, {2, 3}, {0}, {1}, {2}, {3}) for o in b_cross)
    # the loss is summed across groups on the last stage, the gradient sums on each weight's stage
    assert any(o.result.type.get_shape() == () for o in _crossing((2, 3), groups[1][1]))


def _events(devices, module, rank: int) -> list[tuple]:
    """Return the communication `rank` issues running `module`'s step, callees inlined and a
    `pipeline.run` walked in its schedule's order, as the runtime does."""
    functions = {f.sym_name.data: f for f in module.body.block.ops if isinstance(f, func.FuncOp)}
    out: list[tuple] = []

    def walk(fn):
        for o in fn.body.block.ops:
            if isinstance(o, func.CallOp) and o.callee.root_reference.data in functions:
                walk(functions[o.callee.root_reference.data])
            elif isinstance(o, pipeline.RunOp):
                for kind, _ in pipeline.actions(o):
                    walk(functions[(o.forward if kind == "F" else o.backward).root_reference.data])
            elif isinstance(o, comm.ExchangeOp):  # blocking sends and receives, in one global order
                for src, dst, _ in o.transfer_list():
                    if src != dst and rank in (src, dst):
                        out.append(("send", dst) if src == rank else ("recv", src))
            elif isinstance(o, comm.SendOp):  # a send never blocks: its message waits for the receive
                out.extend(("isend", b, o.tag_value) for a, b in comm.groups_of(o.pairs) if a == rank)
            elif isinstance(o, comm.RecvOp):
                out.extend(("irecv", a, o.tag_value) for a, b in comm.groups_of(o.pairs) if b == rank)
            elif o.dialect_name() == "comm" and hasattr(o, "rank_groups"):
                group = next(g for g in o.rank_groups if rank in g)
                if len(group) > 1:
                    out.append(("coll", o.name, tuple(group)))

    walk(_step(module))
    return out


def deadlock_free(physical) -> bool:
    """Simulate every rank: collectives and exchanges' transfers meet (rendezvous), `comm.send`s are
    buffered and a `comm.recv` takes the oldest message with its source and tag; return whether all finish."""
    programs = {r: _events(d, g, r) for d, g in physical_groups(physical) for r in d}
    at = {r: 0 for r in programs}
    mailbox: dict[tuple, int] = {}

    def head(r):
        return programs[r][at[r]] if at[r] < len(programs[r]) else None

    moved = True
    while moved:
        moved = False
        for r in programs:
            e = head(r)
            if e is None:
                continue
            if e[0] == "coll" and all(head(q) == e for q in e[2]):
                for q in e[2]:
                    at[q] += 1
                moved = True
            elif e[0] == "send" and head(e[1]) == ("recv", r):
                at[r] += 1
                at[e[1]] += 1
                moved = True
            elif e[0] == "isend":
                key = (r, e[1], e[2])
                mailbox[key] = mailbox.get(key, 0) + 1
                at[r] += 1
                moved = True
            elif e[0] == "irecv" and mailbox.get((e[1], r, e[2]), 0):
                mailbox[(e[1], r, e[2])] -= 1
                at[r] += 1
                moved = True
    return all(head(r) is None for r in programs) and not any(mailbox.values())


@settings(max_examples=10, deadline=None)
@given(first=st.booleans(), pp=st.sampled_from([2, 3]), tp=st.sampled_from([1, 2]), other_tp=st.sampled_from([1, 2]),
       other_pp=st.sampled_from([1, 1, 2, 3]), shares=st.sampled_from([(1, 1), (1, 2), (2, 1), (1, 3), (3, 1)]),
       m=st.sampled_from([1, 2, 3]), schedule=st.sampled_from(["gpipe", "1f1b"]))
def test_every_rank_meets_its_collectives_in_one_order(first, pp, tp, other_tp, other_pp, shares, m, schedule):
    if m > 1 and other_pp > 1:  # micro-batches with tp in two pipelines: refused (per-micro-batch sums across them)
        tp = other_tp = 1
    n_pipe, n_other = pp * tp, other_pp * other_tp
    devices = list(range(n_pipe + n_other))
    pipe_devs, other_devs = (devices[:n_pipe], devices[n_pipe:]) if first else (devices[n_other:], devices[:n_other])
    fmt = lambda ds: ",".join(map(str, ds))  # noqa: E731
    piped = f"[{fmt(pipe_devs)}]: tp={tp} pp={pp} share={shares[0]}"
    other = f"[{fmt(other_devs)}]: tp={other_tp} pp={other_pp} share={shares[1]}"
    strategy = f"{piped} | {other}" if first else f"{other} | {piped}"
    compiled = compile_script(_script("mlp.py", ["hidden=32", "batch_size=72"]), strategy, len(devices),
                              microbatches=m, pipeline_schedule=schedule)
    assert deadlock_free(compiled.physical), (strategy, m, schedule)


def test_the_simulation_finds_a_deadlock():
    compiled = compile_script(_script("mlp.py"), "[0,1]: pp=2 share=1 | [2]: dp=1 share=1", 3)
    (_, b), = [g for g in physical_groups(compiled.physical) if g[0] == (2,)]
    cross = _crossing((2,), b)
    assert len({tuple(sorted(partners(o, {2}))) for o in cross}) == 2  # with both stages
    # swap the first collective with stage 0 and the first with stage 1 in the other group's program
    s0 = next(o for o in cross if partners(o, {2}) == {0})
    s1 = next(o for o in cross if partners(o, {2}) == {1})
    g0, g1 = s0.properties["groups"], s1.properties["groups"]
    s0.properties["groups"], s1.properties["groups"] = g1, g0
    assert not deadlock_free(compiled.physical)


@pytest.mark.parametrize("strategy, n, kw, words", [
    ("[0-3]: pp=2 dp=2 zero=1 | [4]: dp=1", 5, {}, ["zero=1", "pp=2"]),
    # refused by apply-strategy (the strategy checks), not by the pipeline passes after them
    ("[0-3]: pp=2 tp=2 | [4-7]: pp=2 tp=2", 8, {"microbatches": 2}, ["microbatches=2", "several pipelined groups",
                                                                     "tp=1 in all pipelined groups but one"]),
    ("[0-3]: dp=2 pp=2 | [4,5]: dp=2", 6, {"microbatches": 2}, ["dp=4", "annotated as", "virtual dp rank"]),
])
def test_bad_hetero_pipelines_are_refused_in_one_message(strategy, n, kw, words):
    with pytest.raises(PassError) as err:
        compile_script(_script("gpt.py"), strategy, n, **kw)
    text = str(err.value)
    assert "\n" not in text and all(w in text for w in words), text
