"""Idle ranks (`hspmd.runtime.launcher.idle`): a strategy naming some of a run's ranks runs on those, the
others run no step and exit cleanly; the log, the checkpoints and the result come from the
working ranks, and match a run of the working ranks alone."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import EXAMPLES, run_cli

from hspmd.codegen.bundle import read_manifest
from hspmd.compiler import compile_script, compile_working, write_bundle
from hspmd.frontend.script import load_script
from hspmd.ir.strategy import StrategyError, parse_strategy
from hspmd.runtime.checkpoint.gathered import load_checkpoint
from hspmd.runtime.launcher.launch import THREAD_VARIABLES, usable_cores
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.comm.base import CommError
from hspmd.runtime.launcher.idle import (
    RankSubset,
    mark_working_ranks,
    working_strategy,
)
from hspmd.runtime.worker import train

MLP = os.path.join(EXAMPLES, "mlp.py")


def test_working_strategy_renumbers_the_named_ranks_in_order():
    s, ranks = working_strategy(parse_strategy("[3]: dp=1 share=2 | [0,2]: dp=2"), 4)
    assert ranks == (0, 2, 3) and str(s) == "[2]: dp=1 share=2 | [0,1]: dp=2"
    s, ranks = working_strategy(parse_strategy("[0,1]: dp=2"), 2)
    assert ranks == (0, 1) and str(s) == "[0,1]: dp=2"  # every rank: as it is


def test_a_rank_the_run_lacks_is_one_line_error():
    with pytest.raises(StrategyError, match=r"uses device 3 but the run has -n 3 \(ranks 0-2"):
        working_strategy(parse_strategy("[0,3]: dp=2"), 3)


def test_rank_subset_numbers_groups_and_peers_among_the_working_ranks():
    def body(world):
        if world.rank == 1:  # idle: takes part in nothing
            with pytest.raises(CommError):
                RankSubset(world, (0, 2))
            return None
        comm = RankSubset(world, (0, 2))
        total = comm.all_reduce(np.array([float(world.rank + 1)]), (0, 1))
        got = np.zeros(1)
        comm.sendrecv(np.array([float(world.rank)]), 1 - comm.rank, got, 1 - comm.rank)
        comm.barrier()
        return comm.rank, comm.size, float(total[0]), float(got[0])

    assert run_spmd(3, body) == [(0, 2, 4.0, 2.0), None, (1, 2, 4.0, 0.0)]


def _train_both(tmp_path, text: str, n: int, steps: int = 3):
    """Return each rank's RunResult of `text` on `n` in-process ranks (its idle ones idle)."""
    script = load_script(MLP, {})
    compiled, ranks = compile_working(script, text, n)
    bundle = str(tmp_path / "bundle")
    write_bundle(compiled, bundle)
    mark_working_ranks(bundle, ranks, n)
    return run_spmd(n, lambda comm: train(bundle, comm, steps, quiet=True, log=str(tmp_path / "log.jsonl")))


@pytest.mark.parametrize("text", ["[0]: dp=1", "[1]: dp=1"])
def test_an_idle_rank_runs_nothing_and_the_working_one_trains_as_alone(tmp_path, text):
    results = _train_both(tmp_path, text, 2)
    idle, working = (results[1], results[0]) if text.startswith("[0]") else (results[0], results[1])
    assert idle.idle and not idle.losses and idle.params is None
    alone = tmp_path / "alone"
    alone.mkdir()
    write_bundle(compile_script(load_script(MLP, {}), "[0]: dp=1", 1), str(alone / "b"))
    (ref,) = run_spmd(1, lambda comm: train(str(alone / "b"), comm, 3, quiet=True))
    assert working.losses == ref.losses  # the same program on one rank: the same bits
    assert working.params is not None and set(working.params) == set(ref.params)
    for name, value in ref.params.items():
        np.testing.assert_array_equal(working.params[name], value)
    logged = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logged] == ref.losses and all(r["ranks"] == 1 for r in logged)


def test_the_manifest_says_which_ranks_work(tmp_path):
    _train_both(tmp_path, "[1]: dp=1", 2, steps=1)
    m = read_manifest(str(tmp_path / "bundle"))
    assert m.ranks == [1] and m.world_size == 2 and m.num_devices == 1 and m.strategy == "[0]: dp=1"


def test_hspmd_run_with_an_idle_rank_logs_and_checkpoints_from_the_working_rank(tmp_path):
    log, ck, ckdir = tmp_path / "idle.jsonl", tmp_path / "final.npz", tmp_path / "ck"
    r = run_cli("hspmd", "run", "-n", "2", MLP, "--strategy", "[1]: dp=1", "--steps", "2", "--log", str(log),
                "--checkpoint", str(ck), "--checkpoint-dir", str(ckdir), timeout=180)
    assert r.returncode == 0, r.stderr
    assert "rank 0 idle: the strategy runs on rank 1" in r.stdout
    assert sum(1 for line in r.stdout.splitlines() if line.startswith("step ")) == 2  # said once, not per rank
    ref_log = tmp_path / "alone.jsonl"
    # alone on the BLAS threads the working rank had (a core's share of -n 2): a BLAS may give
    # other bits on another thread count (OpenBLAS on an AMD EPYC does)
    share = str(max(1, usable_cores() // 2))
    r1 = run_cli("hspmd", "run", "-n", "1", MLP, "--steps", "2", "--log", str(ref_log),
                 "--checkpoint", str(tmp_path / "alone.npz"), timeout=180,
                 env={name: share for name in THREAD_VARIABLES})
    assert r1.returncode == 0, r1.stderr
    assert [json.loads(x)["loss"] for x in log.read_text().splitlines()] == \
        [json.loads(x)["loss"] for x in ref_log.read_text().splitlines()]
    (final, step), (ref, _) = load_checkpoint(str(ck)), load_checkpoint(str(tmp_path / "alone.npz"))
    assert step == 2 and set(final) == set(ref) and all(np.array_equal(final[k], ref[k]) for k in ref)
    assert [d for d in os.listdir(ckdir) if d.startswith("step-")] == ["step-2"]  # the working rank's shards, resumable under any strategy
    resumed = run_cli("hspmd", "run", "-n", "2", MLP, "--steps", "3", "--resume", str(ckdir), timeout=180)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr


def test_hspmd_run_refuses_a_rank_the_run_lacks_in_one_line():
    r = run_cli("hspmd", "run", "-n", "2", MLP, "--strategy", "[0,2]: dp=2", "--steps", "1", timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and "uses device 2 but the run has -n 2" in lines[0], r.stderr
