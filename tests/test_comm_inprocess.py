"""The in-process communicator against NumPy references, and run_spmd's failure handling."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd.runtime.comm import (
    CommAborted,
    CommError,
    Communicator,
    DeadlockError,
    InProcessCommunicator,
    fold_sum,
    run_spmd,
)

FAST = settings(max_examples=40, deadline=None)
DTYPES = ["float32", "float64", "int32"]


# -- helpers ---------------------------------------------------------------------------------


def left_fold(arrays):
    acc = arrays[0].copy()
    for a in arrays[1:]:
        acc = acc + a
    return acc


def make_input(seed: int, rank: int, shape, dtype) -> np.ndarray:
    """Return values of many magnitudes, so that summation order shows in the bits."""
    rng = np.random.default_rng([seed, rank])
    if np.dtype(dtype).kind == "f":
        return (rng.standard_normal(shape) * 10.0 ** rng.integers(-4, 5, size=shape)).astype(dtype)
    return rng.integers(-1000, 1000, size=shape).astype(dtype)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@st.composite
def layouts(draw, max_world=6, max_group=4):
    """Return a world size and its partition into groups of 1..max_group ranks (random order)."""
    world = draw(st.integers(1, max_world))
    perm = draw(st.permutations(range(world)))
    groups, i = [], 0
    while i < world:
        k = draw(st.integers(1, min(max_group, world - i)))
        groups.append(tuple(perm[i : i + k]))
        i += k
    return world, groups


@st.composite
def specs(draw, groups, divisible_axis=False, second_axis=False):
    """Return per-group (dtype, shape, axis[, axis2]) with dims fitting the group size."""
    out = []
    for g in groups:
        ndim = draw(st.integers(1, 3))
        shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
        axis = draw(st.integers(-ndim, ndim - 1))
        if divisible_axis:
            shape[axis] *= len(g)
        axis2 = draw(st.integers(-ndim, ndim - 1)) if second_axis else None
        out.append((draw(st.sampled_from(DTYPES)), tuple(shape), axis, axis2))
    return out


def group_of(groups, rank):
    for gi, g in enumerate(groups):
        if rank in g:
            return gi, g
    raise AssertionError(rank)


# -- collectives against NumPy ---------------------------------------------------------------


@FAST
@given(st.data(), layouts(), st.integers(0, 2**31), st.sampled_from(["new", "out", "inplace"]))
def test_all_reduce(data, layout, seed, mode):
    world, groups = layout
    sp = data.draw(specs(groups))

    def fn(comm: Communicator):
        gi, g = group_of(groups, comm.rank)
        dtype, shape, _, _ = sp[gi]
        x = make_input(seed, comm.rank, shape, dtype)
        if mode == "new":
            res = comm.all_reduce(x, g)
            assert res is not x
        elif mode == "out":
            out = np.empty_like(x)
            res = comm.all_reduce(x, g, out=out)
            assert res is out
        else:
            res = comm.all_reduce(x, g, out=x)
            assert res is x
        return res

    results = run_spmd(world, fn)
    for gi, g in enumerate(groups):
        dtype, shape, _, _ = sp[gi]
        ref = left_fold([make_input(seed, r, shape, dtype) for r in g])
        for r in g:
            assert same_bits(results[r], ref)
            assert results[r].flags.c_contiguous


@FAST
@given(st.data(), layouts(), st.integers(0, 2**31), st.booleans(), st.booleans())
def test_all_gather(data, layout, seed, use_out, uneven):
    world, groups = layout
    sp = data.draw(specs(groups))

    def shape_of(gi, rank):
        dtype, shape, axis, _ = sp[gi]
        shape = list(shape)
        if uneven:
            shape[axis] = 1 + groups[gi].index(rank)
        return tuple(shape)

    def fn(comm):
        gi, g = group_of(groups, comm.rank)
        dtype, _, axis, _ = sp[gi]
        x = make_input(seed, comm.rank, shape_of(gi, comm.rank), dtype)
        if not use_out:
            return comm.all_gather(x, g, axis)
        total = list(x.shape)
        total[axis] = sum(shape_of(gi, r)[axis] for r in g)
        out = np.empty(total, x.dtype)
        assert comm.all_gather(x, g, axis, out=out) is out
        return out

    results = run_spmd(world, fn)
    for gi, g in enumerate(groups):
        dtype, _, axis, _ = sp[gi]
        ref = np.concatenate([make_input(seed, r, shape_of(gi, r), dtype) for r in g], axis=axis)
        for r in g:
            assert same_bits(results[r], ref)


@FAST
@given(st.data(), layouts(), st.integers(0, 2**31), st.booleans())
def test_reduce_scatter(data, layout, seed, use_out):
    world, groups = layout
    sp = data.draw(specs(groups, divisible_axis=True))

    def fn(comm):
        gi, g = group_of(groups, comm.rank)
        dtype, shape, axis, _ = sp[gi]
        x = make_input(seed, comm.rank, shape, dtype)
        if not use_out:
            return comm.reduce_scatter(x, g, axis)
        chunk = list(shape)
        chunk[axis] //= len(g)
        out = np.empty(chunk, x.dtype)
        assert comm.reduce_scatter(x, g, axis, out=out) is out
        return out

    results = run_spmd(world, fn)
    for gi, g in enumerate(groups):
        dtype, shape, axis, _ = sp[gi]
        total = left_fold([make_input(seed, r, shape, dtype) for r in g])
        chunks = np.split(total, len(g), axis=axis)
        for j, r in enumerate(g):
            assert same_bits(results[r], chunks[j])


@FAST
@given(st.data(), layouts(), st.integers(0, 2**31), st.booleans())
def test_broadcast(data, layout, seed, use_out):
    world, groups = layout
    sp = data.draw(specs(groups))
    roots = [data.draw(st.sampled_from(g)) for g in groups]

    def fn(comm):
        gi, g = group_of(groups, comm.rank)
        dtype, shape, _, _ = sp[gi]
        x = make_input(seed, comm.rank, shape, dtype)
        out = np.empty_like(x) if use_out else None
        res = comm.broadcast(x, g, roots[gi], out=out)
        assert res is not x and (out is None or res is out)
        return res

    results = run_spmd(world, fn)
    for gi, g in enumerate(groups):
        dtype, shape, _, _ = sp[gi]
        ref = make_input(seed, roots[gi], shape, dtype)
        for r in g:
            assert same_bits(results[r], ref)


@FAST
@given(st.data(), layouts(), st.integers(0, 2**31), st.booleans())
def test_all_to_all(data, layout, seed, use_out):
    world, groups = layout
    sp = data.draw(specs(groups, divisible_axis=True, second_axis=True))

    def fn(comm):
        gi, g = group_of(groups, comm.rank)
        dtype, shape, split, concat = sp[gi]
        x = make_input(seed, comm.rank, shape, dtype)
        if not use_out:
            return comm.all_to_all(x, g, split, concat)
        res_shape = list(shape)
        res_shape[split] //= len(g)
        res_shape[concat] *= len(g)
        out = np.empty(res_shape, x.dtype)
        assert comm.all_to_all(x, g, split, concat, out=out) is out
        return out

    results = run_spmd(world, fn)
    for gi, g in enumerate(groups):
        dtype, shape, split, concat = sp[gi]
        xs = [make_input(seed, r, shape, dtype) for r in g]
        for j, r in enumerate(g):
            ref = np.concatenate([np.split(x, len(g), axis=split)[j] for x in xs], axis=concat)
            assert same_bits(results[r], ref)


@FAST
@given(st.integers(1, 6).flatmap(lambda n: st.permutations(range(n))), st.integers(0, 2**31),
       st.integers(0, 99))
def test_send_recv_pairs(perm, seed, tag):
    world = len(perm)
    pairs = [(perm[i], perm[i + 1]) for i in range(0, world - 1, 2)]
    role = {}
    for a, b in pairs:
        role[a] = ("first", b)
        role[b] = ("second", a)

    def fn(comm):
        if comm.rank not in role:
            return None
        which, peer = role[comm.rank]
        x = make_input(seed, comm.rank, (2, 3), "float32")
        got = np.empty((2, 3), np.float32)
        if which == "first":
            comm.send(x, peer, tag)
            comm.recv(got, peer, tag + 1)
        else:
            comm.recv(got, peer, tag)
            comm.send(x, peer, tag + 1)
        return got

    results = run_spmd(world, fn)
    for r, (_, peer) in role.items():
        assert same_bits(results[r], make_input(seed, peer, (2, 3), "float32"))


def test_sendrecv_ring_and_tag_matching():
    n = 5

    def fn(comm):
        r = comm.rank
        out = np.empty(3, np.int64)
        comm.sendrecv(np.full(3, r), (r + 1) % n, out, (r - 1) % n)
        # messages are matched by tag
        a, b = np.empty(2), np.empty(2)
        if r == 0:
            comm.sendrecv(np.array([1.0, 1.0]), 1, a, 1, sendtag=7, recvtag=8)
            comm.sendrecv(np.array([2.0, 2.0]), 1, b, 1, sendtag=8, recvtag=7)
        elif r == 1:
            comm.sendrecv(np.array([3.0, 3.0]), 0, a, 0, sendtag=8, recvtag=7)
            comm.sendrecv(np.array([4.0, 4.0]), 0, b, 0, sendtag=7, recvtag=8)
        return out, a, b

    res = run_spmd(n, fn)
    for r in range(n):
        assert res[r][0].tolist() == [(r - 1) % n] * 3
    assert res[0][1].tolist() == [3.0, 3.0] and res[0][2].tolist() == [4.0, 4.0]
    assert res[1][1].tolist() == [1.0, 1.0] and res[1][2].tolist() == [2.0, 2.0]


def test_recv_into_non_contiguous_out():
    def fn(comm):
        if comm.rank == 0:
            comm.send(np.arange(6.0).reshape(2, 3), 1)
            return None
        out = np.zeros((3, 2)).T
        assert comm.recv(out, 0) is out
        return out

    assert run_spmd(2, fn)[1].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_left_fold_order_in_group_order():
    # 1 + 1e8 rounds to 1e8 in float32, so the order of the sum decides the result.
    vals = {0: 1.0, 1: 1e8, 2: -1e8}

    def fn(comm):
        x = np.array([vals[comm.rank]], np.float32)
        return comm.all_reduce(x, (0, 1, 2))[0], comm.all_reduce(x, (1, 2, 0))[0]

    for forward, rotated in run_spmd(3, fn):
        assert forward == 0.0  # (1 + 1e8) - 1e8
        assert rotated == 1.0  # (1e8 - 1e8) + 1
    assert fold_sum([np.float32([v]) for v in vals.values()])[0] == 0.0


def test_group_of_one_returns_copies():
    def fn(comm):
        g = (comm.rank,)
        x = np.arange(6.0).reshape(2, 3)
        outs = [
            comm.all_reduce(x, g),
            comm.all_gather(x, g, 1),
            comm.reduce_scatter(x, g, 0),
            comm.broadcast(x, g, comm.rank),
            comm.all_to_all(x, g, 0, 1),
        ]
        for o in outs:
            assert o is not x and not np.shares_memory(o, x)
            assert same_bits(o, x)
        return True

    assert run_spmd(3, fn) == [True] * 3


def test_overlapping_groups_in_sequence_and_lists_as_groups():
    def fn(comm):
        r = comm.rank
        x = np.array([float(r + 1)])
        a = comm.all_reduce(x, (0, 1, 2, 3))
        b = comm.all_reduce(x, (0, 1) if r < 2 else (2, 3))
        c = comm.all_reduce(x, [1, 2]) if r in (1, 2) else comm.all_reduce(x, [r])
        d = comm.all_gather(x, (3, 2, 1, 0), 0)
        return a[0], b[0], c[0], d.tolist()

    res = run_spmd(4, fn)
    assert [t[0] for t in res] == [10.0] * 4
    assert [t[1] for t in res] == [3.0, 3.0, 7.0, 7.0]
    assert [t[2] for t in res] == [1.0, 5.0, 5.0, 4.0]
    assert all(t[3] == [4.0, 3.0, 2.0, 1.0] for t in res)


def test_barrier_orders_phases():
    seen = []
    lock = threading.Lock()

    def fn(comm):
        time.sleep(0.01 * comm.rank)
        with lock:
            seen.append(comm.rank)
        comm.barrier()
        with lock:
            return len(seen)

    assert run_spmd(4, fn) == [4, 4, 4, 4]


def test_run_spmd_results_in_rank_order_and_size_one():
    assert run_spmd(5, lambda c: (c.rank, c.size)) == [(r, 5) for r in range(5)]
    assert run_spmd(1, lambda c: c.all_reduce(np.ones(2), (0,)).tolist()) == [[1.0, 1.0]]


def test_create_world_with_own_threads():
    comms = InProcessCommunicator.create_world(3, timeout=10)
    results = [None] * 3

    def body(c):
        results[c.rank] = c.all_reduce(np.array([c.rank]), (0, 1, 2))[0]

    threads = [threading.Thread(target=body, args=(c,)) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [3, 3, 3]


# -- misuse ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "group, message",
    [((1, 2), "not a member"), ((0, 0, 1), "repeats"), ((0, 5), "outside"), ((), "empty")],
)
def test_bad_groups(group, message):
    comm = InProcessCommunicator.create_world(3)[0]
    with pytest.raises(CommError, match=message):
        comm.all_reduce(np.ones(2), group)


def test_bad_shapes_and_outs():
    def fn(comm):
        with pytest.raises(CommError, match="equal chunks"):
            comm.reduce_scatter(np.ones((3, 2)), (0, 1), 0)
        with pytest.raises(CommError, match="out has shape"):
            comm.all_reduce(np.ones(3), (0, 1), out=np.empty(4))
        with pytest.raises(CommError, match="out has shape"):
            comm.all_reduce(np.ones(3), (0, 1), out=np.empty(3, np.float32))
        with pytest.raises(CommError, match="axis 2 is out of range"):
            comm.all_gather(np.ones(3), (0, 1), 2)
        with pytest.raises(CommError, match="root 3"):
            comm.broadcast(np.ones(3), (0, 1), 3)
        return True

    assert run_spmd(2, fn) == [True, True]


def test_mismatched_shapes_raise():
    def fn(comm):
        return comm.all_reduce(np.ones(2 + comm.rank), (0, 1))

    with pytest.raises(CommError, match="passed shape"):
        run_spmd(2, fn, timeout=10)


def test_mismatched_collectives_raise():
    def fn(comm):
        x = np.ones(4)
        if comm.rank == 0:
            return comm.all_reduce(x, (0, 1))
        return comm.all_gather(x, (0, 1), 0)

    with pytest.raises(CommError, match="while another member called"):
        run_spmd(2, fn, timeout=10)


# -- failures, deadlocks, timeouts -----------------------------------------------------------


def test_exception_is_reraised_with_rank_and_others_released():
    def fn(comm):
        if comm.rank == 2:
            raise ValueError("boom")
        return comm.all_reduce(np.ones(3), (0, 1, 2, 3))

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="boom") as info:
        run_spmd(4, fn, timeout=30)
    assert time.monotonic() - t0 < 5
    assert info.value.rank == 2
    assert any("rank 2 of 4" in note for note in info.value.__notes__)


def test_exception_while_peer_waits_in_recv():
    def fn(comm):
        if comm.rank == 0:
            comm.recv(np.empty(2), 1)
        else:
            raise KeyError("missing")

    with pytest.raises(KeyError) as info:
        run_spmd(2, fn, timeout=30)
    assert info.value.rank == 1


def test_secondary_aborts_are_not_reported():
    def fn(comm):
        if comm.rank == 1:
            time.sleep(0.05)
            raise RuntimeError("first")
        comm.barrier()

    with pytest.raises(RuntimeError, match="first") as info:
        run_spmd(3, fn, timeout=30)
    assert not isinstance(info.value, CommAborted)
    assert info.value.rank == 1


@pytest.mark.parametrize("kind", ["recv-recv", "send-send", "exited", "collective-subset"])
def test_deadlocks_are_detected_at_once(kind):
    def fn(comm):
        peer = 1 - comm.rank
        if kind == "recv-recv":
            comm.recv(np.empty(1), peer)
        elif kind == "send-send":
            comm.send(np.ones(1), peer)  # synchronous: never buffered
        elif kind == "exited":
            if comm.rank == 0:
                comm.all_reduce(np.ones(1), (0, 1))
        else:
            comm.all_gather(np.ones(1), (0, 1), 0)
            if comm.rank == 0:
                comm.all_gather(np.ones(1), (0, 1), 0)

    t0 = time.monotonic()
    with pytest.raises(DeadlockError, match="deadlock detected") as info:
        run_spmd(2, fn, timeout=30)
    assert isinstance(info.value, TimeoutError)
    assert time.monotonic() - t0 < 5


def test_timeout_when_a_rank_hangs_outside_the_communicator():
    release = threading.Event()

    def fn(comm):
        if comm.rank == 1:
            release.wait(30)  # busy elsewhere: not a detectable deadlock
        return comm.all_reduce(np.ones(1), (0, 1))

    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError) as info:
            run_spmd(2, fn, timeout=0.5)
    finally:
        release.set()
    assert time.monotonic() - t0 < 5
    assert "all_reduce" in str(info.value)
