"""Each rank's device, without a GPU: `--device` with one entry or one per rank, the strategy
groups' `device=` key, their conflicts as one-line errors, the bundle holding GPU programs for
the groups of GPU ranks only, and the worker taking its rank's entry. "cuda" runs here under the
test switch `HSPMD_EMULATE_GPU=1` (`hspmd/runtime/cuda/select.py`)."""

from __future__ import annotations

import json
import os

import pytest

from hspmd.runtime.cuda.device import DeviceError
from hspmd.runtime.cuda.select import EMULATION, device_entries, devices_text, rank_device, rank_devices
from hspmd.runtime.worker import worker_device

from conftest import EXAMPLES, run_cli

MIXED = "[0]: dp=1 device=cuda share=3 | [1]: dp=1 device=cpu share=1"
MLP = os.path.join(EXAMPLES, "mlp.py")


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setenv(EMULATION, "1")


@pytest.fixture
def no_gpu(monkeypatch):
    from hspmd.codegen.cupy_backend import gpu_status

    if gpu_status()[0]:
        pytest.skip("a GPU is here: 'cuda' is usable without the switch")  # the switch-less refusal needs none
    monkeypatch.delenv(EMULATION, raising=False)


def test_device_entries_one_for_all_or_one_per_rank():
    assert device_entries("cuda", 3) == ["cuda"] * 3
    assert device_entries("cuda,cuda,cpu", 3) == ["cuda", "cuda", "cpu"]
    assert device_entries("auto, cpu", 2) == ["auto", "cpu"]
    with pytest.raises(DeviceError, match=r"--device cuda,cpu names 2 ranks but the run has -n 3"):
        device_entries("cuda,cpu", 3)
    with pytest.raises(DeviceError, match="unknown device 'gpu'"):
        device_entries("cuda,gpu", 2)


def test_group_keys_decide_auto_and_conflicts_are_refused(emulated):
    assert rank_devices(["auto", "auto"], ["cuda", "cpu"]) == ["cuda", "cpu"]
    assert rank_devices(["cuda", "auto"], [None, "cpu"]) == ["cuda", "cpu"]
    assert rank_devices(["auto", "auto", "auto"], [None] * 3) == ["cpu"] * 3  # several GPU ranks by name only
    assert rank_devices(["cuda"] * 3, [None] * 3) == ["cuda"] * 3
    with pytest.raises(DeviceError, match="puts rank 1 on 'cuda' but its strategy group says device=cpu"):
        rank_devices(["cuda", "cuda"], ["cuda", "cpu"])


def test_a_cuda_rank_without_a_gpu_is_refused(no_gpu):
    with pytest.raises(DeviceError, match="--device cuda: no usable GPU here"):
        rank_devices(["auto", "auto"], ["cuda", "cpu"])
    assert rank_devices(["auto", "cpu"], [None, None]) == ["cpu", "cpu"]


def test_the_workers_device_text_and_each_ranks_entry():
    assert devices_text(["cuda", "cuda"]) == "cuda" and devices_text(["cuda", "cpu"]) == "cuda,cpu"
    assert [rank_device("cuda,cpu,cpu", r) for r in range(3)] == ["cuda", "cpu", "cpu"]
    assert rank_device("cpu", 7) == "cpu"
    assert [worker_device("cuda,cpu", r) for r in range(2)] == ["cuda", "cpu"]
    with pytest.raises(SystemExit, match="no entry for rank 2"):
        worker_device("cuda,cpu", 2)
    with pytest.raises(SystemExit, match="gets 'auto', not cpu or cuda"):
        worker_device("auto", 0)


def one_line_error(proc, text: str) -> None:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and text in lines[0] and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("device, text", [
    ("cuda,gpu", "unknown device 'gpu' (each entry is one of cpu, cuda, auto)"),
    ("cuda,cpu,cpu", "--device cuda,cpu,cpu names 3 ranks but the run has -n 2"),
])
def test_hspmd_run_refuses_a_bad_device_list_in_one_line(device, text):
    one_line_error(run_cli("hspmd", "run", "-n", "2", MLP, "--device", device, "--steps", "1", timeout=60), text)


def test_hspmd_run_refuses_a_device_against_the_strategy_in_one_line():
    proc = run_cli("hspmd", "run", "-n", "2", MLP, "--strategy", MIXED, "--device", "cpu,cpu", "--steps", "1",
                   env={EMULATION: "1"}, timeout=60)
    one_line_error(proc, "--device puts rank 0 on 'cpu' but its strategy group says device=cuda")


def test_hspmd_run_refuses_gpu_and_cpu_ranks_with_elastic(tmp_path):
    """`--elastic` over GPU ranks alone runs (tests/test_gpu_ranks.py); over two kinds a restart
    would not know which kind each rank left is."""
    proc = run_cli("hspmd", "run", "-n", "2", MLP, "--device", "cuda,cpu", "--elastic", "--checkpoint-dir",
                   str(tmp_path / "c"), "--steps", "1", env={EMULATION: "1"}, timeout=60)
    one_line_error(proc, "--elastic needs one device kind for every rank (got --device cuda,cpu)")


def test_compile_writes_gpu_programs_for_the_cuda_groups_only(tmp_path):
    d = tmp_path / "b"
    run_cli("hspmd", "compile", MLP, "--strategy", MIXED, "--dump-dir", str(d), check=True, timeout=120)
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["strategy"] == "[0]: dp=1 device=cuda share=3 | [1]: dp=1 device=cpu"
    assert [g.get("device") for g in manifest["groups"]] == ["device_group0.mlir", None]
    assert (d / "device_group0.mlir").is_file() and not (d / "device_group1.mlir").exists()
    assert "@train_step" in (d / "device_group0.mlir").read_text()


def test_hspmd_run_device_list_puts_gpu_programs_in_the_bundle_for_those_ranks(tmp_path):
    """The bundle a run makes holds the GPU program of the group of rank 0 (cuda) only; whether
    the run's collectives run on a GPU rank yet is the GPU plan's part (issue 28)."""
    d = tmp_path / "b"
    run_cli("hspmd", "run", "-n", "2", MLP, "--strategy", "[0]: dp=1 | [1]: dp=1", "--device", "cuda,cpu",
            "--steps", "1", "--dump-dir", str(d), env={EMULATION: "1"}, timeout=180)
    manifest = json.loads((d / "manifest.json").read_text())
    assert [g.get("device") for g in manifest["groups"]] == ["device_group0.mlir", None]


def test_a_gpu_and_a_cpu_rank_in_one_job_run_or_stop_in_one_line(tmp_path):
    """`[0]: cuda | [1]: cpu` on the emulated GPU: the 2-rank CPU losses where the GPU plan runs
    the cross-group gradient sum; until it does, one line naming what the GPU program lacks."""
    import math

    ref, log = tmp_path / "cpu.jsonl", tmp_path / "mixed.jsonl"
    run_cli("hspmd", "run", "-n", "2", MLP, "--strategy", "[0]: dp=1 share=3 | [1]: dp=1 share=1", "--device", "cpu",
            "--steps", "2", "--log", str(ref), check=True, timeout=180)
    proc = run_cli("hspmd", "run", "-n", "2", MLP, "--strategy", MIXED, "--steps", "2", "--log", str(log),
                   env={EMULATION: "1"}, timeout=180)
    assert "Traceback" not in proc.stderr, proc.stderr
    if proc.returncode == 0:
        want = [json.loads(line)["loss"] for line in ref.read_text().splitlines()]
        got = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
        assert len(got) == len(want) and all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(got, want))
    else:
        errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
        assert len(errors) == 1 and "no GPU kernel" in errors[0], proc.stderr
