"""Resharding as primitive communication steps, and a NumPy simulator that defines them.

`plan_transition(src, dst)` turns one single-group layout into another over the same devices
as a sequence of `CommStep`s; `simulate(steps, pieces)` says exactly what every rank holds
afterwards. Each step lists disjoint rank groups (global device ids); a rank uses the group
containing it, its *position* is its index in that group, and chunk order is group order.
Ranks in no group of a step keep their piece. "Chunk p of x along dim" means x split into
len(group) equal parts along dim, part p (the dim must divide evenly).

    all_reduce        every member gets the sum of the members' pieces.
    all_gather(dim)   every member gets the members' pieces concatenated along dim.
    reduce_scatter(dim)  the member at position p gets chunk p of the sum.
    local_split(dim)  (no communication) the member at position p keeps chunk p of its own piece.
    local_zero        (no communication) position 0 keeps its piece, the others hold zeros;
                      turns replicas into partial sums.
    all_to_all(dim, src_dim)  the member at position p gets chunk p along dim of every member's
                      piece, concatenated along src_dim in group order: dim becomes split,
                      src_dim (split across the group, in group order) becomes whole.
    exchange          batched point-to-point (the general fallback between unions): every
                      rank named in `shapes` starts from zeros of its new shape and adds, for
                      each transfer (src, src_region, dst, dst_region) with dst == itself, the
                      region src_region of src's *old* piece into its region dst_region
                      (regions are per-dim (start, stop) in local coordinates). Several
                      transfers into one region sum (partial pieces); src == dst is a local copy.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from hspmd.ir.devices import DeviceRange, RankGroups, concat
from hspmd.ir.layout import DUP, PARTIAL, Axis, DistributedStates, Layout, split

__all__ = ["CommStep", "KINDS", "exchange_step", "plan_transition", "simulate"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "local_split", "local_zero", "all_to_all", "exchange")

Region = tuple[tuple[int, int], ...]
Transfer = tuple[int, Region, int, Region]
_WITH_DIM = ("all_gather", "reduce_scatter", "local_split", "all_to_all")


@dataclass(frozen=True)
class CommStep:
    """One primitive step of a reshard; see the module docstring for its exact meaning.

    >>> str(CommStep("all_gather", ((0, 1), (2, 3)), dim=0))
    'all_gather(dim=0) [0,1] [2,3]'
    """

    kind: str
    groups: RankGroups
    dim: int = -1
    src_dim: int = -1
    transfers: tuple[Transfer, ...] = ()
    shapes: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.groups, RankGroups):
            try:
                object.__setattr__(self, "groups", RankGroups.of(self.groups))
            except ValueError:
                raise ValueError(f"{self.kind} needs disjoint, non-empty rank groups, got {self.groups}") from None
        groups = self.groups
        transfers = tuple((int(s), tuple((int(a), int(b)) for a, b in sr), int(d), tuple((int(a), int(b)) for a, b in dr))
                          for s, sr, d, dr in self.transfers)
        object.__setattr__(self, "transfers", transfers)
        object.__setattr__(self, "shapes", tuple((int(r), tuple(int(n) for n in sh)) for r, sh in self.shapes))
        if (self.kind == "exchange") != bool(self.shapes) or (self.transfers and self.kind != "exchange"):
            raise ValueError(f"{self.kind}: only exchange takes transfers and shapes, and it needs shapes")
        if self.kind == "exchange":
            members = set(groups.members)
            shaped = dict(self.shapes)
            for s_, sr, d, dr in transfers:
                if s_ not in members or d not in shaped or len(dr) != len(shaped[d]) or len(sr) != len(dr) or \
                        any(b - a != d2 - c for (a, b), (c, d2) in zip(sr, dr)) or \
                        any(not 0 <= c <= d2 <= n for (c, d2), n in zip(dr, shaped[d])):
                    raise ValueError(f"exchange: bad transfer {(s_, sr, d, dr)}")
        if self.kind not in KINDS:
            raise ValueError(f"unknown comm step kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if (self.kind in _WITH_DIM) != (self.dim >= 0):
            raise ValueError(f"{self.kind} {'needs' if self.kind in _WITH_DIM else 'takes no'} dim, got dim={self.dim}")
        if (self.kind == "all_to_all") != (self.src_dim >= 0) or (self.kind == "all_to_all" and self.src_dim == self.dim):
            raise ValueError(f"{self.kind} got src_dim={self.src_dim}; only all_to_all takes one, different from dim")

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in (("dim", self.dim), ("src_dim", self.src_dim)) if v >= 0)
        groups = " ".join("[" + ",".join(map(str, g)) + "]" for g in self.groups)
        if self.kind == "exchange":
            moves = sum(1 for s, _, d, _ in self.transfers if s != d)
            return f"exchange({len(self.transfers)} transfers, {moves} sent) {groups}"
        return f"{self.kind}({args}) {groups}"


# --------------------------------------------------------------------------------------
# Simulator


def _chunk(x: np.ndarray, k: int, dim: int, p: int) -> np.ndarray:
    if dim >= x.ndim or x.shape[dim] % k:
        raise ValueError(f"cannot cut a piece of shape {x.shape} into {k} equal chunks along dim {dim}")
    n = x.shape[dim] // k
    return x[(slice(None),) * dim + (slice(p * n, (p + 1) * n),)]


def simulate(steps: Iterable[CommStep], pieces: Mapping[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Return {rank: piece} after running `steps` on `pieces` (the inputs are not modified)."""
    out = {r: np.array(p, copy=True) for r, p in pieces.items()}
    for step in steps:
        new = dict(out)
        if step.kind == "exchange":
            for r in {r for g in step.groups for r in g}:
                if r not in out:
                    raise ValueError(f"{step} names rank {r} that holds no piece")
            dtype = np.result_type(*(out[r] for g in step.groups for r in g))
            for r, shape in step.shapes:
                new[r] = np.zeros(shape, dtype)
            for s_, sr, d, dr in step.transfers:
                new[d][tuple(slice(a, b) for a, b in dr)] += out[s_][tuple(slice(a, b) for a, b in sr)]
            out = new
            continue
        for group in step.groups:
            missing = [r for r in group if r not in out]
            if missing:
                raise ValueError(f"{step} names ranks {missing} that hold no piece")
            xs = [out[r] for r in group]
            k = len(group)
            if step.kind in ("all_reduce", "reduce_scatter"):
                total = sum(xs[1:], xs[0].copy())
            for p, r in enumerate(group):
                if step.kind == "all_reduce":
                    new[r] = total.copy()
                elif step.kind == "all_gather":
                    new[r] = np.concatenate(xs, axis=step.dim)
                elif step.kind == "reduce_scatter":
                    new[r] = _chunk(total, k, step.dim, p).copy()
                elif step.kind == "local_split":
                    new[r] = _chunk(xs[p], k, step.dim, p).copy()
                elif step.kind == "local_zero":
                    new[r] = xs[p] if p == 0 else np.zeros_like(xs[p])
                else:  # all_to_all
                    new[r] = np.concatenate([_chunk(x, k, step.dim, p) for x in xs], axis=step.src_dim)
        out = new
    return out


# --------------------------------------------------------------------------------------
# Planner


def _mesh_groups(devices: Sequence[int], ds: DistributedStates, j: int) -> RankGroups:
    """Return the device groups along mesh axis `j` of `ds` (members differ only in coordinate j),
    computed from the range of `devices`, not listed."""
    return RankGroups.along(DeviceRange.of(devices), [d for _, d in ds.axes], j)


def _axis_steps(src: Axis, dst: Axis, groups: RankGroups) -> list[CommStep]:
    """Return the steps turning one mesh axis from role `src` into role `dst` (other axes untouched)."""
    if src == PARTIAL:
        if dst == DUP:
            return [CommStep("all_reduce", groups)]
        return [CommStep("reduce_scatter", groups, dim=dst.dim)]
    if src == DUP:
        if dst == PARTIAL:
            return [CommStep("local_zero", groups)]
        return [CommStep("local_split", groups, dim=dst.dim)]
    # src is split
    if dst.kind == "split":
        return [CommStep("all_to_all", groups, dim=dst.dim, src_dim=src.dim)]
    gather = CommStep("all_gather", groups, dim=src.dim)
    return [gather] if dst == DUP else [gather, CommStep("local_zero", groups)]


# Cheaper steps first: shrink pieces before moving them, grow them last.
_RANK = {"local_split": 0, "reduce_scatter": 1, "all_to_all": 2, "all_reduce": 3, "all_gather": 4, "local_zero": 5}


def _per_axis(devices: Sequence[int], sds: DistributedStates, dds: DistributedStates) -> list[CommStep]:
    """Return steps converting mesh axis by mesh axis, for states with the same degree sequence.

    Every intermediate state keeps each tensor dim split on at most one mesh axis, so each
    step cuts a dim that is whole in the current piece, into a number of chunks (its
    destination degree) that divides it; a cycle of split moves is broken by gathering one
    of its axes to `dup` first.
    """
    roles = [a for a, _ in sds.axes]
    target = [b for b, _ in dds.axes]
    pending = [j for j in range(len(roles)) if roles[j] != target[j]]
    steps: list[CommStep] = []
    while pending:
        ready = [j for j in pending
                 if target[j].kind != "split" or all(roles[k] != target[j] for k in range(len(roles)) if k != j)]
        if ready:
            j = min(ready, key=lambda j: (_RANK[_axis_steps(roles[j], target[j], ((0,),))[0].kind], j))
            to = target[j]
            pending.remove(j)
        else:  # a cycle of split(i) -> split(j) moves: gather one of them first
            j = next(j for j in pending if roles[j].kind == "split")
            to = DUP
        steps += _axis_steps(roles[j], to, _mesh_groups(devices, sds, j))
        roles[j] = to
    return steps


def _common_radix(a: Sequence[int], b: Sequence[int]) -> list[int] | None:
    """Return the mesh degrees (major first) that refine both degree sequences, None if none does.

    [4] and [2, 2] give [2, 2]: each axis of either becomes one or more consecutive axes of it.
    """
    cuts = set()
    for seq in (a, b):
        acc = 1
        for d in seq:
            acc *= d
            cuts.add(acc)
    radix, prev = [], 1
    for c in sorted(cuts):
        if c % prev:
            return None
        radix.append(c // prev)
        prev = c
    return radix


def _refine(ds: DistributedStates, radix: Sequence[int]) -> list[Axis]:
    """Return the role of each axis of `radix` that refines `ds`'s axes (an axis of degree 4 over
    radix [2, 2] gives its role twice: the major one the outer chunks, as device order does)."""
    roles: list[Axis] = []
    k = 0
    for axis, degree in ds.axes:
        while degree > 1:
            roles.append(axis)
            degree //= radix[k]
            k += 1
    return roles


def _refined(devices: Sequence[int], sds: DistributedStates, dds: DistributedStates) -> list[CommStep] | None:
    """Return steps between states of different degree sequences over one common refinement of
    their meshes, axis by axis (split(1)=4 -> split(1)=2, split(0)=2 is one all_to_all in pairs,
    where the fallback gathers everything), or None where that does not work out.

    A split refined into several axes is moved innermost axis first, and a new split is cut
    innermost; the plan is checked by `simulate` on a small tensor before it is returned.

    A partial axis is allowed where both states have it on the same refined axes (the expert
    outputs of a row-parallel expert weight, `split(1)=2, split(0)=2, partial=2 ->
    split(1)=4, partial=2`): no step touches it, and every step is linear, so the steps are
    planned and checked with it read as `dup` (each member's summand moves alike). A source
    partial axis that the destination replicates is all-reduced along it after the cuts and
    before the gathers (`... partial=2 -> split(1)=4, dup=2`); one that it splits is reduce-scattered where the
    plan read as dup cuts it.

    The plan depends on the states only (`_refined_plan`, planned once per pair); each step's
    rank groups are the devices' groups along one refined axis, computed from their range.
    """
    plan = _refined_plan(sds, dds)
    if plan is None:
        return None
    radix, skeleton = plan
    devices = DeviceRange.of(devices)
    return [CommStep(kind, RankGroups.along(devices, radix, j), dim=dim, src_dim=src_dim)
            for kind, j, dim, src_dim in skeleton]


#: a refined plan's step: (kind, refined axis, dim, src_dim)
_Skeleton = tuple[tuple[str, int, int, int], ...]


@functools.lru_cache(maxsize=512)
def _refined_plan(sds: DistributedStates, dds: DistributedStates) -> tuple[tuple[int, ...], _Skeleton] | None:
    """Return (the common refinement's degrees, the steps of `_refined` by refined axis), or None."""
    radix = _common_radix([d for _, d in sds.axes], [d for _, d in dds.axes])
    if radix is None:
        return None
    reduce: list[int] = []
    if any(a == PARTIAL for a, _ in (*sds.axes, *dds.axes)):
        src_roles, dst_roles = _refine(sds, radix), _refine(dds, radix)
        partial = [{k for k, a in enumerate(rs) if a == PARTIAL} for rs in (src_roles, dst_roles)]
        reduce = sorted(partial[0] - partial[1])
        if not partial[1] <= partial[0]:
            return None
        if any(PARTIAL in axes and DUP in axes for axes in ([a for a, _ in ds.axes] for ds in (sds, dds))):
            return None  # read as dup, the partial axis would name dup twice
        sds, dds = (DistributedStates(tuple((DUP if a == PARTIAL else a, d) for a, d in ds.axes)) for ds in (sds, dds))
    roles, target = _refine(sds, radix), _refine(dds, radix)

    def inner(j: int, axis: Axis) -> bool:  # no more minor axis holds `axis` now
        return all(roles[k] != axis for k in range(j + 1, len(roles)))

    def kind(j: int) -> str:
        return _axis_steps(roles[j], target[j], ((0,),))[0].kind

    def skeleton(j: int, src: Axis, dst: Axis) -> list[tuple[str, int, int, int]]:
        return [(st.kind, j, st.dim, st.src_dim) for st in _axis_steps(src, dst, ((0,),))]

    start = list(roles)
    # cheaper steps first; where that blocks (a cut that takes the dim a split still has to
    # leave by all-to-all), the all-to-alls first
    for moves_first in (False, True):
        roles = list(start)
        steps: list[tuple[str, int, int, int]] = []
        pending = [j for j in range(len(roles)) if roles[j] != target[j]]
        while pending:
            ready = [j for j in pending if (roles[j].kind != "split" or inner(j, roles[j]))
                     and (target[j].kind != "split" or inner(j, target[j]))]
            if not ready:
                break
            j = min(ready, key=lambda j: (moves_first and kind(j) != "all_to_all", _RANK[kind(j)], j))
            steps += skeleton(j, roles[j], target[j])
            roles[j] = target[j]
            pending.remove(j)
        if not pending:
            break
    else:
        return None
    moves = tuple(steps)
    # a reduced axis: read as dup it was cut by a local_split (-> reduce_scatter) or left alone (-> all_reduce)
    steps = [("reduce_scatter", j, dim, src) if kind_ == "local_split" and j in reduce else (kind_, j, dim, src)
             for kind_, j, dim, src in steps]
    at = next((i for i, st in enumerate(steps) if st[0] == "all_gather"), len(steps))  # after cuts, before gathers
    steps[at:at] = [("all_reduce", k, -1, -1) for k in reduce if target[k] == DUP]
    return (tuple(radix), tuple(steps)) if _moves_check(radix, start, target, moves, sds, dds) else None


def _moves_check(radix: Sequence[int], roles: Sequence[Axis], target: Sequence[Axis], moves: _Skeleton,
                 sds: DistributedStates, dds: DistributedStates) -> bool:
    """Return whether `moves` (by refined axis) turn pieces laid out `sds` into pieces laid out `dds`,
    by `simulate` on a small tensor. On a large mesh the check runs on the same plan over a mesh
    whose refined axes are cut to at most 3 devices each: a step acts along one refined axis and
    its chunks' order does not depend on that axis's size, only on the axes' order."""
    dims = 1 + max([a.dim for a, _ in (*sds.axes, *dds.axes) if a.kind == "split"], default=0)
    n = math.prod(radix)
    if n <= 64 and n ** dims <= 1 << 16:
        shape = tuple(n if any(a == split(d) for a, _ in (*sds.axes, *dds.axes)) else 1 for d in range(dims))
    else:  # a large mesh: the same plan over refined axes of at most 3, each dim as long as its cuts need
        radix = [min(r, 3) for r in radix]
        sds, dds = _states_over(roles, radix), _states_over(target, radix)
        n = math.prod(radix)
        shape = tuple(math.prod(r for r, a, b in zip(radix, roles, target) if split(d) in (a, b)) for d in range(dims))
    whole = np.arange(int(np.prod(shape))).reshape(shape)
    index = DeviceRange.iota(n)
    steps = [CommStep(kind, RankGroups.along(index, radix, j), dim=dim, src_dim=src) for kind, j, dim, src in moves]
    try:
        got = simulate(steps, {i: whole[sds.slices(i, shape)] for i in range(n)})
    except ValueError:
        return False
    return all(np.array_equal(got[i], whole[dds.slices(i, shape)]) for i in range(n))


def _states_over(roles: Sequence[Axis], radix: Sequence[int]) -> DistributedStates:
    """Return the states whose axes take `roles` over refined axes of degrees `radix` (consecutive
    refined axes of one role are one axis)."""
    axes: list[list] = []
    for role, r in zip(roles, radix):
        if axes and axes[-1][0] == role:
            axes[-1][1] *= r
        else:
            axes.append([role, r])
    return DistributedStates(tuple((a, d) for a, d in axes))


def _via_replicas(src: tuple[int, ...], sds: DistributedStates,
                  dst: tuple[int, ...], dds: DistributedStates) -> list[CommStep]:
    """Return steps that reduce and gather to full replicas on every device, then cut out `dds`."""
    steps: list[CommStep] = []
    for j, (axis, _) in enumerate(sds.axes):
        if axis == PARTIAL:
            steps.append(CommStep("all_reduce", _mesh_groups(src, sds, j)))
    for j, (axis, _) in enumerate(sds.axes):
        if axis.kind == "split":
            steps.append(CommStep("all_gather", _mesh_groups(src, sds, j), dim=axis.dim))
    for j, (axis, _) in enumerate(dds.axes):
        if axis.kind == "split":
            steps.append(CommStep("local_split", _mesh_groups(dst, dds, j), dim=axis.dim))
        elif axis == PARTIAL:
            steps.append(CommStep("local_zero", _mesh_groups(dst, dds, j)))
    return steps


def plan_transition(src: Layout, dst: Layout, shape: Sequence[int] | None = None) -> tuple[CommStep, ...]:
    """Return the steps that turn pieces laid out as `src` into pieces laid out as `dst`.

    Single groups over the same device set: with the same devices in the
    same order and the same degree sequence the plan works mesh axis by mesh axis (partial->dup
    all_reduce, partial->split reduce_scatter, split->dup all_gather, dup->split local_split,
    dup->partial local_zero, split(i)->split(j) all_to_all); with other degree sequences that
    one mesh refines (`_refined`: [4] and [2, 2]) the same over that mesh; otherwise it reduces
    and gathers to full replicas and cuts out the destination. Equal layouts give (). Unions of several
    groups over the same devices: see `_hetero` for what is handled (partial or split across
    groups -> replicated everywhere); any other transition between unions of the same devices
    is one `exchange` over the finest common slices (see `_exchange`), which needs the global
    `shape`; without it, NotImplementedError.

    >>> from hspmd.ir.layout_text import parse_layout
    >>> [str(s) for s in plan_transition(parse_layout("[0-3]: partial=2, split(0)=2"),
    ...                                  parse_layout("[0-3]: split(1)=2, dup=2"))]
    ['reduce_scatter(dim=1) [0,2] [1,3]', 'all_gather(dim=0) [0,1] [2,3]']
    """
    if src == dst:
        return ()
    same = src.same_devices(dst)
    if (len(src.groups) > 1 or len(dst.groups) > 1) and same:
        return _hetero(src, dst, shape)
    if len(src.groups) > 1 or len(dst.groups) > 1 or not same:
        raise NotImplementedError(
            f"cannot plan '{src}' -> '{dst}': only single groups over the same devices are handled; "
            f"heterogeneous resharding is not supported yet")
    (sg,), (dg,) = src.groups, dst.groups
    sds, dds = sg.states, dg.states
    if sg.devices == dg.devices and [d for _, d in sds.axes] == [d for _, d in dds.axes]:
        return tuple(_per_axis(sg.devices, sds, dds))
    if sg.devices == dg.devices and (refined := _refined(sg.devices, sds, dds)) is not None:
        return tuple(refined)
    return tuple(_via_replicas(sg.devices, sds, dg.devices, dds))


def _replicated_everywhere(dst: Layout) -> bool:
    return dst.hetero == DUP and all(g.states.axes in ((), ((DUP, len(g.devices)),)) for g in dst.groups)


def _hetero(src: Layout, dst: Layout, shape: Sequence[int] | None = None) -> tuple[CommStep, ...]:
    """Return the steps of a transition between unions of the same devices (see `plan_transition`).

    Handled: (a) partial across groups -> replicated everywhere: each group first makes its
    pieces partial sums in which every device counts once (a replica inside a group is
    zeroed on all but one member, `local_zero`; split or partial axes go through the
    one-group planner to `partial=n`), then one flat `all_reduce` over all devices sums
    them exactly. (b) split across groups -> replicated everywhere: each group gathers a
    split of the hetero dim inside itself only if its pieces are cut on other dims too;
    pieces of the hetero dim are then disjoint slices, and one uneven `all_gather` over one
    member per slice, in slice order, would leave the other replicas out, so (b) is limited
    to groups whose devices each hold a distinct slice (states `split(d)=n_g` on the hetero dim).

    (c) The same groups related the same way (hetero axis and shares): each group's own
    single-group plan, steps of different groups side by side.

    (d) Hierarchical, over matching slices (`_hierarchical`): partial across groups that hold
    their pieces alike -> replicated across groups, any inner states: one collective across
    the groups over the devices holding the same slice, then each group's own step inside.

    Flat rather than hierarchical (reduce inside each group, all_reduce across one
    representative per group, broadcast inside each group): one collective instead of three,
    the same bytes per rank as a ring over all devices, and the sum is one left fold in
    device order whatever the groups; a hierarchical form pays off only where links between
    groups are slower than inside them, which nothing here measures yet.
    """
    same_groups = [g.devices for g in src.groups] == [g.devices for g in dst.groups]
    hierarchical = _hierarchical(src, dst) if same_groups else None
    if hierarchical is not None:
        return hierarchical
    if same_groups and src.hetero == dst.hetero and src.shares == dst.shares:
        # the groups relate as before: each group converts its own pieces, independently
        steps = []
        for sg, dg in zip(src.groups, dst.groups):
            steps += plan_transition(Layout.spmd(sg.devices, sg.states), Layout.spmd(dg.devices, dg.states))
        return tuple(steps)
    if same_groups and _replicated_everywhere(dst):
        if src.hetero == PARTIAL:
            steps: list[CommStep] = []
            for g in src.groups:
                n = len(g.devices)
                if n > 1 and g.states.axes != ((PARTIAL, n),):
                    to = DistributedStates(((PARTIAL, n),))
                    steps += plan_transition(Layout.spmd(g.devices, g.states), Layout.spmd(g.devices, to))
            return (*steps, CommStep("all_reduce", RankGroups(src.devices, src.num_devices)))
        if src.hetero.kind == "split":
            d = src.hetero.dim
            if all(g.states.axes in ((), ((split(d), len(g.devices)),)) for g in src.groups):
                return (CommStep("all_gather", RankGroups(src.devices, src.num_devices), dim=d),)
    if shape is not None:
        return (exchange_step(src, dst, tuple(shape)),)
    raise NotImplementedError(
        f"cannot plan '{src}' -> '{dst}' without the tensor's shape: the general heterogeneous transition "
        f"(an exchange over the finest common slices) needs it, and without it heterogeneous resharding is not "
        f"supported yet for this transition "
        f"(only partial across groups -> replicated everywhere, and split(d) across groups with each device "
        f"holding its own slice -> replicated everywhere)")


def _merged(plans: list[tuple[CommStep, ...]]) -> list[CommStep] | None:
    """Return the groups' own plans run side by side as one list, each step over all groups' rank sets.

    None unless every plan has the same steps but for their ranks (the groups hold pieces alike).
    """
    if len({tuple((st.kind, st.dim, st.src_dim, len(st.groups)) for st in p) for p in plans}) != 1:
        return None
    return [CommStep(steps[0].kind, RankGroups(concat([st.groups.members for st in steps]), steps[0].groups.size),
                     dim=steps[0].dim, src_dim=steps[0].src_dim) for steps in zip(*plans)]


def _hierarchical(src: Layout, dst: Layout) -> tuple[CommStep, ...] | None:
    """Return the hierarchical plan of partial-across-groups -> replicated across groups, or None.

    Applies when the groups (the same in `src` and `dst`) have equal sizes, equal inner states
    in `src` (so device i of every group holds the same slice, the same partial coordinate)
    and equal inner states in `dst`, and `dst` is replicated across groups (`hetero=dup`);
    but when the groups' pieces are not split and `dst` is replicated everywhere, one flat
    all_reduce (see `_hetero`) sends no more bytes, and that is used instead. Then one
    `all_reduce` across the groups over the devices at the same position sums the groups'
    partial pieces slice by slice (a collective over matching slices), and each group converts
    its inner states as its own one-group plan would; when that only shrinks the pieces
    (reduce-scatters, local splits: ZeRO's gradients over dp groups), the groups convert first
    and the sum across them moves the slices only (e.g. `[0,1]: tp=2 | [2,3]: tp=2`: a
    column weight's gradient `[0,1]: split(1)=2 | [2,3]: split(1)=2 ; hetero=partial` ->
    `hetero=dup` is one all_reduce over [0,2] and [1,3], half the tensor each; to replicated
    everywhere, that and an all_gather inside each group: a rank sends B/2 + B/2 where
    gathering first and one flat all_reduce would send B/2 + 3B/2).
    """
    if src.hetero != PARTIAL or dst.hetero != DUP:
        return None
    if _replicated_everywhere(dst) and not any(a.kind == "split" for g in src.groups for a, _ in g.states.axes):
        return None  # partial or replicated inside groups: one flat all_reduce sends no more
    sizes = {len(g.devices) for g in src.groups}
    if len(sizes) != 1 or len({g.states for g in src.groups}) != 1 or len({g.states for g in dst.groups}) != 1:
        return None
    (n,) = sizes
    # the devices at position i of every group, for each i: the stacked groups read along the group axis
    across = CommStep("all_reduce", RankGroups.along(concat([g.devices for g in src.groups]), (len(src.groups), n), 0))
    inner = _merged([plan_transition(Layout.spmd(sg.devices, sg.states), Layout.spmd(dg.devices, dg.states))
                     for sg, dg in zip(src.groups, dst.groups)])
    if inner is None:
        return None
    if inner and all(step.kind in ("reduce_scatter", "local_split") for step in inner):
        return (*inner, across)  # shrink inside the groups first: the sum across them moves a slice only
    return (across, *inner)


# --------------------------------------------------------------------------------------
# General fallback: batched point-to-point over the finest common slices


def _cells(regions: Iterable[tuple[slice, ...]], shape: tuple[int, ...]) -> list[tuple[tuple[int, int], ...]]:
    """Return the finest common cells: per dim, cut at every start and stop of every region."""
    cuts = [{0, n} for n in shape]
    for reg in regions:
        for d, sl in enumerate(reg):
            cuts[d] |= {sl.start, sl.stop}
    bounds = [sorted(c) for c in cuts]
    out: list[tuple[tuple[int, int], ...]] = [()]
    for b in bounds:
        out = [c + ((lo, hi),) for c in out for lo, hi in zip(b, b[1:]) if hi > lo]
    return out


def _inside(cell: tuple[tuple[int, int], ...], reg: tuple[slice, ...]) -> bool:
    return all(r.start <= a and b <= r.stop for (a, b), r in zip(cell, reg))


def _local(cell: tuple[tuple[int, int], ...], reg: tuple[slice, ...]) -> Region:
    return tuple((a - r.start, b - r.start) for (a, b), r in zip(cell, reg))


def _summands_of(src: Layout, cell: tuple[tuple[int, int], ...], shape: tuple[int, ...],
                 prefer: int) -> list[int]:
    """Return devices of `src` whose pieces over `cell`, added, give the tensor's value there.

    One group when groups are replicas (hetero dup: the one holding `prefer`, else the first)
    or hold disjoint slices (hetero split: the one covering the cell); every group when they hold
    partial sums. Inside a group, one device per partial coordinate among those covering the
    cell; of replicas, `prefer` itself when it is one, else the first.
    """
    cand = [g for g in range(len(src.groups)) if _inside(cell, src.group_extent(g, shape))]
    if src.hetero != PARTIAL:
        mine = [g for g in cand if prefer in src.groups[g].devices]
        cand = mine or cand[:1]
    chosen: list[int] = []
    for g in cand:
        group = src.groups[g]
        pick: dict[int, int] = {}
        for i, dev in enumerate(group.devices):
            if _inside(cell, src.slices(dev, shape)):
                p = group.states.coords(i).get(PARTIAL, 0)
                if p not in pick or dev == prefer:
                    pick[p] = dev
        chosen += [pick[p] for p in sorted(pick)]
    return chosen


@functools.lru_cache(maxsize=256)
def exchange_step(src: Layout, dst: Layout, shape: tuple[int, ...]) -> CommStep:
    """Return the `exchange` step from `src` to `dst` for a tensor of global `shape` (cached).

    `comm.exchange` names only its layouts and shape; every rank derives the same transfer
    list from them through this function.
    """
    return _exchange(src, dst, tuple(shape))


def _exchange(src: Layout, dst: Layout, shape: tuple[int, ...]) -> CommStep:
    """Return one `exchange` step turning `src` pieces into `dst` pieces of a tensor of `shape`.

    The tensor is cut into the finest common cells of every src and dst device's region. A dst
    device whose piece must carry the value (any non-partial device; for partial dst, the
    member at partial coordinate 0, of group 0 when groups are partial) gets, for every cell
    of its region, the cell of each src device in `_summands_of`, summed; other dst devices
    hold zeros. A device already holding a summand reads it locally (src == dst transfer).
    Transfers are listed in (dst, cell, src) order; every device computes the same list, so the
    lowering can order sends and receives globally (see lower_reshard).
    """
    src.check_shape(shape)
    dst.check_shape(shape)
    regions = {("s", d): src.slices(d, shape) for d in src.devices}
    regions.update({("d", d): dst.slices(d, shape) for d in dst.devices})
    cells = _cells(regions.values(), shape)
    transfers: list[Transfer] = []
    for d in dst.devices:
        g, i = dst._locate(d)
        if dst.groups[g].states.coords(i).get(PARTIAL, 0) or (dst.hetero == PARTIAL and g):
            continue
        dreg = regions[("d", d)]
        for cell in cells:
            if _inside(cell, dreg):
                for s_ in _summands_of(src, cell, shape, d):
                    transfers.append((s_, _local(cell, regions[("s", s_)]), d, _local(cell, dreg)))
    shapes = tuple((d, dst.local_shape(d, shape)) for d in dst.devices)
    members = tuple(sorted(set(src.devices) | set(dst.devices)))
    return CommStep("exchange", (members,), transfers=tuple(transfers), shapes=shapes)
