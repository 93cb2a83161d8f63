"""The `pipeline` dialect: a pipeline stage's micro-batches, run by the runtime in a schedule.

`pipeline-split` gives each stage of a pipeline one `@train_step` of the form

    ... parameters, what every micro-batch shares (pre) ...
    %gw, %loss = pipeline.run @stage_forward, @stage_backward (%w, %b) (%ids)
        {schedule = "1f1b", stage = 0, stages = 2, microbatches = 4, stash = 3}
        : (tensor<..>, tensor<..>) (tensor<4x8x64xi32>) -> (tensor<..>, tensor<..>)
    ... the sums over micro-batches all-reduced, the update (post) ...

* `shared` operands are passed to every action; each `microbatched` operand holds one slice
  per micro-batch along its leading dim (size `microbatches`): action i gets slice i.
* `@stage_forward(shared..., slices...)` returns `stash` values kept for the backward of the
  same micro-batch, then values to be summed over the micro-batches (the loss's pieces);
  `@stage_backward(shared..., slices..., stash...)` returns values to be summed (gradients).
* the results are those sums, forward's first: for each, micro-batch 0's value plus
  micro-batch 1's, and so on in micro-batch order (a left fold, so every schedule and every
  micro-batch count gives the bits of one fixed order).
* the runtime walks the schedule `SCHEDULES[schedule](stages, microbatches)[stage]`
  (`hspmd.ir.pipeline_schedule`): ("F", i) runs the forward on micro-batch i, ("B", i) the
  backward. A schedule must run every micro-batch's forwards, and its backwards, in
  micro-batch order on every stage (GPipe and 1F1B do): a message between two stages is
  then told apart by its tag and its place among the messages with that tag.

The program does not grow with the micro-batches: their number is an attribute.
"""

from __future__ import annotations

from typing import ClassVar

from collections.abc import Sequence

from xdsl.dialects.builtin import IntegerAttr, ModuleOp, StringAttr, SymbolRefAttr, TensorType, i64
from xdsl.ir import Attribute, Dialect, Operation, SSAValue
from xdsl.irdl import (
    AttrSizedOperandSegments,
    IRDLOperation,
    ParsePropInAttrDict,
    irdl_op_definition,
    prop_def,
    var_operand_def,
    var_result_def,
)
from xdsl.utils.exceptions import VerifyException

from hspmd.ir.pipeline_schedule import SCHEDULES, PipelineScheduleError

__all__ = ["Pipeline", "RunOp", "STAGE_ATTR", "MICROBATCHES_ATTR", "SINGLE_STAGE_ATTR", "OP_STAGE_ATTR", "CROSS_ATTR",
           "actions"]

#: a stage's group module: its stage number
STAGE_ATTR = "hspmd.pipeline_stage"
#: a stage's group module: the number of micro-batches of a step
MICROBATCHES_ATTR = "hspmd.microbatches"
#: marks a group without stages beside a pipeline (a one-stage pipeline whose step may be re-ordered)
SINGLE_STAGE_ATTR = "hspmd.single_stage"
#: an op of a stage-shaped step: its stage (-1: free, each stage that needs it computes its own copy);
#: written by `assign-pipeline-stages`, read (and dropped) by `outline-pipeline-stages`
OP_STAGE_ATTR = "pipeline.stage"
#: a stage's collective with other device groups: its index k among the stage-shaped step's
#: cross-group collectives (program order); written by `outline-pipeline-stages`, read (and
#: dropped) by `join-pipeline-groups`
CROSS_ATTR = "pipeline.cross"


@irdl_op_definition
class RunOp(IRDLOperation):
    """Run a stage's forward and backward on every micro-batch in a schedule; return the sums (module docstring)."""

    name = "pipeline.run"
    NO_SHARDING_RULE: ClassVar[str] = "made per stage at the physical level"
    NO_VJP: ClassVar[str] = "made after autodiff: it runs the stage's forward and backward"
    NO_KERNEL: ClassVar[str] = "the schedule lays out its actions (codegen/schedule/flatten.py)"
    NO_FRONTEND: ClassVar[str] = "made by outline-pipeline-stages"
    irdl_options = (AttrSizedOperandSegments(as_property=True), ParsePropInAttrDict())
    shared = var_operand_def(TensorType)
    microbatched = var_operand_def(TensorType)
    sums = var_result_def(TensorType)
    forward = prop_def(SymbolRefAttr)
    backward = prop_def(SymbolRefAttr)
    schedule = prop_def(StringAttr)
    stage = prop_def(IntegerAttr)
    stages = prop_def(IntegerAttr)
    microbatches = prop_def(IntegerAttr)
    stash = prop_def(IntegerAttr)
    assembly_format = ("$forward `,` $backward `(` $shared `)` `(` $microbatched `)` attr-dict `:` "
                       "`(` type($shared) `)` `(` type($microbatched) `)` `->` `(` type($sums) `)`")

    def __init__(self, forward: str, backward: str, shared: Sequence[SSAValue], microbatched: Sequence[SSAValue],
                 sum_types: Sequence[Attribute], *, schedule: str, stage: int, stages: int, microbatches: int,
                 stash: int):
        super().__init__(
            operands=[list(shared), list(microbatched)],
            result_types=[list(sum_types)],
            properties={
                "forward": SymbolRefAttr(forward), "backward": SymbolRefAttr(backward),
                "schedule": StringAttr(schedule), "stage": IntegerAttr(stage, i64),
                "stages": IntegerAttr(stages, i64), "microbatches": IntegerAttr(microbatches, i64),
                "stash": IntegerAttr(stash, i64),
            },
        )

    def ints(self) -> tuple[int, int, int, int]:
        """Return (stage, stages, microbatches, stash)."""
        return (self.stage.value.data, self.stages.value.data, self.microbatches.value.data,
                self.stash.value.data)

    def verify_(self) -> None:
        stage, stages, m, stash = self.ints()
        if self.schedule.data not in SCHEDULES:
            raise VerifyException(f"'{self.name}': unknown schedule '{self.schedule.data}' "
                                  f"(known: {', '.join(SCHEDULES)})")
        if not 0 <= stage < stages or m < 1 or stash < 0:
            raise VerifyException(f"'{self.name}': needs 0 <= stage < stages, microbatches >= 1 and stash >= 0 "
                                  f"(has stage={stage}, stages={stages}, microbatches={m}, stash={stash})")
        for v in self.microbatched:
            shape = v.type.get_shape()  # type: ignore[attr-defined]
            if not shape or shape[0] != m:
                raise VerifyException(f"'{self.name}': a micro-batched operand of type {v.type} must have a "
                                      f"leading dim of {m} (one slice per micro-batch)")
        module = self.parent_op()
        while module is not None and not isinstance(module, ModuleOp):
            module = module.parent_op()
        if module is not None:
            self._verify_callees(module, stash)

    def _verify_callees(self, module: ModuleOp, stash: int) -> None:
        from xdsl.dialects import func

        funcs = {op.sym_name.data: op for op in module.body.block.ops if isinstance(op, func.FuncOp)}
        fwd, bwd = (funcs.get(r.root_reference.data) for r in (self.forward, self.backward))
        if fwd is None or bwd is None:
            missing = [r.root_reference.data for r, f in ((self.forward, fwd), (self.backward, bwd)) if f is None]
            raise VerifyException(f"'{self.name}': the module has no @{', @'.join(missing)}")
        shared = [v.type for v in self.shared]
        slices = [TensorType(v.type.element_type, v.type.get_shape()[1:]) for v in self.microbatched]  # type: ignore
        f_in, f_out = list(fwd.function_type.inputs.data), list(fwd.function_type.outputs.data)
        b_in, b_out = list(bwd.function_type.inputs.data), list(bwd.function_type.outputs.data)
        if f_in != shared + slices:
            raise VerifyException(f"'{self.name}': @{fwd.sym_name.data} must take the shared operands then one "
                                  "slice of each micro-batched operand")
        if len(f_out) < stash or b_in != shared + slices + f_out[:stash]:
            raise VerifyException(f"'{self.name}': @{bwd.sym_name.data} must take the shared operands, the slices, "
                                  f"then the {stash} stashed results of @{fwd.sym_name.data}")
        if [r.type for r in self.sums] != f_out[stash:] + b_out:
            raise VerifyException(f"'{self.name}': its results must have the types of @{fwd.sym_name.data}'s sums "
                                  f"then @{bwd.sym_name.data}'s results")


def actions(op: RunOp) -> list[tuple[str, int]]:
    """Return the actions of `op`'s stage, in order: its schedule's list, checked (see the module docstring).

    Raises PipelineScheduleError when the schedule does not keep micro-batch order.
    """
    stage, stages, m, _ = op.ints()
    acts = SCHEDULES[op.schedule.data](stages, m)[stage]
    for kind in ("F", "B"):
        order = [i for k, i in acts if k == kind]
        if order != list(range(m)):
            raise PipelineScheduleError(f"schedule '{op.schedule.data}', stage {stage}: the {kind} actions run "
                                        f"micro-batches {order}, not 0..{m - 1} in order")
    return acts


def run_ops(module: Operation) -> list[RunOp]:
    """Return the `pipeline.run` ops under `module`."""
    return [op for op in module.walk() if isinstance(op, RunOp)]


Pipeline = Dialect("pipeline", [RunOp], [])
