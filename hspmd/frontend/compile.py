"""Compiling a model script: trace, then the pass pipelines, level by level, into a bundle."""

from __future__ import annotations

import os
from dataclasses import dataclass

from xdsl.dialects.builtin import ModuleOp

from hspmd.frontend.optim import Optimizer
from hspmd.frontend.script import ModelScript, loss_scale, script_optimizer, trace_script
from hspmd.frontend.strategy import parse_strategy
from hspmd.ir.context import module_text
from hspmd.ir.levels import physical_groups, verify_annotated, verify_logical, verify_physical
from hspmd.runtime.bundle import GroupEntry, Manifest, atomic_write_text, write_manifest
from hspmd.transforms.pipeline import PHYSICAL_PIPELINE, annotate_pipeline, run_passes


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
    script: ModelScript, strategy: str, num_devices: int | None = None, optimizer: Optimizer | bool = True
) -> Compiled:
    """Return the logical, annotated and physical IR of the script's training step.

    `optimizer`: True uses the script's `optimizer(config)` (plain SGD with `config["lr"]` if it
    has none), an `hspmd.optim` optimizer overrides it, and False compiles no update at all:
    the step then outputs every gradient as `grad:NAME`.
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
    annotated = logical.clone()
    run_passes(annotated, annotate_pipeline(str(parsed)))
    verify_annotated(annotated)
    physical = annotated.clone()
    run_passes(physical, PHYSICAL_PIPELINE)
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
