"""Elastic runs (`hspmd run --elastic`, docs/checkpoints.md): a rank dies, the run goes on from the
newest checkpoint on the ranks left, and ends with the parameters of a run switched by hand.

The watching machinery (`hspmd.runtime.launcher.watch`, the rank guard) is tested on a stand-in worker
(tests/mpi_scripts/watch_ranks.py); the elastic launcher on examples/gpt.py with two layers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from hspmd.cli.elastic import choose_strategy, describe_losses, last_logged_step
from hspmd.runtime.launcher.fault import FaultSpecError, parse_faults
from hspmd.runtime.launcher.watch import RankEnd, WatchedRun, start_watched, watch_started

from conftest import BIN, ROOT

GPT = ["examples/gpt.py", "--set", "model.layers=2", "--set", "data.batch_size=12"]
STAND_IN = str(Path(__file__).parent / "mpi_scripts" / "watch_ranks.py")
TIMEOUT = 240


def hspmd_run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `hspmd run ARGS` and return the finished process."""
    return subprocess.run([os.path.join(BIN, "hspmd"), "run", *args], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=ROOT, env={**_env_without_fault(), **(env or {})})


def _env_without_fault() -> dict:
    return {k: v for k, v in os.environ.items() if k != "HSPMD_FAULT"}


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc


def _steps(log: Path) -> list[int]:
    """Return the steps of the `--log` at `log` in the order logged (a step redone after a restart twice)."""
    return [r["step"] for r in map(json.loads, log.read_text().splitlines()) if "event" not in r]


def _events(log: Path) -> list[dict]:
    return [r for r in map(json.loads, log.read_text().splitlines()) if "event" in r]


def _said(proc: subprocess.CompletedProcess) -> list[str]:
    """Return the elastic launcher's lines on stderr."""
    return [line for line in proc.stderr.splitlines() if line.startswith("hspmd run: ") and "error" not in line]


# -- unit tests ---------------------------------------------------------------------------------

def test_fault_spec_parses_pairs_and_lists():
    assert parse_faults("1:7") == {(1, 7)}
    assert parse_faults(" 1:7, 0:20 ") == {(1, 7), (0, 20)}
    assert parse_faults("") == set()


@pytest.mark.parametrize("text", ["1", "1:x", "a:7", "1:7:2", "-1:3", "1:0", "1;7"])
def test_a_malformed_fault_spec_is_a_value_error_naming_the_variable(text):
    with pytest.raises(FaultSpecError, match="HSPMD_FAULT") as info:
        parse_faults(text)
    assert isinstance(info.value, ValueError)


def test_the_first_fallback_strategy_that_fits_is_chosen_else_data_parallel():
    fallbacks = ["[0-3]: dp=2 tp=2", "[0,1]: tp=2", "[0,1]: dp=2"]
    assert choose_strategy(fallbacks, 2) == "[0,1]: tp=2"
    assert choose_strategy(fallbacks, 4) == "[0-3]: dp=2 tp=2"
    assert choose_strategy(fallbacks, 3) == "[0-2]: dp=3"
    assert choose_strategy([], 1) == "[0]: dp=1"


def test_the_last_logged_step_skips_events_and_a_half_written_line(tmp_path):
    log = tmp_path / "l.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 8))
                   + json.dumps({"event": "restart", "resumed_from_step": 5}) + "\n" + '{"step": 8, "lo')
    assert last_logged_step(str(log)) == 7
    assert last_logged_step(str(tmp_path / "absent.jsonl")) is None and last_logged_step(None) is None


def test_losses_are_described_in_words():
    lost = (RankEnd(1, "h", 10, -signal.SIGKILL, False),)
    assert describe_losses(lost, 7) == "rank 1 died at step ~7 (SIGKILL)"
    two = lost + (RankEnd(2, "h", 11, -signal.SIGSEGV, False),)
    assert describe_losses(two, None) == "ranks 1, 2 died (SIGKILL, SIGSEGV)"


def test_a_signal_is_a_lost_device_and_an_exit_code_an_error():
    run = WatchedRun(143, (RankEnd(0, "h", 1, -signal.SIGTERM, True), RankEnd(1, "h", 2, -signal.SIGKILL, False),
                           RankEnd(2, "h", 3, 1, False)))
    assert [e.rank for e in run.lost] == [1]
    assert [e.rank for e in run.errors] == [2]
    assert run.ends[1].how() == "SIGKILL" and run.ends[2].how() == "exit code 1"


# -- the watcher, on a stand-in worker ------------------------------------------------------------

def _watch(tmp_path, mode: str, n: int = 3) -> tuple[WatchedRun, float]:
    seen = []
    start = time.monotonic()
    run = watch_started(start_watched(n, [STAND_IN, str(tmp_path), mode], str(tmp_path)), str(tmp_path),
                        before_stop=seen.append)
    assert all(e.returncode != 0 for ends in seen for e in ends)
    return run, time.monotonic() - start


def _gone(run: WatchedRun) -> bool:
    for e in run.ends:
        try:
            os.kill(e.pid, 0)
            return False
        except ProcessLookupError:
            pass
    return True


@pytest.mark.mpi
def test_watcher_sees_a_good_end(tmp_path):
    run, _ = _watch(tmp_path, "ok")
    assert run.returncode == 0 and [e.returncode for e in run.ends] == [0, 0, 0]
    assert not run.lost and not run.errors


@pytest.mark.mpi
def test_watcher_names_the_killed_rank_and_stops_the_others(tmp_path):
    run, seconds = _watch(tmp_path, "kill")
    assert [(e.rank, e.how()) for e in run.lost] == [(1, "SIGKILL")]
    assert all(e.stopped for e in run.ends if e.rank != 1) and _gone(run)
    assert seconds < 15


@pytest.mark.mpi
def test_an_abort_or_an_exit_code_is_no_lost_device(tmp_path):
    run, _ = _watch(tmp_path / "a", "abort")
    assert run.returncode != 0 and not run.lost
    run, _ = _watch(tmp_path / "e", "exit")
    assert not run.lost and {e.returncode for e in run.errors} == {3}


@pytest.mark.mpi
def test_watcher_kills_a_rank_that_ignores_sigterm(tmp_path):
    run, seconds = _watch(tmp_path, "stubborn")
    assert [e.rank for e in run.lost] == [0]
    assert [(e.rank, e.how(), e.stopped) for e in run.ends if e.rank == 1] == [(1, "SIGKILL", True)], run
    assert _gone(run) and seconds < 20


# -- elastic runs of the GPT example --------------------------------------------------------------

@pytest.fixture(scope="module")
def by_hand(tmp_path_factory):
    """A run switched from 3 ranks to 2 by hand at the checkpoint of step 5: its final parameters
    and the 2-rank part's checkpoint directory (step 12)."""
    d = tmp_path_factory.mktemp("by_hand")
    _ok(hspmd_run("-n", "3", *GPT, "--steps", "5", "--checkpoint-dir", str(d / "D"), "--checkpoint-every", "5"))
    _ok(hspmd_run("-n", "2", *GPT, "--steps", "12", "--resume", str(d / "D"), "--checkpoint", str(d / "final.npz"),
                  "--checkpoint-dir", str(d / "D2")))
    return d


def _assert_same_parameters(a: Path, b: Path) -> None:
    with np.load(a) as x, np.load(b) as y:
        assert sorted(x.files) == sorted(y.files)
        for name in x.files:
            assert x[name].dtype == y[name].dtype and np.array_equal(x[name], y[name]), name


@pytest.mark.mpi
def test_rank_killed_at_step_7_run_finishes_on_two_ranks_as_switched_by_hand(tmp_path, by_hand):
    log = tmp_path / "e.jsonl"
    proc = _ok(hspmd_run("-n", "3", *GPT, "--steps", "12", "--elastic", "--checkpoint-dir", str(tmp_path / "D"),
                         "--checkpoint-every", "5", "--log", str(log), "--checkpoint", str(tmp_path / "final.npz"),
                         env={"HSPMD_FAULT": "1:7"}))
    assert _said(proc) == [f"hspmd run: rank 1 died at step ~7 (SIGKILL); resuming from {tmp_path / 'D' / 'step-5'} "
                           f"on 2 ranks under '[0,1]: dp=2' (restart 1 of 3)"]
    # the log is appended, not rewritten: step 6 twice, the restart line between
    assert _steps(log) == [1, 2, 3, 4, 5, 6] + list(range(6, 13))
    assert [r["ranks"] for r in map(json.loads, log.read_text().splitlines()) if "ranks" in r] == [3] * 6 + [2] * 7
    (restart,) = _events(log)
    assert {k: v for k, v in restart.items() if k != "restart_s"} == {
        "event": "restart", "lost_ranks": [1], "resumed_from_step": 5, "steps_redone": 1, "source": "disk"}
    assert restart["restart_s"] > 0
    _assert_same_parameters(tmp_path / "final.npz", by_hand / "final.npz")


@pytest.mark.mpi
def test_rank_killed_from_outside_by_its_pid(tmp_path):
    log, d = tmp_path / "e.jsonl", tmp_path / "D"
    cmd = [os.path.join(BIN, "hspmd"), "run", "-n", "3", *GPT, "--steps", "60", "--elastic", "--checkpoint-dir",
           str(d), "--checkpoint-every", "5", "--log", str(log)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env_without_fault(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while (last_logged_step(str(log)) or 0) < 6:
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 6"
            time.sleep(0.02)
        host, pid = (d / ".ranks" / "rank-1.pid").read_text().split()
        assert host == socket.gethostname()
        os.kill(int(pid), signal.SIGKILL)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    said = [line for line in err.splitlines() if line.startswith("hspmd run: ")]
    assert len(said) == 1 and said[0].startswith("hspmd run: rank 1 died at step ~") and "(SIGKILL)" in said[0]
    assert "on 2 ranks under '[0,1]: dp=2' (restart 1 of 3)" in said[0]
    assert sorted(set(_steps(log))) == list(range(1, 61)) and len(_events(log)) == 1


@pytest.mark.mpi
def test_a_device_coming_back_resumes_on_more_ranks(tmp_path, by_hand):
    d = tmp_path / "D"
    shutil.copytree(by_hand / "D2", d)  # step 12, written by 2 ranks
    log = tmp_path / "l.jsonl"
    proc = _ok(hspmd_run("-n", "3", *GPT, "--steps", "14", "--elastic", "--checkpoint-dir", str(d), "--log", str(log),
                         "--fallback-strategy", "[0,1]: tp=2"))
    assert _said(proc) == [f"hspmd run: resuming from {d / 'step-12'} (the newest checkpoint in {d}) on 3 ranks "
                           f"under '[0-2]: dp=3'"]
    assert _steps(log) == [13, 14] and (d / "step-14").is_dir()
    assert [(e["event"], e["resumed_from_step"], e["source"]) for e in _events(log)] == [("resume", 12, "disk")]


@pytest.mark.mpi
def test_two_host_names_for_this_machine_through_mpiexec(tmp_path):
    other = socket.gethostname() if socket.gethostname() != "localhost" else "127.0.0.1"
    log = tmp_path / "l.jsonl"
    proc = _ok(hspmd_run("-n", "2", *GPT, "--steps", "6", "--elastic", "--checkpoint-dir", str(tmp_path / "D"),
                         "--checkpoint-every", "2", "--log", str(log), "--hosts", f"localhost,{other}",
                         env={"HSPMD_FAULT": "1:4"}))
    assert len(_said(proc)) == 1 and "on 1 rank under '[0]: dp=1'" in _said(proc)[0]
    assert _steps(log) == [1, 2, 3, 3, 4, 5, 6]  # resumed from step 2, step 3 redone


@pytest.mark.mpi
def test_no_restarts_left_is_one_clear_error(tmp_path):
    proc = hspmd_run("-n", "2", *GPT, "--steps", "5", "--elastic", "--checkpoint-dir", str(tmp_path / "D"),
                     "--checkpoint-every", "2", "--max-restarts", "0", env={"HSPMD_FAULT": "1:4"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hspmd: error:")]
    assert errors == [f"hspmd: error: rank 1 died (SIGKILL), and --max-restarts 0 allows no more restarts; the newest "
                      f"checkpoint is {tmp_path / 'D' / 'step-2'}, where the same command goes on from"]


@pytest.mark.mpi
def test_an_error_of_the_program_is_no_device_loss(tmp_path, by_hand):
    bad = tmp_path / "bad"
    shutil.copytree(by_hand / "D", bad)
    piece = sorted(bad.glob("step-5/*.safetensors"))[0]
    data = bytearray(piece.read_bytes())
    data[len(data) // 2] ^= 0xFF
    piece.write_bytes(data)
    proc = hspmd_run("-n", "2", *GPT, "--steps", "8", "--elastic", "--checkpoint-dir", str(tmp_path / "D"),
                     "--resume", str(bad))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert not _said(proc), proc.stderr  # no restart


def test_elastic_command_line_errors_come_before_any_rank_starts(tmp_path):
    proc = hspmd_run("-n", "2", *GPT, "--elastic", "--checkpoint-dir", str(tmp_path / "D"), env={"HSPMD_FAULT": "1-7"})
    assert proc.returncode == 1 and "HSPMD_FAULT='1-7'" in proc.stderr and "Traceback" not in proc.stderr
    proc = hspmd_run("-n", "2", str(tmp_path), "--elastic", "--checkpoint-dir", str(tmp_path / "D"))
    assert proc.returncode == 1 and "compiled bundle" in proc.stderr and "Traceback" not in proc.stderr
    proc = hspmd_run("-n", "2", *GPT, "--elastic", "--checkpoint-dir", str(tmp_path / "D"),
                     "--fallback-strategy", "[0,1]: dp=")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and proc.stderr.startswith("hspmd: error:")
