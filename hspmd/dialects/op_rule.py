"""The sharding rule an op gives of itself (`sharding_rule()`), and helpers to write one.

An op is described by *factors* (as in einsum, or Shardy's factor rules): one name per dim of
each operand and result. `matmul` is `[i,k] x [k,j] -> [i,j]`; `k` appears in no result, so it
is a reduction factor and splitting it leaves partial sums. An op is *linear* in some operands
(partial sums may pass through it): jointly (`add`: all partial together) or separately
(`mul`, `matmul`: one operand partial, the others replicated on that axis).
`hspmd.dialects.sharding` infers layouts from these rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from xdsl.ir import Operation


@dataclass(frozen=True)
class OpRule:
    """Factors per dim of each operand and result, linearity and unsplittable factors.

    A factor split on a mesh axis that is missing from a result was summed over for that
    result, which is then partial on that axis (for every result alike: `layer_norm_grad`'s
    dx keeps the batch factors, its dweight and dbias do not and come out partial).
    """

    operands: tuple[tuple[str, ...], ...]
    results: tuple[tuple[str, ...], ...]
    linear: frozenset[int] = frozenset()
    joint: bool = True
    blocked: frozenset[str] = frozenset()
    extents: tuple[tuple[str, int], ...] = ()  # (factor, size): a split degree of it must divide size
    #: factors whose splits are kept first where operands disagree on a mesh axis (a weight's
    #: dims: weights stay where they are, activations are gathered or reduced to meet them, as
    #: Megatron does; a weight gradient keeps the weight's split rather than the sequence's)
    prefer: frozenset[str] = frozenset()
    #: which operand sets the mesh the op runs on, where operands lie on different meshes or
    #: split different factors on one: an operand index, or a factor (the operand splitting it,
    #: the most split first). Operands on another mesh then give their splits to the mesh axes
    #: the leader leaves free. Mixture of experts: the expert weights (split along the expert
    #: dim) lead the expert matmuls, the tokens (split along the batch) lead the combine, so the
    #: reshards between them are all-to-alls of the tokens, never gathers of the weights.
    lead: int | str | None = None


def factors(prefix: str, n: int) -> tuple[str, ...]:
    """Return `n` factor names `prefix0`, `prefix1`, ..."""
    return tuple(f"{prefix}{i}" for i in range(n))


def rank(value) -> int:
    """Return the number of dims of a tensor value."""
    return len(value.type.get_shape())


def elementwise_rule(op: Operation, linear: frozenset[int] = frozenset()) -> OpRule:
    """Return the rule of an elementwise op: every operand and the result share the dims' factors."""
    d = factors("d", rank(op.results[0]))
    return OpRule(tuple(d for _ in op.operands), (d,), linear)


def last_dim_rule(op: Operation, operands_full: Sequence[bool], results_full: Sequence[bool],
                  linear: frozenset[int] = frozenset()) -> OpRule:
    """Return the rule of an op normalising over the last dim `n` of x [..., n] (blocked), with
    [n]-shaped operands/results where `*_full` is False (their leading dims are reductions)."""
    lead = factors("b", rank(op.operands[0]) - 1)
    full, vec = (*lead, "n"), ("n",)
    return OpRule(
        tuple(full if f else vec for f in operands_full),
        tuple(full if f else vec for f in results_full),
        linear,
        blocked=frozenset({"n"}),
    )
