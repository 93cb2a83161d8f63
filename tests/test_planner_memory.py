"""The planner under a memory budget: zero=3 and recompute are candidates, priced (extra gathers,
recomputed FLOPs, smaller activations), chosen where only they fit, and said to be why."""

from __future__ import annotations

import os

import pytest

from hspmd.cli.plan import what_made_it_fit
from hspmd.compiler import compile_script
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.planner import Machine, model_facts, plan
from hspmd.planner.cost import GroupConfig, group_cost

GPT = os.path.join(os.path.dirname(__file__), "..", "examples", "gpt.py")
SMALL = ["model.layers=6", "model.d_model=64", "model.heads=4", "model.seq_len=32", "data.batch_size=8"]


@pytest.fixture(scope="module")
def script():
    return load_script(GPT, parse_overrides(SMALL))


@pytest.fixture(scope="module")
def facts(script):
    return model_facts(script, 4)


def test_recompute_facts_and_costs(facts):
    grow, shrink = facts.recompute_ratios("block")
    # one more forward; fewer activations at the peak (a small model's peak is mostly the backward's
    # own working set, which recompute does not shrink)
    assert 1.1 < grow < 1.5 and shrink < 1.0
    sel_grow, sel_shrink = facts.recompute_ratios("selective")
    assert 1.0 < sel_grow < grow and shrink <= sel_shrink <= 1.0
    machine = Machine.uniform(4)
    z1, z3, z1_rc, z3_rc = (group_cost(facts, machine, GroupConfig(tuple(range(4)), dp=4, **k), facts.rows)
                            for k in ({"zero": 1}, {"zero": 3}, {"zero": 1, "recompute": "block"},
                                      {"zero": 3, "recompute": "block"}))
    assert z3.dp_s > z1.dp_s and z3.memory_bytes < z1.memory_bytes  # gathered twice; parameters sharded
    assert z1_rc.compute_s > z1.compute_s and z1_rc.memory_bytes < z1.memory_bytes
    assert z3_rc.memory_bytes < min(z3.memory_bytes, z1_rc.memory_bytes)


def test_only_zero3_and_recompute_fit_and_the_plan_says_so(script, facts):
    fits, _ = plan(facts, Machine.uniform(4))
    lean = lambda c: any(g.zero == 3 or g.recompute != "none" for g in c.groups)  # noqa: E731
    plain = min(c.memory_bytes for c in fits if not lean(c))
    leaner = min(c.memory_bytes for c in fits if lean(c))
    assert leaner < plain
    budget = (leaner + plain) / 2  # only a candidate with zero=3 or recompute fits
    fits, over = plan(facts, Machine.uniform(4), budget)
    best = fits[0]
    assert lean(best) and all(lean(c) for c in fits), best.strategy()
    line = what_made_it_fit(best, fits + over, budget)
    assert line is not None and "made it fit" in line and "over --memory-per-rank" in line
    compile_script(script, best.strategy(), 4, microbatches=best.microbatches, pipeline_schedule=best.schedule)
    assert what_made_it_fit(best, fits + over, None) is None
