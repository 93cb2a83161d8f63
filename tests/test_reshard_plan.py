"""Reshard plans: every plan, run on the NumPy simulator, lands exactly on the destination layout."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hspmd.ir.layout import DUP, PARTIAL, DistributedStates, Group, Layout, LayoutError, gather, scatter, split
from hspmd.ir.layout_text import parse_layout
from hspmd.ir.reshard_plan import CommStep, plan_transition, simulate
from test_layout import shape_for, states


def plan(src: str, dst: str) -> list[str]:
    return [str(s) for s in plan_transition(parse_layout(src), parse_layout(dst))]


def check(src: Layout, dst: Layout, a: np.ndarray, rng: np.random.Generator | None = None) -> None:
    """Assert the plan from src to dst moves scatter(src, a) onto dst's pieces of a."""
    out = simulate(plan_transition(src, dst, a.shape), scatter(src, a, rng))
    assert set(out) == set(dst.devices)
    for dev, piece in out.items():
        assert piece.shape == dst.local_shape(dev, a.shape)
        if not dst.holds_partial(dev):
            np.testing.assert_allclose(piece, a[dst.slices(dev, a.shape)], atol=1e-9)
    np.testing.assert_allclose(gather(dst, out, a.shape), a, atol=1e-9)


# --------------------------------------------------------------------------------------
# Steps and simulator


def test_simulator_semantics():
    x = {r: np.array([[10.0 * r, 10.0 * r + 1]]) for r in range(4)}   # rank r holds [[10r, 10r+1]]
    g = ((0, 1), (2, 3))
    out = simulate([CommStep("all_reduce", g)], x)
    np.testing.assert_array_equal(out[1], [[10, 12]])
    out = simulate([CommStep("all_gather", ((1, 0), (2, 3)), dim=0)], x)
    np.testing.assert_array_equal(out[0], [[10, 11], [0, 1]])
    out = simulate([CommStep("reduce_scatter", g, dim=1)], x)
    np.testing.assert_array_equal(out[0], [[10]]), np.testing.assert_array_equal(out[1], [[12]])
    out = simulate([CommStep("local_split", ((3, 2),), dim=1)], x)
    np.testing.assert_array_equal(out[3], [[30]]), np.testing.assert_array_equal(out[2], [[21]])
    np.testing.assert_array_equal(out[0], x[0])  # ranks in no group keep their piece
    out = simulate([CommStep("local_zero", ((1, 0),))], x)
    np.testing.assert_array_equal(out[1], x[1]), np.testing.assert_array_equal(out[0], [[0, 0]])
    out = simulate([CommStep("all_to_all", g, dim=1, src_dim=0)], x)
    np.testing.assert_array_equal(out[0], [[0], [10]]), np.testing.assert_array_equal(out[1], [[1], [11]])
    assert x[0].tolist() == [[0, 1]]  # inputs untouched


def test_comm_step_validation_and_text():
    assert str(CommStep("all_to_all", ((0, 1),), dim=1, src_dim=0)) == "all_to_all(dim=1, src_dim=0) [0,1]"
    assert str(CommStep("all_reduce", ((0, 1), (2, 3)))) == "all_reduce() [0,1] [2,3]"
    for bad in (dict(kind="broadcast", groups=((0,),)), dict(kind="all_gather", groups=((0, 1),)),
                dict(kind="all_reduce", groups=((0, 1),), dim=0), dict(kind="all_reduce", groups=((0, 1), (1,))),
                dict(kind="all_to_all", groups=((0, 1),), dim=0), dict(kind="all_to_all", groups=((0, 1),), dim=0,
                                                                          src_dim=0)):
        with pytest.raises(ValueError):
            CommStep(**bad)
    with pytest.raises(ValueError, match="equal chunks"):
        simulate([CommStep("local_split", ((0, 1),), dim=0)], {0: np.zeros(3), 1: np.zeros(3)})


# --------------------------------------------------------------------------------------
# Plans


def test_per_axis_plans():
    assert plan("[0-3]: split(0)=2, dup=2", "[0-3]: split(0)=2, dup=2") == []
    assert plan("[0,1]: partial=2", "[0,1]: dup=2") == ["all_reduce() [0,1]"]
    assert plan("[0,1]: partial=2", "[0,1]: split(1)=2") == ["reduce_scatter(dim=1) [0,1]"]
    assert plan("[0,1]: split(0)=2", "[0,1]: dup=2") == ["all_gather(dim=0) [0,1]"]
    assert plan("[0,1]: dup=2", "[0,1]: split(0)=2") == ["local_split(dim=0) [0,1]"]
    assert plan("[0,1]: dup=2", "[0,1]: partial=2") == ["local_zero() [0,1]"]
    assert plan("[0,1]: split(0)=2", "[0,1]: split(1)=2") == ["all_to_all(dim=1, src_dim=0) [0,1]"]
    # mesh axes: dup is major ([0,2] [1,3] vary it), split(0) minor
    assert plan("[0-3]: dup=2, split(0)=2", "[0-3]: partial=2, split(1)=2") == \
        ["all_to_all(dim=1, src_dim=0) [0,1] [2,3]", "local_zero() [0,2] [1,3]"]
    # pieces shrink before they move: the local split goes before the all_reduce
    assert plan("[0-3]: partial=2, dup=2", "[0-3]: dup=2, split(0)=2") == \
        ["local_split(dim=0) [0,1] [2,3]", "all_reduce() [0,2] [1,3]"]


def test_swapping_split_dims_breaks_the_cycle_through_dup():
    src, dst = "[0-3]: split(0)=2, split(1)=2", "[0-3]: split(1)=2, split(0)=2"
    assert plan(src, dst) == ["all_gather(dim=0) [0,2] [1,3]", "all_to_all(dim=0, src_dim=1) [0,1] [2,3]",
                              "local_split(dim=1) [0,2] [1,3]"]
    a = np.arange(4 * 6.0).reshape(4, 6)  # dim 1 (6) is divisible by 2 but not by 4: no nested cuts allowed
    check(parse_layout(src), parse_layout(dst), a)


def test_moving_a_split_between_mesh_axes_waits_for_the_dim_to_be_free():
    src, dst = "[0-3]: split(0)=2, dup=2", "[0-3]: dup=2, split(0)=2"
    assert plan(src, dst) == ["all_gather(dim=0) [0,2] [1,3]", "local_split(dim=0) [0,1] [2,3]"]
    check(parse_layout(src), parse_layout(dst), np.arange(6.0))


def test_fallback_through_replicas():
    # different degree sequences
    assert plan("[0-3]: split(0)=4", "[0-3]: split(0)=2, partial=2") == \
        ["all_gather(dim=0) [0,1,2,3]", "local_split(dim=0) [0,2] [1,3]", "local_zero() [0,1] [2,3]"]
    # same devices in another order
    assert plan("[0,1]: partial=2", "[1,0]: split(0)=2") == \
        ["all_reduce() [0,1]", "local_split(dim=0) [1,0]"]
    a = np.arange(8.0)
    check(parse_layout("[0,1]: partial=2"), parse_layout("[1,0]: split(0)=2"), a, np.random.default_rng(1))


def test_a_refinement_of_the_mesh_keeps_per_axis_steps():
    """[4] and [2, 2] refine to one mesh: tokens split 4 ways over dp*ep move into the experts'
    layout (and back) by one all-to-all inside each ep pair, not by gathering everything."""
    tokens, experts = "[0-3]: split(1)=4", "[0-3]: split(1)=2, split(0)=2"
    assert plan(tokens, experts) == ["all_to_all(dim=0, src_dim=1) [0,1] [2,3]"]
    assert plan(experts, tokens) == ["all_to_all(dim=1, src_dim=0) [0,1] [2,3]"]
    a = np.arange(4.0 * 8 * 3).reshape(4, 8, 3)
    check(parse_layout(tokens), parse_layout(experts), a)
    check(parse_layout(experts), parse_layout(tokens), a)
    # nested splits that would come out in the wrong order fall back to replicas
    assert plan(tokens, "[0-3]: split(0)=2, split(1)=2")[0] == "all_gather(dim=1) [0,1,2,3]"


def test_a_refinement_keeps_a_partial_axis_that_both_sides_share():
    """Row-parallel expert outputs (partial over tp) go back to the tokens' layout by one
    all-to-all inside each ep pair, still partial over tp (the combine reduces them later)."""
    experts, tokens = "[0-7]: split(1)=2, split(0)=2, partial=2", "[0-7]: split(1)=4, partial=2"
    assert plan(experts, tokens) == ["all_to_all(dim=1, src_dim=0) [0,2] [1,3] [4,6] [5,7]"]
    a = np.arange(4.0 * 8 * 3).reshape(4, 8, 3)
    check(parse_layout(experts), parse_layout(tokens), a, np.random.default_rng(2))
    check(parse_layout(tokens), parse_layout(experts), a, np.random.default_rng(3))
    # the destination replicates the partial axis: the same all-to-all, then an all-reduce along it
    assert plan(experts, "[0-7]: split(1)=4, dup=2") == ["all_to_all(dim=1, src_dim=0) [0,2] [1,3] [4,6] [5,7]",
                                                         "all_reduce() [0,1] [2,3] [4,5] [6,7]"]
    check(parse_layout(experts), parse_layout("[0-7]: split(1)=4, dup=2"), a, np.random.default_rng(4))
    # ... or splits it: reduce-scatter where the plan cuts it
    assert plan(experts, "[0-7]: split(1)=4, split(2)=2") == ["reduce_scatter(dim=2) [0,1] [2,3] [4,5] [6,7]",
                                                              "all_to_all(dim=1, src_dim=0) [0,2] [1,3] [4,6] [5,7]"]
    a = np.arange(4.0 * 8 * 4).reshape(4, 8, 4)
    check(parse_layout(experts), parse_layout("[0-7]: split(1)=4, split(2)=2"), a, np.random.default_rng(5))
    # the gradient of the experts' input: the all-to-all must go first (a cut of dim 0 first would
    # leave the expert split with no way out), then the reduce-scatter
    assert plan(experts, "[0-7]: split(1)=4, split(0)=2") == ["all_to_all(dim=1, src_dim=0) [0,2] [1,3] [4,6] [5,7]",
                                                              "reduce_scatter(dim=0) [0,1] [2,3] [4,5] [6,7]"]
    check(parse_layout(experts), parse_layout("[0-7]: split(1)=4, split(0)=2"), a, np.random.default_rng(6))


def test_heterogeneous_transitions_are_not_supported_yet():
    with pytest.raises(NotImplementedError, match="heterogeneous resharding is not supported yet"):
        plan("[0,1]: dup=2", "[0]: dup=1 | [1]: dup=1 ; hetero=dup")
    with pytest.raises(NotImplementedError, match="heterogeneous resharding is not supported yet"):
        plan("[0,1]: dup=2", "[0,2]: dup=2")


@st.composite
def transitions(draw):
    """Draw (src, dst, shape): single-group layouts on the same devices, often on the same mesh."""
    ndim = draw(st.integers(1, 3))
    n = draw(st.integers(1, 8))
    sds = draw(states(ndim, n=n))
    if draw(st.booleans()):  # same mesh: same degrees, new roles
        roles = draw(st.permutations([split(d) for d in range(ndim)] + [DUP, PARTIAL]))
        dds = DistributedStates(tuple(zip(roles, (d for _, d in sds.axes))))
    else:
        dds = draw(states(ndim, n=n))
    devices = draw(st.permutations(range(n)))
    ddevices = devices if draw(st.booleans()) else draw(st.permutations(range(n)))
    src, dst = Layout.spmd(devices, sds), Layout.spmd(ddevices, dds)
    return src, dst, shape_for(draw, [src, dst], ndim)


@settings(max_examples=300, deadline=None)
@given(transitions(), st.integers(0, 2**32 - 1))
def test_plans_land_on_the_destination(case, seed):
    src, dst, shape = case
    rng = np.random.default_rng(seed)
    check(src, dst, rng.standard_normal(shape), rng)
    if src == dst:
        assert plan_transition(src, dst) == ()


# --------------------------------------------------------------------------------------
# Heterogeneous unions: partial or split across groups -> replicated everywhere


def test_hetero_partial_to_replicated_plans():
    dst = "[0,1]: dup=2 | [2]: dup=1 ; hetero=dup"
    # every device's piece counts once in the sum: one flat all_reduce is exact
    assert plan("[0,1]: partial=2 | [2]: dup=1 ; hetero=partial", dst) == ["all_reduce() [0,1,2]"]
    # a replica inside a group would be counted twice: zero it on all but one member first
    assert plan("[0,1]: dup=2 | [2]: dup=1 ; hetero=partial", dst) == ["local_zero() [0,1]", "all_reduce() [0,1,2]"]
    a = np.arange(12.0).reshape(3, 4)
    for src in ("[0,1]: partial=2 | [2]: dup=1 ; hetero=partial", "[0,1]: dup=2 | [2]: dup=1 ; hetero=partial",
                "[0,1]: split(1)=2 | [2]: dup=1 ; hetero=partial"):
        check(parse_layout(src), parse_layout(dst), a, np.random.default_rng(0))


def test_hetero_split_to_replicated_is_one_uneven_all_gather_in_slice_order():
    src = "[0,1]: split(0)=2 | [2]: dup=1 ; hetero=split(0), shares=3:1"
    assert plan(src, "[0,1]: dup=2 | [2]: dup=1 ; hetero=dup") == ["all_gather(dim=0) [0,1,2]"]
    a = np.arange(16.0 * 3).reshape(16, 3)  # rows 12 (6 + 6) and 4: the members' extents differ
    check(parse_layout(src), parse_layout("[0,1]: dup=2 | [2]: dup=1 ; hetero=dup"), a)


def test_other_hetero_transitions_say_not_supported_yet():
    with pytest.raises(NotImplementedError, match="heterogeneous resharding is not supported yet"):
        plan("[0,1]: dup=2 | [2]: dup=1 ; hetero=dup", "[0,1]: split(0)=2 | [2]: dup=1 ; hetero=split(0)")
    with pytest.raises(NotImplementedError, match="heterogeneous resharding is not supported yet"):  # a replica
        plan("[0,1]: dup=2 | [2]: dup=1 ; hetero=split(0)", "[0,1]: dup=2 | [2]: dup=1 ; hetero=dup")


@st.composite
def hetero_transitions(draw):
    """Draw (src, dst, shape): a union partial or split across 2..3 groups (random shares) -> replicated."""
    ndim = draw(st.integers(1, 3))
    k = draw(st.integers(2, 3))
    sizes = [draw(st.integers(1, 3)) for _ in range(k)]
    devices = draw(st.permutations(range(sum(sizes))))
    bounds = np.cumsum([0] + sizes)
    devs = [tuple(devices[bounds[i]:bounds[i + 1]]) for i in range(k)]
    if draw(st.booleans()):
        sts = [draw(states(ndim, n=n)) for n in sizes]
        src = Layout(tuple(Group(d, s) for d, s in zip(devs, sts)), PARTIAL)
    else:
        dim = draw(st.integers(0, ndim - 1))
        shares = tuple(draw(st.integers(1, 4)) for _ in range(k))
        src = Layout(tuple(Group(d, DistributedStates(((split(dim), len(d)),))) for d in devs), split(dim), shares)
    dst = Layout(tuple(Group(d, DistributedStates(((DUP, len(d)),))) for d in devs), DUP)
    shape = list(shape_for(draw, [src, dst], ndim))
    if src.hetero.kind == "split" and draw(st.booleans()):  # shares that do not divide the dim exactly
        shape[src.hetero.dim] = draw(st.integers(1, 30))
        try:
            src.check_shape(shape)
        except LayoutError:
            assume(False)
    return src, dst, tuple(shape)


@settings(max_examples=200, deadline=None)
@given(hetero_transitions(), st.integers(0, 2**32 - 1))
def test_hetero_plans_land_on_the_destination(case, seed):
    src, dst, shape = case
    rng = np.random.default_rng(seed)
    check(src, dst, rng.standard_normal(shape), rng)


# --------------------------------------------------------------------------------------
# The general fallback between unions: one exchange over the finest common slices


def test_exchange_semantics():
    x = {0: np.arange(4.0), 1: 10 + np.arange(4.0)}
    step = CommStep("exchange", ((0, 1),), transfers=((0, ((0, 2),), 1, ((0, 2),)), (1, ((2, 4),), 1, ((0, 2),)),
                                                      (1, ((0, 1),), 0, ((1, 2),))),
                    shapes=((0, (3,)), (1, (2,))))
    out = simulate([step], x)
    np.testing.assert_array_equal(out[1], [12, 14])   # 0[0:2] + 1[2:4]: summed
    np.testing.assert_array_equal(out[0], [0, 10, 0])  # reads the old pieces; unreached entries are zero
    assert str(step) == "exchange(3 transfers, 2 sent) [0,1]"
    with pytest.raises(ValueError, match="bad transfer"):  # region sizes differ
        CommStep("exchange", ((0, 1),), transfers=((0, ((0, 2),), 1, ((0, 1),)),), shapes=((1, (2,)),))
    with pytest.raises(ValueError, match="needs shapes"):
        CommStep("exchange", ((0, 1),))


def test_tp_gradient_partial_across_groups_to_tp_and_whole_weight():
    # the column weight's gradient under "[0,1]: tp=2 share=2 | [2]: tp=1 share=1": each group holds a
    # partial sum over its batch rows, split like the weight in group 0; the parameter is split in group 0
    # and whole in group 1
    src = parse_layout("[0,1]: split(1)=2 | [2]: dup=1 ; hetero=partial")
    dst = parse_layout("[0,1]: split(1)=2 | [2]: dup=1 ; hetero=dup")
    (step,) = plan_transition(src, dst, (4, 6))
    assert step.kind == "exchange"
    # device 0 adds its own columns 0:3 and device 2's; device 2 adds its own and devices 0's and 1's
    sent = sorted((s, d, sr) for s, sr, d, _ in step.transfers if s != d)
    assert sent == [(0, 2, ((0, 4), (0, 3))), (1, 2, ((0, 4), (0, 3))), (2, 0, ((0, 4), (0, 3))),
                    (2, 1, ((0, 4), (3, 6)))]
    check(src, dst, np.arange(24.0).reshape(4, 6), np.random.default_rng(0))
    with pytest.raises(NotImplementedError, match="needs it"):
        plan_transition(src, dst)


def _union(draw, ndim: int, devs: list[tuple[int, ...]]) -> Layout:
    sts = [draw(states(ndim, n=len(d))) for d in devs]
    hetero = draw(st.sampled_from([DUP, PARTIAL] + [split(d) for d in range(ndim)]))
    shares = tuple(draw(st.integers(1, 4)) for _ in devs) if hetero.kind == "split" and draw(st.booleans()) else None
    return Layout(tuple(Group(d, s) for d, s in zip(devs, sts)), hetero, shares)


def _groups(draw, devices: list[int]) -> list[tuple[int, ...]]:
    k = draw(st.integers(1, min(3, len(devices))))
    cuts = sorted(draw(st.lists(st.integers(1, len(devices) - 1), min_size=k - 1, max_size=k - 1, unique=True))) \
        if k > 1 else []
    bounds = [0, *cuts, len(devices)]
    return [tuple(devices[a:b]) for a, b in zip(bounds, bounds[1:])]


@st.composite
def union_transitions(draw):
    """Draw (src, dst, shape): random unions over the same 2..7 devices, each group with its own states
    (split, dup, partial in any mix), hetero dup, partial or split with random shares; dst on the same
    groups or on another grouping of the devices."""
    ndim = draw(st.integers(1, 3))
    n = draw(st.integers(2, 7))
    devices = list(draw(st.permutations(range(n))))
    sdevs = _groups(draw, devices)
    assume(len(sdevs) > 1)
    src = _union(draw, ndim, sdevs)
    ddevs = sdevs if draw(st.booleans()) else _groups(draw, list(draw(st.permutations(range(n)))))
    dst = _union(draw, ndim, ddevs)
    return src, dst, shape_for(draw, [src, dst], ndim)


@settings(max_examples=300, deadline=None)
@given(union_transitions(), st.integers(0, 2**32 - 1))
def test_union_plans_land_on_the_destination(case, seed):
    src, dst, shape = case
    rng = np.random.default_rng(seed)
    check(src, dst, rng.standard_normal(shape), rng)


@st.composite
def matched_unions(draw):
    """Draw (src, dst, shape): 2..3 groups of equal size holding a tensor alike (the same inner states),
    partial across groups -> replicated across groups with other common inner states."""
    ndim = draw(st.integers(1, 3))
    k, n = draw(st.integers(2, 3)), draw(st.integers(1, 3))
    devices = list(draw(st.permutations(range(k * n))))
    devs = [tuple(devices[i * n:(i + 1) * n]) for i in range(k)]
    s_states, d_states = draw(states(ndim, n=n)), draw(states(ndim, n=n))
    src = Layout(tuple(Group(d, s_states) for d in devs), PARTIAL)
    dst = Layout(tuple(Group(d, d_states) for d in devs), DUP)
    return src, dst, shape_for(draw, [src, dst], ndim)


@settings(max_examples=150, deadline=None)
@given(matched_unions(), st.integers(0, 2**32 - 1))
def test_hierarchical_plans_reduce_across_groups_over_matching_slices(case, seed):
    src, dst, shape = case
    steps = plan_transition(src, dst)  # no shape needed: no exchange
    if all(g.states.axes in ((), ((DUP, len(g.devices)),)) for g in dst.groups) and \
            not any(a.kind == "split" for a, _ in src.groups[0].states.axes):
        assert [s.kind for s in steps][-1] == "all_reduce" and steps[-1].groups == (src.devices,)  # flat
    else:  # the sum across groups over matching slices: first, or after the groups shrink their pieces
        n = len(src.groups[0].devices)
        across = CommStep("all_reduce", tuple(tuple(g.devices[i] for g in src.groups) for i in range(n)))
        shrink = steps[:-1] and all(s.kind in ("reduce_scatter", "local_split") for s in steps[:-1])
        assert (steps[-1] if shrink else steps[0]) == across, steps
    rng = np.random.default_rng(seed)
    check(src, dst, rng.standard_normal(shape), rng)


def test_hierarchical_tp_gradient_of_equal_groups():
    # "[0,1]: tp=2 share=3 | [2,3]: tp=2 share=1": the column weight's gradient is summed across the
    # groups by one all_reduce per matching half, no exchange
    assert plan("[0,1]: split(1)=2 | [2,3]: split(1)=2 ; hetero=partial",
                "[0,1]: split(1)=2 | [2,3]: split(1)=2 ; hetero=dup") == ["all_reduce() [0,2] [1,3]"]
    assert plan("[0-3]: partial=2, split(1)=2 | [4-7]: partial=2, split(1)=2 ; hetero=partial",
                "[0-3]: dup=2, split(1)=2 | [4-7]: dup=2, split(1)=2 ; hetero=dup") == [
        "all_reduce() [0,4] [1,5] [2,6] [3,7]", "all_reduce() [0,2] [1,3] [4,6] [5,7]"]
    # to replicated everywhere: across the groups on halves first, then gather inside each group
    assert plan("[0,1]: split(1)=2 | [2,3]: split(1)=2 ; hetero=partial",
                "[0,1]: dup=2 | [2,3]: dup=2 ; hetero=dup") == ["all_reduce() [0,2] [1,3]",
                                                                 "all_gather(dim=1) [0,1] [2,3]"]
