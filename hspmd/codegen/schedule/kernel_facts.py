"""What the schedule may assume of the kernel that computes an op: its `out=` facts.

`out_facts(op)` says whether the op's kernel writes its results into preallocated `out=`
arrays (so the schedule gives them reused buffers), and whether `out` may be one of its own
operands (so an elementwise chain, or an optimizer update, writes over an operand that dies
there). These are facts of the op, not of a backend: each op declares them beside its
definition (`OUT_FACTS`, or `out_facts()` where they depend on its attributes; see
`hspmd/dialects/interfaces.py`), and every runtime kernel of the op must honour them (its
NumPy kernel's markers, `kernel_exec`'s compiled launches; a test checks that they agree).
An op that declares none writes fresh arrays (`FRESH`).
"""

from __future__ import annotations

from xdsl.ir import Operation

from hspmd.dialects.interfaces import ANY, FIRST, FRESH, OUT, OutFacts, out_facts_of

__all__ = ["ANY", "FIRST", "FRESH", "OUT", "OutFacts", "SUM", "out_facts"]

#: the facts of a pipeline's micro-batch sum (`graph.add`)
SUM = ANY


def out_facts(op: Operation) -> OutFacts:
    """Return the static facts of `op`'s kernel (FRESH for an op that declares none)."""
    return out_facts_of(op)
