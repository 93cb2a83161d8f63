"""`multi-tensor`: the optimizer's updates of all parameters in a few launches.

Runs on a GPU program (the kernel level after `device-kernels`). There the update of each
parameter is a `kernel.fused` of its own (Adam's `p, m, v` from the gradient, with the clipping
coefficient and the step's scalars), and the parameters share one kernel source: one launch
per parameter, 16 to 150 a step, most of them over a few thousand items. This pass puts the
kernels of one source side by side in one kernel (at most `MAX_PIECES` of them, and at most
`MAX_POINTERS` pointer arguments, the 4 KB a launch's arguments may take), a *multi-tensor*
launch as apex's and PyTorch's `_foreach` optimizers make:

* one `row` launch, a block per chunk of `CHUNK` items of one piece: block r finds its piece
  (a chain of comparisons against the pieces' first blocks, constants of the source) and runs
  the piece's elementwise body over its chunk (`HS_FOR_PIECE`, `hs_common.cuh`), each thread
  every blockDim-th item, so every item is computed as the kernel of the piece alone computes
  it (the same bits);
* operands the pieces share (the step's scalars) are passed once;
* the fused op is placed where the last piece was; the pieces' `graph.assign`s that stood
  before it move after it (an assign stores a value at the end of the step wherever it
  stands). A piece whose results are read before that place by anything else, or that reads
  another piece's results, stays a kernel of its own.

The results keep their in-place updates: item i of a piece reads item i of its operands before
writing item i of its results (`kernel.FusedOp.pieces`, `out_facts`), so `p, m, v` are still
written over the parameters' arrays.

Which kernels: one elementwise launch over `n0` items, no scratch, no rank values (their
source differs per rank), and an `optim` op among the ops they compute. Others (a layer's
activations, whose uses are spread through the step) stay as they are.
"""

from __future__ import annotations

import re
from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Block, Operation, SSAValue
from xdsl.passes import ModulePass

from hspmd.dialects import graph, kernel
from hspmd.dialects.cuda_c import KernelCode
from hspmd.transforms.device_kernels import module_namer
from hspmd.transforms.fuse_kernels import KERNEL_NAME, KernelNamer

#: items of a piece one block runs (a row launch of CHUNK columns: 512 threads, 4 items each)
CHUNK = 2048
#: pieces in one launch at most (the comparisons a block makes to find its piece)
MAX_PIECES = 64
#: pointer arguments of one launch at most (8 bytes each, within the 4 KB of a launch's arguments)
MAX_POINTERS = 480

_SIGNATURE = re.compile(r"HS_KERNEL void (\w+)\(([^)]*)\)\s*\{")


def _merges(op: Operation) -> bool:
    """Return whether `op` is a kernel this pass puts beside others (see the module docstring)."""
    if not isinstance(op, kernel.FusedOp) or op.rank_values is not None or op.pieces is not None:
        return False
    launches = op.launch_list
    if len(launches) != 1 or launches[0][0] != "elementwise" or op.scratch_sizes:
        return False
    source = op.source.data
    if source.count("HS_KERNEL") != 1 or source.count("HS_FOR(i, n0)") != 1:
        return False
    return any(o.dialect_name() == "optim" for o in op.body.block.ops)


def _in_block(op: Operation, block: Block) -> Operation | None:
    """Return the op of `block` that holds `op` (itself, or an ancestor), or None."""
    while op is not None and op.parent_block() is not block:
        op = op.parent_op()
    return op


def _pieces(block: Block) -> list[list[kernel.FusedOp]]:
    """Return the groups of `block`'s kernels to merge: per kernel source, those that may move
    to the last one's place (see the module docstring), in block order."""
    position = {op: i for i, op in enumerate(block.ops)}
    by_name: dict[str, list[kernel.FusedOp]] = {}
    for op in block.ops:
        if _merges(op):
            by_name.setdefault(op.kernel.data, []).append(op)
    groups = []
    for members in by_name.values():
        results = {r for m in members for r in m.results}
        apart = {m for m in members if any(v in results for v in m.inputs)}  # reads another's results
        apart |= {m for m in members if any(_in_block(u.operation, block) in apart for r in m.results for u in r.uses)}
        members = [m for m in members if m not in apart]
        while len(members) > 1:
            last = position[members[-1]]
            early = [m for m in members[:-1]
                     if any(position[_in_block(u.operation, block)] < last
                            and not isinstance(_in_block(u.operation, block), graph.AssignOp)
                            for r in m.results for u in r.uses)]
            if not early:
                break
            members = [m for m in members if m not in early]
        if len(members) > 1:
            groups.append(members)
    return groups


def _chunks(members: list[kernel.FusedOp]) -> list[list[kernel.FusedOp]]:
    """Split `members` into launches of at most MAX_PIECES pieces and MAX_POINTERS pointers."""
    out: list[list[kernel.FusedOp]] = [[]]
    shared: set[SSAValue] = set()
    pointers = 0
    for m in members:
        new = [v for v in dict.fromkeys(m.inputs) if v not in shared]
        cost = len(new) + len(m.outputs)
        if out[-1] and (len(out[-1]) >= MAX_PIECES or pointers + cost > MAX_POINTERS):
            out.append([])
            shared, pointers = set(), 0
            new = list(dict.fromkeys(m.inputs))
            cost = len(new) + len(m.outputs)
        out[-1].append(m)
        shared.update(new)
        pointers += cost
    return [c for c in out if len(c) > 1]


def multi_tensor_source(members: list[kernel.FusedOp], inputs: list[SSAValue]) -> tuple[str, int]:
    """Return the multi-tensor kernel's source (named `KERNEL_NAME`) running `members` side by
    side with the fused op's operands `inputs` (then its results, the members' in order), and
    its blocks (the launch's rows)."""
    first = members[0]
    match = _SIGNATURE.search(first.source.data)
    assert match is not None  # `_merges` checked the source has its kernel
    name, params = match.group(1), [p.strip() for p in match.group(2).split(",")]
    n_in, n_out = len(first.inputs), len(first.outputs)
    assert len(params) == n_in + n_out + 2, "a fused kernel takes its operands, results, n0 and n1"
    types = [p.rsplit(" ", 1)[0] for p in params]
    body = first.source.data[match.end():].replace("HS_FOR(i, n0)", "HS_FOR_PIECE(i, n0)")
    piece = f"{KERNEL_NAME}_piece"
    lines = [f"// {KERNEL_NAME}: multi-tensor: {len(members)} launches of {name} side by side, "
             f"a block per {CHUNK} items of one",
             f"static __device__ __forceinline__ void {piece}({', '.join(params)}, long hs_piece_lo, "
             f"long hs_piece_hi, long hs_piece_step) {{" + body.rstrip()]
    arg_types = []
    for v in inputs:
        m = next(m for m in members if v in m.inputs)
        arg_types.append(types[list(m.inputs).index(v)])
    args = [f"{t} a{k}" for k, t in enumerate(arg_types)]
    results = [f"{types[n_in + j]} r{k * n_out + j}" for k in range(len(members)) for j in range(n_out)]
    lines.append(f"HS_KERNEL void {KERNEL_NAME}({', '.join(args + results)}, long n0, long n1) {{")
    lines.append("  HS_ROWS(r, n0) {")
    start = 0
    for k, m in enumerate(members):
        items = m.launch_list[0][2]
        blocks = -(-items // CHUNK)
        call_args = [f"a{inputs.index(v)}" for v in m.inputs] + [f"r{k * n_out + j}" for j in range(n_out)]
        test = "if" if k == 0 else "else if"
        lines.append(f"    {test} (r < {start + blocks}L) {piece}({', '.join(call_args)}, {items}L, 0L, "
                     f"(r - {start}L) * {CHUNK}L + (long)threadIdx.x, (r - {start}L + 1) * {CHUNK}L, (long)blockDim.x);")
        start += blocks
    lines += ["  }", "}", ""]
    return "\n".join(lines), start


def merge(block: Block, members: list[kernel.FusedOp], namer: KernelNamer) -> kernel.FusedOp:
    """Replace `members` (kernels of one source in `block`, see `_pieces`) by one multi-tensor
    kernel at the last one's place; return it."""
    inputs = list(dict.fromkeys(v for m in members for v in m.inputs))
    source, blocks = multi_tensor_source(members, inputs)
    ops = [o for o in members[0].body.block.ops if not isinstance(o, kernel.YieldOp)]
    name, code = namer(ops, KernelCode(source, [f"row {KERNEL_NAME} {blocks} {CHUNK}"]))
    region, body = kernel.make_body([v.type for v in inputs])
    outer: dict[SSAValue, SSAValue] = dict(zip(inputs, body.args))
    yielded: list[SSAValue] = []
    for m in members:
        mapping = {arg: outer[v] for arg, v in zip(m.body.block.args, m.inputs)}
        for o in m.body.block.ops:
            if isinstance(o, kernel.YieldOp):
                yielded += [mapping[v] for v in o.values]
            else:
                body.add_op(o.clone(value_mapper=mapping))
    body.add_op(kernel.YieldOp(*yielded))
    fused = kernel.FusedOp(inputs, [r.type for m in members for r in m.results], name, members[0].dtype.data,
                           code.source, code.launches, [], region,
                           pieces=[m.launch_list[0][2] for m in members])
    last = members[-1]
    block.insert_op_before(fused, last)
    position = {op: i for i, op in enumerate(block.ops)}
    moved: list[Operation] = []
    for old, new in zip([r for m in members for r in m.results], fused.results):
        moved += [u.operation for u in old.uses if u.operation.parent_block() is block
                  and position[u.operation] < position[fused]]
        old.replace_all_uses_with(new)
    anchor: Operation = last
    for op in sorted(set(moved), key=position.__getitem__):
        op.detach()
        block.insert_op_after(op, anchor)
        anchor = op
    for m in members:
        m.detach()
        m.erase()
    return fused


def multi_tensor_function(fn: func.FuncOp, namer: KernelNamer) -> int:
    """Run `multi-tensor` on `fn`'s body; return the number of launches it saved."""
    saved = 0
    block = fn.body.block
    for members in _pieces(block):
        for chunk in _chunks(members):
            merge(block, chunk, namer)
            saved += len(chunk) - 1
    return saved


def multi_tensor_module(module: ModuleOp) -> int:
    """Run `multi-tensor` on every function of `module`; return the launches it saved."""
    namer = module_namer(module)
    return sum(multi_tensor_function(fn, namer) for fn in [op for op in module.walk() if isinstance(op, func.FuncOp)])


class MultiTensor(ModulePass):
    """`multi-tensor` (see the module docstring)."""

    name = "multi-tensor"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        multi_tensor_module(op)
