"""Bucketed, overlapped all-reduces: a plan-time grouping of a flat program's `comm.all_reduce` ops.

The compiler places the gradient all-reduces of data parallelism after the backward pass,
one per gradient. `plan_buckets` rewrites the flat node list of a plan (`hspmd.runtime.plan`)
so that

* all-reduces over the same group and dtype whose operands become ready one after the other
  share a *bucket*: one flat buffer of at most `bucket_bytes` (a larger tensor gets a bucket
  of its own);
* a bucket *starts* (copies its operands into its buffer and calls the communicator's
  non-blocking `iall_reduce` in place) right after the node that computes its last operand;
  a kernel whose result only feeds the all-reduce writes it straight into the bucket
  (`out=` a view of the bucket's buffer), so that gradient is not copied;
  and is *waited on* just before the first node that reads one of its results (the results
  are views of the bucket's buffer);
* between start and wait, a light *poll* node after each kernel calls `test()` on the buckets
  in flight, so MPI progresses the transfers while the backward pass computes;
* a bucket with no other kernel between its start and its wait (a tensor-parallel
  all-reduce read by the next op, say) is not made: its all-reduces stay blocking, which
  is faster when nothing can overlap them.

The sums are the communicator's (`iall_reduce` gives the bits of `all_reduce`: left folds in
group order), and an element's sum does not depend on its neighbours, so bucketing changes no
result. The order in which buckets start is a function of the program alone, so every member
of a group starts them in the same order. Only all-reduces whose group lies inside the
program's own devices are bucketed (their members run this same program); the others run
where the program has them. The rewrite happens when the plan is built, so the IR, and the
passes after `PHYSICAL_PIPELINE` (pipeline-split) see plain `comm.all_reduce` ops.
"""

from __future__ import annotations

import numpy as np

from hspmd.dialects import comm
from hspmd.runtime.comm.base import Communicator, Request
from hspmd.runtime.nodes import Node, group_of


class Bucket:
    """One flat buffer of all-reduce operands: `start(*operands)`, `poll()`, `wait()` -> results."""

    def __init__(self, communicator: Communicator, group: tuple[int, ...], dtype: np.dtype,
                 shapes: list[tuple[int, ...]]) -> None:
        self.communicator, self.group, self.dtype = communicator, group, dtype
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        self.buffer = np.empty(max(sum(sizes), 1), dtype=dtype)
        self.views: list[np.ndarray] = []
        offset = 0
        for shape, size in zip(shapes, sizes):
            self.views.append(self.buffer[offset: offset + size].reshape(shape))
            offset += size
        self.request: Request | None = None

    def start(self, *operands: np.ndarray) -> None:
        """Copy the operands into the buffer and start the in-place all-reduce."""
        for view, x in zip(self.views, operands):
            if x is not view:  # a producer that wrote into the bucket needs no copy
                np.copyto(view, x)
        self.request = self.communicator.iall_reduce(self.buffer, self.group, out=self.buffer)

    def poll(self) -> None:
        """Let the transfer progress (MPI moves data of non-blocking operations only when called)."""
        if self.request is not None and self.request.test():
            self.request.wait()
            self.request = None

    def wait(self):
        """Return the summed tensors (views of the buffer): one array, or a tuple of several."""
        if self.request is not None:
            self.request.wait()
            self.request = None
        return self.views[0] if len(self.views) == 1 else tuple(self.views)

    def nbytes(self) -> int:
        """Return the bytes of the bucket's buffer."""
        return self.buffer.nbytes

    def summary(self) -> tuple[tuple[int, ...], int, int]:
        """Return (group, number of tensors, bytes)."""
        return self.group, len(self.views), self.buffer.nbytes


def _poller(buckets: list[Bucket]):
    def poll() -> None:
        for b in buckets:
            b.poll()

    return poll


def plan_buckets(flat, rank: int, communicator: Communicator, devices: frozenset[int] | None,
                 bucket_bytes: int) -> list[Bucket]:
    """Rewrite `flat.nodes` (a `plan._Flat`, a bound schedule) with bucketed, overlapped all-reduces; return the buckets."""

    nodes, types = flat.nodes, flat.types
    if devices is None or bucket_bytes <= 0:
        return []
    defined: dict[int, int] = {}
    first_use: dict[int, int] = {}
    uses: dict[int, int] = {}
    for i, node in enumerate(nodes):
        for o in node.outs:
            defined[o] = i
        for a in node.ins:
            first_use.setdefault(a, i)
            uses[a] = uses.get(a, 0) + 1
    for _, slot in flat.outputs + flat.assigns:
        uses[slot] = uses.get(slot, 0) + 1
    n = len(nodes)
    candidates = []  # (ready position, op position, first use, group, node)
    for i, node in enumerate(nodes):
        if not isinstance(node.op, comm.AllReduceOp) or types[node.ins[0]] is None:
            continue
        group = group_of(node.op.rank_groups, rank, node.op)
        if len(group) < 2 or not set(group) <= devices or types[node.ins[0]] != types[node.outs[0]]:
            continue
        ready = defined.get(node.ins[0], -1) + 1
        candidates.append((ready, i, first_use.get(node.outs[0], n), group, node))
    if not candidates:
        return []
    candidates.sort(key=lambda c: (c[0], c[1]))

    groups: list[list[tuple]] = []
    current: list[tuple] = []
    size = 0
    for c in candidates:
        nbytes = int(np.prod(types[c[4].ins[0]][0], dtype=np.int64)) * types[c[4].ins[0]][1].itemsize
        if current:
            head = current[0]
            same = head[3] == c[3] and types[head[4].ins[0]][1] == types[c[4].ins[0]][1]
            start = max(x[0] for x in current + [c])
            if not same or size + nbytes > bucket_bytes or start > min(x[2] for x in current + [c]):
                groups.append(current)
                current, size = [], 0
        current.append(c)
        size += nbytes
    groups.append(current)

    grouped = {m[1] for members in groups for m in members}
    starts: dict[int, list[Node]] = {}
    waits: dict[int, list[Node]] = {}
    spans: list[tuple[int, int, Bucket]] = []
    removed = set()
    buckets = []
    for members in groups:
        start, wait = max(m[0] for m in members), min(m[2] for m in members)
        if all(j in grouped for j in range(start, min(wait, n))):
            continue  # nothing would run while it is in flight: the blocking all-reduce is faster
        group, dtype = members[0][3], types[members[0][4].ins[0]][1]
        bucket = Bucket(communicator, group, dtype, [types[m[4].ins[0]][0] for m in members])
        buckets.append(bucket)
        starts.setdefault(start, []).append(
            Node(None, bucket.start, tuple(m[4].ins[0] for m in members), (), "bucket-start", bucket))
        waits.setdefault(wait, []).append(
            Node(None, bucket.wait, (), tuple(m[4].outs[0] for m in members), "bucket-wait", bucket))
        spans.append((start, wait, bucket))
        removed.update(m[1] for m in members)
        for m, view in zip(members, bucket.views):
            a = m[4].ins[0]
            producer = nodes[defined[a]] if a in defined else None
            if producer is not None and producer.op is not None and uses.get(a) == 1 and a not in flat.constants:
                producer.into = {**(producer.into or {}), producer.outs.index(a): view}

    out: list[Node] = []
    for i in range(n + 1):
        out.extend(starts.get(i, ()))
        out.extend(waits.get(i, ()))
        if i == n:
            break
        if i not in removed:
            out.append(nodes[i])
        in_flight = [b for s, w, b in spans if s <= i < w - 1]
        if in_flight and i not in removed:
            out.append(Node(None, _poller(in_flight), (), (), "poll"))
    flat.nodes[:] = out
    return buckets
