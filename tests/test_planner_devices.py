"""The planner over GPU and CPU ranks: a profile's per-rank kinds (`meta["kinds"]`, written by
`hspmd profile --device cuda,cpu`) keep the kinds in groups of their own, each saying its
`device=`, with batch shares from the cost model; `--strategy auto` hands the chosen keys on to
the ranks (`planned_devices`)."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
from conftest import EXAMPLES, run_cli

from hspmd.cli.main import planned_devices
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.ir.strategy import parse_strategy
from hspmd.planner import Machine, model_facts, plan
from hspmd.planner.cost import GroupConfig, group_cost
from hspmd.planner.search import clusters
from hspmd.runtime.cuda.device import DeviceError
from hspmd.runtime.cuda.select import EMULATION

GPT = os.path.join(EXAMPLES, "gpt.py")
SMALL = ["model.d_model=32", "model.seq_len=8", "model.heads=4", "model.layers=2", "data.batch_size=8"]


def machine(speed, kinds) -> Machine:
    """Return ranks of relative `speed`s and device `kinds` on the default CPU profile."""
    profile = Machine.uniform(len(speed), speed).profile
    return Machine(dataclasses.replace(profile, meta={**profile.meta, "kinds": list(kinds)}))


@pytest.fixture(scope="module")
def facts():
    return model_facts(load_script(GPT, parse_overrides(SMALL)), 8)


def test_kinds_come_from_the_profile_and_default_to_cpu():
    assert Machine.uniform(3).kinds == ("cpu",) * 3
    assert machine([1, 1], ["cuda", "cpu"]).kinds == ("cuda", "cpu")
    assert machine([1, 1], ["cuda"]).kinds == ("cpu", "cpu")  # a list of another length says nothing


def test_clusters_never_mix_kinds_and_put_gpus_first():
    assert clusters(machine([1, 1, 1], ["cpu", "cuda", "cpu"]), 1e6) == [(1,), (0, 2)]
    assert clusters(machine([1, 1, 1], ["cpu"] * 3), 1e6) == [(0, 1, 2)]


def test_a_gpu_and_a_cpu_rank_get_groups_of_their_kind_and_shares_by_speed(facts):
    fits, over = plan(facts, machine([1.5, 1], ["cuda", "cpu"]))
    for c in fits + over:
        groups = parse_strategy(c.strategy()).groups
        assert [g.devices for g in groups] == ([(0,)] if c.idle_ranks else [(0,), (1,)])
        assert [g.device for g in groups] == (["cuda"] if c.idle_ranks else ["cuda", "cpu"])
    assert not fits[0].idle_ranks  # 1.5x: the CPU rank's rows save more than the sum across kinds costs
    best = parse_strategy(fits[0].strategy()).groups
    assert best[0].share > best[1].share  # the faster GPU rank takes more of the batch


def test_a_cpu_rank_much_slower_than_the_gpu_rank_is_left_idle(facts):
    fits, _ = plan(facts, machine([50, 1], ["cuda", "cpu"]))
    best = fits[0]
    assert best.idle_ranks == (1,) and best.strategy() == "[0]: dp=1 device=cuda"
    assert best.cross_s == 0.0 and best.rows == (facts.rows,)  # an idle rank costs nothing
    # a real choice: the candidates with both ranks were priced, each paying the CPU rank's
    # compute and the gradient sum across kinds, and lost
    both = [c for c in fits if not c.idle_ranks]
    assert both and all(c.cross_s > 0 and c.step_s > best.step_s for c in both)
    alone = group_cost(facts, Machine.uniform(2, [50, 1]), GroupConfig((0,)), facts.rows)
    assert best.step_s == pytest.approx(alone.step_s)


def test_idle_candidates_come_only_from_slower_clusters(facts):
    fits, over = plan(facts, Machine.uniform(3, [1.0, 1.0, 0.1]))  # rank 2 alone is slow
    assert {c.idle_ranks for c in fits + over} <= {(), (2,)}
    fits, _ = plan(facts, Machine.uniform(2))  # alike ranks: one cluster, nobody idle
    assert all(not c.idle_ranks for c in fits)


def test_strategy_auto_maps_the_working_ranks_keys_onto_the_run(monkeypatch):
    monkeypatch.setenv(EMULATION, "1")
    compiled = SimpleNamespace(strategy=SimpleNamespace(strategy=parse_strategy("[0]: dp=1 device=cuda")))
    args = SimpleNamespace(device_asked="auto", kernels="cpu")
    assert planned_devices(args, compiled, 2, (1,)) == "cpu,cuda"  # device 0 of the program is rank 1


def test_hspmd_plan_says_which_rank_is_idle(tmp_path):
    path = str(tmp_path / "p.json")
    machine([50, 1], ["cuda", "cpu"]).profile.save(path)
    r = run_cli("hspmd", "plan", GPT, "-n", "2", "--profile", path, *[a for s in SMALL for a in ("--set", s)],
                timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == "[0]: dp=1 device=cuda"
    header = next(line for line in lines if line.startswith("#"))
    assert "idle" in header.split()
    assert any(line.startswith("rank 1 (cpu): idle - the step is faster without it (with every rank: ")
               for line in lines), r.stdout


def test_a_machine_of_gpus_only_says_device_cuda_and_of_cpus_nothing(facts):
    fits, _ = plan(facts, machine([1, 1], ["cuda", "cuda"]))
    assert all(g.device == "cuda" for g in parse_strategy(fits[0].strategy()).groups)
    fits, _ = plan(facts, Machine.uniform(2))
    assert "device=" not in fits[0].strategy()


def test_strategy_auto_hands_the_chosen_keys_to_the_ranks(monkeypatch):
    monkeypatch.setenv(EMULATION, "1")
    compiled = SimpleNamespace(strategy=SimpleNamespace(
        strategy=parse_strategy("[0]: dp=1 device=cuda share=3 | [1]: dp=1 device=cpu")))
    args = SimpleNamespace(device_asked="auto", kernels="cpu")
    assert planned_devices(args, compiled, 2) == "cuda,cpu"
    args = SimpleNamespace(device_asked="cpu", kernels="cpu")
    with pytest.raises(DeviceError, match="puts rank 0 on 'cpu' but its strategy group says device=cuda"):
        planned_devices(args, compiled, 2)


@pytest.mark.parametrize("device, text", [
    ("cuda,gpu", "unknown device 'gpu'"),
    ("cuda,cpu,cpu", "--device cuda,cpu,cpu names 3 ranks but the run has -n 2"),
])
def test_hspmd_profile_refuses_a_bad_device_list_in_one_line(tmp_path, device, text):
    r = run_cli("hspmd", "profile", "-n", "2", "--device", device, "-o", str(tmp_path / "p.json"), timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and text in lines[0], r.stderr


def test_strategy_auto_runs_the_plan_that_leaves_the_cpu_rank_idle(tmp_path):
    path = str(tmp_path / "p.json")
    machine([50, 1], ["cuda", "cpu"]).profile.save(path)
    r = run_cli("hspmd", "run", "-n", "2", GPT, "--strategy", "auto", "--profile", path, "--device", "cuda,cpu",
                "--steps", "2", *[a for s in SMALL for a in ("--set", s)], timeout=300, env={EMULATION: "1"})
    assert r.returncode == 0, r.stderr
    assert "--strategy auto chose '[0]: dp=1 device=cuda'" in r.stdout and "rank 1 idle" in r.stdout
    assert sum(1 for line in r.stdout.splitlines() if line.startswith("step ")) == 2
