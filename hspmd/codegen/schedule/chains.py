"""Batch chains: runs of steps over one leading batch dim that a runtime may run by slices of it.

Causal attention is, per layer, such a run: the qkv bias add, the scores `q @ k^T` (a batch of
small products), the masked softmax (a row kernel), `p @ v`; in the backward six steps. A runtime that runs every
member on entries `lo:hi` of the batch, then on the next entries, keeps a slice's scores and
probabilities in a core's caches between the members that write and read them
(`hspmd.runtime.cpu.batch_chain`).

A chain is two or more *members* of one leading extent, with only view steps between them:
- a `graph.matmul` of two float32 operands of rank 3 or more with its result's leading dims
  (entry i of the result is the product of entries i);
- a `kernel.fused` whose launches are all row launches over operands shaped as its result, of
  rank 3 or more, or broadcast onto its trailing dims (a bias; `leading_chunks`);
- both writing into preallocated results.
The view steps between them are transposes, reshapes and splits (a runtime computes them first,
on whole arrays: views of results not yet written; it checks that they are views).

Sliced, a member runs entry i before a later member has read every other entry of the values
the chain holds: so the schedule keeps each such value's buffer alive to the chain's end
(`memory._chains`), where one after the other a dead value's buffer could be taken by a later
member's result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hspmd.codegen.schedule.model import SlotType
from hspmd.dialects import graph

#: view steps that may stand between members (a reshape may copy: the runtime checks)
VIEWS = ("graph.transpose", "graph.reshape", "graph.split")

_F32 = np.dtype(np.float32)


def trailing_broadcasts(op) -> list[bool]:
    """Return, per operand of fused op `op`, whether every use of it in the op's body is a
    `graph.broadcast` onto the trailing dims of a value shaped as the op's first result (a bias
    added to every row: a kernel reads it at the column, and inner dims, of the row it computes)."""
    outs = [tuple(v.type.get_shape()) for v in op.outputs]
    flags = []
    for arg in op.body.block.args:
        rank = len(arg.type.get_shape())
        uses = [u.operation for u in arg.uses]
        flags.append(bool(uses) and bool(outs) and all(
            isinstance(u, graph.BroadcastOp) and tuple(u.result.type.get_shape()) == outs[0]
            and list(u.dims.get_values()) == list(range(len(outs[0]) - rank, len(outs[0]))) for u in uses))
    return flags


def leading_chunks(in_types: Sequence, out_types: Sequence, launch_list, scratch,
                   broadcasts: Sequence[bool] = ()) -> bool:
    """Return whether a fused kernel computes each entry of its results' leading dim from the
    same entry of its operands alone, so that it may run on a slice of that dim.

    True for row launches only (each row reads its own row of every operand), every operand and
    result of one shape of rank 3 or more (or a scalar, or an operand marked in `broadcasts`,
    `trailing_broadcasts`, shaped as the result's trailing dims), no scratch. A row launch
    indexes a row by its number within the launch; the kernels' row-dependent terms (a causal
    mask's `r % rows`, a broadcast operand's `(r / inner) % dim`) take it modulo inner dims,
    which divide the rows of one leading entry when the rank is 3 or more, so a launch starting
    at a leading entry sees the same terms. `in_types`, `out_types`: (shape, dtype) pairs."""
    if scratch or not out_types or not launch_list:
        return False
    shape = tuple(out_types[0][0])
    if len(shape) < 3 or shape[0] < 2 or any(tuple(s) != shape for s, _ in out_types):
        return False
    for k, (s, _) in enumerate(in_types):
        s = tuple(s)
        trailing = (k < len(broadcasts) and broadcasts[k] and 0 < len(s) < len(shape)
                    and s == shape[len(shape) - len(s):])
        if s != () and s != shape and not trailing:
            return False
    rows, cols = int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]
    return all(kind == "row" and n0 == rows and n1 == cols for kind, _, n0, n1 in launch_list)


def member_lead(node, types: Sequence[SlotType]) -> int | None:
    """Return the leading extent a step (`Node` or `Step`) would be sliced along as a chain
    member, or None if it cannot be one (whether it writes into preallocated results is the
    caller's to check)."""
    op = node.op
    if node.kind != "op" or op is None or node.microbatch is not None or not node.outs:
        return None
    if op.name == "graph.matmul":
        if len(node.ins) != 2 or len(node.outs) != 1:
            return None
        a, b, r = (types[s] for s in (*node.ins, node.outs[0]))
        if a is None or b is None or r is None or not (len(a[0]) == len(b[0]) == len(r[0]) >= 3):
            return None
        if not (a[0][:-2] == b[0][:-2] == r[0][:-2]) or not (a[1] == b[1] == r[1] == _F32):
            return None
        lead = r[0][0]
    elif op.name == "kernel.fused":
        ins = [types[s] for s in node.ins]
        outs = [types[s] for s in node.outs]
        if any(t is None for t in (*ins, *outs)):
            return None
        if not leading_chunks(ins, outs, op.launch_list, op.scratch_sizes,  # type: ignore[attr-defined]
                              trailing_broadcasts(op)):
            return None
        lead = outs[0][0][0]
    else:
        return None
    return lead if lead >= 2 else None


def find_chains(nodes: Sequence, lead_of: Callable[[int], int | None]) -> list[tuple[int, int]]:
    """Return the chains of `nodes` as (first, last) indices: two or more members of one leading
    extent (`lead_of(i)`, None for a non-member), only view steps between them."""
    chains = []
    i = 0
    while i < len(nodes):
        lead = lead_of(i)
        if lead is None:
            i += 1
            continue
        last, members, j = i, 1, i + 1
        while j < len(nodes):
            s = nodes[j]
            if lead_of(j) == lead:
                last, members = j, members + 1
            elif s.kind == "op" and s.op is not None and s.microbatch is None and s.op.name in VIEWS:
                pass
            else:
                break
            j += 1
        if members >= 2:
            chains.append((i, last))
        i = last + 1
    return chains
