"""CUDA C emission for fused kernels: elementwise chains and row reductions, from the ops' own C.

Every op gives its CUDA C beside its definition (`hspmd/dialects/interfaces.py`): an elementwise
op a `cuda_expr` (statements over C variables), a row op a `cuda_row` (a kernel template with
one block per row). This module assembles kernels from them: a chain of elementwise ops into one
loop, a row op's template with its first operand read from memory or computed in place by an
elementwise prologue. Each emitter returns a `KernelCode`: the source (written against the
portability layer that `cuda_preamble.cuh` / `cuda_emu.h` define), its launches (`"KIND NAME
N0 N1"`) and scratch buffer sizes. Every `__global__` function of one kernel takes the same
arguments: operands (`const` pointers), results, scratch buffers, then `long n0, long n1`.

The arithmetic follows the ops' NumPy kernels operation by operation, in the operands' float
type, with Python-float constants rounded to that type first as NumPy's weak scalars are. Sums
over a row are reassociated (SIMD lanes on a CPU, a tree across threads on a GPU), as NumPy's
pairwise summation is; docs/kernels.md states the resulting tolerance.
"""

from __future__ import annotations

import math
import re

from xdsl.ir import Operation, SSAValue

from hspmd.dialects import graph
from hspmd.dialects.cuda_c import (
    C_FLOAT,
    C_ROUND,
    C_STORAGE,
    EmitError,
    KernelCode,
    Prologue,
    RowKernel,
    c_type,
    float_kind,
    lit,
    retype,
    shape,
)

__all__ = [
    "C_FLOAT", "EmitError", "KernelCode", "Prologue", "c_type", "emit_elementwise", "emit_row", "elementwise_expr",
    "float_kind", "is_elementwise", "is_row_op", "lit", "row_extents", "shape", "takes_prologue",
]


def is_elementwise(op: Operation) -> bool:
    """Return whether an elementwise kernel can compute `op` (it has a `cuda_expr`)."""
    return callable(getattr(op, "cuda_expr", None))


def is_row_op(op: Operation) -> bool:
    """Return whether a row kernel computes `op` (it has a `cuda_row`)."""
    return callable(getattr(op, "cuda_row", None))


def takes_prologue(op: Operation) -> bool:
    """Return whether `op`'s row kernel can compute its first operand from an elementwise chain."""
    return bool(getattr(op, "CUDA_ROW_PROLOGUE", False))


def _needs_rows(op: Operation) -> bool:
    """Return whether `op`, in an elementwise chain, reads the row `r` and column `j` of its item."""
    return isinstance(op, graph.BroadcastOp) or bool(getattr(op, "CUDA_NEEDS_ROWS", False))


# ----------------------------------------------------------------------------- elementwise


def elementwise_expr(op: Operation, a: list[str], t: str, stmts: list[str], out: list[str]) -> None:
    """Append statements computing `op` from operand expressions `a` into `stmts`; `out` are
    the names of its result variables (the op's `cuda_expr`).

    Scalar (0-d) operands arrive as `double` expressions. EmitError for an op without one.
    """
    if not is_elementwise(op):
        raise EmitError(f"no elementwise emitter for '{op.name}'")
    op.cuda_expr(a, t, stmts, out)  # type: ignore[attr-defined]


def _elementwise_body(
    members: list[Operation], inputs: list[SSAValue], outputs: list[SSAValue], t: str, cols: int
) -> tuple[list[str], list[str], dict[SSAValue, str]]:
    """Return (statements before the loop, statements per item, value names) computing
    `members` at flat index `i` (= row `r` * `cols` + column `j` where an op needs them).

    A result in a 16-bit float type is rounded to it where its op computes it (`hs_round_*`), so
    a chain gives what its ops give one by one, stored and read back between them."""
    input_index = {v: k for k, v in enumerate(inputs)}
    names: dict[SSAValue, str] = {}
    pre: list[str] = []
    body: list[str] = []
    for k, v in enumerate(inputs):
        if shape(v) == ():
            pre.append(f"const double s{k} = (double)in{k}[0];")
            names[v] = f"s{k}"
    bcast_inputs = {m.input for m in members if isinstance(m, graph.BroadcastOp)}
    for k, v in enumerate(inputs):
        if v not in names and v not in bcast_inputs:
            body.append(f"const {t} x{k} = in{k}[i];")
            names[v] = f"x{k}"
    for j, m in enumerate(members):
        outs = [f"v{j}_{q}" for q in range(len(m.results))]
        if isinstance(m, graph.BroadcastOp):  # read through the broadcast, not materialised
            src = m.input
            if src not in input_index:
                raise EmitError("a fused graph.broadcast must read an operand of the kernel")
            if shape(src) == ():
                body.append(f"const {t} {outs[0]} = ({t})s{input_index[src]};")
            else:
                body.append(f"const {t} {outs[0]} = in{input_index[src]}[{m.cuda_read_index(cols)}];")
        else:
            elementwise_expr(m, [names[v] for v in m.operands], t, body, outs)
        for res, nm in zip(m.results, outs):
            kind = float_kind(res.type, reduced=True)
            if kind in C_ROUND:
                body.append(f"const {t} {nm}r = {C_ROUND[kind]}({nm});")
                nm += "r"
            names[res] = nm
    missing = [v for v in outputs if v not in names]
    if missing:
        raise EmitError("a kernel result is not computed by its ops")
    return pre, body, names


def emit_elementwise(
    name: str,
    members: list[Operation],
    inputs: list[SSAValue],
    outputs: list[SSAValue],
    dtype: str,
    out_shape: tuple[int, ...],
    ctype: str | None = None,
) -> KernelCode:
    """Return the elementwise kernel computing `outputs` from `inputs` through `members` (in
    order). Inputs are tensors of the group's shape (read at `i`), 0-d scalars (read once) or
    the operands of member `graph.broadcast` ops (read at the mapped index). The kernel computes
    in `dtype`'s C type, or `ctype` where given (an integer chain: a dropout's step counters).

    A plain chain is one flat loop (`HS_FOR`, launch `elementwise`). A chain that reads
    through a broadcast or masks by position (`CUDA_NEEDS_ROWS`) runs as rows of the last dim
    (launch `row`, no reduction): the row and column indices then come without a division per
    element, and the column loop stays unit-stride so a CPU compiler vectorises it.
    """
    t = ctype or C_FLOAT[dtype]
    numel = math.prod(out_shape)
    cols = out_shape[-1]
    rows = numel // cols
    two_d = any(_needs_rows(m) for m in members)
    # no __restrict__: a runner may pass an operand's array as the result of the same index
    # (an in-place optimizer update), which is safe for a loop reading in[i] before out[i]
    params = [f"const {c_type(v.type)}* in{k}" for k, v in enumerate(inputs)]
    params += [f"{C_STORAGE.get(dtype, t) if ctype is None else t}* out{k}" for k in range(len(outputs))]
    params += ["long n0", "long n1"]
    pre, body, names = _elementwise_body(members, inputs, outputs, t, cols)
    for k, v in enumerate(outputs):
        body.append(f"out{k}[i] = {names[v]};")
    ops = ", ".join(m.name for m in members)
    head = f"HS_KERNEL void {name}({', '.join(params)}) {{\n" + "".join(f"  {s}\n" for s in pre)
    if two_d:
        src = (
            f"// {name}: elementwise, rows of the last dim: {ops}\n" + head
            + "  HS_ROWS(r, n0) {\n    HS_COLS_SIMD(j, n1) {\n      const long i = r * n1 + j;\n"
            + "".join(f"      {s}\n" for s in body)
            + "    }\n  }\n}\n"
        )
        return KernelCode(src, [f"row {name} {rows} {cols}"], [])
    src = (
        f"// {name}: elementwise: {ops}\n" + head
        + "  HS_FOR(i, n0) {\n"
        + "".join(f"    {s}\n" for s in body)
        + "  }\n}\n"
    )
    return KernelCode(src, [f"elementwise {name} {numel} 0"], [])


def _prologue_function(name: str, pro: Prologue, t: str, cols: int) -> tuple[str, list[str]]:
    """Return the `__device__` function computing the prologue's value at (r, j), and the
    kernel parameters that replace the row op's first operand."""
    pre, body, names = _elementwise_body(pro.members, pro.inputs, [pro.output], t, cols)
    params = [f"const {c_type(v.type)}* in{k}" for k, v in enumerate(pro.inputs)]
    fn = (
        f"__device__ __forceinline__ {t} {name}_x({', '.join(params)}, long r, long j, long cols) {{\n"
        + "  const long i = r * cols + j;\n"
        + "".join(f"  {s}\n" for s in pre + body)
        + f"  return {names[pro.output]};\n}}\n"
    )
    return fn, params


# ----------------------------------------------------------------------------- rows


def row_extents(op: Operation) -> tuple[int, int]:
    """Return (rows, cols) of a row op: its main operand as rows of its last dim (or what the
    op's `cuda_row_extents()` says: a routing group's [tokens, experts] for `graph.moe_route`)."""
    own = getattr(op, "cuda_row_extents", None)
    if callable(own):
        return own()
    s = shape(op.operands[0])
    if not s:
        raise EmitError(f"'{op.name}' on a 0-d tensor")
    return math.prod(s[:-1]), s[-1]


def emit_row(name: str, op: Operation, prologue: Prologue | None = None, reduced: bool = False) -> KernelCode:
    """Return the kernel of row op `op` from its `cuda_row` template (EmitError where its form is
    not handled); with a `prologue`, the kernel computes the op's first operand from the
    prologue's inputs where it reads it (its operands are then the prologue's inputs and the
    op's other operands). With `reduced` (a GPU program), an op on bfloat16 or float16 too: its
    pointers point to the 16-bit type, its values are floats (no scratch, no prologue)."""
    if not is_row_op(op):
        raise EmitError(f"no row emitter for '{op.name}'")
    dtype = float_kind(op.operands[0].type, reduced)
    if dtype is None:
        raise EmitError(f"'{op.name}' is not f32/f64")
    t = C_FLOAT[dtype]
    rows, cols = row_extents(op)
    code = op.cuda_row(RowKernel(name, t, rows, cols, prologue))  # type: ignore[attr-defined]
    src = code.source
    for w in op.operands[1:]:
        if float_kind(w.type, reduced) not in (None, dtype):
            raise EmitError(f"'{op.name}' mixes float types")
    if dtype in C_STORAGE:  # 16-bit floats: the template's pointers point to them, its values are floats
        if code.scratch or prologue is not None:
            raise EmitError(f"its row kernel takes no {dtype} scratch or prologue")
        src = re.sub(r"\bT(\s*\*)", C_STORAGE[dtype] + r"\1", src)
    if prologue is None:
        ptr = C_STORAGE.get(dtype, "T")
        src = src.replace("XPARAM", f"const {ptr}* __restrict__ x").replace("XDECL", f"const {ptr}* xr = x + r * cols;")
        src = src.replace("XLOAD[", "xr[")
    else:
        if not takes_prologue(op) or shape(prologue.output) != shape(op.operands[0]):
            raise EmitError(f"'{op.name}' takes no prologue")
        fn, params = _prologue_function(name, prologue, t, cols)
        args = ", ".join(f"in{k}" for k in range(len(prologue.inputs)))
        src = src.replace("XPARAM", ", ".join(params)).replace("    XDECL\n", "")
        src = re.sub(r"XLOAD\[([^\]]+)\]", lambda m: f"{name}_x({args}, r, {m.group(1)}, cols)", src)
        ops = ", ".join(m.name for m in prologue.members)
        src = f"// {name}: prologue {ops}\n" + fn + src
    if "XLOAD" in src or "XPARAM" in src or "XDECL" in src:
        raise EmitError(f"internal: unresolved template in the kernel of '{op.name}'")
    return KernelCode(retype(src, t), code.launches, code.scratch)
