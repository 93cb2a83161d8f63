"""`fuse-kernels`: physical IR -> kernel-level IR (`kernel.fused` ops carrying CUDA C).

In every function of the module (the step and the private layer functions), per block:

* **row ops** (softmax and its gradient over the last dim, layer norm, RMS norm and their
  gradients, softmax cross-entropy and its gradient) each become one `kernel.fused` whose
  source runs one block per row with a block reduction;
* **elementwise chains** (`graph` arithmetic, activations and their gradients, causal mask,
  `optim.mul_scalar`, `optim.adam`, `optim.sgd`) of one shape and float type are grouped
  greedily in program order and become one kernel each. A `graph.broadcast` feeding a chain
  is read through an index expression instead of being materialised; 0-d scalar operands
  (learning rate, bias corrections, clip coefficient) are read once.

Then an elementwise kernel whose one result only feeds the first operand of a softmax,
layer/RMS norm or cross-entropy kernel becomes that kernel's prologue: the row kernel
computes the chain where it reads the operand (attention's scale + causal mask + softmax is
one kernel, and the masked scores are never stored).

A group grows only while that keeps the program valid with the fused op at the position of
the group's last member: an op joins a group only if no op outside the group, placed
before it, uses a member's value. Groups never span a collective (`comm.*`) or a
`func.call` or `graph.scan`, so the order of communication and compute stays as it was. Matmuls, reshapes,
transposes, reductions over other dims, embeddings, dropout, casts, integer and f16/bf16 ops
stay as they are (NumPy's BLAS / cuBLAS or the per-op kernels run them). The fused op keeps
the replaced ops in its body: the semantics, and the per-op fallback. Kernels with the same
source share one name, so a program compiles each once.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Block, Operation, SSAValue
from xdsl.passes import ModulePass

from hspmd.codegen.emit_cuda import (
    EmitError,
    KernelCode,
    Prologue,
    emit_elementwise,
    emit_row,
    float_kind,
    is_elementwise,
    is_row_op,
    shape,
    takes_prologue,
)
from hspmd.dialects import graph, kernel
from hspmd.dialects.cuda_c import REDUCED, format_rank_values


@dataclass
class _Group:
    """An elementwise group being formed: its shape and float type, and its members."""

    shape: tuple[int, ...]
    dtype: str
    members: list[Operation] = field(default_factory=list)


def _elementwise_key(op: Operation, reduced: bool = False) -> tuple[tuple[int, ...], str] | None:
    """Return (shape, dtype) of an op an elementwise kernel can compute, else None; with
    `reduced`, of a 16-bit float op only (a GPU's chains of them: `device-kernels`)."""
    if not is_elementwise(op) or not op.results:
        return None
    s, dtype = shape(op.results[0]), float_kind(op.results[0].type, reduced)
    if dtype is None or s == () or math.prod(s) == 0 or reduced and dtype not in REDUCED:
        return None
    for v in (*op.operands, *op.results):
        if shape(v) == ():
            if float_kind(v.type, reduced) is None:
                return None
        elif shape(v) != s or float_kind(v.type, reduced) != dtype:
            return None
    return s, dtype


def _is_barrier(op: Operation) -> bool:
    return op.dialect_name() == "comm" or isinstance(op, (func.CallOp, graph.ScanOp))


def _absorbable(value: SSAValue, group: _Group) -> graph.BroadcastOp | None:
    """Return the broadcast producing `value` if a kernel of `group` can read through it."""
    owner = value.owner
    if isinstance(owner, graph.BroadcastOp) and shape(owner.result) == group.shape:
        if float_kind(owner.input.type, True) == group.dtype or shape(owner.input) == ():
            return owner
    return None


def _can_join(group: _Group, op: Operation, pos: dict[Operation, int]) -> bool:
    """True if `op` may join `group`: no outside op before `op` uses a member's value."""
    members = set(group.members)
    here = pos[op]
    for m in group.members:
        for r in m.results:
            for use in r.uses:
                user = use.operation
                if user is not op and user not in members and pos.get(user, -1) < here:
                    return False
    return True


#: the name a kernel is emitted under before it gets its own
KERNEL_NAME = "HS_KERNEL_NAME"


class KernelNamer:
    """Names kernels within one module: k<N>_<op names>, and the same name for the same source
    (the Adam updates of all parameters, the layer norms of every layer: one kernel each,
    compiled once; the extents are in each op's launches, not in the source)."""

    def __init__(self):
        self.count = itertools.count()
        self.known: dict[str, str] = {}

    def __call__(self, ops: list[Operation], code: KernelCode) -> tuple[str, KernelCode]:
        key = code.source + (f"\n// rank values {format_rank_values(code.rank_values)}" if code.rank_values else "")
        name = self.known.get(key)
        if name is None:
            short = "_".join(o.name.split(".")[1] for o in ops[:3])
            name = self.known[key] = f"k{next(self.count)}_{short}"
        return name, KernelCode(code.source.replace(KERNEL_NAME, name),
                                [s.replace(KERNEL_NAME, name) for s in code.launches], code.scratch,
                                code.rank_values)


def replace_with_kernel(block: Block, code: KernelCode, name: str, dtype: str, members: list[Operation],
             inputs: list[SSAValue], outputs: list[SSAValue], extra: list[Operation]) -> None:
    """Insert the kernel.fused op for `members` before the last member, rewire, erase members."""
    region, body = kernel.make_body([v.type for v in inputs])
    mapping: dict[SSAValue, SSAValue] = dict(zip(inputs, body.args))
    for m in extra + members:
        body.add_op(m.clone(value_mapper=mapping))
    body.add_op(kernel.YieldOp(*[mapping[v] for v in outputs]))
    fused = kernel.FusedOp(inputs, [v.type for v in outputs], name, dtype, code.source,
                           code.launches, code.scratch, region, format_rank_values(code.rank_values))
    block.insert_op_before(fused, members[-1])
    for old, new in zip(outputs, fused.results):
        old.replace_all_uses_with(new)
    for m in reversed(members):
        m.detach()
        m.erase()
    for b in extra:  # broadcasts now read inside the kernel
        if not any(r.uses for r in b.results):
            b.detach()
            b.erase()


def _fuse_rows(block: Block, namer: KernelNamer) -> int:
    count = 0
    for op in list(block.ops):
        if not is_row_op(op):
            continue
        try:
            name, code = namer([op], emit_row(KERNEL_NAME, op))
        except EmitError:
            continue
        if not any(r.uses for r in op.results):
            continue  # dead: nothing to compute
        # the kernel writes every result; unused ones still come back (the yield names them all)
        replace_with_kernel(block, code, name, float_kind(op.operands[0].type), [op], list(op.operands), list(op.results), [])
        count += 1
    return count


def fuse_elementwise(block: Block, namer: KernelNamer, reduced: bool = False) -> int:
    """Fuse the elementwise chains of `block` (with `reduced`: its 16-bit float chains only);
    return the number of kernels made."""
    ops = list(block.ops)
    pos = {op: i for i, op in enumerate(ops)}
    member_of: dict[Operation, _Group] = {}
    groups: list[_Group] = []
    first_pos: dict[int, int] = {}
    last_barrier = -1
    for op in ops:
        if _is_barrier(op):
            last_barrier = pos[op]
            continue
        key = _elementwise_key(op, reduced)
        if key is None:
            continue
        chosen = None
        for v in op.operands:
            g = member_of.get(v.owner)  # type: ignore[arg-type]
            if g is None or (g.shape, g.dtype) != key or first_pos[id(g)] < last_barrier:
                continue
            if _can_join(g, op, pos):
                chosen = g
                break
        if chosen is None:
            chosen = _Group(*key)
            groups.append(chosen)
            first_pos[id(chosen)] = pos[op]
        chosen.members.append(op)
        member_of[op] = chosen
    count = 0
    for g in groups:
        members = set(g.members)
        inputs: list[SSAValue] = []
        extra: list[Operation] = []
        for m in g.members:
            for v in m.operands:
                if v.owner in members:
                    continue
                b = _absorbable(v, g)
                if b is not None:
                    if b not in extra:
                        extra.append(b)
                    v = b.input
                if v not in inputs:
                    inputs.append(v)
        outputs = [r for m in g.members for r in m.results if any(u.operation not in members for u in r.uses)]
        if not outputs:
            continue
        try:
            name, code = namer(g.members, emit_elementwise(KERNEL_NAME, extra + g.members, inputs, outputs,
                                                           g.dtype, g.shape))
        except EmitError:
            continue
        replace_with_kernel(block, code, name, g.dtype, g.members, inputs, outputs, extra)
        count += 1
    return count


def _body_ops(op: kernel.FusedOp) -> list[Operation]:
    return [o for o in op.body.block.ops if not isinstance(o, kernel.YieldOp)]


def _fuse_prologues(block: Block, namer: KernelNamer) -> int:
    """Merge an elementwise kernel whose one result only feeds a row kernel's first operand
    (softmax, layer/RMS norm, cross-entropy) into that row kernel: the row kernel computes
    the chain where it reads the operand (the scaled, masked attention scores of a softmax
    are never stored). Returns the number of merges."""
    count = 0
    for row in [o for o in block.ops if isinstance(o, kernel.FusedOp)]:
        (inner,) = _body_ops(row) if len(_body_ops(row)) == 1 else (None,)
        if not takes_prologue(inner) or not row.inputs:
            continue
        pro = row.inputs[0].owner
        if (not isinstance(pro, kernel.FusedOp) or pro.parent_block() is not block or len(pro.outputs) != 1
                or len(list(pro.outputs[0].uses)) != 1 or list(row.inputs).count(pro.outputs[0]) != 1):
            continue
        members = _body_ops(pro)
        if not all((is_elementwise(m) or isinstance(m, graph.BroadcastOp)) and len(m.results) == 1 for m in members):
            continue
        prologue = Prologue(members, list(pro.body.block.args), pro.body.block.last_op.values[0])
        try:
            name, code = namer(members + [inner], emit_row(KERNEL_NAME, inner, prologue))
        except EmitError:
            continue
        inputs = list(pro.inputs) + list(row.inputs[1:])
        region, body = kernel.make_body([v.type for v in inputs])
        mapping: dict[SSAValue, SSAValue] = dict(zip(pro.body.block.args, body.args))
        for m in members:
            body.add_op(m.clone(value_mapper=mapping))
        mapping[row.body.block.args[0]] = mapping[prologue.output]
        mapping.update(zip(row.body.block.args[1:], body.args[len(pro.inputs):]))
        body.add_op(inner.clone(value_mapper=mapping))
        body.add_op(kernel.YieldOp(*[mapping[v] for v in row.body.block.last_op.values]))
        fused = kernel.FusedOp(inputs, [v.type for v in row.outputs], name, row.dtype.data, code.source,
                               code.launches, code.scratch, region)
        block.insert_op_before(fused, row)
        for old, new in zip(row.outputs, fused.results):
            old.replace_all_uses_with(new)
        for op in (row, pro):
            op.detach()
            op.erase()
        count += 1
    return count


def fuse_function(fn: func.FuncOp, namer: KernelNamer) -> int:
    """Fuse the ops of `fn`'s body in place; return the number of kernels made."""
    block = fn.body.block
    made = _fuse_rows(block, namer) + fuse_elementwise(block, namer)
    return made - _fuse_prologues(block, namer)


def fuse_module(module: ModuleOp) -> int:
    """Fuse every function of `module` (nested group modules included); return the kernel count."""
    namer = KernelNamer()
    functions = [op for op in module.walk() if isinstance(op, func.FuncOp)]
    return sum(fuse_function(fn, namer) for fn in functions)


@dataclass(frozen=True)
class FuseKernels(ModulePass):
    """Fuse elementwise chains and row reductions into `kernel.fused` ops (see the module doc)."""

    name = "fuse-kernels"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        fuse_module(op)
