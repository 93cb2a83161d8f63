"""Small helpers shared by passes: finding the step function and named ops."""

from __future__ import annotations

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation


class PassError(Exception):
    """A pass cannot apply to this IR; the message says which op or name and why."""


def strategy_option(text: str):
    """Return the Strategy of a pass's `strategy` option; a bad one raises PassError with its message."""
    from hspmd.frontend.strategy import StrategyError, parse_strategy

    try:
        return parse_strategy(text)
    except StrategyError as err:
        raise PassError(str(err)) from None


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
