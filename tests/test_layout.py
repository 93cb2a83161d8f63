"""Layout algebra against the brute-force NumPy model (scatter/gather), plus error messages.

The hypothesis strategies here (`states`, `layouts`, `shape_for`) are reused by the other
layout tests.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hspmd.ir.layout import (DUP, PARTIAL, Axis, DistributedStates, Group, Layout, LayoutError, apportion,
                             gather, scatter, split)

FAST = settings(max_examples=60, deadline=None)


# --------------------------------------------------------------------------------------
# Hypothesis strategies


@st.composite
def ordered_factors(draw, n: int, max_len: int) -> list[int]:
    """Draw degrees >= 2, in order, whose product is n, at most max_len of them."""
    out: list[int] = []
    while n > 1:
        if len(out) == max_len - 1:
            out.append(n)
            break
        d = draw(st.sampled_from([d for d in range(2, n + 1) if n % d == 0]))
        out.append(d)
        n //= d
    return out


@st.composite
def states(draw, ndim: int, n: int | None = None, max_devices: int = 8) -> DistributedStates:
    """Draw valid DistributedStates of n (or 1..max_devices) devices over a tensor of ndim dims."""
    if n is None:
        n = draw(st.integers(1, max_devices))
    roles = [split(d) for d in range(ndim)] + [DUP, PARTIAL]
    degrees = draw(ordered_factors(n, len(roles)))
    chosen = draw(st.permutations(roles))[: len(degrees)]
    return DistributedStates(tuple(zip(chosen, degrees)))


@st.composite
def layouts(draw, ndim: int, max_groups: int = 3, max_group_devices: int = 4) -> Layout:
    """Draw a valid Layout: 1..max_groups groups on distinct (permuted, gappy) device ids."""
    k = draw(st.integers(1, max_groups))
    sts = [draw(states(ndim, max_devices=max_group_devices)) for _ in range(k)]
    total = sum(s.num_devices for s in sts)
    ids = draw(st.lists(st.integers(0, total + 3), min_size=total, max_size=total, unique=True))
    groups, at = [], 0
    for s in sts:
        groups.append(Group(tuple(ids[at: at + s.num_devices]), s))
        at += s.num_devices
    hetero = draw(st.sampled_from([DUP, PARTIAL] + [split(d) for d in range(ndim)]))
    shares = None
    if hetero.kind == "split" and draw(st.booleans()):
        shares = tuple(draw(st.lists(st.integers(1, 3), min_size=k, max_size=k)))
    return Layout(tuple(groups), hetero, shares)


def shape_for(draw, lays: list[Layout], ndim: int, max_size: int = 4096) -> tuple[int, ...]:
    """Draw a shape that every layout in `lays` can hold (split dims divide, hetero shares exact)."""
    shape = []
    for d in range(ndim):
        unit = math.lcm(*(g.states.degree(split(d)) for lay in lays for g in lay.groups))
        for lay in lays:
            if lay.hetero == split(d):
                unit = math.lcm(unit, sum(lay.shares) * math.lcm(*(g.states.degree(split(d)) for g in lay.groups)))
        shape.append(unit * draw(st.integers(1, 2)))
    assume(math.prod(shape) <= max_size)
    return tuple(shape)


@st.composite
def laid_out(draw, max_groups: int = 3):
    """Draw (layout, shape) with the shape fitting the layout."""
    ndim = draw(st.integers(0, 3))
    lay = draw(layouts(ndim, max_groups=max_groups))
    return lay, shape_for(draw, [lay], ndim)


def ds(*pairs):
    return DistributedStates.of(*pairs)


# --------------------------------------------------------------------------------------
# Axis and DistributedStates


def test_axis_text_and_validation():
    assert (str(split(2)), str(DUP), str(PARTIAL)) == ("split(2)", "dup", "partial")
    assert split(1) == Axis("split", 1) and hash(split(1)) == hash(Axis("split", 1))
    for bad in (lambda: Axis("spilt", 0), lambda: Axis("split"), lambda: Axis("dup", 0), lambda: split(-1)):
        with pytest.raises(LayoutError):
            bad()


def test_states_canonical_form():
    a = ds((split(0), 2), (DUP, 1), (PARTIAL, 2))
    assert a.axes == ((split(0), 2), (PARTIAL, 2))
    assert a == DistributedStates.from_dict({split(0): 2, PARTIAL: 2, DUP: 1})
    assert str(DistributedStates()) == "dup=1" and DistributedStates().num_devices == 1
    assert str(a) == "split(0)=2, partial=2" and a.num_devices == 4 and a.is_partial
    assert a.degree(DUP) == 1 and a.split_dims == {0: 2}
    with pytest.raises(LayoutError, match="more than once"):
        ds((DUP, 2), (DUP, 2))
    with pytest.raises(LayoutError, match="degrees must be >= 1"):
        ds((DUP, 0))


def test_states_order_is_major_to_minor():
    # DESIGN example: dup=2, split(0)=2, order [dup, split(0)]
    s = ds((DUP, 2), (split(0), 2))
    assert [s.slices(i, (8,)) for i in range(4)] == [(slice(0, 4),), (slice(4, 8),)] * 2
    assert s.coords(2) == {DUP: 1, split(0): 0}
    assert s.subgroups(DUP) == ((0, 2), (1, 3)) and s.subgroups(split(0)) == ((0, 1), (2, 3))
    assert s.subgroup(3, DUP) == (1, 3) and s.subgroup(3, PARTIAL) == (3,)


def test_states_local_shape_errors():
    s = ds((split(1), 2))
    assert s.local_shape((10, 4)) == (10, 2)
    with pytest.raises(LayoutError, match=r"shape \(10, 3\) cannot be laid out as 'split\(1\)=2': dim 1 \(size 3\)"):
        s.local_shape((10, 3))
    with pytest.raises(LayoutError, match="names dim 1 but the tensor has 1 dims"):
        s.local_shape((10,))
    with pytest.raises(LayoutError, match="out of range"):
        s.coords(2)


@FAST
@given(st.integers(0, 3).flatmap(lambda nd: states(nd)))
def test_coords_index_of_inverse_and_subgroups_partition(s):
    n = s.num_devices
    for i in range(n):
        assert s.index_of(s.coords(i)) == i
    assert len({tuple(sorted(s.coords(i).items(), key=str)) for i in range(n)}) == n
    for axis, deg in s.axes:
        sgs = s.subgroups(axis)
        assert sorted(i for sg in sgs for i in sg) == list(range(n))
        assert [sg[0] for sg in sgs] == sorted(sg[0] for sg in sgs)
        for sg in sgs:
            assert len(sg) == deg and [s.coords(i)[axis] for i in sg] == list(range(deg))
            for i in sg:
                assert s.subgroup(i, axis) == sg
                others = {a: c for a, c in s.coords(i).items() if a != axis}
                assert others == {a: c for a, c in s.coords(sg[0]).items() if a != axis}


# --------------------------------------------------------------------------------------
# Group and Layout


def test_group_validation():
    with pytest.raises(LayoutError, match=r"group '\[0-2\]: split\(0\)=2' lists 3 devices but its degrees multiply to 2"):
        Group((0, 1, 2), ds((split(0), 2)))
    with pytest.raises(LayoutError, match="more than once"):
        Group((1, 1), ds((DUP, 2)))
    assert Group([3, 4], ds((DUP, 2))).devices == (3, 4)


def test_layout_validation_and_normalisation():
    g01, g2 = Group((0, 1), ds((DUP, 2))), Group((2,), DistributedStates())
    with pytest.raises(LayoutError, match="puts device 1 in groups 0 and 1"):
        Layout((g01, Group((1,), DistributedStates())))
    with pytest.raises(LayoutError, match="shares need hetero=split"):
        Layout((g01, g2), DUP, (1, 1))
    with pytest.raises(LayoutError, match="has 2 groups but shares 1"):
        Layout((g01, g2), split(0), (1,))
    with pytest.raises(LayoutError):
        Layout(())
    assert Layout((g01, g2), split(0)).shares == (1, 1)
    assert Layout((g01, g2), split(0), (6, 2)) == Layout((g01, g2), split(0), (3, 1))
    one = Layout((g01,), PARTIAL)
    assert one.hetero == DUP and one.shares is None and one == Layout.spmd((0, 1), ds((DUP, 2)))
    assert Layout.replicated([5, 6]).groups == (Group((5, 6), ds((DUP, 2))),)


def test_layout_queries():
    lay = Layout((Group((4, 5), ds((split(1), 2))), Group((0,), DistributedStates())), split(0), (3, 1))
    assert lay.devices == (4, 5, 0) and lay.num_devices == 3
    assert lay.group_index(0) == 1
    assert lay.group_extent(0, (8, 4)) == (slice(0, 6), slice(0, 4))
    assert lay.group_shape(1, (8, 4)) == (2, 4)
    assert lay.local_shape(5, (8, 4)) == (6, 2)
    assert lay.slices(5, (8, 4)) == (slice(0, 6), slice(2, 4))
    assert lay.slices(0, (8, 4)) == (slice(6, 8), slice(0, 4))
    assert not lay.holds_partial(4)
    with pytest.raises(LayoutError, match="device 7 is not in layout"):
        lay.group_index(7)
    part = Layout((Group((0,), DistributedStates()), Group((1, 2), ds((PARTIAL, 2)))), PARTIAL)
    assert part.holds_partial(0) and part.holds_partial(2)


def test_check_shape_message():
    lay = Layout.spmd((0, 1), ds((split(1), 2)))
    with pytest.raises(LayoutError) as err:
        lay.check_shape((10, 3), "tensor 'fc1.weight'")
    assert str(err.value) == ("tensor 'fc1.weight' of shape (10, 3) cannot be laid out as "
                              "'[0,1]: split(1)=2': dim 1 (size 3) is not divisible by 2")
    het = Layout((Group((0, 1), ds((split(0), 2))), Group((2,), DistributedStates())), split(0), (1, 1))
    with pytest.raises(LayoutError, match=r"dim 0 of group 0 \(size 5\) is not divisible by 2"):
        het.check_shape((10,))
    with pytest.raises(LayoutError, match=r"hetero split\(0\) names dim 0 but the tensor has 0 dims"):
        het.check_shape(())


def test_apportion_examples():
    assert apportion(10, (3, 1)) == (8, 2)
    assert apportion(5, (1, 1, 1)) == (2, 2, 1)
    assert apportion(0, (2, 5)) == (0, 0)
    with pytest.raises(LayoutError):
        apportion(3, (1, 0))


@FAST
@given(st.integers(0, 1000), st.lists(st.integers(1, 20), min_size=1, max_size=6))
def test_apportion_property(total, shares):
    parts = apportion(total, shares)
    assert sum(parts) == total and len(parts) == len(shares)
    for p, s in zip(parts, shares):
        assert abs(p - total * s / sum(shares)) < 1
    assert apportion(total, [3 * s for s in shares]) == parts


# --------------------------------------------------------------------------------------
# The brute-force model


@settings(max_examples=120, deadline=None)
@given(laid_out(), st.integers(0, 2**32 - 1), st.booleans())
def test_scatter_gather_model(case, seed, random_partials):
    lay, shape = case
    a = np.random.default_rng(seed).standard_normal(shape)
    pieces = scatter(lay, a, np.random.default_rng(seed + 1) if random_partials else None)
    assert set(pieces) == set(lay.devices)
    np.testing.assert_allclose(gather(lay, pieces, shape), a, atol=1e-9)
    cover: Counter = Counter()
    for dev, piece in pieces.items():
        assert piece.shape == lay.local_shape(dev, shape)
        sl = lay.slices(dev, shape)
        assert tuple(s.stop - s.start for s in sl) == piece.shape
        if not lay.holds_partial(dev):
            np.testing.assert_array_equal(piece, a[sl])
            cover.update(tuple(s.start + i for s, i in zip(sl, idx)) for idx in np.ndindex(*piece.shape))
    if not any(lay.holds_partial(d) for d in lay.devices):
        # every element is held exactly (number of replicas of its group, times replica groups) times
        for idx in np.ndindex(*shape):
            want = sum(g.states.degree(DUP) for gi, g in enumerate(lay.groups)
                       if all(s.start <= i < s.stop for s, i in zip(lay.group_extent(gi, shape), idx)))
            assert cover[idx] == want


def test_scatter_without_rng_puts_value_on_first_replica():
    lay = Layout((Group((3,), DistributedStates()), Group((1, 2), ds((PARTIAL, 2)))), PARTIAL)
    a = np.arange(6.0).reshape(2, 3)
    p = scatter(lay, a)
    np.testing.assert_array_equal(p[3], a)
    assert not p[1].any() and not p[2].any()


def test_gather_rejects_disagreeing_replicas_and_bad_pieces():
    lay = Layout.spmd((0, 1), ds((DUP, 2)))
    with pytest.raises(LayoutError, match="disagrees"):
        gather(lay, {0: np.zeros(3), 1: np.ones(3)}, (3,))
    with pytest.raises(LayoutError, match="no piece for devices 1"):
        gather(lay, {0: np.zeros(3)}, (3,))
    with pytest.raises(LayoutError, match=r"shape \(2,\)"):
        gather(lay, {0: np.zeros(2), 1: np.zeros(2)}, (3,))
    het = Layout((Group((0,), DistributedStates()), Group((1,), DistributedStates())), DUP)
    with pytest.raises(LayoutError, match="group 1 disagrees"):
        gather(het, {0: np.zeros(3), 1: np.ones(3)}, (3,))


def test_scatter_integer_partials_sum_exactly():
    lay = Layout.spmd(range(4), ds((PARTIAL, 2), (split(0), 2)))
    a = np.arange(8).reshape(4, 2)
    p = scatter(lay, a, np.random.default_rng(0))
    assert p[0].dtype == a.dtype
    np.testing.assert_array_equal(gather(lay, p, a.shape), a)


@FAST
@given(laid_out())
def test_layouts_are_hashable_values(case):
    lay, _ = case
    same = Layout(tuple(Group(tuple(g.devices), DistributedStates(g.states.axes)) for g in lay.groups),
                  lay.hetero, lay.shares)
    assert same == lay and hash(same) == hash(lay) and {lay: 1}[same] == 1
