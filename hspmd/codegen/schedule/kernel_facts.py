"""What the schedule may assume of the kernel that computes an op: static facts by op.

`out_facts(op)` says whether the op's kernel writes its results into preallocated `out=`
arrays (so the schedule gives them reused buffers), and whether `out` may be one of its own
operands (so an elementwise chain, or an optimizer update, writes over an operand that dies
there). These are facts of the op, not of a backend: every runtime kernel of the op must
honour them (`hspmd.runtime.numpy_ops`, `optim_kernels`, `kernel_exec` mark their functions
to match, and a test checks that they agree).

`overwrites`:
* "" — `out` must not be an operand's array;
* "first" — `out` may be the first operand's array (the kernel reads each element of it
  before writing that element of `out`);
* "any" — `out` may be any operand's array (NumPy ufuncs: elementwise, any overlap handled).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.ir import Operation

from hspmd.dialects import graph, kernel, optim
from hspmd.ir.types import dtype_name
from hspmd.dialects.interfaces import out_facts_of


@dataclass(frozen=True)
class OutFacts:
    """Whether an op's kernel takes `out=`, and which operands `out` may be (see the module docstring)."""

    takes_out: bool = False
    overwrites: str = ""

    @property
    def inplace_safe(self) -> bool:
        """Return whether `out` may be (at least) the first operand's array."""
        return self.overwrites in ("first", "any")


FRESH = OutFacts()
OUT = OutFacts(True)
FIRST = OutFacts(True, "first")
ANY = OutFacts(True, "any")

_BY_CLASS: dict[type, OutFacts] = {
    # NumPy ufuncs
    graph.AddOp: ANY, graph.SubOp: ANY, graph.MulOp: ANY, graph.DivOp: ANY,
    graph.ExpOp: ANY, graph.LogOp: ANY, graph.SqrtOp: ANY, graph.TanhOp: ANY,
    # elementwise or row-wise kernels that read each element before writing it
    graph.ReluOp: FIRST, graph.ScaleOp: FIRST, graph.RsqrtOp: FIRST, graph.TanhGradOp: FIRST,
    graph.SoftmaxOp: FIRST, graph.LayerNormOp: FIRST, graph.CausalMaskOp: FIRST,
    # kernels that fill out= arrays distinct from their operands
    graph.MatmulOp: OUT, graph.ExpertMatmulOp: OUT, graph.ExpertMatmulRhsGradOp: OUT, graph.MatmulRhsGradOp: OUT, graph.GeluOp: OUT, graph.GeluGradOp: OUT,
    graph.SoftmaxGradOp: OUT, graph.LayerNormGradOp: OUT, graph.ConcatOp: OUT,
    # optimizer updates (elementwise)
    optim.SGDOp: FIRST, optim.AdamOp: FIRST, optim.MulScalarOp: FIRST,
}

#: the facts of a pipeline's micro-batch sum (`graph.add`)
SUM = ANY


def out_facts(op: Operation) -> OutFacts:
    """Return the static facts of `op`'s kernel (FRESH for ops the table does not know)."""
    if callable(getattr(op, "out_facts", None)) or hasattr(op, "OUT_FACTS"):
        return out_facts_of(op)
    match op:
        case graph.ReduceSumOp():  # sums in its own dtype into out=; a cast sum allocates
            same = dtype_name(op.operands[0].type) == dtype_name(op.results[0].type)
            return OUT if same else FRESH
        case graph.PowOp():  # x ** 0.5 is np.sqrt
            return ANY if op.exponent.value.data == 0.5 else FRESH
        case kernel.FusedOp():  # compiled launches over pointers; elementwise ones read before they write
            elementwise = all(kind == "elementwise" for kind, _, _, _ in op.launch_list) and not op.scratch_sizes
            return FIRST if elementwise else OUT
    return _BY_CLASS.get(type(op), FRESH)
