"""Walking chains of kernels in a GPU program (the kernel level after `device-kernels`): what a
kernel computes, the runs of kernels between two values (casts looked through), dropouts and
products found through them. The matching helpers of `flash-attention`."""

from __future__ import annotations

from xdsl.ir import Operation, SSAValue

from hspmd.dialects import graph, kernel
from hspmd.dialects.cuda_c import float_kind
from hspmd.dialects.graph.base import whole_piece


def members(op: Operation | None) -> list[Operation]:
    """Return the ops a kernel computes (its body), or [op] for an op that is not a kernel."""
    if op is None:
        return []
    if isinstance(op, kernel.FusedOp):
        return [o for o in op.body.block.ops if not isinstance(o, kernel.YieldOp)]
    return [op]


def owner(v: SSAValue) -> Operation | None:
    return v.owner if isinstance(v.owner, Operation) else None


def chain(op: Operation | None, names: list[str]) -> list[Operation] | None:
    """Return the member ops of `op` where it is a one-input, one-output kernel (or a lone op)
    computing a chain of ops named `names` (in this order, each reading the last), else None."""
    if op is None or len(op.results) != 1:
        return None
    ms = members(op)
    if [m.name for m in ms] != names:
        return None
    if isinstance(op, kernel.FusedOp):
        if len(op.operands) != 1:
            return None
        prev: SSAValue = op.body.block.args[0]
        for m in ms:
            if m.operands[0] is not prev or any(o is not prev for o in m.operands[1:]):
                return None
            prev = m.results[0]
        if op.body.block.last_op.operands[0] is not prev:  # type: ignore[union-attr]
            return None
    return ms


def swapped(v: SSAValue) -> SSAValue | None:
    """Return x where `v` is x with its last two dims swapped (a transpose, or a kernel of one)."""
    op = owner(v)
    ms = chain(op, ["graph.transpose"])
    if not ms:
        return None
    perm = list(ms[0].perm.get_values())  # type: ignore[attr-defined]
    n = len(perm)
    return op.operands[0] if n >= 2 and perm == [*range(n - 2), n - 1, n - 2] else None  # type: ignore[union-attr]


def dropout(v: SSAValue) -> tuple[SSAValue, SSAValue, graph.DropoutOp] | None:
    """Return (x, step, the dropout) where `v` is a dropout kernel's result: rate > 0, the whole
    tensor on the rank (its mask's indices are the tensor's own), not a micro-batch's."""
    op = owner(v)
    if op is None or len(op.results) != 1 or [m.name for m in members(op)] != ["graph.dropout"]:
        return None
    (d,) = members(op)
    assert isinstance(d, graph.DropoutOp)
    if d.rate.value.data <= 0.0 or d.microbatches is not None or not whole_piece(d):
        return None
    if isinstance(op, kernel.FusedOp) and [o for o in d.operands] != list(op.body.block.args):
        return None
    return op.operands[0], op.operands[1], d


def same_dropout(a: graph.DropoutOp | None, b: graph.DropoutOp | None) -> bool:
    if a is None or b is None:
        return a is b
    return all(getattr(a, k).value.data == getattr(b, k).value.data for k in ("rate", "seed", "salt"))


def is_matmul(op: Operation | None) -> bool:
    return op is not None and op.name == "graph.matmul"


def shape(v: SSAValue) -> tuple[int, ...]:
    return tuple(v.type.get_shape())  # type: ignore[attr-defined]


#: the storage types whose chains the pass fuses (the kernels compute in float32 for all)
_FLOAT_KINDS = ("f32", "bf16", "f16")


def kind(v: SSAValue) -> str | None:
    """Return "f32", "bf16" or "f16" for a tensor of that element type, else None."""
    k = float_kind(v.type, reduced=True)
    return k if k in _FLOAT_KINDS else None


def kernel_links(op: Operation, allowed: tuple[str, ...]) -> list[Operation] | None:
    """Return the member ops of `op` where it is a one-input, one-output kernel (or a lone op)
    whose ops each read the last (a chain) and are all named in `allowed`, else None."""
    if op is None or len(op.results) != 1 or len(op.operands) != 1:
        return None
    ms = members(op)
    if not ms or any(m.name not in allowed for m in ms):
        return None
    return chain(op, [m.name for m in ms])


def peel_casts(v: SSAValue) -> tuple[SSAValue, list[Operation]]:
    """Return (x, the cast kernels) where `v` is float value x cast (once or more) between float
    types, each cast read by the next only: a 16-bit program's softmax and its gradient compute
    in float32 between casts from and to the 16-bit type; (v, []) where it is not a cast."""
    casts: list[Operation] = []
    while (op := owner(v)) is not None and kernel_links(op, ("graph.cast",)) is not None \
            and kind(op.operands[0]) is not None and (not casts or len(list(v.uses)) == 1):
        casts.append(op)
        v = op.operands[0]
    return v, casts


def run_back(v: SSAValue, allowed: tuple[str, ...]) -> tuple[SSAValue, list[Operation], list[Operation]]:
    """Walk back from `v` through chain kernels of ops in `allowed` (and casts), each read only by
    the next; return (the first one's input, the kernels in program order, their member ops)."""
    kernels: list[Operation] = []
    while (op := owner(v)) is not None and kernel_links(op, (*allowed, "graph.cast")) is not None \
            and (not kernels or len(list(v.uses)) == 1):
        kernels.insert(0, op)
        v = op.operands[0]
    return v, kernels, [m for k in kernels for m in members(k)]


def run_forward(v: SSAValue, allowed: tuple[str, ...]) -> tuple[SSAValue, list[Operation], list[Operation]]:
    """Walk on from `v` through chain kernels of ops in `allowed` (and casts), each the only
    reader of the last's result; return (the last one's result, the kernels, their member ops)."""
    kernels: list[Operation] = []
    while (user := single_use(v)) is not None and kernel_links(user, (*allowed, "graph.cast")) is not None:
        kernels.append(user)
        v = user.results[0]
    return v, kernels, [m for k in kernels for m in members(k)]


def named(ms: list[Operation]) -> list[str]:
    """Return the names of member ops `ms`, the casts left out."""
    return [m.name for m in ms if m.name != "graph.cast"]


def single_use(v: SSAValue) -> Operation | None:
    """Return the op that uses `v`, where exactly one does."""
    uses = list(v.uses)
    return uses[0].operation if len(uses) == 1 else None
