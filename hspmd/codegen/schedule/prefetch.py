"""Prefetched all-gathers: ZeRO-3's parameter gathers started one layer ahead of where they are read.

Under `zero=3` each layer's weights are all-gathered in its forward and again in its backward
(`shard-parameters`). Laid out flat (`flatten`: a scan's iterations in order), each gather stands
just before the op that reads it and, blocking, makes every rank wait there. `plan_prefetch`
rewrites the flat node list so that the gathers run ahead, as FSDP's forward and backward prefetch
does:

* the candidates are the `comm.all_gather`s of a parameter's piece (or a scan iteration's slice
  of one) in equal pieces over a group of this program's own devices (every member runs this
  same program, so all start them in the same order); an activation's gather stays as it is;
* D is the most candidates that read the weights of one scan iteration (the slices one run of
  `take` nodes makes: one layer's weights), 1 where no scan feeds a gather;
* candidate j *starts* (`gather-start`: a non-blocking `iall_gather` into a fresh array, its
  result's slot) right after candidate j - D stands (at the top for the first D), or once its
  piece exists if that is later; a `take` of a layer's slice that its piece is gets moved along
  with it (a view, whose operand exists from the start). It is *waited on* (`gather-wait`, which
  reads the result and the piece, so both stay alive until then) where it stood. So while layer i
  computes, layer i+1's weights are in flight, and at most about one layer's gathered weights more
  than without prefetch are alive (the schedule's memory counts each from its start);
* between a start and its wait a light `gather-poll` after each op lets MPI move the transfer.

A gather that could not start before where it stands stays blocking. The gathered values are
the blocking gather's (`iall_gather` and `all_gather` give the same concatenation), so prefetch
changes no number. The rewrite runs when the schedule is built (after the all-reduce buckets), on
CPU programs; a device program keeps its gathers blocking.
"""

from __future__ import annotations

from hspmd.codegen.schedule.buckets import group_of
from hspmd.codegen.schedule.flatten import Flat, Node
from hspmd.dialects import comm


def _candidates(flat: Flat, rank: int, devices) -> list[int]:
    """Return the positions of the all-gathers that may start early (module docstring), in order."""
    params = {p.slot for p in flat.params}
    weights = set(params)  # a parameter's slot, or a scan iteration's slice of it
    weights.update(n.outs[0] for n in flat.nodes if n.kind == "take" and n.ins[0] in params)
    out = []
    for i, node in enumerate(flat.nodes):
        op = node.op
        if node.kind != "op" or not isinstance(op, comm.AllGatherOp) or len(node.ins) != 1 or len(node.outs) != 1:
            continue
        if node.ins[0] not in weights:
            continue  # an activation's gather (tp, sp) stands right after what makes it
        piece, whole = flat.types[node.ins[0]], flat.types[node.outs[0]]
        group = group_of(op.rank_groups, rank, op)
        if piece is None or whole is None or len(group) < 2 or not all(d in devices for d in group):
            continue
        dim = op.dim.value.data
        if whole[0][dim] != len(group) * piece[0][dim]:
            continue  # uneven pieces: `iall_gather` takes equal ones
        out.append(i)
    return out


def plan_prefetch(flat: Flat, rank: int, devices) -> int:
    """Rewrite `flat.nodes` with gathers started ahead (module docstring); return how many were."""
    nodes = flat.nodes
    if devices is None:
        return 0
    candidates = _candidates(flat, rank, devices)
    if not candidates:
        return 0
    defined: dict[int, int] = {o: i for i, node in enumerate(nodes) for o in node.outs}
    run_of: dict[int, int] = {}  # a take's result -> the run of consecutive takes it belongs to
    run = 0
    for i, node in enumerate(nodes):
        if node.kind == "take":
            run_of[node.outs[0]] = run
        elif i and nodes[i - 1].kind == "take":
            run += 1
    per_run: dict[int, int] = {}
    for i in candidates:
        r = run_of.get(nodes[i].ins[0])
        if r is not None:
            per_run[r] = per_run.get(r, 0) + 1
    ahead = max(per_run.values(), default=1)

    starts: dict[int, list[Node]] = {}
    moved: set[int] = set()  # positions of takes moved along with a start
    spans: list[tuple[int, int, int]] = []  # (start, wait, gather)
    for j, i in enumerate(candidates):
        node = nodes[i]
        piece = node.ins[0]
        anchor = candidates[j - ahead] + 1 if j >= ahead else 0
        source = defined.get(piece)
        take = None
        if source is not None and source >= anchor and nodes[source].kind == "take" and source not in moved:
            operand = defined.get(nodes[source].ins[0])
            if (operand if operand is not None else -1) < anchor:
                take = source  # the layer's slice is a view of a whole stacked operand: take it early
        ready = 0 if source is None else source + 1
        at = max(anchor, ready) if take is None else anchor
        if at >= i:
            continue
        k = len(spans)
        if take is not None:
            moved.add(take)
            starts.setdefault(at, []).append(nodes[take])
        starts.setdefault(at, []).append(Node(node.op, (piece,), node.outs, "gather-start", node.facts,
                                              node.microbatch, gather=k, scope=node.scope))
        nodes[i] = Node(node.op, (node.outs[0], piece), (), "gather-wait", node.facts, node.microbatch, gather=k,
                        scope=node.scope)
        spans.append((at, i, k))
    if not spans:
        return 0
    began: dict[int, list[int]] = {}
    for s, _, k in spans:
        began.setdefault(s, []).append(k)
    waited = {w: k for _, w, k in spans}
    flying: list[int] = []  # started, not yet waited on, in start order
    out: list[Node] = []
    for i, node in enumerate(nodes):
        out.extend(starts.get(i, ()))
        flying.extend(began.get(i, ()))
        if i in waited:
            flying.remove(waited[i])
        if i in moved:
            continue
        out.append(node)
        if flying and node.kind == "op":
            out.append(Node(None, (), (), "gather-poll", polls=tuple(flying)))
    flat.nodes[:] = out
    return len(spans)


__all__ = ["plan_prefetch"]
