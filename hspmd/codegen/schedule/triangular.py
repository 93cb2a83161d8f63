"""Causal attention's products computed on their non-zero blocks only: which matmul may skip what.

Causal attention multiplies triangular matrices. The forward's probabilities
`softmax(causal_mask(s, -inf))` are exactly 0 above the diagonal of their last two dims (the
mask's `j > i`: `exp(-inf) = 0`); so is the gradient of the scores, `causal_mask(.., 0)`; a
`scale` or a dropout keeps the zeros, and a transpose of the last two dims turns such a *lower*
matrix into an *upper* one. Of a layer's six batched products, four have such an operand:
`att @ v`, `att^T @ dy` (the gradient of v), `ds @ k` and `q^T @ ds` (of q and k).

`triangular_matmuls(flat)` finds the `graph.matmul`s of a flat program with a triangular
operand, in the physical program (the ops one by one) and in the kernel-level one (the same
ops inside `kernel.fused` bodies), and says for each which (`TRIANGLES`): "lhs-lower",
"lhs-upper", "rhs-lower" or "rhs-upper". The runtime (`hspmd.runtime.cpu.small_matmul`, or
`hspmd.runtime.cpu.triangular_matmul` without a C++ compiler) then multiplies over the operand's
non-zero part only (by 8-row tiles: 17/32 of the work at 128 x 128; NumPy's blocks: 5/8).
The terms left out are exact zeros added to a dot product, so the values are those of the
full product wherever the operands are finite; on attention's shapes the bits too (tested;
for some other shapes OpenBLAS picks another kernel for a block: other last bits). A CPU
schedule choice: the IR is unchanged, and the CUDA backend runs its own (full) products.

The other two products, the scores `q @ k^T` and the probabilities' gradient `dy @ v^T`, have
full operands but are read only on and below the diagonal: the scores through the causal
mask, `dy @ v^T` through softmax's gradient `y * (g - sum(y * g))` with `y` zero above the
diagonal, then a mask. They are "out-lower": the runtime may write 0 above the diagonal instead
of the products there (`small_matmul`'s kernel does; NumPy's computes them in full: by blocks
they went to OpenBLAS's small-matrix kernel, slower and adding in another order). Every value
a consumer reads is the same either way (0 times a finite number is 0, the mask replaces the
rest), so the bits are unchanged (`out_lower_matmuls`).
"""

from __future__ import annotations

import math

from xdsl.ir import Operation, SSAValue

from hspmd.codegen.schedule.flatten import Flat

#: how a matmul's operands or result are triangular (see the module docstring); "out-upper" is
#: "out-lower"'s transposed product, made only by the runtime
TRIANGLES = ("lhs-lower", "lhs-upper", "rhs-lower", "rhs-upper", "out-lower", "out-upper")

#: ops that keep an operand's zeros zeros (their result is as triangular as their first operand)
_KEEP_ZEROS = ("graph.scale", "graph.dropout")


def _square(value: SSAValue) -> bool:
    shape = value.type.get_shape() if hasattr(value.type, "get_shape") else ()
    return len(shape) >= 2 and shape[-1] == shape[-2]


def _swaps_last_two(op: Operation) -> bool:
    perm = tuple(op.perm.get_values())  # type: ignore[attr-defined]
    n = len(perm)
    return n >= 2 and perm == tuple(range(n - 2)) + (n - 1, n - 2)


def _last_dim(op: Operation) -> bool:
    return op.dim.value.data in (-1, len(op.results[0].type.get_shape()) - 1)  # type: ignore[attr-defined]


def _mask_value(op: Operation) -> float:
    return op.value.value.data  # type: ignore[attr-defined]


def _shape_of(op: Operation, fact_of) -> str:
    """Return the triangle ("lower", "upper", "masked": -inf above the diagonal, or "") of the
    result of a graph op, the triangles of its operands given by `fact_of(value)`."""
    name = op.name
    if not op.results or not _square(op.results[0]):
        return ""
    if name == "graph.causal_mask":
        value = _mask_value(op)
        return "lower" if value == 0.0 else "masked" if value == -math.inf else ""
    if name == "graph.softmax" and _last_dim(op) and fact_of(op.operands[0]) == "masked":
        return "lower"
    if name in _KEEP_ZEROS:
        fact = fact_of(op.operands[0])
        return fact if fact in ("lower", "upper") else ""
    if name == "graph.transpose" and _swaps_last_two(op):
        return {"lower": "upper", "upper": "lower"}.get(fact_of(op.operands[0]), "")
    return ""


def _fused_facts(op: Operation, operand_facts: list[str]) -> list[str]:
    """Return the triangles of a `kernel.fused` op's results from its body's ops."""
    block = op.body.block  # type: ignore[attr-defined]
    facts: dict[SSAValue, str] = dict(zip(block.args, operand_facts))
    yielded: list[str] = []
    for inner in block.ops:
        if inner.name == "kernel.yield":
            yielded = [facts.get(v, "") for v in inner.operands]
        elif len(inner.results) == 1:
            facts[inner.results[0]] = _shape_of(inner, lambda v: facts.get(v, ""))
    return yielded


def _slot_facts(flat: Flat) -> dict[int, str]:
    """Return the triangle ("lower", "upper", "masked") of every slot of `flat` that has one."""
    fact: dict[int, str] = {}  # slot -> "lower" | "upper" | "masked"
    for node in flat.nodes:
        op = node.op
        if node.kind != "op" or op is None:
            continue
        if op.name == "kernel.fused":
            results = _fused_facts(op, [fact.get(a, "") for a in node.ins])
        elif len(node.outs) == 1:
            slot_of = dict(zip(op.operands, node.ins))
            results = [_shape_of(op, lambda v: fact.get(slot_of.get(v, -1), ""))]
        else:
            results = []
        for o, f in zip(node.outs, results):
            if f:
                fact[o] = f
    return fact


def triangular_matmuls(flat: Flat) -> dict[int, str]:
    """Return, by node index, how each triangular `graph.matmul` of `flat` is shaped (`TRIANGLES`):
    a triangular operand, else a result read only on and below its diagonal (`out_lower_matmuls`)."""
    fact = _slot_facts(flat)
    found: dict[int, str] = {}
    for i, node in enumerate(flat.nodes):
        op = node.op
        if node.kind != "op" or op is None or op.name != "graph.matmul" or len(node.ins) != 2:
            continue
        a, b = node.ins
        lhs, rhs = fact.get(a, ""), fact.get(b, "")
        if lhs in ("lower", "upper"):
            found[i] = f"lhs-{lhs}"
        elif rhs in ("lower", "upper"):
            found[i] = f"rhs-{rhs}"
    for i in out_lower_matmuls(flat, fact):
        found.setdefault(i, "out-lower")
    return found


def out_lower_matmuls(flat: Flat, fact: dict[int, str] | None = None) -> list[int]:
    """Return the node indices of the square `graph.matmul`s of `flat` whose result is read only
    on and below its diagonal, so that 0 may stand for every element above it.

    Such a result is used only by a causal mask (any value: it replaces the elements above), by
    a scale whose result is read so, or as the gradient `g` of `softmax_grad(y, g)` with `y`
    lower triangular (`y * (g - sum(y * g))` multiplies every element above by 0) whose result
    is read so; through `kernel.fused` bodies too. Never an output of the step.
    """
    fact = _slot_facts(flat) if fact is None else fact
    uses: dict[int, list[tuple[int, int]]] = {}
    for i, node in enumerate(flat.nodes):
        for pos, a in enumerate(node.ins):
            uses.setdefault(a, []).append((i, pos))
    exported = {slot for _, slot in flat.outputs + flat.assigns}

    def slot_read_lower(slot: int, depth: int = 0) -> bool:
        if slot in exported or depth > 8 or not uses.get(slot):
            return False
        for i, pos in uses[slot]:
            node = flat.nodes[i]
            op = node.op
            if node.kind != "op" or op is None:
                return False
            if op.name == "kernel.fused":
                block = op.body.block  # type: ignore[attr-defined]
                inner = {a: fact.get(s, "") for a, s in zip(block.args, node.ins)}
                if not value_read_lower(block.args[pos], inner, node.outs, depth):
                    return False
            elif not _masks(op, pos, lambda p: fact.get(node.ins[p], ""),
                            lambda: len(node.outs) == 1 and slot_read_lower(node.outs[0], depth + 1)):
                return False
        return True

    def value_read_lower(value: SSAValue, inner: dict[SSAValue, str], outs: tuple[int, ...], depth: int) -> bool:
        """Whether `value` inside a fused body is read only on and below the diagonal."""
        if not value.uses:
            return True
        for use in value.uses:
            op = use.operation
            if op.name == "kernel.yield":
                if not slot_read_lower(outs[use.index], depth + 1):
                    return False
            elif not _masks(op, use.index, lambda p: inner.get(op.operands[p], "") or _inner_fact(op.operands[p], inner),
                            lambda: len(op.results) == 1 and value_read_lower(op.results[0], inner, outs, depth + 1)):
                return False
        return True

    found = []
    for i, node in enumerate(flat.nodes):
        op = node.op
        if (node.kind == "op" and op is not None and op.name == "graph.matmul" and len(node.outs) == 1
                and _square(op.results[0]) and slot_read_lower(node.outs[0])):
            found.append(i)
    return found


def _inner_fact(value: SSAValue, inner: dict[SSAValue, str]) -> str:
    """Return the triangle of a value computed inside a fused body from its block arguments'."""
    op = value.owner
    if not isinstance(op, Operation) or len(op.results) != 1:
        return ""
    return _shape_of(op, lambda v: inner.get(v, "") or _inner_fact(v, inner))


def _masks(op: Operation, pos: int, operand_fact, result_read_lower) -> bool:
    """Return whether `op`, using a value as its operand `pos`, reads it only on and below the
    diagonal (`out_lower_matmuls`); `operand_fact(p)` is operand p's triangle,
    `result_read_lower()` whether `op`'s result is read so."""
    if op.name == "graph.causal_mask":
        return pos == 0 and _square(op.results[0])
    if op.name == "graph.scale":
        return result_read_lower()
    if op.name == "graph.softmax_grad":
        return pos == 1 and _last_dim(op) and operand_fact(0) == "lower" and result_read_lower()
    return False
