"""Sharding rules of the `graph` ops: which operand layouts an op accepts, which result follows.

Each op is described by *factors* (as in einsum, or Shardy's factor rules): one name per
dim of each operand and result. `matmul` is `[i,k] x [k,j] -> [i,j]`; `k` appears in no
result, so it is a reduction factor and splitting it leaves partial sums. An op is *linear*
in some operands (partial sums may pass through it): jointly (`add`: all partial together)
or separately (`mul`, `matmul`: one operand partial, the others replicated on that axis).

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

from hspmd.dialects import graph
from hspmd.dialects.op_rule import OpRule
from hspmd.ir.layout import DUP, PARTIAL, Axis, DistributedStates, Group, Layout, LayoutError, split


class ShardingError(Exception):
    """Layouts that an op's rule cannot reconcile; names the op and the layouts."""


def _dims(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(n))


def _shape(value) -> tuple[int, ...]:
    return value.type.get_shape()


def rule_for(op: Operation) -> OpRule | None:
    """Return the sharding rule of a compute op (None for leaves, outputs and assigns).

    An op class of any dialect can give its own rule with a `sharding_rule(self) -> OpRule`
    method; the `graph` ops' rules are below.
    """
    own = getattr(op, "sharding_rule", None)
    if own is not None:
        return own()
    match op:
        case graph.AddOp() | graph.SubOp():
            d = _dims("d", len(_shape(op.result)))
            return OpRule((d, d), (d,), frozenset({0, 1}), joint=True)
        case graph.MulOp():
            d = _dims("d", len(_shape(op.result)))
            return OpRule((d, d), (d,), frozenset({0, 1}), joint=False)
        case graph.ReluGradOp():
            d = _dims("d", len(_shape(op.result)))
            return OpRule((d, d), (d,), frozenset({1}))
        case graph.ReluOp():
            d = _dims("d", len(_shape(op.result)))
            return OpRule((d,), (d,))
        case graph.ScaleOp():
            d = _dims("d", len(_shape(op.result)))
            return OpRule((d,), (d,), frozenset({0}))
        case graph.ExpertMatmulOp():
            return OpRule((("e", "i", "k"), ("e", "k", "j")), (("e", "i", "j"),), frozenset({0, 1}), joint=False,
                          lead="e")
        case graph.ExpertMatmulRhsGradOp():  # m is contracted: split, it leaves partial sums
            return OpRule((("e", "m", "k"), ("e", "m", "n")), (("e", "k", "n"),), frozenset({0, 1}), joint=False,
                          lead="e")
        case graph.MatmulOp():
            b = _dims("b", len(_shape(op.lhs)) - 2)  # batch dims: shared, so splitting them is free
            rhs = (*b, "k", "j") if len(_shape(op.rhs)) > 2 else ("k", "j")
            weight = frozenset({"k", "j"}) if len(_shape(op.rhs)) == 2 else frozenset()  # times a 2-D weight
            return OpRule(((*b, "i", "k"), rhs), ((*b, "i", "j"),), frozenset({0, 1}), joint=False, prefer=weight)
        case graph.MatmulRhsGradOp():  # batch dims and i are contracted: split, they leave partial sums
            b = _dims("b", len(_shape(op.lhs)) - 2)
            return OpRule(((*b, "i", "k"), (*b, "i", "j")), (("k", "j"),), frozenset({0, 1}), joint=False,
                          prefer=frozenset({"k", "j"}))
        case graph.TransposeOp():
            d = _dims("d", len(_shape(op.input)))
            return OpRule((d,), (tuple(d[p] for p in op.perm.get_values()),), frozenset({0}))
        case graph.ReshapeOp():
            src, dst, extents = _reshape_factors(_shape(op.input), _shape(op.result))
            blocked = frozenset(f for f in (*src, *dst) if f.startswith("r"))
            return OpRule((src,), (dst,), frozenset({0}), blocked=blocked, extents=extents)
        case graph.BroadcastOp():
            dims = op.dims.get_values()
            src_shape, dst_shape = _shape(op.input), _shape(op.result)
            out = list(_dims("o", len(dst_shape)))
            src = tuple(out[d] if src_shape[i] == dst_shape[d] else f"one{i}" for i, d in enumerate(dims))
            return OpRule((src,), (tuple(out),), frozenset({0}))
        case graph.ReduceSumOp():
            d = _dims("d", len(_shape(op.input)))
            dims = set(op.dims.get_values())
            return OpRule((d,), (tuple(f for i, f in enumerate(d) if i not in dims),), frozenset({0}))
    return _rule_for_more(op)


def _elementwise(op: Operation, linear: frozenset[int] = frozenset()) -> OpRule:
    d = _dims("d", len(_shape(op.results[0])))
    return OpRule(tuple(d for _ in op.operands), (d,), linear)


def _last_dim_rule(op: Operation, n_operands_full: Sequence[bool], results_full: Sequence[bool],
                   linear: frozenset[int] = frozenset()) -> OpRule:
    """Rule of an op normalising over the last dim `n` of x [..., n] (blocked), with [n]-shaped
    operands/results where `*_full` is False (their leading dims are reductions)."""
    lead = _dims("b", len(_shape(op.operands[0])) - 1)
    full, vec = (*lead, "n"), ("n",)
    return OpRule(
        tuple(full if f else vec for f in n_operands_full),
        tuple(full if f else vec for f in results_full),
        linear,
        blocked=frozenset({"n"}),
    )


def _rule_for_more(op: Operation) -> OpRule | None:
    """Rules of the transformer op set (elementwise, normalisation, indexing, losses)."""
    match op:
        case graph.BinaryCrossEntropyOp():
            return _elementwise(op)
        case graph.BinaryCrossEntropyGradOp():  # linear in the incoming gradient
            return _elementwise(op, frozenset({2}))
        case graph.DivOp():  # linear in the numerator only
            return _elementwise(op, frozenset({0}))
        case graph.ExpOp() | graph.LogOp() | graph.SqrtOp() | graph.RsqrtOp() | graph.TanhOp() | graph.SiluOp() | graph.SigmoidOp():
            return _elementwise(op)
        case graph.GeluOp() | graph.PowOp():
            return _elementwise(op)
        case graph.CastOp():
            return _elementwise(op, frozenset({0}))
        case graph.TanhGradOp() | graph.SiluGradOp() | graph.GeluGradOp() | graph.PowGradOp() | graph.SigmoidGradOp():
            return _elementwise(op, frozenset({1}))  # linear in the incoming gradient
        case graph.SoftmaxOp():
            d = _dims("d", len(_shape(op.result)))
            return OpRule((d,), (d,), blocked=frozenset({d[op.dim.value.data]}))
        case graph.SoftmaxGradOp():
            d = _dims("d", len(_shape(op.result)))
            return OpRule((d, d), (d,), frozenset({1}), blocked=frozenset({d[op.dim.value.data]}))
        case graph.LayerNormOp():
            return _last_dim_rule(op, (True, False, False), (True,))
        case graph.LayerNormGradOp():  # linear in dy, but a partial dy is reduced first (below)
            return _last_dim_rule(op, (True, False, True), (True, False, False))
        case graph.RmsNormOp():
            return _last_dim_rule(op, (True, False), (True,))
        case graph.RmsNormGradOp():
            # Linear in dy, yet declared not: a partial dy (a column-parallel input's gradient) is
            # all-reduced here, as Megatron does, so the residual stream's gradient, the norm's
            # weight gradients and what the embeddings receive are whole, not partial sums that
            # each need a reduction of their own.
            return _last_dim_rule(op, (True, False, True), (True, False))
        case graph.EmbeddingOp():
            # vocabulary-parallel (Megatron): a table split along V gives each rank the rows it
            # owns and zeros for other ids, so `v`, missing from the result, leaves partial sums.
            # Not linear in the table: a partial result then always means a split vocabulary
            # (the kernel reads its rows' offset from the partial coordinate).
            b = _dims("b", len(_shape(op.ids)))
            return OpRule((("v", "e"), b), ((*b, "e"),))
        case graph.EmbeddingGradOp():  # the id dims are summed over: split, they leave partial sums;
            b = _dims("b", len(_shape(op.ids)))  # a result split along V scatters only its ids' rows
            return OpRule((b, (*b, "e")), (("v", "e"),), frozenset({1}))
        case graph.OneHotOp():  # classes are global indices along the last dim: any split is fine
            b = _dims("b", len(_shape(op.labels)))
            return OpRule((b,), ((*b, "c"),))
        case graph.CausalMaskOp():  # the mask compares global query and key indices: keep them whole
            d = _dims("d", len(_shape(op.result)))
            linear = frozenset({0}) if op.value.value.data == 0.0 else frozenset()
            return OpRule((d,), (d,), linear, blocked=frozenset(d[-2:]))
        case graph.SliceOp() | graph.SplitOp() | graph.ConcatOp():  # offsets are global along dim
            d = _dims("d", len(_shape(op.results[0])))
            blocked = frozenset({d[op.dim.value.data]})
            return OpRule(tuple(d for _ in op.operands), tuple(d for _ in op.results),
                          frozenset(range(len(op.operands))), joint=True, blocked=blocked)
        case graph.ReduceMaxOp():  # a max of pieces is not a sum: reduced dims stay whole
            d = _dims("d", len(_shape(op.input)))
            dims = set(op.dims.get_values())
            kept = tuple(f for i, f in enumerate(d) if i not in dims)
            return OpRule((d,), (kept,), blocked=frozenset(d[i] for i in dims))
        case graph.ReduceMaxGradOp():
            d = _dims("d", len(_shape(op.x)))
            dims = set(op.dims.get_values())
            kept = tuple(f for i, f in enumerate(d) if i not in dims)
            return OpRule((d, kept, kept), (d,), frozenset({2}), blocked=frozenset(d[i] for i in dims))
        case graph.SoftmaxCrossEntropyOp():
            b = _dims("b", len(_shape(op.labels)))
            return OpRule(((*b, "c"), b), (b,), blocked=frozenset({"c"}))
        case graph.SoftmaxCrossEntropyGradOp():
            b = _dims("b", len(_shape(op.labels)))
            return OpRule(((*b, "c"), b, b), ((*b, "c"),), frozenset({2}), blocked=frozenset({"c"}))
        case graph.LabelMaskOp():
            return _elementwise(op)
        case graph.RopeOp() | graph.RopeGradOp():  # angles use the global position (dim -3) and Dh
            d = _dims("d", len(_shape(op.result)))
            return OpRule((d,), (d,), frozenset({0}), blocked=frozenset({d[-3], d[-1]}))
        case graph.DropoutOp():  # the mask is keyed by global indices (global_type): any split is fine
            d = _dims("d", len(_shape(op.result)))
            return OpRule((d, ()), (d,), frozenset({0}))
    return _rule_for_moe(op)


def _rule_for_moe(op: Operation) -> OpRule | None:
    """Rules of the mixture-of-experts ops: groups `g` split freely, experts `e` where the weights lie."""
    match op:
        case graph.MoeRouteOp():  # a group's routing needs its whole sequence and every expert
            return OpRule((("g", "s", "e"),), (("g", "s", "e", "c"),), blocked=frozenset({"s", "e", "c"}))
        case graph.MoeDispatchOp():
            return OpRule((("g", "s", "d"), ("g", "s", "e", "c")), (("e", "g", "c", "d"),), frozenset({0, 1}),
                          joint=False)
        case graph.MoeCombineOp():  # the tokens' side (weights) leads: expert outputs come back by all-to-all
            return OpRule((("e", "g", "c", "d"), ("g", "s", "e", "c")), (("g", "s", "d"),), frozenset({0, 1}),
                          joint=False, lead=1)
        case graph.MoeWeightsGradOp():
            return OpRule((("g", "s", "d"), ("e", "g", "c", "d")), (("g", "s", "e", "c"),), frozenset({0, 1}),
                          joint=False, lead=0)
    return None


def _reshape_factors(
    src: Sequence[int], dst: Sequence[int]
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[str, int], ...]]:
    """Return (source factors, result factors, extents) for a reshape.

    Dims kept whole at the same offset (stride) share a factor. A dim that is the product of
    consecutive dims of the other side ending at the same offset (`[B,T,D] -> [B,T,H,hd]`,
    D = H*hd, or the reverse merge) shares its factor with the MAJOR of those sub-dims: a split
    of D into k contiguous chunks is a split of H into k chunks exactly when k divides H, so the
    factor's extent is H (`extents`) and a degree that does not divide it is not offered. The
    minor sub-dims, and dims matched in no way, get blocked factors (`rs*`, `rd*`).
    """

    def offsets(shape):
        out, acc = [], 1
        for s in reversed(shape):
            out.append(acc)
            acc *= s
        return list(reversed(out))

    so, do = offsets(src), offsets(dst)
    shared: dict[int, int] = {}  # source dim -> result dim with the same factor
    for i, (s, o) in enumerate(zip(src, so)):
        for j, (t, p) in enumerate(zip(dst, do)):
            if s == t and o == p and j not in shared.values():
                shared[i] = j
                break
    extents: list[tuple[str, int]] = []

    def merge(big, big_off, small, small_off, taken_big, taken_small):
        """Yield (big dim, major small dim) where big dim = product of consecutive small dims."""
        for i, (s, o) in enumerate(zip(big, big_off)):
            if i in taken_big or s == 1:
                continue
            for j in range(len(small)):
                prod, k = 1, j
                while k < len(small) and prod < s:
                    prod *= small[k]
                    k += 1
                if k - j >= 2 and prod == s and small_off[k - 1] == o and small[j] > 1 \
                        and not any(x in taken_small for x in range(j, k)):
                    yield i, j
                    taken_small.update(range(j, k))
                    break

    used_src, used_dst = set(shared), set(shared.values())
    for i, j in list(merge(src, so, dst, do, used_src, used_dst)):  # one source dim -> several result dims
        shared[i] = j
        used_src.add(i)
        extents.append((f"f{j}", dst[j]))
    for j, i in list(merge(dst, do, src, so, used_dst, used_src)):  # several source dims -> one result dim
        shared[i] = j
        extents.append((f"f{j}", src[i]))
    a = tuple(f"f{shared[i]}" if i in shared else f"rs{i}" for i in range(len(src)))
    b = tuple(f"f{j}" if j in shared.values() else f"rd{j}" for j in range(len(dst)))
    return a, b, tuple(extents)


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
