"""Switch plans (`hspmd.ir.switch_plan`): every rank ends with exactly its new pieces, and the plan
moves exactly the elements a rank lacks (checked against a brute-force count over every element)."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hspmd.ir.layout import DUP, DistributedStates, Group, Layout, split
from hspmd.ir.switch_plan import SwitchError, box_subtract, overlap, plan_switch

N = 4  # ranks


def _states(n: int, shape: tuple[int, ...], draw) -> DistributedStates:
    """A random DistributedStates over n devices that fits `shape` (split dims divide evenly)."""
    axes = []
    left = n
    for dim, size in enumerate(shape):
        degrees = [k for k in range(2, left + 1) if left % k == 0 and size % k == 0]
        if degrees and draw(st.booleans()):
            k = draw(st.sampled_from(degrees))
            axes.append((split(dim), k))
            left //= k
    if left > 1:
        axes.append((DUP, left))
    order = draw(st.permutations(axes)) if axes else []
    return DistributedStates.of(*order) if order else DistributedStates()


@st.composite
def holdings(draw, shape: tuple[int, ...]):
    """Random regions per rank of a tensor of `shape`: one group over a subset of the ranks (as a
    pipeline stage holds its layers), or two groups as replicas or as unequal slices of dim 0."""
    ranks = draw(st.permutations(range(N)))
    kind = draw(st.sampled_from(["one", "dup", "split"] if shape and shape[0] >= 2 else ["one", "dup"]))
    if kind == "one":
        devices = tuple(ranks[:draw(st.integers(1, N))])
        layout = Layout.spmd(devices, _states(len(devices), shape, draw))
    else:
        cut = draw(st.integers(1, N - 1))
        a, b = tuple(ranks[:cut]), tuple(ranks[cut:])
        if kind == "dup":
            layout = Layout((Group(a, _states(len(a), shape, draw)), Group(b, _states(len(b), shape, draw))), DUP)
        else:
            shares = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
            layout = Layout((Group(a, DistributedStates.of((DUP, len(a)))),
                             Group(b, DistributedStates.of((DUP, len(b))))), split(0), shares)
    layout.check_shape(shape)
    return {d: tuple((s.start, s.stop) for s in layout.slices(d, shape)) for d in layout.devices}


def _cells(region) -> set[tuple[int, ...]]:
    return {tuple(a + i for (a, _), i in zip(region, idx)) for idx in np.ndindex(*[b - a for a, b in region])}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_plan_moves_exactly_what_each_rank_lacks(data):
    shape = data.draw(st.sampled_from([(), (6,), (4, 6), (8, 2, 3)]))
    before = data.draw(holdings(shape))
    after = data.draw(holdings(shape))
    plan = plan_switch({r: {"w": reg} for r, reg in before.items()}, {r: {"w": reg} for r, reg in after.items()},
                       {"w": (shape, 4)})
    # brute force: every element a rank needs after and did not hold before crosses once
    lacking = sum(len(_cells(need) - (_cells(before[r]) if r in before else set())) for r, need in after.items())
    assert plan.bytes_moved() == 4 * lacking
    # and carrying the plan out on real pieces gives every rank exactly its new piece
    value = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.float32).reshape(shape)
    pieces = {r: value[tuple(slice(a, b) for a, b in reg)] for r, reg in before.items()}
    for r, need in after.items():
        got = np.full([b - a for a, b in need], np.nan, np.float32)
        for t in plan.receives(r).get(r, []) + [t for s, ts in plan.receives(r).items() if s != r for t in ts]:
            src = before[t.src]
            got[tuple(slice(a - n0, b - n0) for (a, b), (n0, _) in zip(t.region, need))] = \
                pieces[t.src][tuple(slice(a - s0, b - s0) for (a, b), (s0, _) in zip(t.region, src))]
        np.testing.assert_array_equal(got, value[tuple(slice(a, b) for a, b in need)])
    assert plan.messages() == len({(t.src, t.dst) for t in plan.transfers if t.src != t.dst})


def test_replicated_to_split_moves_nothing():
    before = {r: {"w": ((0, 8), (0, 4))} for r in range(2)}
    after = {0: {"w": ((0, 4), (0, 4))}, 1: {"w": ((4, 8), (0, 4))}}
    plan = plan_switch(before, after, {"w": ((8, 4), 8)})
    assert plan.bytes_moved() == 0 and plan.messages() == 0


def test_pipeline_stages_to_data_parallel():
    """Stage 0 holds a, stage 1 holds b: each rank lacks the other's layer, one message each way."""
    before = {0: {"a": ((0, 3),)}, 1: {"b": ((0, 5),)}}
    after = {r: {"a": ((0, 3),), "b": ((0, 5),)} for r in range(2)}
    plan = plan_switch(before, after, {"a": ((3,), 4), "b": ((5,), 8)})
    assert plan.bytes_moved() == 3 * 4 + 5 * 8 and plan.messages() == 2


def test_nobody_holds_it():
    with pytest.raises(SwitchError, match="tensor 'w'.*rank 1 needs region"):
        plan_switch({0: {"w": ((0, 2),)}}, {1: {"w": ((0, 4),)}}, {"w": ((4,), 4)})


def test_box_subtract_covers_the_difference():
    a, b = ((0, 4), (0, 5)), ((1, 3), (2, 4))
    parts = box_subtract(a, b)
    cells = [c for p in parts for c in _cells(p)]
    assert len(cells) == len(set(cells)) == 20 - 4 and not set(cells) & _cells(b)
    assert overlap(((0, 2),), ((2, 4),)) is None
