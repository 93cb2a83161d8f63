"""Runs every collective of a communicator on fixed inputs and collects the results.

Under ``mpiexec -n N python comm_check.py OUTDIR`` each rank writes ``OUTDIR/rank{r}.npz``
(results of an MPICommunicator).  ``tests/test_comm_mpi.py`` imports this file too, runs
:func:`exercise` on the in-process communicator, and compares both with :func:`expected`
(plain NumPy) bit for bit.
"""
from __future__ import annotations

import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

SEP = "__"


def make_input(name: str, rank: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Return rank ``rank``'s input of case ``name``: values of many magnitudes, so that the
    order of a floating-point sum changes its bits."""
    rng = np.random.default_rng([zlib.crc32(name.encode()), rank])
    if np.dtype(dtype).kind == "f":
        mag = 10.0 ** rng.integers(-4, 5, size=shape)
        return (rng.standard_normal(shape) * mag).astype(dtype)
    return rng.integers(-1000, 1000, size=shape).astype(dtype)


def layouts(n: int) -> list[list[tuple[int, ...]]]:
    """Return partitions of range(n) into groups, used concurrently (one partition at a time)."""
    everyone = tuple(range(n))
    evens = tuple(r for r in everyone if r % 2 == 0)[::-1]
    odds = tuple(r for r in everyone if r % 2 == 1)
    out = [[everyone], [everyone[::-1]], [g for g in (evens, odds) if g]]
    if n >= 3:
        out.append([(n - 1, 0, *range(1, n - 1))])  # rotated
    return out


def left_fold(arrays: list[np.ndarray]) -> np.ndarray:
    acc = arrays[0].copy()
    for a in arrays[1:]:
        acc = acc + a
    return acc


# A case: (name, input shape for group size k and member index i, dtype, run, reference).
# run(comm, g, x) -> result; reference(g, rank, xs) -> expected, xs[r] = input of rank r.
Case = tuple[str, Callable[[int, int], tuple[int, ...]], str, Callable, Callable]


def _chunk(a: np.ndarray, k: int, axis: int, j: int) -> np.ndarray:
    return np.split(a, k, axis=axis)[j]


def cases() -> list[Case]:
    """Return the list of cases every rank runs, in the same order."""
    cs: list[Case] = []
    add = cs.append

    def ar_ref(g, rank, xs):
        return left_fold([xs[r] for r in g])

    add(("ar_f32", lambda k, i: (5, 7), "float32", lambda c, g, x: c.all_reduce(x, g), ar_ref))
    add(("ar_i32", lambda k, i: (3, 4), "int32", lambda c, g, x: c.all_reduce(x, g), ar_ref))
    add(("ar_f64_T", lambda k, i: (4, 6), "float64", lambda c, g, x: c.all_reduce(x.T, g),
         lambda g, rank, xs: left_fold([xs[r].T for r in g])))
    add(("ar_out", lambda k, i: (8,), "float32",
         lambda c, g, x: c.all_reduce(x, g, out=np.empty_like(x)), ar_ref))
    add(("ar_inplace", lambda k, i: (2, 3, 4), "float32",
         lambda c, g, x: c.all_reduce(x, g, out=x), ar_ref))
    # > 256 KiB and not divisible by 2 or 3: the reduce-scatter + all-gather path.
    add(("ar_big", lambda k, i: (70001,), "float32", lambda c, g, x: c.all_reduce(x, g), ar_ref))

    def forced(shape):
        def run(c, g, x):
            old = getattr(c, "small_all_reduce_bytes", None)
            if old is not None:
                c.small_all_reduce_bytes = 0
            try:
                return c.all_reduce(x, g, out=np.empty_like(x))
            finally:
                if old is not None:
                    c.small_all_reduce_bytes = old
        return run

    add(("ar_rsag_uneven", lambda k, i: (5, 7), "float32", forced((5, 7)), ar_ref))
    add(("ar_rsag_even", lambda k, i: (6, 4), "float64", forced((6, 4)), ar_ref))

    for axis in (0, 1, -1):
        add((f"ag_ax{axis}", lambda k, i: (2, 3), "float32",
             lambda c, g, x, a=axis: c.all_gather(x, g, a),
             lambda g, rank, xs, a=axis: np.concatenate([xs[r] for r in g], axis=a)))
    add(("ag_uneven", lambda k, i: (3, 1 + i, 2), "float64",
         lambda c, g, x: c.all_gather(x, g, 1),
         lambda g, rank, xs: np.concatenate([xs[r] for r in g], axis=1)))
    add(("ag_out", lambda k, i: (2, 2), "int64",
         lambda c, g, x: c.all_gather(x, g, 0, out=np.empty((2 * len(g), 2), x.dtype)),
         lambda g, rank, xs: np.concatenate([xs[r] for r in g], axis=0)))

    def ag_inplace(c, g, x):
        rows, i = x.shape[0], g.index(c.rank)
        out = np.zeros((len(g) * rows,) + x.shape[1:], x.dtype)
        mine = out[i * rows:(i + 1) * rows]
        mine[...] = x
        return c.all_gather(mine, g, 0, out=out)

    add(("ag_inplace", lambda k, i: (2, 3), "float32", ag_inplace,
         lambda g, rank, xs: np.concatenate([xs[r] for r in g], axis=0)))

    for axis in (0, 1):
        add((f"rs_ax{axis}", lambda k, i, a=axis: (2 * k, 3) if a == 0 else (3, 2 * k), "float32",
             lambda c, g, x, a=axis: c.reduce_scatter(x, g, a),
             lambda g, rank, xs, a=axis: _chunk(ar_ref(g, rank, xs), len(g), a, g.index(rank))))
    add(("rs_out", lambda k, i: (k, 4, 2), "float64",
         lambda c, g, x: c.reduce_scatter(x, g, 0, out=np.empty((1, 4, 2), x.dtype)),
         lambda g, rank, xs: _chunk(ar_ref(g, rank, xs), len(g), 0, g.index(rank))))

    add(("bc_last", lambda k, i: (3, 5), "float32", lambda c, g, x: c.broadcast(x, g, g[-1]),
         lambda g, rank, xs: xs[g[-1]]))
    add(("bc_first_out", lambda k, i: (4,), "int32",
         lambda c, g, x: c.broadcast(x, g, g[0], out=np.empty_like(x)),
         lambda g, rank, xs: xs[g[0]]))

    for sa, ca in ((0, 1), (1, 0), (1, 1), (0, 0)):
        add((f"a2a_{sa}{ca}", lambda k, i: (2 * k, 3 * k), "float32",
             lambda c, g, x, sa=sa, ca=ca: c.all_to_all(x, g, sa, ca),
             lambda g, rank, xs, sa=sa, ca=ca: np.concatenate(
                 [_chunk(xs[r], len(g), sa, g.index(rank)) for r in g], axis=ca)))
    return cs


def exercise(comm) -> dict[str, np.ndarray]:
    """Return this rank's results of every case on every layout, plus point-to-point results."""
    n, rank = comm.size, comm.rank
    res: dict[str, np.ndarray] = {}
    for li, layout in enumerate(layouts(n)):
        g = next(g for g in layout if rank in g)
        k, i = len(g), g.index(rank)
        for name, shape, dtype, run, _ in cases():
            x = make_input(f"{li}{name}", rank, shape(k, i), dtype)
            res[f"L{li}{SEP}{name}"] = np.asarray(run(comm, g, x))
    comm.barrier()
    # send/recv in pairs (0,1), (2,3), ...; the lower rank sends first.
    x = make_input("p2p", rank, (3, 4), "float32")
    peer = rank ^ 1
    if peer < n:
        got = np.empty((3, 4), np.float32)
        if rank % 2 == 0:
            comm.send(x, peer, tag=5)
            comm.recv(got, peer, tag=6)
        else:
            comm.recv(got, peer, tag=5)
            comm.send(x, peer, tag=6)
        res["p2p"] = got
    # non-blocking sends: both ends send first (tags 3 then 2, the buffer overwritten at once),
    # then receive in the other tag order
    if peer < n:
        buf = make_input("isend3", rank, (2, 5), "float64")
        requests = [comm.isend(buf, peer, tag=3)]
        buf[...] = make_input("isend2", rank, (2, 5), "float64")
        requests.append(comm.isend(buf, peer, tag=2))
        buf[...] = 0
        two, three = np.empty((2, 5)), np.empty((2, 5))
        comm.recv(two, peer, tag=2)
        comm.recv(three, peer, tag=3)
        for req in requests:
            req.wait()
        res["isend"] = np.concatenate([two, three])
    # a ring with sendrecv, into a non-contiguous out.
    if n > 1:
        y = make_input("ring", rank, (4, 3), "int64")
        out = np.zeros((3, 4), np.int64).T
        comm.sendrecv(y, (rank + 1) % n, out, (rank - 1) % n, sendtag=1, recvtag=1)
        res["ring"] = np.ascontiguousarray(out)
    comm.barrier()
    return res


def expected(n: int, rank: int) -> dict[str, np.ndarray]:
    """Return what :func:`exercise` must give on ``rank`` of ``n``, computed with NumPy alone."""
    exp: dict[str, np.ndarray] = {}
    for li, layout in enumerate(layouts(n)):
        g = next(g for g in layout if rank in g)
        k = len(g)
        for name, shape, dtype, _, ref in cases():
            xs = {r: make_input(f"{li}{name}", r, shape(k, g.index(r)), dtype) for r in g}
            exp[f"L{li}{SEP}{name}"] = np.asarray(ref(g, rank, xs))
    peer = rank ^ 1
    if peer < n:
        exp["p2p"] = make_input("p2p", peer, (3, 4), "float32")
        exp["isend"] = np.concatenate([make_input("isend2", peer, (2, 5), "float64"),
                                       make_input("isend3", peer, (2, 5), "float64")])
    if n > 1:
        exp["ring"] = make_input("ring", (rank - 1) % n, (4, 3), "int64")
    return exp


def main(argv: list[str]) -> int:
    from hspmd.runtime.comm.mpi import MPICommunicator

    outdir = Path(argv[1])
    comm = MPICommunicator()
    try:
        res = exercise(comm)
        np.savez(outdir / f"rank{comm.rank}.npz", **res)
    finally:
        comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
