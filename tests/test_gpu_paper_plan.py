"""tools/gpu_paper_plan.py at a tiny size: its synthetic H100 profiles are valid device profiles
whose links and collectives are ordered as the hardware is, and the cost model's predictions on
them are finite and ordered sensibly (docs/gpus.md)."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import replace
from functools import cache

import pytest

from hspmd.ir.device_profile import DeviceProfile

HERE = os.path.dirname(os.path.abspath(__file__))


@cache
def tool():
    path = os.path.join(HERE, "..", "tools", "gpu_paper_plan.py")
    spec = importlib.util.spec_from_file_location("gpu_paper_plan", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@cache
def machines():
    g = tool()
    one, two = g.H100Node(), g.H100Node(nodes=2)
    return (one, g.make_profile(one)), (two, g.make_profile(two))


def tiny():
    g = tool()
    return g.ModelShape("tiny GPT", layers=2, d_model=128, heads=4, seq_len=128, batch=16, vocab=256)


def test_profiles_are_valid_and_survive_json():
    for hw, profile in machines():
        assert profile.num_ranks == hw.n
        again = DeviceProfile.from_json(profile.to_json())
        assert again.num_ranks == profile.num_ranks and len(again.collectives) == len(profile.collectives)
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
            small, large = (profile.time(kind, tuple(range(hw.n)), b) for b in (2**16, 2**28))
            assert 0 < small < large and math.isfinite(large)
        # the matmul table: faster for larger products, never above the dense bf16 peak
        rates = [p.gflops for p in profile.ranks[0].matmul]
        assert rates == sorted(rates) and rates[-1] * 1e9 < hw.bf16_peak_flops
        assert profile.ranks[0].elementwise_bps < hw.hbm_bps


def test_infiniband_is_slower_than_nvlink():
    g = tool()
    (_, p8), (hw16, p16) = machines()
    mib = 2**20
    assert p16.link(0, 1).seconds(mib) < p16.link(0, 8).seconds(mib)
    # an all-reduce over a pair across nodes is slower than over a pair inside one
    assert p16.time("all_reduce", (0, 8), 16 * mib) > 3 * p16.time("all_reduce", (0, 1), 16 * mib)
    # all 16 GPUs: slower than one node's 8, but not by the flat ring over the slowest link
    # (NCCL runs a ring per NIC, or the tree, or the hierarchical form: the fastest is taken)
    world = tuple(range(16))
    t16, t8 = p16.time("all_reduce", world, 256 * mib), p8.time("all_reduce", tuple(range(8)), 256 * mib)
    flat = 2 * 15 * p16.link(0, 8).seconds(256 * mib / 16)
    assert t8 < t16 < flat / 2
    algorithms = {g.collective_seconds(hw16, "all_reduce", world, b)[1] for b in (2**10, 2**22, 2**30)}
    assert len(algorithms) >= 2  # the choice changes with the size, as NCCL's tuner's does


def test_regular_groups_cover_the_strategies_groups():
    g = tool()
    groups = set(g.regular_groups(16))
    assert (0, 1, 2, 3) in groups and (0, 4, 8, 12) in groups and (0, 8) in groups and (1, 9) in groups
    assert all(len(set(x)) == len(x) and max(x) < 16 for x in groups)
    assert g.strategies_for(8, 64, heads=12)  # pipelines with tp=8 are left out for 12 heads
    assert not [s for s, m in g.strategies_for(16, 64, heads=12) if "tp=8 pp" in s]


def test_predictions_are_finite_and_ordered():
    g = tool()
    (hw, p8), _ = machines()
    shape = tiny()
    one = g.predict(shape, "[0]: dp=1", p8.restricted(1), 1, hw)
    four = g.predict(shape, "[0-3]: dp=4", p8.restricted(4), 1, hw)
    eight = g.predict(shape, "[0-7]: dp=8", p8, 1, hw)
    for p in (one, four, eight):
        assert math.isfinite(p.step_s) and p.step_s > 0 and 0 < p.mfu < 1
        assert 0 < p.matmul_s <= p.compute_s and p.peak_bytes > 0 and p.tokens_per_s > 0
    # compute-bound at this size: more GPUs in dp, shorter step (fixed global batch)
    assert one.step_s > four.step_s > eight.step_s
    assert one.exposed_comm_s == 0 < eight.exposed_comm_s
    # a dp rank holds less of the batch: less activation memory
    assert eight.peak_bytes < one.peak_bytes


def test_model_flops_agree_with_the_ir():
    g = tool()
    from hspmd.planner import model_facts

    shape = tiny()
    facts = model_facts(g._script(shape), 1)
    assert facts.matmul_flops == pytest.approx(g.model_flops(shape), rel=0.02)
    assert facts.param_bytes / 4 == pytest.approx(shape.params(), rel=0.01)  # float32 master weights
    assert g.model_flops(replace(shape, batch=2 * shape.batch)) == pytest.approx(2 * g.model_flops(shape))


def test_megatron_rows_are_the_papers_models():
    """Table 1's rows as typed in: each model's parameters by the paper's equation 2 (12 l h^2 (1 +
    13/(12h) + (V+s)/(12lh))) its stated size to the paper's rounding (1.65 is its "1.7"), its tp * pp * dp its GPUs, its batch
    divisible by dp; the paper's FLOP count (with recomputation) is 4/3 of the model's forward and
    backward but for the logits."""
    g = tool()
    for row in g.MEGATRON_TABLE1:
        shape = row.shape()
        h, l, v, s = shape.d_model, shape.layers, shape.vocab, shape.seq_len
        params = 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))
        assert abs(params / 1e9 - row.params_b) <= 0.05 + 1e-3 * row.params_b, row
        assert row.tp * row.pp * row.dp == row.gpus and row.batch % row.dp == 0 and h % row.heads == 0, row
        logits = 6 * shape.batch * s * h * v  # forward and backward of the output layer, never recomputed
        assert g.megatron_flops(shape) - logits == pytest.approx(4 / 3 * (g.model_flops(shape) - logits), rel=1e-12)


def test_a100_nodes_are_slower_than_h100_nodes():
    g = tool()
    a100, h100 = g.make_profile(g.a100_node(4)), g.make_profile(g.H100Node(nodes=4))
    assert DeviceProfile.from_json(a100.to_json()).num_ranks == 32
    x = 1 << 28
    assert a100.time("all_reduce", tuple(range(32)), x) > h100.time("all_reduce", tuple(range(32)), x)


def test_a_megatron_row_nothing_fits_is_a_row_of_dashes(monkeypatch):
    """A row where no candidate fits the memory (the 145.6B on 1,536 GPUs with at most 8
    micro-batches) says so and which candidate came nearest, instead of failing the table."""
    import hspmd.planner as planner

    g = tool()

    class Lean:
        memory_bytes = 90 * 2**30

        def strategy(self):
            return "[0-31]: dp=4 tp=8"

        def settings(self):
            return ["microbatches=8"]

    monkeypatch.setattr(g, "model_facts_for", lambda shape, n: None)
    monkeypatch.setattr(planner, "plan", lambda facts, machine, memory: ([], [Lean()]))
    text = g.megatron_table(g.MEGATRON_TABLE1[:1], markdown=True)
    row = text.splitlines()[2].split(" | ")
    assert "none fits in 72 GiB" in row[5] and "90 GiB: [0-31]: dp=4 tp=8 microbatches=8" in row[5]
    assert row[6:10] == ["-", "-", "-", "-"] and row[10] == "- |"
