"""Bucketed, overlapped all-reduces: which `comm.all_reduce` ops of a flat program share a bucket.

The compiler places the gradient all-reduces of data parallelism after the backward pass,
one per gradient. `plan_buckets` rewrites the flat node list of a schedule so that

* all-reduces over the same group and dtype whose operands become ready one after the other
  share a *bucket*: one flat buffer of at most `bucket_bytes` (a larger tensor gets a bucket
  of its own);
* a bucket *starts* (copies its operands into its buffer and starts a non-blocking
  all-reduce in place) right after the node that computes its last operand; a kernel whose
  result only feeds the all-reduce writes it straight into the bucket (`out=` a view of the
  bucket's buffer), so that gradient is not copied; and is *waited on* just before the first
  node that reads one of its results (the results are views of the bucket's buffer);
* between start and wait, a light *poll* node after each kernel lets the buckets in flight
  progress, so MPI moves the transfers while the backward pass computes;
* a bucket with no other kernel between its start and its wait (a tensor-parallel
  all-reduce read by the next op, say) is not made: its all-reduces stay blocking, which
  is faster when nothing can overlap them.

The runtime's buckets (`hspmd.runtime.buckets.Bucket`) sum with the communicator's
`iall_reduce` (the bits of `all_reduce`: left folds in group order), and an element's sum
does not depend on its neighbours, so bucketing changes no result. The order in which
buckets start is a function of the program alone, so every member of a group starts them in
the same order. Only all-reduces whose group lies inside the program's own devices are
bucketed (their members run this same program); the others run where the program has them.
The rewrite happens when the schedule is built, so the IR, and the passes after
`PHYSICAL_PIPELINE` (pipeline-split) see plain `comm.all_reduce` ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hspmd.codegen.schedule.flatten import Flat, Node
from hspmd.codegen.schedule.model import BucketSpec, ScheduleError
from hspmd.dialects import comm


def group_of(groups: tuple[tuple[int, ...], ...], rank: int, op) -> tuple[int, ...]:
    """Return the group of `groups` holding `rank` (ScheduleError naming `op` if none does)."""
    for g in groups:
        if rank in g:
            return g
    raise ScheduleError(f"rank {rank} is in no group of '{op.name}' {list(groups)}")


@dataclass(frozen=True)
class _Candidate:
    """An all-reduce that may be bucketed: where its operand is ready, where it is, its first use."""

    ready: int
    position: int
    first_use: int
    group: tuple[int, ...]
    node: Node


def _candidates(flat: Flat, rank: int, devices: frozenset[int]) -> tuple[list[_Candidate], dict[int, int]]:
    """Return the bucketable all-reduces in ready order, and the node defining each slot."""
    nodes, types = flat.nodes, flat.types
    defined: dict[int, int] = {}
    first_use: dict[int, int] = {}
    for i, node in enumerate(nodes):
        for o in node.outs:
            defined[o] = i
        for a in node.ins:
            first_use.setdefault(a, i)
    candidates = []
    for i, node in enumerate(nodes):
        if not isinstance(node.op, comm.AllReduceOp) or types[node.ins[0]] is None:
            continue
        group = group_of(node.op.rank_groups, rank, node.op)
        if len(group) < 2 or not set(group) <= devices or types[node.ins[0]] != types[node.outs[0]]:
            continue
        ready = defined.get(node.ins[0], -1) + 1
        candidates.append(_Candidate(ready, i, first_use.get(node.outs[0], len(nodes)), group, node))
    candidates.sort(key=lambda c: (c.ready, c.position))
    return candidates, defined


def _group_candidates(flat: Flat, candidates: list[_Candidate], bucket_bytes: int) -> list[list[_Candidate]]:
    """Cut the candidates, in order, into runs of one group and dtype of at most `bucket_bytes`
    that all start before any of them is used."""
    types = flat.types
    groups: list[list[_Candidate]] = []
    current: list[_Candidate] = []
    size = 0
    for c in candidates:
        nbytes = int(np.prod(types[c.node.ins[0]][0], dtype=np.int64)) * types[c.node.ins[0]][1].itemsize
        if current:
            head = current[0]
            same = head.group == c.group and types[head.node.ins[0]][1] == types[c.node.ins[0]][1]
            start = max(x.ready for x in current + [c])
            if not same or size + nbytes > bucket_bytes or start > min(x.first_use for x in current + [c]):
                groups.append(current)
                current, size = [], 0
        current.append(c)
        size += nbytes
    groups.append(current)
    return groups


def plan_buckets(flat: Flat, rank: int, devices: frozenset[int] | None, bucket_bytes: int) -> list[BucketSpec]:
    """Rewrite `flat.nodes` with bucketed, overlapped all-reduces; return the buckets, by index."""
    nodes, types = flat.nodes, flat.types
    if devices is None or bucket_bytes <= 0:
        return []
    candidates, defined = _candidates(flat, rank, devices)
    if not candidates:
        return []
    uses: dict[int, int] = {}
    for node in nodes:
        for a in node.ins:
            uses[a] = uses.get(a, 0) + 1
    for _, slot in flat.outputs + flat.assigns:
        uses[slot] = uses.get(slot, 0) + 1
    constants = {c.slot for c in flat.constants}
    groups = _group_candidates(flat, candidates, bucket_bytes)
    n = len(nodes)
    grouped = {m.position for members in groups for m in members}
    starts: dict[int, list[Node]] = {}
    waits: dict[int, list[Node]] = {}
    spans: list[tuple[int, int, int]] = []
    removed = set()
    buckets: list[BucketSpec] = []
    for members in groups:
        start, wait = max(m.ready for m in members), min(m.first_use for m in members)
        if all(j in grouped for j in range(start, min(wait, n))):
            continue  # nothing would run while it is in flight: the blocking all-reduce is faster
        b = len(buckets)
        buckets.append(BucketSpec(members[0].group, types[members[0].node.ins[0]][1],
                                  tuple(types[m.node.ins[0]][0] for m in members)))
        starts.setdefault(start, []).append(Node(None, tuple(m.node.ins[0] for m in members), (), "bucket-start",
                                                 bucket=b))
        waits.setdefault(wait, []).append(Node(None, (), tuple(m.node.outs[0] for m in members), "bucket-wait",
                                               bucket=b))
        spans.append((start, wait, b))
        removed.update(m.position for m in members)
        for k, m in enumerate(members):
            a = m.node.ins[0]
            producer = nodes[defined[a]] if a in defined else None
            if producer is not None and producer.op is not None and uses.get(a) == 1 and a not in constants:
                producer.into = {**(producer.into or {}), producer.outs.index(a): (b, k)}

    out: list[Node] = []
    for i in range(n + 1):
        out.extend(starts.get(i, ()))
        out.extend(waits.get(i, ()))
        if i == n:
            break
        if i not in removed:
            out.append(nodes[i])
        in_flight = tuple(b for s, w, b in spans if s <= i < w - 1)
        if in_flight and i not in removed:
            out.append(Node(None, (), (), "poll", polls=in_flight))
    flat.nodes[:] = out
    return buckets
