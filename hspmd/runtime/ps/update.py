"""The optimizer's update step of a set of parameters, run on whole parameters or on table rows.

The compiler writes, per server (and under hybrid for the workers' dense parameters), a logical
`@train_step` in which parameter NAME's gradient enters as `graph.input "grad:NAME"` and the
optimizer's own passes wrote the update: the same fused `optim` ops, states (`opt.m.NAME`,
`opt.step`, ...) and `graph.assign`s as a compiled training step. `UpdateStep` runs it op by op
with the NumPy kernels every backend is checked against. For an embedding table the update
runs on the rows a push carries: the table and its per-row states are read at those rows and
written back there (the other rows, whose gradient is zero, are left as they are — with plain
SGD exactly what a dense update does; with momentum or Adam the "lazy" update of sparse
optimizers).
"""

from __future__ import annotations

import numpy as np
from xdsl.dialects import func

from hspmd.dialects import graph, optim
from hspmd.dialects.context import parse_module
from hspmd.ir.init_spec import initial_value
from hspmd.ir.types import dtype_name
from hspmd.runtime.numpy_ops import kernel_for

GRAD_PREFIX = "grad:"


def _param_of_state(name: str) -> str:
    """Return the parameter an optimizer state belongs to (`opt.m.emb` -> `emb`), else `name`."""
    parts = name.split(".", 2)
    return parts[2] if name.startswith("opt.") and len(parts) == 3 else name


class UpdateStep:
    """A parameter set's update step: `initial_state`, then `apply` per (summed) push."""

    def __init__(self, text: str, path: str, tables: set[str] = frozenset()) -> None:
        module = parse_module(text, path)
        fn = next(op for op in module.walk() if isinstance(op, func.FuncOp) and op.sym_name.data == "train_step")
        self.ops = list(fn.body.block.ops)
        self.kernels = {}
        self.leaves: list[tuple[str, str, tuple[int, ...], np.dtype]] = []
        for op in self.ops:
            if isinstance(op, graph.ParameterOp):
                typ = op.result.type
                self.leaves.append((op.tensor_name.data, op.init.data, tuple(typ.get_shape()),
                                    np.dtype(dtype_name(typ))))
            elif op.dialect_name() == "optim":
                self.kernels[op] = kernel_for(op, 0)
            elif op.dialect_name() == "graph" and not isinstance(
                    op, (graph.InputOp, graph.OutputOp, graph.AssignOp, graph.ConstantOp)):
                self.kernels[op] = kernel_for(op, 0)
        #: the parameters whose gradients this step takes, in order
        self.params = [o.tensor_name.data[len(GRAD_PREFIX):] for o in self.ops
                       if isinstance(o, graph.InputOp) and o.tensor_name.data.startswith(GRAD_PREFIX)]
        #: the leaves read and written at a push's rows: tables and their per-row states
        self.row_leaves = {name for name, _, shape, _ in self.leaves
                           if _param_of_state(name) in tables and len(shape) == 2}
        self.scalars = {o.tensor_name.data for o in self.ops
                        if isinstance(o, graph.InputOp) and not o.tensor_name.data.startswith(GRAD_PREFIX)}

    def initial_state(self, seed: int) -> dict[str, np.ndarray]:
        """Return every leaf's initial value (the same as a compiled step's: by name and seed)."""
        return {name: initial_value(init, shape, dtype, name, seed) for name, init, shape, dtype in self.leaves}

    def apply(self, state: dict[str, np.ndarray], grads: dict[str, tuple[np.ndarray | None, np.ndarray]],
              scalars: dict[str, np.ndarray]) -> None:
        """Update `state` in place by gradients `grads` ({param: (rows or None, gradient)}).

        A table's gradient comes with the rows it holds (distinct ids); `scalars` are the step
        inputs the update reads ("lr" under a schedule).
        """
        env: dict = {}
        rows_of = {}
        for name in self.row_leaves:
            rows = grads[_param_of_state(name)][0]
            rows_of[name] = rows
        for op in self.ops:
            match op:
                case graph.ParameterOp():
                    name = op.tensor_name.data
                    value = state[name]
                    env[op.result] = value[rows_of[name]] if name in rows_of else value
                case graph.InputOp():
                    name = op.tensor_name.data
                    env[op.result] = grads[name[len(GRAD_PREFIX):]][1] if name.startswith(GRAD_PREFIX) else scalars[name]
                case graph.ConstantOp():
                    env[op.result] = np.full(op.result.type.get_shape(), op.value.value.data,
                                             dtype=dtype_name(op.result.type))
                case graph.AssignOp():
                    name = op.tensor_name.data
                    if name in rows_of:
                        state[name][rows_of[name]] = env[op.value]
                    else:
                        state[name] = np.asarray(env[op.value])
                case graph.OutputOp() | func.ReturnOp():
                    continue
                case _:
                    result = self.kernels[op](*[env[v] for v in op.operands])
                    if len(op.results) == 1:
                        env[op.results[0]] = result
                    else:
                        for r, v in zip(op.results, result):
                            env[r] = v
        return None

    def has_optim(self) -> bool:
        """Return whether the step holds an update op (an empty parameter set has none)."""
        return any(isinstance(o, (optim.SGDOp, optim.AdamOp)) for o in self.ops)
