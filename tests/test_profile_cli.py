"""`hspmd profile` over MPI writes a profile that loads; bad options end in one message.

No timing is asserted: the machine may be shared, so only the profile's shape is checked.
"""

from __future__ import annotations

import os

import pytest

from conftest import run_cli
from hspmd.ir.device_profile import COLLECTIVES, DeviceProfile
from hspmd.runtime.profiler import COLLECTIVE_BYTES, ProfileRunError, groups_measured, measuring_rounds, parse_cpu_bind


@pytest.mark.mpi
def test_profile_two_ranks_writes_a_loadable_profile(tmp_path):
    out = tmp_path / "p.json"
    proc = run_cli("hspmd", "profile", "-n", "2", "-o", str(out), "--reps", "2", "--seconds-per-point", "0.05",
                   timeout=120, check=True)
    assert f"wrote {out}" in proc.stdout
    prof = DeviceProfile.load(str(out))
    assert prof.num_ranks == 2 and prof.source.startswith("measured")
    assert all(len(r.matmul) >= 3 and r.elementwise_bps > 0 for r in prof.ranks)
    assert {(0, 1), (1, 0)} <= set(prof.links)
    assert {f.kind for f in prof.collectives} == set(COLLECTIVES)
    assert all([b for b, _ in f.points] == list(COLLECTIVE_BYTES) for f in prof.collectives)
    assert prof.time("all_reduce", [0, 1], 1 << 20) > 0


@pytest.mark.mpi
def test_profile_with_cpu_bind_records_three_ranks(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    bind = ",".join(str(c) for c in (cores[0], cores[0], cores[-1]))
    out = tmp_path / "p.json"
    run_cli("hspmd", "profile", "-n", "3", "-o", str(out), "--cpu-bind", bind, "--reps", "2",
            "--seconds-per-point", "0.05", timeout=180, check=True)
    prof = DeviceProfile.load(str(out))
    assert prof.num_ranks == 3 and prof.meta["cpu_bind"] == bind
    assert {f.group for f in prof.collectives} == set(groups_measured(3))


def test_bad_cpu_bind_is_one_message(tmp_path):
    for bind, message in (("0,x", "one core number per rank"), ("0", "names 1 cores for 2 ranks"),
                          ("0,99999", "names core 99999")):
        proc = run_cli("hspmd", "profile", "-n", "2", "-o", str(tmp_path / "p.json"), "--cpu-bind", bind)
        assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr
    assert parse_cpu_bind("0,0,1", 3) == [0, 0, 1]
    with pytest.raises(ProfileRunError):
        parse_cpu_bind("-1,0", 2)
    assert groups_measured(1) == [] and groups_measured(2) == [(0, 1)]
    assert groups_measured(3) == [(0, 1, 2), (0, 1), (0, 2), (1, 2)]


@pytest.mark.parametrize("n", range(1, 9))
def test_measuring_rounds_cover_every_group_once_with_disjoint_groups(n):
    rounds = measuring_rounds(n)
    assert sorted(g for r in rounds for g in r) == sorted(groups_measured(n))
    for r in rounds:
        members = [m for g in r for m in g]
        assert len(members) == len(set(members))  # a rank is in one group of a round at most
    if n >= 4:
        assert all(len(r) == n // 2 for r in rounds[1:])  # every rank (but a bye) busy in a pair


def test_the_profile_times_the_projects_own_fused_softmax():
    import numpy as np

    from hspmd.codegen.cpu_compile import find_compiler
    from hspmd.runtime.profiler import _fused_softmax

    if find_compiler() is None:
        pytest.skip("no C++ compiler: the profile times NumPy's softmax instead")
    x = np.random.default_rng(0).standard_normal((64, 256), dtype=np.float32)
    out = np.empty_like(x)
    kernel = _fused_softmax(x.shape)
    assert kernel is not None
    kernel(x, out)
    ref = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out, ref / ref.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)
