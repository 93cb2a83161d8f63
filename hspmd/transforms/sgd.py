"""`sgd`: plain stochastic gradient descent as IR, `w <- w - lr * grad`.

Consumes every `graph.output "grad:NAME"` that `autodiff` made and replaces it with
`graph.assign "NAME"` of the updated value, so the step function updates its parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from hspmd.dialects import graph
from hspmd.transforms.autodiff import GRAD_PREFIX
from hspmd.transforms.util import PassError, step_function, terminator


@dataclass(frozen=True)
class SGD(ModulePass):
    """Replace each parameter's gradient output by the update `w - lr * g`."""

    name = "sgd"
    lr: float = 0.01

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        fn = step_function(op)
        block = fn.body.block
        params = {o.tensor_name.data: o for o in block.ops if isinstance(o, graph.ParameterOp)}
        grads = [
            o for o in block.ops if isinstance(o, graph.OutputOp) and o.tensor_name.data.startswith(GRAD_PREFIX)
        ]
        if not grads:
            raise PassError("sgd: no gradient outputs; run 'autodiff' first")
        ret = terminator(fn)
        for out in grads:
            name = out.tensor_name.data[len(GRAD_PREFIX) :]
            if name not in params:
                raise PassError(f"sgd: gradient of unknown parameter '{name}'")
            scaled = graph.ScaleOp(out.value, -self.lr)
            new = graph.AddOp(params[name].result, scaled.result)
            block.insert_ops_before([scaled, new, graph.AssignOp(name, new.result)], ret)
            out.detach()
            out.erase()
