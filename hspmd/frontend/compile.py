"""Compiling a model script: trace, then the pass pipelines, level by level, into a bundle."""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects.builtin import ModuleOp

from hspmd.frontend.optim import Optimizer
from hspmd.frontend.script import ModelScript, loss_scale, script_optimizer, trace_script
from hspmd.frontend.strategy import Strategy, StrategyGroup, parse_strategy
from hspmd.ir.levels import physical_groups, verify_annotated, verify_logical, verify_physical
from hspmd.codegen import bundle
from hspmd.transforms.fuse_kernels import fuse_module
from hspmd.transforms.pipeline import PHYSICAL_PIPELINE, annotate_pipeline, run_passes
from hspmd.transforms.util import PassError


@dataclass(frozen=True)
class Pipeline:
    """The pipeline of a strategy: its devices stage-major, and dp / tp inside each stage.

    Stage s runs on `devices[s*dp*tp:(s+1)*dp*tp]`; inside a stage the devices are a dp x tp
    mesh, dp major, tp minor (`[0-3]: dp=1 tp=2 pp=2`: stage 0 is the tp pair 0,1, stage 1 is
    2,3). `layers` gives each stage's layer count (None: contiguous ranges balanced by cost).
    """

    devices: tuple[int, ...]
    pp: int
    dp: int
    tp: int
    sp: int = 0
    layers: tuple[int, ...] | None = None
    #: a heterogeneous strategy: every group's text with the pipelined one as `{}` (None: one group)
    union: tuple[str, ...] | None = None
    share: int = 1
    other_devices: tuple[int, ...] = ()
    #: the first number its virtual devices may take beyond its own devices (None: above every device)
    fresh: int | None = None
    #: ZeRO over each stage's dp ranks (`shard-stage-optimizer`)
    zero: int = 0

    @property
    def stages(self) -> tuple[tuple[int, ...], ...]:
        """Return each stage's devices."""
        n = self.dp * self.tp
        return tuple(self.devices[s * n:(s + 1) * n] for s in range(self.pp))

    def stage_strategy(self, microbatches: int) -> str:
        """Return the one-group strategy one stage's step is compiled with: micro-batches x dp as dp.

        `[0..V-1]: dp=m*dp tp=tp` over V = m*dp*tp virtual devices (`[d0]: dp=1` for V = 1);
        `pipeline-split` maps virtual device p to stage position p % (dp*tp), micro-batch
        p // (dp*tp).
        """
        v = microbatches * self.dp * self.tp
        if self.union is not None:  # the pipelined group on virtual devices, the others as written
            return " | ".join(str(self.stage_group(microbatches)) if g == "{}" else g for g in self.union)
        if v == 1:
            return f"[{self.devices[0]}]: dp=1"
        devices = f"0-{v - 1}" if v > 2 else "0,1"
        return f"[{devices}]: dp={microbatches * self.dp} tp={self.tp}" + (" sp=1" if self.sp else "")

    def stage_group(self, microbatches: int) -> StrategyGroup:
        """Return the pipelined group as one stage on its virtual devices (micro-batches x dp as dp)."""
        return StrategyGroup(self.virtual(microbatches), dp=microbatches * self.dp, tp=self.tp, share=self.share,
                             sp=self.sp)

    def virtual(self, microbatches: int) -> tuple[int, ...]:
        """Return the virtual devices of a pipelined group beside other groups: one per micro-batch
        and stage position, the group's own devices first, then numbers from `fresh` on (above
        every real device, and above the other pipelined groups' virtual devices)."""
        v = microbatches * self.dp * self.tp
        top = self.fresh if self.fresh is not None else max([*self.devices, *self.other_devices]) + 1
        return (*self.devices, *range(top, top + v))[:v]

    def split_pass(self, microbatches: int, schedule: str) -> str:
        """Return the `pipeline-split{...}` pass text for this pipeline (then `shard-stage-optimizer` with ZeRO)."""
        layers = f' layers="{",".join(map(str, self.layers))}"' if self.layers else ""
        virtual = f' virtual="{",".join(map(str, self.virtual(microbatches)))}"' if self.union is not None else ""
        zero = f",shard-stage-optimizer{{dp={self.dp} tp={self.tp}}}" if self.zero and self.dp > 1 else ""
        return (f'pipeline-split{{devices="{",".join(map(str, self.devices))}" pp={self.pp} tp={self.tp} '
                f'microbatches={microbatches} schedule="{schedule}"{layers}{virtual}}}' + zero)


def pipeline_stages(strategy: Strategy) -> Pipeline | None:
    """Return the pipeline of a strategy with pp > 1 (`[0-3]: dp=1 tp=2 pp=2`); None without pp.

    A pipeline's step is compiled for one stage-shaped group (`Pipeline.stage_strategy`: one
    virtual device per micro-batch and stage position), then `pipeline-split` cuts the
    physical step into one program per stage (this returns the first pipelined group's; see
    `pipelines` for all). In a heterogeneous strategy a group may be pipelined beside others
    (`[0-3]: tp=2 pp=2 share=2 | [4,5]: tp=2 share=1`): its stage shape, on
    virtual devices (`Pipeline.virtual`), stands in the union the step is annotated with, and
    `pipeline-split{virtual=...}` cuts that group's program into its stages
    (`hspmd.transforms.hetero_pipeline`).
    """
    pipes = pipelines(strategy)
    return pipes[0] if pipes else None


def pipelines(strategy: Strategy, microbatches: int = 1) -> list[Pipeline]:
    """Return the pipeline of every group with pp > 1, in the strategy's order (see `pipeline_stages`).

    Several pipelined groups (`[0-3]: pp=2 share=1 | [4-7]: pp=4 share=1`) each get virtual
    devices of their own (`fresh` numbers one after the other for `microbatches`), and are cut
    one after the other; `pipeline-split` refuses them with one message when their stages'
    collectives cannot be put in one order.
    """
    piped = [g for g in strategy.groups if g.pp > 1]
    for g in piped:
        if g.zero and len(strategy.groups) > 1:
            raise PassError(f"strategy '{strategy}': ZeRO (zero={g.zero}) in a pipeline beside other device groups "
                            f"is not supported; use zero=0 in the group with pp={g.pp} (ZeRO with pp works in a "
                            "strategy of one group)")
    out = []
    fresh = max(strategy.devices) + 1
    for g in piped:
        union = None
        if len(strategy.groups) > 1:
            union = tuple("{}" if h is g else str(h) for h in strategy.groups)
        others = tuple(d for h in strategy.groups if h is not g for d in h.devices)
        pipe = Pipeline(tuple(g.devices), g.pp, g.dp, g.tp, g.sp, g.layers, union, g.share, others, fresh, g.zero)
        fresh += microbatches * g.dp * g.tp
        out.append(pipe)
    return out


def stage_union(strategy: Strategy, pipes: list[Pipeline], microbatches: int) -> str:
    """Return the strategy the step is annotated with: each pipelined group as one stage on its
    virtual devices (`Pipeline.stage_group`), the other groups as written."""
    if len(strategy.groups) == 1:
        return pipes[0].stage_strategy(microbatches)
    by_devices = {p.devices: p for p in pipes}
    return " | ".join(str(by_devices[g.devices].stage_group(microbatches)) if g.devices in by_devices else str(g)
                      for g in strategy.groups)


def _check_microbatches(logical: ModuleOp, m: int, dp: int = 1) -> None:
    """Raise PassError unless m >= 1 micro-batches, each split over dp ranks, divide the batch
    dim (dim 0) of every non-scalar input."""
    from hspmd.dialects import graph

    if m < 1:
        raise PassError(f"microbatches={m}: the number of micro-batches must be >= 1")
    for op in logical.walk():
        if isinstance(op, graph.InputOp) and op.result.type.get_shape() and op.result.type.get_shape()[0] % (m * dp):
            pieces = f"{m} micro-batches" + (f" x dp={dp} = {m * dp} pieces" if dp > 1 else "")
            raise PassError(f"microbatches={m}: input '{op.tensor_name.data}' has batch dim "
                            f"{op.result.type.get_shape()[0]}, which {pieces} do not divide")


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
    # the strategy the annotated level was made with: `strategy`, or for a pipeline the
    # stage-shaped one over virtual devices (`Pipeline.stage_strategy`)
    annotated_as: str = ""


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
    m = int(microbatches if microbatches is not None else script.config.get("microbatches", 1))
    pipes = pipelines(parsed, max(m, 1))
    pipe = pipes[0] if pipes else None
    split, annotate_as = "", str(parsed)
    if pipe:
        # one stage's step is compiled over one virtual device per micro-batch and stage position
        # (micro-batches x dp as the dp axis): its all-reduces over micro-batches are where
        # pipeline-split sums the micro-batches' gradients (and losses)
        schedule = str(pipeline_schedule or script.config.get("pipeline_schedule", "gpipe"))
        if pipe.union is None:  # (beside other groups, apply-strategy checks the group's rows against m x dp)
            _check_microbatches(logical, m, pipe.dp)
        elif m < 1:
            raise PassError(f"microbatches={m}: the number of micro-batches must be >= 1")
        annotate_as = stage_union(parsed, pipes, m)
        split = "".join("," + p.split_pass(m, schedule) for p in pipes)
    annotated = logical.clone()
    try:
        run_passes(annotated, annotate_pipeline(annotate_as))
    except PassError as err:
        if pipe is None or pipe.union is None:
            raise
        raise PassError(f"{err} (strategy '{parsed}' is annotated as '{annotate_as}': a pipelined group as one "
                        "stage, each micro-batch a virtual dp rank)") from None
    verify_annotated(annotated)
    physical = annotated.clone()
    run_passes(physical, PHYSICAL_PIPELINE + split)
    verify_physical(physical)
    return Compiled(script, str(parsed), logical, annotated, physical, opt.schedule_spec() if opt is not None else None,
                    annotate_as)


def kernel_level(compiled: Compiled) -> list[ModuleOp]:
    """Return every device group's physical program fused (`fuse-kernels` on a copy), in group order."""
    out = []
    for _, module in physical_groups(compiled.physical):
        fused = module.clone()
        fuse_module(fused)
        out.append(fused)
    return out


def write_bundle(compiled: Compiled, directory: str) -> str:
    """Write the levels (the kernel level too) and the manifest of `compiled` into `directory`;
    return the directory."""
    groups = physical_groups(compiled.physical)
    bundle.write_bundle(
        directory, script=compiled.script.path,
        config={**compiled.script.config, "lr_schedule": compiled.lr_schedule}, strategy=compiled.strategy,
        logical=compiled.logical, annotated=compiled.annotated,
        groups=[(devices, module, fused) for (devices, module), fused in zip(groups, kernel_level(compiled))],
    )
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
    for p in build_passes(annotate_pipeline(compiled.annotated_as or compiled.strategy)):
        if isinstance(p, PropagateLayouts):
            provenance = propagate(module)
        else:
            p.apply(ctx, module)
    module.verify()
    verify_annotated(module)
    return module, provenance
