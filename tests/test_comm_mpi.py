"""The MPI communicator under mpiexec: NumPy references and bit-equality with in-process runs;
and the launcher."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hspmd.runtime.launcher import launch as launch_mod
from hspmd.runtime.comm import run_spmd
from hspmd.runtime.launcher.launch import LaunchError, LaunchTimeout, find_mpiexec, launch, mpiexec_command

SCRIPT = Path(__file__).parent / "mpi_scripts" / "comm_check.py"
TIMEOUT = 60


def _load_script():
    spec = importlib.util.spec_from_file_location("hspmd_comm_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cc = _load_script()


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3])
def test_mpi_collectives_match_numpy_and_inprocess(n, tmp_path):
    cmd = mpiexec_command(n, [str(SCRIPT), str(tmp_path)])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    inproc = run_spmd(n, cc.exercise, timeout=TIMEOUT)
    for r in range(n):
        with np.load(tmp_path / f"rank{r}.npz") as f:
            mpi = {k: f[k] for k in f.files}
        exp = cc.expected(n, r)
        assert set(mpi) == set(exp) == set(inproc[r])
        bad_ref = [k for k in exp if not _same_bits(mpi[k], exp[k])]
        bad_inproc = [k for k in exp if not _same_bits(mpi[k], inproc[r][k])]
        assert not bad_ref, f"rank {r}: MPI differs from NumPy in {bad_ref}"
        assert not bad_inproc, f"rank {r}: MPI differs from in-process in {bad_inproc}"


def test_inputs_make_summation_order_visible():
    """Another order of the sum (as MPI's reductions may use) would change the bits checked."""
    xs = [cc.make_input("0ar_f32", r, (5, 7), "float32") for r in range(3)]
    left = (xs[0] + xs[1]) + xs[2]
    other = xs[0] + (xs[1] + xs[2])
    assert left.tobytes() != other.tobytes()


def test_importing_comm_does_not_import_mpi4py():
    code = (
        "import sys, hspmd.runtime.comm, hspmd.runtime.comm.mpi, hspmd.runtime.launcher.launch; "
        "assert 'mpi4py' not in sys.modules, 'mpi4py imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=TIMEOUT)


# -- launcher --------------------------------------------------------------------------------


def test_find_mpiexec_and_command():
    exe = find_mpiexec()
    assert os.access(exe, os.X_OK)
    cmd = mpiexec_command(3, ["-m", "foo", 1])
    assert cmd == [exe, "-n", "3", sys.executable, "-m", "foo", "1"]
    with pytest.raises(LaunchError):
        mpiexec_command(0, ["x.py"])
    with pytest.raises(TypeError):
        mpiexec_command(2, "x.py")


def test_find_mpiexec_override(monkeypatch, tmp_path):
    monkeypatch.setenv("HSPMD_MPIEXEC", str(tmp_path / "nope"))
    with pytest.raises(LaunchError, match="HSPMD_MPIEXEC"):
        find_mpiexec()
    fake = tmp_path / "my-mpiexec"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("HSPMD_MPIEXEC", str(fake))
    assert find_mpiexec() == str(fake)


def test_find_mpiexec_none(monkeypatch, tmp_path):
    monkeypatch.delenv("HSPMD_MPIEXEC", raising=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(launch_mod, "_wheel_mpiexec", lambda: None)
    monkeypatch.setattr(launch_mod.sysconfig, "get_path", lambda name: str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match="no mpiexec found") as info:
        find_mpiexec()
    assert "\n" not in str(info.value)


@pytest.mark.mpi
def test_launch_returns_exit_code():
    ok = "from mpi4py import MPI; assert MPI.COMM_WORLD.size == 2"
    assert launch(2, ["-c", ok], timeout=TIMEOUT) == 0
    fail = "import sys; from mpi4py import MPI; sys.exit(3 if MPI.COMM_WORLD.rank == 1 else 0)"
    assert launch(2, ["-c", fail], timeout=TIMEOUT) != 0


def test_ranks_share_the_cores_for_their_math_libraries(monkeypatch):
    monkeypatch.setattr(launch_mod, "usable_cores", lambda: 8)
    env = launch_mod.rank_environment(2, {"PATH": "/bin", "OPENBLAS_NUM_THREADS": "3"})
    assert env["OMP_NUM_THREADS"] == "4" and env["MKL_NUM_THREADS"] == "4"
    assert env["OPENBLAS_NUM_THREADS"] == "3" and env["PATH"] == "/bin"  # what the caller set stays
    assert launch_mod.rank_environment(16, {})["OMP_NUM_THREADS"] == "1"  # more ranks than cores: one each


def test_ranks_that_share_cores_wait_yielding_them(monkeypatch):
    monkeypatch.setattr(launch_mod, "usable_cores", lambda: 2)
    names = launch_mod.YIELDING_WAITS
    assert not names.keys() & launch_mod.rank_environment(2, {}).keys()  # a core each: MPICH's own waits
    assert not names.keys() & launch_mod.rank_environment(2, {}, cpu_bind=[0, 1]).keys()
    for shared in (launch_mod.rank_environment(3, {}), launch_mod.rank_environment(2, {}, cpu_bind=[1, 1]),
                   launch_mod.rank_environment(3, {}, cpu_bind=[0, 0, 1])):
        assert all(shared[k] == v for k, v in names.items())
    assert not names.keys() & launch_mod.rank_environment(3, {}, one_host=False).keys()  # other machines: unknown
    mine = {"MPIR_CVAR_POLLS_BEFORE_YIELD": "1000"}
    assert launch_mod.rank_environment(3, mine)["MPIR_CVAR_POLLS_BEFORE_YIELD"] == "1000"  # what the caller set stays


@pytest.mark.mpi
def test_launch_gives_each_rank_its_share_of_the_cores(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    code = ("import os, sys; from mpi4py import MPI; "
            f"sys.exit(0 if os.environ['OMP_NUM_THREADS'] == '{max(1, launch_mod.usable_cores() // 2)}' else 5)")
    assert launch(2, ["-c", code], timeout=TIMEOUT) == 0


@pytest.mark.mpi
def test_launch_timeout_kills_all_processes(tmp_path):
    code = (
        "import os, sys, time; from mpi4py import MPI; "
        f"open(os.path.join({str(tmp_path)!r}, f'pid{{MPI.COMM_WORLD.rank}}'), 'w')"
        ".write(str(os.getpid())); time.sleep(60)"
    )
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout, match="did not finish"):
        launch(2, ["-c", code], timeout=3)
    assert time.monotonic() - t0 < 20
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.mpi
def test_a_terminated_launcher_takes_its_ranks_with_it(tmp_path):
    """SIGTERM to the process that launched the job (`timeout`, a batch system): the ranks, in a
    session of their own, are killed too, not left running."""
    ranks = (
        "import os, sys, time; from mpi4py import MPI; "
        f"open(os.path.join({str(tmp_path)!r}, f'pid{{MPI.COMM_WORLD.rank}}'), 'w')"
        ".write(str(os.getpid())); time.sleep(60)"
    )
    launcher = f"from hspmd.runtime.launcher.launch import launch; launch(2, ['-c', {ranks!r}])"
    proc = subprocess.Popen([sys.executable, "-c", launcher])
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"pid{r}").exists() for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    proc.terminate()
    assert proc.wait(20) == 128 + 15
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
