"""`insert-reshard`: add `dist.reshard` wherever a consumer needs another layout than it gets.

Runs after `propagate-layouts`. For each op, its sharding rule (or, for outputs, "replicated",
and for assigns, "the parameter's layout") says which layout each operand needs; an operand
whose type carries another gets a `dist.reshard` in front of the op. Reshards of one value to
one layout are shared by all its consumers. An op whose rule gives its result another layout
than the result is typed with (a user's annotation, or a consumer's need that the producer
cannot meet, e.g. a reshape asked to split a dim its rule blocks) gets its result retyped to
what it gives and a `dist.reshard` after it to the typed layout. The result is annotated IR.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.dialects import func
from xdsl.ir import Block, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import Rewriter

from hspmd.dialects import graph
from hspmd.dialects.dist import ReshardOp, layout_of, with_layout
from hspmd.dialects.sharding import ShardingError, infer, rule_for
from hspmd.ir.layout import Layout
from hspmd.transforms.propagate_layouts import required_operand_layouts
from hspmd.transforms.util import PassError, scan_carries, step_function


@dataclass(frozen=True)
class InsertReshard(ModulePass):
    """Insert `dist.reshard` between producers and consumers whose layouts differ."""

    name = "insert-reshard"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        step_function(op)  # the module must have a step function
        carries = scan_carries(op)
        for fn in [f for f in op.body.block.ops if isinstance(f, func.FuncOp)]:
            self._insert(fn.body.block, carries.get(fn.sym_name.data, set()))
            if fn.sym_name.data in carries:  # a carried result resharded to its argument's layout
                fn.update_function_type()

    @staticmethod
    def _insert(block: Block, carries: set[tuple[int, int]] = frozenset()) -> None:  # type: ignore[assignment]
        """Insert the reshards one function body needs (callees included: they are functions too).
        `carries` are the (argument, result) pairs a scan feeds back: the returned value must have
        its argument's layout."""
        layouts: dict[SSAValue, Layout] = {}
        for v in (*block.args, *(r for o in block.ops for r in o.results)):
            if (lay := layout_of(v)) is not None:
                layouts[v] = lay
        params = {o.tensor_name.data: layouts[o.result] for o in block.ops if isinstance(o, graph.ParameterOp)}
        made: dict[tuple[SSAValue, Layout], SSAValue] = {}
        for o in list(block.ops):
            if isinstance(o, func.ReturnOp) and carries:
                needs_of_return: list[Layout | None] = [None] * len(o.operands)
                for j, k in carries:
                    needs_of_return[k] = layouts.get(block.args[j])
            elif rule_for(o) is None and not isinstance(o, (graph.OutputOp, graph.AssignOp, func.CallOp, graph.ScanOp)):
                continue
            got: tuple[Layout, ...] = ()
            try:
                needs = (needs_of_return if isinstance(o, func.ReturnOp)
                         else required_operand_layouts(o, layouts, params))
                if rule_for(o) is not None:
                    hint = layouts.get(o.results[0]) if len(o.results) == 1 else None
                    got = infer(o, [layouts.get(v) for v in o.operands], hint).results
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
            for v, lay in zip(list(o.results), got):
                typed = layouts.get(v)
                if typed is None or typed == lay:
                    continue
                # the op gives `lay`: type its result so, and reshard that to what the result was typed
                given = Rewriter.replace_value_with_new_type(v, with_layout(v.type, lay))
                reshard = ReshardOp(given, with_layout(given.type, typed))
                block.insert_op_after(reshard, o)
                given.replace_uses_with_if(reshard.result, lambda use: use.operation is not reshard)
                del layouts[v]
                layouts[given], layouts[reshard.result] = lay, typed
