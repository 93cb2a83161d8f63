"""`join-pipeline-groups`: tie a pipeline's stage modules to the device groups beside it.

Input: the output of `outline-pipeline-stages` for a pipelined group beside other groups
(`[0-3]: tp=2 pp=2 share=2 | [4,5]: tp=2 share=1`, annotated with the pipelined group as one
stage on virtual devices, `virtual.py`): the stage modules, whose stand-ins for the stage-shaped
step's collectives with other groups carry `pipeline.cross = k`, and the other groups' modules,
still naming the virtual devices. For each such pipelined group (`group=K`: only the K-th):

* **cross-group collectives**: in every other group's module, the collective matching the
  step's k-th one (the k-th that touches the virtual devices, in program order, as every
  heterogeneous program already pairs them) is remapped onto the devices of the stage that
  runs it (the stage computing its operand: a layer-0 weight's sum on stage 0, the loss's on
  the last stage), per op;
* **layouts** left in the other modules (parameters' and inputs' `global_type`, the
  position-dependent ops' records, exchanges' `src`/`dst`) name the real devices too: a
  parameter those of the stage that owns it, anything else stage 0's;
* **order** (deadlock freedom; collectives and receives block, sends do not): each stage's
  program, run as the runtime runs it (`executed_ops`), gives a chain of *events* (sends,
  receives, cross-group collectives); an event follows the last blocking event before it on
  its chain. We add, for each other group, its data dependencies between its cross-group
  collectives, and take a topological order of all events (smallest original position first
  among the ready ones); a cycle is refused with one message. Each other group's step is then
  re-ordered (every op pulled in just before the first cross-group collective that needs it,
  the rest after in their old order) so that its cross-group collectives follow that order:
  every rank issues the blocking operations it shares with another rank in the order of one
  global sequence, so no rank deadlocks;
* the other groups' modules are marked as one-stage pipelines (`hspmd.pipeline_stage = 0`,
  `hspmd.microbatches = 1`, `hspmd.single_stage`) so that the runtime gathers parameters from
  every group's programs in one list on every rank;
* **several pipelined groups** are joined one after the other (each right after its own
  outline): a later join treats the stage modules of an earlier one as fixed chains of events
  (their collectives with the pipeline being joined are remapped, never re-ordered).

The `pipeline.cross` attributes are dropped.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerAttr, ModuleOp, UnitAttr, i64
from xdsl.ir import Operation
from xdsl.passes import ModulePass

from hspmd.dialects import comm, graph, pipeline
from hspmd.dialects.pipeline import CROSS_ATTR, MICROBATCHES_ATTR, SINGLE_STAGE_ATTR, STAGE_ATTR
from hspmd.dialects.levels import physical_groups
from hspmd.transforms.pipeline.devices import (Remap, comm_signature, executed_ops, functions, partners,
                                               remap_op, train_step)
from hspmd.transforms.pipeline.stage_mesh import StageMesh
from hspmd.transforms.pipeline.virtual import Pipeline, selected_pipelines
from hspmd.transforms.util import PassError

__all__ = ["JoinPipelineGroups", "join_pipeline"]

Event = tuple
Chain = list[tuple[Event, bool]]


def _pipeline_functions(module: ModuleOp) -> set[str]:
    """Return the names of the functions a `pipeline.run` of the module runs."""
    return {r.root_reference.data for o in train_step(module).body.block.ops if isinstance(o, pipeline.RunOp)
            for r in (o.forward, o.backward)}


def chain_of(module: ModuleOp, nodes: Mapping[Operation, Event]) -> Chain:
    """Return the module's events in the order it runs them, each with whether it blocks (a send does not)."""
    chain: Chain = []
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


class _EventGraph:
    """Events, each after the ones it must follow; `order()` is a topological order, smallest priority first."""

    def __init__(self) -> None:
        self.succ: dict[Event, set[Event]] = {}
        self.indeg: dict[Event, int] = {}
        self.prio: dict[Event, tuple] = {}

    def node(self, n: Event, p: tuple) -> None:
        if n not in self.indeg:
            self.indeg[n], self.succ[n] = 0, set()
            self.prio[n] = p
        self.prio[n] = min(self.prio[n], p)

    def edge(self, a: Event, b: Event) -> None:
        if b not in self.succ[a]:
            self.succ[a].add(b)
            self.indeg[b] += 1

    def add_chain(self, chain: Chain) -> None:
        """Each event after the last blocking one before it (sends do not hold a rank up)."""
        for i, (n, _) in enumerate(chain):
            self.node(n, (-1, i))
        last = None
        for n, blocking in chain:
            if last is not None:
                self.edge(last, n)
            if blocking:
                last = n

    def order(self) -> list[Event] | None:
        """Return a topological order of the events, or None when they form a cycle."""
        indeg = dict(self.indeg)
        ready = [(self.prio[n], n) for n in indeg if indeg[n] == 0]
        heapq.heapify(ready)
        order: list[Event] = []
        while ready:
            _, n = heapq.heappop(ready)
            order.append(n)
            for b in sorted(self.succ[n]):
                indeg[b] -= 1
                if indeg[b] == 0:
                    heapq.heappush(ready, (self.prio[b], b))
        return order if len(order) == len(indeg) else None


@dataclass
class _Join:
    """One pipeline's stage modules, its cross-group collectives and the other groups, while joined."""

    stage_devices: tuple[tuple[int, ...], ...]
    virtual: frozenset[int]
    stage_modules: list[ModuleOp]
    others: list[tuple[tuple[int, ...], ModuleOp]]
    remaps: list[Remap]
    cross: list[tuple[int, Operation]]  # the step's k-th cross-group collective: (stage, its stand-in)

    def __post_init__(self) -> None:
        self.node_of: dict[Operation, Event] = {}
        # the stages of a pipeline joined before (several pipelined groups) keep their programs
        self.fixed = [STAGE_ATTR in m.attributes and SINGLE_STAGE_ATTR not in m.attributes for _, m in self.others]
        self.param_stage: dict[str, int] = {}  # parameters' stages, for the layouts the other groups record
        for s, module in enumerate(self.stage_modules):
            for o in module.walk():
                if isinstance(o, graph.ParameterOp):
                    self.param_stage.setdefault(o.tensor_name.data, s)

    def check_callees(self, devices: tuple[int, ...], module: ModuleOp) -> None:
        own = set(devices)
        step, runs = train_step(module), _pipeline_functions(module)
        for f in functions(module):
            if f is step or f.sym_name.data in runs:
                continue
            for o in f.walk():
                if o.dialect_name() == "comm" and partners(o, own):
                    raise PassError(f"pipeline-split: '{o.name}' in @{f.sym_name.data} of group {list(devices)} "
                                    "crosses groups; only the step itself may")

    def match(self, devices: tuple[int, ...], module: ModuleOp) -> list[Operation]:
        """Pair another group's cross-group collectives with the pipeline's (by order) and give the
        others an event each; remap its ops onto real devices; return its cross-group collectives."""
        own = set(devices)
        self.check_callees(devices, module)
        mine = [o for o in executed_ops(module) if o.dialect_name() == "comm" and partners(o, own)]
        with_virtual = [o for o in mine if partners(o, own) & self.virtual]
        expected = [k for k, (s, c) in enumerate(self.cross) if partners(c, frozenset(self.stage_devices[s])) & own]
        if len(with_virtual) != len(expected):
            raise PassError(f"pipeline-split: group {list(devices)} has {len(with_virtual)} collectives with the "
                            f"pipelined group, which has {len(expected)} with it; the programs do not pair up")
        for o, k in zip(with_virtual, expected):
            self.node_of[o] = ("x", k)
        involvement_count: dict[tuple, int] = {}
        for o in mine:
            if o in self.node_of:
                continue
            key = tuple(sorted(j for j, (d, _) in enumerate(self.others) if (partners(o, own) | own) & set(d)))
            k = involvement_count.get(key, 0)
            involvement_count[key] = k + 1
            self.node_of[o] = ("y", key, k)
        self.remap_group(devices, module)
        return mine

    def remap_group(self, devices: tuple[int, ...], module: ModuleOp) -> None:
        """Rename the virtual devices in another group's module: a paired collective onto its stage's, a
        parameter's layout onto its owner's, the rest onto stage 0's."""
        for f in functions(module):
            for o in f.walk():
                node = self.node_of.get(o)
                if node is not None and node[0] == "x":
                    s, stand_in = self.cross[node[1]]
                    remap_op(o, self.remaps[s])
                    if comm_signature(o) != comm_signature(stand_in):
                        raise PassError(f"pipeline-split: group {list(devices)}'s '{o.name}' does not match the "
                                        f"pipelined group's '{stand_in.name}' at the same place "
                                        f"({comm_signature(o)} vs {comm_signature(stand_in)})")
                elif isinstance(o, graph.ParameterOp):
                    remap_op(o, self.remaps[self.param_stage.get(o.tensor_name.data, 0)])
                else:
                    remap_op(o, self.remaps[0])

    def event_order(self, other_cross: list[list[Operation]]) -> dict[Event, int]:
        """Return each event's position in one order every rank can follow (or refuse the strategy)."""
        clone_node = {stand_in: ("x", k) for k, (_, stand_in) in enumerate(self.cross)}
        graph_ = _EventGraph()
        for module in self.stage_modules:
            graph_.add_chain(chain_of(module, clone_node))
        for (_, module), f in zip(self.others, self.fixed):
            if f:
                graph_.add_chain(chain_of(module, self.node_of))
        for mine, (_, module), f in zip(other_cross, self.others, self.fixed):
            if f:
                continue
            for i, o in enumerate(mine):
                graph_.node(self.node_of[o], (i, 0))
            for o, deps in _cross_dependencies(train_step(module), set(mine)).items():
                for d in deps:
                    graph_.edge(self.node_of[d], self.node_of[o])
        order = graph_.order()
        if order is None:
            piped = [list(d) for (d, _), f in zip(self.others, self.fixed) if f]
            raise PassError(f"pipeline-split: the collectives between the stages of the pipeline on "
                            f"{[list(d) for d in self.stage_devices]} and the other groups"
                            + (f" (stages {piped} of another pipeline)" if piped else "")
                            + " cannot be put in one order that every rank follows, so these stage counts and "
                            "layer placements cannot be combined (give the pipelines the same stages, or one "
                            "pipeline only)")
        return {n: i for i, n in enumerate(order)}

    def run(self) -> None:
        other_cross: list[list[Operation]] = []
        for gi, (devices, module) in enumerate(self.others):
            other_cross.append(self.match(devices, module))
            if not self.fixed[gi]:
                module.attributes[STAGE_ATTR] = IntegerAttr(0, i64)
                module.attributes[MICROBATCHES_ATTR] = IntegerAttr(1, i64)
                module.attributes[SINGLE_STAGE_ATTR] = UnitAttr()
        position = self.event_order(other_cross)
        for mine, (_, module), f in zip(other_cross, self.others, self.fixed):
            if not f:  # each other group's step in that order (a stage of another pipeline keeps its own)
                _reorder(train_step(module), sorted(mine, key=lambda o: position[self.node_of[o]]))


def join_pipeline(op: ModuleOp, pipe: Pipeline, m: int) -> None:
    """Join pipelined group `pipe`'s stage modules in physical module `op` with the other groups'."""
    size = len(pipe.devices) // pipe.pp
    stage_devices = tuple(pipe.devices[s * size:(s + 1) * size] for s in range(pipe.pp))
    groups = physical_groups(op)
    by_devices = {devices: module for devices, module in groups}
    stage_modules = [by_devices.get(d) for d in stage_devices]
    for s, module in enumerate(stage_modules):
        stage = module.attributes.get(STAGE_ATTR) if module is not None else None
        if module is None or not isinstance(stage, IntegerAttr) or stage.value.data != s \
                or SINGLE_STAGE_ATTR in module.attributes:
            raise PassError(f"join-pipeline-groups: no stage module {s} on devices {list(stage_devices[s])} "
                            "(run outline-pipeline-stages first)")
    modules = [module for module in stage_modules if module is not None]
    others = [(devices, module) for devices, module in groups if devices not in stage_devices]
    cross: dict[int, tuple[int, Operation]] = {}
    for s, module in enumerate(modules):
        for o in module.walk():
            k = o.attributes.pop(CROSS_ATTR, None)
            if isinstance(k, IntegerAttr):
                cross[k.value.data] = (s, o)
    if sorted(cross) != list(range(len(cross))):
        raise PassError(f"join-pipeline-groups: the stages' {CROSS_ATTR} indices {sorted(cross)} are not 0, 1, ...")
    if not others:
        return
    foreign = frozenset(d for devices, _ in others for d in devices)
    mesh = StageMesh(stage_devices, pipe.virtual(m), m, foreign)
    _Join(stage_devices, frozenset(mesh.virtual), modules, others, [mesh.remap(s) for s in range(pipe.pp)],
          [cross[k] for k in range(len(cross))]).run()


@dataclass(frozen=True)
class JoinPipelineGroups(ModulePass):
    """Remap and re-order the other device groups' modules around each pipelined group's stages."""

    name = "join-pipeline-groups"

    #: the id of the module's strategy to read (None: its only one)
    strategy_id: int | None = None
    #: the pipelined group to join (its index among the strategy's pipelined groups; None: all)
    group: int | None = None

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        record, pipes = selected_pipelines(op, self.strategy_id, self.group, self.name)
        for pipe in pipes:
            if pipe.union is not None:
                join_pipeline(op, pipe, record.microbatches)


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
