"""The steps `hspmd reduce` shrinks a program by, each keeping the IR valid (or saying it did not).

- `drop_ops(module, picks)`: a copy without the ops at positions `picks` of `droppable_ops`: each
  result read elsewhere is replaced by an operand of the same type, else by a `graph.constant` of
  its type (1.0 everywhere); then what no longer feeds an output, an assign or a collective goes
  (`dead_code`), and private functions nothing calls (`unused_functions`).
- `inline_calls(module, picks)`: a copy with the calls at positions `picks` of the program's
  `func.call`s replaced by their callee's body (a layer function), so that what a layer needs
  can be dropped op by op.
- `shrink_dim(text, size, to)`: the program's text with every tensor dim of `size` made `to`
  (a batch, a width, a sequence); whatever no longer fits fails the verifier, and the step is not
  taken.
- `smaller_strategies(record)`: the strategies one step smaller than `record`'s: a device group
  dropped, pipeline stages, tp, dp or ep cut, ZeRO, recompute and sp off, one micro-batch; the
  reducer annotates the stripped program under each again.

`count_ops` is the size the reducer minimises: the ops of the program (modules, functions and
their returns not counted).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

from xdsl.dialects import func
from xdsl.dialects.builtin import ArrayAttr, DictionaryAttr, ModuleOp, SymbolRefAttr, TensorType
from xdsl.ir import Attribute, Operation

from hspmd.dialects import graph
from hspmd.dialects.dist import module_strategies
from hspmd.dialects.levels import physical_groups
from hspmd.ir.strategy import Strategy, StrategyError, StrategyGroup, StrategyRecord

__all__ = ["count_ops", "dead_code", "droppable_ops", "drop_ops", "inline_calls", "level_of", "shrink_dim",
           "smaller_strategies", "tensor_dims", "unused_functions"]

_STRUCTURE = ("builtin.module", "func.func", "func.return")
#: ops kept however unused: their effect is not a result (collectives must match across ranks)
_EFFECT_DIALECTS = ("comm", "pipeline")


def count_ops(module: ModuleOp) -> int:
    """Return the number of ops of `module`'s program (modules, functions and returns not counted)."""
    return sum(1 for op in module.walk() if op.name not in _STRUCTURE)


def level_of(module: ModuleOp) -> str:
    """Return "physical" (device group modules), "annotated" (a recorded strategy) or "logical"."""
    if physical_groups(module):
        return "physical"
    return "annotated" if module_strategies(module) else "logical"


def droppable_ops(module: ModuleOp) -> list[Operation]:
    """Return the ops `drop_ops` may drop, in program order: every op but modules, functions and
    block terminators."""
    return [op for op in module.walk() if op.name not in _STRUCTURE and not _is_terminator(op)]


def _is_terminator(op: Operation) -> bool:
    block = op.parent_block()
    return block is not None and block.last_op is op and op.parent_op() is not None and \
        not isinstance(op.parent_op(), ModuleOp)


def drop_ops(module: ModuleOp, picks: list[int]) -> ModuleOp:
    """Return a copy of `module` without the ops at positions `picks` of `droppable_ops` (see the
    module docstring); the copy may not verify: the caller checks."""
    out = module.clone()
    ops = droppable_ops(out)
    for i in sorted(picks):
        op = ops[i]
        for r in op.results:
            if not r.uses:
                continue
            same = next((v for v in op.operands if v.type == r.type), None)
            if same is None:
                if not isinstance(r.type, TensorType):
                    raise ValueError(f"'{op.name}' has a result of {r.type}, which nothing can stand for")
                const = graph.ConstantOp(1.0, r.type)
                op.parent_block().insert_op_before(const, op)
                same = const.result
            r.replace_all_uses_with(same)
        op.detach()
        op.erase(safe_erase=False)
    dead_code(out)
    unused_functions(out)
    return out


def inline_calls(module: ModuleOp, picks: list[int] | None = None) -> ModuleOp:
    """Return a copy of `module` with the `func.call`s at positions `picks` (None: all) of its calls,
    in program order, replaced by their callees' bodies (calls of functions with one block)."""
    out = module.clone()
    functions = {f.sym_name.data: f for f in out.walk() if isinstance(f, func.FuncOp) and not f.is_declaration}
    calls = [op for op in out.walk() if isinstance(op, func.CallOp)]
    for i, call in enumerate(calls):
        callee = functions.get(call.callee.root_reference.data)
        if (picks is not None and i not in picks) or callee is None or len(callee.body.blocks) != 1:
            continue
        values = dict(zip(callee.body.block.args, call.operands))
        results = list(call.operands)
        for op in callee.body.block.ops:
            if isinstance(op, func.ReturnOp):
                results = [values.get(v, v) for v in op.operands]
                break
            copy = op.clone(value_mapper=values)
            call.parent_block().insert_op_before(copy, call)
            values.update(zip(op.results, copy.results))
        for r, v in zip(call.results, results):
            r.replace_all_uses_with(v)
        call.detach()
        call.erase(safe_erase=False)
    dead_code(out)
    unused_functions(out)
    return out


def dead_code(module: ModuleOp) -> int:
    """Drop, until none is left, ops whose every result is unused (not collectives, not terminators);
    return how many went."""
    gone = 0
    while True:
        dead = [op for op in module.walk() if op.results and all(not r.uses for r in op.results)
                and op.dialect_name() not in _EFFECT_DIALECTS and op.name not in _STRUCTURE
                and not _is_terminator(op)]
        if not dead:
            return gone
        for op in reversed(dead):  # users before what they read
            if all(not r.uses for r in op.results):
                op.detach()
                op.erase(safe_erase=False)
                gone += 1


def _symbols(attr: Attribute, out: set[str]) -> None:
    if isinstance(attr, SymbolRefAttr):
        out.add(attr.root_reference.data)
    elif isinstance(attr, ArrayAttr):
        for a in attr.data:
            _symbols(a, out)
    elif isinstance(attr, DictionaryAttr):
        for a in attr.data.values():
            _symbols(a, out)


def unused_functions(module: ModuleOp) -> int:
    """Drop private functions that no op names (a call, a scan, a pipeline run); return how many."""
    gone = 0
    while True:
        used: set[str] = set()
        for op in module.walk():
            for attr in (*op.properties.values(), *op.attributes.values()):
                _symbols(attr, used)
        unused = [op for op in module.walk() if isinstance(op, func.FuncOp) and op.sym_name.data not in used
                  and op.sym_visibility is not None and op.sym_visibility.data == "private"]
        if not unused:
            return gone
        for op in unused:
            op.detach()
            op.erase(safe_erase=False)
            gone += 1


_TENSOR_DIMS = re.compile(r"tensor<((?:\d+x)+)")


def tensor_dims(text: str) -> Counter:
    """Return how often each dim size (> 1) appears in the tensor types of IR `text`."""
    sizes: Counter = Counter()
    for m in _TENSOR_DIMS.finditer(text):
        sizes.update(int(d) for d in m.group(1).split("x") if d and int(d) > 1)
    return sizes


def shrink_dim(text: str, size: int, to: int) -> str:
    """Return IR `text` with every tensor dim of `size` made `to` (see the module docstring)."""
    def one(m: re.Match) -> str:
        dims = [d for d in m.group(1).split("x") if d]
        return "tensor<" + "".join(f"{to if int(d) == size else int(d)}x" for d in dims)

    return _TENSOR_DIMS.sub(one, text)


def _renumbered(groups: list[StrategyGroup]) -> Strategy:
    """Return the strategy of `groups` with their devices numbered 0.. group after group."""
    out, start = [], 0
    for g in groups:
        k = g.dp * g.tp * g.pp * g.ep
        out.append(replace(g, devices=tuple(range(start, start + k))))
        start += k
    return Strategy(tuple(out))


def smaller_strategies(record: StrategyRecord) -> list[StrategyRecord]:
    """Return the records one step smaller than `record` (see the module docstring), biggest cut first;
    those the strategy rules refuse are left out."""
    groups = list(record.strategy.groups)
    options: list[list[StrategyGroup]] = []
    if len(groups) > 1:
        options += [groups[:i] + groups[i + 1:] for i in range(len(groups))]
    for i, g in enumerate(groups):
        cuts = []
        for key in ("pp", "tp", "dp", "ep"):
            v = getattr(g, key)
            for to in sorted({1, v // 2} - {0, v}):
                change = {key: to}
                if key == "pp":
                    change["layers"] = None
                if key == "tp" and to == 1:
                    change["sp"] = 0
                if key == "ep" and g.experts is not None and g.experts % to:
                    continue
                cuts.append(change)
        cuts += [{"zero": 0}] if g.zero else []
        cuts += [{"recompute": "none"}] if g.recompute != "none" else []
        cuts += [{"sp": 0}] if g.sp else []
        cuts += [{"share": 1}] if g.share != 1 and len(groups) > 1 else []
        for change in cuts:
            degrees = {k: change.get(k, getattr(g, k)) for k in ("dp", "tp", "pp", "ep")}
            devices = tuple(range(degrees["dp"] * degrees["tp"] * degrees["pp"] * degrees["ep"]))
            try:  # numbered 0.. for now: `_renumbered` places the groups one after another
                options.append(groups[:i] + [replace(g, **change, devices=devices)] + groups[i + 1:])
            except StrategyError:
                continue
    out = []
    for option in options:
        try:
            strategy = _renumbered(option)
            pipelined = any(g.pp > 1 for g in strategy.groups)
            out.append(StrategyRecord(record.id, strategy, record.microbatches if pipelined else 1,
                                      record.schedule if pipelined else "gpipe"))
        except StrategyError:
            continue
    if record.microbatches > 1:
        out.append(StrategyRecord(record.id, record.strategy, 1, record.schedule))
    return out
