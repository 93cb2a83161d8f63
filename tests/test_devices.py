"""Device sets as ranges (`hspmd.ir.devices`): every operation agrees with the same operation on the
listed ids (a brute-force NumPy model), the text round-trips, and a range costs O(1) in the
number of devices: a group of 65,536 devices is as cheap to check, print and split as one of 4.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd.ir.devices import DeviceRange, DeviceSetError, RankGroups, concat, parse_devices, parse_rank_groups
from hspmd.ir.layout import DUP, PARTIAL, DistributedStates, Group, Layout, gather, scatter, split
from hspmd.ir.layout_text import parse_layout


@st.composite
def boxes(draw, max_dims: int = 3):
    """Return (a range, its ids listed) for a random box with nested strides (gaps allowed)."""
    dims = draw(st.integers(1, max_dims))
    shape = [draw(st.integers(1, 4)) for _ in range(dims)]
    order = draw(st.permutations(list(range(dims))))
    strides = [0] * dims
    acc = draw(st.integers(1, 3))
    for k in order:  # minor first: each stride past the span of the smaller ones
        strides[k] = acc
        acc *= shape[k] * draw(st.sampled_from([1, 1, 2]))
    start = draw(st.integers(0, 6))
    ids = [start + sum(c * s for c, s in zip(cs, strides)) for cs in itertools.product(*map(range, shape))]
    return DeviceRange.box(start, shape, strides), ids


@settings(max_examples=200, deadline=None)
@given(boxes())
def test_a_range_is_its_ids(case):
    r, ids = case
    assert list(r) == ids and len(r) == len(ids) and r == tuple(ids) and hash(r) == hash(tuple(ids))
    assert DeviceRange.of(ids) == r  # listing the ids finds the same range
    assert [r[i] for i in range(len(ids))] == ids and r[-1] == ids[-1]
    assert r.array().tolist() == ids
    for d in range(max(ids) + 3):
        assert (d in r) == (d in ids)
        if d in ids:
            assert r.index(d) == ids.index(d)
    assert r.min == min(ids) and r.max == max(ids) and list(r.sorted()) == sorted(ids)


@settings(max_examples=200, deadline=None)
@given(boxes())
def test_the_text_reads_back_as_the_same_range(case):
    r, ids = case
    assert parse_devices(str(r)) == r
    assert parse_layout(f"{r.bracketed()}: dup={len(r)}").groups[0].devices == r


@settings(max_examples=150, deadline=None)
@given(boxes(), st.data())
def test_take_and_slices_are_the_picked_ids(case, data):
    r, ids = case
    picked = data.draw(st.lists(st.integers(0, len(ids) - 1), min_size=1, max_size=len(ids), unique=True))
    assert list(r.take(DeviceRange.of(picked))) == [ids[i] for i in picked]
    a = data.draw(st.integers(0, len(ids) - 1))
    b = data.draw(st.integers(a + 1, len(ids)))
    step = data.draw(st.integers(1, 3))
    assert list(r[a:b:step]) == ids[a:b:step]


def _factor(n: int, draw) -> list[int]:
    degrees, rest = [], n
    for f in (2, 3, 2, 2, 3, 2):
        if rest % f == 0 and draw(st.booleans()):
            degrees.append(f)
            rest //= f
    return draw(st.permutations(degrees + [rest]))


@settings(max_examples=200, deadline=None)
@given(boxes(), st.data())
def test_groups_along_a_mesh_axis_are_numpys(case, data):
    r, ids = case
    degrees = _factor(len(ids), data.draw)
    axis = data.draw(st.integers(0, len(degrees) - 1))
    groups = RankGroups.along(r, degrees, axis)
    want = np.moveaxis(np.array(ids).reshape(degrees), axis, -1).reshape(-1, degrees[axis])
    assert [list(g) for g in groups] == want.tolist() and groups == want.tolist()
    assert parse_rank_groups(str(groups)) == groups
    for d in ids:
        g, p = groups.group_of(d)
        assert want[g][p] == d and list(groups.group_holding(d)) == want[g].tolist()
    assert groups.group_of(max(ids) + 1) is None


@settings(max_examples=200, deadline=None)
@given(boxes(), boxes())
def test_set_relations_are_those_of_the_ids(a, b):
    (ra, ia), (rb, ib) = a, b
    assert ra.isdisjoint(rb) == (not set(ia) & set(ib))
    assert ra.issubset(rb) == (set(ia) <= set(ib))
    assert ra.same_set(rb) == (sorted(ia) == sorted(ib))
    if not set(ia) & set(ib):
        assert list(concat([ra, rb])) == ia + ib


def test_irregular_sets_stay_lists_and_bad_ones_are_refused():
    r = DeviceRange.of([5, 0, 1])
    assert not r.is_range and str(r) == "5,0,1" and r.index(0) == 1 and 1 in r and 2 not in r
    with pytest.raises(DeviceSetError, match="more than once"):
        DeviceRange.of([0, 1, 1])
    with pytest.raises(DeviceSetError, match="negative"):
        DeviceRange.of([-1, 0])
    with pytest.raises(DeviceSetError, match="repeats an id"):
        DeviceRange.box(0, (2, 2), (1, 1))
    with pytest.raises(DeviceSetError, match="hold different numbers"):
        parse_devices("[8]<=[2,2]")
    with pytest.raises(DeviceSetError, match="not a permutation"):
        parse_devices("[4]<=[2,2]T(0,0)")
    with pytest.raises(DeviceSetError, match="differ in size"):
        RankGroups.of([[0, 1], [2]])
    with pytest.raises(DeviceSetError, match="overlap"):
        RankGroups.of([[0, 1], [1, 2]])


def test_xla_forms_read_and_print():
    assert str(RankGroups.along(DeviceRange.iota(4096), (256, 16), 1)) == "[256,16]<=[4096]"
    assert str(RankGroups.along(DeviceRange.iota(4096), (256, 16), 0)) == "[16,256]<=[256,16]T(1,0)"
    assert list(parse_devices("[4]<=[2,2]T(1,0)*2+8")) == [8, 12, 10, 14]
    assert [list(g) for g in parse_rank_groups("[2,2]<=[4]+4")] == [[4, 5], [6, 7]]
    # small sets print as lists where that is shorter, large ones as ranges
    assert str(RankGroups.of([[0, 2], [1, 3]])) == "{0,2},{1,3}" and str(DeviceRange.of([0, 2])) == "0,2"
    assert str(DeviceRange.span(3, 8192, 8)) == "3-65531:8"


def test_a_group_of_65536_devices_is_never_listed(monkeypatch):
    """Checks, coordinates, sub-groups, slices and text of a range work without listing its ids."""
    def listed(*_):
        raise AssertionError("a range was listed")
    monkeypatch.setattr(DeviceRange, "__iter__", listed)
    monkeypatch.setattr(DeviceRange, "array", listed)
    n = 65536
    states = DistributedStates.of((split(0), n // 8), (DUP, 8))
    g = Group(DeviceRange.iota(n), states)
    lay = parse_layout(str(Layout((g,))))
    assert lay.groups[0] == g and str(lay) == "[0-65535]: split(0)=8192, dup=8"
    assert lay.slices(n - 1, (n, 4)) == (slice(n - 8, n), slice(0, 4)) and lay.local_shape(3, (n, 4)) == (8, 4)
    assert g.coords(n - 1) == {split(0): n // 8 - 1, DUP: 7}
    dp = g.mesh_groups(split(0))
    assert len(dp) == 8 and dp.size == n // 8 and str(dp) == "[8,8192]<=[8192,8]T(1,0)"
    assert dp.group_of(13) == (5, 1) and g.subgroup(13, DUP) == DeviceRange.span(8, 8)
    other = Layout((Group(DeviceRange.iota(n, n), states),))
    two = Layout((*lay.groups, *other.groups), DUP)
    assert two.num_devices == 2 * n and two.group_index(n + 5) == 1 and str(two.devices) == "0-131071"


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_layouts_over_ranges_scatter_as_over_lists(data):
    """The brute-force model gives every device the same piece whether its group is a range or the
    same ids listed (a permuted, strided set of devices)."""
    r, ids = data.draw(boxes(max_dims=2))
    n = len(ids)
    degrees = _factor(n, data.draw)
    kinds = data.draw(st.lists(st.sampled_from(["split0", "split1", "dup", "partial"]), min_size=len(degrees),
                               max_size=len(degrees), unique=True)) if len(degrees) <= 4 else None
    if kinds is None:
        return
    axes = {"split0": split(0), "split1": split(1), "dup": DUP, "partial": PARTIAL}
    states = DistributedStates(tuple((axes[k], d) for k, d in zip(kinds, degrees)))
    shape = (states.degree(split(0)) * 2, states.degree(split(1)) * 3)
    as_range = Layout((Group(r, states),))
    listed = Group(DeviceRange(ids[0], (), (), tuple(ids)) if n > 1 else r, states)
    as_list = Layout((listed,))
    x = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    a, b = scatter(as_range, x), scatter(as_list, x)
    assert a.keys() == b.keys() == set(ids)
    for d in ids:
        np.testing.assert_array_equal(a[d], b[d])
        assert as_range.slices(d, shape) == as_list.slices(d, shape)
    np.testing.assert_array_equal(gather(as_range, a, shape), x)
