"""Non-blocking all-reduce (`iall_reduce`) and all-gather (`iall_gather`): the bits of `all_reduce`
and `all_gather`, in-process and over MPI.

Run as a script under mpiexec (`python tests/test_comm_nonblocking.py OUTDIR`), each rank
writes its results to OUTDIR/rankR.npz; the tests compare them with in-process runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd.runtime.comm import run_spmd
from hspmd.runtime.comm.base import Request

# (name, shape, dtype): small buffers gather whole copies; large ones (> 256 KiB) go by pieces
CASES = [
    ("f32_small", (5, 7), "float32"),
    ("f64_small", (3,), "float64"),
    ("i32_small", (4, 4), "int32"),
    ("f16_small", (9,), "float16"),
    ("f32_big", (70001,), "float32"),
    ("f16_big", (200003,), "float16"),
    ("i64_big", (40000,), "int64"),
]


def make_input(name: str, rank: int, shape, dtype) -> np.ndarray:
    """Return rank `rank`'s buffer for case `name`: values whose sums depend on the order."""
    rng = np.random.default_rng([ord(c) for c in name] + [rank])
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, shape).astype(dtype)
    return (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 4, shape)).astype(dtype)


def exercise(comm) -> dict[str, np.ndarray]:
    """Return this rank's results: every case started at once (all in flight), then waited on
    in reverse order; the in-place form; and the blocking all_reduce of the same buffers."""
    g = tuple(range(comm.size))
    out: dict[str, np.ndarray] = {}
    requests = []
    for name, shape, dtype in CASES:
        requests.append((name, comm.iall_reduce(make_input(name, comm.rank, shape, dtype), g)))
    for name, req in reversed(requests):
        assert isinstance(req, Request)
        out[name] = req.wait()
        assert req.test()
    for name, shape, dtype in CASES:
        buf = make_input(name, comm.rank, shape, dtype)
        req = comm.iall_reduce(buf, g, out=buf)
        for _ in range(100):  # a sum whose last step is a collective says done only at wait
            if req.test():
                break
        assert req.wait() is buf
        out[name + "_inplace"] = buf
        out[name + "_blocking"] = comm.all_reduce(make_input(name, comm.rank, shape, dtype), g)
    out.update(exercise_gathers(comm))
    return out


#: (name, piece shape, dtype, axis) of the all-gathers: along the first axis and a later one
GATHERS = [("g_rows", (3, 5), "float32", 0), ("g_cols", (4, 3, 2), "float64", 1), ("g_vec", (7,), "int32", 0),
           ("g_last", (2, 6), "float16", 1)]


def exercise_gathers(comm) -> dict[str, np.ndarray]:
    """Return this rank's all-gathers: all started at once with an all-reduce between them (the
    collectives in flight together, started in the same order everywhere), waited on in reverse;
    into `out`; and the blocking all_gather of the same pieces."""
    g = tuple(range(comm.size))
    out: dict[str, np.ndarray] = {}
    requests = []
    for k, (name, shape, dtype, axis) in enumerate(GATHERS):
        requests.append((name, comm.iall_gather(make_input(name, comm.rank, shape, dtype), g, axis)))
        if k == 1:
            requests.append(("g_sum", comm.iall_reduce(make_input("g_sum", comm.rank, (5,), "float32"), g)))
    for name, req in reversed(requests):
        out[name] = req.wait()
        assert req.test()
    for name, shape, dtype, axis in GATHERS:
        whole = list(shape)
        whole[axis] *= comm.size
        target = np.empty(whole, dtype)
        req = comm.iall_gather(make_input(name, comm.rank, shape, dtype), g, axis, out=target)
        while not req.test():
            pass
        assert req.wait() is target
        out[name + "_out"] = target
        out[name + "_blocking"] = comm.all_gather(make_input(name, comm.rank, shape, dtype), g, axis)
    return out


def left_fold(name: str, shape, dtype, n: int) -> np.ndarray:
    xs = [make_input(name, r, shape, dtype) for r in range(n)]
    acc = xs[0].copy()
    for x in xs[1:]:
        acc = acc + x
    return acc


@pytest.mark.parametrize("n", [1, 2, 3])
def test_in_process_iall_reduce_is_the_left_fold(n):
    results = run_spmd(n, exercise, timeout=120)
    for r in range(n):
        for name, shape, dtype in CASES:
            ref = left_fold(name, shape, dtype, n)
            for suffix in ("", "_inplace", "_blocking"):
                got = results[r][name + suffix]
                assert got.dtype == ref.dtype and got.tobytes() == ref.tobytes(), (r, name + suffix)


@settings(max_examples=15, deadline=None)
@given(st.integers(2, 4), st.lists(st.integers(1, 300), min_size=1, max_size=4), st.integers(0, 2**31 - 1))
def test_in_process_requests_may_complete_in_any_order(n, sizes, seed):
    """Several requests in flight on one group, waited in a shuffled order, give the blocking bits."""
    order = np.random.default_rng(seed).permutation(len(sizes))

    def body(comm):
        g = tuple(range(comm.size))
        bufs = [np.random.default_rng([seed, comm.rank, i]).standard_normal(s).astype(np.float32)
                for i, s in enumerate(sizes)]
        reqs = [comm.iall_reduce(b, g) for b in bufs]
        got = [None] * len(reqs)
        for i in order:
            got[i] = reqs[i].wait()
        return got, [comm.all_reduce(b, g) for b in bufs]

    for got, blocking in run_spmd(n, body, timeout=60):
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got, blocking))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_in_process_iall_gather_is_the_concatenation(n):
    results = run_spmd(n, exercise_gathers, timeout=60)
    for r in range(n):
        for name, shape, dtype, axis in GATHERS:
            want = np.concatenate([make_input(name, k, shape, dtype) for k in range(n)], axis=axis)
            for key in (name, name + "_out", name + "_blocking"):
                assert results[r][key].dtype == want.dtype and results[r][key].tobytes() == want.tobytes(), key


def test_iall_gather_refuses_a_wrong_out():
    from hspmd.runtime.comm.base import CommError

    def bad(comm):
        with pytest.raises(CommError, match="iall_gather"):
            comm.iall_gather(np.zeros((2, 3), np.float32), (0, 1), 0, out=np.empty((2, 3), np.float32))
        return True

    assert run_spmd(2, bad, timeout=30) == [True, True]


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_mpi_iall_reduce_matches_in_process_bits(n, tmp_path):
    from hspmd.runtime.launcher.launch import mpiexec_command

    proc = subprocess.run(mpiexec_command(n, [__file__, str(tmp_path)]), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    inproc = run_spmd(n, exercise, timeout=120)
    for r in range(n):
        with np.load(tmp_path / f"rank{r}.npz") as f:
            mpi = {k: f[k] for k in f.files}
        assert set(mpi) == set(inproc[r])
        bad = [k for k in mpi if mpi[k].dtype != inproc[r][k].dtype or mpi[k].tobytes() != inproc[r][k].tobytes()]
        assert not bad, f"rank {r}: MPI differs from in-process in {bad}"


@pytest.mark.mpi
def test_mpi_buckets_polled_at_different_times_sum_each_its_own(tmp_path):
    """Four large sums in flight (gradient buckets), polled in an order and at times that differ
    between 3 members, then waited on: each equals the blocking all_reduce of its own buffers. (A
    member finishing one from a poll ran its closing all-gather before another member's of another
    bucket: MPI matched the two and the sums came out swapped between buckets, or the run hung.)"""
    from hspmd.runtime.launcher.launch import mpiexec_command

    script = Path(__file__).parent / "mpi_scripts" / "polled_buckets.py"
    proc = subprocess.run(mpiexec_command(3, [str(script)]), capture_output=True, text=True, timeout=120)
    # the members' lines may come through mpiexec interleaved ("ok\nokok\n\n"): count the words' letters
    assert proc.returncode == 0 and proc.stdout.count("ok") == 3 and "wrong" not in proc.stdout, proc.stdout + proc.stderr


def main(argv: list[str]) -> int:
    """The MPI side: write this rank's results to ARGV[0]/rankR.npz."""
    from hspmd.runtime.comm.mpi import MPICommunicator

    comm = MPICommunicator()
    results = exercise(comm)
    np.savez(f"{argv[0]}/rank{comm.rank}.npz", **results)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
