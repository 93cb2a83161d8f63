"""hspmd's gradient all-reduce against mpi4py's raw Allreduce, on 2 MPI ranks.

    python benchmarks/allreduce_vs_mpi.py [--mib 4] [--reps 200]

Started plainly, it starts itself on 2 ranks under the mpiexec of the mpich wheel
(`hspmd.runtime.launcher.launch`). Each rank then times, alternately and after a barrier each:

* ours: the gradient-sync path of a plan, a `hspmd.runtime.buckets.Bucket` holding one
  float32 gradient of `--mib` MiB that its producer wrote into the bucket (as the plan
  arranges), started (`MPICommunicator.iall_reduce` in place) and waited on;
* raw: `MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)` on a buffer of the same bytes;
* blocking: `MPICommunicator.all_reduce(buf, group, out=buf)`, for information.

Rank 0 prints the medians and, last, the ratio ours / raw. The results are checked to be
equal (bitwise) to the left fold of the two ranks' buffers before timing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def child(mib: float, reps: int) -> int:
    from mpi4py import MPI

    from hspmd.runtime.buckets import Bucket
    from hspmd.runtime.comm.mpi import MPICommunicator

    comm = MPICommunicator()
    world = MPI.COMM_WORLD
    if comm.size != 2:
        print(f"allreduce_vs_mpi: needs 2 ranks, has {comm.size}", file=sys.stderr)
        return 1
    n = int(mib * 2**20) // 4
    group = (0, 1)
    rng = np.random.default_rng(comm.rank)
    grad = rng.standard_normal(n).astype(np.float32)
    bucket = Bucket(comm, group, np.dtype(np.float32), [(n,)])
    (view,) = bucket.views
    raw = np.empty(n, np.float32)
    blocking = np.empty(n, np.float32)

    other = np.random.default_rng(1 - comm.rank).standard_normal(n).astype(np.float32)
    expected = grad + other if comm.rank == 0 else other + grad
    np.copyto(view, grad)
    bucket.start(view)
    assert bucket.wait().tobytes() == expected.tobytes(), "bucketed all-reduce differs from the left fold"

    def ours() -> None:
        bucket.start(view)  # the producer wrote the gradient into the bucket: no copy
        bucket.wait()

    def mpi_raw() -> None:
        world.Allreduce(MPI.IN_PLACE, [raw, MPI.FLOAT], op=MPI.SUM)

    def ours_blocking() -> None:
        comm.all_reduce(blocking, group, out=blocking)

    cases = [("ours", ours, view), ("raw", mpi_raw, raw), ("blocking", ours_blocking, blocking)]
    times: dict[str, list[float]] = {name: [] for name, *_ in cases}
    for i in range(reps + 10):
        for name, fn, data in cases[i % 3:] + cases[: i % 3]:  # rotate who goes first
            np.copyto(data, grad)  # the gradient, fresh in cache, as a backward pass leaves it
            world.Barrier()
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if i >= 10:
                times[name].append(elapsed)
    # a rank's time is when it got its result; the slower rank's time is the collective's
    med = {}
    for name, ts in times.items():
        slowest = np.empty(len(ts))
        world.Allreduce(np.array(ts), slowest, op=MPI.MAX)
        med[name] = float(np.median(slowest))
    if comm.rank == 0:
        print(f"{mib:g} MiB float32 all-reduce on 2 ranks, median of {reps} (slower rank's time): "
              f"hspmd bucket {med['ours'] * 1e3:.3f} ms, hspmd blocking all_reduce {med['blocking'] * 1e3:.3f} ms, "
              f"mpi4py Allreduce {med['raw'] * 1e3:.3f} ms")
        print(f"hspmd gradient sync / mpi4py Allreduce: {med['ours'] / med['raw']:.3f}")
    comm.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=4.0, help="buffer size in MiB (default 4)")
    parser.add_argument("--reps", type=int, default=200, help="timed repetitions of each (default 200)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.mib, args.reps)
    from hspmd.runtime.launcher.launch import mpiexec_command

    cmd = mpiexec_command(2, [os.path.abspath(__file__), "--child", "--mib", str(args.mib), "--reps", str(args.reps)])
    return subprocess.run(cmd, timeout=1800).returncode


if __name__ == "__main__":
    sys.exit(main())
