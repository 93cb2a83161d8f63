"""The cost model orders obvious cases right: slow ranks, slow links, pipeline bubbles; memory from the plan.

Nothing here asserts a time against a clock: only predictions against predictions.
"""

from __future__ import annotations

import math
import os
from functools import cache

import pytest
from xdsl.dialects import func

from conftest import EXAMPLES, run_cli
from hspmd.codegen.cost_model import CostError, CostEstimate, estimate_cost
from hspmd.codegen.schedule import build_schedule
from hspmd.compiler import compile_script
from hspmd.dialects.levels import physical_groups
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.ir.device_profile import COLLECTIVES, CollectiveFit, DeviceProfile, Link

MLP = os.path.join(EXAMPLES, "mlp.py")
GPT = os.path.join(EXAMPLES, "gpt.py")


@cache
def _compiled(script: str, strategy: str, n: int, sets: tuple[str, ...] = ()):
    return compile_script(load_script(script, parse_overrides(list(sets))), strategy, n)


def test_a_twice_slower_rank_makes_a_dp_step_slower():
    c = _compiled(GPT, "[0,1]: dp=2", 2)
    even = estimate_cost(c.kernel_groups(), DeviceProfile.uniform(2))
    slow = estimate_cost(c.kernel_groups(), DeviceProfile.uniform(2, speed=[0.5, 1.0]))
    assert slow.step_s > even.step_s * 1.5
    assert slow.slowest_rank == 0
    assert slow.ranks[0].compute_s == pytest.approx(2 * slow.ranks[1].compute_s)
    assert slow.ranks[1].wait_s > 0 and slow.ranks[0].wait_s == 0
    assert even.ranks[0].compute_s == pytest.approx(even.ranks[1].compute_s)


def test_a_big_all_reduce_on_a_slow_link_costs_more():
    c = _compiled(GPT, "[0,1]: dp=2", 2)
    fast = DeviceProfile.uniform(2, bandwidth_gbps=10.0)
    slow = fast.with_link(0, 1, Link(1e-3, 1e8))
    a, b = estimate_cost(c.kernel_groups(), fast), estimate_cost(c.kernel_groups(), slow)
    assert b.ranks[0].comm_s > 10 * a.ranks[0].comm_s > 0
    assert b.step_s > a.step_s
    # one rank: no communication at all
    one = estimate_cost(_compiled(GPT, "[0]: dp=1", 1).kernel_groups(), fast.restricted(1))
    assert one.ranks[0].comm_s == 0 and one.ranks[0].compute_s > 0


def test_pipeline_bubble_shrinks_with_micro_batches():
    prof = DeviceProfile.uniform(2)
    bubbles = {}
    for m in (1, 4):
        c = _compiled(GPT, "[0,1]: pp=2", 2, (f"microbatches={m}",))
        est = estimate_cost(c.kernel_groups(), prof)
        assert all(r.bubble_s > 0 for r in est.ranks)
        bubbles[m] = max(r.bubble_s for r in est.ranks) / est.step_s
    assert bubbles[4] < bubbles[1]
    # GPipe and 1F1B: the same bubble, 1F1B never more memory
    g = estimate_cost(_compiled(GPT, "[0,1]: pp=2", 2, ("microbatches=4",)).kernel_groups(), prof)
    f = estimate_cost(_compiled(GPT, "[0,1]: pp=2", 2, ("microbatches=4", "pipeline_schedule=1f1b")).kernel_groups(),
                      prof)
    assert f.step_s == pytest.approx(g.step_s, rel=0.05)
    assert f.ranks[0].peak_bytes <= g.ranks[0].peak_bytes


def test_no_bubble_without_a_pipeline_and_peak_memory_is_the_plans():
    c = _compiled(MLP, "[0,1]: dp=2 share=3 | [2]: dp=1 share=1", 3)
    est = estimate_cost(c.physical, DeviceProfile.uniform(3))
    assert [r.rank for r in est.ranks] == [0, 1, 2]
    assert all(r.bubble_s == 0 for r in est.ranks)
    for devices, module in physical_groups(c.physical):
        fn = next(op for op in module.body.block.ops if isinstance(op, func.FuncOp) and op.sym_name.data == "train_step")
        for rank in devices:
            assert est.ranks[rank].peak_bytes == build_schedule(fn, rank).peak_bytes
    # the heterogeneous step waits for its slowest group: slow down the lone rank 2
    slow2 = estimate_cost(c.physical, DeviceProfile.uniform(3, speed=[1, 1, 0.1]))
    assert slow2.slowest_rank == 2 and slow2.step_s > est.step_s


def test_format_and_errors():
    c = _compiled(MLP, "[0,1]: dp=2", 2)
    est = estimate_cost(c.kernel_groups(), DeviceProfile.uniform(2))
    assert isinstance(est, CostEstimate)
    text = est.format()
    assert "compute ms" in text and "step:" in text and len(text.splitlines()) == 5
    with pytest.raises(CostError, match="profile describes 1 ranks"):
        estimate_cost(c.kernel_groups(), DeviceProfile.uniform(1))


def test_compile_cost_on_the_command_line(tmp_path):
    proc = run_cli("hspmd", "compile", MLP, "-n", "2", "--cost", check=True)
    assert "synthetic default CPU profile" in proc.stdout and "step:" in proc.stdout
    path = tmp_path / "p.json"
    DeviceProfile.uniform(3, speed=[1, 0.5, 1]).save(str(path))
    proc = run_cli("hspmd", "compile", MLP, "-n", "2", "--cost", "--profile", str(path), check=True)
    assert "rank 1 is the slowest" in proc.stdout
    bad = run_cli("hspmd", "compile", MLP, "-n", "4", "--cost", "--profile", str(path))
    assert bad.returncode == 1 and "describes 3 ranks" in bad.stderr and "Traceback" not in bad.stderr
    (tmp_path / "bad.json").write_text("{}")
    bad = run_cli("hspmd", "compile", MLP, "-n", "2", "--cost", "--profile", str(tmp_path / "bad.json"))
    assert bad.returncode == 1 and "not a device profile" in bad.stderr and bad.stderr.count("\n") == 1


def test_bucketed_all_reduces_overlap_the_backward():
    c = _compiled(GPT, "[0,1]: dp=2", 2)
    prof = DeviceProfile.uniform(2)
    blocking = estimate_cost(c.kernel_groups(), prof, bucket_bytes=None)
    bucketed = estimate_cost(c.kernel_groups(), prof, bucket_bytes=1 << 16)
    assert blocking.ranks[0].exposed_comm_s == pytest.approx(blocking.ranks[0].comm_s)
    assert bucketed.ranks[0].exposed_comm_s < bucketed.ranks[0].comm_s / 2
    assert bucketed.step_s < blocking.step_s


def test_bucket_overlap_of_the_profile_sets_what_hides():
    c = _compiled(GPT, "[0,1]: dp=2", 2)
    costs = [estimate_cost(c.kernel_groups(), DeviceProfile.uniform(2, bucket_overlap=o), bucket_bytes=1 << 16)
             for o in (0.0, 0.5, 1.0)]
    none, half, full = (x.ranks[0] for x in costs)
    assert none.comm_s == half.comm_s == full.comm_s  # the same transfers
    assert none.exposed_comm_s == pytest.approx(none.comm_s)  # on the rank's own time: nothing hides
    assert full.exposed_comm_s < half.exposed_comm_s < none.exposed_comm_s
    assert costs[0].step_s > costs[2].step_s
    assert DeviceProfile.default_cpu(2).bucket_overlap == 0.0  # measured near 0 on CPU ranks (docs/planning.md)


def test_resync_is_paid_by_collectives_after_compute_in_proportion_to_it():
    from dataclasses import replace as dc_replace

    base = DeviceProfile.uniform(2)
    fits = tuple(CollectiveFit.from_points(k, (0, 1), [(1024, 1e-5), (1 << 22, 1e-3)]) for k in COLLECTIVES)
    plain = DeviceProfile(base.ranks, base.default_link, {}, fits)
    resync = DeviceProfile(base.ranks, base.default_link, {},
                           tuple(dc_replace(f, resync_s=1e-3, resync_after_s=1e-3) for f in fits))
    tp = _compiled(GPT, "[0,1]: tp=2", 2)
    dp = _compiled(GPT, "[0,1]: dp=2", 2)
    extra_tp = estimate_cost(tp.physical, resync).step_s - estimate_cost(tp.physical, plain).step_s
    extra_dp = estimate_cost(dp.physical, resync).step_s - estimate_cost(dp.physical, plain).step_s
    calls_tp = sum(1 for op in tp.physical.walk() if op.name == "comm.all_reduce")
    assert extra_tp > 2e-3  # tp's collectives follow whole layers of compute
    assert 0 < extra_dp < extra_tp  # between two gradient sums, only one parameter's update
    assert calls_tp > 0


def _step(compiled, rank: int = 0):
    for devices, module in compiled.kernel_groups():
        if rank in devices:
            return next(op for op in module.body.block.ops if isinstance(op, func.FuncOp)
                        and op.sym_name.data == "train_step")
    raise AssertionError(rank)


def test_gpt_gradient_sums_are_one_blocking_bucket_priced_as_one_all_reduce():
    c = _compiled(GPT, "[0,1]: dp=2", 2)
    schedule = build_schedule(_step(c), 0)
    assert [b.blocking for b in schedule.buckets] == [True]  # the loss and every gradient, after the backward
    assert not any(s.kind == "op" and s.op is not None and s.op.name == "comm.all_reduce" for s in schedule.steps)
    prof = DeviceProfile.uniform(2)
    est = estimate_cost(c.kernel_groups(), prof)
    one = prof.time("all_reduce", (0, 1), schedule.buckets[0].nbytes())
    assert est.ranks[0].comm_s == pytest.approx(one) and est.ranks[0].exposed_comm_s >= one


def test_a_stack_of_products_runs_at_the_rate_of_one_of_them():
    from hspmd.codegen.cost_model import compute_seconds
    from hspmd.codegen.schedule.analysis import op_matmul_flops
    from hspmd.dialects import graph
    from hspmd.ir.device_profile import MatmulPoint, RankRates

    # small products slow, big ones fast: attention's per-head products (both operands batched)
    # are priced at one product's rate, a batch of rows times a weight at the rate of all its FLOPs
    rates = RankRates((MatmulPoint(1e5, 10.0), MatmulPoint(1e9, 100.0)), 5e9)
    prof = DeviceProfile((rates,), Link(1e-5, 1e9))
    stacked = weights = 0
    for node in build_schedule(_step(_compiled(GPT, "[0]: dp=1", 1)), 0).steps:
        op = node.op
        if not isinstance(op, graph.MatmulOp):
            continue
        a, b = (v.type.get_shape() for v in op.operands)
        flops = op_matmul_flops(op)
        if len(a) > 2 and len(b) > 2:
            product = flops / math.prod(op.results[0].type.get_shape()[:-2])
            assert compute_seconds(op, 0, prof) == pytest.approx(flops / (rates.matmul_gflops(product) * 1e9))
            assert compute_seconds(op, 0, prof) > prof.matmul_seconds(0, flops)
            stacked += 1
        elif len(b) == 2:
            assert compute_seconds(op, 0, prof) == pytest.approx(prof.matmul_seconds(0, flops))
            weights += 1
    assert stacked and weights
