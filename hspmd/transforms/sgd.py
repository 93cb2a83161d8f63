"""`sgd`: torch.optim.SGD as IR (momentum, Nesterov, weight decay; dampening 0).

`sgd{lr=0.1 momentum=0.9 weight_decay=1.0e-04 nesterov=true lr_input=false}` replaces every
`graph.output "grad:NAME"` that `autodiff` made by one `optim.sgd` of the parameter, its
gradient, its momentum buffer `graph.parameter "opt.momentum.NAME" {init = "zeros"}` (only
when momentum != 0) and the learning rate, and `graph.assign`s of the new parameter and
buffer. It also counts steps in `opt.step`. The learning rate is the constant `lr`, or, with
`lr_input=true`, the scalar `graph.input "lr" : tensor<f64>` the runtime feeds each step.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from hspmd.dialects import optim
from hspmd.transforms.optimizer import OptimizerBuilder, check_option, state_name
from hspmd.transforms.util import PassError


@dataclass(frozen=True)
class SGD(ModulePass):
    """Replace each parameter's gradient output by a fused SGD update."""

    name = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    lr_input: bool = False

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        check_option(self.name, "lr", self.lr, 0.0)
        check_option(self.name, "momentum", self.momentum, 0.0)
        check_option(self.name, "weight_decay", self.weight_decay, 0.0)
        if self.nesterov and self.momentum == 0.0:
            raise PassError(f"{self.name}: nesterov=true needs a momentum > 0")
        b = OptimizerBuilder(op, self.name)
        lr = b.learning_rate(self.lr, self.lr_input)
        b.count_step()
        for param, grad in b.gradients:
            name = param.tensor_name.data
            buf = b.state(state_name("momentum", name), "zeros", param.result.type) if self.momentum else None
            update = b.emit(optim.SGDOp(param.result, grad, buf, lr, self.momentum, self.weight_decay, self.nesterov))
            b.assign(name, update.results[0])
            if buf is not None:
                b.assign(state_name("momentum", name), update.results[1])
        b.consume_gradients()
