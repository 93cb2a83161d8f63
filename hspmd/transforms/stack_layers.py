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
by one (`hspmd.ir.stacked_names`), with one `init`; a call result other than the carry is
unused; an operand that differs per call is a parameter, or a per-call counter `base + c_k`
with constants c_k counting up by one step (a dropout's random stream: `step + (k << 32)`),
which becomes one stacked operand `broadcast(base) + graph.iota`. Chains of fewer than
`min_length` calls are left too.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerType, ModuleOp
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass

from hspmd.dialects import graph
from hspmd.ir.stacked_names import stack_name
from hspmd.transforms.util import PassError, step_function


@dataclass
class _Chain:
    """Consecutive calls of one callee and how their operands relate."""

    calls: list[func.CallOp]
    carries: list[tuple[int, int]]  # (argument index, result index)


def _carries(prev: func.CallOp, call: func.CallOp) -> list[tuple[int, int]]:
    """Return (argument of `call`, result of `prev`) for each operand of `call` that `prev` made."""
    return [(j, v.index) for j, v in enumerate(call.operands) if v.owner is prev]  # type: ignore[attr-defined]


def _chains(block) -> list[_Chain]:
    """Return the maximal chains of calls in `block` (see the module docstring for what links them)."""
    chains: list[_Chain] = []
    current: _Chain | None = None
    for op in block.ops:
        if not isinstance(op, func.CallOp):
            continue
        if current is not None:
            prev = current.calls[-1]
            links = _carries(prev, op)
            same_callee = op.callee == prev.callee
            if same_callee and links and (len(current.calls) == 1 or links == current.carries) and all(
                    all(u.operation is op for u in r.uses) for k, r in enumerate(prev.results)
                    if k in {res for _, res in links}):
                current.carries = links
                current.calls.append(op)
                continue
            chains.append(current)
        current = _Chain([op], [])
    if current is not None:
        chains.append(current)
    return [c for c in chains if len(c.calls) > 1]


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


@dataclass(frozen=True)
class StackLayers(ModulePass):
    """Replace chains of calls of one layer function by `graph.scan` over stacked parameters."""

    name = "stack-layers"
    min_length: int = 2

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        if self.min_length < 2:
            raise PassError(f"stack-layers: option min_length={self.min_length} must be >= 2")
        block = step_function(op).body.block
        for chain in _chains(block):
            if len(chain.calls) >= self.min_length:
                self._stack(chain)

    @staticmethod
    def _stack(chain: _Chain) -> bool:
        """Replace `chain` by a scan if it can be stacked; return whether it was."""
        calls, first, last = chain.calls, chain.calls[0], chain.calls[-1]
        carry_args = [j for j, _ in chain.carries]
        carry_results = {r for _, r in chain.carries}
        if any(r.uses for c in calls for k, r in enumerate(c.results) if k not in carry_results):
            return False  # a per-layer result used outside the chain: it would have to be stacked
        stacked: dict[int, list[tuple[graph.ParameterOp, graph.CastOp | None]]] = {}
        counters: dict[int, tuple[SSAValue, int, int]] = {}
        for j in range(len(first.operands)):
            if j in carry_args:
                continue
            values = [c.operands[j] for c in calls]
            if all(v is values[0] for v in values):
                continue  # an invariant
            if (counter := _counter(values)) is not None:
                counters[j] = counter
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
        results = [graph.stacked_type(r.type, length) if k not in carry_results else r.type
                   for k, r in enumerate(first.results)]
        scan = graph.ScanOp(first.callee.root_reference.data, operands, results, length=length,
                            stacked=sorted([*stacked, *counters]), carry_args=carry_args,
                            carry_results=[r for _, r in chain.carries])
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
        for add in dead:  # then their constants, if nothing else reads them
            const = add.rhs.owner  # type: ignore[union-attr]
            add.detach()  # type: ignore[union-attr]
            add.erase()  # type: ignore[union-attr]
            if isinstance(const, graph.ConstantOp) and not const.result.uses:
                const.detach()
                const.erase()
        return True
