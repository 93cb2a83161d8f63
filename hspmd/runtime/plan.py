"""Execution plans: a physical step function turned, once, into a flat list of NumPy calls.

`build_plan` reads the IR of one device group's step function for one rank and resolves
everything a step needs: kernels, constants, the rank's communicator groups, where each
parameter and input comes from. `Plan.run` then replays the list each step without looking
at an xDSL object.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import TensorType
from xdsl.ir import Operation, SSAValue

from hspmd.dialects import comm, graph
from hspmd.dialects.dist import layout_of
from hspmd.ir.init_spec import initial_value
from hspmd.ir.layout import Layout
from hspmd.ir.types import dtype_name
from hspmd.runtime.comm.base import Communicator
from hspmd.runtime.numpy_ops import kernel_for
from hspmd.runtime.optim_kernels import kernel_for as optim_kernel_for

# dialect name -> maker of the NumPy function that computes one of its ops on a given rank
KERNELS: dict[str, Callable[[Operation, int], Callable]] = {"graph": kernel_for, "optim": optim_kernel_for}


class PlanError(Exception):
    """The physical IR cannot be run by this rank (wrong level, missing group, unknown op)."""


@dataclass(frozen=True)
class Leaf:
    """A parameter or input: its slot, global shape, layout and dtype (and initialiser)."""

    name: str
    slot: int
    global_shape: tuple[int, ...]
    layout: Layout
    dtype: str
    init: str = ""


@dataclass
class Plan:
    """The flat program of one rank: `steps` read and write numbered slots."""

    rank: int
    steps: list[tuple[Callable, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    num_slots: int = 0
    constants: dict[int, np.ndarray] = field(default_factory=dict)
    params: list[Leaf] = field(default_factory=list)
    inputs: list[Leaf] = field(default_factory=list)
    outputs: list[tuple[str, int]] = field(default_factory=list)
    assigns: list[tuple[str, int]] = field(default_factory=list)

    def initial_state(self, seed: int) -> dict[str, np.ndarray]:
        """Return this rank's pieces of every parameter's initial value."""
        state = {}
        for p in self.params:
            full = initial_value(p.init, p.global_shape, p.dtype, p.name, seed)
            state[p.name] = _contiguous(full[p.layout.slices(self.rank, p.global_shape)])
        return state

    def local_batch(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Return this rank's piece of each input of a global batch."""
        out = {}
        for leaf in self.inputs:
            if leaf.name not in batch:
                raise PlanError(f"the batch has no input '{leaf.name}' (it has {', '.join(sorted(batch))})")
            value = np.asarray(batch[leaf.name], dtype=leaf.dtype)
            if value.shape != leaf.global_shape:
                raise PlanError(
                    f"input '{leaf.name}' has shape {value.shape}, the program was compiled for {leaf.global_shape}"
                )
            out[leaf.name] = _contiguous(value[leaf.layout.slices(self.rank, leaf.global_shape)])
        return out

    def run(self, state: dict[str, np.ndarray], inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one step on local pieces; update `state` in place and return the named outputs."""
        env: list = [None] * self.num_slots
        for slot, value in self.constants.items():
            env[slot] = value
        for p in self.params:
            env[p.slot] = state[p.name]
        for leaf in self.inputs:
            env[leaf.slot] = inputs[leaf.name]
        for fn, args, outs in self.steps:
            result = fn(*[env[a] for a in args])
            if len(outs) == 1:
                env[outs[0]] = result
            elif outs:  # several results come back as a tuple
                for slot, value in zip(outs, result):
                    env[slot] = value
        for name, slot in self.assigns:
            state[name] = env[slot]
        return {name: env[slot] for name, slot in self.outputs}


def _contiguous(x: np.ndarray) -> np.ndarray:
    """Return `x` as a C-contiguous array of the same shape (0-d stays 0-d)."""
    return x if x.flags.c_contiguous else x.copy(order="C")


def _group_of(groups: tuple[tuple[int, ...], ...], rank: int, op: Operation) -> tuple[int, ...]:
    for g in groups:
        if rank in g:
            return g
    raise PlanError(f"rank {rank} is in no group of '{op.name}' {list(groups)}")


def _comm_kernel(op: Operation, rank: int, communicator: Communicator) -> Callable[..., np.ndarray]:
    """Return the call that performs collective `op` for `rank`."""
    if isinstance(op, comm.SendOp):
        peers = {s: d for s, d in comm.groups_of(op.pairs)}
        dest = peers.get(rank)
        return (lambda x: communicator.send(_contiguous(x), dest)) if dest is not None else (lambda x: None)
    if isinstance(op, comm.RecvOp):
        peers = {d: s for s, d in comm.groups_of(op.pairs)}
        src = peers.get(rank)
        shape, dtype = op.result.type.get_shape(), dtype_name(op.result.type)
        return lambda: communicator.recv(np.empty(shape, dtype), src)
    if isinstance(op, comm.ExchangeOp):
        return _exchange_kernel(op, rank, communicator)
    group = _group_of(op.rank_groups, rank, op)
    match op:
        case comm.AllReduceOp():
            return lambda x: communicator.all_reduce(_contiguous(x), group)
        case comm.AllGatherOp():
            d = op.dim.value.data
            return lambda x: communicator.all_gather(_contiguous(x), group, d)
        case comm.ReduceScatterOp():
            d = op.dim.value.data
            return lambda x: communicator.reduce_scatter(_contiguous(x), group, d)
        case comm.BroadcastOp():
            root = group[op.root.value.data]
            return lambda x: communicator.broadcast(_contiguous(x), group, root)
        case comm.AllToAllOp():
            s, c = op.split_dim.value.data, op.concat_dim.value.data
            return lambda x: communicator.all_to_all(_contiguous(x), group, s, c)
        case comm.LocalSplitOp():
            d, index, n = op.dim.value.data, group.index(rank), len(group)

            def local_split(x: np.ndarray) -> np.ndarray:
                size = x.shape[d] // n
                return np.ascontiguousarray(np.take(x, np.arange(index * size, (index + 1) * size), axis=d))

            return local_split
        case comm.LocalZeroOp():
            keep = group.index(rank) == 0
            return (lambda x: x) if keep else (lambda x: np.zeros_like(x))
    raise PlanError(f"no runtime for '{op.name}'")


def _exchange_kernel(op: comm.ExchangeOp, rank: int, communicator: Communicator) -> Callable[..., np.ndarray]:
    """Return the call doing `rank`'s transfers of an exchange, in the op's one global order."""
    shape, dtype = op.result.type.get_shape(), dtype_name(op.result.type)
    mine = [(s, d, tuple(slice(a, a + n) for a, _, n in r), tuple(slice(b, b + n) for _, b, n in r))
            for s, d, r in op.transfer_list() if rank in (s, d)]

    def exchange(x: np.ndarray) -> np.ndarray:
        out = np.zeros(shape, dtype)
        for s, d, sr, dr in mine:
            if s == d:
                out[dr] += x[sr]
            elif s == rank:
                communicator.send(_contiguous(x[sr]), d)
            else:
                out[dr] += communicator.recv(np.empty(out[dr].shape, dtype), s)
        return out

    return exchange


def _global(op: graph.ParameterOp | graph.InputOp) -> tuple[tuple[int, ...], Layout]:
    typ = op.global_type
    layout = layout_of(typ) if typ is not None else None
    if not isinstance(typ, TensorType) or layout is None:
        raise PlanError(f"'{op.name}' \"{op.tensor_name.data}\" has no global_type with a layout: not physical IR")
    return typ.get_shape(), layout


def build_plan(fn: func.FuncOp, rank: int, communicator: Communicator) -> Plan:
    """Return the plan that runs physical step function `fn` as `rank`.

    Functions that `fn` calls (repeated layers) are compiled once each into sub-plans.
    """
    plan = Plan(rank)
    slots: dict[SSAValue, int] = {}
    module = fn.parent_op()
    callees: dict[str, Callable] = {}

    def slot(value: SSAValue) -> int:
        if value not in slots:
            slots[value] = len(slots)
        return slots[value]

    for op in fn.body.block.ops:
        match op:
            case func.ReturnOp():
                pass
            case graph.ParameterOp() | graph.InputOp():
                shape, layout = _global(op)
                leaf = Leaf(op.tensor_name.data, slot(op.result), shape, layout, dtype_name(op.result.type))
                if isinstance(op, graph.ParameterOp):
                    plan.params.append(Leaf(**{**leaf.__dict__, "init": op.init.data}))
                else:
                    plan.inputs.append(leaf)
            case graph.ConstantOp():
                plan.constants[slot(op.result)] = _constant(op)
            case graph.OutputOp():
                plan.outputs.append((op.tensor_name.data, slot(op.value)))
            case graph.AssignOp():
                plan.assigns.append((op.tensor_name.data, slot(op.value)))
            case _:
                kernel = _kernel(op, rank, communicator, module, callees)
                plan.steps.append((kernel, tuple(slot(v) for v in op.operands), tuple(slot(r) for r in op.results)))
    plan.num_slots = len(slots)
    return plan


def _constant(op: graph.ConstantOp) -> np.ndarray:
    typ = op.result.type
    return np.full(typ.get_shape(), op.value.value.data, dtype_name(typ))


def _kernel(op: Operation, rank: int, communicator: Communicator, module, callees: dict[str, Callable]) -> Callable:
    """Return the call that computes `op` on `rank`."""
    if isinstance(op, func.CallOp):
        name = op.callee.root_reference.data
        if name not in callees:
            callees[name] = _function_kernel(_lookup(module, name, op), rank, communicator, module, callees)
        return callees[name]
    if op.dialect_name() == "comm":
        return _comm_kernel(op, rank, communicator)
    if op.dialect_name() in KERNELS:
        return KERNELS[op.dialect_name()](op, rank)
    raise PlanError(f"'{op.name}' cannot run: lower it to {', '.join(KERNELS)} or comm ops first")


def _lookup(module, name: str, op: Operation) -> func.FuncOp:
    for candidate in module.body.block.ops if module is not None else ():
        if isinstance(candidate, func.FuncOp) and candidate.sym_name.data == name:
            return candidate
    raise PlanError(f"'{op.name}' calls @{name}, which the module does not define")


def _function_kernel(fn: func.FuncOp, rank: int, communicator: Communicator, module, callees) -> Callable:
    """Return a Python function that runs the body of `fn` (a sub-plan) on its arguments."""
    block = fn.body.block
    slots: dict[SSAValue, int] = {arg: i for i, arg in enumerate(block.args)}
    steps: list[tuple[Callable, tuple[int, ...], tuple[int, ...]]] = []
    constants: list[tuple[int, np.ndarray]] = []
    returns: tuple[int, ...] = ()

    def slot(value: SSAValue) -> int:
        if value not in slots:
            slots[value] = len(slots)
        return slots[value]

    for op in block.ops:
        if isinstance(op, func.ReturnOp):
            returns = tuple(slot(v) for v in op.operands)
        elif isinstance(op, graph.ConstantOp):
            constants.append((slot(op.result), _constant(op)))
        elif op.dialect_name() == "graph" and isinstance(op, (graph.ParameterOp, graph.InputOp, graph.OutputOp, graph.AssignOp)):
            raise PlanError(f"@{fn.sym_name.data}: '{op.name}' belongs in the step function, not a callee")
        else:
            kernel = _kernel(op, rank, communicator, module, callees)
            steps.append((kernel, tuple(slot(v) for v in op.operands), tuple(slot(r) for r in op.results)))
    num_slots, nargs, single = len(slots), len(block.args), len(returns) == 1

    def call(*args):
        env: list = [None] * num_slots
        env[:nargs] = args
        for s, value in constants:
            env[s] = value
        for kernel, ins, outs in steps:
            result = kernel(*[env[a] for a in ins])
            if len(outs) == 1:
                env[outs[0]] = result
            elif outs:
                for s, value in zip(outs, result):
                    env[s] = value
        return env[returns[0]] if single else tuple(env[r] for r in returns)

    return call
