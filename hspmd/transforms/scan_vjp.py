"""Gradients through scans: a stack of layers differentiated as one reverse scan of the layer's backward.

For `graph.scan @F` (see `graph.ScanOp`) autodiff splits F once, as for calls
(`call_vjp.CallDifferentiator`): `@F_fwd` returns F's results and the residuals its backward
reads, `@F_bwd(dys, residuals)` returns the gradients of F's float arguments. Then

* the forward scan calls `@F_fwd`; the residuals come out stacked, one slice per layer, except
  those that are a stacked or invariant argument of F (a layer's weight): the backward reads
  the forward's operand itself, so no weight is copied (the scan's own `@F_fwd` does not
  return them);
* the backward is `graph.scan @F_bwd {reverse}`: the gradient of each carried result is carried
  (from the last layer down to the first), the gradients of stacked results and the stacked
  residuals are stacked operands; it returns each stacked argument's gradient stacked (the
  gradient of a stacked parameter, layer i in slice i) and the carried argument's gradient
  after the first layer (the gradient of the scan's initial carry).

An invariant float argument that needs a gradient gets the sum over the layers of its
per-layer gradients (`graph.reduce_sum` over the stacking dim; unrolled calls would have added
them one by one, so the last bits can differ).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.ir import BlockArgument, SSAValue

from hspmd.dialects import graph
from hspmd.transforms.call_vjp import CallDifferentiator, SplitFunction
from hspmd.transforms.util import PassError


def scan_callee(scan: graph.ScanOp) -> func.FuncOp:
    """Return the function `scan` calls."""
    from xdsl.traits import SymbolTable

    callee = SymbolTable.lookup_symbol(scan, scan.callee)
    if not isinstance(callee, func.FuncOp):
        raise PassError(f"graph.scan of @{scan.callee.root_reference.data}: no such function")
    return callee


@dataclass
class _ScanSplit:
    """The scan-specific forward of one callee: which residuals it returns, which it reads from operands."""

    split: SplitFunction
    forward: func.FuncOp
    #: per residual: the callee argument it is (stacked or invariant: read from the scan's operand), else None
    from_operand: list[int | None]


@dataclass
class ScanDifferentiator:
    """Differentiates scans (module docstring); shares its callee splits with `calls`."""

    calls: CallDifferentiator
    scans: dict[tuple, _ScanSplit] = field(default_factory=dict)
    #: forward scan -> (its split, the kinds its operands had)
    made: dict[graph.ScanOp, tuple[_ScanSplit, tuple[str, ...]]] = field(default_factory=dict)

    def _scan_split(self, scan: graph.ScanOp) -> _ScanSplit:
        callee = scan_callee(scan)
        kinds = tuple(scan.arg_kind(j) for j in range(len(scan.args)))
        key = (callee.sym_name.data, kinds)
        if key in self.scans:
            return self.scans[key]
        split = self.calls.split(callee)
        fwd = split.forward
        ret = fwd.body.block.last_op
        assert isinstance(ret, func.ReturnOp)
        residuals = list(ret.operands)[split.num_results:]
        from_operand: list[int | None] = []
        for r in residuals:
            is_arg = isinstance(r, BlockArgument) and r.block is fwd.body.block
            from_operand.append(r.index if is_arg and kinds[r.index] != "carry" else None)  # type: ignore[union-attr]
        forward = fwd
        if any(i is not None for i in from_operand):
            forward = fwd.clone()
            forward.sym_name = StringAttr(self._free_name(f"{callee.sym_name.data}_scan_fwd"))
            old = forward.body.block.last_op
            keep = list(old.operands)[:split.num_results] + [
                v for v, i in zip(list(old.operands)[split.num_results:], from_operand) if i is None]
            forward.body.block.insert_op_before(func.ReturnOp(*keep), old)
            old.detach()
            old.erase()
            forward.update_function_type()
            self.calls.module.body.block.insert_op_after(forward, fwd)
        self.scans[key] = _ScanSplit(split, forward, from_operand)
        return self.scans[key]

    def _free_name(self, base: str) -> str:
        taken = {o.sym_name.data for o in self.calls.module.body.block.ops if isinstance(o, func.FuncOp)}
        name, k = base, 1
        while name in taken:
            name, k = f"{base}{k}", k + 1
        return name

    def forward_scan(self, scan: graph.ScanOp) -> graph.ScanOp:
        """Replace forward `scan` by a scan of the callee's forward; return the new scan."""
        kinds = tuple(scan.arg_kind(j) for j in range(len(scan.args)))
        ss = self._scan_split(scan)
        n = scan.num_iterations
        out_types = list(ss.forward.function_type.outputs.data)
        num_results = ss.split.num_results
        types = [r.type for r in scan.outs] + [graph.stacked_type(t, n) for t in out_types[num_results:]]
        new = graph.ScanOp(ss.forward.sym_name.data, list(scan.args), types, length=n, stacked=scan.stacked_args(),
                           carry_args=[j for j, _ in scan.carries()], carry_results=[k for _, k in scan.carries()])
        scan.parent_block().insert_op_before(new, scan)  # type: ignore[union-attr]
        for old, r in zip(scan.outs, new.outs):
            old.replace_all_uses_with(r)
        scan.detach()
        scan.erase()
        self.made[new] = (ss, kinds)
        return new

    def backward_scan(self, fwd: graph.ScanOp, gs: list[SSAValue | None], emit) -> dict[int, SSAValue]:
        """Emit the backward scan of forward scan `fwd` given the gradients `gs` of F's results
        (None: none); return {operand index of `fwd`: its gradient}."""
        ss, kinds = self.made[fwd]
        split, n = ss.split, fwd.num_iterations
        num_results = split.num_results
        carries = dict((k, j) for j, k in fwd.carries())  # result -> argument
        dys: list[SSAValue] = []
        for k, g in enumerate(gs[:num_results]):
            dys.append(g if g is not None else emit(graph.ConstantOp(0.0, fwd.outs[k].type)))
        residuals: list[SSAValue] = []
        stacked_res: list[bool] = []
        kept = iter(fwd.outs[num_results:])
        for i in ss.from_operand:
            if i is None:
                residuals.append(next(kept))
                stacked_res.append(True)
            else:
                residuals.append(fwd.args[i])
                stacked_res.append(kinds[i] == "stacked")
        operands = [*dys, *residuals]
        stacked = [k for k in range(num_results) if k not in carries]
        stacked += [num_results + i for i, s in enumerate(stacked_res) if s]
        bwd_outputs = list(split.backward.function_type.outputs.data)
        carry_args, carry_results = [], []
        for k, j in carries.items():
            if j not in split.float_args:
                continue  # an integer carried (indices a layer hands on): no gradient flows back through it
            carry_args.append(k)
            carry_results.append(split.float_args.index(j))
        types = [t if r in carry_results else graph.stacked_type(t, n) for r, t in enumerate(bwd_outputs)]
        bwd = graph.ScanOp(split.backward.sym_name.data, operands, types, length=n, stacked=stacked,
                           carry_args=carry_args, carry_results=carry_results, reverse=not fwd.is_reverse)
        emit.before.parent_block().insert_op_before(bwd, emit.before)
        grads: dict[int, SSAValue] = {}
        for r, j in enumerate(split.float_args):
            g = bwd.outs[r]
            if kinds[j] == "invariant":
                shape = graph.tensor_shape(g)[1:]
                g = emit(graph.ReduceSumOp(g, [0], graph.tensor_type(g.type.element_type, shape)))  # type: ignore
            grads[j] = g
        return grads

    def finish(self, module: ModuleOp) -> None:
        """Erase forwards no call uses, and give a scan forward the plain `_fwd` name where it is free."""
        used = {o.callee.root_reference.data for o in module.walk() if isinstance(o, (func.CallOp, graph.ScanOp))}
        for ss in self.scans.values():
            plain = ss.split.forward
            if plain is ss.forward or plain.sym_name.data in used or plain.parent is None:
                continue
            name = plain.sym_name.data
            plain.detach()
            plain.erase()
            old = ss.forward.sym_name.data
            ss.forward.sym_name = StringAttr(name)
            for o in module.walk():
                if isinstance(o, graph.ScanOp) and o.callee.root_reference.data == old:
                    o.properties["callee"] = type(o.callee)(name)
