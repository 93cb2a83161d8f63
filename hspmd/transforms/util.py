"""Small helpers shared by passes: finding the step function and named ops."""

from __future__ import annotations

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation

from hspmd.dialects.dist import module_strategies
from hspmd.ir.strategy import StrategyRecord


class PassError(Exception):
    """A pass cannot apply to this IR; the message says which op or name and why."""


def module_strategy(module: ModuleOp, sid: int | None = None, what: str = "this pass") -> StrategyRecord:
    """Return the strategy recorded on `module` (`dist.strategies`) with id `sid`, or its only one.

    Raises PassError when there is none (`apply-strategy` records it), or when `sid` is None and
    the module holds several.
    """
    records = module_strategies(module)
    if sid is not None:
        for r in records:
            if r.id == sid:
                return r
        raise PassError(f"{what} needs strategy {sid}, but the module records "
                        f"{', '.join(str(r.id) for r in records) or 'none'} (apply-strategy records one)")
    if not records:
        raise PassError(f"{what} needs the module's strategy (`dist.strategies`), and the module has none: "
                        "run apply-strategy first")
    if len(records) > 1:
        raise PassError(f"{what}: the module records {len(records)} strategies; say which one (its id)")
    return records[0]


def step_function(module: ModuleOp, name: str = "train_step") -> func.FuncOp:
    """Return the `func.func @name` of `module` (the training step)."""
    for op in module.walk():
        if isinstance(op, func.FuncOp) and op.sym_name.data == name:
            return op
    raise PassError(f"no function @{name} in the module")


def terminator(fn: func.FuncOp) -> Operation:
    """Return the `func.return` that ends the step function's single block."""
    block = fn.body.block
    last = block.last_op
    if not isinstance(last, func.ReturnOp):
        raise PassError(f"@{fn.sym_name.data} does not end with func.return")
    return last


def callee_of(call: func.CallOp) -> func.FuncOp:
    """Return the `func.func` that `call` calls."""
    from xdsl.traits import SymbolTable

    callee = SymbolTable.lookup_symbol(call, call.callee)
    if not isinstance(callee, func.FuncOp):
        raise PassError(f"func.call of @{call.callee.root_reference.data}: no such function")
    return callee
