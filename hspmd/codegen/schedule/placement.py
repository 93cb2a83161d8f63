"""Matmul results written in the layout their consumer needs: no copy for a reshape or a concat.

Attention computes each head's product as a batched matmul over (batch, head, row, col), then
moves the head next to the columns: `transpose` (a view), and then either `reshape` to
(batch, row, head * col) — which copies, the view not being contiguous — or, in the backward,
`concat` of the q, k and v gradients along the last dim, which copies each operand. Both copies
go away when the matmul writes its result straight into the memory the consumer reads:

* **reshape**: the matmul's own buffer holds the transposed value C-contiguously; the matmul
  gets a transposed view of it as `out=` (BLAS writes strided rows as fast), the transpose
  chain then yields a contiguous view and the reshape is a view too.
* **concat**: each operand that is a matmul's result seen through transposes is written by
  that matmul into its part of the concat's own buffer (a slice along the concat dim,
  transposed back); the concat kernel then finds each operand already in place and copies
  nothing (`graph.concat`'s kernel checks that it is the very same view).

* **stack**: a scan's stacked result (`graph.scan`, the iterations' values one slice each):
  each iteration's value that only the stack reads is written by its op straight into its
  slice of the stack's buffer (`at`); the stack then copies nothing.

Only (reshape and concat) results whose rows stay rows qualify (BLAS writes a matrix's rows at any stride, but not
its columns; computing the transposed product `b^T a^T` instead gave other bits on small
shapes), except the products the runtime computes by triangular blocks (`triangular.py`): there
the kernel computes `b^T a^T` into such a result, with the same bits on attention's shapes
(tests/test_triangular.py), so attention's k gradient is written into the concat as well;
and only single-use chains: the matmul's result and every transposed view between it
and the consumer are used once (by the next transpose or the consumer), and none is a
program output or assign, so nothing else ever sees the different layout. Values and bits
are unchanged: the same products, written elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hspmd.codegen.schedule.flatten import Flat


@dataclass(frozen=True)
class Placement:
    """Where a matmul's result lives: in the buffer of slot `host` (the matmul's own result,
    or the concat it feeds), which holds a C-contiguous array of `stored` shape; the result is
    `stored[select].transpose(perm)`, `select` being (dim, start, stop) of a slice or None."""

    host: int
    stored: tuple[int, ...]
    select: tuple[int, int, int] | None
    perm: tuple[int, ...]
    #: the result is slice `at` of `stored` along its leading dim (a stack's iteration), else None
    at: int | None = None


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def placements(flat: Flat, pooled: Callable[[int], bool],
               triangles: Mapping[int, str] | None = None) -> dict[int, Placement]:
    """Return the placement of every matmul result slot written in its consumer's layout.

    `pooled(i)` says whether node i writes its results into schedule buffers (`out=`): both
    the matmul and a concat consumer must. `triangles` (node index -> `triangular.TRIANGLES`)
    are the matmuls whose runtime kernel computes a result laid out by columns as the
    transposed product (`runtime.triangular_matmul`): those may be placed with their columns
    strided (attention's k gradient, `q^T @ ds` seen transposed, into the concat).
    """
    triangles = triangles or {}
    nodes, types = flat.nodes, flat.types
    uses = [0] * len(types)
    producer: dict[int, int] = {}
    for i, node in enumerate(nodes):
        for a in node.ins:
            uses[a] += 1
        for o in node.outs:
            producer[o] = i
    exported = {slot for _, slot in flat.outputs + flat.assigns}
    for slot in exported:
        uses[slot] += 2  # never re-laid out: the caller reads it

    def op_name(slot: int) -> str:
        i = producer.get(slot)
        op = nodes[i].op if i is not None else None
        return op.name if op is not None and nodes[i].kind == "op" else ""

    def matmul_behind(x: int) -> tuple[int, tuple[int, ...]] | None:
        """Return (matmul result slot m, perm B) with m = x.transpose(B), through single-use
        transposes (at least one), or None."""
        perm = tuple(range(len(types[x][0])))  # type: ignore[index]
        cur, steps = x, 0
        while op_name(cur) == "graph.transpose":
            node = nodes[producer[cur]]
            p = tuple(node.op.perm.get_values())  # type: ignore[union-attr]
            perm = tuple(p[q] for q in perm)
            cur = node.ins[0]
            steps += 1
            if uses[cur] != 1:
                return None
        i = producer.get(cur)
        if steps == 0 or op_name(cur) != "graph.matmul" or len(nodes[i].outs) != 1 or not pooled(i):  # type: ignore[arg-type]
            return None
        back = _inverse(perm)  # the result is stored.transpose(back)
        if len(back) < 2:
            return None
        if back[-1] != len(back) - 1:  # BLAS writes rows at a stride, not columns,
            if back[-2] != len(back) - 1 or i not in triangles:  # unless the kernel computes b^T a^T
                return None
        return cur, back

    found: dict[int, Placement] = {}
    for i, node in enumerate(nodes):
        if node.kind == "stack" and pooled(i) and node.outs[0] not in exported:
            host = node.outs[0]
            for k, x in enumerate(node.ins):
                p = producer.get(x)
                if (p is not None and uses[x] == 1 and x not in exported and nodes[p].kind == "op" and pooled(p)
                        and x not in found and node.ins.count(x) == 1):
                    found[x] = Placement(host, types[host][0], None, tuple(range(len(types[x][0]))), k)  # type: ignore
            continue
        name = node.op.name if node.op is not None and node.kind == "op" else ""
        if name == "graph.reshape":
            x = node.ins[0]
            behind = matmul_behind(x)
            if behind is not None:
                m, perm = behind
                found[m] = Placement(m, types[x][0], None, perm)  # type: ignore[index]
        elif name == "graph.concat" and pooled(i) and len(set(node.ins)) == len(node.ins) and node.outs[0] not in exported:
            d = node.op.dim.value.data  # type: ignore[union-attr]
            host = node.outs[0]
            start = 0
            for x in node.ins:
                width = types[x][0][d]  # type: ignore[index]
                behind = matmul_behind(x) if uses[x] == 1 else None
                if behind is not None:
                    m, perm = behind
                    found[m] = Placement(host, types[host][0], (d, start, start + width), perm)  # type: ignore[index]
                start += width
    return found
