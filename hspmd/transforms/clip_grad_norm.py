"""`clip-grad-norm`: scale all gradients so their global 2-norm is at most `max_norm`.

Runs between `autodiff` and the optimizer pass, as `torch.nn.utils.clip_grad_norm_` runs
between `backward()` and `step()`. For gradients g_i (the `graph.output "grad:NAME"` values):

    total = sum_i optim.sum_squares(g_i)                       (f64 scalars, graph.add)
    coef  = optim.clip_coef(total) = min(1, max_norm / (sqrt(total) + 1e-6))
    g_i'  = optim.mul_scalar(g_i, coef)

and each `grad:NAME` output is moved to the end of the step and now outputs g_i'. Under data
parallelism each gradient is all-reduced once, before `sum_squares` (which is not linear);
`mul_scalar` and the optimizer's update share that reduced value. After `dynamic-loss-scale`
the total is that pass's (the same sum of the same squares), not computed twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from hspmd.dialects import graph, optim
from hspmd.transforms.optimizer import SCALAR, OptimizerBuilder, check_option


@dataclass(frozen=True)
class ClipGradNorm(ModulePass):
    """Replace each gradient output by the gradient scaled to a global norm of at most `max_norm`."""

    name = "clip-grad-norm"
    max_norm: float = 1.0

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        check_option(self.name, "max_norm", self.max_norm, 0.0, open_lo=True)
        b = OptimizerBuilder(op, self.name)
        total = b.finite_total  # dynamic loss scaling summed the same squares already
        if total is None:
            for _, grad in b.gradients:
                sq = b.value(optim.SumSquaresOp(grad, SCALAR))
                total = sq if total is None else b.value(graph.AddOp(total, sq))
        assert total is not None
        coef = b.value(optim.ClipCoefOp(total, self.max_norm))
        for out, (_, grad) in zip(b.outputs, b.gradients):
            clipped = b.value(optim.MulScalarOp(grad, coef))
            out.detach()
            b.emit(out)
            out.operands[0] = clipped
