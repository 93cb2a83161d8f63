"""`pipeline-split`: the pipeline passes in order, for each pipelined group of the strategy.

    for each pipelined group K (of the module's strategy, in order):
        cut-stacked-layers{group=K}         stacked layers cut into each stage's pieces
        assign-pipeline-stages{group=K}     each op of the stage-shaped step: `pipeline.stage = S`
        outline-pipeline-stages{group=K}    the stage modules (`pipeline.run`, send/recv)
        join-pipeline-groups{group=K}       beside other groups: remap and re-order them

A later group is assigned after the earlier ones are joined (the join may re-order the steps
of the groups not cut yet). `hspmd.compiler.physical_passes` lists the same passes.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from hspmd.ir.strategy import StrategyRecord
from hspmd.transforms.pipeline.assign_stages import AssignPipelineStages
from hspmd.transforms.pipeline.cut_stacks import CutStackedLayers
from hspmd.transforms.pipeline.join_groups import JoinPipelineGroups
from hspmd.transforms.pipeline.outline_stages import OutlinePipelineStages
from hspmd.transforms.pipeline.virtual import pipelines
from hspmd.transforms.util import module_strategy

__all__ = ["PipelineSplit", "pipeline_split_passes"]


def pipeline_split_passes(record: StrategyRecord) -> list[ModulePass]:
    """Return the passes that cut every pipelined group of `record`'s strategy into stages."""
    out: list[ModulePass] = []
    for k, pipe in enumerate(pipelines(record.strategy, record.microbatches)):
        out += [CutStackedLayers(strategy_id=record.id, group=k), AssignPipelineStages(strategy_id=record.id, group=k),
                OutlinePipelineStages(strategy_id=record.id, group=k)]
        if pipe.union is not None:
            out.append(JoinPipelineGroups(strategy_id=record.id, group=k))
    return out


@dataclass(frozen=True)
class PipelineSplit(ModulePass):
    """Cut each pipelined group's stage-shaped physical step into one group module per stage."""

    name = "pipeline-split"

    #: the id of the module's strategy to read (None: its only one)
    strategy_id: int | None = None

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for p in pipeline_split_passes(module_strategy(op, self.strategy_id, self.name)):
            p.apply(ctx, op)
