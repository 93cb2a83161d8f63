"""Parameter servers end to end over MPI: `hspmd run -n N --servers K` against all-reduce data parallelism.

The runs two tests compare with are made once per module (the MLP's all-reduce losses, its
parameter-server runs under BSP). The CTR sweep is sampled per run (`HSPMD_TEST_SEED`, printed in
pytest's header; the test ids name the cases): one case of comm=ps and one of comm=hybrid;
successive runs cover every case.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from conftest import EXAMPLES, run_cli, sampled_kinds

MLP = os.path.join(EXAMPLES, "mlp.py")
CTR = os.path.join(EXAMPLES, "ctr.py")


def _run(tmp_path, script, n, steps, strategy=None, servers=None, extra=()):
    log = tmp_path / f"log-{len(list(tmp_path.iterdir()))}.jsonl"
    args = ["hspmd", "run", "-n", str(n), script, "--steps", str(steps), "--log", str(log), *extra]
    if strategy:
        args += ["--strategy", strategy]
    if servers:
        args += ["--servers", str(servers)]
    run_cli(*args, check=True, timeout=600)
    return [json.loads(line) for line in log.read_text().splitlines()]


def _losses(rows):
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def mlp_all_reduce(tmp_path_factory):
    return _losses(_run(tmp_path_factory.mktemp("mlp-ar"), MLP, 2, 10))


#: 10 steps of the MLP on parameter servers under BSP, by server count (made once: two tests compare with them)
_mlp_bsp_rows: dict[int, list[dict]] = {}


def _mlp_bsp(tmp_path, servers: int) -> list[dict]:
    if servers not in _mlp_bsp_rows:
        _mlp_bsp_rows[servers] = _run(tmp_path, MLP, 2, 10, "[0,1]: dp=2 comm=ps consistency=bsp", servers)
    return _mlp_bsp_rows[servers]


@pytest.mark.mpi
@pytest.mark.parametrize("servers", [1, 2])
def test_mlp_ps_bsp_equals_all_reduce(tmp_path, mlp_all_reduce, servers):
    rows = _mlp_bsp(tmp_path, servers)
    np.testing.assert_allclose(_losses(rows), mlp_all_reduce, rtol=1e-4)
    assert all(r["staleness"] == 0 for r in rows if "loss" in r)


@pytest.fixture(scope="module")
def ctr_all_reduce(tmp_path_factory):
    return _losses(_run(tmp_path_factory.mktemp("ar"), CTR, 2, 10))


@pytest.mark.mpi
@pytest.mark.parametrize("keys,servers", sampled_kinds([("comm=ps", 1), ("comm=hybrid", 1), ("comm=ps", 2),
                                                       ("comm=hybrid cache=1000", 2)],  # bsp: a cache bound of 0
                                                      lambda case: case[0].split()[0], "ps-ctr"))
def test_ctr_bsp_equals_all_reduce(tmp_path, ctr_all_reduce, keys, servers):
    """A run tests one case of comm=ps and one of comm=hybrid, sampled by its seed."""
    rows = _run(tmp_path, CTR, 2, 10, f"[0,1]: dp=2 {keys} consistency=bsp", servers)
    np.testing.assert_allclose(_losses(rows), ctr_all_reduce, rtol=1e-4)


@pytest.mark.mpi
def test_ssp_bounds_staleness_with_a_slow_worker_and_asp_ssp_converge_like_bsp(tmp_path):
    steps = 60
    runs = {}
    for c in ("bsp", "ssp:2", "asp"):
        runs[c] = _run(tmp_path, CTR, 2, steps, f"[0,1]: dp=2 comm=ps consistency={c}", 1,
                       ("--slow-worker", "1:0.02"))
    ssp = [r["staleness"] for r in runs["ssp:2"] if "loss" in r]
    assert max(ssp) <= 2 and max(ssp) >= 1  # the bound holds and the slow worker did fall behind
    assert all(r["staleness"] == 0 for r in runs["bsp"] if "loss" in r)
    auc = {c: next(r["auc"] for r in rows if "auc" in r) for c, rows in runs.items()}
    late = {c: float(np.mean(_losses(rows)[-20:])) for c, rows in runs.items()}
    assert auc["bsp"] > 0.7  # there is something learnt
    for c in ("ssp:2", "asp"):
        assert abs(auc[c] - auc["bsp"]) < 0.05, auc
        assert abs(late[c] - late["bsp"]) < 0.05, late


@pytest.mark.mpi
def test_het_cache_moves_fewer_bytes_and_still_learns(tmp_path):
    plain = _run(tmp_path, CTR, 2, 30, "[0,1]: dp=2 comm=hybrid consistency=ssp:2", 1)
    cached = _run(tmp_path, CTR, 2, 30, "[0,1]: dp=2 comm=hybrid consistency=ssp:2 cache=200000:8", 1)
    moved = lambda rows: sum(r["bytes"] for r in rows if "bytes" in r)  # noqa: E731
    assert moved(cached) < 0.8 * moved(plain)
    assert [r for r in cached if "loss" in r][-1]["cache_hit_rate"] > 0.3
    auc = lambda rows: next(r["auc"] for r in rows if "auc" in r)  # noqa: E731
    assert abs(auc(cached) - auc(plain)) < 0.05


@pytest.mark.parametrize("args,words", [
    (["--servers", "1"], "needs a strategy with comm=ps or comm=hybrid"),
    (["--strategy", "[0,1]: dp=2 comm=ps"], "give their number with --servers K"),
    (["--strategy", "[0,1]: dp=2 comm=ps consistency=ssp"], "ssp takes its staleness bound"),
    (["--strategy", "[0-2]: dp=3 comm=ps", "--servers", "1"], "but the run has -n 2"),
    (["--strategy", "[0,1]: dp=2 comm=ps", "--strategy", "[0,1]: dp=2", "--servers", "1"], "takes one --strategy"),
    (["--strategy", "[0,1]: dp=2 comm=ps", "--servers", "1", "--resume", "no-such-dir"], "no such checkpoint directory"),
])
def test_parameter_server_mistakes_are_one_message(args, words):
    proc = run_cli("hspmd", "run", "-n", "2", MLP, "--steps", "1", *args)
    assert proc.returncode != 0
    assert words in proc.stderr and "Traceback" not in proc.stderr


def _run_with_fault(tmp_path, script, fault, strategy, steps, extra=(), servers=1):
    log = tmp_path / "fault.jsonl"
    proc = run_cli("hspmd", "run", "-n", "2", "--servers", str(servers), script, "--steps", str(steps), "--log", str(log),
                   "--strategy", strategy, *extra, env={"HSPMD_FAULT": fault}, timeout=300)
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, rows


@pytest.mark.mpi
@pytest.mark.parametrize("consistency", ["asp", "ssp:2"])
def test_a_worker_lost_under_asp_or_ssp_leaves_the_others_finishing(tmp_path, consistency):
    proc, rows = _run_with_fault(tmp_path, MLP, "1:4", f"[0,1]: dp=2 comm=ps consistency={consistency}", 12,
                                 ("--silent-after", "2"))
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "was lost" in ln]
    # killed at the start of step 4, its push of step 3 may still have been in flight (overlap)
    at = re.search(r"worker 1 \(rank 1\) was lost at step (\d+)", lines[0]) if len(lines) == 1 else None
    assert at and int(at.group(1)) in (3, 4), proc.stderr
    assert "Traceback" not in proc.stderr
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 13))  # worker 0 logged every step
    assert rows[-1]["lost_workers"] == {"1": int(at.group(1))}
    if consistency == "ssp:2":
        assert max(r["staleness"] for r in rows if "loss" in r) <= 2


@pytest.mark.mpi
@pytest.mark.parametrize("script,keys", [(MLP, "comm=ps consistency=bsp"), (CTR, "comm=hybrid consistency=ssp:2")])
def test_a_worker_lost_under_bsp_or_hybrid_is_one_clear_error(tmp_path, script, keys):
    proc, rows = _run_with_fault(tmp_path, script, "1:3", f"[0,1]: dp=2 {keys}", 10)
    assert proc.returncode == 1
    assert "hspmd run: error: worker 1 (rank 1) was lost (it died: SIGKILL)" in proc.stderr, proc.stderr
    assert "cannot go on" in proc.stderr and "Traceback" not in proc.stderr
    assert max((r["step"] for r in rows if "loss" in r), default=0) < 3


@pytest.mark.mpi
def test_a_server_lost_is_one_clear_error(tmp_path):
    proc, _ = _run_with_fault(tmp_path, MLP, "2:3", "[0,1]: dp=2 comm=ps consistency=ssp:2", 10)
    assert proc.returncode == 1
    assert proc.stderr.count("server 0 (rank 2) died (SIGKILL)") == 1, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.mpi
def test_a_run_whose_server_died_resumes_from_its_checkpoint_with_the_losses_of_an_unbroken_run(tmp_path):
    bsp = "[0,1]: dp=2 comm=ps consistency=bsp"
    unbroken = _losses(_mlp_bsp(tmp_path, 2))  # the run test_mlp_ps_bsp_equals_all_reduce[2] compares
    ck = tmp_path / "ck"
    proc, _ = _run_with_fault(tmp_path, MLP, "3:8", bsp, 10,
                              ("--checkpoint-dir", str(ck), "--checkpoint-every", "5"), servers=2)  # server 1 dies at step 8
    assert proc.returncode == 1 and "server 1 (rank 3) died" in proc.stderr, proc.stderr
    assert sorted(os.listdir(ck)) == ["step-5"]
    # two servers' checkpoint, resumed on one server, and as all-reduce data parallelism
    resumed = _run(tmp_path, MLP, 2, 10, bsp, 1, ("--resume", str(ck)))
    assert [r["step"] for r in resumed] == list(range(6, 11))
    np.testing.assert_allclose(_losses(resumed), unbroken[5:], rtol=1e-6)
    as_all_reduce = _run(tmp_path, MLP, 2, 10, None, None, ("--resume", str(ck / "step-5")))
    np.testing.assert_allclose(_losses(as_all_reduce), unbroken[5:], rtol=1e-4)


@pytest.mark.mpi
def test_an_all_reduce_checkpoint_resumes_under_hybrid_and_a_hybrid_one_under_hybrid(tmp_path, ctr_all_reduce):
    ck, hybrid = tmp_path / "ck", "[0,1]: dp=2 comm=hybrid consistency=bsp"
    _run(tmp_path, CTR, 2, 4, None, None, ("--checkpoint-dir", str(ck)))
    rows = _run(tmp_path, CTR, 2, 7, hybrid, 1, ("--resume", str(ck), "--checkpoint-dir", str(tmp_path / "ck2"),
                                                 "--checkpoint-every", "2"))
    np.testing.assert_allclose(_losses(rows), ctr_all_reduce[4:7], rtol=1e-4)
    assert sorted(os.listdir(tmp_path / "ck2")) == ["step-6", "step-7"]
    again = _run(tmp_path, CTR, 2, 10, hybrid, 2, ("--resume", str(tmp_path / "ck2" / "step-6")))
    np.testing.assert_allclose(_losses(again), ctr_all_reduce[6:10], rtol=1e-4)
    np.testing.assert_array_equal(_losses(again)[:1], _losses(rows)[2:3])  # step 7, as the run that wrote step-6
