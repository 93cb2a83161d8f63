"""Build one pipeline stage's program from a stage-shaped step whose ops carry their stages.

`StagePlan` holds what every stage shares: the ops and their stages, kinds (once per step, per
micro-batch, after the sums) and collectives, and the messages between stages (`plan_messages`:
(value, how, from stage, to stage) -> tag). `StageBuilder(plan, s).build()` returns stage s's
`StageProgram`: `@train_step` = pre (what every micro-batch shares), one `pipeline.run`, post
(after the sums over the micro-batches), and its `@pipeline_forward` / `@pipeline_backward`.
Values reach a function as arguments: shared values, micro-batch slices, the forward's stash.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xdsl.dialects import func
from xdsl.ir import Attribute, Block, Operation, Region, SSAValue

from hspmd.dialects import comm, graph, pipeline
from hspmd.ir.devices import RankPairs
from hspmd.transforms.pipeline.devices import rank_groups, remap_op
from hspmd.transforms.pipeline.group import Collectives
from hspmd.transforms.pipeline.microbatches import (global_type, stack_input, stack_split,
                                                    union_input_microbatches)
from hspmd.transforms.pipeline.stage_mesh import (CROSS, LOCAL, MAPPED, MEET, SPLIT, VLOCAL, XMEET, XPOST, ZERO,
                                                  StageMesh, restage_global_types, run_as_virtual, stage_type)
from hspmd.transforms.util import PassError

__all__ = ["BACKWARD_FN", "FORWARD_FN", "FREE", "StageBuilder", "StagePlan", "StageProgram"]

FREE = -1
STEP, FWD, BWD = "step", "F", "B"  # where a value is made on a stage: its @train_step, forward or backward
FORWARD_FN, BACKWARD_FN = "pipeline_forward", "pipeline_backward"
#: (value, "mb" | "one" | "sum", from stage, to stage)
Message = tuple[SSAValue, str, int, int]


@dataclass
class StagePlan:
    """What every stage of one pipelined group shares while its programs are built."""

    ops: list[Operation]
    stages: dict[Operation, int]
    mesh: StageMesh
    schedule: str
    collectives: Collectives
    leaves: dict[Operation, bool]
    kind: dict[Operation, str]  # "step" | "mb" | "post" (`group.op_kinds`)
    forward_end: int
    messages: dict[Message, int] = field(default_factory=dict)  # -> tag
    #: (stage, clone) of each collective with other device groups
    placed: dict[Operation, tuple[int, Operation]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.where = {o: j for j, o in enumerate(self.ops)}
        self.set_messages(self.messages)

    def coll(self, o: Operation) -> str:
        return self.collectives.get(o, (LOCAL, ()))[0]

    def region_of(self, o: Operation) -> str:
        if self.kind[o] == "mb":
            return FWD if self.where[o] < self.forward_end else BWD
        return STEP

    def stage_of(self, v: SSAValue) -> int:
        return self.stages.get(v.owner, FREE) if isinstance(v.owner, Operation) else FREE

    def runs_on(self, o: Operation, s: int) -> bool:
        t = self.stages[o]
        return t == s or (t == FREE and isinstance(o, (graph.AssignOp, graph.OutputOp)))

    def micro_batched(self, o: Operation) -> bool:
        """A source of one slice per micro-batch: a batch input, or a split over the micro-batches."""
        return self.leaves.get(o, False) or self.coll(o) == SPLIT

    def pairs(self, t: int, c: int) -> RankPairs:
        """Return the (src, dst) pairs from stage t to stage c: the same position on both
        (the two stages' ranges, `0-2047->2048-4095`, not listed)."""
        return RankPairs(self.mesh.stages[t], self.mesh.stages[c])

    def set_messages(self, messages: dict[Message, int]) -> None:
        self.messages = messages
        self.sends_of: dict[tuple[SSAValue, int], list[tuple[str, int, int]]] = {}
        for (v, how, t, c), tag in messages.items():
            self.sends_of.setdefault((v, t), []).append((how, c, tag))


@dataclass
class StageProgram:
    """One stage's program: @train_step's ops (pre, `pipeline.run`, post) and the forward and backward."""

    step: list[Operation]
    forward: func.FuncOp
    backward: func.FuncOp


class _Function:
    """The forward or backward of a stage while it is built: ops, and placeholders for its arguments."""

    def __init__(self) -> None:
        self.ops: list[Operation] = []
        self.scratch = Block()  # placeholders (block arguments of a scratch block), replaced at the end
        self.shared: dict[SSAValue, SSAValue] = {}  # step value -> placeholder
        self.slices: dict[Operation, SSAValue] = {}  # micro-batched source -> placeholder
        self.stash: dict[SSAValue, SSAValue] = {}  # the forward's value -> placeholder (backward only)
        self.sums: list[SSAValue] = []  # values summed over the micro-batches

    def placeholder(self, typ: Attribute) -> SSAValue:
        return self.scratch.insert_arg(typ, len(self.scratch.args))

    def build(self, name: str, args: list[SSAValue], results: list[SSAValue]) -> func.FuncOp:
        """Return the function: its arguments (the placeholders, in order), then the ops and the return."""
        block = Block(arg_types=[ph.type for ph in args])
        for ph, arg in zip(args, block.args):
            ph.replace_all_uses_with(arg)
        block.add_ops([*self.ops, func.ReturnOp(*results)])
        fn = func.FuncOp(name, ([ph.type for ph in args], [r.type for r in results]), Region(block), "private")
        self.scratch.erase(safe_erase=True)
        return fn


class StageBuilder:
    """Stage s's program, built op by op: each op of the step that runs on s is cloned into
    @train_step (pre or post), the forward or the backward; `get` finds or makes its operands."""

    def __init__(self, plan: StagePlan, s: int):
        self.plan, self.s = plan, s
        self.mesh = plan.mesh
        self.m = plan.mesh.microbatches
        self.pre: list[Operation] = []
        self.post: list[Operation] = []
        self.cursor = self.pre  # where @train_step's ops go now: pre (before the run), then post
        self.fns = {FWD: _Function(), BWD: _Function()}
        self.vmap: dict[tuple[SSAValue, str], SSAValue] = {}
        self.stacked: dict[Operation, SSAValue] = {}  # micro-batched source -> its stacked value in @train_step
        self.sum_of: dict[SSAValue, SSAValue] = {}  # value -> placeholder of its sum in @train_step
        self.sums = _Function()  # (only its placeholders: the run's results, made last)
        self.stash_from: dict[SSAValue, SSAValue] = {}  # value -> the forward's value the backward gets
        self.sum_regions: list[tuple[SSAValue, str]] = []

    # -- where ops go, messages -------------------------------------------------------------
    def emit(self, region: str, op: Operation) -> None:
        (self.cursor if region == STEP else self.fns[region].ops).append(op)

    def send_made(self, v: SSAValue, new: SSAValue, region: str) -> None:
        """Send a value made here to the stages that use it (sums are sent after the run)."""
        for how, c, tag in self.plan.sends_of.get((v, self.s), []):
            if how != "sum":
                self.emit(region, comm.SendOp(new, self.plan.pairs(self.s, c), tag))

    def recv(self, v: SSAValue, how: str, t: int, region: str) -> SSAValue:
        op = comm.RecvOp(self.plan.pairs(t, self.s), v.type, self.plan.messages[(v, how, t, self.s)])
        self.emit(region, op)
        return op.result

    # -- values -----------------------------------------------------------------------------
    def get(self, v: SSAValue, region: str) -> SSAValue:
        """Return `v` as this stage has it in `region` (made, received, an argument or a clone)."""
        key = (v, region)
        if key not in self.vmap:
            if region == STEP:
                self._get_in_step(v)
            else:
                self._get_in_action(v, region)
        return self.vmap[key]

    def _is_mb(self, v: SSAValue) -> bool:
        return isinstance(v.owner, Operation) and self.plan.kind.get(v.owner) == "mb"

    def _get_in_step(self, v: SSAValue) -> None:
        owner, t, mb, s = v.owner, self.plan.stage_of(v), self._is_mb(v), self.s
        key = (v, STEP)
        if mb and self.m == 1 and t in (s, FREE):  # one micro-batch's value: its own sum
            self.vmap[key] = self.summed(v)
        elif mb and self.m == 1:
            self.vmap[key] = self.recv(v, "sum", t, STEP)
        elif t == FREE and isinstance(owner, Operation) and not mb:
            self.clone(owner, STEP)
        elif t != s and not mb:
            self.vmap[key] = self.recv(v, "one", t, STEP)
        else:
            raise PassError(f"pipeline-split: internal error: stage {s} uses '{getattr(owner, 'name', owner)}'"
                            " in @train_step before it is made there")

    def _get_in_action(self, v: SSAValue, region: str) -> None:
        owner, t, key = v.owner, self.plan.stage_of(v), (v, region)
        fn = self.fns[region]
        if not self._is_mb(v):  # a value every micro-batch shares: an argument
            inner = self.before_run(v)
            if inner not in fn.shared:
                for f in self.fns.values():
                    f.shared.setdefault(inner, f.placeholder(inner.type))
            self.vmap[key] = fn.shared[inner]
            return
        assert isinstance(owner, Operation)
        if self.plan.micro_batched(owner):
            self.source(owner)
            if owner not in fn.slices:
                for f in self.fns.values():
                    f.slices.setdefault(owner, f.placeholder(v.type))
            self.vmap[key] = fn.slices[owner]
        elif region == BWD and (v, FWD) in self.vmap:  # made (or received) by the forward: stashed
            if v not in fn.stash:
                fn.stash[v] = fn.placeholder(v.type)
                self.stash_from[v] = self.vmap[(v, FWD)]
            self.vmap[key] = fn.stash[v]
        elif t == FREE:
            self.clone(owner, region)
        elif t != self.s:
            self.vmap[key] = self.recv(v, "mb", t, region)
        else:
            raise PassError(f"pipeline-split: internal error: stage {self.s} uses '{owner.name}' "
                            f"in its {'forward' if region == FWD else 'backward'} before it is made there")

    def before_run(self, v: SSAValue) -> SSAValue:
        """Return `v` made (or received) in @train_step before the run."""
        saved, self.cursor = self.cursor, self.pre
        try:
            return self.get(v, STEP)
        finally:
            self.cursor = saved

    def summed(self, v: SSAValue) -> SSAValue:
        """Return (a placeholder for) the sum over micro-batches of a value this stage makes."""
        if v not in self.sum_of:
            owner = v.owner
            region = self.plan.region_of(owner) if isinstance(owner, Operation) and owner in self.plan.kind else FWD
            region = FWD if region == STEP else region
            self.fns[region].sums.append(self.get(v, region))
            self.sum_of[v] = self.sums.placeholder(v.type)
            self.sum_regions.append((v, region))
        return self.sum_of[v]

    def source(self, o: Operation) -> None:
        """Make (in @train_step, before the run) the stacked value of a micro-batched source."""
        if o in self.stacked:
            return
        if isinstance(o, graph.InputOp) and self.mesh.foreign and self.m > 1:
            self.stacked[o] = union_input_microbatches(o, self.mesh, self.s, self.pre)
        elif isinstance(o, graph.InputOp):  # NAME@mb: the batch as [m, rows / m, ...]
            self.stacked[o] = stack_input(o, self.mesh, self.s, self.pre)
        else:  # a split over the micro-batches (dim 0), then over the stage's positions
            assert isinstance(o, comm.LocalSplitOp)
            real = self.mesh.real(self.s, self.plan.collectives[o][1])
            self.stacked[o] = stack_split(o, self.before_run(o.operands[0]), real, self.m, self.pre)

    # -- ops ----------------------------------------------------------------------------------
    def place(self, o: Operation, new: Operation) -> None:
        """Record where a collective across device groups runs (one stage)."""
        if o in self.plan.placed:
            raise PassError(f"pipeline-split: '{o.name}' across device groups would run on stages "
                            f"{self.plan.placed[o][0]} and {self.s}; it must have one stage")
        self.plan.placed[o] = (self.s, new)

    def clone(self, o: Operation, region: str) -> None:
        """Clone op `o` of the step into `region`, on this stage's devices, and send what it makes."""
        mapping = {v: self.get(v, region) for v in o.operands}
        new = o.clone(value_mapper=mapping)
        coll, s, mesh = self.plan.coll(o), self.s, self.mesh
        if coll in (CROSS, XPOST):  # with other groups: on this stage's devices
            remap_op(new, mesh.remap(s))
            self.place(o, new)
        elif coll in (MAPPED, ZERO):
            remap_op(new, mesh.remap(s))
        elif coll == VLOCAL:
            run_as_virtual(new, mesh, s)
        elif o in self.plan.collectives:  # a collective inside one micro-batch, over this stage's devices
            new.properties["groups"] = comm.groups_attr(mesh.real(s, self.plan.collectives[o][1]))
        if isinstance(o, (graph.ParameterOp, graph.InputOp)):
            new.properties["global_type"] = stage_type(global_type(new), mesh, s, f"'{o.tensor_name.data}'")[0]
        else:
            restage_global_types([new], mesh, s)
        self.emit(region, new)
        for old, r in zip(o.results, new.results):
            self.vmap[(old, region)] = r
            self.send_made(old, r, region)

    def sum_then_reduce(self, o: Operation) -> None:
        """An all-reduce over the micro-batches: their sum (the run's result), then over the stage's dp
        ranks (or with the other groups)."""
        plan, s = self.plan, self.s
        v = o.operands[0]
        t = plan.stage_of(v)
        acc = self.summed(v) if t in (s, FREE) else self.recv(v, "sum", t, STEP)
        result = o.results[0]
        if plan.coll(o) == XMEET and isinstance(o, comm.ExchangeOp):  # the stage's pieces in the virtual ones'
            across = o.clone(value_mapper={o.input: acc})
            remap_op(across, self.mesh.remap(s))
            self.post.append(across)
            self.place(o, across)
            acc = across.result
        elif plan.coll(o) == XMEET:
            reduce = comm.AllReduceOp(acc, self.mesh.remap(s).groups(rank_groups(o)), result.type)
            self.post.append(reduce)
            self.place(o, reduce)
            acc = reduce.result
        elif len((real := self.mesh.real(s, plan.collectives[o][1]))[0]) > 1:
            reduce = comm.AllReduceOp(acc, real, result.type)
            self.post.append(reduce)
            acc = reduce.result
        self.vmap[(result, STEP)] = acc
        self.send_made(result, acc, STEP)

    def build(self) -> StageProgram:
        """Return the stage's program: pre, the forward and backward of one micro-batch, post."""
        plan, s = self.plan, self.s
        for o in plan.ops:  # 1. pre: what every micro-batch shares
            if plan.runs_on(o, s) and plan.kind[o] == "step" and not isinstance(o, (graph.AssignOp, graph.OutputOp)):
                self.clone(o, STEP)
        for o in plan.ops:  # 2. the forward and backward of one micro-batch
            if plan.runs_on(o, s) and plan.kind[o] == "mb" and not plan.micro_batched(o):
                self.clone(o, plan.region_of(o))
        self.cursor = self.post  # 3. post: the sums the other stages need, then what follows the sums
        for (v, how, t, c), tag in plan.messages.items():
            if t == s and how == "sum":
                self.post.append(comm.SendOp(self.summed(v), plan.pairs(s, c), tag))
        for o in plan.ops:
            if not plan.runs_on(o, s) or (plan.kind[o] != "post" and not isinstance(o, (graph.AssignOp,
                                                                                         graph.OutputOp))):
                continue
            if plan.coll(o) in (MEET, XMEET):
                self.sum_then_reduce(o)
            else:
                self.clone(o, STEP)
        return self.assemble()

    def assemble(self) -> StageProgram:
        """Return the stage's program from its parts: @train_step = pre, `pipeline.run`, post."""
        plan = self.plan
        fwd, bwd = self.fns[FWD], self.fns[BWD]
        shared = list(fwd.shared)  # the step values, in first-use order (the same keys in both)
        sources = list(fwd.slices)
        stash = list(bwd.stash)
        forward = fwd.build(FORWARD_FN, [fwd.shared[v] for v in shared] + [fwd.slices[o] for o in sources],
                            [self.stash_from[v] for v in stash] + fwd.sums)
        backward = bwd.build(BACKWARD_FN, [bwd.shared[v] for v in shared] + [bwd.slices[o] for o in sources]
                             + [bwd.stash[v] for v in stash], bwd.sums)
        order = [v for v, r in self.sum_regions if r == FWD] + [v for v, r in self.sum_regions if r == BWD]
        run = pipeline.RunOp(FORWARD_FN, BACKWARD_FN, shared, [self.stacked[o] for o in sources],
                             [v.type for v in order], schedule=plan.schedule, stage=self.s,
                             stages=len(self.mesh.stages), microbatches=self.m, stash=len(stash))
        for v, r in zip(order, run.results):
            self.sum_of[v].replace_all_uses_with(r)
        self.sums.scratch.erase(safe_erase=True)
        return StageProgram([*self.pre, run, *self.post], forward, backward)
