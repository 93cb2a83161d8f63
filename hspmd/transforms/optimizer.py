"""What every optimizer pass does to the step function: read gradients, add state, write updates.

After `autodiff`, parameter NAME has `graph.output "grad:NAME"`. An optimizer pass replaces
those outputs by `graph.assign "NAME"` of the updated value. Optimizer state is ordinary IR:

- `graph.parameter "opt.step" {init = "zeros"} : tensor<i64>`, incremented every step;
- per-parameter buffers such as `graph.parameter "opt.m.NAME" {init = "zeros"}`, shaped like
  the parameter, whose layouts follow the parameter's through propagation;
- scalar states such as `opt.beta1_pow` (init "ones", times beta1 each step) that give Adam's
  bias corrections without a pow op.

Each state is written back with `graph.assign`, so checkpoints (which save every parameter)
hold the optimizer state too. After `dynamic-loss-scale` every such assign stores
`optim.where_finite(old, new, total)`: a step whose gradients hold an inf or nan changes
nothing. The learning rate is a 0-d f64 tensor: a `graph.constant`, or with `lr_input` the
step input `graph.input "lr"` that the runtime feeds from the schedule.
The passes run after `autodiff`, which therefore never sees these states.
"""

from __future__ import annotations

from xdsl.dialects.builtin import Float64Type, ModuleOp, TensorType, f64, i64
from xdsl.ir import Operation, SSAValue

from hspmd.dialects import graph, optim
from hspmd.transforms.autodiff import GRAD_PREFIX
from hspmd.transforms.util import PassError, step_function, terminator

STATE_PREFIX = "opt."
STEP = "opt.step"
LR_INPUT = "lr"
SCALAR = TensorType(f64, ())
STEP_TYPE = TensorType(i64, ())


def state_name(kind: str, param: str) -> str:
    """Return the name of the optimizer state `kind` of parameter `param` (`opt.m.fc1.weight`)."""
    return f"{STATE_PREFIX}{kind}.{param}"


class OptimizerBuilder:
    """Appends an optimizer's ops before the step's `func.return`, in order.

    `gradients` lists (parameter op, gradient value) for every `grad:NAME` output, in the
    order autodiff wrote them; `consume_gradients()` removes those outputs once the updates
    are written. `finite_total` is the gradients' sum of squares of `dynamic-loss-scale`'s
    update, where the step has one (None otherwise): `assign` keeps the old value unless it is finite.
    """

    def __init__(self, module: ModuleOp, pass_name: str) -> None:
        self.pass_name = pass_name
        fn = step_function(module)
        self.block = fn.body.block
        self.ret = terminator(fn)
        ops = list(self.block.ops)
        self.leaves = {o.tensor_name.data: o for o in ops if isinstance(o, (graph.ParameterOp, graph.InputOp))}
        self.outputs = [o for o in ops if isinstance(o, graph.OutputOp) and o.tensor_name.data.startswith(GRAD_PREFIX)]
        if not self.outputs:
            raise PassError(f"{pass_name}: no gradient outputs; run 'autodiff' first")
        self.gradients: list[tuple[graph.ParameterOp, SSAValue]] = []
        for out in self.outputs:
            name = out.tensor_name.data[len(GRAD_PREFIX) :]
            param = self.leaves.get(name)
            if not isinstance(param, graph.ParameterOp):
                raise PassError(f"{pass_name}: gradient of unknown parameter '{name}'")
            self.gradients.append((param, out.value))
        scalers = [o for o in ops if isinstance(o, optim.UpdateLossScaleOp)]
        self.finite_total: SSAValue | None = scalers[0].total if scalers else None

    def emit(self, op: Operation) -> Operation:
        """Insert `op` before the return and return it."""
        self.block.insert_op_before(op, self.ret)
        return op

    def value(self, op: Operation) -> SSAValue:
        """Insert single-result `op` before the return and return its result."""
        return self.emit(op).results[0]

    def state(self, name: str, init: str, typ: TensorType) -> SSAValue:
        """Add optimizer state parameter `name` (initialised by `init`) and return its value."""
        if name in self.leaves:
            raise PassError(f"{self.pass_name}: the step already has a parameter or input named '{name}'")
        op = graph.ParameterOp(name, init, typ)
        self.leaves[name] = op
        self.emit(op)
        return op.result

    def assign(self, name: str, value: SSAValue) -> None:
        """Store `value` into parameter `name` at the end of the step (under dynamic loss scaling,
        only where the step's gradients are finite)."""
        if self.finite_total is not None:
            value = self.value(optim.WhereFiniteOp(self.leaves[name].results[0], value, self.finite_total))
        self.emit(graph.AssignOp(name, value))

    def constant(self, value: float, typ: TensorType = SCALAR) -> SSAValue:
        return self.value(graph.ConstantOp(value, typ))

    def learning_rate(self, lr: float, lr_input: bool) -> SSAValue:
        """Return the step's learning rate: constant `lr`, or the f64 scalar input "lr" (made once)."""
        if not lr_input:
            return self.constant(lr)
        existing = self.leaves.get(LR_INPUT)
        if existing is None:
            op = graph.InputOp(LR_INPUT, SCALAR)
            self.leaves[LR_INPUT] = op
            self.emit(op)
            return op.result
        typ = existing.result.type
        if not isinstance(existing, graph.InputOp) or graph.tensor_shape(typ) != () or not isinstance(
            typ.element_type, Float64Type  # type: ignore[attr-defined]
        ):
            raise PassError(
                f"{self.pass_name}: lr_input needs '{LR_INPUT}' to be a tensor<f64> input, "
                f"but the step has a {existing.name} '{LR_INPUT}' of type {typ}"
            )
        return existing.result

    def count_step(self) -> SSAValue:
        """Add the `opt.step` counter (0 before the first step) and return its value after this step."""
        step = self.state(STEP, "zeros", STEP_TYPE)
        new = self.value(graph.AddOp(step, self.constant(1.0, STEP_TYPE)))
        self.assign(STEP, new)
        return new

    def power(self, name: str, base: float) -> SSAValue:
        """Add scalar state `name` = base**t and return its value after this step (t = 1 on the first)."""
        pow_ = self.state(name, "ones", SCALAR)
        new = self.value(graph.ScaleOp(pow_, base))
        self.assign(name, new)
        return new

    def consume_gradients(self) -> None:
        """Remove the `grad:NAME` outputs (their updates have been written)."""
        for out in self.outputs:
            out.detach()
            out.erase()


def check_option(pass_name: str, option: str, value: float, lo: float, hi: float | None = None, open_lo=False) -> None:
    """Raise PassError unless lo <= value (< hi); `open_lo` makes it lo < value."""
    ok = (value > lo if open_lo else value >= lo) and (hi is None or value < hi)
    if not ok:
        low = f"> {lo}" if open_lo else f">= {lo}"
        raise PassError(f"{pass_name}: option {option}={value} must be {low}" + (f" and < {hi}" if hi is not None else ""))
