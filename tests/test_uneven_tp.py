"""Tensor parallelism over dims tp does not divide (`tp=2` over 3 heads): uneven pieces inside a
group, laid out over tp sub-groups (`transforms/uneven_tensor_parallel.py`), give the 1-device
numbers."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_reshard_plan import check
from test_spmd_property import TOL, _mlp, _mlp_numpy_grads, check_property, compile_step, make_batch, run_step, trace

from conftest import EXAMPLES
from hspmd.compiler import compile_script, write_bundle
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.ir.layout import PARTIAL, DistributedStates, Group, Layout, gather, scatter, split
from hspmd.ir.reshard_plan import plan_transition
from hspmd.ir.strategy import parse_strategy
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.worker import train
from hspmd.transforms import uneven_tensor_parallel as uneven_tp

STEPS = 3
GPT3 = ["model.d_model=24", "model.seq_len=8", "model.heads=3", "model.layers=2", "data.batch_size=4",
        "optim.warmup=1"]


# --------------------------------------------------------------------------------------
# The layouts: pieces cover the tensor, reshard plans move the right elements


@st.composite
def uneven_groups(draw):
    """Draw (strategy group, tensor-parallel size, heads or None): dp 1..3, tp 2..4, a size tp may not divide."""
    dp, tp = draw(st.integers(1, 3)), draw(st.integers(2, 4))
    group = parse_strategy(f"[0-{dp * tp - 1}]: dp={dp} tp={tp}").groups[0]
    heads = draw(st.one_of(st.none(), st.integers(tp, 7)))
    size = heads * draw(st.integers(1, 3)) if heads else draw(st.integers(tp, 13))
    return group, size, heads


@settings(max_examples=120, deadline=None)
@given(uneven_groups(), st.sampled_from(["column", "row", "column-bias"]), st.integers(1, 3), st.integers(0, 2**32 - 1))
def test_uneven_pieces_cover_the_tensor_once_per_replica(case, role, other, seed):
    group, size, heads = case
    dim = uneven_tp.SPLIT_DIM[role]
    shape = (size,) if role == "column-bias" else ((other, size) if dim == 1 else (size, other))
    shares = uneven_tp.head_shares(heads, group.tp) if heads else (1,) * group.tp
    lay = uneven_tp.weight_layout(group, role, shares)
    a = np.random.default_rng(seed).standard_normal(shape)
    pieces = scatter(lay, a)
    subs = uneven_tp.tp_subgroups(group)
    cuts = []
    for devices in subs:
        (cut,) = {(lay.slices(d, shape)[dim].start, lay.slices(d, shape)[dim].stop) for d in devices}
        cuts.append(cut)  # a sub-group's dp ranks hold the same slice
        for d in devices:
            np.testing.assert_array_equal(pieces[d], a[lay.slices(d, shape)])
    assert cuts[0][0] == 0 and cuts[-1][1] == size and all(cuts[i][1] == cuts[i + 1][0] for i in range(len(cuts) - 1))
    widths = [b - a_ for a_, b in cuts]
    if heads:  # cut at head boundaries: each rank holds whole heads, at most one more than another
        per = size // heads
        assert all(w % per == 0 for w in widths) and max(widths) - min(widths) <= per
    else:
        assert max(widths) - min(widths) <= 1 and min(widths) >= 1
    np.testing.assert_array_equal(gather(lay, pieces, shape), a)


@settings(max_examples=80, deadline=None)
@given(uneven_groups(), st.integers(0, 2**32 - 1))
def test_reshard_plans_between_uneven_tp_layouts_move_the_right_elements(case, seed):
    """The transitions a step under uneven tp makes: a row matmul's partial sums (across the tp
    sub-groups) all-reduced; uneven column pieces gathered; replicated values cut into pieces."""
    group, size, heads = case
    rng = np.random.default_rng(seed)
    shares = uneven_tp.head_shares(heads, group.tp) if heads else (1,) * group.tp
    batch = group.batch_ranks * 2
    # an activation [batch, size] split like a column weight's output: rows over dp, columns across sub-groups
    act = Layout(tuple(Group(s, DistributedStates.of((split(0), group.batch_ranks))) for s in uneven_tp.tp_subgroups(group)),
                 split(1), shares)
    rows = uneven_tp.batch_layout(group)
    partial = Layout(rows.groups, PARTIAL)
    a = rng.standard_normal((batch, size))
    check(partial, rows, a, rng)  # all-reduce across the sub-groups, shapes alike on every rank
    check(act, rows, a, rng)  # gather uneven pieces
    check(rows, act, a, rng)  # cut the replicated rows' columns unevenly
    steps = plan_transition(partial, rows, a.shape)
    assert [s.kind for s in steps] == ["all_reduce"], steps


def _mlp_layouts(group):
    """The MLP of test_spmd_property under uneven tp: w1 column, b1 its bias, w2 row, batch over dp."""
    shares = (1,) * group.tp
    batch = uneven_tp.batch_layout(group)
    return {"x0": batch, "x4": batch, "w1": uneven_tp.weight_layout(group, "column", shares),
            "w2": uneven_tp.weight_layout(group, "column-bias", shares),
            "w3": uneven_tp.weight_layout(group, "row", shares)}


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 2), st.integers(2, 3), st.integers(0, 9), st.integers(0, 2**16))
def test_uneven_tp_mlp_step_equals_one_device_and_numpy(dp, tp, extra, seed):
    """Random hidden widths tp need not divide: the distributed step's loss and gradients equal the
    1-device program's and hand-derived NumPy gradients."""
    group = parse_strategy(f"[0-{dp * tp - 1}]: dp={dp} tp={tp}").groups[0]
    hidden = tp + extra
    prog = _mlp(batch=4 * dp, hidden=hidden)
    batch = make_batch(prog, seed)
    layouts = _mlp_layouts(group)
    check_property(prog, layouts, dp * tp, batch)
    physical = compile_step(trace(prog), layouts)
    for outputs in run_step(physical, dp * tp, batch):
        for name, value in _mlp_numpy_grads(prog, batch).items():
            np.testing.assert_allclose(outputs[name], value, **TOL, err_msg=name)


# --------------------------------------------------------------------------------------
# End to end: the examples under uneven tp equal one device


def _train(tmp_path, example: str, sets: list[str], strategy: str, n: int, **kw):
    script = load_script(os.path.join(EXAMPLES, example), parse_overrides(sets + [f"steps={STEPS}"]))
    bundle = tmp_path / f"{example}-{n}-{abs(hash(strategy))}"
    compiled = compile_script(script, strategy, n)
    write_bundle(compiled, str(bundle))
    ranks = run_spmd(n, lambda c: train(str(bundle), c, steps=STEPS, quiet=True, keep_outputs=True, **kw),
                     timeout=300)
    return compiled, ranks


def _assert_same(ref, ranks, atol):
    for got in ranks:
        np.testing.assert_allclose(got.losses, ref.losses, rtol=1e-5)
    for name, value in ref.params.items():
        np.testing.assert_allclose(ranks[0].params[name], value, rtol=1e-5, atol=atol, err_msg=name)


@pytest.mark.parametrize("strategy,n,extra", [("[0,1]: tp=2", 2, []), ("[0-3]: dp=2 tp=2", 4, []),
                                              ("[0-3]: dp=2 tp=2 zero=1", 4, []),
                                              ("[0-3]: dp=2 tp=2", 4, ["model.dropout=0.1"])])
def test_gpt_three_heads_over_tp2_equals_one_device(tmp_path, strategy, n, extra):
    """Dropout too: its mask is keyed by global indices, which the uneven pieces' offsets give."""
    _, (ref,) = _train(tmp_path, "gpt.py", GPT3 + extra, "[0]: dp=1", 1)
    compiled, ranks = _train(tmp_path, "gpt.py", GPT3 + extra, strategy, n)
    text = str(compiled.annotated)
    assert "hetero=split(1), shares=2:1" in text  # the qkv weight: 2 heads on one tp rank, 1 on the other
    if "zero=1" in strategy:  # Adam's moments split over dp inside each tp sub-group
        # (the layers stacked: each layer's state split along its dim 0 as unstacked, the stack's dim 1)
        assert '"opt.m.blocks.[0:2].attn.qkv.weight"' in text and "[0,2]: split(1)=2 | [1,3]: split(1)=2 ; hetero=split(2)" in text
    print(f"\ngpt 3 heads {strategy}: losses {ranks[0].losses} (1 device {ref.losses})")
    _assert_same(ref, ranks, atol=5e-5)


@pytest.mark.parametrize("strategy,n,hidden", [("[0-2]: tp=3", 3, 10), ("[0-3]: tp=4", 4, 30)])
def test_mlp_width_tp_does_not_divide_equals_one_device(tmp_path, strategy, n, hidden):
    sets = ["batch_size=8", f"hidden={hidden}"]
    _, (ref,) = _train(tmp_path, "mlp.py", sets, "[0]: dp=1", 1)
    compiled, ranks = _train(tmp_path, "mlp.py", sets, strategy, n)
    assert "hetero=split(1), shares=1:1" in str(compiled.annotated)  # 10 columns: 4, 3, 3; 30: 8, 8, 7, 7
    _assert_same(ref, ranks, atol=1e-6)


@settings(max_examples=4, deadline=None)
@given(st.integers(1, 2), st.integers(2, 3), st.integers(0, 7))
def test_mlp_example_random_widths_under_apply_strategy_equal_one_device(tmp_path_factory, dp, tp, extra):
    """apply-strategy on random widths (tp need not divide them): the example trains as on 1 device."""
    tmp_path = tmp_path_factory.mktemp("w")
    sets = ["batch_size=8", f"hidden={tp + extra}"]
    _, (ref,) = _train(tmp_path, "mlp.py", sets, "[0]: dp=1", 1)
    _, ranks = _train(tmp_path, "mlp.py", sets, f"[0-{dp * tp - 1}]: dp={dp} tp={tp}", dp * tp)
    _assert_same(ref, ranks, atol=1e-6)


def test_llama_three_heads_over_tp2_equals_one_device(tmp_path):
    sets = ["model.d_model=24", "model.seq_len=8", "model.heads=3", "model.layers=1", "data.batch_size=4",
            "optim.warmup=1"]
    _, (ref,) = _train(tmp_path, "llama.py", sets, "[0]: dp=1", 1)
    _, ranks = _train(tmp_path, "llama.py", sets, "[0,1]: tp=2", 2)
    _assert_same(ref, ranks, atol=5e-5)


@pytest.mark.parametrize("written,wn,read,rn", [("[0,1]: tp=2", 2, "[0]: dp=1", 1),
                                                 ("[0,1]: dp=2", 2, "[0-3]: dp=2 tp=2", 4)])
def test_checkpoint_under_uneven_tp_resumes_elsewhere(tmp_path, written, wn, read, rn):
    """Each tp rank writes its uneven pieces and the reader under another strategy reshards them
    (or reads uneven pieces out of another run's); step 3 goes on alike."""
    from hspmd.runtime.worker import CheckpointOptions

    ck = tmp_path / "ck"
    _, ranks = _train(tmp_path, "gpt.py", GPT3, written, wn, checkpoints=CheckpointOptions(str(ck), every=2))
    _, (other, *_) = _train(tmp_path, "gpt.py", GPT3, read, rn, checkpoints=CheckpointOptions(resume=str(ck / "step-2")))
    assert other.first_step == 3
    np.testing.assert_allclose(other.losses, ranks[0].losses[2:], rtol=1e-5)
    for name, value in ranks[0].params.items():
        np.testing.assert_allclose(other.params[name], value, rtol=1e-5, atol=5e-5, err_msg=name)


@pytest.mark.mpi
def test_mpi_gpt_three_heads_over_tp2_logs_the_one_rank_losses(tmp_path):
    import json

    from conftest import run_cli
    from hspmd.runtime.checkpoint import load_checkpoint

    gpt = os.path.join(EXAMPLES, "gpt.py")
    sets = [a for s in GPT3 for a in ("--set", s)]
    for n, strategy in (("1", "[0]: dp=1"), ("2", "[0,1]: tp=2")):
        run_cli("hspmd", "run", "-n", n, gpt, "--strategy", strategy, "--steps", "4", *sets,
                "--log", str(tmp_path / f"log{n}.jsonl"), "--checkpoint", str(tmp_path / f"ck{n}.npz"),
                check=True, timeout=300)
    logs = {n: [json.loads(line)["loss"] for line in open(tmp_path / f"log{n}.jsonl")] for n in ("1", "2")}
    print(f"\nMPI gpt 3 heads [0,1]: tp=2: losses {logs['2']} (1 rank {logs['1']})")
    assert len(logs["2"]) == 4
    np.testing.assert_allclose(logs["2"], logs["1"], rtol=1e-5)
    p1, _ = load_checkpoint(str(tmp_path / "ck1.npz"))
    p2, _ = load_checkpoint(str(tmp_path / "ck2.npz"))
    for name in p1:
        np.testing.assert_allclose(p2[name], p1[name], rtol=1e-5, atol=5e-5, err_msg=name)


@pytest.mark.parametrize("strategy,n", [("[0,1]: tp=2", 2), ("[0-3]: dp=2 tp=2", 4)])
def test_uneven_blocks_need_only_megatron_s_all_reduces(strategy, n):
    """3 heads over tp=2: each tp rank runs its program (2 heads, 1 head), and a block's forward and
    backward each need one all-reduce per row-parallel matmul, of the same shape on every rank."""
    from hspmd.codegen.report import collective_report

    script = load_script(os.path.join(EXAMPLES, "gpt.py"), parse_overrides(GPT3))
    compiled = compile_script(script, strategy, n)
    rows = collective_report(compiled.physical)
    assert len({r.devices for r in rows}) == 2  # one program per tp sub-group
    blocks = [r for r in rows if "Block" in r.function]
    assert blocks and {r.op for r in blocks} == {"comm.all_reduce"}, blocks
    assert len({r.shape for r in blocks}) == 1


def test_switching_between_data_parallel_and_uneven_tp_equals_one_device(tmp_path):
    """Graph switching moves parameters and Adam's states into the uneven pieces and back."""
    from hspmd.compiler import compile_strategies

    steps = 5
    script = load_script(os.path.join(EXAMPLES, "gpt.py"), parse_overrides(GPT3 + [f"steps={steps}"]))
    ref = str(tmp_path / "ref")
    write_bundle(compile_script(script, "[0]: dp=1", 1), ref)
    one = run_spmd(1, lambda c: train(ref, c, steps=steps, quiet=True), timeout=300)[0]
    switching = write_bundle(compile_strategies(script, ["[0,1]: dp=2", "[0,1]: tp=2"], 2), str(tmp_path / "sw"))
    order = [0, 1, 1, 0, 1]
    ranks = run_spmd(2, lambda c: train(switching, c, steps=steps, quiet=True, strategy_order=order), timeout=300)
    assert [(a, b) for _, a, b, _ in ranks[0].switches] == [(0, 1), (1, 0), (0, 1)]
    for r in ranks:
        np.testing.assert_allclose(r.losses, one.losses, rtol=1e-5)
    for name, value in one.params.items():
        np.testing.assert_allclose(ranks[0].params[name], value, rtol=1e-4, atol=5e-5, err_msg=name)


@pytest.mark.parametrize("strategy,n,words", [
    ("[0-7]: tp=8", 8, ["tp=8", "its 3 heads leave a tp rank with nothing", "use tp <= 3"]),
    ("[0-3]: tp=2 pp=2", 4, ["3 heads", "not beside other groups, nor with pp, sp or ep"]),
    ("[0,1]: tp=2 sp=1", 2, ["3 heads", "nor with pp, sp or ep"]),
    ("[0,1]: tp=2 share=1 | [2]: dp=1", 3, ["3 heads", "not beside other groups"]),
    ("[0-5]: dp=3 tp=2", 6, ["3 heads", "splits 4 rows unevenly over dp, so it runs as '[0,1]: dp=1 tp=2"]),
])
def test_what_stays_refused_is_one_clear_message(strategy, n, words):
    from conftest import run_cli

    sets = [a for s in GPT3 for a in ("--set", s)]
    proc = run_cli("hspmd", "compile", os.path.join(EXAMPLES, "gpt.py"), "--strategy", strategy, "-n", str(n), *sets)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    for w in words:
        assert w in line, line
