"""`specialize-groups`: annotated IR -> physical IR, one module per device group.

The step function and the functions it calls are cloned once per device group (the groups
of the layouts in the functions: for a single SPMD group, one module). In each clone every tensor type becomes the
local piece of that group's devices (`Layout.local_shape`), without layout. Parameters and
inputs keep their annotated type as `global_type`, so that the runtime can cut its piece of
the global value; `dist.reshard` keeps its two layouts as `src`/`dst` for `lower-reshard`.
The program is the same for every rank of a group: it does not grow with the group's size.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, StringAttr, TensorType
from xdsl.passes import ModulePass
from xdsl.rewriter import Rewriter

from hspmd.dialects import dist, graph
from hspmd.dialects.dist import LayoutAttr, layout_of, without_layout
from hspmd.ir.devices import DeviceRange
from hspmd.ir.layout import Layout, LayoutError
from hspmd.dialects.levels import DEVICES_ATTR, devices_attr
from hspmd.transforms.util import PassError, step_function


def device_groups(functions: list[func.FuncOp]) -> list[DeviceRange]:
    """Return the device groups of the layouts in `functions`, in first-seen order (ranges: found
    per group, never per device)."""
    groups: list[DeviceRange] = []
    seen: set[Layout] = set()
    for fn in functions:
        for v in (*fn.body.block.args, *(r for op in fn.walk() for r in op.results)):
            lay = layout_of(v)
            if lay is None or lay in seen:
                continue
            seen.add(lay)
            for g in lay.groups:
                if g.devices not in groups:
                    if any(not g.devices.isdisjoint(h) for h in groups):
                        raise PassError(
                            f"specialize-groups: device group {list(g.devices)} overlaps another group; "
                            "layouts that regroup devices are not supported yet"
                        )
                    groups.append(g.devices)
    return groups


def _local_type(typ: TensorType, group: DeviceRange, what: str) -> TensorType:
    lay = layout_of(typ)
    if lay is None:
        raise PassError(f"specialize-groups: {what} has no layout; run propagate-layouts first")
    if not any(group[0] in g.devices for g in lay.groups):
        raise PassError(f"specialize-groups: {what} with layout '{lay}' does not live on devices {list(group)}")
    try:
        return without_layout(typ, lay.local_shape(group[0], typ.get_shape()))
    except LayoutError as err:
        raise PassError(f"specialize-groups: {what}: {err}") from None


@dataclass(frozen=True)
class SpecializeGroups(ModulePass):
    """Replace the annotated module's body by one local-shape module per device group."""

    name = "specialize-groups"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        step_function(op)
        functions = [f for f in op.body.block.ops if isinstance(f, func.FuncOp)]
        groups = device_groups(functions)
        if not groups:
            raise PassError("specialize-groups: no layouts in the step function; the input is not annotated IR")
        modules = []
        for gi, group in enumerate(groups):
            clones = [self._localize(fn.clone(), group) for fn in functions]
            module = ModuleOp(clones, attributes={DEVICES_ATTR: devices_attr(group)})
            module.sym_name = StringAttr(f"group{gi}")
            modules.append(module)
        for fn in functions:
            fn.detach()
            fn.erase()
        for m in modules:
            op.body.block.add_op(m)

    @staticmethod
    def _localize(fn: func.FuncOp, group: DeviceRange) -> func.FuncOp:
        """Return `fn` with every type made local to `group` (arguments and signature included)."""
        for o in fn.walk():  # record global facts before any type becomes local
            if isinstance(o, (graph.ParameterOp, graph.InputOp)) or getattr(o, "RECORDS_GLOBAL_TYPE", False):
                o.properties["global_type"] = o.results[0].type
            if isinstance(o, dist.ReshardOp) and o.src is None:
                src, dst = o.layouts()
                o.properties["src"], o.properties["dst"] = LayoutAttr(src), LayoutAttr(dst)
        name = fn.sym_name.data
        for arg in list(fn.body.block.args):
            if isinstance(arg.type, TensorType) and layout_of(arg) is not None:
                Rewriter.replace_value_with_new_type(arg, _local_type(arg.type, group, f"an argument of @{name}"))
        for o in list(fn.walk()):
            for v in o.results:
                if isinstance(v.type, TensorType) and layout_of(v) is not None:
                    Rewriter.replace_value_with_new_type(v, _local_type(v.type, group, f"a value of '{o.name}'"))
        fn.update_function_type()
        return fn
