"""`hspmd run` inside a job an outside launcher started (srun, mpirun, mpiexec): one job, not N.

The environment of each launcher is read by `outside_job` (checked on made-up environments);
one real `mpiexec -n 2 hspmd run -n 2` trains once, as a job of 2 ranks; what cannot run inside
such a job (another -n, --elastic) is refused in one line by rank 0.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from conftest import EXAMPLES, run_cli
from hspmd.runtime.launcher.launch import find_mpiexec, is_hydra
from hspmd.runtime.launcher.outside import OutsideJob, outside_job

MLP = os.path.join(EXAMPLES, "mlp.py")


@pytest.mark.parametrize("env, want", [
    ({}, None),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, OutsideJob("Open MPI", 3, 8, 1, 2)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
     OutsideJob("MPICH Hydra / PMI", 1, 2, 1, 2)),
    ({"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "6", "SLURM_LOCALID": "2"}, OutsideJob("Slurm", 5, 6, 2, None)),
    # an sbatch script itself (no srun step): hspmd launches its ranks itself
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}, None),
    ({"PMIX_RANK": "2", "SLURM_STEP_NUM_TASKS": "4"}, OutsideJob("PMIx", 2, 4, 2, None)),
    ({"PMI_RANK": "2", "PMI_SIZE": "2"}, None),  # a rank outside its job's size is no job
])
def test_outside_job_is_read_from_each_launchers_environment(env, want):
    assert outside_job(env) == want


def _one_line(proc: subprocess.CompletedProcess, text: str) -> None:
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0, proc.stderr
    assert len(lines) == 1 and text in lines[0] and "Traceback" not in proc.stderr, proc.stderr


def test_elastic_inside_an_outside_job_is_refused_in_one_line():
    # the environment of rank 0 of a 1-rank job that Open MPI started: refused before MPI starts
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    proc = run_cli("hspmd", "run", MLP, "--steps", "1", "--elastic", "--checkpoint-dir", "ck", env=env, timeout=120)
    _one_line(proc, "--elastic restarts ranks itself with MPICH's Hydra mpiexec; inside a job that Open MPI started")


def test_elastic_with_an_mpiexec_that_is_not_hydra_is_refused_in_one_line(tmp_path):
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'mpirun (Open MPI) 5.0.5'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    assert not is_hydra(str(fake)) and is_hydra(find_mpiexec())
    proc = run_cli("hspmd", "run", "-n", "2", MLP, "--steps", "1", "--elastic", "--checkpoint-dir",
                   str(tmp_path / "ck"), env={"HSPMD_MPIEXEC": str(fake)}, timeout=120)
    _one_line(proc, "is not Hydra")


def _under_mpiexec(*args: str) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "hspmd")
    hspmd = [exe] if os.path.isfile(exe) else [sys.executable, "-m", "hspmd.cli.main"]
    return subprocess.run([find_mpiexec(), "-n", "2", *hspmd, "run", *args], capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL, cwd=os.path.dirname(EXAMPLES))


def test_hspmd_run_under_mpiexec_is_one_job_of_its_ranks(tmp_path):
    log = tmp_path / "log.jsonl"
    proc = _under_mpiexec("-n", "2", MLP, "--steps", "3", "--log", str(log))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("step 3/3") == 1, proc.stdout  # one job: its rank 0 reports
    rows = [line for line in log.read_text().splitlines() if line.startswith("{")]
    assert len(rows) == 3 and all('"ranks": 2' in r for r in rows)  # each step once, by a job of 2


def test_another_n_inside_an_outside_job_is_one_line_from_rank_0():
    proc = _under_mpiexec("-n", "3", MLP, "--steps", "1")
    _one_line(proc, "-n 3, but this runs in a job of 2 ranks that MPICH Hydra / PMI started: give -n 2")
