"""`dynamic-loss-scale`: torch.amp.GradScaler's skip of non-finite steps and its scale update.

`dynamic-loss-scale{growth_factor=2.0 backoff_factor=0.5 growth_interval=2000}` runs after
`autodiff{loss_scale=S dynamic_scale=true}` (which seeds the backward with the state
`opt.loss_scale`, init S, and multiplies the gradients by its reciprocal) and before the
clipping and optimizer passes, as `scaler.unscale_` / `scaler.step` / `scaler.update` run
around `optimizer.step()`:

    total = sum_i optim.sum_squares(g_i)                  (f64 scalars, graph.add)
    scale', good' = optim.update_loss_scale(scale, good, total)

`total` is inf or nan exactly when some gradient element is (squares of finite float32 values
stay finite in float64), and it is the same decision on every rank: a split gradient's sum of
squares is a partial sum that is all-reduced, a partial gradient is reduced first, as for
`clip-grad-norm`'s norm. The count of good steps is the state `opt.loss_scale_good_steps`.
Every `graph.assign` an optimizer pass writes after this one goes through
`optim.where_finite(old, new, total)` (`OptimizerBuilder.assign`): a step with a non-finite
gradient leaves the parameters, the optimizer state and `opt.step` as they were.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from hspmd.dialects import graph, optim
from hspmd.ir.loss_scaling import (
    BACKOFF_FACTOR,
    GOOD_STEPS_STATE,
    GROWTH_FACTOR,
    GROWTH_INTERVAL,
    SCALE_STATE,
    check_settings,
)
from hspmd.transforms.optimizer import SCALAR, OptimizerBuilder
from hspmd.transforms.util import PassError


@dataclass(frozen=True)
class DynamicLossScale(ModulePass):
    """Skip the update of a step with a non-finite gradient, and grow or back off the loss scale."""

    name = "dynamic-loss-scale"
    growth_factor: float = GROWTH_FACTOR
    backoff_factor: float = BACKOFF_FACTOR
    growth_interval: int = GROWTH_INTERVAL

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        try:
            check_settings(1.0, self.growth_factor, self.backoff_factor, self.growth_interval)
        except ValueError as err:
            raise PassError(f"{self.name}: option {err}") from None
        b = OptimizerBuilder(op, self.name)
        if b.finite_total is not None:
            raise PassError(f"{self.name}: the step already has a dynamic loss scale update")
        if any(isinstance(o, graph.AssignOp) for o in b.block.ops):
            raise PassError(f"{self.name}: the step already has updates; run it before the optimizer pass")
        scale = b.leaves.get(SCALE_STATE)
        if not isinstance(scale, graph.ParameterOp) or graph.tensor_shape(scale.result) != ():
            raise PassError(f"{self.name}: the step has no 0-d state '{SCALE_STATE}'; run "
                            "'autodiff{dynamic_scale=true}' first")
        good = b.state(GOOD_STEPS_STATE, "zeros", scale.result.type)
        total = None
        for _, grad in b.gradients:
            sq = b.value(optim.SumSquaresOp(grad, SCALAR))
            total = sq if total is None else b.value(graph.AddOp(total, sq))
        assert total is not None  # OptimizerBuilder found gradients
        update = b.emit(optim.UpdateLossScaleOp(scale.result, good, total, self.growth_factor, self.backoff_factor,
                                                self.growth_interval))
        b.emit(graph.AssignOp(SCALE_STATE, update.results[0]))
        b.emit(graph.AssignOp(GOOD_STEPS_STATE, update.results[1]))
