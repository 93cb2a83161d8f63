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
* a bucket of one all-reduce with no other kernel between its start and its wait (a
  tensor-parallel all-reduce read by the next op, say) is not made: it stays blocking,
  which is faster when nothing can overlap it. A bucket of several all-reduces is made even
  then, *blocking* (`BucketSpec.blocking`: its start sums it with one blocking all-reduce, a
  *coalesced* all-reduce): one collective instead of k pays one latency, and one meeting of
  the group's members, where k blocking ones pay k. On ranks that share a core each meeting
  costs scheduler hand-overs (0.1-0.3 ms measured), so GPT's 29 gradient sums over 3 ranks,
  one by one after the backward pass, took 5.3 ms of a 90 ms step; and the loss's sum, which
  nothing in the step reads, joins the gradients' bucket instead of making every rank wait
  for the slowest between its forward and backward passes.

The runtime's buckets (`hspmd.runtime.buckets.Bucket`) sum with the communicator's
`iall_reduce` or `all_reduce` (the same bits: left folds in group order), and an element's sum
does not depend on its neighbours, so bucketing changes no result. The order in which
buckets start is a function of the program alone, so every member of a group starts them in
the same order. All-reduces whose group lies inside the program's own devices are bucketed
as above (their members run this same program). One whose group reaches ranks of other
programs is bucketed only as the IR says, since every program must make the same buckets:
`coalesce-group-sums` marks runs of them (`comm.COALESCE_ATTR`), each run one blocking bucket
(MPI matches a blocking collective only with a blocking one, and whether other work could
overlap it differs between the programs), summed no earlier than just after the last other
communicating step before it and no later than the first one after it, so every rank meets
the others' collectives in the order the program has them.
The rewrite happens when the schedule is built, so the IR, and the passes after
`PHYSICAL_PIPELINE` (pipeline-split) see plain `comm.all_reduce` ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hspmd.codegen.schedule.flatten import Flat, Node
from hspmd.codegen.schedule.model import BucketSpec, ScheduleError
from hspmd.dialects import comm
from hspmd.ir.devices import RankGroups


def group_of(groups, rank: int, op) -> tuple[int, ...]:
    """Return the group of `groups` (RankGroups, or listed groups) holding `rank`, found from the
    rank's id (ScheduleError naming `op` if none does)."""
    if isinstance(groups, RankGroups):
        found = groups.group_holding(rank)
        if found is not None:
            return tuple(found)
    else:
        for g in groups:
            if rank in g:
                return tuple(g)
    raise ScheduleError(f"rank {rank} is in no group of '{op.name}' {groups}")


@dataclass(frozen=True)
class _Candidate:
    """An all-reduce that may be bucketed: where its operand is ready, where it is, its first use."""

    ready: int
    position: int
    first_use: int
    group: tuple[int, ...]
    node: Node
    run: int | None = None  # the `coalesce` run of an all-reduce across programs


def _candidates(flat: Flat, rank: int, devices) -> tuple[list[_Candidate], dict[int, int]]:
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
        mark = node.op.attributes.get(comm.COALESCE_ATTR)
        run = mark.value.data if mark is not None else None  # type: ignore[attr-defined]
        if len(group) < 2 or (not all(d in devices for d in group) and run is None) or types[node.ins[0]] != types[node.outs[0]]:
            continue
        ready = defined.get(node.ins[0], -1) + 1
        candidates.append(_Candidate(ready, i, first_use.get(node.outs[0], len(nodes)), group, node, run))
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
        if c.run is not None:
            continue  # across programs: the IR's runs (`_marked_runs`)
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


def _marked_runs(flat: Flat, candidates: list[_Candidate]) -> list[tuple[list[_Candidate], int, int]]:
    """Return each `coalesce` run of all-reduces across programs with where it may start and
    where it must be waited on: after its last operand but not before the last other
    communicating step before its first member, before its first use but not after the first
    other communicating step after its last member."""
    runs: dict[int, list[_Candidate]] = {}
    for c in sorted(candidates, key=lambda c: c.position):
        if c.run is not None:
            runs.setdefault(c.run, []).append(c)
    talking = [i for i, node in enumerate(flat.nodes)  # the sends' wait at the end of the step too
               if node.kind == "wait-sends" or (node.op is not None and comm.members(node.op) is not None)]
    out = []
    for run in runs.values():
        own = {m.position for m in run}
        first, last = run[0].position, run[-1].position
        after = max((i for i in talking if i < first and i not in own), default=-1) + 1
        before = min((i for i in talking if i > last and i not in own), default=len(flat.nodes))
        start, wait = max(after, *(m.ready for m in run)), min(before, *(m.first_use for m in run))
        if start > wait:
            raise ScheduleError(f"the all-reduces of coalesce run {run[0].run} are read before all are computed")
        out.append((run, start, wait))
    return out


def plan_buckets(flat: Flat, rank: int, devices, bucket_bytes: int) -> list[BucketSpec]:
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
    placed = [(members, max(m.ready for m in members), min(m.first_use for m in members))
              for members in _group_candidates(flat, candidates, bucket_bytes) if members]
    placed += _marked_runs(flat, candidates)
    n = len(nodes)
    grouped = {m.position for members, _, _ in placed for m in members}
    starts: dict[int, list[Node]] = {}
    waits: dict[int, list[Node]] = {}
    spans: list[tuple[int, int, int]] = []
    removed = set()
    buckets: list[BucketSpec] = []
    for members, start, wait in placed:
        idle = all(j in grouped for j in range(start, min(wait, n)))  # nothing would run while it is in flight
        if len(members) == 1 and idle:
            continue  # the blocking all-reduce is faster
        # a run across programs is always blocking: MPI matches a blocking collective only with a
        # blocking one, and whether something runs before the wait differs from program to program
        blocking = idle or members[0].run is not None
        b = len(buckets)
        buckets.append(BucketSpec(members[0].group, types[members[0].node.ins[0]][1],
                                  tuple(types[m.node.ins[0]][0] for m in members), blocking=blocking))
        starts.setdefault(start, []).append(Node(None, tuple(m.node.ins[0] for m in members), (), "bucket-start",
                                                 bucket=b))
        waits.setdefault(wait, []).append(Node(None, (), tuple(m.node.outs[0] for m in members), "bucket-wait",
                                               bucket=b))
        if not blocking:
            spans.append((start, wait, b))
        removed.update(m.position for m in members)
        for k, m in enumerate(members):
            a = m.node.ins[0]
            producer = nodes[defined[a]] if a in defined else None
            if producer is not None and producer.op is not None and uses.get(a) == 1 and a not in constants:
                producer.into = {**(producer.into or {}), producer.outs.index(a): (b, k)}

    began = {node.bucket: i for i, ns in starts.items() for node in ns}
    out: list[Node] = []
    for i in range(n + 1):
        # the waits of buckets started earlier come before the starts here: one bucket's last
        # collective then precedes the next one's first on every program, whichever nodes lie between
        out.extend(w for w in waits.get(i, ()) if began[w.bucket] < i)
        out.extend(starts.get(i, ()))
        out.extend(w for w in waits.get(i, ()) if began[w.bucket] == i)
        if i == n:
            break
        if i not in removed:
            out.append(nodes[i])
        in_flight = tuple(b for s, w, b in spans if s <= i < w - 1)
        if in_flight and i not in removed:
            out.append(Node(None, (), (), "poll", polls=in_flight))
    flat.nodes[:] = out
    return buckets
