"""Graph switching (docs/switching.md): one bundle of several strategies, switched at step boundaries
with parameters and optimizer states moved in memory, gives the 1-device losses and parameters
whatever the order; in process (random orders among dp, tp, pp with micro-batches, unequal shares
and ZeRO) and over MPI (`hspmd run --strategy ... --switch-every K`).

The random order is one per run, drawn from the run's seed (`HSPMD_TEST_SEED`, printed in pytest's
header; the test id names it); `test_every_strategy_reached_from_every_other` runs every switch."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from conftest import EXAMPLES, RUN_SEED, run_cli
from hspmd.compiler import compile_script, compile_strategies, write_bundle
from hspmd.frontend.script import load_script, parse_overrides
from hspmd.codegen.bundle import read_manifest
from hspmd.runtime.comm.inprocess import run_spmd
from hspmd.runtime.stacked import layer_leaves
from hspmd.runtime.switch import bundle_holdings
from hspmd.runtime.worker import load_rank_program, train

GPT = os.path.join(EXAMPLES, "gpt.py")
SMALL = ["model.d_model=32", "model.seq_len=8", "model.heads=4", "model.layers=2", "data.batch_size=4",
         "optim.warmup=1", "microbatches=2"]
STEPS = 8
STRATEGIES = ["[0,1]: dp=2", "[0,1]: tp=2", "[0,1]: pp=2", "[0]: dp=1 share=3 | [1]: dp=1 share=1",
              "[0,1]: dp=2 zero=1"]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    script = load_script(GPT, parse_overrides(SMALL + [f"steps={STEPS}"]))
    ref = str(tmp_path_factory.mktemp("ref"))
    write_bundle(compile_script(script, "[0]: dp=1", 1), ref)
    switching = str(tmp_path_factory.mktemp("switch"))
    write_bundle(compile_strategies(script, STRATEGIES, 2), switching)
    one = run_spmd(1, lambda c: train(ref, c, steps=STEPS, quiet=True), timeout=300)[0]
    return switching, one


def test_bundle_holds_one_program_per_distinct_strategy(tmp_path):
    script = load_script(GPT, parse_overrides(SMALL))
    compiled = compile_strategies(script, ["[0,1]: dp=2", "[0,1]: tp=2", "[0,1]: dp=2"], 2)
    assert compiled[0] is compiled[2] and compiled[1] is not compiled[0]
    assert [c.strategy.id for c in compiled] == [0, 1, 0]
    write_bundle(compiled, str(tmp_path))
    assert read_manifest(str(tmp_path)).variants == ["strategy-1", "."]
    assert read_manifest(str(tmp_path / "strategy-1")).strategy == "[0,1]: dp=1 tp=2"


@pytest.mark.parametrize("seed", [RUN_SEED])
def test_random_switch_orders_equal_one_device(bundles, seed):
    """One random order of `STRATEGIES` per run (the run's seed), starting in the bundle's first
    strategy on even seeds."""
    switching, one = bundles
    rng = random.Random(seed)
    order = [rng.randrange(len(STRATEGIES)) for _ in range(STEPS)]
    order[0] = 0 if seed % 2 == 0 else order[0]
    ranks = run_spmd(2, lambda c: train(switching, c, steps=STEPS, quiet=True, strategy_order=order), timeout=300)
    print(f"\norder {order}: losses {ranks[0].losses}\n1 device {one.losses}")
    switches = [(a, b) for _, a, b, _ in ranks[0].switches]
    assert len(switches) == sum(1 for i in range(STEPS) if order[i] != ([0] + order)[i])
    for r in ranks:
        np.testing.assert_allclose(r.losses, one.losses, rtol=1e-5)
    got = ranks[0].params
    assert set(got) == set(one.params)
    for name, value in one.params.items():  # micro-batches and ZeRO sum in another order
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=5e-5, err_msg=name)


def test_every_strategy_reached_from_every_other(tmp_path):
    """All ordered pairs in one run: 0 1 0 2 0 3 0 4 1 2 1 3 ... (the script's step count sets
    the learning-rate schedule, so both programs are compiled for this run's length)."""
    n = len(STRATEGIES)
    order = [0]
    for a in range(n):
        for b in range(n):
            if a != b:
                order += [a, b]
    steps = len(order)
    script = load_script(GPT, parse_overrides(SMALL + [f"steps={steps}"]))
    ref = run_spmd(1, lambda c: train(_bundle(script, "[0]: dp=1", 1), c, steps=steps, quiet=True), timeout=300)[0]
    switching = write_bundle(compile_strategies(script, STRATEGIES, 2), str(tmp_path))
    ranks = run_spmd(2, lambda c: train(switching, c, steps=steps, quiet=True, strategy_order=order), timeout=600)
    for r in ranks:
        np.testing.assert_allclose(r.losses, ref.losses, rtol=1e-5)


_made: dict[tuple[str, int], str] = {}


def _bundle(script, strategy: str, n: int) -> str:
    import tempfile

    key = (strategy, n)
    if key not in _made:
        _made[key] = write_bundle(compile_script(script, strategy, n), tempfile.mkdtemp(prefix="hspmd-switch-"))
    return _made[key]


def test_holdings_agree_with_each_ranks_plan(bundles):
    """What the switch plans with (every group program's parameters) is what each rank's plan holds."""
    switching, _ = bundles
    manifest = read_manifest(switching)
    for sub in [".", *manifest.variants]:
        where = os.path.join(switching, sub)
        held = bundle_holdings(where)
        mine = run_spmd(2, lambda c: {p.name: p.layout.slices(c.rank, p.global_shape) for p in layer_leaves(
            load_rank_program(where, read_manifest(where), c, "numpy", True).plan.params)})  # per layer, as held
        for r in range(2):
            assert set(mine[r]) == set(held[r]), sub
            for name, leaf in held[r].items():
                assert leaf.layout.slices(r, leaf.global_shape) == mine[r][name], (sub, name)


@pytest.mark.mpi
def test_switching_over_mpi_equals_one_device(tmp_path):
    small = [a for s in SMALL[:-1] for a in ("--set", s)]
    ref, sw = tmp_path / "ref.jsonl", tmp_path / "sw.jsonl"
    run_cli("hspmd", "run", "-n", "1", GPT, "--steps", "9", "--log", str(ref), *small, check=True, timeout=300)
    run_cli("hspmd", "run", "-n", "3", GPT, "--steps", "9", "--log", str(sw), *small,
            "--strategy", "[0-2]: dp=3", "--strategy", "[0,1]: tp=2 share=2 | [2]: tp=1 share=1",
            "--strategy", "[0-2]: dp=3 zero=1", "--strategy", "[0,1]: pp=2 | [2]: dp=1",
            "--switch-every", "2", check=True, timeout=600)
    a = [json.loads(line) for line in ref.read_text().splitlines()]
    b = [json.loads(line) for line in sw.read_text().splitlines()]
    assert [r["strategy"] for r in b] == [0, 0, 1, 1, 2, 2, 3, 3, 0]
    assert all("switch_bytes" in r for r in b if r["step"] in (3, 5, 7, 9))
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], rtol=1e-5)


def test_switch_every_needs_several_strategies(tmp_path):
    proc = run_cli("hspmd", "run", "-n", "2", GPT, "--strategy", "[0,1]: dp=2", "--switch-every", "2")
    assert proc.returncode == 1 and "--switch-every needs two or more --strategy" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_switching_refuses_checkpoints_in_one_message(tmp_path):
    proc = run_cli("hspmd", "run", "-n", "2", GPT, "--strategy", "[0,1]: dp=2", "--strategy", "[0,1]: tp=2",
                   "--checkpoint-dir", str(tmp_path / "ck"))
    assert proc.returncode == 1 and "do not go together with checkpoints" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_compile_prints_each_strategys_level():
    proc = run_cli("hspmd", "compile", GPT, "--set", "model.layers=1", "--strategy", "[0,1]: dp=2",
                   "--strategy", "[0,1]: tp=2", "--level", "annotated", check=True)
    assert "// strategy 0: [0,1]: dp=2" in proc.stdout and "// strategy 1: [0,1]: dp=1 tp=2" in proc.stdout
    assert 'id = 1, "[0,1]: dp=1 tp=2"' in proc.stdout.replace("#dist.strategy<", "")


LEAVE = ["[0-2]: dp=3 zero=1", "[0,1]: tp=2"]  # three ranks (rank 2 alone holds a third of the optimizer
# states), then the two that stay


def test_graceful_leave_in_process_equals_one_device(bundles, tmp_path):
    """Rank 2 is asked to leave before step 5: every rank switches to the strategy without it, rank 2
    hands over its pieces and stops; no step is lost, and the result is the 1-device result."""
    _, one = bundles
    script = load_script(GPT, parse_overrides(SMALL + [f"steps={STEPS}"]))
    bundle = write_bundle(compile_strategies(script, LEAVE, 3), str(tmp_path))
    ranks = run_spmd(3, lambda c: train(bundle, c, steps=STEPS, quiet=True, leave_at=(2, 5)), timeout=300)
    assert ranks[0].left == [(5, [2])] and len(ranks[2].losses) == 4 and ranks[2].params is None
    assert [s[:3] for s in ranks[0].switches] == [(5, 0, 1)] and ranks[0].switches[0][3].bytes_moved > 0
    for r in ranks[:2]:
        np.testing.assert_allclose(r.losses, one.losses, rtol=1e-5)
    for name, value in one.params.items():
        np.testing.assert_allclose(ranks[0].params[name], value, rtol=1e-4, atol=5e-5, err_msg=name)


def test_leave_without_a_strategy_to_go_to(bundles, tmp_path):
    script = load_script(GPT, parse_overrides(SMALL + [f"steps={STEPS}"]))
    bundle = write_bundle(compile_strategies(script, ["[0-2]: dp=3", "[0]: dp=1"], 3), str(tmp_path))
    from hspmd.runtime.launcher.leave import LeaveError

    with pytest.raises(LeaveError, match=r"rank 2 asked to leave, but no strategy of the run runs on ranks \[0, 1\]"):
        run_spmd(3, lambda c: train(bundle, c, steps=STEPS, quiet=True, leave_at=(2, 3)), timeout=300)


@pytest.mark.mpi
def test_graceful_leave_over_mpi(tmp_path):
    """`-n 3`, SIGTERM to rank 2 at step 8 (HSPMD_LEAVE sends it): the run finishes on 2 ranks, 10 steps."""
    small = [a for s in SMALL[:-1] for a in ("--set", s)]
    ref, log = tmp_path / "ref.jsonl", tmp_path / "leave.jsonl"
    run_cli("hspmd", "run", "-n", "1", GPT, "--steps", "10", "--log", str(ref), *small, check=True, timeout=300)
    run_cli("hspmd", "run", "-n", "3", GPT, "--steps", "10", "--log", str(log), *small,
            "--strategy", LEAVE[0], "--strategy", LEAVE[1], env={"HSPMD_LEAVE": "2:8"}, check=True, timeout=600)
    a = [json.loads(line) for line in ref.read_text().splitlines()]
    b = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in b] == list(range(1, 11))
    assert [r.get("left") for r in b] == [None] * 7 + [[2]] + [None] * 2 and b[7]["switch_bytes"] > 0
    assert [r["ranks"] for r in b] == [3] * 10  # the world's size
    np.testing.assert_allclose([r["loss"] for r in b], [r["loss"] for r in a], rtol=1e-5)
