"""`recompute{mode=block}`: activation recompute, marked on the layer functions before `autodiff`.

The pass runs on the logical step before `autodiff` (the compiler adds it when a strategy asks for
`recompute=block` or `recompute=selective`). It marks each function the step calls (a repeated
layer, called by `func.call` or stacked in a `graph.scan`) with `hspmd.recompute = "block"` or
`"selective"`; `hs.checkpoint(fn, *args)` marks one function of a script the same way (`block`).
`autodiff` then splits a marked function into its `_fwd`/`_bwd` pair (`call_vjp`) keeping fewer
residuals:

* `block`: `@F_fwd` returns only F's results and the arguments its backward reads (the block's
  input and its weights; in a scan the weights are read from the scan's operands, so only the
  input of each layer is kept, stacked); `@F_bwd` runs F's forward again (the ops its backward
  needs) before the backward.
* `selective` (Megatron's selective recompute): only attention's core is computed again: each
  `graph.softmax`, the `graph.dropout` of its result and the ops between the score product
  (`q @ k^T`, a `graph.matmul`) and the softmax (scale, mask); `@F_fwd` keeps q and k instead of
  the scores and probabilities (whose size grows with the sequence squared).

A dropout's mask is a function of (seed, salt, counter, index), and the counter is an argument
of the layer function, so the recomputed forward draws the same mask: the numbers are those of
the run without recompute, bit for bit. Both `_bwd` functions carry the mark, so the annotated
and physical IR show which layers recompute; `hspmd compile --report` shows the activations kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass

from hspmd.dialects import graph
from hspmd.ir.recompute import MODES, RECOMPUTE_ATTR, mark, recompute_mode  # noqa: F401 (re-exported)
from hspmd.transforms.util import PassError, step_function

#: most ops between a softmax and its score product that selective recompute walks back through
_MAX_CORE = 8


def _callee_names(op: Operation) -> list[str]:
    return [o.callee.root_reference.data for o in op.walk() if isinstance(o, (func.CallOp, graph.ScanOp))]


def mark_layers(module: ModuleOp, mode: str) -> list[str]:
    """Mark the functions the step calls (and, for `selective`, the functions they call) with
    `mode`; return their names in order."""
    if mode == "none":
        return []
    functions = {o.sym_name.data: o for o in module.body.block.ops if isinstance(o, func.FuncOp)}
    todo, marked = _callee_names(step_function(module)), []
    while todo:
        name = todo.pop(0)
        if name in marked or name not in functions:
            continue
        mark(functions[name], mode)
        marked.append(name)
        if mode == "selective":  # attention may sit in a function of its own
            todo += _callee_names(functions[name])
    return marked


def _attention_core(softmax: graph.SoftmaxOp) -> list[Operation] | None:
    """Return the ops from the score product to `softmax`'s dropout (the product included), or
    None where no `graph.matmul` lies within `_MAX_CORE` ops before the softmax."""
    core: list[Operation] = [softmax]
    found, todo = False, [softmax.operands[0]]
    while todo:
        v = todo.pop()
        owner = v.owner
        if not isinstance(owner, Operation) or owner in core:
            continue
        if isinstance(owner, (graph.ParameterOp, graph.InputOp)):
            continue
        core.append(owner)
        if len(core) > _MAX_CORE:
            return None
        if isinstance(owner, graph.MatmulOp):
            found = True
            continue
        todo.extend(owner.operands)
    if not found:
        return None
    for use in softmax.results[0].uses:
        if isinstance(use.operation, graph.DropoutOp):
            core.append(use.operation)
    return core


def recomputed_ops(forward: list[Operation], residuals: list[SSAValue], mode: str) -> list[Operation]:
    """Return the ops of `forward` (a function body's forward, in order) that the backward computes
    again under `mode`, in program order: those making a residual among the candidates (every op
    for `block`, attention's core for `selective`) and the candidates they need."""
    if mode == "none":
        return []
    if mode == "block":
        candidates = set(forward)
    else:
        candidates = set()
        for o in forward:
            if isinstance(o, graph.SoftmaxOp):
                candidates.update(_attention_core(o) or ())
    chosen: set[Operation] = set()
    todo = [r.owner for r in residuals if isinstance(r.owner, Operation) and r.owner in candidates]
    while todo:
        o = todo.pop()
        if o in chosen:
            continue
        chosen.add(o)
        todo.extend(v.owner for v in o.operands if isinstance(v.owner, Operation) and v.owner in candidates)
    return [o for o in forward if o in chosen]


@dataclass(frozen=True)
class Recompute(ModulePass):
    """Mark the step's layer functions for activation recompute (`block` or `selective`)."""

    name = "recompute"
    mode: str = "block"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        if self.mode not in MODES:
            raise PassError(f"recompute: mode '{self.mode}' is not one of {', '.join(MODES)}")
        mark_layers(op, self.mode)
