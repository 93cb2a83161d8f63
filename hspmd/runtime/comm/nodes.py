"""Collectives over several nodes in two tiers: inside each node, then once across (Hetu v2's
hierarchical annotations, docs/gpus.md's pricing).

A group that spans nodes sums its gradients flat today: every member exchanges pieces with every
other, so each byte crosses between nodes about as often as the group has members on other
nodes. `two_tier_all_reduce` sends each node's 1/g of the buffer across once (g ranks per node):

1. inside each node the members trade pieces (an all-to-all): local rank i gets piece i of every
   local member;
2. across the nodes, in group order, the owners of piece i pass one running sum along: node k's
   owner adds its members' pieces, in their order, to what node k-1's owner sent, and sends it
   on; the last node's owner has piece i of the sum and sends it back to the other nodes' owners
   (in chunks, pipelined: both directions of the link carry data at once);
3. inside each node the members gather the summed pieces (an all-gather).

The sum is the left fold in group order, the same bits as the flat form (`base.fold_sum`),
because the running sum visits the members in group order: that needs each node's members to be
one run of the group, and the nodes alike in size. Where they are not, the flat form runs.
Cross-node bytes per rank: 1/g of the buffer out (and in), against about 2 (n - g) / n of it flat.

`NodeCommunicator` runs a communicator's all-reduces over groups that span nodes in two tiers
(`hspmd run --ranks-per-node K` simulates nodes of K ranks on one machine; else the hosts say).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hspmd.runtime.comm.base import Communicator, Group, Request, as_buffer, chunk_bounds, fold_sum
from hspmd.runtime.comm.forward import Forwarding

__all__ = ["NodeCommunicator", "node_aware", "node_blocks", "nodes_of", "two_tier_all_reduce"]

TAG_CHAIN, TAG_BACK = 29201, 29202


def nodes_of(hosts: Sequence[str], ranks_per_node: int | None = None) -> list[int]:
    """Return each rank's node: rank // `ranks_per_node` where given (simulated nodes), else the
    index of its host among the hosts in order of first appearance."""
    if ranks_per_node:
        return [r // int(ranks_per_node) for r in range(len(hosts))]
    order: dict[str, int] = {}
    return [order.setdefault(h, len(order)) for h in hosts]


def node_blocks(group: Sequence[int], node_of: Sequence[int]) -> list[tuple[int, ...]] | None:
    """Return `group` cut into its nodes' runs of members, in group order, where the two-tier form
    gives the flat form's bits: two nodes or more, each one run, all of one size; else None."""
    blocks: list[list[int]] = []
    for r in group:
        if blocks and node_of[blocks[-1][-1]] == node_of[r]:
            blocks[-1].append(r)
        else:
            blocks.append([r])
    nodes = [node_of[b[0]] for b in blocks]
    if len(blocks) < 2 or len(set(nodes)) != len(nodes) or len({len(b) for b in blocks}) != 1:
        return None
    return [tuple(b) for b in blocks]


#: bytes per message of the pipelined pass across nodes (a piece is sent in up to `MAX_CHUNKS` of them)
CHUNK_BYTES = 256 * 1024
MAX_CHUNKS = 8


def two_tier_all_reduce(comm: Communicator, buf: np.ndarray, blocks: Sequence[tuple[int, ...]],
                        out: np.ndarray | None = None) -> np.ndarray:
    """Return the sum of the members' `buf` over the ranks of `blocks` (a group cut into its nodes,
    `node_blocks`), in two tiers (see the module docstring): the bits of the flat left fold.

    The pass across nodes is pipelined: each piece goes in chunks, so that the last node sends
    chunk q back while chunk q + 1 is on its way to it (both directions of the link busy)."""
    buf = as_buffer(buf, "all_reduce")
    me = comm.rank
    k = next(j for j, b in enumerate(blocks) if me in b)
    node, i, g = blocks[k], blocks[k].index(me), len(blocks[k])
    flat = np.ascontiguousarray(buf).reshape(-1)
    bounds = chunk_bounds(flat.size, g)
    width = max(1, max(bounds[j + 1] - bounds[j] for j in range(g)))
    pieces = np.zeros((g, width), dtype=buf.dtype)
    for j in range(g):
        pieces[j, :bounds[j + 1] - bounds[j]] = flat[bounds[j]:bounds[j + 1]]
    mine = comm.all_to_all(pieces, node, 0, 0) if g > 1 else pieces  # row m: local member m's piece i
    running = _across_nodes(comm, [mine[m] for m in range(g)], blocks, k, i)
    summed = comm.all_gather(running[None, :], node, 0) if g > 1 else running[None, :]
    result = np.concatenate([summed[j, :bounds[j + 1] - bounds[j]] for j in range(g)]).reshape(buf.shape)
    if out is None:
        return result
    np.copyto(out, result)
    return out


def _across_nodes(comm: Communicator, rows: list[np.ndarray], blocks: Sequence[tuple[int, ...]], k: int,
                  i: int) -> np.ndarray:
    """Return piece i of the sum, from this node's members' `rows` (node k of `blocks`): the running sum
    passed along the owners of piece i, node by node, in chunks, and sent back from the last node."""
    width = rows[0].size
    chunks = max(1, min(MAX_CHUNKS, width * rows[0].itemsize // CHUNK_BYTES))
    cuts = chunk_bounds(width, chunks)
    last = len(blocks) - 1
    running = np.empty(width, dtype=rows[0].dtype)
    sends = []
    for a, b in zip(cuts, cuts[1:]):
        part = [r[a:b] for r in rows]
        if k > 0:
            part.insert(0, comm.recv(np.empty(b - a, dtype=running.dtype), blocks[k - 1][i], TAG_CHAIN))
        fold_sum(part, out=running[a:b])
        targets = [blocks[k + 1][i]] if k < last else [blk[i] for blk in blocks[:-1]]
        sends += [comm.isend(running[a:b], t, TAG_CHAIN if k < last else TAG_BACK) for t in targets]
    if k < last:
        for a, b in zip(cuts, cuts[1:]):
            comm.recv(running[a:b], blocks[last][i], TAG_BACK)
    for req in sends:
        req.wait()
    return running


class NodeCommunicator(Forwarding):
    """`inner`, with all-reduces over groups that span nodes (`node_of`: each rank's node) run in two
    tiers where that gives the flat bits (`node_blocks`); `form="flat"` keeps them flat (to compare)."""

    def __init__(self, inner: Communicator, node_of: Sequence[int], form: str = "two-tier") -> None:
        super().__init__(inner)
        if form not in ("two-tier", "flat"):
            raise ValueError(f"unknown collective form {form!r} (two-tier or flat)")
        self.node_of, self.form = tuple(node_of), form
        self._blocks: dict[Group, list[tuple[int, ...]] | None] = {}

    def blocks(self, group: Group) -> list[tuple[int, ...]] | None:
        """Return the nodes' runs of `group` where its all-reduce runs in two tiers, else None."""
        group = tuple(group)
        if group not in self._blocks:
            self._blocks[group] = node_blocks(group, self.node_of) if self.form == "two-tier" else None
        return self._blocks[group]

    def all_reduce(self, buf: np.ndarray, group: Group, out: np.ndarray | None = None) -> np.ndarray:
        blocks = self.blocks(group)
        if blocks is None:
            return self.inner.all_reduce(buf, group, out)
        buf, _ = self.check_all_reduce(buf, group, out)
        return two_tier_all_reduce(self.inner, buf, blocks, out)

    def iall_reduce(self, buf: np.ndarray, group: Group, out: np.ndarray | None = None) -> Request:
        """A group across nodes sums at the start, in two tiers (its tiers are not overlapped with the
        caller's work yet); others as `inner` does."""
        if self.blocks(group) is None:
            return self.inner.iall_reduce(buf, group, out)
        return Request(self.all_reduce(buf, group, out))


#: a switch for comparisons (benchmarks/hier_allreduce.py): `flat` keeps all-reduces across nodes flat
FORM_VARIABLE = "HSPMD_NODE_COLLECTIVES"


def node_aware(comm: Communicator, hosts: Sequence[str] | None, ranks_per_node: int | None = None,
               env=None) -> Communicator:
    """Return `comm`, as a `NodeCommunicator` where its ranks are on several nodes (`nodes_of`: the
    `hosts`, one per rank, or `ranks_per_node`), with the link between them slowed where
    `HSPMD_SLOW_LINK` says (`slow_link.SlowLinks`); `comm` itself on one node."""
    import os

    from hspmd.runtime.comm.slow_link import SlowLinks, link_from_env

    env = os.environ if env is None else env
    if comm.size < 2 or (hosts is None and not ranks_per_node):
        return comm
    node_of = nodes_of(list(hosts) if hosts is not None else [""] * comm.size, ranks_per_node)
    if len(set(node_of)) < 2:
        return comm
    link = link_from_env(env)
    inner = SlowLinks(comm, node_of, *link) if link is not None else comm
    return NodeCommunicator(inner, node_of, env.get(FORM_VARIABLE) or "two-tier")
