"""The planner: facts read from the IR, candidates that fit the devices and compile, batch rows
that follow device speed, the memory limit, `hspmd plan` and `hspmd run --strategy auto`."""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import EXAMPLES, run_cli
from hspmd.codegen.cost_model import estimate_cost
from hspmd.codegen.schedule.analysis import matmul_flops
from hspmd.compiler import compile_script
from hspmd.dialects.levels import physical_groups
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.ir.device_profile import DeviceProfile
from hspmd.ir.strategy import parse_strategy
from hspmd.planner import Machine, PlanError, model_facts, plan
from hspmd.planner.cost import GroupConfig, group_cost
from hspmd.planner.facts import DataParallelSync
from hspmd.planner.search import clusters, preference

GPT = os.path.join(EXAMPLES, "gpt.py")
SMALL = ["model.d_model=32", "model.seq_len=8", "model.heads=4", "model.layers=2", "data.batch_size=8"]
SETS = [a for s in SMALL for a in ("--set", s)]


@pytest.fixture(scope="module")
def script():
    return load_script(GPT, parse_overrides(SMALL))


@pytest.fixture(scope="module")
def facts(script):
    return model_facts(script, 8)


def test_facts_come_from_the_ir(script, facts):
    compiled = compile_script(script, "[0]: dp=1", 1)
    (_, module), = physical_groups(compiled.physical)
    fn = next(op for op in module.body.block.ops if getattr(op, "sym_name", None) and op.sym_name.data == "train_step")
    assert facts.matmul_flops == matmul_flops(fn)
    assert facts.rows == 8 and facts.layers == 2 and facts.max_pp == 2
    assert facts.tp_degrees[:2] == (1, 2) and 8 not in facts.tp_degrees  # 4 heads: tp=8 does not fit
    assert facts.tp_bytes > 0 and facts.pp_bytes > 0 and facts.param_bytes > 0
    assert 2 * facts.param_bytes <= facts.state_bytes <= 2 * facts.param_bytes + 64  # AdamW: m, v and scalars


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
def test_the_best_candidate_fits_the_devices_and_compiles(script, facts, n):
    fits, _ = plan(facts, Machine.uniform(n))
    assert fits == sorted(fits, key=preference)  # by step time, ZeRO needing a clear win
    best = fits[0]
    assert parse_strategy(best.strategy()).num_devices == n
    compile_script(script, best.strategy(), n, microbatches=best.microbatches, pipeline_schedule=best.schedule)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([0.5, 1.0, 2.0, 4.0]), min_size=1, max_size=8))
def test_every_candidate_is_a_valid_strategy_with_whole_rows(facts, speeds):
    n = len(speeds)
    try:
        fits, over = plan(facts, Machine.uniform(n, tuple(speeds)))
    except PlanError:
        return  # e.g. 7 devices of 4 speeds and 8 rows: no grouping divides the batch
    for c in fits + over:
        s = parse_strategy(c.strategy())
        if c.idle_ranks:  # a slower cluster left idle: the others' strategy, on the ranks it names
            assert len(set(speeds)) > 1 and set(s.devices).isdisjoint(c.idle_ranks)
            assert sorted(s.devices + c.idle_ranks) == list(range(n))
        else:
            s.check_devices(n)
        assert sum(c.rows) == facts.rows
        for g, r in zip(c.groups, c.rows):  # a pipeline's rows divide into micro-batches; others may be uneven
            assert r >= g.dp and (g.pp == 1 or r % (g.dp * c.microbatches) == 0)


def test_faster_devices_get_more_rows(facts):
    machine = Machine.uniform(3, (1.0, 1.0, 3.0))
    assert clusters(machine, facts.mean_matmul_flops()) == [(2,), (0, 1)]
    fits, _ = plan(facts, machine)
    hetero = next(c for c in fits if len(c.groups) == 2)
    rows = {g.devices: r / len(g.devices) for g, r in zip(hetero.groups, hetero.rows)}
    assert rows[(2,)] > rows[(0, 1)]


def test_costs_order_the_obvious_cases(facts):
    fast, slow = Machine.uniform(2), Machine.uniform(2, (1.0, 0.5))
    dp2 = GroupConfig((0, 1), dp=2)
    assert group_cost(facts, slow, dp2, 8).step_s > group_cost(facts, fast, dp2, 8).step_s
    pp2 = GroupConfig((0, 1), pp=2)
    assert group_cost(facts, fast, pp2, 8, m=1).bubble_s > group_cost(facts, fast, pp2, 8, m=4).bubble_s
    zero = GroupConfig((0, 1), dp=2, zero=1)
    assert group_cost(facts, fast, zero, 8).memory_bytes < group_cost(facts, fast, dp2, 8).memory_bytes


def test_a_memory_limit_drops_candidates(facts):
    fits, over = plan(facts, Machine.uniform(4))
    limit = sorted(c.memory_bytes for c in fits)[len(fits) // 2]
    fits2, over2 = plan(facts, Machine.uniform(4), limit)
    assert all(c.memory_bytes <= limit for c in fits2) and over2
    assert all(c.memory_bytes > limit for c in over2)


def test_sixty_four_devices_plan(facts):
    fits, _ = plan(facts, Machine.uniform(64, (1.0,) * 32 + (2.0,) * 32))
    # 8 rows over 64 ranks: the 32 faster ones alone are faster, the slower half idle
    best = fits[0]
    assert fits and parse_strategy(best.strategy()).num_devices + len(best.idle_ranks) == 64
    assert set(best.idle_ranks) <= set(range(32))


def test_hspmd_plan_prints_a_strategy_line_run_accepts(tmp_path):
    r = run_cli("hspmd", "plan", GPT, "-n", "4", *SETS, timeout=300)
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert parse_strategy(last).num_devices == 4
    assert "why not" in r.stdout and "fastest" in r.stdout


def test_hspmd_run_strategy_auto(tmp_path):
    log = tmp_path / "a.jsonl"
    r = run_cli("hspmd", "run", "-n", "2", GPT, "--strategy", "auto", "--steps", "2", "--log", str(log), *SETS,
                timeout=300)
    assert r.returncode == 0, r.stderr
    assert "--strategy auto chose" in r.stdout
    assert len(log.read_text().splitlines()) == 2


@pytest.mark.parametrize("args,message", [
    (["--memory-per-rank", "lots"], "expected a size"),
    (["--memory-per-rank", "1KiB"], "the leanest of"),
    (["--profile", "/nonexistent/profile.json"], "profile.json"),
    (["-n", "3", "--profile", "PROFILE2"], "describes 2 ranks, the program runs on 3"),
])
def test_plan_errors_are_one_line(tmp_path, args, message):
    from hspmd.ir.device_profile import DeviceProfile

    DeviceProfile.uniform(2).save(str(tmp_path / "p2.json"))
    args = [str(tmp_path / "p2.json") if a == "PROFILE2" else a for a in args]
    r = run_cli("hspmd", "plan", GPT, "-n", "2", *args, *SETS, timeout=300)
    assert r.returncode != 0
    assert message in r.stderr and "Traceback" not in r.stderr


def test_uneven_tp_degrees_are_planned_and_priced_by_the_busiest_rank(facts):
    """3 heads: tp=2 is allowed (2 heads and 1), priced at the rank with 2; 4 heads split evenly."""
    three = model_facts(load_script(GPT, parse_overrides([*SMALL[:2], "model.heads=3", "model.d_model=24",
                                                          *SMALL[3:]])), 4)
    assert three.tp_degrees == (1, 2)  # tp=4 would leave a rank without a head
    assert facts.tp_busiest(2) == 1.0 and 1.0 < three.tp_busiest(2) < 4 / 3
    machine, config = Machine.uniform(2), GroupConfig((0, 1), 1, 2, 1, 0)
    even = dataclasses.replace(three, tp_imbalance=())
    assert group_cost(three, machine, config, 8).compute_s > group_cost(even, machine, config, 8).compute_s
    fits, _ = plan(three, machine)
    assert any(g.tp == 2 for c in fits for g in c.groups)  # priced among the candidates
    assert not any(g.sp for c in fits for g in c.groups)  # the compiler refuses sp beside uneven tp


# --- overlap, sequence parallelism, and agreement with the IR cost model ---------------------------


def _best(facts, profile, memory=None):
    fits, _ = plan(facts, Machine(profile), memory)
    return fits[0]


def test_sp_twin_wins_where_replicated_elementwise_work_is_slow_and_loses_where_latency_is(facts):
    assert facts.sp is not None and facts.tp is not None
    # sp splits the residual stream's elementwise work over tp, at twice the collectives
    assert facts.sp.activation_bytes_written < facts.tp.activation_bytes_written
    assert sum(c for _, _, c in facts.sp.collectives) > sum(c for _, _, c in facts.tp.collectives)
    for ew, latency, sp_faster in ((0.2, 1e-7, True), (10, 1e-4, False)):
        fits, _ = plan(facts, Machine(DeviceProfile.uniform(2, elementwise_gbps=ew, latency_s=latency)))
        by = {c.strategy(): c.step_s for c in fits}
        assert (by["[0,1]: dp=1 tp=2 sp=1"] < by["[0,1]: dp=1 tp=2"]) == sp_faster


def test_the_planner_picks_sp_when_only_its_activation_memory_fits(script, facts):
    fits, _ = plan(facts, Machine.uniform(4))
    plain = min(c.memory_bytes for c in fits if not any(g.sp for g in c.groups))
    best = _best(facts, DeviceProfile.default_cpu(4), memory=plain * 0.99)
    assert best.groups[0].sp == 1 and best.memory_bytes < plain
    compile_script(script, best.strategy(), 4, microbatches=best.microbatches, pipeline_schedule=best.schedule)


def test_overlap_of_gradient_buckets_makes_dp_the_choice_when_the_profile_hides_them(facts):
    # a model whose schedule buckets its gradients (8 buckets of 4 MiB), on a slow link: without
    # overlap the gradient sync costs dp its lead; hidden behind the backward, dp wins
    big = dataclasses.replace(facts, dp_sync=DataParallelSync(0.0, 0, (4 << 20,) * 8), param_bytes=32 << 20,
                              state_bytes=64 << 20, matmul_flops=facts.matmul_flops * 2000)
    slow = dict(bandwidth_gbps=0.5, latency_s=1e-3)
    hidden = _best(big, DeviceProfile.uniform(2, bucket_overlap=1.0, **slow))
    exposed = _best(big, DeviceProfile.uniform(2, bucket_overlap=0.0, **slow))
    assert hidden.strategy() == "[0,1]: dp=2" and exposed.groups[0].dp == 1
    dp2 = GroupConfig((0, 1), dp=2)
    with_overlap = group_cost(big, Machine(DeviceProfile.uniform(2, bucket_overlap=1.0, **slow)), dp2, 8)
    without = group_cost(big, Machine(DeviceProfile.uniform(2, bucket_overlap=0.0, **slow)), dp2, 8)
    assert with_overlap.dp_hidden_s > 0 and without.dp_hidden_s == 0
    assert with_overlap.dp_s + with_overlap.dp_hidden_s == pytest.approx(without.dp_s)
    assert with_overlap.dp_s >= without.dp_s / 8  # the last bucket is always waited for


def test_gpt_gradient_sums_are_blocking_as_its_schedule_runs_them(facts):
    # GPT's optimizer reads each gradient right after its sum: nothing can overlap them, so the
    # schedule sums them all, and the loss, in one blocking (coalesced) bucket; the planner prices
    # that one all-reduce, and overlap changes nothing
    assert facts.dp_sync.bucket_bytes == () and facts.dp_sync.blocking_calls == 1
    assert facts.dp_sync.blocking_bytes == facts.param_bytes + 4  # + the loss
    dp2 = GroupConfig((0, 1), dp=2)
    costs = [group_cost(facts, Machine(DeviceProfile.uniform(2, bucket_overlap=o)), dp2, 8) for o in (0.0, 1.0)]
    assert costs[0].dp_s == costs[1].dp_s > 0 and costs[1].dp_hidden_s == 0


@pytest.mark.parametrize("overlap", [0.0, 1.0])
@pytest.mark.parametrize("strategy, config, m", [
    ("[0]: dp=1", GroupConfig((0,)), 1),
    ("[0,1]: dp=2", GroupConfig((0, 1), dp=2), 1),
    ("[0,1]: tp=2", GroupConfig((0, 1), tp=2), 1),
    ("[0,1]: tp=2 sp=1", GroupConfig((0, 1), tp=2, sp=1), 1),
    ("[0,1]: pp=2", GroupConfig((0, 1), pp=2), 2),
    ("[0-3]: dp=2 tp=2", GroupConfig((0, 1, 2, 3), dp=2, tp=2), 1),
    ("[0-3]: dp=4", GroupConfig((0, 1, 2, 3), dp=4), 1),
])
def test_the_planner_agrees_with_the_ir_cost_model(script, facts, strategy, config, m, overlap):
    """The planner's price of a candidate (from the facts, without compiling it) stays within 25 %
    of the IR cost model's over the compiled program, on the same profile and per-kernel cost."""
    n = len(config.devices)
    profile = DeviceProfile.uniform(n, gflops=40, elementwise_gbps=10, latency_s=10e-6, bandwidth_gbps=5,
                                    bucket_overlap=overlap)
    machine = Machine(profile)
    schedule = "1f1b" if m > 1 else "gpipe"
    compiled = compile_script(script, strategy, n, microbatches=m, pipeline_schedule=schedule)
    ir = estimate_cost(compiled.physical, profile, overhead_s=machine.op_overhead)
    planned = group_cost(facts, machine, config, facts.rows, m, schedule)
    assert planned.step_s == pytest.approx(ir.step_s, rel=0.25)


# --- expert parallelism for a mixture-of-experts model --------------------------------------------

MOE = os.path.join(EXAMPLES, "moe.py")
MOE_SMALL = ["model.d_model=32", "model.d_ff=256", "model.seq_len=8", "model.heads=2", "model.layers=2",
             "data.batch_size=8"]


@pytest.fixture(scope="module")
def moe_script():
    return load_script(MOE, parse_overrides(MOE_SMALL))


@pytest.fixture(scope="module")
def moe_facts(moe_script):
    return model_facts(moe_script, 4)


def test_expert_parallel_facts_come_from_the_ep_probe(moe_facts, facts):
    ep = moe_facts.ep
    assert ep is not None and ep.experts == 4 and ep.expert_tensors == 2
    assert 0 < ep.expert_param_bytes < moe_facts.param_bytes
    assert ep.all_to_all[1] == 4 and ep.all_to_all[0] > 0  # tokens in and out, and their gradients
    assert ep.sync.blocking_bytes < moe_facts.dp_sync.blocking_bytes  # the experts are not summed over ep
    assert facts.ep is None  # GPT has no expert layers: no ep candidates
    fits, _ = plan(facts, Machine.uniform(4))
    assert all(g.ep == 1 for c in fits for g in c.groups)


def test_the_planner_searches_ep_and_picks_it_where_expert_gradients_cost_more_than_tokens(moe_script, moe_facts):
    fits, _ = plan(moe_facts, Machine.uniform(4))
    assert {g.ep for c in fits for g in c.groups} == {1, 2, 4}  # every degree dividing 4 experts and 4 ranks
    # the experts are most of the parameters: dp sums their gradients, ep moves the (few) tokens instead
    assert moe_facts.ep.expert_param_bytes > moe_facts.param_bytes / 2
    profile = DeviceProfile.uniform(2, latency_s=1e-6)
    by = {c.strategy(): c.step_s for c in plan(moe_facts, Machine(profile))[0]}
    assert by["[0,1]: dp=1 ep=2"] < by["[0,1]: dp=2"]
    best = _best(moe_facts, profile)
    assert best.groups[0].ep == 2
    compile_script(moe_script, best.strategy(), 2, microbatches=best.microbatches, pipeline_schedule=best.schedule)


@pytest.mark.parametrize("strategy, config", [
    ("[0,1]: ep=2", GroupConfig((0, 1), ep=2)),
    ("[0-3]: dp=2 ep=2", GroupConfig((0, 1, 2, 3), dp=2, ep=2)),
    ("[0,1]: dp=2", GroupConfig((0, 1), dp=2)),
])
def test_the_planner_agrees_with_the_ir_cost_model_on_experts(moe_script, moe_facts, strategy, config):
    n = len(config.devices)
    profile = DeviceProfile.default_cpu(n)
    machine = Machine(profile)
    ir = estimate_cost(compile_script(moe_script, strategy, n).physical, profile, overhead_s=machine.op_overhead)
    assert group_cost(moe_facts, machine, config, moe_facts.rows).step_s == pytest.approx(ir.step_s, rel=0.25)
