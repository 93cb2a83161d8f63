"""Sharding inference: from an op's rule, which operand layouts it accepts and which result follows.

Every op gives its own rule (`sharding_rule()` beside its definition, an `OpRule` of
`hspmd.dialects.op_rule`): *factors* (as in einsum, or Shardy's factor rules), one name per dim
of each operand and result. `matmul` is `[i,k] x [k,j] -> [i,j]`; `k` appears in no result, so
it is a reduction factor and splitting it leaves partial sums. An op is *linear* in some
operands (partial sums may pass through it): jointly (`add`: all partial together) or
separately (`mul`, `matmul`: one operand partial, the others replicated on that axis).

`infer` works on the mesh of one SPMD group: each mesh axis of the operands' states gets
one role (a factor, partial, or nothing). The roles give every operand the layout the op
needs (a consumer inserts `dist.reshard` where a producer differs) and every result its
layout. A layout that is replicated on its whole group (`dup=n`) fits any mesh. Where the
roles would give a tensor a layout one device order cannot express (two dup axes that are not
neighbours), roles are dropped (those mesh axes replicate) until every layout is expressible.
Heterogeneous unions (layouts with the same device lists per group): the hetero tier is one
more mesh axis with one role, a factor split across groups by `shares`, partial, or none;
a factor split across groups and missing from a result (the batch dim of a weight gradient,
of `reduce_sum`) leaves that result partial across groups (`hetero=partial`), as a mesh axis
does. Within each group the group's states are inferred as for one SPMD group.

A rule may name a *lead* (`OpRule.lead`: an operand, or the operand splitting a factor) whose
mesh and splits the op takes where operands disagree, across groups too; operands on another
mesh give their splits to the mesh axes it leaves free. The mixture-of-experts ops use it so
that tokens travel to the experts (all-to-all), never the experts to the tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from xdsl.ir import Operation

from hspmd.dialects.op_rule import OpRule
from hspmd.ir.layout import DUP, PARTIAL, Axis, DistributedStates, Group, Layout, LayoutError, split


class ShardingError(Exception):
    """Layouts that an op's rule cannot reconcile; names the op and the layouts."""


def _shape(value) -> tuple[int, ...]:
    return value.type.get_shape()


def rule_for(op: Operation) -> OpRule | None:
    """Return the sharding rule of `op` (its `sharding_rule()`), None for an op without one
    (leaves, outputs and assigns, which the strategy lays out)."""
    own = getattr(op, "sharding_rule", None)
    return own() if callable(own) else None


def has_rule(op: Operation) -> bool:
    """Return whether `op` has a sharding rule (`rule_for(op) is not None`, without building the
    rule: every `sharding_rule()` returns one, and the layout sweeps ask this of each op per sweep)."""
    return callable(getattr(op, "sharding_rule", None))


# ----------------------------------------------------------------------------- inference


def _flexible(ds: DistributedStates) -> bool:
    return all(a == DUP for a, _ in ds.axes)


def _states_from_roles(roles: list[tuple[Axis, int]]) -> DistributedStates | None:
    """Return states from per-mesh-axis roles, merging neighbouring dups; None if not expressible."""
    merged: list[tuple[Axis, int]] = []
    for axis, deg in roles:
        if merged and merged[-1][0] == axis and axis.kind != "split":
            merged[-1] = (axis, merged[-1][1] * deg)
        else:
            merged.append((axis, deg))
    if len({a for a, _ in merged}) != len(merged):
        return None
    return DistributedStates(tuple(merged))


@dataclass(frozen=True)
class Inference:
    """What an op needs of its operands and gives its results, as layouts."""

    operands: tuple[Layout, ...]
    results: tuple[Layout, ...]


def _fits(rule: OpRule, factor: str, degree: int) -> bool:
    """Return whether `factor` may be split `degree` ways (its extent, where the rule gives one, divides)."""
    return all(size % degree == 0 for f, size in rule.extents if f == factor)


def _infer_group(
    rule: OpRule, ins: Sequence[DistributedStates | None], hint: DistributedStates | None, n: int
) -> tuple[list[DistributedStates], list[DistributedStates]]:
    """Infer per-group states; `ins[i]` None means the operand takes whatever the op needs."""
    candidates = [(i, ds) for i, ds in enumerate(ins) if ds is not None and not _flexible(ds)]
    if hint is not None and not _flexible(hint):
        candidates.append((len(ins), hint))
    if candidates:
        leaders = [c for c in candidates if _leads(rule, c[0], c[1])] or candidates
        driver = max(leaders, key=lambda c: (sum(a != DUP for a, _ in c[1].axes), -c[0]))[1]
        mesh = [deg for _, deg in driver.axes]
    else:
        mesh = [n] if n > 1 else []
    roles: list[tuple[str, str | int] | None] = [None] * len(mesh)  # ("factor", f) | ("partial", operand)
    used: set[str] = set()
    partial_ops: dict[int, set[int]] = {}

    def offer(axes, factors, idx: int | None, only: frozenset[str] | None = None) -> None:
        if [d for _, d in axes] != mesh:
            return
        for m, (axis, _) in enumerate(axes):
            if only is not None and (axis.kind != "split" or factors[axis.dim] not in only):
                continue
            if axis.kind == "split":
                f = factors[axis.dim]
                if roles[m] is None and f not in used and f not in rule.blocked and _fits(rule, f, mesh[m]):
                    roles[m] = ("factor", f)
                    used.add(f)
            elif axis == PARTIAL and idx is not None and idx in rule.linear:
                if rule.joint and not all(_partial_on(ins[j], m) for j in rule.linear if ins[j] is not None):
                    continue  # reduce the partial operand rather than make the others partial
                if roles[m] is None or roles[m][0] == "partial":
                    roles[m] = ("partial", 0)
                    partial_ops.setdefault(m, set()).add(idx)
            elif axis == PARTIAL and idx is None and roles[m] is None:
                roles[m] = ("partial", 0)  # a result wanted partial: make a linear operand partial

    def _partial_on(ds: DistributedStates, m: int) -> bool:
        return [d for _, d in ds.axes] == mesh and ds.axes[m][0] == PARTIAL

    order = sorted(range(len(ins)), key=lambda i: ins[i] is not driver if candidates else 0)
    if rule.prefer:  # splits of the preferred factors first, then everything in the usual order
        for i in order:
            if ins[i] is not None and not _flexible(ins[i]):
                offer(ins[i].axes, rule.operands[i], i, only=rule.prefer)
    for i in order:
        if ins[i] is not None and not _flexible(ins[i]):
            offer(ins[i].axes, rule.operands[i], i)
    if hint is not None and not _flexible(hint) and len(rule.results) == 1:
        offer(hint.axes, rule.results[0], None)
    if rule.lead is not None:  # operands on another mesh: their splits take the free mesh axes
        for i in order:
            ds = ins[i]
            if ds is None or _flexible(ds) or [d for _, d in ds.axes] == mesh:
                continue
            for axis, _ in ds.axes:
                f = rule.operands[i][axis.dim] if axis.kind == "split" else None
                free = [m for m in range(len(mesh)) if roles[m] is None]
                if f is None or f in used or f in rule.blocked or not free or not _fits(rule, f, mesh[free[0]]):
                    continue
                roles[free[0]] = ("factor", f)
                used.add(f)

    def layout_for(roles, factors: Sequence[str], idx: int | None) -> DistributedStates | None:
        axes: list[tuple[Axis, int]] = []
        for m, role in enumerate(roles):
            axis = DUP
            if role is not None and role[0] == "factor":
                f = role[1]
                if f in factors:
                    axis = split(list(factors).index(f))
                elif idx is None:
                    axis = PARTIAL  # a split factor missing from this result was summed over
            elif role is not None and role[0] == "partial":
                if idx is None:
                    axis = PARTIAL
                elif rule.joint:
                    axis = PARTIAL if idx in rule.linear else DUP
                else:  # bilinear: exactly one operand carries the partial sums
                    axis = PARTIAL if idx == min(partial_ops.get(m) or rule.linear) else DUP
            axes.append((axis, mesh[m]))
        return _states_from_roles(axes)

    if any(r is not None and r[0] == "partial" for r in roles) and not rule.linear:
        raise ShardingError("op is not linear in any operand but a partial layout was asked for")
    # Roles can give some tensor a layout one DistributedStates cannot express (on a 3-axis mesh
    # `dup, split(1), dup`: two dup axes that are not neighbours). Then drop roles, fewest and
    # most minor first: a dropped mesh axis is replicated for every operand and result, which is
    # always correct (insert-reshard gathers what arrives split or partial on it).
    assigned = [m for m, r in enumerate(roles) if r is not None]
    for k in range(len(assigned) + 1):
        for drop in itertools.combinations(reversed(assigned), k):
            trial = [None if m in drop else r for m, r in enumerate(roles)]
            operands = [layout_for(trial, f, i) for i, f in enumerate(rule.operands)]
            results = [layout_for(trial, f, None) for f in rule.results]
            if all(ds is not None for ds in (*operands, *results)):
                return operands, results  # type: ignore[return-value]
    # unreachable: with every role dropped each layout is all dup, which merges into one axis
    raise ShardingError("the layouts cannot be expressed in one device order")


def _leads(rule: OpRule, index: int, ds: DistributedStates) -> bool:
    """Return whether operand `index`, laid out `ds`, is one that `rule.lead` names."""
    if isinstance(rule.lead, int):
        return index == rule.lead
    if isinstance(rule.lead, str) and index < len(rule.operands):
        return any(a.kind == "split" and rule.operands[index][a.dim] == rule.lead for a, _ in ds.axes)
    return False


def _leads_across(rule: OpRule, index: int, x: Layout) -> bool:
    """Return whether operand `index`, split across groups in `x`, is one that `rule.lead` names."""
    if isinstance(rule.lead, int):
        return index == rule.lead
    return isinstance(rule.lead, str) and rule.operands[index][x.hetero.dim] == rule.lead


def infer(op: Operation, ins: Sequence[Layout | None], hint: Layout | None = None) -> Inference:
    """Return the operand layouts `op` needs and the result layouts it gives.

    `ins[i]` is the layout operand i has now (None: not decided, take what the op needs);
    `hint` is a layout wanted for the (single) result, used where operands leave room.
    """
    rule = rule_for(op)
    if rule is None:
        raise ShardingError(f"'{op.name}' has no sharding rule")
    if all(x is None for x in (*ins, hint)):
        raise ShardingError(f"'{op.name}': no layout to start from")
    tensors = [(x, rule.operands[i]) for i, x in enumerate(ins) if x is not None]
    if hint is not None:
        tensors.append((hint, rule.results[0]))
    base, base_factors = next(
        (t for t in tensors if not all(_flexible(g.states) for g in t[0].groups)), tensors[0]
    )
    groups = base.groups

    def same_groups(x: Layout) -> bool:
        return [g.devices for g in x.groups] == [g.devices for g in groups]

    # The hetero tier is one more mesh axis, of as many "devices" as there are groups: it
    # takes one role (a factor split by shares, partial, or none) as a mesh axis does.
    hrole: tuple[str, str] | None = None
    hshares: tuple[int, ...] | None = None
    hpartial: set[int] = set()
    if len(groups) > 1:
        hrole, hshares, hpartial = _hetero_role(op, rule, ins, hint, same_groups)
    inference = _assemble(op, rule, ins, hint, groups, same_groups, hrole, hshares, hpartial)
    if hrole is not None and hrole[0] == "factor" and not _shapes_fit(op, inference):
        # the groups' rows of the factor cannot be cut as the group states say (a reshape of a
        # group's few rows): keep the factor whole across groups for this op
        inference = _assemble(op, rule, ins, hint, groups, same_groups, None, None, set())
    return inference


def _shapes_fit(op: Operation, inference: Inference) -> bool:
    """Return whether every operand and result shape of `op` can be laid out as `inference` says."""
    for value, lay in (*zip(op.operands, inference.operands), *zip(op.results, inference.results)):
        try:
            lay.check_shape(_shape(value))
        except (LayoutError, AttributeError):
            return False
    return True


def _assemble(op, rule: OpRule, ins, hint, groups, same_groups, hrole, hshares, hpartial) -> Inference:
    """Return the layouts of `op` under hetero role `hrole`, inferring the states of each group."""
    need_ops = [_hetero_axis(hrole, rule, rule.operands[i], i, hpartial) for i in range(len(ins))]
    need_res = [_hetero_axis(hrole, rule, rule.results[i], None, hpartial) for i in range(len(rule.results))]

    def fits(x: Layout | None, axis: Axis) -> bool:
        if x is None or not same_groups(x):
            return False
        return len(groups) == 1 or (x.hetero == axis and (axis.kind != "split" or x.shares == hshares))

    per_group_ops: list[list[DistributedStates]] = []
    per_group_res: list[list[DistributedStates]] = []
    for gi, group in enumerate(groups):
        def states(x: Layout | None, axis: Axis) -> DistributedStates | None:
            return x.groups[gi].states if fits(x, axis) else None

        try:
            o, r = _infer_group(rule, [states(x, need_ops[i]) for i, x in enumerate(ins)],
                                states(hint, need_res[0]) if need_res else None, len(group.devices))
        except ShardingError as err:
            raise ShardingError(f"'{op.name}': {err} (operands {', '.join(map(str, ins))})") from None
        per_group_ops.append(o)
        per_group_res.append(r)

    def assemble(k: int, per_group: list[list[DistributedStates]], axis: Axis) -> Layout:
        shares = hshares if axis.kind == "split" else None
        return Layout(tuple(Group(g.devices, per_group[gi][k]) for gi, g in enumerate(groups)), axis, shares)

    try:
        operands = tuple(assemble(i, per_group_ops, need_ops[i]) for i in range(len(ins)))
        results = tuple(assemble(i, per_group_res, need_res[i]) for i in range(len(rule.results)))
    except LayoutError as err:
        raise ShardingError(f"'{op.name}': {err}") from None
    return Inference(operands, results)


def _hetero_role(op: Operation, rule: OpRule, ins: Sequence[Layout | None], hint: Layout | None, same_groups):
    """Return (role, shares, partial operands) of the hetero tier of a multi-group op.

    The first operand (then the hint) split across groups on a factor the op may split gives
    the role ("factor", f) with its shares; else operands partial across groups give
    ("partial", ""), when the op is linear in them (jointly: all its linear operands are); a
    hint partial across groups asks for partial results as for a mesh axis. A factor split
    across groups and missing from a result was summed over: that result is partial across groups.
    """
    tensors = [(x, rule.operands[i], i) for i, x in enumerate(ins) if x is not None and same_groups(x)]
    if rule.lead is not None:  # the leading operand's split across groups first (expert weights stay put)
        tensors.sort(key=lambda t: not (t[0].hetero.kind == "split" and _leads_across(rule, t[2], t[0])))
    if hint is not None and same_groups(hint) and len(rule.results) == 1:
        tensors.append((hint, rule.results[0], None))
    for x, factors, _ in tensors:
        if x.hetero.kind == "split":
            f = factors[x.hetero.dim]
            if f in rule.blocked:
                continue  # the consumer gathers it across groups
            if not _apportion_carries(op, rule, f, x.shares):
                continue  # a reshape would move rows between groups: gather them first
            return ("factor", f), x.shares, set()
    partial = {i for x, _, i in tensors if i is not None and x.hetero == PARTIAL and i in rule.linear}
    if partial:
        if rule.joint and not all(ins[j] is not None and same_groups(ins[j]) and ins[j].hetero == PARTIAL
                                  for j in rule.linear):
            return None, None, set()
        return ("partial", ""), None, partial
    if hint is not None and same_groups(hint) and hint.hetero == PARTIAL and rule.linear:
        return ("partial", ""), None, set()
    return None, None, set()


def _apportion_carries(op: Operation, rule: OpRule, f: str, shares) -> bool:
    """Return whether every tensor of `op` holding factor `f` cuts it by `shares` at the same places.

    Groups hold `apportion(size, shares)` of a hetero-split dim; a reshape that merges the
    dim with minor dims (`[B, T] -> [B*T]`) keeps the groups' rows only when
    `apportion(B*T) == T * apportion(B)`.
    """
    if not rule.extents:
        return True
    from fractions import Fraction

    from hspmd.ir.layout import apportion

    cuts = set()  # where each tensor cuts the factor, as fractions of its extent
    for value, factors in (*zip(op.operands, rule.operands), *zip(op.results, rule.results)):
        shape = _shape(value)
        for d, g in enumerate(factors):
            if g == f and shape[d]:
                starts = [0]
                for part in apportion(shape[d], shares):
                    starts.append(starts[-1] + part)
                cuts.add(tuple(Fraction(c, shape[d]) for c in starts))
    return len(cuts) <= 1


def _hetero_axis(role, rule: OpRule, factors: Sequence[str], idx: int | None, partial: set[int]) -> Axis:
    """Return the hetero axis a tensor with `factors` gets under hetero `role` (idx None: a result)."""
    if role is None:
        return DUP
    if role[0] == "factor":
        if role[1] in factors:
            return split(list(factors).index(role[1]))
        return PARTIAL if idx is None else DUP
    if idx is None:
        return PARTIAL
    if rule.joint:
        return PARTIAL if idx in rule.linear else DUP
    return PARTIAL if idx == min(partial or rule.linear) else DUP
