"""`stack-layers`: consecutive calls of one layer function become one `graph.scan` over stacked parameters.

A transformer traced for one device calls its block function once per layer, each call with
that layer's own parameters:

    %w0 = graph.parameter "blocks.0.attn.proj.weight" ...     (one per layer and weight)
    %x1 = func.call @Block_0(%w0, ..., %x0)
    %x2 = func.call @Block_0(%w1, ..., %x1)

This pass finds such a chain (the same callee; each call takes some results of the one before
at the same argument positions, the carry; every other operand either a parameter used by
that call only, or one value shared by every call) and replaces it by

    %w = graph.parameter "blocks.[0:2].attn.proj.weight" ... : tensor<2x...>   (slice i: layer i)
    %x2 = graph.scan @Block_0(%w, ..., %x0) {length = 2, stacked = ..., carry_args = ..., carry_results = ...}

so that no level of the program holds anything per layer: its size and compile time stay flat
in the layer count, and the optimizer updates each stacked parameter with one op. A stacked
parameter's initial value is its layers' own (each seeded by its per-layer name), so the step
computes what the calls computed. A mixed-precision model's `graph.cast` of each parameter
becomes one cast of the stacked parameter.

A chain is left as calls (and the program is the same as without the pass) when any of this
does not hold: the per-layer parameter names differ in one dotted component that counts up
(`hspmd.ir.stacked_names`), with one `init`; a call result other than the carry is
unused; an operand that differs per call is a parameter, or a per-call counter `base + c_k`
with constants c_k counting up by one step (a dropout's random stream: `step + (k << 32)`),
which becomes one stacked operand `broadcast(base) + graph.iota`. Chains of fewer than
`min_length` calls are left too.

Layers that repeat with a period stack too. Gemma-3 calls its block as sliding-window attention
five times, then as full attention (two functions, `@L_0` x5 then `@L_1`); Cohere-2 and SmolLM3
take turns of 3 and 1. A chain of calls whose callees repeat with period p (after some first
calls that do not, which stay calls) becomes one function `@L_0_period6` that makes one period's
p calls in turn (each call's carry fed by the one before; the callees stay functions, so the
program holds each layer function once however long the period), and a scan of it over the
periods: parameter k of period member m is stacked over the layers m, m + p,
m + 2p, ... (`blocks.[1:49:2].mlp.w`, `hspmd.ir.stacked_names`). The period is the one that
covers the most calls (the shortest of those), so a plain chain stays period 1.

Functions alike but for their literals (Gemma-3's sliding and full layers read different rotary
tables) are first made one function that takes them (`hspmd.transforms.layer_literals`), so
their calls stack with period 1, the per-call table numbers stacked as one literal.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerType, ModuleOp
from xdsl.ir import Block, Operation, Region, SSAValue
from xdsl.passes import ModulePass

from hspmd.dialects import graph
from hspmd.ir.stacked_names import stack_name
from hspmd.transforms.layer_literals import unify_literals
from hspmd.transforms.util import PassError, step_function


@dataclass
class _Chain:
    """Consecutive periods of calls, each period's p calls in turn, and how their operands relate.

    A period's operands (`row`) are its first call's, then each later call's but those the calls
    before it in the period made (the period's own carries, `inner`: HY-v4's second "shared"
    layer reads the hidden states of the one before and the top-k indices of the full layer
    before that)."""

    groups: list[list[func.CallOp]]
    inner: list[dict[int, tuple[int, int]]]  # per member m: {argument index: (member m' < m, its result index)}

    def row(self, k: int) -> list[SSAValue]:
        """Return period k's operands."""
        calls = self.groups[k]
        out = list(calls[0].operands)
        for m in range(1, len(calls)):
            out += [v for j, v in enumerate(calls[m].operands) if j not in self.inner[m]]
        return out


def _carries(prev: func.CallOp, operands: list[SSAValue]) -> list[tuple[int, int]]:
    """Return (operand index, result of `prev`) for each of `operands` that `prev` made."""
    return [(j, v.index) for j, v in enumerate(operands) if v.owner is prev]  # type: ignore[attr-defined]


def _runs(block) -> list[list[func.CallOp]]:
    """Return the maximal runs of calls in `block`: each call reads some results of the one
    before, and only calls read that one's results (HY-v4's "shared" layers read the top-k
    indices of the last full layer; `StackLayers._stack` checks that each is read where a scan
    can hand it on)."""
    runs: list[list[func.CallOp]] = []
    for op in block.ops:
        if not isinstance(op, func.CallOp):
            continue
        if runs and runs[-1]:
            prev = runs[-1][-1]
            if _carries(prev, list(op.operands)) and all(isinstance(u.operation, func.CallOp)
                                                         for r in prev.results for u in r.uses):
                runs[-1].append(op)
                continue
        runs.append([op])
    return [r for r in runs if len(r) > 1]


def _periods(keys: list[str], min_length: int) -> list[tuple[int, int, int]]:
    """Return the (start, period, count) of `keys` that repeat: keys[start:start + period] then
    `count - 1` copies of it, count >= min_length; those covering most keys first, then the
    shortest period, then the earliest start."""
    n, found = len(keys), []
    for start in range(n):
        for period in range(1, (n - start) // min_length + 1):
            count = 1
            while (start + (count + 1) * period <= n
                   and keys[start + count * period:start + (count + 1) * period] == keys[start:start + period]):
                count += 1
            if count >= min_length:
                found.append((start, period, count))
    return sorted(found, key=lambda f: (-f[1] * f[2], f[1], f[0]))


def _inner(groups: list[list[func.CallOp]]) -> list[dict[int, tuple[int, int]]] | None:
    """Return each member's arguments made by members before it in its period, {argument: (member,
    result)} (alike in every period; the member before among them), or None where the periods
    differ in how their members pass values on."""
    inner: list[dict[int, tuple[int, int]]] = [{}]
    for m in range(1, len(groups[0])):
        links = [{j: (m2, r) for m2 in range(m) for j, r in _carries(g[m2], list(g[m].operands))} for g in groups]
        if any(link != links[0] for link in links) or not any(m2 == m - 1 for m2, _ in links[0].values()):
            return None
        inner.append(links[0])
    return inner


def _handed_on_only(chain: _Chain, rows: list[list[SSAValue]], carries: list[tuple[int, int]]) -> bool:
    """Return whether every result of the chain's calls is read only where a scan of its periods
    hands it on: by a later member of its period (`_Chain.inner`), a last member's carried result
    by the next period at a carried argument, or after the chain (the last period's)."""
    period, count = len(chain.groups[0]), len(chain.groups)
    carried_at = {}  # (period k, id of its row's operand value) -> carried result index
    for k in range(1, count):
        for j, r in carries:
            carried_at.setdefault((k, id(rows[k][j])), set()).add(r)
    for k, group in enumerate(chain.groups):
        for m, call in enumerate(group):
            later = {(m2, j) for m2 in range(m + 1, period) for j, (src, _) in chain.inner[m2].items() if src == m}
            for r, result in enumerate(call.results):
                for use in result.uses:
                    op = use.operation
                    inside = [m2 for m2 in range(m + 1, period) if group[m2] is op]
                    if inside and (inside[0], use.index) in later and chain.inner[inside[0]][use.index] == (m, r):
                        continue
                    if m == period - 1 and k + 1 < count and r in carried_at.get((k + 1, id(result)), ()):
                        if any(c is op for c in chain.groups[k + 1]):
                            continue
                    if m == period - 1 and k + 1 == count and r in {c for _, c in carries}:
                        if not any(c is op for g in chain.groups for c in g):
                            continue
                    return False
    return True


def _counter(values: list[SSAValue]) -> tuple[SSAValue, int, int] | None:
    """Return (base, start, step) when `values[k]` is `base + constant(start + k * step)`, integer
    scalars each used once (the per-call counter of a layer that draws random numbers)."""
    found = []
    for v in values:
        add = v.owner
        if not isinstance(add, graph.AddOp) or v.uses.get_length() != 1 or graph.tensor_shape(v) != ():
            return None
        base, const = add.lhs, add.rhs
        if not isinstance(const.owner, graph.ConstantOp) or not isinstance(v.type.element_type, IntegerType):
            return None
        found.append((base, int(const.owner.value.value.data)))
    if len({id(b) for b, _ in found}) != 1:
        return None
    offsets = [c for _, c in found]
    step = offsets[1] - offsets[0]
    if offsets != [offsets[0] + k * step for k in range(len(offsets))]:
        return None
    return found[0][0], offsets[0], step


def _literals(values: list[SSAValue]) -> list[graph.LiteralOp] | None:
    """Return the literals `values` are when each is a literal of one type used once (a per-call
    number `layer_literals` made), else None."""
    owners = [v.owner for v in values]
    if (not all(isinstance(o, graph.LiteralOp) for o in owners) or any(v.uses.get_length() != 1 for v in values)
            or len({v.type for v in values}) != 1):
        return None
    return owners  # type: ignore[return-value]


def _source(value: SSAValue) -> tuple[graph.ParameterOp, graph.CastOp | None] | None:
    """Return (parameter, cast or None) when `value` is a parameter (or its cast) used once."""
    op = value.owner
    cast = None
    if isinstance(op, graph.CastOp):
        if value.uses.get_length() != 1:
            return None
        cast, value = op, op.input
        op = value.owner
    if not isinstance(op, graph.ParameterOp) or value.uses.get_length() != 1:
        return None
    return op, cast


def _period_function(module: ModuleOp, chain: _Chain) -> func.FuncOp:
    """Add to `module` a function that makes one period's calls in turn, its arguments a period's
    row (`_Chain.row`), its results the last call's; return it."""
    funcs = {o.sym_name.data: o for o in module.body.block.ops if isinstance(o, func.FuncOp)}
    members = [funcs[c.callee.root_reference.data] for c in chain.groups[0]]
    row = chain.row(0)
    body = Block(arg_types=[v.type for v in row])
    args = iter(body.args)
    results: list[SSAValue] = []
    made: list[list[SSAValue]] = []
    for m, callee in enumerate(members):
        operands = [made[chain.inner[m][j][0]][chain.inner[m][j][1]] if j in chain.inner[m] else next(args)
                    for j in range(len(callee.body.block.args))]
        call = func.CallOp(callee.sym_name.data, operands, list(callee.function_type.outputs.data))
        body.add_op(call)
        results = list(call.results)
        made.append(results)
    body.add_op(func.ReturnOp(*results))
    name, k = f"{members[0].sym_name.data}_period{len(members)}", 1
    while name in funcs:
        k += 1
        name = f"{members[0].sym_name.data}_period{len(members)}_{k}"
    made = func.FuncOp(name, ([v.type for v in row], [v.type for v in results]), Region(body),
                       visibility="private")
    module.body.block.insert_op_after(made, members[-1])
    return made


def _call_periods(made: func.FuncOp, chain: _Chain) -> list[func.CallOp]:
    """Replace each period's calls of `chain` by one call of `made` (at its last call's place)."""
    calls = []
    for k, group in enumerate(chain.groups):
        last = group[-1]
        call = func.CallOp(made.sym_name.data, chain.row(k), [r.type for r in last.results])
        last.parent_block().insert_op_before(call, last)  # type: ignore[union-attr]
        for old, new in zip(last.results, call.results):
            old.replace_all_uses_with(new)
        for c in reversed(group):
            c.detach()
            c.erase()
        calls.append(call)
    return calls


@dataclass(frozen=True)
class StackLayers(ModulePass):
    """Replace chains of calls of layer functions, one function or a period of them repeating,
    by `graph.scan` over stacked parameters."""

    name = "stack-layers"
    min_length: int = 2

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        if self.min_length < 2:
            raise PassError(f"stack-layers: option min_length={self.min_length} must be >= 2")
        block = step_function(op).body.block
        merged: set[str] = set()
        for run in _runs(block):  # functions alike but for literals: one function first
            merged |= unify_literals(op, run)
        for run in _runs(block):
            self._stack_run(op, run, merged)
        used = {o.callee.root_reference.data for o in op.walk() if isinstance(o, (func.CallOp, graph.ScanOp))}
        for o in list(op.body.block.ops):  # the functions merged into one, if nothing else calls them
            if isinstance(o, func.FuncOp) and o.sym_name.data in merged - used:
                o.detach()
                o.erase()

    def _stack_run(self, module: ModuleOp, run: list[func.CallOp], merged: set[str]) -> None:
        """Stack the calls of `run` that repeat (the period covering most of them first; then
        what is left before and after it)."""
        keys = [c.callee.root_reference.data for c in run]
        tried: set[int] = set()
        for start, period, count in _periods(keys, self.min_length):
            if period in tried:
                continue  # one try per period: its longest stretch
            tried.add(period)
            groups = [run[start + k * period:start + (k + 1) * period] for k in range(count)]
            if self._stack(module, groups, merged):
                for part in (run[:start], run[start + period * count:]):
                    if len(part) >= self.min_length:
                        self._stack_run(module, part, merged)
                return

    @staticmethod
    def _stack(module: ModuleOp, groups: list[list[func.CallOp]], merged: set[str]) -> bool:
        """Replace the periods `groups` by a scan if they can be stacked; return whether they were."""
        period = len(groups[0])
        inner = _inner(groups) if period > 1 else [{}]
        if inner is None:
            return False
        chain = _Chain(groups, inner)
        rows = [chain.row(k) for k in range(len(groups))]
        carries = _carries(groups[0][-1], rows[1])
        if not carries or any(_carries(groups[k - 1][-1], rows[k]) != carries for k in range(2, len(groups))):
            return False
        carry_args = [j for j, _ in carries]
        carry_results = {r for _, r in carries}
        if len(carry_results) < len(carries) or any(
                _carries(groups[k - 1][m], rows[k]) for k in range(1, len(groups)) for m in range(period - 1)):
            return False  # a result carried to two arguments, or one of a period's other calls: not one carry each
        if not _handed_on_only(chain, rows, carries):
            return False  # a per-layer result used outside the chain: it would have to be stacked
        stacked: dict[int, list[tuple[graph.ParameterOp, graph.CastOp | None]]] = {}
        counters: dict[int, tuple[SSAValue, int, int]] = {}
        constants: dict[int, list[graph.LiteralOp]] = {}
        for j in range(len(rows[0])):
            if j in carry_args:
                continue
            values = [row[j] for row in rows]
            if all(v is values[0] for v in values):
                continue  # an invariant
            if (counter := _counter(values)) is not None:
                counters[j] = counter
                continue
            if (literals := _literals(values)) is not None:
                constants[j] = literals
                continue
            sources = [_source(v) for v in values]
            if any(s is None for s in sources):
                return False
            params = [s[0] for s in sources]  # type: ignore[index]
            casts = [s[1] for s in sources]  # type: ignore[index]
            if (len({p.init.data for p in params}) != 1 or len({p.result.type for p in params}) != 1
                    or stack_name([p.tensor_name.data for p in params]) is None
                    or len({None if c is None else c.result.type for c in casts}) != 1):
                return False
            stacked[j] = sources  # type: ignore[assignment]
        if period > 1:
            merged.update(c.callee.root_reference.data for c in groups[0])
            calls = _call_periods(_period_function(module, chain), chain)
        else:
            calls = [g[0] for g in groups]
        _scan(calls, carries, stacked, counters, constants)
        return True


def _scan(calls: list[func.CallOp], carries: list[tuple[int, int]],
          stacked: dict[int, list[tuple[graph.ParameterOp, graph.CastOp | None]]],
          counters: dict[int, tuple[SSAValue, int, int]], constants: dict[int, list[graph.LiteralOp]]) -> None:
    """Replace `calls` (of one function) by a scan: operands `carries` carried, `stacked` made
    stacked parameters, `counters` made one stacked counter, `constants` one stacked literal."""
    first, last = calls[0], calls[-1]
    carry_args = [j for j, _ in carries]
    carry_results = {r for _, r in carries}
    length = len(calls)
    operands: list[SSAValue] = list(first.operands)
    made: list[Operation] = []
    for j, sources in stacked.items():
        params = [p for p, _ in sources]
        head, cast = params[0], sources[0][1]
        new = graph.ParameterOp(stack_name([p.tensor_name.data for p in params]), head.init.data,
                                graph.stacked_type(head.result.type, length))
        head.parent_block().insert_op_before(new, head)  # type: ignore[union-attr]
        value = new.result
        if cast is not None:
            stacked_cast = graph.CastOp(value, graph.stacked_type(cast.result.type, length))
            made.append(stacked_cast)
            value = stacked_cast.result
        operands[j] = value
    for j, (base, start, step) in counters.items():  # [base + start, base + start + step, ...]
        typ = graph.stacked_type(base.type, length)
        spread = graph.BroadcastOp(base, [], typ)
        iota = graph.IotaOp(start, step, typ)
        total = graph.AddOp(spread.result, iota.result)
        made += [spread, iota, total]
        operands[j] = total.result
    for j, literals in constants.items():
        whole = graph.LiteralOp(np.stack([lit.values() for lit in literals]),
                                graph.stacked_type(literals[0].result.type, length))
        made.append(whole)
        operands[j] = whole.result
    results = [graph.stacked_type(r.type, length) if k not in carry_results else r.type
               for k, r in enumerate(first.results)]
    scan = graph.ScanOp(first.callee.root_reference.data, operands, results, length=length,
                        stacked=sorted([*stacked, *counters, *constants]), carry_args=carry_args,
                        carry_results=[r for _, r in carries])
    block = first.parent_block()
    for o in made:
        block.insert_op_before(o, first)  # type: ignore[union-attr]
    block.insert_op_before(scan, first)  # type: ignore[union-attr]
    for k in carry_results:
        last.results[k].replace_all_uses_with(scan.results[k])
    dead = [c.operands[j].owner for c in calls for j in counters]  # the per-call counters
    for c in reversed(calls):
        c.detach()
        c.erase()
    for sources in stacked.values():
        for p, cast in sources:
            for o in (cast, p):
                if o is not None:
                    o.detach()
                    o.erase()
    for literals in constants.values():
        for lit in literals:
            lit.detach()
            lit.erase()
    for add in dead:  # then their constants, if nothing else reads them
        const = add.rhs.owner  # type: ignore[union-attr]
        add.detach()  # type: ignore[union-attr]
        add.erase()  # type: ignore[union-attr]
        if isinstance(const, graph.ConstantOp) and not const.result.uses:
            const.detach()
            const.erase()
