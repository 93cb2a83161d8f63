"""`insert-reshard`: add `dist.reshard` wherever a consumer needs another layout than it gets.

Runs after `propagate-layouts`. For each op, its sharding rule (or, for outputs, "replicated",
and for assigns, "the parameter's layout") says which layout each operand needs; an operand
whose type carries another gets a `dist.reshard` in front of the op. Reshards of one value to
one layout are shared by all its consumers. The result is annotated IR.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import SSAValue
from xdsl.passes import ModulePass

from hspmd.dialects import graph
from hspmd.dialects.dist import ReshardOp, layout_of, with_layout
from hspmd.dialects.sharding import ShardingError, infer, rule_for
from hspmd.ir.layout import Layout
from hspmd.transforms.propagate_layouts import required_operand_layouts
from hspmd.transforms.util import PassError, step_function


@dataclass(frozen=True)
class InsertReshard(ModulePass):
    """Insert `dist.reshard` between producers and consumers whose layouts differ."""

    name = "insert-reshard"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        block = step_function(op).body.block
        layouts: dict[SSAValue, Layout] = {}
        for o in block.ops:
            for v in o.results:
                if (lay := layout_of(v)) is not None:
                    layouts[v] = lay
        params = {o.tensor_name.data: layouts[o.result] for o in block.ops if isinstance(o, graph.ParameterOp)}
        made: dict[tuple[SSAValue, Layout], SSAValue] = {}
        for o in list(block.ops):
            if rule_for(o) is None and not isinstance(o, (graph.OutputOp, graph.AssignOp)):
                continue
            try:
                needs = required_operand_layouts(o, layouts, params)
                if rule_for(o) is not None:
                    hint = layouts.get(o.results[0]) if len(o.results) == 1 else None
                    got = infer(o, [layouts.get(v) for v in o.operands], hint).results
                    for v, lay in zip(o.results, got):
                        if layouts.get(v) != lay:
                            raise PassError(
                                f"insert-reshard: '{o.name}' gives {lay} but its result is typed {layouts.get(v)}; "
                                "run propagate-layouts again"
                            )
            except ShardingError as err:
                raise PassError(f"insert-reshard: {err}") from None
            for i, (v, need) in enumerate(zip(o.operands, needs)):
                if need is None or layouts.get(v) == need:
                    continue
                key = (v, need)
                if key not in made:
                    reshard = ReshardOp(v, with_layout(v.type, need))
                    block.insert_op_before(reshard, o)
                    made[key] = reshard.result
                    layouts[reshard.result] = need
                o.operands[i] = made[key]
