"""`propagate-layouts`: give every tensor value of the step a layout, from the few it has.

Start: the values whose types already carry a `#dist.layout` (parameters and inputs from
`apply-strategy`, or any value a user annotated). Then, to a fixed point:

1. forward, in program order: an op whose operands have layouts gets result layouts from its
   sharding rule; a constant operand takes the layout the op needs (constants are free to
   make in any layout);
2. backward, in reverse order: a value still without a layout takes the layout its first
   consumer needs (an output needs a replicated value; an assign the parameter's layout),
   and the op making it is asked what its operands need for that.

Conflicts are resolved in this order: a layout already on a value (the user's) wins; then the
operand of an op with the most split or partial axes drives its rule; then the first
consumer. Values nobody constrains are replicated. The layouts are written into the types;
`insert-reshard` then adds `dist.reshard` wherever a consumer needs another layout.

Calls (repeated layers): when the layouts of a `func.call`'s operands are known, the callee
is propagated with its arguments laid out so, and the call's results take the layouts of
what the callee returns. Calls with the same argument layouts share one callee; a call with
other layouts gets its own copy of the callee (`@Block_0_l1`).

Provenance: `propagate(module)` does the same as the pass and also returns, for each tensor
value it laid out, where its layout came from (`hspmd compile --explain` prints it):
`strategy` (a layout the value already had: apply-strategy's, or a user's), `argument of
@F` (a callee's argument, laid out as the call's operand), `forward: OP rule` (from its
operands), `backward: needed by OP` (a value made from constants takes its consumer's need),
`refined for OP` (a producer made to give its consumer's layout where that costs nothing),
`default: replicated` (nobody constrained it).
Recording it never changes what is computed.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp, StringAttr, SymbolRefAttr, TensorType
from xdsl.dialects import func
from xdsl.ir import Block, BlockArgument, Operation, OpResult, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import Rewriter

from hspmd.dialects import graph
from hspmd.dialects.dist import layout_of, with_layout
from hspmd.dialects.sharding import ShardingError, has_rule, infer
from hspmd.ir.layout import DUP, PARTIAL, DistributedStates, Group, Layout, LayoutError
from hspmd.transforms.util import PassError, callee_of, step_function


def replicated_like(layout: Layout) -> Layout:
    """Return the layout with `layout`'s groups where every device holds the whole value."""
    groups = tuple(Group(g.devices, DistributedStates(((DUP, len(g.devices)),))) for g in layout.groups)
    return Layout(groups, DUP)


def required_operand_layouts(
    op: Operation, layouts: dict[SSAValue, Layout], params: dict[str, Layout]
) -> list[Layout | None]:
    """Return the layout each operand of `op` needs given the layouts known now (None: no need)."""
    if isinstance(op, graph.OutputOp):
        lay = layouts.get(op.value)
        return [replicated_like(lay) if lay is not None else None]
    if isinstance(op, graph.AssignOp):
        return [params.get(op.tensor_name.data)]
    if isinstance(op, func.CallOp):
        return [layout_of(arg) for arg in callee_of(op).body.block.args]
    if isinstance(op, graph.ScanOp):
        return scan_operand_layouts(op, [layout_of(arg) for arg in callee_of(op).body.block.args])
    if not has_rule(op):
        return [None] * len(op.operands)
    ins = [layouts.get(v) for v in op.operands]
    hint = layouts.get(op.results[0]) if len(op.results) == 1 else None
    if all(x is None for x in (*ins, hint)):
        return [None] * len(op.operands)
    return list(infer(op, ins, hint).operands)


def scan_operand_layouts(op: graph.ScanOp, args: list[Layout | None]) -> list[Layout | None]:
    """Return the layouts a scan's operands need for its callee's argument layouts `args`: a
    stacked operand is laid out as one layer is, its stacking dim whole (`Layout.shift_dims`)."""
    return [lay.shift_dims(1) if lay is not None and op.arg_kind(j) == "stacked" else lay
            for j, lay in enumerate(args)]


def scan_argument_layouts(op: graph.ScanOp, operands: list[Layout]) -> list[Layout]:
    """Return the layouts a scan's callee arguments get from its operands' `operands`; raise
    PassError where a stacked operand is split along its stacking dim."""
    out = []
    for j, lay in enumerate(operands):
        if op.arg_kind(j) != "stacked":
            out.append(lay)
            continue
        try:
            out.append(lay.shift_dims(-1))
        except LayoutError:
            raise PassError(f"propagate-layouts: graph.scan @{op.callee.root_reference.data}: its stacked operand {j} "
                            f"is laid out '{lay}', split along the stacking dim 0; each layer must see all of "
                            "its own slice") from None
    for j, _ in op.carries():
        if out[j].hetero == PARTIAL or any(g.states.is_partial for g in out[j].groups):
            out[j] = replicated_like(out[j])  # a carried value enters every layer whole
    return out


Provenance = dict[SSAValue, str]


def _current(v: SSAValue) -> SSAValue:
    """Return the value now in `v`'s place (its op's result or block's argument of the same index)."""
    if isinstance(v, OpResult):
        return v.op.results[v.index]
    assert isinstance(v, BlockArgument)
    return v.block.args[v.index]


def propagate(module: ModuleOp) -> Provenance:
    """Run propagate-layouts on `module` in place; return where each tensor value's layout came from.

    The keys are the values as they are after the pass (types carry the layouts).
    """
    block = step_function(module).body.block
    seeds = {v: lay for o in block.ops for v in o.results if (lay := layout_of(v)) is not None}
    if not seeds:
        raise PassError("propagate-layouts: no value has a layout to start from; run apply-strategy first")
    why: Provenance = {}
    PropagateLayouts()._propagate(block, next(iter(seeds.values())), {}, why)
    return {_current(v): reason for v, reason in why.items() if isinstance(v.type, TensorType)}


@dataclass(frozen=True)
class PropagateLayouts(ModulePass):
    """Write a layout into the type of every tensor value of the step function."""

    name = "propagate-layouts"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        propagate(op)

    def _propagate(
        self, block: Block, reference: Layout, specialized: dict[tuple, func.FuncOp], why: Provenance
    ) -> None:
        """Lay out every value of `block` (a function body whose seeds have layouts); note why in `why`."""
        ops = list(block.ops)
        layouts: dict[SSAValue, Layout] = {}
        for v in (*block.args, *(r for o in ops for r in o.results)):
            if (lay := layout_of(v)) is not None:
                layouts[v] = lay
                if isinstance(v, BlockArgument):
                    why.setdefault(v, f"argument of @{block.parent_op().sym_name.data}")  # type: ignore[union-attr]
                else:
                    why.setdefault(v, "strategy")
        params = {o.tensor_name.data: layouts[o.result] for o in ops if isinstance(o, graph.ParameterOp) and o.result in layouts}

        # values made from constants only: nothing upstream decides them, their consumers do
        free: set[SSAValue] = set()
        for o in ops:
            if not any(v in layouts for v in o.results) and all(v in free for v in o.operands):
                free.update(o.results)

        def calls() -> bool:
            return self._calls(ops, layouts, free, reference, specialized, why)

        try:
            changed = True
            while changed:
                changed = self._forward(ops, layouts, why) | calls()
                changed |= self._backward(ops, layouts, params, free, why)
                if not changed:  # a call still waiting on values nobody constrains: replicate them
                    changed = self._calls(ops, layouts, free, reference, specialized, why, force=True)
            self._refine(ops, layouts, params, why)
        except ShardingError as err:
            raise PassError(f"propagate-layouts: {err}") from None

        for o in ops:
            for v in o.results:
                if isinstance(v.type, TensorType) and layout_of(v) is None:
                    if v not in layouts:
                        why[v] = "default: replicated"
                    lay = layouts.get(v, replicated_like(reference))
                    Rewriter.replace_value_with_new_type(v, with_layout(v.type, lay))

    def _calls(
        self, ops, layouts, free, reference: Layout, specialized: dict, why: Provenance, force: bool = False
    ) -> bool:
        """Specialise the callee of each call whose operand layouts are known; True if any was."""
        changed = False
        for o in ops:
            if not isinstance(o, (func.CallOp, graph.ScanOp)) or all(r in layouts for r in o.results):
                continue
            if force:
                unknown = [v for v in o.operands if v not in layouts]
                if not unknown or not all(v in free for v in unknown):
                    continue
                for v in unknown:
                    layouts[v] = replicated_like(reference)
                    why[v] = "default: replicated"
            if any(v not in layouts for v in o.operands):
                continue
            args = [layouts[v] for v in o.operands]
            if isinstance(o, graph.ScanOp):
                args = scan_argument_layouts(o, args)
            callee = self._specialize(o, args, reference, specialized, why)
            ret = callee.body.block.last_op
            assert isinstance(ret, func.ReturnOp)
            returned = [layout_of(v) for v in ret.operands]
            if isinstance(o, graph.ScanOp):  # a carried result keeps its argument's layout; others stack
                carried = {k: j for j, k in o.carries()}
                returned = [layout_of(callee.body.block.args[carried[k]]) if k in carried else lay.shift_dims(1)
                            for k, lay in enumerate(returned)]
            for r, lay in zip(o.results, returned):
                layouts[r] = lay  # type: ignore[assignment]
                why[r] = f"forward: {o.name} @{callee.sym_name.data} returns"
            changed = True
            if force:
                break
        return changed

    def _specialize(
        self, call: func.CallOp | graph.ScanOp, args: list[Layout], reference: Layout, specialized: dict, why: Provenance
    ) -> func.FuncOp:
        """Return the callee laid out for `args` (made once per argument layouts) and point `call` at it."""
        original = callee_of(call)
        key = (original.sym_name.data, tuple(args))
        if key not in specialized:
            taken = any(k[0] == key[0] for k in specialized)
            if not taken:  # laid out in place; keep an unannotated copy for other argument layouts
                specialized[("pristine", key[0])] = original.clone()
                fn = original
            else:
                fn = specialized[("pristine", key[0])].clone()
                fn.sym_name = StringAttr(f"{key[0]}_l{sum(1 for k in specialized if k[0] == key[0])}")
                original.parent_block().insert_op_after(fn, original)  # type: ignore[union-attr]
            for arg, lay in zip(list(fn.body.block.args), args):
                Rewriter.replace_value_with_new_type(arg, with_layout(arg.type, lay))
            self._propagate(fn.body.block, reference, specialized, why)
            fn.update_function_type()
            specialized[key] = fn
        fn = specialized[key]
        call.callee = SymbolRefAttr(fn.sym_name.data)
        return fn

    @staticmethod
    def _refine(
        ops: list[Operation], layouts: dict[SSAValue, Layout], params: dict[str, Layout], why: Provenance
    ) -> None:
        """Let a producer give its first consumer's layout where that costs its operands nothing.

        A broadcast of a replicated bias can be made directly split like the activations it is
        added to, instead of being made replicated and then cut. The change is kept only if
        every consumer's rule still gives its results the layouts they have.
        """
        for o in ops:
            if not has_rule(o) or len(o.results) != 1 or o.results[0] not in layouts:
                continue
            v = o.results[0]
            ins = [layouts.get(x) for x in o.operands]
            if any(x is None for x in ins):
                continue
            for use in v.uses:
                need = required_operand_layouts(use.operation, layouts, params)[use.index]
                if need is None or need == layouts[v]:
                    break
                try:
                    alt = infer(o, ins, need)
                except ShardingError:
                    break
                if alt.results[0] == need and list(alt.operands) == list(infer(o, ins, layouts[v]).operands):
                    if list(alt.operands) == ins:
                        old, layouts[v] = layouts[v], need
                        if not all(PropagateLayouts._still_gives(use.operation, layouts) for use in v.uses):
                            layouts[v] = old  # another consumer's result would change: keep it
                        else:
                            why[v] = f"refined for {use.operation.name}"
                break

    @staticmethod
    def _still_gives(op: Operation, layouts: dict[SSAValue, Layout]) -> bool:
        """Return whether `op`'s rule still gives its results the layouts they have."""
        if not has_rule(op):
            return True
        hint = layouts.get(op.results[0]) if len(op.results) == 1 else None
        try:
            got = infer(op, [layouts.get(x) for x in op.operands], hint).results
        except ShardingError:
            return False
        return all(layouts.get(r) == g for r, g in zip(op.results, got))

    @staticmethod
    def _forward(ops: list[Operation], layouts: dict[SSAValue, Layout], why: Provenance) -> bool:
        changed = False
        for o in ops:
            if not has_rule(o) or all(v in layouts for v in o.results):
                continue
            ins = [layouts.get(v) for v in o.operands]
            if all(x is None for x in ins):
                continue
            if any(x is None and not isinstance(v.owner, graph.ConstantOp) for x, v in zip(ins, o.operands)):
                continue  # wait until the backward sweep decides that operand
            inference = infer(o, ins)
            for v, need in zip(o.operands, inference.operands):
                if v not in layouts:
                    layouts[v] = need
                    why[v] = f"backward: needed by {o.name}"
            for v, lay in zip(o.results, inference.results):
                if v not in layouts:
                    why[v] = f"forward: {o.name} rule"
                layouts.setdefault(v, lay)
            changed = True
        return changed

    @staticmethod
    def _backward(
        ops: list[Operation],
        layouts: dict[SSAValue, Layout],
        params: dict[str, Layout],
        free: set[SSAValue],
        why: Provenance,
    ) -> bool:
        changed = False
        for o in reversed(ops):
            for v in o.results:
                if v in layouts or v not in free or not isinstance(v.type, TensorType):
                    continue
                for use in v.uses:
                    needs = required_operand_layouts(use.operation, layouts, params)
                    need = needs[use.index]
                    if need is None and has_rule(use.operation):
                        ins = [layouts.get(x) for x in use.operation.operands]
                        hint = layouts.get(use.operation.results[0]) if use.operation.results else None
                        if hint is not None:
                            need = infer(use.operation, ins, hint).operands[use.index]
                    if need is not None and need.hetero != PARTIAL and not any(g.states.is_partial for g in need.groups):
                        layouts[v] = need
                        why[v] = f"backward: needed by {use.operation.name}"
                        changed = True
                        break
            if has_rule(o) and o.results and o.results[0] in layouts:
                ins = [layouts.get(x) for x in o.operands]
                if any(x is None for x in ins):
                    inference = infer(o, ins, layouts[o.results[0]])
                    for x, need in zip(o.operands, inference.operands):
                        if x not in layouts:
                            layouts[x] = need
                            why[x] = f"backward: needed by {o.name}"
                            changed = True
        return changed
