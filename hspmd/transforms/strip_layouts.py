"""`strip-layouts`: annotated IR back to logical IR — the same ops on global shapes, no layouts.

Every `dist.reshard` goes (its users read its operand), every tensor type loses its layout
encoding (values, block arguments, function signatures), and the module's recorded strategies
(`dist.strategies`) go. What `apply-strategy` rewrote for a strategy stays rewritten (the
vocabulary-parallel cross-entropy is a logical program too): the result computes what the
annotated program computes, on one device.

`hspmd compare` runs an annotated file's 1-device reference through it, and `hspmd reduce`
re-annotates a stripped program under a smaller strategy (fewer groups or stages).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.passes import ModulePass
from xdsl.rewriter import Rewriter

from hspmd.dialects import dist
from hspmd.dialects.dist import STRATEGIES_ATTR, layout_of, without_layout
from hspmd.transforms.util import PassError


def strip_layouts(module: ModuleOp) -> ModuleOp:
    """Strip `module` (annotated IR) in place to logical IR (see the module docstring); return it."""
    for op in module.walk():
        if op.dialect_name() == "comm" or (isinstance(op, dist.ReshardOp) and op.src is not None):
            raise PassError(f"strip-layouts takes annotated IR; '{op.name}' is physical (specialize-groups ran)")
    for op in list(module.walk()):
        for region in op.regions:
            for block in region.blocks:
                for arg in list(block.args):
                    if isinstance(arg.type, TensorType) and layout_of(arg) is not None:
                        Rewriter.replace_value_with_new_type(arg, without_layout(arg.type))
        for v in op.results:
            if isinstance(v.type, TensorType) and layout_of(v) is not None:
                Rewriter.replace_value_with_new_type(v, without_layout(v.type))
    for op in list(module.walk()):
        if isinstance(op, dist.ReshardOp):
            op.result.replace_all_uses_with(op.input)
            op.detach()
            op.erase()
    for op in module.walk():
        if isinstance(op, func.FuncOp) and not op.is_declaration:
            op.update_function_type()
    module.attributes.pop(STRATEGIES_ATTR, None)
    return module


@dataclass(frozen=True)
class StripLayouts(ModulePass):
    """Annotated IR to logical IR: reshards, layouts and the recorded strategies dropped."""

    name = "strip-layouts"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        strip_layouts(op)
