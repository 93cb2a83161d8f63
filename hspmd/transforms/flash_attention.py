"""`flash-attention`: attention's chain in a GPU program becomes one fused kernel forward and one backward.

Runs on a GPU program (the kernel level after `device-kernels`: every op a `kernel.fused`, a
GEMM or a view). It finds attention's forward chain

    s = matmul(q, kT)                       kT: k with its last two dims swapped (a view or a kernel)
    p = kernel[scale, causal_mask(-inf), softmax(last dim)](s)      (no causal_mask: not causal)
    pd = kernel[dropout](p, step)           (optional)
    o = matmul(pd, v)

and its backward (in the same function, or in the backward function that a `graph.scan` (or a
`func.call`) of the layers calls with the forward's residuals)

    dpd = matmul(do, vT)        dv = matmul(pdT, do)        dp = kernel[dropout](dpd, step)
    ds = kernel[softmax_grad](p, dp)        dsc = kernel[causal_mask(0), scale](ds)
    dq = matmul(dsc, k)         dkT = matmul(qT, dsc)

and replaces them by `graph.flash_attention` (o and the rows' logsumexp) and
`graph.flash_attention_grad` (dq, dk, dv), each then given its kernel as `device-kernels` does.
Between a forward and a backward function the residuals p and pd ([..., T, T] each) leave the
scans (or calls); the logsumexp ([..., T]) joins them, and o ([..., T, D]) too unless the layer
keeps it already with its heads moved inside (attention's output before the projection, whose
weight gradient reads it: the backward kernel reads o in that layout); k takes the place of k^T
where the forward had it written out for the backward only. The T x T scores and
probabilities are never written.

In a bfloat16 or float16 program (`precision=bfloat16`, `float16`) the chain is the same with
casts: the products and the scale and mask are 16-bit, the softmax and its gradient compute in
float32 between casts (as autodiff writes them: `p` is float32, the residual the softmax
gradient reads, and what the dropout and the product read is `p` cast to 16 bits):

    s16 = matmul(q, kT)    kernel[scale, causal_mask](s16)    cast to f32    p = kernel[softmax]
    p16 = cast(p)          pd = kernel[dropout](p16, step)    o = matmul(pd, v)
    ... dp = kernel[dropout](dpd16, step)    cast to f32    ds = kernel[softmax_grad](p, dp)
    cast to 16 bits        dsc = kernel[causal_mask(0), scale](ds16)    dq, dkT as above

The pass looks through casts between float types anywhere in these runs of kernels (one kernel
or several, each read only by the next). The fused ops then take q, k, v, o, do and give o, dq,
dk, dv in the program's 16-bit type, with a float32 logsumexp; their kernels compute in float32
(`dialects/graph/attention.py` says what they round where). So they round less than the chain
they replace, which rounds the scores, their scale, the probabilities, their dropout and the
gradients of each to 16 bits on the way: their results differ from the chain's by about the
16-bit type's rounding, and are closer to attention computed exactly (tests/test_flash_attention.py).

What the chain must be: q, k, v, the product's operands and its result of one type (float32,
bfloat16 or float16; p float32 or that type), of one shape [..., T, D] with D <= 128 (the
kernels' tiles), self-attention (as many keys as queries), one scale and one dropout (same rate,
seed, salt) forward and backward, do, dq, dk, dv of q's type, and every intermediate value used
only by the chain (p and pd may also be residuals). A chain that is not so, or whose backward
is not found, stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, TensorType
from xdsl.ir import Block, BlockArgument, Operation, SSAValue
from xdsl.passes import ModulePass

from hspmd.dialects import graph, kernel
from hspmd.dialects.graph.attention import (
    MAX_HEAD_DIM,
    FlashAttentionGradOp,
    FlashAttentionOp,
)
from hspmd.dialects.graph.base import int_attr
from hspmd.dialects.graph.scan import stacked_type
from hspmd.transforms import kernel_chains as kc
from hspmd.transforms.device_kernels import give_kernels, module_namer


@dataclass
class _Forward:
    fn: func.FuncOp
    qk: Operation
    sm: list[Operation]  # the kernels from the scores to p: scale, mask, softmax (and casts)
    casts: list[Operation]  # those from p to what the dropout (or the product) reads
    drop: Operation | None
    pv: Operation
    q: SSAValue
    kt: SSAValue  # the product's right operand (k with its last two dims swapped)
    k: SSAValue  # what the forward kernel reads (k, or kt itself)
    k_transposed: bool
    v: SSAValue
    p: SSAValue
    pd: SSAValue
    step: SSAValue | None
    dropout: graph.DropoutOp | None
    scale: float
    causal: bool


def _softmax_facts(p: SSAValue) -> tuple[float, bool, SSAValue, list[Operation]] | None:
    """Return (scale, causal, the scores, the kernels) where `p` is the scores' kernels' result:
    scale, causal mask of -inf, softmax over the last dim (one kernel in a float32 program; in a
    16-bit one casts to float32 and back between kernels of them)."""
    s, kernels, ms = kc.run_back(p, ("graph.scale", "graph.causal_mask", "graph.softmax"))
    if not kernels or kc.members(kernels[-1])[-1].name != "graph.softmax":
        return None
    for names, causal in ((["graph.scale", "graph.causal_mask", "graph.softmax"], True),
                          (["graph.causal_mask", "graph.scale", "graph.softmax"], True),
                          (["graph.scale", "graph.softmax"], False)):
        if kc.named(ms) != names:
            continue
        scale = next(m for m in ms if m.name == "graph.scale").factor.value.data  # type: ignore[attr-defined]
        mask = [m for m in ms if m.name == "graph.causal_mask"]
        if mask and mask[0].value.value.data != float("-inf"):  # type: ignore[attr-defined]
            return None
        soft = ms[-1]
        if soft.dim.value.data != len(kc.shape(soft.results[0])) - 1:  # type: ignore[attr-defined]
            return None
        return float(scale), causal, s, kernels
    return None


def _match_forward(fn: func.FuncOp, pv: Operation) -> _Forward | None:
    if not kc.is_matmul(pv):
        return None
    pd, v = pv.operands
    dropped = kc.dropout(pd)
    p, step, dropout = (dropped[0], dropped[1], dropped[2]) if dropped else (pd, None, None)
    p, casts = kc.peel_casts(p)  # a 16-bit program's softmax computes in float32: p is that
    facts = _softmax_facts(p)
    if facts is None:
        return None
    s = facts[2]
    qk = kc.owner(s)
    if not kc.is_matmul(qk) or len(list(s.uses)) != 1:
        return None
    q, kt = qk.operands  # type: ignore[union-attr]
    shape = kc.shape(q)
    if len(shape) < 3 or shape[-1] > MAX_HEAD_DIM or kc.shape(v) != shape or kc.shape(kt) != (*shape[:-2], shape[-1], shape[-2]):
        return None
    kind = kc.kind(q)
    if kind is None or any(kc.kind(x) != kind for x in (kt, v, pd, pv.results[0])) or kc.kind(p) not in (kind, "f32"):
        return None
    k = kc.swapped(kt)
    return _Forward(fn, qk, facts[3], casts, kc.owner(pd) if dropped else None, pv, q, kt, k if k is not None else kt,  # type: ignore[arg-type]
                    k is None, v, p, pd, step, dropout, facts[0], facts[1])


#: what calls a layer's forward or backward function: a scan over the layers, or a call
_Caller = graph.ScanOp | func.CallOp


@dataclass
class _Link:
    """How residuals go from a forward function to a backward one: the one scan (or call) of
    each; a scan's residuals are stacked results fed to stacked operands."""

    fwd: _Caller
    bwd: _Caller
    bwd_fn: func.FuncOp


def _callers(module: ModuleOp, fn: func.FuncOp) -> list[_Caller]:
    name = fn.sym_name.data
    return [op for op in module.walk() if isinstance(op, (graph.ScanOp, func.CallOp))
            and op.callee.root_reference.data == name]


def _stacked_result(caller: _Caller, r: int) -> bool:
    """Return whether result `r` of `caller` is one per call (a call's, a scan's stacked one)."""
    return isinstance(caller, func.CallOp) or caller.result_stacked(r)


def _stacked_arg(caller: _Caller, j: int) -> bool:
    return isinstance(caller, func.CallOp) or caller.arg_kind(j) == "stacked"


def _image(v: SSAValue, fwd: _Forward, link: _Link | None) -> SSAValue | None:
    """Return the value the backward sees for forward value `v`: itself in the same function,
    else the backward function's argument fed by the callers with the residual `v`."""
    if link is None:
        return v
    ret = fwd.fn.body.block.last_op
    assert isinstance(ret, func.ReturnOp)
    for r, x in enumerate(ret.operands):
        if x is not v or not _stacked_result(link.fwd, r):
            continue
        for use in link.fwd.results[r].uses:
            if use.operation is link.bwd and _stacked_arg(link.bwd, use.index):
                return link.bwd_fn.body.block.args[use.index]
    return None


def _links(module: ModuleOp, fwd: _Forward, funcs: dict[str, func.FuncOp]) -> list[_Link | None]:
    """Return where the backward of `fwd` may be: its own function (None), and each backward
    function fed by the one scan (or call) of the forward function with p as a residual."""
    out: list[_Link | None] = [None]
    callers = _callers(module, fwd.fn)
    if len(callers) != 1:
        return out
    ret = fwd.fn.body.block.last_op
    for r, x in enumerate(ret.operands):  # type: ignore[union-attr]
        if x is not fwd.p:
            continue
        for use in callers[0].results[r].uses:
            user = use.operation
            if isinstance(user, (graph.ScanOp, func.CallOp)) and user.callee.root_reference.data in funcs \
                    and type(user) is type(callers[0]):
                g = funcs[user.callee.root_reference.data]
                if len(_callers(module, g)) == 1 and g is not fwd.fn:
                    out.append(_Link(callers[0], user, g))
    return out


@dataclass
class _Backward:
    fn: func.FuncOp
    ops: list[Operation]  # the chain's ops, to erase
    q: SSAValue
    kt: SSAValue
    v: SSAValue
    do: SSAValue
    step: SSAValue | None
    dq: SSAValue
    dkt: SSAValue
    dv: SSAValue
    first: Operation


def _same_step(fwd: _Forward, step: SSAValue | None, link: _Link | None) -> bool:
    """Return whether the backward's dropout step `step` is the forward's: the same value, the
    forward's as a residual, or arguments that the callers feed with one value in the same way."""
    if fwd.step is None or step is None:
        return fwd.step is step
    if link is None:
        return fwd.step is step
    if _image(fwd.step, fwd, link) is step:  # the forward hands its step over as a residual
        return True
    a, b = fwd.step, step
    if not (isinstance(a, BlockArgument) and isinstance(b, BlockArgument)):
        return False
    i, j = a.index, b.index
    return (link.fwd.operands[i] is link.bwd.operands[j]
            and _stacked_arg(link.fwd, i) == _stacked_arg(link.bwd, j))


def _match_backward(fwd: _Forward, fn: func.FuncOp, link: _Link | None) -> _Backward | None:
    p, pd, q, kt, v = (_image(x, fwd, link) for x in (fwd.p, fwd.pd, fwd.q, fwd.kt, fwd.v))
    if p is None or pd is None or q is None or kt is None or v is None:
        return None
    for use in list(p.uses):
        sg = use.operation
        if use.index != 0 or _chain_two(sg) is None:
            continue
        found = _match_from_softmax_grad(fwd, fn, sg, pd, q, kt, v)
        if found is not None and _same_step(fwd, found.step, link):
            return found
    return None


def _chain_two(sg: Operation) -> Operation | None:
    """Return the softmax_grad of kernel `sg` (two inputs y, dy; one output; over the last dim)."""
    ms = kc.members(sg)
    if [m.name for m in ms] != ["graph.softmax_grad"] or len(sg.results) != 1 or len(sg.operands) != 2:
        return None
    (m,) = ms
    if isinstance(sg, kernel.FusedOp) and list(m.operands) != list(sg.body.block.args):
        return None
    if m.dim.value.data != len(kc.shape(m.results[0])) - 1:  # type: ignore[attr-defined]
        return None
    return m


def _match_from_softmax_grad(fwd: _Forward, fn: func.FuncOp, sg: Operation, pd: SSAValue, q: SSAValue,
                             kt: SSAValue, v: SSAValue) -> _Backward | None:
    dp = sg.operands[1]
    ops = [sg]
    if len(list(dp.uses)) != 1:
        return None
    dp, casts = kc.peel_casts(dp)  # a 16-bit program's softmax_grad computes in float32
    ops += casts
    step = None
    if fwd.dropout is not None:
        dropped = kc.dropout(dp)
        if dropped is None or not kc.same_dropout(dropped[2], fwd.dropout) or len(list(dp.uses)) != 1:
            return None
        dpd, step, _ = dropped
        ops.append(kc.owner(dp))  # type: ignore[arg-type]
    else:
        dpd = dp
    mm = kc.owner(dpd)
    if not kc.is_matmul(mm) or len(list(dpd.uses)) != 1 or kc.swapped(mm.operands[1]) is not v:  # type: ignore[union-attr]
        return None
    do = mm.operands[0]  # type: ignore[union-attr]
    ops.append(mm)  # type: ignore[arg-type]
    # dv = matmul(pd^T, do)
    dv_op = next((u.operation for u in do.uses if kc.is_matmul(u.operation) and u.index == 1
                  and kc.swapped(u.operation.operands[0]) is pd), None)
    if dv_op is None:
        return None
    ops.append(dv_op)
    dsc, scaled, ms = kc.run_forward(sg.results[0], ("graph.scale", "graph.causal_mask"))
    names = (["graph.causal_mask", "graph.scale"], ["graph.scale", "graph.causal_mask"]) if fwd.causal else (["graph.scale"],)
    if kc.named(ms) not in names:
        return None
    scale = next(m for m in ms if m.name == "graph.scale").factor.value.data  # type: ignore[attr-defined]
    mask = [m for m in ms if m.name == "graph.causal_mask"]
    if scale != fwd.scale or (mask and mask[0].value.value.data != 0.0):  # type: ignore[attr-defined]
        return None
    ops += scaled
    uses = list(dsc.uses)
    if len(uses) != 2:
        return None
    dq_op = next((u.operation for u in uses if kc.is_matmul(u.operation) and u.index == 0
                  and kc.swapped(u.operation.operands[1]) is kt), None)
    dk_op = next((u.operation for u in uses if kc.is_matmul(u.operation) and u.index == 1
                  and kc.swapped(u.operation.operands[0]) is q), None)
    if dq_op is None or dk_op is None:
        return None
    if any(kc.kind(x) != kc.kind(q) for x in (do, dq_op.results[0], dk_op.results[0], dv_op.results[0])):
        return None
    ops += [dq_op, dk_op]
    block = fn.body.block
    first = min((mm, dv_op), key=block.get_operation_index)  # type: ignore[arg-type]
    return _Backward(fn, ops, q, kt, v, do, step, dq_op.results[0], dk_op.results[0], dv_op.results[0], first)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- residuals through scans


def _rebuild(old: _Caller, args: list[SSAValue], result_types: list, result_map: list[int | None], *,
             stacked: list[int] | None = None, carry_args: list[int] | None = None,
             carry_results: list[int] | None = None) -> _Caller:
    """Put a caller of the same callee with these operands and results in place of `old` (a
    scan takes `stacked`, `carry_args`, `carry_results`); old result i becomes new result
    `result_map[i]` (None: it must have no uses)."""
    if isinstance(old, graph.ScanOp):
        new: _Caller = graph.ScanOp(old.callee.root_reference.data, args, result_types, length=old.num_iterations,
                                    stacked=stacked or [], carry_args=carry_args or [],
                                    carry_results=carry_results or [], reverse=old.is_reverse)
    else:
        new = func.CallOp(old.callee, args, result_types)
    for k, v in old.attributes.items():
        new.attributes[k] = v
    block = old.parent_block()
    assert block is not None
    block.insert_op_before(new, old)
    for i, r in enumerate(old.results):
        j = result_map[i]
        if j is None:
            assert not r.uses
        else:
            r.replace_all_uses_with(new.results[j])
    old.detach()
    old.erase()
    return new


def _scan_facts(c: _Caller) -> tuple[list[int], list[int], list[int]]:
    """Return (stacked, carry_args, carry_results) of a scan; empty lists for a call."""
    if isinstance(c, graph.ScanOp):
        return list(c.stacked_args()), list(c.carry_args.get_values()), list(c.carry_results.get_values())
    return [], [], []


def _add_residual(value: SSAValue, fwd_fn: func.FuncOp, link: _Link) -> SSAValue:
    """Return the backward function's new argument holding forward value `value` (a new
    result of the forward's caller, stacked for a scan, fed to the backward's caller)."""
    ret = fwd_fn.body.block.last_op
    assert isinstance(ret, func.ReturnOp)
    ret.operands = [*ret.operands, value]
    fwd_fn.update_function_type()
    f = link.fwd
    n = len(f.results)
    typ = stacked_type(value.type, f.num_iterations) if isinstance(f, graph.ScanOp) else value.type
    st, ca, cr = _scan_facts(f)
    link.fwd = _rebuild(f, list(f.operands), [r.type for r in f.results] + [typ], list(range(n)),
                        stacked=st, carry_args=ca, carry_results=cr)
    b = link.bwd
    m = len(b.operands)
    st, ca, cr = _scan_facts(b)
    link.bwd = _rebuild(b, [*b.operands, link.fwd.results[n]], [r.type for r in b.results], list(range(len(b.results))),
                        stacked=[*st, m], carry_args=ca, carry_results=cr)
    block = link.bwd_fn.body.block
    arg = block.insert_arg(value.type, len(block.args))
    link.bwd_fn.update_function_type()
    return arg


def _drop_unused_args(link: _Link, args: list[SSAValue | None]) -> None:
    """Remove those of `args` (the backward function's) that nothing uses and that its caller
    feeds once per call (a scan's stacked operands)."""
    block = link.bwd_fn.body.block
    b = link.bwd
    drop = [j for j, a in enumerate(block.args) if not a.uses and _stacked_arg(b, j) and any(a is x for x in args)]
    if not drop:
        return
    keep = [j for j in range(len(b.operands)) if j not in drop]
    where = {j: i for i, j in enumerate(keep)}
    for j in reversed(drop):
        block.erase_arg(block.args[j])
    link.bwd_fn.update_function_type()
    st, ca, cr = _scan_facts(b)
    link.bwd = _rebuild(b, [b.operands[j] for j in keep], [r.type for r in b.results], list(range(len(b.results))),
                        stacked=[where[j] for j in st if j in where], carry_args=[where[j] for j in ca],
                        carry_results=cr)


def _drop_unused_results(fwd_fn: func.FuncOp, link: _Link, values: list[SSAValue]) -> None:
    """Remove the forward caller's results (once per call) that nothing reads any more and that
    return one of `values`."""
    f = link.fwd
    ret = fwd_fn.body.block.last_op
    assert isinstance(ret, func.ReturnOp)
    drop = [r for r, x in enumerate(ret.operands) if any(x is v for v in values) and _stacked_result(f, r)
            and not f.results[r].uses]
    if not drop:
        return
    keep = [r for r in range(len(f.results)) if r not in drop]
    where = {r: i for i, r in enumerate(keep)}
    ret.operands = [ret.operands[r] for r in keep]
    fwd_fn.update_function_type()
    st, ca, cr = _scan_facts(f)
    link.fwd = _rebuild(f, list(f.operands), [f.results[r].type for r in keep], [where.get(r) for r in range(len(f.results))],
                        stacked=st, carry_args=ca, carry_results=[where[r] for r in cr])


# ----------------------------------------------------------------------------- the rewrite


def _erase_dead(ops: list[Operation]) -> None:
    """Erase `ops` (and the views and kernels they alone read, transitively) where nothing uses them."""
    work = list(ops)
    while work:
        op = work.pop()
        if op.parent is None or any(r.uses for r in op.results):
            continue
        if not (isinstance(op, kernel.FusedOp) or op.name in ("graph.matmul", "graph.transpose")):
            continue
        feeders = [kc.owner(x) for x in op.operands]
        op.detach()
        op.erase()
        work += [f for f in feeders if f is not None]


def _heads_inside_residual(o: SSAValue, fwd: _Forward, link: _Link, block: Block,
                           before: Operation) -> SSAValue | None:
    """Return o [B, H, T, D] as the backward function already has it: the residual of o with its
    heads moved inside ([B, T, H, D], or that merged into [B, T, H * D], which the layer keeps for
    its projection's weight gradient), seen as [B, T, H, D] (a view put before `before`); None
    where there is no such residual."""
    shape = kc.shape(o)
    if len(shape) != 4:
        return None
    b, h, t, d = shape
    for use in o.uses:
        ms = kc.chain(use.operation, ["graph.transpose"])
        if not ms or list(ms[0].perm.get_values()) != [0, 2, 1, 3]:  # type: ignore[attr-defined]
            continue
        moved = use.operation.results[0]
        for x in (moved, *(u.operation.results[0] for u in moved.uses if u.operation.name == "graph.reshape")):
            seen = _image(x, fwd, link)
            if seen is None or kc.shape(seen) not in ((b, t, h, d), (b, t, h * d)):
                continue
            if kc.shape(seen) == (b, t, h, d):
                return seen
            view = graph.ReshapeOp(seen, TensorType(o.type.element_type, [b, t, h, d]))  # type: ignore[attr-defined]
            block.insert_op_before(view, before)
            return view.result
    return None


def _rewrite(module: ModuleOp, fwd: _Forward, bwd: _Backward, link: _Link | None) -> list[tuple[func.FuncOp, Operation]]:
    """Put the fused ops in place of the chain; return the new ops that need kernels, with their functions."""
    # the images of the forward's values in the backward function, before the scans change
    p_pd = [_image(x, fwd, link) for x in (fwd.p, fwd.pd)]
    drop = fwd.dropout
    props = {"scale": fwd.scale, "causal": fwd.causal, "rate": drop.rate.value.data if drop else 0.0,
             "seed": drop.seed.value.data if drop else 0, "salt": drop.salt.value.data if drop else 0}
    flash = FlashAttentionOp(fwd.q, fwd.k, fwd.v, fwd.step, k_transposed=fwd.k_transposed, **props)
    fwd.fn.body.block.insert_op_before(flash, fwd.pv)
    fwd.pv.results[0].replace_all_uses_with(flash.o)
    block: Block = bwd.fn.body.block
    heads_inside = False
    if link is None:
        o, lse = flash.o, flash.lse
    else:
        o = _heads_inside_residual(flash.o, fwd, link, block, bwd.first)
        heads_inside = o is not None
        o = o if o is not None else _add_residual(flash.o, fwd.fn, link)
        lse = _add_residual(flash.lse, fwd.fn, link)
    grad = FlashAttentionGradOp(bwd.q, bwd.kt, bwd.v, o, bwd.do, lse, bwd.step, k_transposed=True,
                                o_heads_inside=heads_inside, **props)
    block.insert_op_before(grad, bwd.first)
    made: list[tuple[func.FuncOp, Operation]] = [(fwd.fn, flash), (bwd.fn, grad)]
    bwd.dq.replace_all_uses_with(grad.dq)
    bwd.dv.replace_all_uses_with(grad.dv)
    user = kc.single_use(bwd.dkt)
    if user is not None and kc.swapped(user.results[0]) is bwd.dkt and len(user.results) == 1:
        user.results[0].replace_all_uses_with(grad.dk)  # dk^T written out as dk: dk itself
        bwd.ops.append(user)
    else:
        n = len(kc.shape(grad.dk))
        back = graph.TransposeOp(grad.dk, [*range(n - 2), n - 1, n - 2], bwd.dkt.type)
        block.insert_op_after(back, grad)
        bwd.dkt.replace_all_uses_with(back.result)
        made.append((bwd.fn, back))
    _erase_dead(bwd.ops)
    fwd_ops = [fwd.pv, *([fwd.drop] if fwd.drop else []), *reversed(fwd.casts), *reversed(fwd.sm), fwd.qk]
    if link is None:
        _erase_dead(fwd_ops)
    if not fwd.k_transposed and [u.operation for u in bwd.kt.uses] == [grad]:
        # the backward reads k as the forward does: k^T need not be written out for it
        grad.operands[1] = fwd.k if link is None else _add_residual(fwd.k, fwd.fn, link)
        grad.properties["k_transposed"] = int_attr(0)
    if link is not None:
        _drop_unused_args(link, [bwd.kt, *p_pd])
        _drop_unused_results(fwd.fn, link, [fwd.p, fwd.pd, fwd.kt])
    kt_op = kc.owner(fwd.kt)
    _erase_dead(fwd_ops + ([kt_op] if kt_op is not None and kt_op.parent is not None else []))
    return made


def flash_attention_module(module: ModuleOp) -> int:
    """Replace every attention chain of GPU program `module` (and its backward) by the fused
    kernels (see the module docstring); return how many it replaced."""
    funcs = {op.sym_name.data: op for op in module.walk() if isinstance(op, func.FuncOp)}
    made: list[tuple[func.FuncOp, Operation]] = []
    n = 0
    for fn in list(funcs.values()):
        for op in list(fn.body.block.ops):
            if op.parent is None or not kc.is_matmul(op):
                continue
            fwd = _match_forward(fn, op)
            if fwd is None:
                continue
            for link in _links(module, fwd, funcs):
                bwd = _match_backward(fwd, link.bwd_fn if link else fn, link)
                if bwd is not None:
                    made += _rewrite(module, fwd, bwd, link)
                    n += 1
                    break
    namer = module_namer(module)
    for fn, op in made:  # the new ops' kernels, as device-kernels gives them
        give_kernels(fn, [op], namer)
    return n


@dataclass(frozen=True)
class FlashAttention(ModulePass):
    """Fuse attention's chains of a GPU program into flash-style kernels (see the module doc)."""

    name = "flash-attention"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        flash_attention_module(op)
