"""Memory of a flat program: storages, liveness, in-place updates, reused buffers, frees, peak.

1. **Aliasing.** Every value has the set of *storages* (memory blocks) it may share memory
   with: a view op (reshape, transpose, broadcast, split, slice) aliases its operand; a
   kernel that writes into a preallocated `out=` buffer owns a fresh storage; any other
   kernel may alias its operands (kept conservative for kernels the schedule does not know,
   such as the fused kernels of other dialects). A storage lives from its definition to the
   last use of any value that may alias it.
2. **Buffers by liveness.** Kernels that take `out=` (`kernel_facts.out_facts`) write into
   buffers preallocated once and reused by storages whose lifetimes do not overlap (best fit
   by size). A batched matmul whose result is only transposed into a reshape or a concat
   writes in that consumer's layout (`placement.py`): into its own buffer laid out
   transposed, or into its slice of the concat's buffer (one storage, living from the first
   such matmul). `Schedule.peak_bytes` is the rank's peak: buffers + the largest sum of live
   kernel-allocated arrays + parameters, inputs, constants and all-reduce buckets.
3. **In place.** An elementwise kernel that may write over its first operand (a ufunc: any
   operand) writes its result into that operand's buffer when the operand dies there
   (chains such as scale, mask, softmax share one buffer). A `graph.assign` of a value
   computed by an `out=` kernel after the last use of the old parameter value writes
   straight into the parameter's array (Adam's `p, m, v` are updated in place); other
   assigned or output values that live in schedule-owned memory are copied at the end of the
   step.
4. **Frees.** Each step lists the slots that die after it, so kernel-allocated arrays are
   released as early as possible.
5. **Batch chains** (`chains`): the buffers of the values a chain of batched steps holds (causal
   attention's scores and probabilities) live to the chain's end, so that a runtime may run it
   by slices of its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hspmd.codegen.schedule.chains import find_chains, member_lead
from hspmd.codegen.schedule.flatten import Flat
from hspmd.codegen.schedule.placement import Placement, placements
from hspmd.codegen.schedule.triangular import triangular_matmuls
from hspmd.codegen.schedule.model import BucketSpec, Destination, Schedule, Step, nbytes, step_name

# ops whose result is a view of their first operand (never written through)
_VIEW_OPS = ("graph.reshape", "graph.transpose", "graph.broadcast", "graph.split", "graph.slice")
# ops that return a fresh array not sharing memory with their operands, without out=
_FRESH_OPS = frozenset({
    "graph.embedding", "graph.embedding_grad", "graph.constant", "graph.cast", "graph.reduce_max",
    "graph.reduce_max_grad", "graph.softmax_cross_entropy", "graph.softmax_cross_entropy_grad",
    "graph.label_mask", "graph.rope", "graph.rope_grad", "graph.rms_norm", "graph.rms_norm_grad",
    "graph.relu_grad", "graph.silu", "graph.silu_grad", "graph.concat", "optim.sum_squares",
    "optim.clip_coef", "comm.all_reduce", "comm.all_gather", "comm.reduce_scatter", "comm.broadcast",
    "comm.all_to_all", "comm.recv", "comm.exchange", "comm.local_split",
})
#: node kinds that compute (may take out=)
_COMPUTES = ("op", "sum", "stack")


@dataclass
class _Storages:
    """Storages and what each slot may alias. Kinds: "param" (state arrays), "fixed" (inputs,
    constants, buckets: never written by the schedule), "pooled" (an out= buffer), "fresh"
    (kernel-allocated)."""

    kind: list[str] = field(default_factory=list)
    owner: list[int] = field(default_factory=list)  # the slot a storage was created for
    alias: list[frozenset[int]] = field(default_factory=list)
    param: dict[str, int] = field(default_factory=dict)  # parameter name -> its storage
    out_capable: list[bool] = field(default_factory=list)  # per node: writes into out=
    placed: dict[int, Placement] = field(default_factory=dict)  # matmul results in a consumer's layout
    hosts: dict[int, int] = field(default_factory=dict)  # host slot -> its storage, for placed results
    start: list[int] = field(default_factory=list)  # per storage: node defining it
    end: list[int] = field(default_factory=list)  # per storage: last node using it

    def new(self, kind: str, slot: int) -> int:
        self.kind.append(kind)
        self.owner.append(slot)
        return len(self.kind) - 1


def _storages(flat: Flat, reuse_buffers: bool, triangles: dict[int, str], device: bool = False) -> _Storages:
    """Return the storages of `flat` and each slot's aliases (step 1 of the module docstring);
    `device`: a device program's (every result pooled, scalars too; no result placed in a
    consumer's layout)."""
    types = flat.types
    st = _Storages(alias=[frozenset()] * len(types))
    for p in flat.params:
        st.param[p.name] = s = st.new("param", p.slot)
        st.alias[p.slot] = frozenset({s})
    for leaf in flat.inputs:
        st.alias[leaf.slot] = frozenset({st.new("fixed", leaf.slot)})
    for c in flat.constants:
        st.alias[c.slot] = frozenset({st.new("fixed", c.slot)})
    st.out_capable = [reuse_buffers and node.kind in _COMPUTES and node.facts.takes_out
                      and all(types[o] is not None and (device or types[o][0] != ()) for o in node.outs)
                      for node in flat.nodes]
    st.placed = {} if device else placements(flat, lambda i: st.out_capable[i] and not flat.nodes[i].into, triangles)
    for i, node in enumerate(flat.nodes):
        name = node.op.name if node.op is not None else ""
        poolable = st.out_capable[i]
        if node.kind == "bucket-wait":
            fixed = st.new("fixed", node.outs[0] if node.outs else -1)
            for o in node.outs:
                st.alias[o] = frozenset({fixed})
        elif poolable:
            for pos, o in enumerate(node.outs):
                if node.into and pos in node.into:
                    st.alias[o] = frozenset({st.new("fixed", o)})
                    continue
                host = st.placed[o].host if o in st.placed else o
                if host not in st.hosts:  # a concat's buffer is made by its first placed operand
                    st.hosts[host] = st.new("pooled", host)
                st.alias[o] = frozenset({st.hosts[host]})
        elif name in _VIEW_OPS or node.kind == "take":
            for o in node.outs:
                st.alias[o] = st.alias[node.ins[0]]
        else:
            shared = frozenset() if name in _FRESH_OPS else frozenset().union(*(st.alias[i] for i in node.ins))
            for o in node.outs:
                st.alias[o] = shared | {st.new("fresh", o)}
    return st


def _liveness(flat: Flat, st: _Storages) -> tuple[list[int], list[int]]:
    """Set each storage's lifetime; return the defining node and the last use of every slot."""
    nodes, n_nodes, n_slots = flat.nodes, len(flat.nodes), len(flat.types)
    defined = [-1] * n_slots  # node index defining each slot (-1: before the first node)
    last_use = [-1] * n_slots
    for i, node in enumerate(nodes):
        for o in node.outs:
            defined[o] = i
            last_use[o] = max(last_use[o], i)
        for a in node.ins:
            last_use[a] = i
    for _, slot in flat.outputs + flat.assigns:
        last_use[slot] = n_nodes  # outputs and assigns are read after the last node
    n_storages = len(st.kind)
    st.start = [n_nodes + 1] * n_storages
    st.end = [-1] * n_storages
    for s in range(n_storages):
        o = st.owner[s]
        st.start[s] = defined[o] if o >= 0 else -1
    for slot in range(n_slots):
        for s in st.alias[slot]:
            st.end[s] = max(st.end[s], last_use[slot])
            if st.kind[s] == "pooled":  # a concat's buffer is written first by its placed operands
                st.start[s] = min(st.start[s], defined[slot])
    for s in range(n_storages):
        st.end[s] = max(st.end[s], st.start[s])
    return defined, last_use


def _inplace_params(flat: Flat, st: _Storages, defined: list[int]) -> dict[tuple[int, int], str]:
    """Return (node index, result position) -> parameter name of the results written straight
    into a parameter's array (step 3), and make those results alias the parameter."""
    nodes, types = flat.nodes, flat.types
    inplace: dict[tuple[int, int], str] = {}
    assigned_once = [name for name, _ in flat.assigns]
    out_slots = {slot for _, slot in flat.outputs}
    slot_uses: dict[int, int] = {}
    for _, slot in flat.assigns:
        slot_uses[slot] = slot_uses.get(slot, 0) + 1
    params_by_name = {p.name: p for p in flat.params}
    for name, slot in flat.assigns:
        p = params_by_name.get(name)
        i = defined[slot]
        if (p is None or i < 0 or not st.out_capable[i] or assigned_once.count(name) != 1 or slot in out_slots
                or slot_uses[slot] != 1 or types[slot] != types[p.slot]):
            continue
        last = st.end[st.param[name]]
        if (last < i or last == i and nodes[i].facts.inplace_safe) and len(st.alias[slot]) == 1:
            inplace[(i, nodes[i].outs.index(slot))] = name
            st.alias[slot] = frozenset({st.param[name]})
    return inplace


def _share_dying_operands(flat: Flat, st: _Storages, inplace: dict[tuple[int, int], str]) -> list[int]:
    """Return each storage's root: the storage whose buffer it takes over (itself if none), for
    elementwise results written over an operand that dies there (step 3)."""
    types = flat.types
    root = list(range(len(st.kind)))

    def find(s: int) -> int:
        while root[s] != s:
            s = root[s]
        return s

    for i, node in enumerate(flat.nodes):
        if not st.out_capable[i] or len(node.outs) != 1 or (i, 0) in inplace or not node.facts.inplace_safe:
            continue
        o = node.outs[0]
        (so,) = st.alias[o]
        if st.kind[so] != "pooled" or st.owner[so] != o:  # not its own buffer (placed in a stack's)
            continue
        for a in node.ins if node.facts.overwrites == "any" else node.ins[:1]:
            if types[a] != types[o] or len(st.alias[a]) != 1:
                continue
            (sa,) = st.alias[a]
            r = find(sa)
            others = {find(x) for b in node.ins if b != a for x in st.alias[b]}
            if st.kind[sa] == "pooled" and st.owner[sa] == a and st.end[r] == i and r not in others:
                root[so] = r
                st.end[r] = max(st.end[r], st.end[so])
                break
    for s in range(len(root)):
        root[s] = find(s)
    return root


def _chains(flat: Flat, st: _Storages, root: list[int]) -> list[tuple[int, int]]:
    """Return the batch chains of the program (`chains.find_chains`, members writing into
    buffers) and keep the buffer of every value they read or write until each one's end."""
    nodes, types = flat.nodes, flat.types

    def lead_of(i: int) -> int | None:
        if not st.out_capable[i] or nodes[i].into:
            return None
        return member_lead(nodes[i], types)

    chains = find_chains(nodes, lead_of)
    for first, last in chains:
        for node in nodes[first:last + 1]:
            for slot in (*node.ins, *node.outs):
                for s in st.alias[slot]:
                    r = root[s]
                    st.end[r] = max(st.end[r], last)
    return chains


def _pack_buffers(flat: Flat, st: _Storages, defined: list[int], root: list[int],
                  inplace: dict[tuple[int, int], str]) -> tuple[list[int], dict[int, int]]:
    """Return the buffers' bytes and the buffer of every root pooled storage (best fit by liveness)."""
    nodes = flat.nodes
    pooled = sorted((s for s in range(len(st.kind)) if st.kind[s] == "pooled" and root[s] == s
                     and (defined[st.owner[s]], nodes[defined[st.owner[s]]].outs.index(st.owner[s])) not in inplace),
                    key=lambda s: (st.start[s], s))
    buffers: list[int] = []  # bytes of each buffer
    free: list[int] = []  # buffer indices free at the current point
    busy: list[tuple[int, int]] = []  # (end, buffer index)
    storage_buffer: dict[int, int] = {}
    for s in pooled:
        need = max(nbytes(flat.types[st.owner[s]]), 1)
        still = []
        for end, b in busy:
            (free.append(b) if end < st.start[s] else still.append((end, b)))
        busy = still
        fits = [b for b in free if buffers[b] >= need]
        if fits:
            b = min(fits, key=lambda b: buffers[b])
            free.remove(b)
        else:
            buffers.append(need)
            b = len(buffers) - 1
        storage_buffer[s] = b
        busy.append((st.end[s], b))
    return buffers, storage_buffer


def _destinations(flat: Flat, st: _Storages, i: int, root: list[int], storage_buffer: dict[int, int],
                  inplace: dict[tuple[int, int], str]) -> tuple[Destination, ...] | None:
    """Return where node i writes each result (None: its kernel allocates them)."""
    if not st.out_capable[i]:
        return None
    node, types = flat.nodes[i], flat.types
    out = []
    for pos, o in enumerate(node.outs):
        name = inplace.get((i, pos))
        shape, dtype = types[o]  # type: ignore[misc]
        if node.into and pos in node.into:
            bucket, member = node.into[pos]
            out.append(Destination("bucket", bucket, member))
        elif name is None:
            (s,) = st.alias[o]
            place = st.placed.get(o)
            if place is None:
                out.append(Destination("buffer", storage_buffer[root[s]], shape=shape, dtype=dtype))
            else:
                out.append(Destination("buffer", storage_buffer[root[s]], shape=shape, dtype=dtype,
                                       stored=place.stored, select=place.select, perm=place.perm, at=place.at))
        else:
            out.append(Destination("param", name=name, shape=shape, dtype=dtype))
    return tuple(out)


def _peak_bytes(flat: Flat, st: _Storages, buffers: list[int], buckets: list[BucketSpec]) -> int:
    """Return buffers + the largest sum of live kernel-allocated arrays + what lives all step."""
    types, n_nodes = flat.types, len(flat.nodes)
    persistent = sum(nbytes(types[p.slot]) for p in flat.params) + sum(nbytes(types[l.slot]) for l in flat.inputs)
    persistent += sum(c.nbytes() for c in flat.constants)
    persistent += sum(buckets[b].nbytes() for b in dict.fromkeys(n.bucket for n in flat.nodes if n.bucket is not None))
    delta = [0] * (n_nodes + 2)
    for s in range(len(st.kind)):
        if st.kind[s] == "fresh" and st.start[s] >= 0:
            size = nbytes(types[st.owner[s]])
            delta[st.start[s]] += size
            delta[min(st.end[s], n_nodes) + 1] -= size
    live = peak_fresh = 0
    for d in delta:
        live += d
        peak_fresh = max(peak_fresh, live)
    return sum(buffers) + peak_fresh + persistent


def assemble(flat: Flat, rank: int, buckets: list[BucketSpec], reuse_buffers: bool = True,
             triangular: bool = True, device: bool = False) -> Schedule:
    """Return the finished schedule of a flat program (see the module docstring); with
    `triangular`, causal attention's products marked for block products (`triangular.py`);
    with `device`, the schedule of a device program (`_storages`)."""
    triangles = triangular_matmuls(flat) if triangular and not device else {}
    st = _storages(flat, reuse_buffers, triangles, device)
    defined, last_use = _liveness(flat, st)
    inplace = _inplace_params(flat, st, defined)
    root = _share_dying_operands(flat, st, inplace)
    chains = _chains(flat, st, root)
    buffers, storage_buffer = _pack_buffers(flat, st, defined, root, inplace)
    n_nodes = len(flat.nodes)
    keep = {slot for _, slot in flat.outputs + flat.assigns} | {p.slot for p in flat.params}
    dead_at: list[list[int]] = [[] for _ in range(n_nodes)]
    for slot in range(len(flat.types)):
        if slot not in keep and 0 <= last_use[slot] < n_nodes:
            dead_at[last_use[slot]].append(slot)
    steps = tuple(
        Step(node.kind, node.op, node.ins, node.outs, node.microbatch,
             _destinations(flat, st, i, root, storage_buffer, inplace), node.facts, tuple(dead_at[i]), node.bucket,
             node.polls, step_name(node.kind, node.op), node.scope, triangles.get(i, ""), node.gather)
        for i, node in enumerate(flat.nodes)
    )
    updated = {flat.nodes[i].outs[pos]: name for (i, pos), name in inplace.items()}
    copy_out = frozenset(
        (name, slot) for name, slot in flat.outputs + flat.assigns
        if updated.get(slot) != name and any(st.kind[s] != "fresh" for s in st.alias[slot])
    )
    return Schedule(rank, steps, tuple(flat.types), tuple(flat.params), tuple(flat.inputs), tuple(flat.constants),
                    tuple(flat.outputs), tuple(flat.assigns), copy_out, tuple(buffers), tuple(buckets),
                    _peak_bytes(flat, st, buffers, buckets), tuple(chains))
