"""The calls that perform `comm` ops for one rank over a communicator.

`comm_kernel(op, rank, communicator)` returns a function of NumPy arrays, as the NumPy
kernel makers do for `graph` ops. A `comm.send` starts a non-blocking send (its function's
`pending` lists the requests; the plan's `wait-sends` step waits for them); an exchange over
a stage's virtual devices has `for_microbatch(i)`, the kernel of micro-batch i.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from xdsl.ir import Operation

from hspmd.dialects import comm
from hspmd.ir.devices import RankGroups
from hspmd.ir.types import dtype_name
from hspmd.runtime.comm.base import Communicator


class CommKernelError(Exception):
    """A comm op cannot run on this rank (it is in none of its groups, or it cannot run at all)."""


def contiguous(x: np.ndarray) -> np.ndarray:
    """Return `x` as a C-contiguous array of the same shape (0-d stays 0-d)."""
    return x if x.flags.c_contiguous else x.copy(order="C")


def _group_of(groups: RankGroups, rank: int, op: Operation) -> tuple[int, ...]:
    """Return the group holding `rank`, found from its id (not by a search through the groups)."""
    found = groups.group_holding(rank)
    if found is None:
        raise CommKernelError(f"rank {rank} is in no group of '{op.name}' {groups}")
    return tuple(found)


def comm_kernel(op: Operation, rank: int, communicator: Communicator) -> Callable[..., np.ndarray]:
    """Return the call that performs collective `op` for `rank`."""
    if isinstance(op, comm.SendOp):  # non-blocking: the plan's last step waits for its sends
        dest = comm.pair_partner(op.pairs, rank, "src")
        tag = op.tag_value
        pending: list = []

        def send(x: np.ndarray) -> None:
            if dest is not None:
                pending.append(communicator.isend(x, dest, tag))

        send.pending = pending  # type: ignore[attr-defined]
        return send
    if isinstance(op, comm.RecvOp):
        src = comm.pair_partner(op.pairs, rank, "dst")
        shape, dtype, tag = op.result.type.get_shape(), dtype_name(op.result.type), op.tag_value
        return lambda: communicator.recv(np.empty(shape, dtype), src, tag)
    if isinstance(op, comm.ExchangeOp):
        return _exchange_kernel(op, rank, communicator)
    group = _group_of(op.rank_groups, rank, op)
    match op:
        case comm.AllReduceOp():
            return lambda x: communicator.all_reduce(contiguous(x), group)
        case comm.AllGatherOp():
            d = op.dim.value.data
            return lambda x: communicator.all_gather(contiguous(x), group, d)
        case comm.ReduceScatterOp():
            d = op.dim.value.data
            return lambda x: communicator.reduce_scatter(contiguous(x), group, d)
        case comm.BroadcastOp():
            root = group[op.root.value.data]
            return lambda x: communicator.broadcast(contiguous(x), group, root)
        case comm.AllToAllOp():
            s, c = op.split_dim.value.data, op.concat_dim.value.data
            return lambda x: communicator.all_to_all(contiguous(x), group, s, c)
        case comm.LocalSplitOp():
            d, index, n = op.dim.value.data, group.index(rank), len(group)

            def local_split(x: np.ndarray) -> np.ndarray:
                size = x.shape[d] // n
                return np.ascontiguousarray(np.take(x, np.arange(index * size, (index + 1) * size), axis=d))

            return local_split
        case comm.LocalZeroOp():
            keep = group.index(rank) == 0
            return (lambda x: x) if keep else (lambda x: np.zeros_like(x))
    raise CommKernelError(f"no runtime for '{op.name}'")


def _exchange_kernel(op: comm.ExchangeOp, rank: int, communicator: Communicator,
                     microbatch: int = 0) -> Callable[..., np.ndarray]:
    """Return the call doing `rank`'s transfers of an exchange, in the op's one global order
    (an exchange over a stage's virtual devices: those of its virtual device in `microbatch`,
    all on the rank itself; the kernel's `for_microbatch(i)` gives micro-batch i's)."""
    shape, dtype = op.result.type.get_shape(), dtype_name(op.result.type)
    me = rank
    if op.microbatch_ranks is not None and op.stage_ranks is not None:
        stage = tuple(op.stage_ranks.get_values())
        me = tuple(op.microbatch_ranks.get_values())[microbatch * len(stage) + stage.index(rank)]
    mine = [(s, d, tuple(slice(a, a + n) for a, _, n in r), tuple(slice(b, b + n) for _, b, n in r))
            for s, d, r in op.transfer_list() if me in (s, d)]
    if me != rank and any(s != d for s, d, _, _ in mine):
        raise CommKernelError(f"'{op.name}' over virtual devices moves data between them; only local transfers can run")

    def exchange(x: np.ndarray) -> np.ndarray:
        out = np.zeros(shape, dtype)
        for s, d, sr, dr in mine:
            if s == d:
                out[dr] += x[sr]
            elif s == rank:
                communicator.send(contiguous(x[sr]), d)
            else:
                out[dr] += communicator.recv(np.empty(out[dr].shape, dtype), s)
        return out

    if me != rank:
        exchange.for_microbatch = lambda i: _exchange_kernel(op, rank, communicator, i)  # type: ignore[attr-defined]
    return exchange
