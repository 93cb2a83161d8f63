"""The three IR levels and their verifiers, plus the physical module's device-group structure.

- logical: `graph` ops on global shapes, no layout anywhere, no `dist`/`comm` op but `dist.annotate`;
- annotated: every tensor value has a layout in its type's encoding; `dist.reshard` allowed;
- physical: a `builtin.module` holding one nested module per device group (attribute
  `hspmd.devices`, a range: `#dist.devices<"0-4095">`; IR written before ranges lists them,
  `array<i64: 0, 1>`, and still reads), local shapes, no layouts except in `global_type` of
  parameters/inputs.
"""

from __future__ import annotations

from xdsl.dialects import func
from xdsl.dialects.builtin import DenseArrayBase, ModuleOp, NoneAttr, TensorType
from xdsl.ir import Attribute

from hspmd.dialects.dist import DevicesAttr
from hspmd.ir.devices import DeviceRange

DEVICES_ATTR = "hspmd.devices"
LEVELS = ("logical", "annotated", "physical")


class LevelError(Exception):
    """IR is not well-formed for the level it claims to be at; names the op and why."""


def _tensor_values(module: ModuleOp):
    for op in module.walk():
        if isinstance(op, (ModuleOp, func.FuncOp)):
            continue
        for v in (*op.operands, *op.results):
            if isinstance(v.type, TensorType):
                yield op, v


def verify_logical(module: ModuleOp) -> None:
    """Raise LevelError unless `module` is logical IR."""
    for op in module.walk():
        if op.dialect_name() in ("dist", "comm") and op.name != "dist.annotate":
            raise LevelError(f"logical IR cannot hold '{op.name}'")
    for op, v in _tensor_values(module):
        if not isinstance(v.type.encoding, NoneAttr):
            raise LevelError(f"logical IR has a layout on a value of '{op.name}'")


def verify_annotated(module: ModuleOp) -> None:
    """Raise LevelError unless every tensor value has a layout and every op obeys its sharding rule."""
    from hspmd.dialects.dist import LayoutAttr, layout_of
    from hspmd.dialects.sharding import ShardingError, infer, rule_for

    for op, v in _tensor_values(module):
        if not isinstance(v.type.encoding, LayoutAttr):
            raise LevelError(f"annotated IR: a value of '{op.name}' has no layout")
    for op in module.walk():
        if op.dialect_name() == "comm":
            raise LevelError(f"annotated IR cannot hold '{op.name}'; collectives appear after specialize-groups")
        if op.name == "dist.annotate":
            raise LevelError("annotated IR cannot hold 'dist.annotate'; apply-annotations turns it into a dist.reshard")
        if rule_for(op) is None:
            continue
        ins = [layout_of(v) for v in op.operands]
        outs = [layout_of(v) for v in op.results]
        try:
            inference = infer(op, ins, outs[0] if len(outs) == 1 else None)
        except ShardingError as err:
            raise LevelError(f"annotated IR: {err}") from None
        if list(inference.operands) != ins or list(inference.results) != outs:
            raise LevelError(
                f"annotated IR: '{op.name}' with operands {', '.join(map(str, ins))} gives "
                f"{', '.join(map(str, inference.results))}, not {', '.join(map(str, outs))}; insert dist.reshard"
            )


def devices_of(attr: Attribute) -> DeviceRange:
    """Return the devices an `hspmd.devices` attribute names (a range, or an old listed array)."""
    if isinstance(attr, DevicesAttr):
        return attr.data
    assert isinstance(attr, DenseArrayBase)
    return DeviceRange.of(attr.get_values())


def physical_groups(module: ModuleOp) -> list[tuple[DeviceRange, ModuleOp]]:
    """Return (devices, group module) for each device group of a physical module."""
    groups = []
    for op in module.body.block.ops:
        if isinstance(op, ModuleOp) and DEVICES_ATTR in op.attributes:
            groups.append((devices_of(op.attributes[DEVICES_ATTR]), op))
    if not groups and DEVICES_ATTR in module.attributes:
        groups.append((devices_of(module.attributes[DEVICES_ATTR]), module))
    return groups


def devices_attr(devices) -> DevicesAttr:
    """Return the `hspmd.devices` attribute value for a device set (a range where it is one)."""
    return DevicesAttr(DeviceRange.of(devices))


def verify_physical(module: ModuleOp) -> None:
    """Raise LevelError unless `module` is physical IR: device groups, local shapes, no dist ops."""
    groups = physical_groups(module)
    if not groups:
        raise LevelError(f"physical IR needs modules with a '{DEVICES_ATTR}' attribute")
    for i, (devices, group) in enumerate(groups):
        for other, _ in groups[:i]:
            if not devices.isdisjoint(other):
                raise LevelError(f"device groups overlap on {sorted(set(other) & set(devices))}")
        for op in group.walk():
            if op.dialect_name() == "dist":
                raise LevelError(f"physical IR cannot hold '{op.name}'; run lower-reshard")
        for op, v in _tensor_values(group):
            if not isinstance(v.type.encoding, NoneAttr):
                raise LevelError(f"physical IR has a layout on a value of '{op.name}'; run specialize-groups")
