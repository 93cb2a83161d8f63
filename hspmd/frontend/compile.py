"""Compiling a model script: trace, then the pass pipelines, level by level, into a bundle."""

from __future__ import annotations

import os
from dataclasses import dataclass

from xdsl.dialects.builtin import ModuleOp

from hspmd.frontend.optim import Optimizer
from hspmd.frontend.script import ModelScript, loss_scale, script_optimizer, trace_script
from hspmd.frontend.strategy import Strategy, parse_strategy
from hspmd.ir.context import module_text
from hspmd.ir.levels import physical_groups, verify_annotated, verify_logical, verify_physical
from hspmd.runtime.bundle import GroupEntry, Manifest, atomic_write_text, write_manifest
from hspmd.transforms.pipeline import PHYSICAL_PIPELINE, annotate_pipeline, run_passes
from hspmd.transforms.util import PassError


def pipeline_stages(strategy: Strategy) -> tuple[int, ...] | None:
    """Return the stage devices of a pipeline strategy (`[0,1]: pp=2` -> (0, 1)); None without pp.

    A pipeline's step is compiled for one group (the annotated level is that of `[d0]: dp=1`, or
    with m micro-batches `[0..m-1]: dp=m`, one virtual device per micro-batch), then
    `pipeline-split` cuts the physical step into one program per stage.
    """
    if not any(g.pp > 1 for g in strategy.groups):
        return None
    if len(strategy.groups) != 1 or strategy.groups[0].dp != 1 or strategy.groups[0].tp != 1:
        raise PassError(f"strategy '{strategy}': pipeline parallelism is supported with one group and "
                        "dp=1 tp=1 (one device per stage) only, not yet combined with dp, tp or other groups")
    return tuple(strategy.groups[0].devices)


def _check_microbatches(logical: ModuleOp, m: int) -> None:
    """Raise PassError unless m >= 1 divides the batch dim (dim 0) of every non-scalar input."""
    from hspmd.dialects import graph

    if m < 1:
        raise PassError(f"microbatches={m}: the number of micro-batches must be >= 1")
    for op in logical.walk():
        if isinstance(op, graph.InputOp) and op.result.type.get_shape() and op.result.type.get_shape()[0] % m:
            raise PassError(f"microbatches={m}: input '{op.tensor_name.data}' has batch dim "
                            f"{op.result.type.get_shape()[0]}, which {m} micro-batches do not divide")


def default_strategy(n: int) -> str:
    """Return the data-parallel strategy over `n` devices (`[0,1]: dp=2` for n=2)."""
    devices = ",".join(str(i) for i in range(n)) if n < 3 else f"0-{n - 1}"
    return f"[{devices}]: dp={n}"


@dataclass
class Compiled:
    """The three levels of one compiled training step."""

    script: ModelScript
    strategy: str
    logical: ModuleOp
    annotated: ModuleOp
    physical: ModuleOp
    # the learning-rate schedule the runtime feeds as input "lr" (hspmd.runtime.schedule spec)
    lr_schedule: dict | None = None


def compile_script(
    script: ModelScript, strategy: str, num_devices: int | None = None, optimizer: Optimizer | bool = True,
    microbatches: int | None = None, pipeline_schedule: str | None = None,
) -> Compiled:
    """Return the logical, annotated and physical IR of the script's training step.

    `optimizer`: True uses the script's `optimizer(config)` (plain SGD with `config["lr"]` if it
    has none), an `hspmd.optim` optimizer overrides it, and False compiles no update at all:
    the step then outputs every gradient as `grad:NAME`.

    With pipeline parallelism (`pp` > 1), `microbatches` (default: the script's
    `config["microbatches"]`, else 1) micro-batches run through the stages in the order of
    `pipeline_schedule` (default `config["pipeline_schedule"]`, else "gpipe") and their
    gradients are summed before the update.
    """
    parsed = parse_strategy(strategy)
    if num_devices is not None:
        parsed.check_devices(num_devices)
    logical = trace_script(script)
    opt = script_optimizer(script) if optimizer is True else optimizer or None
    scale = loss_scale(script)
    autodiff = "autodiff" if scale == 1.0 else f"autodiff{{loss_scale={scale!r}}}"
    run_passes(logical, autodiff + (f",{opt.pipeline()}" if opt is not None else ""))
    verify_logical(logical)
    stages = pipeline_stages(parsed)
    split, annotate_as = "", str(parsed)
    if stages:
        # one stage's step is compiled as data parallel over one virtual device per micro-batch:
        # its all-reduces are where pipeline-split sums the micro-batches' gradients (and losses)
        m = int(microbatches if microbatches is not None else script.config.get("microbatches", 1))
        schedule = str(pipeline_schedule or script.config.get("pipeline_schedule", "gpipe"))
        _check_microbatches(logical, m)
        annotate_as = f"[{','.join(map(str, range(m)))}]: dp={m}" if m > 1 else f"[{stages[0]}]: dp=1"
        split = (f',pipeline-split{{devices="{",".join(map(str, stages))}" microbatches={m} '
                 f'schedule="{schedule}"}}')
    annotated = logical.clone()
    run_passes(annotated, annotate_pipeline(annotate_as))
    verify_annotated(annotated)
    physical = annotated.clone()
    run_passes(physical, PHYSICAL_PIPELINE + split)
    verify_physical(physical)
    return Compiled(script, str(parsed), logical, annotated, physical, opt.schedule_spec() if opt is not None else None)


def write_bundle(compiled: Compiled, directory: str) -> str:
    """Write the levels and the manifest of `compiled` into `directory`; return the directory."""
    os.makedirs(directory, exist_ok=True)
    atomic_write_text(os.path.join(directory, "logical.mlir"), module_text(compiled.logical))
    atomic_write_text(os.path.join(directory, "annotated.mlir"), module_text(compiled.annotated))
    groups = []
    for gi, (devices, module) in enumerate(physical_groups(compiled.physical)):
        name = f"physical_group{gi}.mlir"
        atomic_write_text(os.path.join(directory, name), module_text(module))
        groups.append(GroupEntry(list(devices), name))
    manifest = Manifest(
        script=compiled.script.path,
        config={**compiled.script.config, "lr_schedule": compiled.lr_schedule},
        strategy=compiled.strategy,
        num_devices=sum(len(g.devices) for g in groups),
        groups=groups,
    )
    write_manifest(directory, manifest)
    return directory


def annotate_with_provenance(compiled):
    """Return the annotated IR of `compiled` made again from its logical IR, and where each layout came from.

    The annotate pipeline runs as in `compile_script`, with `propagate-layouts` through
    `propagate`, which also returns the provenance; the IR is the same as `compiled.annotated`.
    """
    from hspmd.ir.context import make_context
    from hspmd.ir.levels import verify_annotated
    from hspmd.transforms.pipeline import annotate_pipeline, build_passes
    from hspmd.transforms.propagate_layouts import PropagateLayouts, propagate

    module = compiled.logical.clone()
    ctx = make_context()
    provenance = {}
    for p in build_passes(annotate_pipeline(compiled.strategy)):
        if isinstance(p, PropagateLayouts):
            provenance = propagate(module)
        else:
            p.apply(ctx, module)
    module.verify()
    verify_annotated(module)
    return module, provenance
