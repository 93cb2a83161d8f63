"""`adam`: torch.optim.Adam, or with `decoupled=true` torch.optim.AdamW, as IR.

`adam{lr=1.0e-03 beta1=0.9 beta2=0.999 eps=1.0e-08 weight_decay=0.0 decoupled=false lr_input=false}`
replaces every `graph.output "grad:NAME"` that `autodiff` made by one `optim.adam` of the
parameter, its gradient, its moments `graph.parameter "opt.m.NAME"` / `"opt.v.NAME"` (init
zeros), the learning rate and the bias corrections, and `graph.assign`s of the new parameter
and moments. The bias corrections `1 - beta**t` come from the scalar states `opt.beta1_pow`
and `opt.beta2_pow` (init ones, times beta every step), computed once for all parameters;
`opt.step` counts steps. `weight_decay` is Adam's L2 penalty (added to the gradient) unless
`decoupled`, where it is AdamW's decay `param *= 1 - lr * weight_decay` before the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from hspmd.dialects import graph, optim
from hspmd.transforms.optimizer import OptimizerBuilder, check_option, state_name


@dataclass(frozen=True)
class Adam(ModulePass):
    """Replace each parameter's gradient output by a fused Adam / AdamW update."""

    name = "adam"
    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False
    lr_input: bool = False

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        check_option(self.name, "lr", self.lr, 0.0)
        check_option(self.name, "beta1", self.beta1, 0.0, 1.0)
        check_option(self.name, "beta2", self.beta2, 0.0, 1.0)
        check_option(self.name, "eps", self.eps, 0.0)
        check_option(self.name, "weight_decay", self.weight_decay, 0.0)
        b = OptimizerBuilder(op, self.name)
        lr = b.learning_rate(self.lr, self.lr_input)
        b.count_step()
        one = b.constant(1.0)
        bc1 = b.value(graph.SubOp(one, b.power("opt.beta1_pow", self.beta1)))
        bc2 = b.value(graph.SubOp(one, b.power("opt.beta2_pow", self.beta2)))
        for param, grad in b.gradients:
            name = param.tensor_name.data
            m = b.state(state_name("m", name), "zeros", param.result.type)
            v = b.state(state_name("v", name), "zeros", param.result.type)
            update = b.emit(
                optim.AdamOp(
                    param.result, grad, m, v, lr, bc1, bc2,
                    self.beta1, self.beta2, self.eps, self.weight_decay, self.decoupled,
                )
            )
            b.assign(name, update.results[0])
            b.assign(state_name("m", name), update.results[1])
            b.assign(state_name("v", name), update.results[2])
        b.consume_gradients()
