"""The compiler driver: a model script and a strategy -> the levels of its training step -> a bundle.

`compile_script` traces the script (`hspmd.frontend`), then runs pass objects level by level:

    logical     [stack-layers], [recompute], autodiff, [clip-grad-norm], the optimizer's
                update                                                       (training_passes)
    annotated   apply-strategy (records `#dist.strategy` on the module), apply-annotations,
                [shard-optimizer-state], [shard-parameters], propagate-layouts, insert-reshard,
                reuse-resharded-residuals                                     (annotate_passes)
    physical    specialize-groups, lower-reshard, and with pp > 1 for each pipelined group
                assign-pipeline-stages, outline-pipeline-stages, [join-pipeline-groups]
                (together: pipeline-split), then [shard-stage-optimizer]       (physical_passes)
    kernel      fuse-kernels on each group's module, when a bundle is written  (kernel_level)

`apply-strategy` is the one pass that takes the strategy as an option; every later pass reads
the strategy the module records. `hspmd compile`, `hspmd run` and the Python API all come
through here. `compile_pipeline` gives the whole list by level (`hspmd compile --print-pipeline`
prints it); a `PassManager` (`hspmd.transforms.pass_manager`, the `passes=` argument) edits it
with the user's own passes and prints, times and checks the passes as they run.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from hspmd.frontend.optim import Optimizer
from hspmd.frontend.script import (
    ModelScript,
    flash_attention,
    loss_scale,
    script_optimizer,
    set_config,
    tf32,
    trace_script,
)
from hspmd.dialects.context import make_context
from hspmd.dialects.levels import physical_groups, verify_annotated, verify_logical, verify_physical
from hspmd.ir.loss_scaling import DynamicScaling
from hspmd.ir.strategy import RECOMPUTE_MODES, Strategy, StrategyError, StrategyRecord, parse_strategy
from hspmd.codegen import bundle
from hspmd.transforms import build_passes, get_all_passes
from hspmd.transforms.apply_annotations import ApplyAnnotations
from hspmd.transforms.apply_strategy import ApplyStrategy
from hspmd.transforms.autodiff import Autodiff
from hspmd.transforms.dynamic_loss_scale import DynamicLossScale
from hspmd.transforms.coalesce_group_sums import CoalesceGroupSums
from hspmd.transforms.device_kernels import device_module
from hspmd.transforms.flash_attention import flash_attention_module
from hspmd.transforms.fuse_kernels import FuseKernels, fuse_module
from hspmd.transforms.multi_tensor import multi_tensor_module
from hspmd.transforms.insert_reshard import InsertReshard
from hspmd.transforms.reuse_resharded_residuals import ReuseReshardedResiduals
from hspmd.transforms.lower_reshard import LowerReshard
from hspmd.transforms.pipeline.virtual import annotation_strategy
from hspmd.transforms.pipeline.shard_stage_optimizer import ShardStageOptimizer
from hspmd.transforms.pipeline.split import pipeline_split_passes
from hspmd.transforms.propagate_layouts import PropagateLayouts, propagate
from hspmd.transforms.recompute import Recompute
from hspmd.transforms.shard_optimizer_state import ShardOptimizerState
from hspmd.transforms.shard_parameters import ShardParameters
from hspmd.transforms.specialize_groups import SpecializeGroups
from hspmd.transforms.stack_layers import StackLayers
from hspmd.transforms.pass_pipeline import Pipeline
from hspmd.transforms.util import PassError, StrategyLimitError, module_strategy

if TYPE_CHECKING:
    from xdsl.dialects.builtin import TensorType

    from hspmd.transforms.pass_manager import PassManager

    from hspmd.ir.ps_plan import PSPlan

__all__ = ["Compiled", "InternalError", "annotate", "annotate_passes", "annotate_with_provenance", "compile_pipeline",
           "compile_script", "compile_strategies", "default_strategy", "kernel_level", "physical_passes", "run_passes",
           "script_pipelines", "to_physical", "training_passes", "write_bundle"]


class InternalError(Exception):
    """A pass after the strategy checks failed: a bug of hspmd, not of the model or the strategy.

    `pass_name` names the pass (or the verifier), `ir_path` the file holding the IR it was given
    (None where it could not be written), `cause` the exception it raised. `hspmd compile` and
    `hspmd run` report it as `hspmd: internal error in <pass>: ...` with that path, exit code 3.
    """

    def __init__(self, pass_name: str, cause: BaseException, ir_path: str | None) -> None:
        self.pass_name, self.cause, self.ir_path = pass_name, cause, ir_path
        lines = [ln for ln in str(cause).strip().splitlines() if ln.strip()]
        text = lines[0] if lines else ""
        if not isinstance(cause, PassError):  # an exception the pass did not mean to raise: name it
            text = f"{type(cause).__name__}: {text}" if text else type(cause).__name__
        super().__init__(f"internal error in {pass_name}: {text}")


def _internal_error(pass_name: str, cause: BaseException, before) -> InternalError:
    """Return the InternalError of `pass_name` failing with `cause`; `before()` gives the IR the pass
    was given, which is written to a new file in the temporary directory."""
    import tempfile

    from hspmd.dialects.context import module_text

    path = None
    try:
        module = before()
        directory = tempfile.mkdtemp(prefix="hspmd-internal-")
        path = os.path.join(directory, f"before-{pass_name.replace(' ', '-')}.mlir")
        with open(path, "w") as f:
            f.write(f"// the input of {pass_name}, which failed: {cause!s:.500}\n" + module_text(module))
    except Exception:  # noqa: BLE001 - the report of a bug must not hide it behind another
        path = None
    return InternalError(pass_name, cause, path)


def run_passes(module: ModuleOp, passes: list[ModulePass] | str, ctx: Context | None = None,
               checked: bool = False, manager: PassManager | None = None, level: str = "") -> ModuleOp:
    """Run `passes` (pass objects, or pass-spec text as `hspmd-opt -p` reads it) on `module` in place,
    verify it, and return it.

    The strategy checks are the passes marked `checks_input` (`apply-strategy`,
    `apply-annotations`): what they refuse is the user's input, and so is what fails before them
    (tracing, the training passes). Every pass after them, or every pass when `checked` (the input
    has passed them), is the compiler's own: its failure (any exception, the verifier's too, but a
    `StrategyLimitError`: a limit of the compiler that only lowering shows) raises
    `InternalError` naming the pass, with the IR the pass was given written to a file. That IR is
    made again only on failure (the passes since the first checked one, rerun on a copy of their
    input), so a compile that succeeds pays one copy of the module per call.

    `manager` (a `PassManager`, of the level named `level`) applies each pass: it prints and times
    them as asked, and checks the user's own passes (their failures are `UserPassError`s, the
    user's; a failure of a pass of hspmd after a user pass ran is too: `PassManager.blame`).
    """
    from hspmd.transforms.pass_manager import UserPassError

    ctx = ctx or make_context()
    passes = build_passes(passes) if isinstance(passes, str) else list(passes)

    def apply(p: ModulePass) -> None:
        _apply(p, ctx, module, manager, level)

    start, snapshot = 0, None
    for i, p in enumerate(passes):
        if getattr(p, "checks_input", False):
            apply(p)
            checked = True
            continue
        if not checked:
            apply(p)
            continue
        if snapshot is None:
            start, snapshot = i, module.clone()
        try:
            apply(p)
        except (StrategyLimitError, UserPassError):
            raise  # the user's strategy, refused where lowering shows what it asks for; the user's pass
        except Exception as err:
            raise _blamed(_internal_error(p.name, err, lambda: _replay(snapshot, passes[start:i], ctx)),
                          manager) from err
    if not checked:
        module.verify()
        return module
    try:
        module.verify()
    except Exception as err:
        last = passes[-1].name if passes else "the input"
        raise _blamed(_internal_error(f"the verifier after {last}", err, lambda: module), manager) from err
    return module


def _blamed(err: InternalError, manager: PassManager | None) -> Exception:
    """Return `err`, or where a user pass changed the IR before, the user's error saying so."""
    text = str(err).removeprefix(f"internal error in {err.pass_name}: ")
    return (manager.blame(err.pass_name, text, err.ir_path) if manager is not None else None) or err


def _replay(snapshot: ModuleOp, passes: list[ModulePass], ctx: Context) -> ModuleOp:
    """Return a copy of `snapshot` with `passes` applied: the input of the pass after them."""
    module = snapshot.clone()
    for p in passes:
        p.apply(ctx, module)
    return module


def _verified(module: ModuleOp, verify, what: str, manager: PassManager | None = None) -> ModuleOp:
    """Run the level verifier `verify` on `module`, past the strategy checks: its failure is the
    compiler's (`InternalError` named `what`), or where a user pass ran, the user's."""
    try:
        verify(module)
    except Exception as err:
        raise _blamed(_internal_error(what, err, lambda: module), manager) from err
    return module


def training_passes(optimizer: Optimizer | None, scale: float | DynamicScaling = 1.0, stack: bool = False,
                    recompute: str = "none") -> list[ModulePass]:
    """Return the passes that turn a traced forward step into a training step: with `stack`,
    stack-layers (repeated layers as one `graph.scan` over stacked parameters), with `recompute`
    (`block` or `selective`) the layer functions marked for activation recompute, autodiff (with
    static loss scale `scale`, or dynamic loss scaling: autodiff seeded by the scale state, then
    dynamic-loss-scale), then the optimizer's clipping and update (none without an optimizer)."""
    registry = get_all_passes()
    update = [registry[name]()(**options) for name, options in optimizer.passes()] if optimizer else []
    marks = [Recompute(mode=recompute)] if recompute != "none" else []
    if isinstance(scale, DynamicScaling):
        backward = [Autodiff(loss_scale=scale.init_scale, dynamic_scale=True),
                    DynamicLossScale(growth_factor=scale.growth_factor, backoff_factor=scale.backoff_factor,
                                     growth_interval=scale.growth_interval)]
    else:
        backward = [Autodiff(loss_scale=scale) if scale != 1.0 else Autodiff()]
    return [*([StackLayers()] if stack else []), *marks, *backward, *update]


def recompute_mode(records: list[StrategyRecord]) -> str:
    """Return the activation recompute the training step of `records` is differentiated with: the
    strongest any group asks for (`block` over `selective` over `none`).

    The backward is made once for every group (autodiff runs before the strategy is applied), so
    groups that ask for less recompute than another group run the same recomputing program: the
    numbers are the same either way, and a group's memory is at most what it asked for.
    """
    modes = [g.recompute for r in records for g in r.strategy.groups]
    return max(modes, key=RECOMPUTE_MODES.index, default="none")


def stacks_layers(records: list[StrategyRecord]) -> bool:
    """Return whether a step compiled for all of `records` stacks its repeated layers (`stack-layers`).

    A stack of layers is one `graph.scan` at every level, so IR size and compile time do not grow
    with the layer count; a pipeline cuts the stacks at its stage boundaries (`cut-stacked-layers`).
    A pipeline beside other device groups (whose cross-group sums would meet stacks cut otherwise)
    and expert parallelism keep the layers as calls, one per layer (the same numbers either way).
    """
    return all(g.ep == 1 and g.experts is None and (g.pp == 1 or len(r.strategy.groups) == 1)
               for r in records for g in r.strategy.groups)


def annotate_passes(record: StrategyRecord) -> list[ModulePass]:
    """Return the passes that take logical IR to annotated IR under `record`'s strategy.

    `apply-strategy` records the strategy on the module; a strategy asking for ZeRO (`zero=1`,
    `zero=2` or `zero=3`, outside pipelines) adds `shard-optimizer-state` after `apply-annotations`,
    and `zero=3` then `shard-parameters`.
    """
    s = record.strategy
    apply = ApplyStrategy(strategy=str(s), microbatches=record.microbatches, schedule=record.schedule, id=record.id)
    groups = annotation_strategy(record).groups
    zero = [ShardOptimizerState(strategy_id=record.id)] if any(g.zero for g in groups) else []
    zero += [ShardParameters(strategy_id=record.id)] if any(g.zero == 3 for g in groups) else []
    return [apply, ApplyAnnotations(strategy_id=record.id), *zero, PropagateLayouts(), InsertReshard(),
            ReuseReshardedResiduals()]


def physical_passes(record: StrategyRecord) -> list[ModulePass]:
    """Return the passes that take annotated IR to physical IR: one module per device group; with
    pp > 1 one per pipeline stage (and ZeRO over each stage's dp ranks when the strategy asks);
    last, the sums across device groups that every program may make in one bucket are marked
    (`coalesce-group-sums`)."""
    passes: list[ModulePass] = [SpecializeGroups(), LowerReshard()]
    if record.pipelined:
        passes += pipeline_split_passes(record)  # assign, outline [, join] per pipelined group
        if any(g.pp > 1 and g.zero and g.dp > 1 for g in record.strategy.groups):
            passes.append(ShardStageOptimizer(strategy_id=record.id))
    if len(record.strategy.groups) > 1 or record.pipelined:  # more than one program
        passes.append(CoalesceGroupSums())
    return passes


def annotate(module: ModuleOp, strategy: str | StrategyRecord, passes: list[ModulePass] | None = None,
             manager: PassManager | None = None) -> ModuleOp:
    """Annotate logical `module` in place under `strategy` (text: one strategy, id 0, no micro-batches)
    with `passes` (default: `annotate_passes`) applied through `manager` (see `run_passes`)."""
    record = strategy if isinstance(strategy, StrategyRecord) else StrategyRecord(0, parse_strategy(strategy))
    run_passes(module, annotate_passes(record) if passes is None else passes, manager=manager, level="annotated")
    return _verified(module, verify_annotated, "verify-annotated", manager)


def to_physical(module: ModuleOp, strategy_id: int | None = None, passes: list[ModulePass] | None = None,
                manager: PassManager | None = None) -> ModuleOp:
    """Lower annotated `module` in place to physical IR under the strategy it records (`strategy_id`:
    which one, when it records several) with `passes` (default: `physical_passes`) applied
    through `manager` (see `run_passes`)."""
    if passes is None:
        passes = physical_passes(module_strategy(module, strategy_id, "to_physical"))
    run_passes(module, passes, checked=True, manager=manager, level="physical")
    return _verified(module, verify_physical, "verify-physical", manager)


def device_passes(flash: bool = True) -> list[ModulePass]:
    """Return the passes that make a group's GPU program from its kernel level: `device-kernels`,
    then `flash-attention` unless `flash` is False, then `multi-tensor`."""
    from hspmd.transforms.device_kernels import DeviceKernels
    from hspmd.transforms.flash_attention import FlashAttention
    from hspmd.transforms.multi_tensor import MultiTensor

    return [DeviceKernels(), *([FlashAttention()] if flash else []), MultiTensor()]


def compile_pipeline(script: ModelScript, record: StrategyRecord, optimizer: Optimizer | bool = True,
                     stack: bool | None = None, recompute: str | None = None) -> Pipeline:
    """Return, by level, the passes `compile_script` runs for `script` under `record` (stack-layers and
    recompute as for that record alone, unless `stack` and `recompute` say): the pipeline
    `hspmd compile --print-pipeline` prints. The kernel and device levels run on each device
    group's module (the device level for the groups that run on GPUs)."""
    opt = script_optimizer(script) if optimizer is True else optimizer or None
    stack = stacks_layers([record]) if stack is None else stack
    recompute = recompute_mode([record]) if recompute is None else recompute
    return Pipeline({
        "logical": tuple(training_passes(opt, loss_scale(script), stack, recompute)),
        "annotated": tuple(annotate_passes(record)),
        "physical": tuple(physical_passes(record)),
        "kernel": (FuseKernels(),),
        "device": tuple(device_passes(flash_attention(script.config))),
    })


def default_strategy(n: int) -> str:
    """Return the data-parallel strategy over `n` devices (`[0,1]: dp=2` for n=2)."""
    devices = ",".join(str(i) for i in range(n)) if n < 3 else f"0-{n - 1}"
    return f"[{devices}]: dp={n}"


@dataclass
class Compiled:
    """The levels of one compiled training step (the kernel level made on first use)."""

    script: ModelScript
    strategy: StrategyRecord
    logical: ModuleOp
    annotated: ModuleOp
    physical: ModuleOp
    # the learning-rate schedule the runtime feeds as input "lr" (hspmd.ir.lr_schedule spec)
    lr_schedule: dict | None = None
    # the passes it was compiled with, by level (None: the defaults), and the PassManager that ran them
    pipeline: Pipeline | None = None
    manager: PassManager | None = field(default=None, repr=False)
    _kernel_groups: list[tuple[tuple[int, ...], ModuleOp]] | None = field(default=None, repr=False)
    _device_groups: list[tuple[tuple[int, ...], ModuleOp]] | None = field(default=None, repr=False)

    def kernel_groups(self) -> list[tuple[tuple[int, ...], ModuleOp]]:
        """Return each device group's kernel level: its physical module fused by `fuse-kernels`."""
        if self._kernel_groups is None:
            passes = self.pipeline.level("kernel") if self.pipeline is not None else None
            self._kernel_groups = kernel_level(self.physical, passes, self.manager)
        return self._kernel_groups

    def device_groups(self) -> list[tuple[tuple[int, ...], ModuleOp]]:
        """Return each device group's program for a GPU: its kernel level after `device-kernels`
        (every op a kernel, a GEMM or a view). PassError names an op that has no GPU kernel."""
        if self._device_groups is None:
            # attention as flash-style kernels unless the script's `flash_attention` is false
            flash = flash_attention(self.script.config)
            passes = self.pipeline.level("device") if self.pipeline is not None else None
            self._device_groups = device_level(self.kernel_groups(), flash, passes, self.manager)
        return self._device_groups

    @property
    def user_passes(self) -> dict | None:
        """Return what the bundle records of the user's passes it was compiled with (None: none)."""
        return self.manager.record() if self.manager is not None else None


def device_level(kernel_groups: list[tuple[tuple[int, ...], ModuleOp]], flash: bool = True,
                 passes: list[ModulePass] | None = None,
                 manager: PassManager | None = None) -> list[tuple[tuple[int, ...], ModuleOp]]:
    """Return (devices, a copy after `passes`) for each group's kernel level; by default
    `device-kernels`, then `flash-attention` unless `flash` is False, then `multi-tensor`
    (`device_passes`). Their PassError (an op with no GPU kernel) is the user's to see."""
    out = []
    ctx = make_context()
    for gi, (devices, fused) in enumerate(kernel_groups):
        program = fused.clone()
        if passes is None and manager is None:
            device_module(program)
            if flash:
                flash_attention_module(program)
            multi_tensor_module(program)
        else:
            for p in device_passes(flash) if passes is None else passes:
                _apply(p, ctx, program, manager, f"device.group{gi}")
        out.append((devices, program))
    return out


def _apply(p: ModulePass, ctx: Context, module: ModuleOp, manager: PassManager | None, level: str) -> None:
    if manager is None:
        p.apply(ctx, module)
    else:
        manager.apply(p, ctx, module, level)


def kernel_level(physical: ModuleOp, passes: list[ModulePass] | None = None,
                 manager: PassManager | None = None) -> list[tuple[tuple[int, ...], ModuleOp]]:
    """Return (devices, a copy after `passes`: by default `fuse-kernels`) for each device group of
    `physical`, applied through `manager` (see `run_passes`)."""
    from hspmd.transforms.pass_manager import UserPassError

    out = []
    ctx = make_context()
    for gi, (devices, module) in enumerate(physical_groups(physical)):
        fused = module.clone()
        if passes is None and manager is None:
            try:
                fuse_module(fused)
            except Exception as err:  # past the strategy checks: the compiler's failure
                raise _internal_error("fuse-kernels", err, lambda m=module: m) from err
            out.append((devices, fused))
            continue
        for i, p in enumerate([FuseKernels()] if passes is None else passes):
            try:
                _apply(p, ctx, fused, manager, f"kernel.group{gi}")
            except UserPassError:
                raise
            except Exception as err:  # past the strategy checks: the compiler's failure (or after a user pass)
                done = ([FuseKernels()] if passes is None else passes)[:i]
                raise _blamed(_internal_error(p.name, err, lambda m=module, d=done: _replay(m, d, ctx)),
                              manager) from err
        out.append((devices, fused))
    return out


def compile_working(script, text: str | Strategy, n: int, **kwargs):
    """Return (`text` compiled for the ranks it names, those ranks of a run of `n`): a strategy
    naming every rank compiles as it is; one naming some of them (`[0]: dp=1` on `-n 2`)
    renumbered onto 0..K-1 (`working_strategy`). The text is parsed once, here (or given parsed).
    `kwargs` go to `compile_script`; a strategy that does not parse, or names ranks the run
    lacks, raises the compiler's usual error."""
    from hspmd.runtime.launcher.idle import working_strategy

    parsed = parse_strategy(text) if isinstance(text, str) else text
    working, ranks = working_strategy(parsed, n)
    return compile_script(script, working, len(ranks), **kwargs), ranks


def compile_script(
    script: ModelScript, strategy: str | Strategy, num_devices: int | None = None, optimizer: Optimizer | bool = True,
    microbatches: int | None = None, pipeline_schedule: str | None = None, stack_layers: bool | None = None,
    passes: PassManager | None = None,
) -> Compiled:
    """Return the logical, annotated and physical IR of the script's training step.

    `optimizer`: True uses the script's `optimizer(config)` (plain SGD with `config["lr"]` if it
    has none), an `hspmd.optim` optimizer overrides it, and False compiles no update at all:
    the step then outputs every gradient as `grad:NAME`.

    With pipeline parallelism (`pp` > 1), `microbatches` (default: the script's
    `config["microbatches"]`, else 1) micro-batches run through the stages in the order of
    `pipeline_schedule` (default `config["pipeline_schedule"]`, else "gpipe") and their
    gradients are summed before the update.

    `stack_layers` (default: where the strategy allows, `stacks_layers`) runs `stack-layers`:
    repeated layers become one scan over stacked parameters.

    `passes` (a `PassManager`): the user's edits of the pipeline (`compile_pipeline`: their own
    passes inserted, levels replaced), and the passes printed, timed and checked as it asks.
    """
    record = _record(script, strategy, 0, num_devices, microbatches, pipeline_schedule)
    stack = stacks_layers([record]) if stack_layers is None else stack_layers
    pipeline = _edited(compile_pipeline(script, record, optimizer, stack, recompute_mode([record])), passes)
    logical, opt = _training_step(script, optimizer, stack, recompute_mode([record]), pipeline, passes)
    return _lower(script, record, logical, opt, pipeline, passes)


def script_pipelines(script: ModelScript, strategies: list[str], num_devices: int | None = None,
                     passes: PassManager | None = None) -> list[Pipeline]:
    """Return the pipeline (`compile_pipeline`, with `passes`' edits) that compiling `script` under
    `strategies` runs for each: `compile_script`'s for one, `compile_strategies`' for several."""
    records = [_record(script, s, i, num_devices if i == 0 else None, None, None) for i, s in enumerate(strategies)]
    stack, recompute = stacks_layers(records), recompute_mode(records)
    pipelines = [compile_pipeline(script, r, True, stack, recompute) for r in records]
    return [passes.pipeline(p) for p in pipelines] if passes is not None else pipelines


def _edited(pipeline: Pipeline, manager: PassManager | None) -> Pipeline | None:
    """Return `pipeline` with `manager`'s edits (None without a manager: every level its default)."""
    return manager.pipeline(pipeline) if manager is not None else None


def compile_strategies(script: ModelScript, strategies: list[str], num_devices: int | None = None,
                       configs: list[dict] | None = None, passes: PassManager | None = None) -> list[Compiled]:
    """Return the script's training step compiled under each of `strategies` (ids 0, 1, ...) from one
    logical program: traced and differentiated once, annotated and lowered once per distinct
    strategy text (a repeated text shares the first one's `Compiled`). Graph switching
    (`docs/switching.md`) runs them in turn in one run. The first strategy uses every device;
    a later one may use fewer (where the run goes when a rank leaves).

    `configs[i]` (dotted key -> value, as `--set` takes them) specialises variant i: the script is
    traced again under that config (one logical program per distinct config), e.g. a sequence
    length bucket's batch shape (`data.bucket=64`); every `Compiled` keeps the run's own
    script and config, which the runtime reads for the data and the schedule.

    `passes`: as for `compile_script`, the same edits for every strategy.
    """
    if num_devices is None and strategies:
        num_devices = parse_strategy(strategies[0]).num_devices
    configs = configs if configs is not None else [{} for _ in strategies]
    if len(configs) != len(strategies):
        raise PassError(f"{len(strategies)} strategies but {len(configs)} configs; give one config per strategy")
    records = [_record(script, s, i, num_devices if i == 0 else None, None, None) for i, s in enumerate(strategies)]
    for record in records[1:]:  # a later strategy may leave ranks out (a rank leaving the run)
        extra = sorted(set(record.strategy.devices) - set(records[0].strategy.devices))
        if extra:
            raise StrategyError(f"strategy '{record.strategy}' uses devices {extra}, which the run's first strategy "
                                f"'{records[0].strategy}' does not have")
    traced: dict[str, tuple[ModuleOp, Optimizer | None]] = {}
    stack = stacks_layers(records)  # one program's variants share their parameters' names
    recompute = recompute_mode(records)
    first: dict[tuple[str, str], Compiled] = {}
    out = []
    pipelines = [_edited(compile_pipeline(script, r, True, stack, recompute), passes) for r in records]
    for record, overrides, pipeline in zip(records, configs, pipelines):
        ckey = repr(sorted(overrides.items()))
        if ckey not in traced:
            traced[ckey] = _training_step(_specialised(script, overrides), True, stack, recompute, pipeline, passes)
        key = (str(record.strategy), ckey)
        if key not in first:
            logical, opt = traced[ckey]
            first[key] = _lower(script, record, logical, opt, pipeline, passes)
        out.append(first[key])
    return out


def _specialised(script: ModelScript, overrides: dict) -> ModelScript:
    """Return `script` with its config updated by `overrides` (itself when there are none)."""
    if not overrides:
        return script
    config = copy.deepcopy(script.config)
    for key, value in overrides.items():
        set_config(config, key, value)
    return ModelScript(script.path, script.module, config)


def _record(script: ModelScript, strategy: str | Strategy, sid: int, num_devices: int | None,
            microbatches: int | None, pipeline_schedule: str | None) -> StrategyRecord:
    """Return the strategy record `compile_script` annotates with (see its docstring); `strategy`
    parsed here where it is text."""
    parsed = parse_strategy(strategy) if isinstance(strategy, str) else strategy
    if num_devices is not None:
        parsed.check_devices(num_devices)
    served = [g for g in parsed.groups if g.comm != "allreduce"]
    if served:
        raise StrategyError(f"strategy '{parsed}': comm={served[0].comm} runs with parameter servers, which are "
                            "ranks of their own: run it with 'hspmd run -n N --servers K' (compile_ps)")
    m = int(microbatches if microbatches is not None else script.config.get("microbatches", 1))
    schedule = str(pipeline_schedule or script.config.get("pipeline_schedule", "gpipe"))
    try:
        return StrategyRecord(sid, parsed, m, schedule)
    except StrategyError as err:  # micro-batches or schedule: how the pipeline runs, not the strategy text
        raise PassError(str(err)) from None


def _training_step(script: ModelScript, optimizer: Optimizer | bool, stack: bool = False, recompute: str = "none",
                   pipeline: Pipeline | None = None,
                   manager: PassManager | None = None) -> tuple[ModuleOp, Optimizer | None]:
    """Return the script's logical training step (traced, [layers stacked,] [marked for recompute,]
    differentiated, updated: `pipeline`'s logical level, by default `training_passes`) and its optimizer."""
    tf32(script.config)  # checked here, read by a GPU run's plan
    flash_attention(script.config)  # checked here, read when the GPU programs are made
    logical = trace_script(script)
    opt = script_optimizer(script) if optimizer is True else optimizer or None
    passes = pipeline.level("logical") if pipeline is not None else training_passes(opt, loss_scale(script), stack,
                                                                                     recompute)
    run_passes(logical, passes, manager=manager, level="logical")
    if manager is not None and manager.user_ran:
        _verified(logical, verify_logical, "verify-logical", manager)
    else:
        verify_logical(logical)
    return logical, opt


def _lower(script: ModelScript, record: StrategyRecord, logical: ModuleOp, opt: Optimizer | None,
           pipeline: Pipeline | None = None, manager: PassManager | None = None) -> Compiled:
    """Return `logical` annotated and lowered to physical IR under `record` (`logical` is left as it
    is), with `pipeline`'s annotated and physical levels (None: the defaults)."""
    annotated = annotate(logical.clone(), record, pipeline.level("annotated") if pipeline else None, manager)
    physical = to_physical(annotated.clone(), None, pipeline.level("physical") if pipeline else None, manager)
    return Compiled(script, record, logical, annotated, physical, opt.schedule_spec() if opt is not None else None,
                    pipeline, manager)


def write_bundle(compiled: Compiled | list[Compiled], directory: str, device: bool | Sequence[str] = False) -> str:
    """Write the levels (the kernel level too; the GPU programs of the groups that run on GPUs as
    well) and the manifest of `compiled` into `directory`; return the directory.

    A group gets its GPU program (`device_groupK.mlir`) where its strategy group says
    `device=cuda`, where `device` is True (every group: a run with `--device cuda`), or where
    `device`, a kind per rank ("cpu"/"cuda", `hspmd run --device cuda,cuda,cpu`), puts one of its
    ranks on a GPU (`gpu_ranks`).

    A list (from `compile_strategies`) makes a switching bundle: the first strategy's program in
    `directory`, each other distinct one in `directory/strategy-<id>/`, and the manifest's
    `variants` naming, for strategies 1, 2, ..., the sub-bundle each runs.
    """
    programs = compiled if isinstance(compiled, list) else [compiled]
    where: dict[int, str] = {id(programs[0]): "."}
    for c in programs[1:]:
        if id(c) not in where:
            where[id(c)] = f"strategy-{c.strategy.id}"
            _write_one(c, os.path.join(directory, where[id(c)]), device=device)
    _write_one(programs[0], directory, [where[id(c)] for c in programs[1:]], device)
    return directory


def gpu_ranks(record: StrategyRecord, device: bool | Sequence[str] = False) -> set[int]:
    """Return the ranks that run on a GPU: those of groups saying `device=cuda`, and every rank
    with `device` True or whose entry of `device` (a kind per rank) is "cuda"."""
    ranks = {r for g in record.strategy.groups if g.device == "cuda" for r in g.devices}
    if device is True:
        ranks.update(record.strategy.devices)
    elif not isinstance(device, bool):
        ranks.update(r for r, kind in enumerate(device) if kind == "cuda")
    return ranks


def _gpu_programs(compiled: Compiled, device: bool | Sequence[str]) -> list[ModuleOp | None]:
    """Return each group's GPU program where one of its ranks runs on a GPU, else None."""
    on_gpu = gpu_ranks(compiled.strategy, device)
    kernel_groups = compiled.kernel_groups()
    wanted = [bool(on_gpu.intersection(devices)) for devices, _ in kernel_groups]
    if all(wanted):
        return [m for _, m in compiled.device_groups()]
    made = iter(device_level([g for g, w in zip(kernel_groups, wanted) if w],
                             flash=flash_attention(compiled.script.config)))
    return [next(made)[1] if w else None for w in wanted]


def _write_one(compiled: Compiled, directory: str, variants: list[str] | None = None,
               device: bool | Sequence[str] = False) -> None:
    gpu = _gpu_programs(compiled, device)
    imported = compiled.script.imported  # a PyTorch model's weights, and its tied parameters' other names
    extra = {"torch_aliases": imported.aliases} if imported is not None and imported.aliases else {}
    if imported is not None and imported.hf is not None:  # a transformers model: `checkpoint export --hf`
        extra["hf"] = imported.hf
    bundle.write_bundle(
        directory, script=compiled.script.path,
        config={**compiled.script.config, "lr_schedule": compiled.lr_schedule, **extra},
        weights=imported.weights if imported is not None else None,
        strategy=str(compiled.strategy.strategy), logical=compiled.logical, annotated=compiled.annotated,
        groups=[(devices, module, fused, program) for (devices, module), (_, fused), program
                in zip(physical_groups(compiled.physical), compiled.kernel_groups(), gpu)],
        variants=variants or [], user_passes=compiled.user_passes,
    )


def annotate_with_provenance(compiled: Compiled):
    """Return the annotated IR of `compiled` made again from its logical IR, and where each layout came from.

    The annotate passes run as in `compile_script`, with `propagate-layouts` through `propagate`,
    which also returns the provenance; the IR is the same as `compiled.annotated`.
    """
    module = compiled.logical.clone()
    ctx = make_context()
    provenance = {}
    passes = compiled.pipeline.level("annotated") if compiled.pipeline is not None else annotate_passes(compiled.strategy)
    for p in passes:
        if isinstance(p, PropagateLayouts):
            provenance = propagate(module)
        else:
            p.apply(ctx, module)
    module.verify()
    verify_annotated(module)
    return module, provenance


# ----------------------------------------------------------------------------- parameter servers

@dataclass
class CompiledPS:
    """A parameter-server run (docs/parameter-server.md): the workers' gradient step, compiled
    for one device on a worker's rows, the servers' (and, under hybrid, the workers') update
    steps, and the `PSPlan` that says who holds what."""

    worker: Compiled
    plan: PSPlan
    server_updates: list[ModuleOp]
    dense_update: ModuleOp | None
    strategy: str


class _WorkerRows(ModelScript):
    """A model script whose batches are a worker's rows of the global batches (for tracing)."""

    workers: int = 1

    def batches(self, shapes_only: bool = False):
        for batch in super().batches(shapes_only):
            rows = {len(v) for v in batch.values() if getattr(v, "ndim", 0)}
            if len(rows) != 1 or next(iter(rows)) % self.workers:
                raise PassError(f"{self.path}: a parameter-server run splits each batch's rows over "
                                f"{self.workers} workers; its inputs have {sorted(rows)} rows")
            take = next(iter(rows)) // self.workers
            yield {k: (v[:take] if getattr(v, "ndim", 0) else v) for k, v in batch.items()}


def update_program(params: list[tuple[str, str, TensorType]], optimizer: Optimizer) -> ModuleOp:
    """Return the logical update step of `params` ((name, init, type) each) under `optimizer`.

    Parameter NAME's gradient enters as `graph.input "grad:NAME"`; the optimizer's own passes
    write the update (the same fused `optim` ops, states and `graph.assign`s as a compiled
    training step), so a server applies exactly the update an all-reduce run applies.
    """
    from xdsl.dialects import func
    from xdsl.ir import Block, Region

    from hspmd.dialects import graph
    from hspmd.transforms.autodiff import GRAD_PREFIX

    block = Block()
    for name, init, typ in params:
        block.add_op(graph.ParameterOp(name, init, typ))
        grad = graph.InputOp(GRAD_PREFIX + name, typ)
        block.add_op(grad)
        block.add_op(graph.OutputOp(GRAD_PREFIX + name, grad.result))
    block.add_op(func.ReturnOp())
    module = ModuleOp([func.FuncOp("train_step", ((), ()), Region(block))])
    registry = get_all_passes()
    run_passes(module, [registry[name]()(**options) for name, options in optimizer.passes()])
    verify_logical(module)
    return module


def embedding_tables(logical: ModuleOp) -> dict[str, str]:
    """Return {table: ids input} for every parameter used only as the table of `graph.embedding`
    ops that look up ids given straight by one step input (rows a batch touches are known)."""
    from hspmd.dialects import graph

    out: dict[str, str] = {}
    for op in logical.walk():
        if not isinstance(op, graph.ParameterOp):
            continue
        ids = set()
        for use in op.result.uses:
            user = use.operation
            if isinstance(user, graph.OutputOp):
                continue
            if not isinstance(user, graph.EmbeddingOp) or use.index != 0 or not isinstance(
                    user.ids.owner, graph.InputOp):
                ids = None
                break
            ids.add(user.ids.owner.tensor_name.data)
        if ids and len(ids) == 1:
            out[op.tensor_name.data] = ids.pop()
    return out


def compile_ps(script: ModelScript, strategy: str, servers: int) -> CompiledPS:
    """Return the programs of a parameter-server run of `script` under `strategy` (one group,
    `comm=ps` or `comm=hybrid`) with `servers` server ranks beside its dp workers."""
    from hspmd.ir.ps_plan import PSPlan, assign_by_bytes
    from hspmd.transforms.autodiff import GRAD_PREFIX

    parsed = parse_strategy(strategy)
    if len(parsed.groups) != 1 or parsed.groups[0].comm == "allreduce":
        raise StrategyError(f"strategy '{parsed}': a parameter-server run has one group with comm=ps or comm=hybrid")
    group = parsed.groups[0]
    parsed.check_devices(len(group.devices))
    if servers < 1:
        raise StrategyError(f"strategy '{parsed}' uses comm={group.comm}, which needs --servers K (K >= 1)")
    opt = script_optimizer(script)
    if opt is None or any(name == "clip-grad-norm" for name, _ in opt.passes()):
        raise PassError(f"{script.path}: comm={group.comm} applies the optimizer on the servers, one parameter "
                        "range each; gradient-norm clipping needs every gradient at once and is not supported there")
    if isinstance(loss_scale(script), DynamicScaling):
        raise PassError(f"{script.path}: comm={group.comm} applies the optimizer on the servers, one parameter "
                        "range each; loss_scale='dynamic' skips a step on any non-finite gradient, which needs every "
                        "gradient at once and is not supported there (use a static loss_scale)")
    workers = group.dp
    local = _WorkerRows(script.path, script.module, script.config)
    local.workers = workers
    worker = compile_script(local, "[0]: dp=1", 1, optimizer=False, stack_layers=False)  # servers hold layers by name
    grads = {o.tensor_name.data[len(GRAD_PREFIX):] for o in worker.logical.walk()
             if o.name == "graph.output" and o.tensor_name.data.startswith(GRAD_PREFIX)}
    params = [(o.tensor_name.data, o.init.data, o.result.type) for o in worker.logical.walk()
              if o.name == "graph.parameter" and o.tensor_name.data in grads]
    tables = embedding_tables(worker.logical)
    served = [p for p in params if group.comm == "ps" or p[0] in tables]
    if not served:
        raise PassError(f"{script.path}: comm=hybrid sends embedding tables through the servers, and the model "
                        "has none (a parameter looked up by graph.embedding with ids from an input)")
    from hspmd.codegen.report import tensor_nbytes

    homes = assign_by_bytes([(name, tensor_nbytes(typ)) for name, _, typ in served], servers)
    rows = len(next(iter(next(script.batches(shapes_only=True)).values())))
    plan = PSPlan(workers=workers, servers=servers, comm=group.comm, consistency=group.consistency,
                  bound=group.staleness_bound, cache_rows=group.cache_rows,
                  cache_bound=group.cache_bound or 0, homes=homes,
                  tables={t: i for t, i in tables.items() if t in homes}, batch_rows=rows)
    server_updates = [update_program([p for p in served if homes[p[0]] == k], opt) for k in range(servers)]
    dense = [p for p in params if p[0] not in homes]
    return CompiledPS(worker, plan, server_updates, update_program(dense, opt) if dense else None, str(parsed))


def write_ps_bundle(compiled: CompiledPS, directory: str, device: bool = False) -> str:
    """Write a parameter-server bundle: the worker's bundle (with its GPU program where `device`:
    the workers run on GPUs), its update steps and `ps.json`."""
    from hspmd.ir.ps_plan import DENSE_UPDATE_FILE, PLAN_FILE, SERVER_UPDATE_FILE

    write_bundle(compiled.worker, directory, device=device)
    bundle.atomic_write_text(f"{directory}/{PLAN_FILE}", compiled.plan.to_json())
    for k, module in enumerate(compiled.server_updates):
        bundle.atomic_write_text(f"{directory}/{SERVER_UPDATE_FILE.format(k=k)}", str(module))
    if compiled.dense_update is not None:
        bundle.atomic_write_text(f"{directory}/{DENSE_UPDATE_FILE}", str(compiled.dense_update))
    return directory
