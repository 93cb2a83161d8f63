"""Device renaming and what comm ops say about devices: shared by the pipeline passes.

A pipeline pass renames the virtual devices of a stage-shaped program onto a stage's real ones
(`remap_op` with a `Remap`), asks which devices a collective names (`comm_devices`) or moves
data to (`partners`), and walks a stage's program as a rank runs it (`executed_ops`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.ir import Operation

from hspmd.dialects import comm, pipeline
from hspmd.dialects.dist import LayoutAttr, layout_of, with_layout
from hspmd.ir.layout import Group, Layout
from hspmd.transforms.util import PassError

__all__ = ["DeviceMap", "Remap", "comm_devices", "comm_signature", "executed_ops", "functions", "partners",
           "rank_groups", "remap_layout", "remap_op", "train_step"]


def rank_groups(o: Operation) -> list[list[int]]:
    """Return a collective's rank groups (none for an op without them)."""
    groups = getattr(o, "rank_groups", None)
    return [list(g) for g in groups] if groups is not None else []


def remap_layout(layout: Layout, mapping: Mapping[int, int]) -> Layout:
    """Return `layout` with each device d replaced by mapping.get(d, d) (states, hetero, shares kept)."""
    groups = tuple(Group(tuple(mapping.get(d, d) for d in g.devices), g.states) for g in layout.groups)
    return Layout(groups, layout.hetero, layout.shares)


def comm_devices(o: Operation) -> set[int]:
    """Return every device a comm op names (its rank groups, an exchange's layouts' devices)."""
    if isinstance(o, comm.ExchangeOp):
        return set(o.members())
    if isinstance(o, (comm.SendOp, comm.RecvOp)):
        return {d for p in comm.groups_of(o.pairs) for d in p}
    return {d for g in rank_groups(o) for d in g}


def partners(o: Operation, own: set[int] | frozenset[int]) -> set[int]:
    """Return the devices outside `own` that comm op `o` moves data to or from a device of `own`:
    members of a rank group with one of `own`, the other end of an exchange's transfer."""
    if isinstance(o, comm.ExchangeOp):
        out: set[int] = set()
        for src, dst, _ in o.transfer_list():
            if (src in own) != (dst in own):
                out.add(dst if src in own else src)
        return out
    groups = comm.groups_of(o.pairs) if isinstance(o, (comm.SendOp, comm.RecvOp)) else rank_groups(o)
    return {d for g in groups if set(g) & own for d in g if d not in own}


def comm_signature(o: Operation) -> tuple:
    """Return what must agree between the ends of one collective in two programs (kind and ranks)."""
    if isinstance(o, comm.ExchangeOp):
        return (o.name, str(o.src.data), str(o.dst.data), o.global_shape())
    return (o.name, tuple(sorted(tuple(g) for g in rank_groups(o))))


class Remap(Protocol):
    """How one stage renames what names the virtual devices: rank groups and layouts."""

    def groups(self, groups: Sequence[Sequence[int]]) -> list[list[int]]: ...

    def layout(self, layout: Layout) -> Layout: ...


@dataclass(frozen=True)
class DeviceMap:
    """A Remap that renames devices one to one (`mapping.get(d, d)`)."""

    mapping: Mapping[int, int]

    def groups(self, groups: Sequence[Sequence[int]]) -> list[list[int]]:
        return [[self.mapping.get(d, d) for d in g] for g in groups]

    def layout(self, layout: Layout) -> Layout:
        return remap_layout(layout, self.mapping)


def remap_op(o: Operation, remap: Remap | Mapping[int, int]) -> None:
    """Rename devices in op `o` in place: rank groups, exchange layouts, layouts in its properties."""
    if isinstance(remap, Mapping):
        remap = DeviceMap(remap)
    if hasattr(o, "rank_groups") and o.dialect_name() == "comm":
        o.properties["groups"] = comm.groups_attr(remap.groups(rank_groups(o)))
    for key, value in list(o.properties.items()):
        if isinstance(value, LayoutAttr):
            o.properties[key] = LayoutAttr(remap.layout(value.data))
        elif isinstance(value, TensorType) and (layout := layout_of(value)) is not None:
            o.properties[key] = with_layout(value, remap.layout(layout))


def functions(module: ModuleOp) -> list[func.FuncOp]:
    """Return the functions of a group module, in order."""
    return [f for f in module.body.block.ops if isinstance(f, func.FuncOp)]


def train_step(module: ModuleOp, what: str = "pipeline-split") -> func.FuncOp:
    """Return the group module's @train_step."""
    for f in functions(module):
        if f.sym_name.data == "train_step":
            return f
    raise PassError(f"{what}: a group module has no @train_step")


def executed_ops(module: ModuleOp) -> list[Operation]:
    """Return the ops of a group's @train_step in the order a rank runs them: a `pipeline.run`
    replaced by the bodies of its forward and backward, action by action of its schedule."""
    funcs = {f.sym_name.data: f for f in functions(module)}
    out: list[Operation] = []
    for o in train_step(module).body.block.ops:
        if isinstance(o, pipeline.RunOp):
            for kind, _ in pipeline.actions(o):
                ref = o.forward if kind == "F" else o.backward
                out.extend(x for x in funcs[ref.root_reference.data].body.block.ops if not isinstance(x, func.ReturnOp))
        else:
            out.append(o)
    return out
