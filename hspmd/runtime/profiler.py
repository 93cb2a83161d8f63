"""Measuring a `DeviceProfile` on real ranks (`hspmd profile -n N`).

Run on every rank as ``python -m hspmd.runtime.profiler OUT [--cpu-bind LIST] [--reps K]``
under ``mpiexec`` (the CLI does that): each rank pins itself to its core if asked
(`bind_cpu`), then all ranks measure *at the same time*, so ranks that share a core show
the share they really get:

* **matmul**: float32 NumPy matmuls at `MATMUL_SHAPES` (the smallest a stack of 64 small
  products from strided views, as attention's per-head products run: 60 GFLOP/s where one
  64x64x64 product runs at 90), each repeated for about
  `seconds_per_point`, in 5 windows timed as a whole; the median window's mean is kept
  (a mean, not a minimum: a rank that loses its core half of the time measures half the
  rate; the median: a burst of someone else's load does not count);
* **elementwise**: ``np.exp(a, out=c)`` over 1 Mi float32 (8 bytes moved per element: a kernel
  with math in it, as the model's are; a bare ``np.add`` runs about 4x faster and made the
  cost model predict half the measured step);
* **fused**: the project's own fused softmax row kernel (the CUDA C that `fuse-kernels` emits
  for `graph.softmax`, built for the CPU by `codegen.cpu_compile`, cached after the first
  build) over rows of 256 of 1 Mi float32, its operand and result counted (8 bytes per
  element): the rate of a row kernel such as layer norm or softmax. Without a C++ compiler
  (the runtime then runs fused ops as NumPy per op) the same softmax as NumPy runs it, in five
  passes. The NumPy chain, which this used to be, ran 2.3x slower than the fused kernels of a
  GPT step and made the cost model price them at 16.7 ms where they took 7.2;
* **point to point**: for each rank pair in turn (the others wait at a barrier), a ping-pong
  of a small and a large message gives a one-way latency and a bandwidth (both directions);
* **collectives**: every kind of `COLLECTIVES` over the whole world and over every pair,
  with the project's `MPICommunicator`, at the log-spaced sizes of `COLLECTIVE_BYTES` (1 KiB
  to 4 MiB: the communicator switches algorithm at 256 KiB, so a line through two sizes
  misses the middle); the fit keeps every size (`CollectiveFit.points`). They are measured as
  a step meets them: the pairs in rounds of disjoint pairs at once (`measuring_rounds`), every
  rank outside a measured group computing meanwhile; the mean of each window of calls (waits
  for a member the OS descheduled included), the median window, the slowest member; and the
  *resynchronisation* cost, what a collective costs more when compute comes before it (the
  wait for a member that the compute left behind, which tensor parallelism's many small
  collectives pay where ranks outnumber cores; `CollectiveFit.resync_s`). All rounds are
  measured twice (`PASSES`) and per size the lesser time is kept: a window of bad
  scheduling that kept a member off its core throughout one pass is the load of that
  moment, not the group's.

* **overlap**: how much of a gradient bucket's all-reduce over the world hides behind compute
  when run as the runtime runs buckets (non-blocking, a poll after each kernel): on CPU ranks
  the cores that move the bytes are the ones computing (`_bucket_overlap`).

With `--device cuda` (`hspmd profile -n 1 --device cuda`) a rank's compute rates are its GPU's,
measured through the GPU plan's device interface (`runtime/cuda/profile.py`: cuBLAS GEMMs up to
4096^3, the device kernels of exp and softmax).

Rank 0 gathers every rank's numbers and writes the JSON profile. `measure` is the whole
measurement for one rank; `main` is the rank's entry point.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from hspmd.ir.device_profile import COLLECTIVES, CollectiveFit, DeviceProfile, Link, MatmulPoint, RankRates

__all__ = ["MATMUL_SHAPES", "bind_cpu", "main", "measure", "parse_cpu_bind"]

#: (m, k, n) of the matmuls measured; a 4-tuple (p, m, k, n) is a stack of p products m x k by
#: k x n whose operands are strided views, as attention's per-head products are (its point is
#: one product's FLOPs: the cost model prices a stack at the rate of one of its products)
MATMUL_SHAPES = ((64, 64, 32, 64), (64, 64, 64), (128, 256, 256), (256, 512, 512), (512, 512, 1024))
#: the elements of the elementwise test arrays, and the row length of the row-kernel test
ELEMENTWISE_SIZE = 1 << 20
ROW = 256
#: buffer sizes (bytes) of the small and the large message of a ping-pong
SMALL_BYTES, LARGE_BYTES = 1024, 4 << 20
#: local buffer sizes (bytes) each collective is measured at: log-spaced, 1 KiB to 4 MiB (the
#: communicator changes algorithm at 256 KiB; a tensor-parallel activation is often near it)
COLLECTIVE_BYTES = (1 << 10, 1 << 13, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
#: the all-reduce whose overlap with compute is measured: the runtime's gradient bucket
OVERLAP_BYTES = 4 << 20
#: passes over all the rounds of collectives (per size the least of the passes' times is kept)
PASSES = 2
#: timed windows per collective size (the median window's mean is kept)
WINDOWS = 3
#: calls of the compute kernel (a 128^3 matmul) before each timed collective, as a step's
#: kernels come between its collectives
WORK_BETWEEN = 4


class ProfileRunError(RuntimeError):
    """The profile run cannot start (a bad --cpu-bind) or failed on a rank."""


def parse_cpu_bind(text: str, n: int) -> list[int]:
    """Return the core of each of `n` ranks from `0,0,1` (one core per rank, comma-separated)."""
    try:
        cores = [int(c) for c in text.split(",")]
    except ValueError:
        raise ProfileRunError(f"--cpu-bind {text!r}: expected one core number per rank, like 0,0,1") from None
    if len(cores) != n:
        raise ProfileRunError(f"--cpu-bind {text!r} names {len(cores)} cores for {n} ranks")
    if any(c < 0 for c in cores):
        raise ProfileRunError(f"--cpu-bind {text!r}: core numbers must not be negative")
    return cores


def bind_cpu(core: int) -> None:
    """Pin this process to `core` (os.sched_setaffinity)."""
    try:
        os.sched_setaffinity(0, {core})
    except (AttributeError, OSError) as err:
        raise ProfileRunError(f"cannot pin to core {core}: {err}") from None


def _timed(fn: Callable[[], object], seconds: float, windows: int = 5) -> float:
    """Return the seconds of one call of `fn`: the median over `windows` windows of the mean time
    of calls repeated for `seconds / windows` each (after one warm-up call).

    A window's mean (not a minimum) keeps the share of a core a rank really gets when it
    shares it; the median of windows drops bursts of unrelated load on the machine.
    """
    fn()
    means = []
    for _ in range(windows):
        reps, start = 0, time.perf_counter()
        while True:
            fn()
            reps += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds / windows:
                break
        means.append(elapsed / reps)
    return sorted(means)[len(means) // 2]


def _compute(seconds_per_point: float) -> RankRates:
    """Return this rank's matmul and elementwise rates."""
    rng = np.random.default_rng(0)
    points = []
    for shape in MATMUL_SHAPES:
        *stack, m, k, n = shape
        if stack:  # heads of a fused projection: [batch, rows, 2, heads, k], 4 heads, k = n
            heads = 4
            x = rng.standard_normal((stack[0] // heads, m, 2, heads, k), dtype=np.float32)
            a, b = x[:, :, 0].transpose(0, 2, 1, 3), x[:, :, 1].transpose(0, 2, 3, 1)
            out = np.empty((stack[0] // heads, heads, m, n), np.float32)
        else:
            a = rng.standard_normal((m, k), dtype=np.float32)
            b = rng.standard_normal((k, n), dtype=np.float32)
            out = np.empty((m, n), np.float32)
        t = _timed(lambda: np.matmul(a, b, out=out), seconds_per_point)
        flops = 2.0 * m * k * n
        points.append(MatmulPoint(flops, flops * (stack[0] if stack else 1) / t / 1e9, tuple(shape)))
    x = rng.standard_normal(ELEMENTWISE_SIZE, dtype=np.float32)
    z = np.empty_like(x)
    t = _timed(lambda: np.exp(x, out=z), seconds_per_point)  # a kernel with math, not a bare copy
    rows = x.reshape(-1, ROW)
    kernel = _fused_softmax(rows.shape)
    if kernel is None:
        t_rows = _timed(lambda: _row_chain(rows, z.reshape(-1, ROW)), seconds_per_point)
    else:
        t_rows = _timed(lambda: kernel(rows, z.reshape(-1, ROW)), seconds_per_point)
    return RankRates(tuple(points), 2 * x.nbytes / t, 2 * x.nbytes / t_rows)


def _fused_softmax(shape: tuple[int, int]) -> Callable[[np.ndarray, np.ndarray], None] | None:
    """Return `kernel(x, out)`: the fused softmax over the rows of a float32 array of `shape`, as
    `fuse-kernels` emits it and the runtime builds it (None where it cannot be built: no C++
    compiler, or a build that fails; the runtime then runs fused ops as NumPy per op too)."""
    import ctypes

    from xdsl.dialects.builtin import TensorType, f32
    from xdsl.ir import Block

    from hspmd.codegen import cpu_compile
    from hspmd.codegen.emit_cuda import EmitError, emit_row
    from hspmd.dialects import graph

    if cpu_compile.find_compiler() is None:
        return None
    block = Block(arg_types=[TensorType(f32, list(shape))])
    name = "hs_profile_softmax"
    try:
        code = emit_row(name, graph.SoftmaxOp(block.args[0], len(shape) - 1))
        (kind, function, n0, n1), = [tuple(int(x) if x.isdigit() else x for x in launch.split())
                                     for launch in code.launches]
        spec = cpu_compile.LaunchSpec(str(kind), str(function), ("float", "float"))
        launch = cpu_compile.load_library(cpu_compile.build_library([code.source], [spec])).function(function)
    except (EmitError, cpu_compile.CompileError, OSError, ValueError):
        return None
    pointers = ctypes.c_void_p * 2

    def kernel(x: np.ndarray, out: np.ndarray) -> None:
        launch(pointers(x.ctypes.data, out.ctypes.data), n0, n1, 1)

    return kernel


def _row_chain(x: np.ndarray, out: np.ndarray) -> None:
    """A softmax over rows, as NumPy runs it: what a fused row kernel (softmax, layer norm) does
    to its operand and result, here in five passes (the rate stands in for the fused kernels')."""
    np.subtract(x, x.max(axis=1, keepdims=True), out=out)
    np.exp(out, out=out)
    np.divide(out, out.sum(axis=1, keepdims=True), out=out)


def _fit(small: float, large: float) -> tuple[float, float]:
    """Return (latency, bandwidth) of the line through (SMALL_BYTES, small) and (LARGE_BYTES, large)."""
    slope = max((large - small) / (LARGE_BYTES - SMALL_BYTES), 1e-15)
    return max(small - slope * SMALL_BYTES, 0.0), 1.0 / slope


def _pingpong(comm, a: int, b: int, reps: int) -> Link:
    """Return the link a <-> b from ping-pongs of a small and a large message (run by a and b)."""
    times = []
    for size in (SMALL_BYTES, LARGE_BYTES):
        buf = np.zeros(size // 4, np.float32)
        out = np.empty_like(buf)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            if comm.rank == a:
                comm.send(buf, b)
                comm.recv(out, b)
            else:
                comm.recv(out, a)
                comm.send(buf, a)
            best = min(best, (time.perf_counter() - start) / 2)
        times.append(best)
    lat, bw = _fit(*times)
    return Link(lat, bw)


def _collective_call(comm, kind: str, group: tuple[int, ...], nbytes: int) -> Callable[[], object]:
    """Return a call of collective `kind` over `group` on a local buffer of `nbytes` (all_gather: the result)."""
    n = len(group)
    elems = max(nbytes // 4 // n, 1) * n
    buf = np.ones(elems, np.float32)
    if kind == "all_reduce":
        return lambda: comm.all_reduce(buf, group)
    if kind == "all_gather":
        piece = np.ones(elems // n, np.float32)
        return lambda: comm.all_gather(piece, group, 0)
    if kind == "reduce_scatter":
        return lambda: comm.reduce_scatter(buf, group, 0)
    if kind == "all_to_all":
        return lambda: comm.all_to_all(buf, group, 0, 0)
    if kind == "broadcast":
        return lambda: comm.broadcast(buf, group, group[0])
    raise ValueError(kind)


def _busy_until(request, work: Callable[[], object]) -> None:
    """Run `work` again and again until MPI request `request` completes (a rank outside the
    measured group: it computes, as it would in a step, instead of idling at a barrier)."""
    while not request.Test():
        work()


def _collective(comm, kind: str, group: tuple[int, ...], reps: int, work: Callable[[], object]) -> CollectiveFit | None:
    """Return the fit of `kind` over this rank's `group` at every size of `COLLECTIVE_BYTES`, and
    its resynchronisation cost (members only; None on a rank in no group, `()`). Every rank
    calls it at once; the groups of one round are disjoint and measure at the same time.

    The ranks in no group compute (`work`) meanwhile, as the other ranks of a step do, so
    where ranks outnumber cores a member that the OS deschedules makes its partners wait here as
    it does in a step. Per size: `WINDOWS` windows of `reps` calls back to back, each window's
    mean, the median window (a mean keeps the waits for descheduled members; the median drops
    bursts of unrelated load); the slowest member's. Then, at the smallest size, the same with
    `WORK_BETWEEN` kernels of compute before each call: what that costs more is the wait for a
    member that the compute left behind (`CollectiveFit.resync_s`), paid by a collective that
    follows compute (tp's) but not by the next of a burst (the gradient sums after the backward).
    """
    mine = comm.rank in group
    if not mine:
        _busy_until(comm.mpi_comm.Ibarrier(), work)
        comm.mpi_comm.allgather(((), None))
        return None

    def mean_time(call: Callable[[], object], between: int) -> float:
        means = []
        for _ in range(WINDOWS):
            spent = 0.0
            for _ in range(reps):
                for _ in range(between):  # a step's kernels between two collectives
                    work()
                start = time.perf_counter()
                call()
                spent += time.perf_counter() - start
            means.append(spent / reps)
        return sorted(means)[len(means) // 2]

    times = []
    for size in COLLECTIVE_BYTES:
        call = _collective_call(comm, kind, group, size)
        call()
        times.append(mean_time(call, 0))
    times.append(mean_time(_collective_call(comm, kind, group, COLLECTIVE_BYTES[0]), WORK_BETWEEN))
    start = time.perf_counter()
    for _ in range(WORK_BETWEEN * reps):
        work()
    times.append((time.perf_counter() - start) / reps)  # the compute before each call
    comm.mpi_comm.Ibarrier().Wait()
    everyone = comm.mpi_comm.allgather((group, times))
    worst = [max(t[i] for g, t in everyone if g == group) for i in range(len(times))]
    fit = CollectiveFit.from_points(kind, group, list(zip(COLLECTIVE_BYTES, worst)))
    return replace(fit, resync_s=max(0.0, worst[-2] - worst[0]), resync_after_s=worst[-1])


def _least(tries: list[CollectiveFit]) -> CollectiveFit:
    """Return one fit of several passes over the same group: per size the least time, and the
    least resynchronisation cost (a pass during which the OS kept a member off its core for
    long is an outlier of the machine's load, not of the group)."""
    first = tries[0]
    points = [(b, min(t.points[i][1] for t in tries)) for i, (b, _) in enumerate(first.points)]
    best = min(tries, key=lambda t: t.resync_s)
    fit = CollectiveFit.from_points(first.kind, first.group, points)
    return replace(fit, resync_s=best.resync_s, resync_after_s=best.resync_after_s)


def _bucket_overlap(comm, reps: int, work: Callable[[], object]) -> float:
    """Return the part (0..1) of a gradient bucket's all-reduce over the world that compute hides,
    as the runtime runs a bucket: `iall_reduce`, a poll (`test`) after each kernel, `wait`.

    Timed (the median of `reps` each, all ranks together): the blocking all-reduce alone (C),
    the compute alone (W: as many kernels of `work` as take about as long as C), and the two
    overlapped (B); the part hidden is (C + W - B) / min(C, W), the smallest over the ranks.
    """
    group = tuple(range(comm.size))
    buf = np.ones(OVERLAP_BYTES // 4, np.float32)

    def timed(run: Callable[[], object]) -> float:
        times = []
        for _ in range(reps):
            comm.barrier()
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    def both() -> None:
        request = comm.iall_reduce(buf, group, out=buf)
        for _ in range(kernels):
            work()
            request.test()
        request.wait()

    alone = timed(lambda: comm.all_reduce(buf, group, out=buf))
    one = timed(work)
    kernels = max(1, min(1000, round(comm.mpi_comm.allreduce(alone / one, op=_max_op()))))
    compute = timed(lambda: [work() for _ in range(kernels)])
    overlapped = timed(both)
    hidden = (alone + compute - overlapped) / min(alone, compute)
    return min(1.0, max(0.0, comm.mpi_comm.allreduce(hidden, op=_min_op())))


def _max_op():
    from mpi4py import MPI

    return MPI.MAX


def _min_op():
    from mpi4py import MPI

    return MPI.MIN


def groups_measured(n: int) -> list[tuple[int, ...]]:
    """Return the groups whose collectives are measured: the world, then every pair (n > 2)."""
    world = tuple(range(n))
    pairs = [(a, b) for a in range(n) for b in range(a + 1, n)]
    return [world] + [p for p in pairs if p != world] if n > 1 else []


def measuring_rounds(n: int) -> list[list[tuple[int, ...]]]:
    """Return `groups_measured(n)` in rounds of disjoint groups measured at once: the world alone,
    then the pairs as a round-robin tournament (n = 4: (0,1)+(2,3), (0,2)+(1,3), (0,3)+(1,2)), so
    every rank is busy in each round as in a step (a rank with no pair in a round computes)."""
    if n < 2:
        return []
    rounds: list[list[tuple[int, ...]]] = [[tuple(range(n))]]
    if n == 2:
        return rounds
    seats = list(range(n)) + ([None] if n % 2 else [])  # None: the bye
    for _ in range(len(seats) - 1):
        pairs = [tuple(sorted((seats[i], seats[-1 - i]))) for i in range(len(seats) // 2)
                 if seats[i] is not None and seats[-1 - i] is not None]
        rounds.append(sorted(pairs))  # type: ignore[arg-type]
        seats = [seats[0], seats[-1], *seats[1:-1]]
    return rounds


def measure(comm, reps: int = 5, seconds_per_point: float = 0.15, cpu_bind: str = "",
            device: str = "cpu") -> DeviceProfile | None:
    """Measure on every rank of `comm` at once; return the profile on rank 0 (None on the others).

    `reps`: repetitions of each message and collective (the best is kept); `seconds_per_point`:
    how long each compute rate is measured; `cpu_bind` is recorded in the profile's meta;
    `device` "cuda": each rank's compute rates are its GPU's (`runtime/cuda/profile.py`); one
    kind per rank (`cuda,cpu`) measures each rank on its own kind, recorded in `meta["kinds"]`.
    """
    from hspmd.runtime.cuda.select import rank_device

    n, rank = comm.size, comm.rank
    device = rank_device(device, rank)
    comm.barrier()
    if device == "cuda":
        from hspmd.runtime.cuda.profile import device_rates
        from hspmd.runtime.cuda.select import local_rank, open_device

        gpu = open_device(local_rank(rank))
        rates, where = device_rates(gpu, seconds_per_point), gpu.name
    else:
        rates, where = _compute(seconds_per_point), "cpu"
    comm.barrier()
    links: dict[tuple[int, int], Link] = {}
    for a in range(n):
        for b in range(a + 1, n):
            if rank in (a, b):
                link = _pingpong(comm, a, b, reps)
                if rank == a:
                    links[(a, b)] = links[(b, a)] = link
            comm.barrier()
    rng = np.random.default_rng(rank)
    a, b = (rng.standard_normal((128, 128), dtype=np.float32) for _ in range(2))
    c = np.empty_like(a)
    work = lambda: np.matmul(a, b, out=c)  # noqa: E731  (about 0.1 ms: a kernel of a small model's step)
    measured: dict[tuple[str, tuple[int, ...]], list[CollectiveFit]] = {}
    for _ in range(PASSES):  # all rounds, then all again: a phase of bad scheduling hits one pass
        for groups in measuring_rounds(n):
            group = next((g for g in groups if rank in g), ())
            for kind in COLLECTIVES:
                fit = _collective(comm, kind, group, reps, work)
                if fit is not None and rank == group[0]:
                    measured.setdefault((kind, group), []).append(fit)
                comm.barrier()
    fits = [_least(tries) for tries in measured.values()]
    overlap = _bucket_overlap(comm, reps, work) if n > 1 else 1.0
    gathered = comm.mpi_comm.gather((rates, links, fits, platform.node(), where, device), root=0)
    if rank != 0:
        return None
    all_links: dict[tuple[int, int], Link] = {}
    all_fits: list[CollectiveFit] = []
    for _, lk, fs, _, _, _ in gathered:
        all_links.update(lk)
        all_fits += fs
    order = {g: i for i, g in enumerate(groups_measured(n))}
    all_fits.sort(key=lambda f: (order[f.group], COLLECTIVES.index(f.kind)))
    default = max(all_links.values(), key=lambda lk: lk.seconds(2 ** 20)) if all_links else Link(1e-6, 1e10)
    hosts = sorted({g[3] for g in gathered})
    devices = sorted({g[4] for g in gathered} - {"cpu"})
    on = f" on {', '.join(devices)}" if devices else ""
    return DeviceProfile(
        tuple(g[0] for g in gathered), default, all_links, tuple(all_fits),
        source=f"measured by hspmd profile on {n} ranks ({', '.join(hosts)}){on}", bucket_overlap=overlap,
        meta={"hosts": [g[3] for g in gathered], "devices": [g[4] for g in gathered],
              "kinds": [g[5] for g in gathered], "reps": reps,
              "seconds_per_point": seconds_per_point,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu_bind": cpu_bind,
              "threads": os.environ.get("OMP_NUM_THREADS", "")},
    )


def main(argv: Sequence[str] | None = None) -> int:
    """One rank of `hspmd profile`: pin, measure, and (rank 0) write the profile."""
    p = argparse.ArgumentParser(prog="python -m hspmd.runtime.profiler")
    p.add_argument("out")
    p.add_argument("--cpu-bind", default="")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seconds-per-point", type=float, default=0.15)
    p.add_argument("--device", default="cpu", help="cpu, cuda, or one of them per rank (cuda,cpu)")
    args = p.parse_args(argv)
    from hspmd.runtime.comm.mpi import MPICommunicator

    comm = MPICommunicator()
    try:
        if args.cpu_bind:
            bind_cpu(parse_cpu_bind(args.cpu_bind, comm.size)[comm.rank])
        profile = measure(comm, args.reps, args.seconds_per_point, args.cpu_bind, args.device)
        if profile is not None:
            profile.save(args.out)
    except ProfileRunError as err:
        print(f"hspmd profile: error on rank {comm.rank}: {err}", file=sys.stderr)
        return 1
    finally:
        comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
