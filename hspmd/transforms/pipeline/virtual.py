"""The virtual devices of a pipeline: one owner of the mapping between a pipelined group and the
stage-shaped group its step is annotated over.

A strategy with pp > 1 is annotated as if each pipelined group were one stage whose dp axis is
micro-batches x dp (one *virtual device* per micro-batch and stage position); the annotated
program's all-reduces over micro-batches are where the pipeline passes sum the micro-batches'
gradients. `pipeline-split` then maps virtual device p to stage position p % (dp*tp) and
micro-batch p // (dp*tp), and cuts the physical step into one program per stage.

    [0-3]: dp=1 tp=2 pp=2, 2 micro-batches     ->  annotated as  [0-3]: dp=2 tp=2
    [0-3]: tp=2 pp=2 share=2 | [4,5]: tp=2     ->  annotated as  [0,1,2,3]: dp=1 tp=2 share=2 | [4,5]: dp=1 tp=2
                                                   (1 micro-batch: the group's own devices first)
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects.builtin import ModuleOp

from hspmd.dialects import graph
from hspmd.ir.strategy import Strategy, StrategyGroup, StrategyRecord, parse_strategy
from hspmd.transforms.util import PassError, module_strategy

__all__ = ["Pipeline", "annotation_strategy", "check_microbatches", "pipelines", "selected_pipelines"]


@dataclass(frozen=True)
class Pipeline:
    """The pipeline of one group: its devices stage-major, and dp / tp inside each stage.

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
    #: expert-parallel ranks inside each stage, between dp and tp (`[0-3]: ep=2 pp=2`)
    ep: int = 1
    #: the experts the group holds where groups hold different numbers (`experts=`)
    experts: int | None = None

    @property
    def stages(self) -> tuple[tuple[int, ...], ...]:
        """Return each stage's devices."""
        n = self.dp * self.ep * self.tp
        return tuple(self.devices[s * n:(s + 1) * n] for s in range(self.pp))

    def stage_strategy(self, microbatches: int) -> str:
        """Return the one-group strategy one stage's step is compiled with: micro-batches x dp as dp.

        `[0..V-1]: dp=m*dp tp=tp` over V = m*dp*tp virtual devices (`[d0]: dp=1` for V = 1).
        """
        v = microbatches * self.dp * self.ep * self.tp
        if self.union is not None:  # the pipelined group on virtual devices, the others as written
            return " | ".join(str(self.stage_group(microbatches)) if g == "{}" else g for g in self.union)
        if v == 1:
            return f"[{self.devices[0]}]: dp=1"
        devices = f"0-{v - 1}" if v > 2 else "0,1"
        return (f"[{devices}]: dp={microbatches * self.dp} tp={self.tp}" + (" sp=1" if self.sp else "")
                + (f" ep={self.ep}" if self.ep > 1 else ""))

    def stage_group(self, microbatches: int) -> StrategyGroup:
        """Return the pipelined group as one stage on its virtual devices (micro-batches x dp as dp)."""
        return StrategyGroup(self.virtual(microbatches), dp=microbatches * self.dp, tp=self.tp, share=self.share,
                             sp=self.sp, ep=self.ep, experts=self.experts)

    def virtual(self, microbatches: int) -> tuple[int, ...]:
        """Return the virtual devices of a pipelined group beside other groups: one per micro-batch
        and stage position, the group's own devices first, then numbers from `fresh` on (above
        every real device, and above the other pipelined groups' virtual devices)."""
        v = microbatches * self.dp * self.ep * self.tp
        top = self.fresh if self.fresh is not None else max([*self.devices, *self.other_devices]) + 1
        return (*self.devices, *range(top, top + v))[:v]


def pipelines(strategy: Strategy, microbatches: int = 1) -> list[Pipeline]:
    """Return the pipeline of every group with pp > 1, in the strategy's order.

    In a heterogeneous strategy a group may be pipelined beside others
    (`[0-3]: tp=2 pp=2 share=2 | [4,5]: tp=2 share=1`): its stage shape, on virtual devices
    (`Pipeline.virtual`), stands in the union the step is annotated with. Several pipelined
    groups each get virtual devices of their own (`fresh` numbers one after the other for
    `microbatches`), and are cut one after the other.
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
        pipe = Pipeline(g.devices, g.pp, g.dp, g.tp, g.sp, g.layers, union, g.share, others, fresh, g.zero,
                        g.ep, g.experts)
        fresh += microbatches * g.dp * g.ep * g.tp
        out.append(pipe)
    return out


def selected_pipelines(module: ModuleOp, strategy_id: int | None, group: int | None,
                       what: str) -> tuple[StrategyRecord, list[Pipeline]]:
    """Return the module's strategy (id `strategy_id`) and the pipelines a pass `what` works on:
    the one with index `group` among the strategy's pipelined groups, or all of them (None)."""
    record = module_strategy(module, strategy_id, what)
    pipes = pipelines(record.strategy, record.microbatches)
    return record, [p for k, p in enumerate(pipes) if group is None or k == group]


def annotation_strategy(record: StrategyRecord) -> Strategy:
    """Return the strategy a step under `record` is annotated with: the strategy itself without
    pp, else each pipelined group as one stage on its virtual devices, the others as written."""
    pipes = pipelines(record.strategy, record.microbatches)
    if not pipes:
        return record.strategy
    if len(record.strategy.groups) == 1:
        return parse_strategy(pipes[0].stage_strategy(record.microbatches))
    by_devices = {p.devices: p for p in pipes}
    return Strategy(tuple(by_devices[g.devices].stage_group(record.microbatches) if g.devices in by_devices else g
                          for g in record.strategy.groups))


def check_microbatches(module: ModuleOp, record: StrategyRecord) -> None:
    """Raise PassError unless the micro-batches of a one-group pipeline, each split over dp ranks,
    divide the batch dim (dim 0) of every non-scalar input (beside other groups, apply-strategy
    checks the group's rows against m x dp); and that micro-batches do not meet tensor
    parallelism in several pipelined groups at once (their sums across the groups would span
    some of the micro-batches only, which the stages cannot run as one collective)."""
    piped_tp = [g for g in record.strategy.groups if g.pp > 1 and g.tp > 1]
    if record.microbatches > 1 and len(piped_tp) > 1:
        raise PassError(f"microbatches={record.microbatches}: strategy '{record.strategy}' has tensor parallelism in "
                        f"several pipelined groups ({', '.join(repr(str(g)) for g in piped_tp)}), which micro-batches "
                        "do not support yet (the groups' sums would span some micro-batches only); use "
                        "microbatches=1, or tp=1 in all pipelined groups but one")
    pipes = pipelines(record.strategy, record.microbatches)
    if len(pipes) != 1 or pipes[0].union is not None:
        return
    m, dp = record.microbatches, pipes[0].dp
    for op in module.walk():
        if isinstance(op, graph.InputOp) and op.result.type.get_shape() and op.result.type.get_shape()[0] % (m * dp):
            pieces = f"{m} micro-batches" + (f" x dp={dp} = {m * dp} pieces" if dp > 1 else "")
            raise PassError(f"microbatches={m}: input '{op.tensor_name.data}' has batch dim "
                            f"{op.result.type.get_shape()[0]}, which {pieces} do not divide")
