"""Inspecting compiled IR: what a physical program communicates, and why values have their layouts.

`collective_report(physical)` lists every `comm` op of a physical module, per device group,
with the bytes one rank sends for it per training step; `format_report` prints the list
(`hspmd compile --report`). `explain_rows(annotated, provenance)` pairs each value of an
annotated module with its layout and where that came from (`propagate_layouts.propagate`
gives the provenance); `format_explain` prints them (`hspmd compile --explain`).

Bytes per rank per call, for a group of n ranks and a local buffer of B bytes (the operand's,
unless said otherwise), counted as the usual ring algorithms send them:

| op | bytes a rank sends |
| --- | --- |
| `comm.all_reduce` | 2(n-1)/n * B (ring: reduce-scatter, then all-gather) |
| `comm.all_gather` | (n-1)/n * B of the result (every other rank's piece once) |
| `comm.reduce_scatter` | (n-1)/n * B |
| `comm.all_to_all` | (n-1)/n * B (every chunk but its own) |
| `comm.broadcast` | B if n > 1 (a ring: each rank but the last forwards the buffer once) |
| `comm.send` | B (on a rank that is a source of its pairs) |
| `comm.recv`, `comm.local_split`, `comm.local_zero` | 0 |
| `comm.exchange` | what its transfers send from the group's busiest rank |

Fractions are rounded down to whole bytes. An op inside a function counts once per call of
that function in one step (calls through calls multiply; a `pipeline.run` calls its forward and
its backward once per micro-batch).

Pure functions: nothing here changes the IR.
"""

from __future__ import annotations

import io
from collections import Counter
from dataclasses import dataclass

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.ir import Block, BlockArgument, Operation, SSAValue
from xdsl.printer import Printer

from hspmd.dialects import comm, graph, pipeline
from hspmd.dialects.comm import groups_of
from hspmd.dialects.levels import physical_groups

__all__ = [
    "ExplainRow", "Row", "call_counts", "collective_report", "explain_rows", "format_explain", "format_report",
    "value_names",
]

STEP = "train_step"


# ---------------------------------------------------------------------------------------------
# names, as the printer gives them


def value_names(module: ModuleOp) -> dict[SSAValue, str]:
    """Return `%name` of every value of `module` as `module_text(module)` prints it."""
    printer = Printer(stream=io.StringIO())
    printer.print_op(module)
    return {v: f"%{name}" for v, name in printer._ssa_values.items()}  # noqa: SLF001 (the names it printed)


def _functions(module: ModuleOp) -> dict[str, func.FuncOp]:
    return {op.sym_name.data: op for op in module.body.block.ops if isinstance(op, func.FuncOp)}


def _callees(fn: func.FuncOp) -> Counter:
    """Return how many times one run of `fn` runs each function it calls: a `func.call` once, a
    `graph.scan` once per iteration (layer), the forward and the backward of a `pipeline.run`
    once per micro-batch."""
    out: Counter = Counter()
    for op in fn.walk():
        if isinstance(op, func.CallOp):
            out[op.callee.root_reference.data] += 1
        elif isinstance(op, graph.ScanOp):
            out[op.callee.root_reference.data] += op.num_iterations
        elif isinstance(op, pipeline.RunOp):
            for ref in (op.forward, op.backward):
                out[ref.root_reference.data] += op.microbatches.value.data
    return out


def call_counts(module: ModuleOp, entry: str = STEP) -> dict[str, int]:
    """Return how many times each function of `module` runs in one call of `@entry` (0: never)."""
    funcs = _functions(module)
    calls = {name: _callees(fn) for name, fn in funcs.items()}
    memo: dict[str, int] = {}

    def count(name: str, seen: frozenset[str] = frozenset()) -> int:
        if name not in memo:
            if name in seen:  # recursion: the IR has none; do not loop
                return 0
            own = 1 if name == entry else 0
            memo[name] = own + sum(k[name] * count(c, seen | {name}) for c, k in calls.items() if name in k)
        return memo[name]

    return {name: count(name) for name in funcs}


# ---------------------------------------------------------------------------------------------
# collectives


@dataclass(frozen=True)
class Row:
    """One `comm` op of a physical program and what it sends."""

    devices: tuple[int, ...]  # the device group (physical module) the op runs in
    function: str  # the function holding the op
    value: str  # its result (or, for a send, its operand) as printed: `%75`
    op: str  # `comm.all_reduce`, ...
    groups: tuple[tuple[int, ...], ...]  # rank groups (send/recv: [src, dst] pairs)
    element_type: str  # `f32`
    shape: tuple[int, ...]  # local shape of the operand (recv: of the result)
    result_shape: tuple[int, ...]  # local shape of the result (send: the operand's)
    bytes_per_call: int  # bytes one rank sends per execution of the op
    calls: int  # executions per training step

    @property
    def bytes_per_step(self) -> int:
        return self.bytes_per_call * self.calls


def tensor_nbytes(t) -> int:
    """Return the bytes of a value of type `t` (0 for a type that is not a tensor)."""
    if not isinstance(t, TensorType):
        return 0
    size = 1
    for d in t.get_shape():
        size *= d
    elem = t.element_type
    width = getattr(elem, "size", None) or (getattr(elem, "bitwidth", 8) + 7) // 8
    return size * width


def bytes_sent(op: Operation, devices: tuple[int, ...] = ()) -> int:
    """Return the bytes one rank sends per execution of the comm op `op` (module docstring).

    For `comm.exchange`, whose ranks send different amounts, the most any of `devices` (the
    group's ranks; all members when empty) sends.
    """
    if isinstance(op, comm.ExchangeOp):
        item = tensor_nbytes(TensorType(op.input.type.element_type, [1]))  # type: ignore[attr-defined]
        sent: dict[int, int] = {}
        for s, d, region in op.transfer_list():
            if s != d:
                sent[s] = sent.get(s, 0) + item * int(np.prod([n for _, _, n in region]))
        return max((sent.get(r, 0) for r in devices or op.members()), default=0)
    if isinstance(op, comm.SendOp):
        return tensor_nbytes(op.input.type)  # type: ignore[arg-type]
    if isinstance(op, (comm.RecvOp, comm.LocalSplitOp, comm.LocalZeroOp)):
        return 0
    assert isinstance(op, comm._Collective)  # noqa: SLF001
    n = op.group_size()
    b_in, b_out = tensor_nbytes(op.input.type), tensor_nbytes(op.result.type)  # type: ignore[arg-type]
    if isinstance(op, comm.AllReduceOp):
        return 2 * (n - 1) * b_in // n
    if isinstance(op, comm.AllGatherOp):
        return (n - 1) * b_out // n
    if isinstance(op, (comm.ReduceScatterOp, comm.AllToAllOp)):
        return (n - 1) * b_in // n
    if isinstance(op, comm.BroadcastOp):
        return b_in if n > 1 else 0
    raise ValueError(f"no byte count for '{op.name}'")


def _type_of(t) -> tuple[str, tuple[int, ...]]:
    return str(t.element_type), tuple(t.get_shape())


def collective_report(physical: ModuleOp) -> list[Row]:
    """Return one Row per comm op of each device group of `physical`, in program order per function."""
    rows: list[Row] = []
    names = value_names(physical)
    for devices, group in physical_groups(physical):
        counts = call_counts(group)
        for fname, fn in _functions(group).items():
            if not counts[fname]:
                continue
            for op in fn.walk():
                if op.dialect_name() != "comm":
                    continue
                if isinstance(op, (comm.SendOp, comm.RecvOp)):
                    value = op.input if isinstance(op, comm.SendOp) else op.result
                    elem, shape = _type_of(value.type)
                    rank_groups, out = groups_of(op.pairs), shape
                elif isinstance(op, comm.ExchangeOp):
                    value = op.result
                    elem, shape = _type_of(op.input.type)
                    rank_groups, out = (op.members(),), _type_of(value.type)[1]
                else:
                    value = op.result  # type: ignore[attr-defined]
                    elem, shape = _type_of(op.input.type)  # type: ignore[attr-defined]
                    rank_groups, out = op.rank_groups, _type_of(value.type)[1]  # type: ignore[attr-defined]
                rows.append(Row(
                    devices, fname, names.get(value, "?"), op.name, rank_groups, elem, shape, out,
                    bytes_sent(op, tuple(devices)), counts[fname],
                ))
    return rows


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) if shape else "scalar"


def _groups_text(groups: tuple[tuple[int, ...], ...]) -> str:
    return "[" + ", ".join("[" + ",".join(map(str, g)) + "]" for g in groups) + "]"


def _table(header: list[str], lines: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in (header, *lines)) for i in range(len(header))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in (header, *lines)]


def format_report(rows: list[Row], physical: ModuleOp | None = None) -> str:
    """Return the report as text: a table per device group, then its totals.

    Pass `physical` to list device groups without collectives too.
    """
    groups: dict[tuple[int, ...], list[Row]] = {}
    if physical is not None:
        groups = {devices: [] for devices, _ in physical_groups(physical)}
    for r in rows:
        groups.setdefault(r.devices, []).append(r)
    out: list[str] = []
    for devices, rs in groups.items():
        out.append(f"device group [{', '.join(map(str, devices))}]")
        if not rs:
            out.append("  no collectives")
            continue
        header = ["op", "value", "in", "rank groups", "type", "shape", "calls", "bytes/call", "bytes/step"]
        lines = [
            [
                r.op, r.value, f"@{r.function}", _groups_text(r.groups), r.element_type,
                _shape_text(r.shape) + ("" if r.result_shape == r.shape else f" -> {_shape_text(r.result_shape)}"),
                str(r.calls), f"{r.bytes_per_call:,}", f"{r.bytes_per_step:,}",
            ]
            for r in rs
        ]
        out += _table(header, lines)
        kinds = Counter()
        for r in rs:
            kinds[r.op] += r.calls
        calls = sum(kinds.values())
        total = sum(r.bytes_per_step for r in rs)
        by_kind = ", ".join(f"{k} {v}" for k, v in kinds.items())
        out.append(f"  total: {calls} collective calls per step ({by_kind}), {total:,} bytes per rank per step")
    out.append("bytes per rank per step: what one rank sends (ring all-reduce 2(n-1)/n of its buffer, "
               "all-gather (n-1)/n of the result, reduce-scatter and all-to-all (n-1)/n; docs/passes.md)")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------
# layout provenance


@dataclass(frozen=True)
class ExplainRow:
    """One value of an annotated module: what makes it, its layout, where the layout came from."""

    function: str
    value: str  # `%12`, as printed
    op: str  # `graph.matmul`, `graph.parameter "fc1.weight"`, `argument` for a block argument
    layout: str  # the layout text, or `-` when the value has none
    why: str


def _slot(v: SSAValue) -> tuple[Operation | Block, int]:
    """Return where `v` lives (its op or block, and index): the same after a value is retyped."""
    if isinstance(v, BlockArgument):
        return v.block, v.index
    return v.op, v.index  # type: ignore[attr-defined]


def _what(op: Operation) -> str:
    name = op.properties.get("tensor_name") or op.attributes.get("tensor_name")
    if isinstance(op, (func.CallOp, graph.ScanOp)):
        return f"{op.name} @{op.callee.root_reference.data}"
    return f'{op.name} "{name.data}"' if name is not None else op.name  # type: ignore[attr-defined]


def explain_rows(annotated: ModuleOp, provenance: dict[SSAValue, str]) -> list[ExplainRow]:
    """Return one row per value of each function of `annotated` (the step first), in program order.

    `provenance` maps values to why they have their layout (`propagate_layouts.propagate`);
    `dist.reshard` results are `reshard of %N`; values it does not know are `-`.
    """
    from hspmd.dialects.dist import layout_of

    whys = {_slot(v): reason for v, reason in provenance.items()}
    names = value_names(annotated)
    funcs = _functions(annotated)
    order = sorted(funcs, key=lambda n: n != STEP)
    rows: list[ExplainRow] = []
    for fname in order:
        block = funcs[fname].body.block
        values = [(v, "argument") for v in block.args]
        values += [(v, _what(op)) for op in funcs[fname].walk() if op is not funcs[fname] for v in op.results]
        for v, what in values:
            lay = layout_of(v) if isinstance(v.type, TensorType) else None
            if what == "dist.reshard":
                why = f"reshard of {names.get(v.owner.operands[0], '?')}"  # type: ignore[union-attr]
            else:
                why = whys.get(_slot(v), "-")
            rows.append(ExplainRow(fname, names.get(v, "?"), what, str(lay) if lay is not None else "-", why))
    return rows


def format_explain(rows: list[ExplainRow]) -> str:
    """Return the rows as text: a table per function."""
    out: list[str] = []
    by_function: dict[str, list[ExplainRow]] = {}
    for r in rows:
        by_function.setdefault(r.function, []).append(r)
    for fname, rs in by_function.items():
        out.append(f"@{fname}")
        out += _table(["value", "op", "layout", "from"], [[r.value, r.op, r.layout, r.why] for r in rs])
    return "\n".join(out) + "\n"
