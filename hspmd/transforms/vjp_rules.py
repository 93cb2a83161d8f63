"""Gradient rules for the `autodiff` pass: each op's own `vjp`, and where backward ops go.

`vjp(op, gs, emit)` returns, per operand, a maker of that operand's gradient given the
gradients `gs` of the op's results (one per result, None where a result has no gradient);
`emit` inserts the backward ops. Makers are called only for operands that need a gradient,
so no dead backward ops appear. The rules stand beside the ops (`vjp` methods, see
`hspmd/dialects/interfaces.py`); backward ops are mostly dedicated `*_grad` ops (one op per
forward op, possibly with several results, such as `layer_norm_grad` -> dx, dweight, dbias),
which NumPy runs fast and a fuser can take whole.
"""

from __future__ import annotations

from collections.abc import Sequence

from xdsl.ir import Operation, SSAValue

from hspmd.dialects.interfaces import Thunk, has_vjp, no_vjp_reason
from hspmd.transforms.util import PassError


class Emitter:
    """Inserts ops before the step function's return and hands back their results."""

    def __init__(self, before: Operation) -> None:
        self.before = before

    def __call__(self, op: Operation) -> SSAValue:
        self.before.parent_block().insert_op_before(op, self.before)  # type: ignore[union-attr]
        return op.results[0] if op.results else None  # type: ignore[return-value]


def vjp(op: Operation, gs: Sequence[SSAValue | None], emit: Emitter) -> list[Thunk | None]:
    """Return, per operand of `op`, a maker of its gradient given the result gradients `gs`.

    `gs[i]` is the gradient of result i, None where it has none (not all None). Makers are
    called only for operands that need a gradient, so no dead backward ops appear.
    """
    if not has_vjp(op):
        why = no_vjp_reason(op)
        raise PassError(f"autodiff: no gradient rule for '{op.name}'" + (f" ({why})" if why else ""))
    return op.vjp(gs, emit)  # type: ignore[attr-defined]
