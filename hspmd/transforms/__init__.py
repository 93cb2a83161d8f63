"""Passes over hspmd IR, one per file, each registered here under its kebab-case name.

`get_all_passes()` maps names to loaders so that importing the registry imports no pass;
`hspmd-opt -p name{opt=value}` and `build_passes` speak the same names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from xdsl.passes import ModulePass, PassPipeline

# name -> "module:Class"
_PASSES = {
    "stack-layers": "hspmd.transforms.stack_layers:StackLayers",
    "recompute": "hspmd.transforms.recompute:Recompute",
    "autodiff": "hspmd.transforms.autodiff:Autodiff",
    "sgd": "hspmd.transforms.sgd:SGD",
    "adam": "hspmd.transforms.adam:Adam",
    "clip-grad-norm": "hspmd.transforms.clip_grad_norm:ClipGradNorm",
    "dynamic-loss-scale": "hspmd.transforms.dynamic_loss_scale:DynamicLossScale",
    "apply-strategy": "hspmd.transforms.apply_strategy:ApplyStrategy",
    "apply-annotations": "hspmd.transforms.apply_annotations:ApplyAnnotations",
    "shard-optimizer-state": "hspmd.transforms.shard_optimizer_state:ShardOptimizerState",
    "shard-parameters": "hspmd.transforms.shard_parameters:ShardParameters",
    "propagate-layouts": "hspmd.transforms.propagate_layouts:PropagateLayouts",
    "insert-reshard": "hspmd.transforms.insert_reshard:InsertReshard",
    "reuse-resharded-residuals": "hspmd.transforms.reuse_resharded_residuals:ReuseReshardedResiduals",
    "lower-reshard": "hspmd.transforms.lower_reshard:LowerReshard",
    "specialize-groups": "hspmd.transforms.specialize_groups:SpecializeGroups",
    "cut-stacked-layers": "hspmd.transforms.pipeline.cut_stacks:CutStackedLayers",
    "assign-pipeline-stages": "hspmd.transforms.pipeline.assign_stages:AssignPipelineStages",
    "outline-pipeline-stages": "hspmd.transforms.pipeline.outline_stages:OutlinePipelineStages",
    "join-pipeline-groups": "hspmd.transforms.pipeline.join_groups:JoinPipelineGroups",
    "pipeline-split": "hspmd.transforms.pipeline.split:PipelineSplit",
    "shard-stage-optimizer": "hspmd.transforms.pipeline.shard_stage_optimizer:ShardStageOptimizer",
    "fuse-kernels": "hspmd.transforms.fuse_kernels:FuseKernels",
    "device-kernels": "hspmd.transforms.device_kernels:DeviceKernels",
    "flash-attention": "hspmd.transforms.flash_attention:FlashAttention",
    "multi-tensor": "hspmd.transforms.multi_tensor:MultiTensor",
    "coalesce-group-sums": "hspmd.transforms.coalesce_group_sums:CoalesceGroupSums",
    "strip-layouts": "hspmd.transforms.strip_layouts:StripLayouts",
}


def _loader(target: str) -> Callable[[], type[ModulePass]]:
    def load() -> type[ModulePass]:
        module, cls = target.split(":")
        return getattr(importlib.import_module(module), cls)

    return load


def get_all_passes() -> dict[str, Callable[[], type[ModulePass]]]:
    """Return {pass name: loader of its ModulePass class} for every hspmd pass."""
    return {name: _loader(target) for name, target in _PASSES.items()}


def build_passes(spec: str, extra: dict[str, Callable[[], type[ModulePass]]] | None = None) -> list[ModulePass]:
    """Return the passes a textual pipeline spec (`a,b{opt=1}`) names."""
    available = {**get_all_passes(), **(extra or {})}
    return list(PassPipeline.parse_spec(available, spec).passes)
