"""`apply-strategy`: turn strategy text into layouts on the step's parameters and inputs.

`apply-strategy{strategy="[0,1]: dp=2"}` sets the type of every `graph.parameter` to a
layout replicated over the devices, and of every `graph.input` to one split along its first
(batch) dim over the data-parallel degree. Other values are left to `propagate-layouts`.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass
from xdsl.rewriter import Rewriter

from hspmd.dialects import graph
from hspmd.dialects.dist import with_layout
from hspmd.frontend.strategy import Strategy, StrategyError, parse_strategy
from hspmd.ir.layout import DistributedStates, Layout, LayoutError, split
from hspmd.transforms.util import PassError, step_function


def strategy_layouts(strategy: Strategy) -> tuple[Layout, Layout]:
    """Return (parameter layout, batch layout) for a data-parallel strategy of one group."""
    if len(strategy.groups) != 1:
        raise PassError(
            f"strategy '{strategy}' has {len(strategy.groups)} device groups; "
            "heterogeneous groups are not supported yet: use one group"
        )
    (group,) = strategy.groups
    if group.tp != 1 or group.pp != 1:
        raise PassError(f"strategy '{strategy}': tensor and pipeline parallelism are not supported yet (tp=1, pp=1)")
    params = Layout.replicated(group.devices)
    batch = Layout.spmd(group.devices, DistributedStates.of((split(0), group.dp)))
    return params, batch


@dataclass(frozen=True)
class ApplyStrategy(ModulePass):
    """Lay out parameters and inputs as the strategy says."""

    name = "apply-strategy"
    strategy: str = "[0]: dp=1"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        try:
            strategy = parse_strategy(self.strategy)
        except StrategyError as err:
            raise PassError(str(err)) from None
        params, batch = strategy_layouts(strategy)
        for leaf in list(step_function(op).body.block.ops):
            if isinstance(leaf, (graph.ParameterOp, graph.InputOp)):
                layout = params if isinstance(leaf, graph.ParameterOp) else batch
                kind = "parameter" if isinstance(leaf, graph.ParameterOp) else "input"
                shape = leaf.result.type.get_shape()
                if isinstance(leaf, graph.InputOp) and not shape:
                    layout = params
                try:
                    layout.check_shape(shape, f"{kind} '{leaf.tensor_name.data}'")
                except LayoutError as err:
                    raise PassError(str(err)) from None
                Rewriter.replace_value_with_new_type(leaf.result, with_layout(leaf.result.type, layout))
