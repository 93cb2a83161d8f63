"""Parameter servers without MPI: strategy keys, range assignment, clocks, the update step, the cache."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import EXAMPLES
from hspmd.ir.ps_plan import PSPlan, assign_by_bytes
from hspmd.ir.strategy import StrategyError, parse_strategy
from hspmd.runtime.ps.cache import RowCache
from hspmd.runtime.ps.clocks import Clocks
from hspmd.runtime.ps.server import _sum_rows


def test_strategy_keys_parse_print_and_check():
    g = parse_strategy("[0,1]: dp=2 comm=hybrid consistency=ssp:2 cache=5000").groups[0]
    assert (g.comm, g.consistency, g.cache, g.staleness_bound) == ("hybrid", "ssp:2", 5000, 2)
    assert str(g) == "[0,1]: dp=2 comm=hybrid consistency=ssp:2 cache=5000"
    assert parse_strategy("[0,1]: dp=2 comm=ps").groups[0].staleness_bound == 0
    assert parse_strategy("[0,1]: dp=2 comm=ps consistency=asp").groups[0].staleness_bound is None
    assert str(parse_strategy("[0,1]: dp=2")) == "[0,1]: dp=2"  # defaults are not printed
    g = parse_strategy("[0,1]: comm=ps consistency=asp cache=100:8").groups[0]
    assert (g.cache_rows, g.cache_bound, str(g)) == (100, 8, "[0,1]: dp=2 comm=ps consistency=asp cache=100:8")


@pytest.mark.parametrize("text,words", [
    ("[0,1]: comm=rdma", "not a communication mode"),
    ("[0,1]: comm=ps consistency=ssp", "ssp takes its staleness bound"),
    ("[0,1]: comm=ps consistency=bsp:1", "bsp/asp take none"),
    ("[0,1]: consistency=asp", "need parameter servers"),
    ("[0,1]: cache=10", "need parameter servers"),
    ("[0,1]: comm=ps consistency=asp cache=10", "cache=ROWS:B"),
    ("[0,1]: comm=ps cache=10:2:3", "ROWS or ROWS:B"),
    ("[0,1]: comm=ps tp=2", "data parallelism only"),
    ("[0,1]: dp=ps", "takes a number"),
])
def test_bad_communication_keys_say_why(text, words):
    with pytest.raises(StrategyError, match=words):
        parse_strategy(text)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=12), servers=st.integers(1, 5))
def test_assign_by_bytes_gives_contiguous_ranges_to_every_server_it_can(sizes, servers):
    names = [(f"p{i}", b) for i, b in enumerate(sizes)]
    homes = assign_by_bytes(names, servers)
    order = [homes[n] for n, _ in names]
    assert order == sorted(order) and order[0] == 0  # contiguous ranges, in order
    assert set(order) == set(range(min(servers, len(sizes))))  # no server idle while a parameter is left
    assert all(b - a <= 1 for a, b in zip(order, order[1:]))


def test_assign_by_bytes_balances():
    homes = assign_by_bytes([(str(i), 100) for i in range(8)], 4)
    assert [list(homes.values()).count(s) for s in range(4)] == [2, 2, 2, 2]


def test_plan_round_trips_through_json():
    plan = PSPlan(2, 1, "hybrid", "ssp:2", 2, cache_rows=100, cache_bound=4, homes={"emb": 0}, tables={"emb": "ids"},
                  batch_rows=256)
    assert PSPlan.from_json(plan.to_json()) == plan


@settings(max_examples=80, deadline=None)
@given(workers=st.integers(1, 4), bound=st.integers(0, 3), steps=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_ssp_never_admits_more_staleness_than_its_bound_and_never_deadlocks(workers, bound, steps, seed):
    """Random schedules of workers that pull, then push, `steps` times under SSP:bound."""
    rng = np.random.default_rng(seed)
    clocks = Clocks(workers, bound)
    next_step = [1] * workers
    pulled = [False] * workers
    while any(s <= steps for s in next_step):
        ready = [w for w in range(workers) if next_step[w] <= steps and (pulled[w] or clocks.admits(next_step[w]))]
        assert ready, "every unfinished worker waits: deadlock"
        w = int(rng.choice(ready))
        if not pulled[w]:
            assert clocks.staleness(next_step[w]) <= bound
            pulled[w] = True
        else:
            clocks.tick(w)
            pulled[w] = False
            next_step[w] += 1
            if next_step[w] > steps:
                clocks.retire(w)


def test_bsp_admits_a_step_only_once_everyone_pushed_the_one_before():
    c = Clocks(3, 0)
    assert c.admits(1) and not c.admits(2)
    c.tick(0), c.tick(1)
    assert not c.admits(2)
    c.retire(2)  # a worker gone no longer holds the others back
    assert c.admits(2)


def test_asp_admits_everything():
    c = Clocks(2, None)
    for _ in range(10):
        c.tick(0)
    assert c.admits(11) and c.staleness(11) == 10


def test_rows_sum_in_order_and_divide():
    rows, grads = _sum_rows(np.array([3, 1, 3]), np.array([[1.0], [2.0], [4.0]], np.float32), 2)
    assert rows.tolist() == [1, 3] and grads.ravel().tolist() == [1.0, 2.5]


def test_cache_bounds_staleness_and_owes_every_gradient():
    cache = RowCache(capacity=2, bound=1, shape=(10, 1), dtype=np.float32)
    rows = np.array([1, 2, 3])
    assert cache.missing(rows, 1).tolist() == [1, 2, 3]
    cache.store(rows, 1)  # 3 rows, capacity 2: one evicted
    assert cache.cached.sum() == 2
    pushed = {}
    total = 0.0
    for step in range(1, 6):
        need = cache.missing(rows, step)
        cache.store(need, step)
        assert all(step - cache.fetched[r] <= 1 for r in rows if cache.cached[r])
        r, g = cache.accumulate(rows, np.ones((3, 1), np.float32), step)
        total += 3
        for row, v in zip(r, g.ravel()):
            pushed[row] = pushed.get(row, 0.0) + v
    r, g = cache.flush()
    for row, v in zip(r, g.ravel()):
        pushed[row] = pushed.get(row, 0.0) + v
    assert sum(pushed.values()) == total  # nothing lost, nothing twice


def test_update_step_on_rows_equals_the_dense_update():
    """SGD on a table: the update of the touched rows equals the dense update of a scattered gradient."""
    from hspmd.compiler import update_program
    from hspmd.frontend.optim import SGD
    from hspmd.runtime.ps.update import UpdateStep
    from xdsl.dialects.builtin import TensorType, f32

    module = update_program([("emb", "normal:1.0", TensorType(f32, (6, 3)))], SGD(lr=0.1))
    sparse = UpdateStep(str(module), "<test>", {"emb"})
    dense = UpdateStep(str(module), "<test>")
    a, b = sparse.initial_state(0), dense.initial_state(0)
    rows = np.array([0, 4])
    g = np.arange(6, dtype=np.float32).reshape(2, 3)
    full = np.zeros((6, 3), np.float32)
    full[rows] = g
    sparse.apply(a, {"emb": (rows, g)}, {})
    dense.apply(b, {"emb": (None, full)}, {})
    np.testing.assert_array_equal(a["emb"], b["emb"])


def test_compile_ps_finds_the_tables_and_rejects_what_it_cannot_serve():
    from hspmd.compiler import compile_ps
    from hspmd.frontend.script import load_script

    compiled = compile_ps(load_script(os.path.join(EXAMPLES, "ctr.py")), "[0,1]: dp=2 comm=hybrid", 2)
    assert compiled.plan.tables == {"embedding.weight": "ids", "wide.weight": "ids"}
    assert set(compiled.plan.homes) == {"embedding.weight", "wide.weight"}
    assert sorted(compiled.plan.homes.values()) == [0, 1]
    assert compiled.dense_update is not None
    with pytest.raises(Exception, match="has none"):
        compile_ps(load_script(os.path.join(EXAMPLES, "mlp.py")), "[0,1]: dp=2 comm=hybrid", 1)


def test_compiling_a_served_strategy_alone_points_at_hspmd_run_servers():
    from hspmd.compiler import compile_script
    from hspmd.frontend.script import load_script

    with pytest.raises(StrategyError, match="--servers K"):
        compile_script(load_script(os.path.join(EXAMPLES, "mlp.py")), "[0,1]: dp=2 comm=ps", 2)


def _plan(comm="ps", consistency="ssp:2", bound=2):
    from hspmd.ir.ps_plan import PSPlan

    return PSPlan(workers=2, servers=1, comm=comm, consistency=consistency, bound=bound)


def _end(rank, code, stopped=False):
    from hspmd.runtime.launcher.watch import RankEnd

    return RankEnd(rank, "host", 100 + rank, code, stopped)


def test_a_lost_worker_stops_only_runs_that_need_every_worker():
    from hspmd.runtime.ps.faults import stops_the_run

    dead_worker, dead_server, failed = _end(1, -9), _end(2, -9), _end(0, 1)
    assert not stops_the_run(_plan(), dead_worker)  # ssp: the others go on
    assert not stops_the_run(_plan(consistency="asp", bound=None), dead_worker)
    assert stops_the_run(_plan(consistency="bsp", bound=0), dead_worker)
    assert stops_the_run(_plan(comm="hybrid"), dead_worker)
    assert all(stops_the_run(p, e) for p in (_plan(), _plan(comm="hybrid")) for e in (dead_server, failed))


def test_the_outcome_of_a_run_that_lost_a_rank():
    from hspmd.runtime.ps.faults import outcome
    from hspmd.runtime.launcher.watch import WatchedRun

    survived = WatchedRun(137, (_end(0, 0), _end(1, -9), _end(2, 0)))
    assert outcome(_plan(), survived) == (0, None)
    code, message = outcome(_plan(consistency="bsp", bound=0), WatchedRun(143, (_end(0, -15, True), _end(1, -9),
                                                                               _end(2, -15, True))))
    assert code == 1 and message.startswith("worker 1 (rank 1) was lost (it died: SIGKILL)")
    code, message = outcome(_plan(), WatchedRun(143, (_end(0, -15, True), _end(1, -15, True), _end(2, -9))))
    assert code == 1 and message.startswith("server 0 (rank 2) died (SIGKILL)")
    assert outcome(_plan(), WatchedRun(1, (_end(0, 1), _end(1, -15, True), _end(2, -15, True)))) == (1, None)
    assert outcome(_plan(), WatchedRun(0, (_end(0, 0), _end(1, 0), _end(2, 0)))) == (0, None)
    code, message = outcome(_plan(), WatchedRun(137, (_end(0, -9), _end(1, -9), _end(2, 0))))
    assert code == 1 and message.startswith("every worker was lost")


@given(st.integers(1, 7), st.integers(1, 30), st.integers(0, 10), st.lists(st.integers(0, 40), max_size=30))
@settings(max_examples=60, deadline=None)
def test_a_server_writes_each_checkpoint_step_once_as_the_clocks_pass_it(every, steps, start, clocks):
    from hspmd.runtime.ps.checkpoints import PSCheckpoints

    ck = PSCheckpoints.__new__(PSCheckpoints)  # the schedule alone, no writer
    ck.every, ck.steps, ck.saved = every, steps, min(start, steps)
    written = []
    for clock in sorted(clocks):  # the slowest worker's clock only grows
        step = ck.due(min(clock, steps))
        if step is not None:
            written.append(step)
            ck.saved = step
    assert written == sorted(set(written)) and all(s > min(start, steps) for s in written)
    assert all(s % every == 0 or s == steps for s in written)
    top = min(max(clocks, default=0), steps)
    due = [s for s in range(min(start, steps) + 1, top + 1) if s % every == 0 or s == steps]
    assert (written[-1:] == due[-1:]) if due else not written  # the newest passed is always written


# ----------------------------------------------------------------------------- bursty stragglers (issue 31)


def test_burst_schedules_slow_about_a_third_of_the_steps_in_bursts_of_one_or_two():
    from hspmd.runtime.ps.bursts import BurstSchedule

    runs = []
    for rank in range(2):
        b = BurstSchedule(3.0, seed=11, rank=rank)
        marks = "".join("x" if b.slowed(s) else "." for s in range(1, 3001))
        assert 0.28 < marks.count("x") / len(marks) < 0.38, marks.count("x")
        bursts = [len(r) for r in marks.split(".") if r]
        assert set(bursts) == {1, 2}  # a burst is 1 or 2 steps, and a normal step follows it
        again = BurstSchedule(3.0, seed=11, rank=rank)
        assert "".join("x" if again.slowed(s) else "." for s in range(1, 3001)) == marks  # seeded
        assert b.extra_seconds(marks.index("x") + 1, 0.01) == pytest.approx(0.02)  # 3x: 2x more
        assert b.extra_seconds(marks.index(".") + 1, 0.01) == 0.0
        runs.append(marks)
    assert runs[0] != runs[1]  # each worker its own schedule


@pytest.mark.parametrize("text", ["3", "x:1", "0.5:1", "3:y"])
def test_malformed_slow_bursts_is_one_error(text):
    from hspmd.runtime.ps.bursts import parse_bursts

    with pytest.raises(ValueError, match="expected FACTOR:SEED"):
        parse_bursts(text)
