"""Tensor parallelism over dims that tp does not divide: uneven pieces inside a group.

`[0,1]: tp=2` over a GPT of 3 heads cannot give each tp rank the same number of heads. HSPMD's
layouts already carry unequal slices between groups (`hetero=split(d)` with `shares`), so a
group whose tensor-parallel dims tp does not divide is laid out as a union of *tp sub-groups*:
sub-group t holds the devices at tp coordinate t (one per dp rank; the mesh is dp major, tp
minor), and

* a tensor-parallel weight is split across the sub-groups (`hetero=split(d)`) by shares, and
  replicated inside each (`dup=dp`): a column weight along its output dim 1, a row weight along
  its input dim 0, a column weight's bias along dim 0;
* the shares are the heads each tp rank holds, `apportion(H, (1,)*tp)` (3 heads over tp=2:
  2:1), for a weight whose output (or, for a row weight, whose input) is cut into H heads, and
  equal shares (`1:1:...`, largest remainder: 10 columns over tp=3 are 4, 3 and 3) otherwise;
  a dim of H*k entries is then cut at head boundaries, so attention runs head-parallel;
* everything else (replicated weights, the batch) is `hetero=dup`, split over dp inside each
  sub-group as usual.

`[0-3]: dp=2 tp=2` over 3 heads: column weight `[0,2]: dup=2 | [1,3]: dup=2 ; hetero=split(1),
shares=2:1`, batch `[0,2]: split(0)=2 | [1,3]: split(0)=2 ; hetero=dup`.

The rest is the machinery of heterogeneous groups: the sharding rules carry the split across
the sub-groups through the column matmul and the heads reshape (`_apportion_carries`), the row
matmul leaves partial sums across them (`hetero=partial`), and reshard lowering all-reduces
those over the devices at the same position of each sub-group, whose pieces then have the same
shape on every rank. `specialize-groups` makes one program per sub-group (local shapes differ
where the pieces do); the checkpoint writer and reader work from the layouts, so they handle
the uneven pieces like any hetero split. A weight whose pieces do not line up with its
consumer's (say two head counts in one block; no example model has one) is resharded where they
meet, as propagation does for any layouts: equal results, at the cost of communication.
`apply-strategy` also lays each row-parallel output whose dim 0 is the batch out like the batch,
so its partial sums are all-reduced straight into rows split over dp.

The even case is untouched: a group whose tensor-parallel dims tp divides keeps its one-group
layouts (`split(d)=tp`), bit for bit as before.
"""

from __future__ import annotations

from collections.abc import Mapping

from hspmd.ir.layout import DUP, DistributedStates, Group, Layout, apportion, split
from hspmd.ir.strategy import StrategyGroup

#: the dim of a parameter that tp splits, by its tensor-parallel role (apply_strategy's roles)
SPLIT_DIM = {"column": 1, "row": 0, "column-bias": 0}


def tp_subgroups(group: StrategyGroup) -> tuple[tuple[int, ...], ...]:
    """Return the devices at each tp coordinate of `group` (dp major, tp minor), by coordinate.

    >>> from hspmd.ir.strategy import parse_strategy
    >>> tp_subgroups(parse_strategy("[0-3]: dp=2 tp=2").groups[0])
    ((0, 2), (1, 3))
    """
    d = group.devices
    return tuple(tuple(d[i * group.tp + t] for i in range(group.batch_ranks)) for t in range(group.tp))


def head_shares(heads: int, tp: int) -> tuple[int, ...]:
    """Return how many of `heads` heads each of `tp` ranks holds: as equal as can be, the extra ones first.

    >>> head_shares(3, 2), head_shares(5, 3), head_shares(4, 2)
    ((2, 1), (2, 2, 1), (2, 2))
    """
    return apportion(heads, (1,) * tp)


def needs_uneven(shapes: Mapping[str, tuple[int, ...]], roles: Mapping[str, str],
                 heads: Mapping[str, int], tp: int) -> bool:
    """Return whether some tensor-parallel dim (a weight's split dim, or a head count) is not divisible by tp."""
    for name, role in roles.items():
        dim = SPLIT_DIM.get(role)
        if dim is not None and len(shapes[name]) > dim and shapes[name][dim] % tp:
            return True
    return any(h % tp for h in heads.values())


def weight_shares(name: str, heads: Mapping[str, int], tp: int) -> tuple[int, ...]:
    """Return the shares a tensor-parallel weight is split by: heads per rank if it is cut into heads, else equal."""
    h = heads.get(name)
    return head_shares(h, tp) if h is not None else (1,) * tp


def replicated_layout(group: StrategyGroup) -> Layout:
    """Return the layout of a replicated parameter over the tp sub-groups (`hetero=dup`)."""
    return Layout(tuple(Group(s, DistributedStates.of((DUP, group.batch_ranks))) for s in tp_subgroups(group)), DUP)


def batch_layout(group: StrategyGroup) -> Layout:
    """Return the layout of a batch input over the tp sub-groups: split over dp in each, `hetero=dup`."""
    return Layout(tuple(Group(s, DistributedStates.of((split(0), group.batch_ranks))) for s in tp_subgroups(group)),
                  DUP)


def weight_layout(group: StrategyGroup, role: str, shares: tuple[int, ...]) -> Layout:
    """Return the layout of a tensor-parallel weight: split across the tp sub-groups by `shares`, dup in each."""
    subs = tp_subgroups(group)
    return Layout(tuple(Group(s, DistributedStates.of((DUP, group.batch_ranks))) for s in subs),
                  split(SPLIT_DIM[role]), shares)
