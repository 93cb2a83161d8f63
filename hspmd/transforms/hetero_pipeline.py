"""Heterogeneous pipelines: a pipelined device group beside groups without pipeline stages.

`[0-3]: tp=2 pp=2 share=2 | [4,5]: tp=2 share=1` is compiled as the union in which the
pipelined group is replaced by its stage shape on virtual devices, one per micro-batch and
stage position (one micro-batch: its first stage's devices, `[0,1]: tp=2 share=2 | [4,5]: tp=2
share=1`), so `apply-strategy` sees no pp, and the physical IR is one module per group as for
any heterogeneous strategy.
`pipeline-split{... virtual="0,1"}` then cuts only the virtual group's module into stage
modules and calls `join_groups` here, which ties the stages to the other groups:

* **cross-group collectives** (gradient sums across groups, the loss sum, exchanges) of the
  virtual module go to the stage that computes their operand (a layer-0 weight's to stage 0,
  a layer-1 weight's to stage 1, the loss's to the last stage); each names that stage's real
  devices in place of the virtual ones (with micro-batches, `pipeline-split` first sums them
  over the micro-batches, so each runs once). In every other group's module, the matching
  collective (the k-th one that touches the virtual devices, matched in program order, as
  every heterogeneous program already pairs them) is remapped onto the same stage's devices,
  per op.
* **layouts** left in the other modules (parameters' and inputs' `global_type`, the
  position-dependent ops' records, exchanges' `src`/`dst`) name the real devices too: a
  parameter those of the stage that owns it, anything else stage 0's.
* **order** (deadlock freedom; collectives and receives block, sends do not): the stage
  programs are fixed by `pipeline-split`. Each stage's program, run as the runtime runs it
  (`executed_ops`: its `pipeline.run` walked in the schedule's order), gives a chain of
  *events*: its sends, receives and cross-group collectives. An event follows the last
  blocking event before it on its chain, and a receive follows its send. The stage chains
  alone have a common linear extension: every receive waits for a send made earlier in the
  schedule's dependency order (before and after the run: in the one-group step's order), and
  a cross-group collective lies on one stage's chain only. We add, for each other group,
  its data dependencies between its cross-group collectives, and take a topological order of
  all events (smallest original position first among the ready ones); a cycle there is
  refused with one message. Each other group's step is then re-ordered (every op pulled in
  just before the first cross-group collective that needs it, the rest after in their old
  order) so that its cross-group collectives follow that order. Every rank then issues the
  blocking operations it shares with any other rank in the order of one global sequence,
  which is the classic condition for no deadlock; collectives inside one group are met by
  all its ranks at the same point of one program.
* the other groups' modules are marked as one-stage pipelines (`hspmd.pipeline_stage = 0`,
  `hspmd.microbatches = 1`, `hspmd.single_stage`) so that the runtime gathers parameters from
  every group's programs in one list on every rank.
* **several pipelined groups** are cut one after the other (one `pipeline-split` each): a
  later cut treats the stage modules of an earlier one as fixed chains of events (their
  collectives with the pipeline being cut are remapped, never re-ordered). A collective
  between two pipelines lies on two fixed chains, so the common order is found by the
  topological sort or the strategy is refused with one message.

With micro-batches, only sums may cross groups (all-reduces, or exchanges that sum the
pipelined group's pieces); an exchange that moves other data between groups inside a
micro-batch is refused by `pipeline-split` with one message.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerAttr, ModuleOp, TensorType, UnitAttr, i64
from xdsl.ir import Operation

from hspmd.dialects import comm, graph, pipeline
from hspmd.dialects.dist import LayoutAttr, layout_of, with_layout
from hspmd.dialects.pipeline import MICROBATCHES_ATTR, SINGLE_STAGE_ATTR, STAGE_ATTR  # noqa: F401
from hspmd.ir.layout import Group, Layout
from hspmd.transforms.util import PassError



def remap_layout(layout: Layout, mapping: Mapping[int, int]) -> Layout:
    """Return `layout` with each device d replaced by mapping.get(d, d) (states, hetero, shares kept)."""
    groups = tuple(Group(tuple(mapping.get(d, d) for d in g.devices), g.states) for g in layout.groups)
    return Layout(groups, layout.hetero, layout.shares)


def comm_devices(o: Operation) -> set[int]:
    """Return every device a comm op names (its rank groups, an exchange's layouts' devices)."""
    if isinstance(o, comm.ExchangeOp):
        return set(o.members())
    if hasattr(o, "rank_groups"):
        return {d for g in o.rank_groups for d in g}  # type: ignore[attr-defined]
    if isinstance(o, (comm.SendOp, comm.RecvOp)):
        return {d for p in comm.groups_of(o.pairs) for d in p}
    return set()


def partners(o: Operation, own: set[int] | frozenset[int]) -> set[int]:
    """Return the devices outside `own` that comm op `o` moves data to or from a device of `own`:
    members of a rank group with one of `own`, the other end of an exchange's transfer."""
    if isinstance(o, comm.ExchangeOp):
        out: set[int] = set()
        for src, dst, _ in o.transfer_list():
            if (src in own) != (dst in own):
                out.add(dst if src in own else src)
        return out
    groups = o.rank_groups if hasattr(o, "rank_groups") else \
        comm.groups_of(o.pairs) if isinstance(o, (comm.SendOp, comm.RecvOp)) else ()  # type: ignore[attr-defined]
    return {d for g in groups if set(g) & own for d in g if d not in own}


def comm_signature(o: Operation) -> tuple:
    """Return what must agree between the ends of one collective in two programs (kind and ranks)."""
    if isinstance(o, comm.ExchangeOp):
        return (o.name, str(o.src.data), str(o.dst.data), o.global_shape())
    return (o.name, tuple(sorted(tuple(g) for g in o.rank_groups)))  # type: ignore[attr-defined]


class Remap(Protocol):
    """How one stage renames what names the virtual devices: rank groups and layouts."""

    def groups(self, groups: Sequence[Sequence[int]]) -> list[list[int]]: ...

    def layout(self, layout: Layout) -> Layout: ...


@dataclass(frozen=True)
class DeviceMap:
    """A Remap that renames devices one to one (`mapping.get(d, d)`)."""

    mapping: Mapping[int, int]

    def groups(self, groups: Sequence[Sequence[int]]) -> list[list[int]]:
        return [[self.mapping.get(d, d) for d in g] for g in groups]

    def layout(self, layout: Layout) -> Layout:
        return remap_layout(layout, self.mapping)


def remap_op(o: Operation, remap: Remap | Mapping[int, int]) -> None:
    """Rename devices in op `o` in place: rank groups, exchange layouts, layouts in its properties."""
    if isinstance(remap, Mapping):
        remap = DeviceMap(remap)
    if hasattr(o, "rank_groups") and o.dialect_name() == "comm":
        o.properties["groups"] = comm.groups_attr(remap.groups(o.rank_groups))  # type: ignore[attr-defined]
    for key, value in list(o.properties.items()):
        if isinstance(value, LayoutAttr):
            o.properties[key] = LayoutAttr(remap.layout(value.data))
        elif isinstance(value, TensorType) and layout_of(value) is not None:
            o.properties[key] = with_layout(value, remap.layout(layout_of(value)))  # type: ignore[arg-type]


def _step(module: ModuleOp) -> func.FuncOp:
    for f in module.body.block.ops:
        if isinstance(f, func.FuncOp) and f.sym_name.data == "train_step":
            return f
    raise PassError("pipeline-split: a group module has no @train_step")


def _functions(module: ModuleOp) -> list[func.FuncOp]:
    return [f for f in module.body.block.ops if isinstance(f, func.FuncOp)]


def executed_ops(module: ModuleOp) -> list[Operation]:
    """Return the ops of a group's @train_step in the order a rank runs them: a `pipeline.run`
    replaced by the bodies of its forward and backward, action by action of its schedule."""
    funcs = {f.sym_name.data: f for f in _functions(module)}
    out: list[Operation] = []
    for o in _step(module).body.block.ops:
        if isinstance(o, pipeline.RunOp):
            for kind, _ in pipeline.actions(o):
                ref = o.forward if kind == "F" else o.backward
                out.extend(x for x in funcs[ref.root_reference.data].body.block.ops if not isinstance(x, func.ReturnOp))
        else:
            out.append(o)
    return out


def _pipeline_functions(module: ModuleOp) -> set[str]:
    """Return the names of the functions a `pipeline.run` of the module runs."""
    return {r.root_reference.data for o in _step(module).body.block.ops if isinstance(o, pipeline.RunOp)
            for r in (o.forward, o.backward)}


def join_groups(stage_modules: list[ModuleOp], stage_devices: Sequence[Sequence[int]], virtual: Sequence[int],
                remaps: Sequence[Remap], virtual_cross: list[Operation],
                placed: Mapping[Operation, tuple[int, Operation]],
                others: list[tuple[tuple[int, ...], ModuleOp]]) -> None:
    """Tie the stage modules of a pipelined group to the other groups' modules (see the module docstring).

    `remaps[s]`: how stage s renames the `virtual` devices (in rank groups and layouts);
    `virtual_cross`: the virtual step's cross-group comm ops in program order; `placed[o]`:
    (stage, the op that stands for it on that stage); `others`: (devices, module) of every
    other group, modified in place.
    """
    virtual = set(virtual)  # type: ignore[assignment]
    # the stages of a pipeline cut before (several pipelined groups) keep their programs
    fixed = [STAGE_ATTR in m.attributes and SINGLE_STAGE_ATTR not in m.attributes for _, m in others]
    for o in virtual_cross:
        if o not in placed:
            raise PassError(f"pipeline-split: internal error: the cross-group '{o.name}' went to no stage")
    # parameters' stages, for the layouts the other groups record
    param_stage: dict[str, int] = {}
    for s, module in enumerate(stage_modules):
        for o in module.walk():
            if isinstance(o, graph.ParameterOp):
                param_stage.setdefault(o.tensor_name.data, s)
    node_of: dict[Operation, tuple] = {o: ("x", k) for k, o in enumerate(virtual_cross)}
    # 1. the other groups: match their cross-group ops to the virtual step's, remap them
    other_cross: list[list[Operation]] = []
    for gi, (devices, module) in enumerate(others):
        own = set(devices)
        step = _step(module)
        runs = _pipeline_functions(module)
        for f in _functions(module):
            if f is step or f.sym_name.data in runs:
                continue
            for o in f.walk():
                if o.dialect_name() == "comm" and partners(o, own):
                    raise PassError(f"pipeline-split: '{o.name}' in @{f.sym_name.data} of group {list(devices)} "
                                    "crosses groups; only the step itself may")
        mine = [o for o in executed_ops(module) if o.dialect_name() == "comm" and partners(o, own)]
        with_virtual = [o for o in mine if partners(o, own) & virtual]
        expected = [o for o in virtual_cross if partners(o, virtual) & own]
        if len(with_virtual) != len(expected):
            raise PassError(f"pipeline-split: group {list(devices)} has {len(with_virtual)} collectives with the "
                            f"pipelined group, which has {len(expected)} with it; the programs do not pair up")
        for o, v in zip(with_virtual, expected):
            if comm_signature(o) != comm_signature(v):
                raise PassError(f"pipeline-split: group {list(devices)}'s '{o.name}' does not match the pipelined "
                                f"group's '{v.name}' at the same place ({comm_signature(o)} vs {comm_signature(v)})")
            node_of[o] = node_of[v]
        involvement_count: dict[tuple, int] = {}
        for o in mine:
            if o in node_of:
                continue
            key = tuple(sorted(j for j, (d, _) in enumerate(others) if (partners(o, own) | own) & set(d)))
            k = involvement_count.get(key, 0)
            involvement_count[key] = k + 1
            node_of[o] = ("y", key, k)
        other_cross.append(mine)
        # layouts and rank groups onto real devices
        for f in _functions(module):
            for o in f.walk():
                if o in node_of and node_of[o][0] == "x":
                    remap_op(o, remaps[placed[virtual_cross[node_of[o][1]]][0]])
                elif isinstance(o, graph.ParameterOp):
                    remap_op(o, remaps[param_stage.get(o.tensor_name.data, 0)])
                else:
                    remap_op(o, remaps[0])
        if not fixed[gi]:
            module.attributes[STAGE_ATTR] = IntegerAttr(0, i64)
            module.attributes[MICROBATCHES_ATTR] = IntegerAttr(1, i64)
            module.attributes[SINGLE_STAGE_ATTR] = UnitAttr()
    # 2. the events of each stage (this pipeline's and any cut before), in program order
    clone_node = {clone: node_of[o] for o, (s, clone) in placed.items()}

    def chain_of(module: ModuleOp, nodes: Mapping[Operation, tuple]) -> list[tuple[tuple, bool]]:
        """Return the module's events in the order it runs them, each with whether it blocks (a send does not)."""
        chain: list[tuple[tuple, bool]] = []
        counts: dict[tuple, int] = {}
        for o in executed_ops(module):
            if isinstance(o, (comm.SendOp, comm.RecvOp)):  # the k-th message along these pairs with this tag
                pairs = (comm.groups_of(o.pairs), o.tag_value)
                k = counts.get(pairs, 0)
                counts[pairs] = k + 1
                chain.append((("msg", pairs, k), isinstance(o, comm.RecvOp)))
            elif o in nodes:
                chain.append((nodes[o], True))
        return chain

    chains = [chain_of(module, clone_node) for module in stage_modules]
    chains += [chain_of(module, node_of) for (_, module), f in zip(others, fixed) if f]
    # 3. a topological order of all events: stage chains + each other group's data dependencies
    succ: dict[tuple, set[tuple]] = {}
    indeg: dict[tuple, int] = {}
    prio: dict[tuple, tuple] = {}

    def node(n: tuple, p: tuple) -> None:
        if n not in indeg:
            indeg[n], succ[n] = 0, set()
            prio[n] = p
        prio[n] = min(prio[n], p)

    def edge(a: tuple, b: tuple) -> None:
        if b not in succ[a]:
            succ[a].add(b)
            indeg[b] += 1

    for chain in chains:  # each event after the last blocking one before it (sends do not hold a rank up)
        for i, (n, _) in enumerate(chain):
            node(n, (-1, i))
        last = None
        for n, blocking in chain:
            if last is not None:
                edge(last, n)
            if blocking:
                last = n
    for mine, (_, module), f in zip(other_cross, others, fixed):
        if f:
            continue
        for i, o in enumerate(mine):
            node(node_of[o], (i, 0))
        for o, deps in _cross_dependencies(_step(module), set(mine)).items():
            for d in deps:
                edge(node_of[d], node_of[o])
    ready = [(prio[n], n) for n in indeg if indeg[n] == 0]
    heapq.heapify(ready)
    order: list[tuple] = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for b in sorted(succ[n]):
            indeg[b] -= 1
            if indeg[b] == 0:
                heapq.heappush(ready, (prio[b], b))
    if len(order) != len(indeg):
        piped = [list(d) for (d, _), f in zip(others, fixed) if f]
        raise PassError(f"pipeline-split: the collectives between the stages of the pipeline on "
                        f"{[list(d) for d in stage_devices]} and the other groups"
                        + (f" (stages {piped} of another pipeline)" if piped else "")
                        + " cannot be put in one order that every rank follows, so these stage counts and layer "
                        "placements cannot be combined (give the pipelines the same stages, or one pipeline only)")
    position = {n: i for i, n in enumerate(order)}
    # 4. each other group's step in that order (a stage of another pipeline keeps its own)
    for mine, (_, module), f in zip(other_cross, others, fixed):
        if not f:
            _reorder(_step(module), sorted(mine, key=lambda o: position[node_of[o]]))


def _cross_dependencies(step: func.FuncOp, cross: set[Operation]) -> dict[Operation, set[Operation]]:
    """Return, for each op of `cross`, the ops of `cross` it depends on (transitively) in `step`."""
    deps: dict[Operation, frozenset[Operation]] = {}
    out: dict[Operation, set[Operation]] = {}
    for o in step.body.block.ops:
        mine: set[Operation] = set()
        for v in o.operands:
            owner = v.owner
            if isinstance(owner, Operation) and owner in deps:
                mine |= deps[owner]
                if owner in cross:
                    mine.add(owner)
        deps[o] = frozenset(mine)
        if o in cross:
            out[o] = set(mine)
    return out


def _reorder(step: func.FuncOp, targets: list[Operation]) -> None:
    """Re-order the step's ops so that `targets` come in the given order: each target right after
    the ops it needs that are not yet placed (in their old order), the remaining ops after them."""
    block = step.body.block
    old = list(block.ops)
    index = {o: i for i, o in enumerate(old)}
    placed: set[Operation] = set()
    new: list[Operation] = []

    def pull(o: Operation) -> None:
        stack, need = [o], []
        seen = {o}
        while stack:  # every op o needs (in the block) that is not placed yet
            x = stack.pop()
            need.append(x)
            for v in x.operands:
                owner = v.owner
                if isinstance(owner, Operation) and owner in index and owner not in placed and owner not in seen:
                    seen.add(owner)
                    stack.append(owner)
        for x in sorted(need, key=index.__getitem__):
            placed.add(x)
            new.append(x)

    for t in targets:
        if t not in placed:
            pull(t)
    new.extend(o for o in old if o not in placed)
    if new == old:
        return
    for o in old:
        o.detach()
    block.add_ops(new)
