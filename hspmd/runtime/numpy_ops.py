"""The NumPy kernels of the ops, bound to a rank: the reference every other backend is tested against.

Every `graph` and `optim` op gives its own kernel beside its definition (`numpy_kernel`, see
`hspmd/dialects/interfaces.py`); `kernel_for` makes it for one rank, with the runtime's compiled
helpers (`hspmd.runtime.cpu.native`: the embedding gradient's scatter-add of rows, the clipping's sum
of squares) where the op's kernel can use them. The kernel is made once, when the plan is built,
and is a function of the operand arrays (several results: a tuple), so no xDSL object is touched
while steps run.

Kernels marked `takes_out` (`interfaces.takes_out`, `rowwise`, ...) also accept `out=` (an
array of the result's shape and dtype, or a tuple of them for several results): they fill it
and return it. The plan hands them buffers it reuses from step to step; NumPy ufuncs (np.add,
np.exp, ...) take `out=` natively. Which ops get buffers is decided with the schedule from the
ops' `OUT_FACTS` (`hspmd.codegen.schedule.kernel_facts`), which must say what these markers say
(a test checks it). View ops (transpose, broadcast, split, slice, reshape) return views of their
operand, not copies: the schedule tracks the aliasing.
"""

from __future__ import annotations

from collections.abc import Callable

from xdsl.ir import Operation

from hspmd.dialects.interfaces import HasNumpyKernel, KernelContext
from hspmd.runtime.cpu import native

__all__ = ["kernel_for"]


def kernel_for(op: Operation, rank: int = 0) -> Callable:
    """Return the NumPy function that computes `op` from its operand arrays on `rank`.

    Most kernels ignore the rank; ops whose values depend on where a piece lies in the global
    tensor (counter-based dropout, a split vocabulary, iota) use it with the op's `global_type`.
    """
    if not isinstance(op, HasNumpyKernel):
        raise NotImplementedError(f"no NumPy kernel for '{op.name}'")
    return op.numpy_kernel(KernelContext(rank, native))
