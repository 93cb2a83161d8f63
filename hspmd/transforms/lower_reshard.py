"""`lower-reshard`: replace each physical `dist.reshard` by the `comm` ops that perform it.

Runs on physical IR (after `specialize-groups`). `plan_transition` of the layout algebra
gives the primitive steps (partial->dup is one `comm.all_reduce`, split->dup one
`comm.all_gather`, ...); each becomes one comm op over explicit rank groups, and the local
shape after each step follows from the step (gathers grow a dim by the group size, scatters
and local splits shrink it). The general fallback between unions, an `exchange` step, becomes
one `comm.exchange` that names the transition (src and dst layouts, global shape) rather than
listing its transfers, so the program does not grow with the number of ranks; the runtime
derives the transfers and runs a rank's own in their one global order, so blocking sends
always meet their receives. Its plan needs the global shape, which `_global_shape` recovers
from the reshard's local types.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass

from hspmd.dialects import comm, dist
from hspmd.dialects.graph import i64_array
from hspmd.ir.layout import Layout, LayoutError, split
from hspmd.dialects.levels import DEVICES_ATTR, devices_of
from hspmd.ir.devices import DeviceRange
from hspmd.ir.reshard_plan import CommStep, plan_transition
from hspmd.transforms.util import PassError


def _step_op(step: CommStep, value: SSAValue, sizes: tuple[int, ...] | None = None) -> Operation:
    """Return the comm op performing `step` on local `value` (`sizes`: the members' extents of an uneven gather)."""
    typ = value.type
    assert isinstance(typ, TensorType)
    shape = list(typ.get_shape())
    n = step.groups.size
    kind = step.kind
    if kind == "all_gather" and sizes is not None:
        shape[step.dim] = sum(sizes)
        op = comm.AllGatherOp(value, step.groups, TensorType(typ.element_type, shape), dim=step.dim)
        op.properties["sizes"] = i64_array(sizes)
        return op
    if kind in ("all_gather",):
        shape[step.dim] *= n
    elif kind in ("reduce_scatter", "local_split"):
        shape[step.dim] //= n
    elif kind == "all_to_all":
        shape[step.dim] //= n
        shape[step.src_dim] *= n
    out = TensorType(typ.element_type, shape)
    match kind:
        case "all_reduce":
            return comm.AllReduceOp(value, step.groups, out)
        case "all_gather":
            return comm.AllGatherOp(value, step.groups, out, dim=step.dim)
        case "reduce_scatter":
            return comm.ReduceScatterOp(value, step.groups, out, dim=step.dim)
        case "local_split":
            return comm.LocalSplitOp(value, step.groups, out, dim=step.dim)
        case "local_zero":
            return comm.LocalZeroOp(value, step.groups, out)
        case "all_to_all":
            return comm.AllToAllOp(value, step.groups, out, split_dim=step.dim, concat_dim=step.src_dim)
    raise PassError(f"lower-reshard: no comm op for step '{step}'")


@dataclass(frozen=True)
class LowerReshard(ModulePass):
    """Lower every `dist.reshard` that has `src`/`dst` layouts into comm ops."""

    name = "lower-reshard"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for reshard in [o for o in op.walk() if isinstance(o, dist.ReshardOp)]:
            if reshard.src is None:
                raise PassError("lower-reshard: a dist.reshard has no src/dst layouts; run specialize-groups first")
            src, dst = reshard.layouts()
            devices = _module_devices(reshard)
            shape: tuple[int, ...] = ()
            try:
                try:
                    steps = plan_transition(src, dst)
                except NotImplementedError:  # the general fallback (an exchange) needs the global shape
                    shape = _global_shape(src, dst, reshard, devices)
                    steps = plan_transition(src, dst, shape)
            except NotImplementedError as err:
                raise PassError(f"lower-reshard: {err}") from None
            value: SSAValue = reshard.input
            block = reshard.parent_block()
            assert block is not None
            for k, step in enumerate(steps):
                if devices is not None and devices.isdisjoint(step.groups.members):
                    continue  # a step inside another device group of the union
                if step.kind == "exchange":
                    step_op = _exchange_op(step, value, reshard, devices, src, dst, shape)
                    block.insert_op_before(step_op, reshard)
                    value = step_op.results[0]
                    continue
                sizes = None
                if step.kind == "all_gather" and len(src.groups) > 1:
                    sizes = _gather_sizes(step, k, src, dst, reshard)
                step_op = _step_op(step, value, sizes)
                block.insert_op_before(step_op, reshard)
                value = step_op.results[0]
            if value.type != reshard.result.type:
                raise PassError(
                    f"lower-reshard: '{src}' -> '{dst}' gives local shape {value.type} "
                    f"but the reshard promises {reshard.result.type}"
                )
            reshard.result.replace_all_uses_with(value)
            reshard.detach()
            reshard.erase()


def _module_devices(op: Operation) -> DeviceRange | None:
    """Return the devices of the physical group module holding `op` (None outside one)."""
    parent = op.parent_op()
    while parent is not None:
        if isinstance(parent, ModuleOp) and DEVICES_ATTR in parent.attributes:
            return devices_of(parent.attributes[DEVICES_ATTR])
        parent = parent.parent_op()
    return None


def _gather_sizes(step: CommStep, k: int, src: Layout, dst: Layout, reshard: dist.ReshardOp) -> tuple[int, ...] | None:
    """Return the members' extents of an all_gather across the groups of `src` (None when equal).

    The extents follow from the global shape, which the reshard's local types give where `dst`
    holds a dim whole (the uneven gather makes the hetero-split dim whole); only a first step
    sees `src`'s pieces.
    """
    if any(step.groups.members.issubset(g.devices) for g in src.groups) or all(
            len({src.group_index(r) for r in g}) == 1 for g in step.groups):
        return None  # each rank group inside one device group: an even gather
    if k != 0:
        raise PassError(f"lower-reshard: '{src}' -> '{dst}': an all_gather across groups must be the first step")
    out_shape = reshard.result.type.get_shape()  # type: ignore[attr-defined]
    whole = [dst.hetero != split(d) and all(d not in g.states.split_dims for g in dst.groups)
             for d in range(len(out_shape))]
    if not all(whole):
        raise PassError(f"lower-reshard: '{src}' -> '{dst}': an uneven all_gather needs the destination whole")
    try:
        sizes = tuple(src.local_shape(r, out_shape)[step.dim] for r in step.groups[0])
    except LayoutError as err:
        raise PassError(f"lower-reshard: '{src}' -> '{dst}': {err}") from None
    return sizes if len(set(sizes)) > 1 else None


def _exchange_op(step: CommStep, value: SSAValue, reshard: dist.ReshardOp,
                 devices: DeviceRange | None, src: Layout, dst: Layout, shape: tuple[int, ...]) -> Operation:
    """Return the `comm.exchange` performing `step`; its result is this group's local piece."""
    typ = value.type
    assert isinstance(typ, TensorType)
    shapes = dict(step.shapes)
    mine = {shapes[d] for d in devices or () if d in shapes}
    if len(mine) > 1:
        raise PassError(f"lower-reshard: an exchange gives the devices {list(devices or ())} different shapes {mine}")
    local = mine.pop() if mine else tuple(reshard.result.type.get_shape())  # type: ignore[attr-defined]
    return comm.ExchangeOp(value, src, dst, shape, TensorType(typ.element_type, list(local)))


def _global_shape(src: Layout, dst: Layout, reshard: dist.ReshardOp,
                  devices: DeviceRange | None) -> tuple[int, ...]:
    """Return the global shape of the reshard: the one specialize-groups recorded, else the one the
    reshard's local types imply for one of this module's devices (IR written without it).

    A dim split across groups by shares is found by search (every extent whose pieces fit both
    local types); an ambiguous one is an error.
    """
    if reshard.global_type is not None:  # recorded by specialize-groups
        return tuple(reshard.global_type.get_shape())  # type: ignore[attr-defined]
    if not devices:
        raise PassError(f"lower-reshard: '{src}' -> '{dst}' needs the global shape, found only inside a group module")
    r = devices[0]
    ins = tuple(reshard.input.type.get_shape())  # type: ignore[attr-defined]
    outs = tuple(reshard.result.type.get_shape())  # type: ignore[attr-defined]
    guess = []
    for d, n in enumerate(ins):
        guess.append([n * src.groups[src.group_index(r)].states.degree(split(d))])
        if src.hetero == split(d) and len(src.groups) > 1:
            if dst.hetero != split(d) or len(dst.groups) == 1:
                guess[d] = [outs[d] * dst.groups[dst.group_index(r)].states.degree(split(d))]
            else:
                guess[d] = list(range(1, (guess[d][0] + 1) * sum(src.shares or (1,) * len(src.groups)) + 1))
    found = []
    for shape in itertools.product(*guess):
        try:
            if src.local_shape(r, shape) == ins and dst.local_shape(r, shape) == outs:
                found.append(tuple(shape))
        except LayoutError:
            pass
    found = sorted(set(found))
    if len(found) != 1:
        raise PassError(f"lower-reshard: '{src}' -> '{dst}': cannot tell the global shape from local types "
                        f"{list(ins)} -> {list(outs)} (candidates {found})")
    return found[0]
