"""Small helpers shared by passes: finding the step function and named ops."""

from __future__ import annotations

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation

from hspmd.dialects.dist import module_strategies
from hspmd.ir.strategy import StrategyRecord


class PassError(Exception):
    """A pass cannot apply to this IR; the message says which op or name and why."""


class StrategyLimitError(PassError):
    """A strategy asks for something the compiler does not support, which only lowering shows
    (the strategy checks cannot see it before the communication is placed): a refusal of the
    user's strategy, one line naming what to change, not a compiler bug (`run_passes` lets it
    through as the checks' refusals go, not as an internal error)."""


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


def callee_of(call: Operation, module: Operation | None = None) -> func.FuncOp:
    """Return the `func.func` that `call` (a `func.call` or a `graph.scan`) calls: of `module`
    where given (`call` may be in a copy of a function, outside any module), else of `call`'s."""
    from xdsl.traits import SymbolTable

    callee = SymbolTable.lookup_symbol(module or call, call.callee)  # type: ignore[attr-defined]
    if not isinstance(callee, func.FuncOp):
        raise PassError(f"{call.name} of @{call.callee.root_reference.data}: no such function")  # type: ignore
    return callee


def scan_carries(module: ModuleOp) -> dict[str, set[tuple[int, int]]]:
    """Return {function name: its (argument, result) carries} for every function a `graph.scan`
    of `module` calls: its result k is fed back as argument j, so the two must agree in type and layout."""
    out: dict[str, set[tuple[int, int]]] = {}
    for op in module.walk():
        if op.name == "graph.scan":
            out.setdefault(op.callee.root_reference.data, set()).update(op.carries())  # type: ignore[attr-defined]
    return out
