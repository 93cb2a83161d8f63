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
"lhs-upper", "rhs-lower" or "rhs-upper". The runtime (`hspmd.runtime.triangular_matmul`)
then multiplies by blocks over the operand's non-zero part only (5/8 of the work at 128 x 128).
The terms left out are exact zeros added to a dot product, so the values are those of the
full product wherever the operands are finite; on attention's shapes the bits too (tested;
for some other shapes OpenBLAS picks another kernel for a block: other last bits). A CPU
schedule choice: the IR is unchanged, and the CUDA backend runs its own (full) products.

The other two products, the scores `q @ k^T` and the probabilities' gradient `dy @ v^T`, are
read only below the diagonal, but computing them by blocks did not pay: the blocks go to
OpenBLAS's small-matrix kernel, which for these transposed operands was slower on one thread
(2.7 against 2.2 ms for a layer's 64 heads) and adds in another order (other last bits); with
`k^T` copied contiguous first, the bits were the full product's but the gain small (2.13 against
1.95 ms with the copy).
"""

from __future__ import annotations

import math

from xdsl.ir import Operation, SSAValue

from hspmd.codegen.schedule.flatten import Flat

#: how a matmul's operands or result are triangular (see the module docstring)
TRIANGLES = ("lhs-lower", "lhs-upper", "rhs-lower", "rhs-upper")

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


def triangular_matmuls(flat: Flat) -> dict[int, str]:
    """Return, by node index, how each triangular `graph.matmul` of `flat` is shaped (`TRIANGLES`)."""
    fact: dict[int, str] = {}  # slot -> "lower" | "upper" | "masked"
    for i, node in enumerate(flat.nodes):
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
    return found

