"""`pipeline-split`: one stage-shaped physical training step -> one program per pipeline stage.

`pipeline-split{devices="0,1,2,3" pp=2 tp=2 microbatches=2 schedule="gpipe" layers="1,1"}` takes
the physical IR of ONE group of virtual devices that computes one stage-shaped step, and
replaces it by one group module per stage, each with its own `@train_step`.

**Devices.** `devices` lists the real devices stage-major: stage `s` runs on
`devices[s*S:(s+1)*S]` with `S = len(devices) / pp` (pp defaults to `len(devices)`: one device
per stage). Inside a stage the devices form a data-parallel x tensor-parallel mesh, dp major,
tp minor: position `q = d*tp + t`. The input is the physical IR that `specialize-groups,
lower-reshard` make of `[0..V-1]: dp=m*dp tp=tp` (V = m*S; `[d]: dp=1` when V = 1): its dp axis
is micro-batches x data-parallel ranks, micro-batch major, so virtual position
`p = mb*S + q`. Virtual position p stands for real position `q = p % S` of every stage, working
on micro-batch `mb = p // S`. So the one-group program already holds the tp collectives (over
the tp ranks of one micro-batch) and the all-reduces where micro-batches and dp ranks meet.

* **collectives** whose every rank group lies inside one micro-batch run as they are, per
  micro-batch, over the stage's real devices (virtual position p -> `stage[p % S]`);
  callees (block functions) get the same remapping;
* an **all-reduce whose groups span micro-batches** (each group must be all m micro-batches
  times one set Q of positions) becomes a local left-to-right sum over the micro-batches,
  then a real all-reduce over the stage devices at Q when Q has more than one position; any
  other collective spanning micro-batches is refused;
* **leaves** (parameters and inputs) keep their layouts, moved onto each stage's devices: the
  major mesh axis of a virtual layout holds the micro-batches, so its degree is divided by m
  (a parameter replicated over micro-batches: `dup=2, split(1)=2` -> `split(1)=2` for m=2,
  dp=1, tp=2); a batch input split over them (`split(0)`; with one micro-batch, every input
  of rank >= 1) becomes `x@mb`, the batch viewed as `[m, rows / m, ...]` with its rows split
  over the stage's dp ranks (dim 1), which the worker makes from the global batch; action i
  gets slice i. A parameter split over micro-batches (ZeRO) is refused.

Every op of the step goes to one stage:

* **layers**: the forward `func.call`s of `*_fwd` block functions, in order (a model without
  block calls: the parameter name prefixes, `layers.0.weight` -> `layers.0`); with
  `layers="3,1"` stage s takes the next `layers[s]` of them (the counts must add up to the
  number of layers), else contiguous ranges balanced by cost: a layer costs its forward ops
  (a matmul 2mnk, any other op one per result element), stage 0 also pays the forward before
  the first layer (the embedding) and the last stage what follows the last layer (the head,
  the loss), and the counts make the largest stage cost smallest (ties: earlier stages take
  more layers); the parameters a layer reads go with it. Fewer layers than stages is
  refused with one message naming both numbers.
* **forward** ops (up to `graph.output "loss"`): the last stage among their operands and the
  parameters they read (a parameter no layer claims goes to its first forward user's stage:
  the embedding to stage 0, the head to the last);
* **backward and update** ops: the stage of a parameter they read; else the one stage all
  their operands come from, or the stage of a weight's transpose they use; a view (transpose,
  reshape, broadcast, cast) of forward values only goes to its users' last stage; else the
  first stage among their users (so an activation's gradient is computed where its layer
  lives); `graph.assign` with its parameter; optimizer
  state `opt.<kind>.NAME` with parameter NAME;
* **free** values (constants, inputs, scalar optimizer state like `opt.step`, and ops of only
  those) belong to no stage: each stage that needs one computes its own copy (and updates its
  own copy of `opt.step`).

A value used on another stage than its producer's is sent with `comm.send` and received with
`comm.recv` between the same position q of both stages (pairs `[stage_t[q], stage_c[q]]` for
every q), each message with its own tag; with one micro-batch every stage computes exactly the
numbers of the one-group step. `graph.output "loss"` is on every stage (the loss is sent to
the others). The group modules carry `hspmd.pipeline_stage` and `hspmd.microbatches`; a
stage's program is the same for each of its ranks and does not grow with them.

**A stage's program** (`hspmd.dialects.pipeline`): `@train_step` holds the ops that do not
depend on the batch (parameters, their views, copies of free ops: "pre"), one `pipeline.run`,
then the ops after the sums over micro-batches (the all-reduces over the stage's dp ranks, the
update, outputs and assignments: "post"). `@pipeline_forward` holds the stage's forward ops of
one micro-batch, `@pipeline_backward` its backward ops; values pass as arguments: what pre
makes (shared), micro-batch i's slices, and the forward values the backward needs (the stash).
An all-reduce of the one-group program over the micro-batches becomes a result of the run
(the sum over the micro-batches in their order; a value made on another stage is summed there
and sent after its run), then an all-reduce over the stage's dp ranks when it has several. The
program does not grow with the micro-batches: the runtime walks the `schedule`
(`hspmd.ir.pipeline_schedule`: "gpipe" or "1f1b", checked complete and runnable here).

**Messages**: a send goes right after its value is made (it does not block), a receive right
before the first use of its value in the function that uses it. A micro-batch's value may go
from a forward to a later stage's forward, from a backward to an earlier stage's backward, or
from a forward to any stage's backward; a stage assignment that needs another flow (an action
waiting for one that the schedule runs after it) is refused with a message naming the op.
Since every stage runs the forwards, and the backwards, in micro-batch order, the k-th message
with a tag is micro-batch k's; receives wait only for earlier actions, so no rank deadlocks.

**Beside other device groups** (`virtual="0,1"`: the devices of the stage-shaped group in a
physical IR with several groups): only that group's module is cut; in leaves' union layouts
the stage takes the virtual group's place (its micro-batch axis divided by m; the batch shape
stays the whole batch's); a collective that moves data to or from another group is `CROSS`
(one micro-batch: it runs on one stage, renamed onto its devices), one that only names other
groups' devices is `MAPPED`. With m > 1 micro-batches, a cross-group all-reduce of a
per-micro-batch value (`XMEET`) becomes the sum over the micro-batches, then one all-reduce
with the other groups; a local_zero over the micro-batches of a summed value (`ZERO`) becomes
one over the stage and the cross-group all-reduce after it (`XPOST`) runs once; an exchange that
sums the group's pieces across groups (its virtual group partial over the micro-batches) is an
`XMEET` too; one whose transfers all stay on one device (`VLOCAL`: a replicated bias into the
batch's rows) keeps the virtual layouts and runs in each micro-batch as its virtual device; a batch input
the other groups share is read as the group's rows, viewed as m micro-batches and split over
the stage's dp ranks; other exchanges across groups are refused. Then
`hetero_pipeline.join_groups` remaps and re-orders the other groups' modules (see its
docstring for why no rank deadlocks).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerAttr, ModuleOp, StringAttr, TensorType, i64
from xdsl.ir import Attribute, Block, Operation, Region, SSAValue
from xdsl.passes import ModulePass

from hspmd.dialects import comm, graph, pipeline
from hspmd.dialects.graph import i64_array
from hspmd.dialects.dist import layout_of, with_layout
from hspmd.ir.layout import DUP, PARTIAL, DistributedStates, Group, Layout, split
from hspmd.dialects.levels import DEVICES_ATTR, devices_attr, physical_groups
from hspmd.ir.pipeline_schedule import SCHEDULES, PipelineScheduleError, check_schedule
from hspmd.dialects.pipeline import MICROBATCHES_ATTR, STAGE_ATTR
from hspmd.transforms.hetero_pipeline import comm_devices, join_groups, partners, remap_layout, remap_op
from hspmd.transforms.pipeline.virtual import pipelines
from hspmd.transforms.util import PassError, module_strategy


@dataclass(frozen=True)
class StageMesh:
    """The real devices of each stage and how the one-group program's virtual devices map onto them.

    Virtual position `p` (index in `virtual`) is micro-batch `p // size` at stage position
    `p % size`; stage position q is real device `stages[s][q]` on stage s (q = d*tp + t).
    """

    stages: tuple[tuple[int, ...], ...]
    virtual: tuple[int, ...]
    microbatches: int
    #: the devices of the other groups of a heterogeneous strategy (`virtual=...`)
    foreign: frozenset[int] = frozenset()

    def device_map(self, s: int) -> dict[int, int]:
        """Return virtual device -> stage s's real device (one micro-batch: position p is `stages[s][p]`)."""
        return {v: self.stages[s][p % self.size] for p, v in enumerate(self.virtual)}

    def collapse(self, s: int, group) -> list[int]:
        """Return a rank group with virtual devices on stage s's real devices (position p -> p % size),
        each once, in first-seen order; other groups' devices stay."""
        where = {v: p for p, v in enumerate(self.virtual)}
        out: list[int] = []
        for d in group:
            real = self.stages[s][where[d] % self.size] if d in where else d
            if real not in out:
                out.append(real)
        return out

    def remap(self, s: int) -> "StageRemap":
        """Return how stage s renames the virtual devices in rank groups and layouts."""
        return StageRemap(self, s)

    @property
    def size(self) -> int:
        """Return the number of devices of one stage (dp * tp)."""
        return len(self.stages[0])

    def positions(self, group) -> list[int]:
        """Return the virtual positions of a rank group of virtual devices."""
        try:
            return [self.virtual.index(d) for d in group]
        except ValueError:
            raise PassError(f"pipeline-split: rank group {list(group)} names a device outside the "
                            f"one-group program's devices {list(self.virtual)}") from None

    def real(self, s: int, groups) -> list[list[int]]:
        """Return stage `s`'s real devices for groups of stage positions."""
        return [[self.stages[s][q] for q in g] for g in groups]


@dataclass(frozen=True)
class StageRemap:
    """Rank groups and layouts of the one-group program (and of the groups beside it) on stage s.

    Rank groups collapse (`StageMesh.collapse`); a layout whose group is the virtual devices
    gets the stage's layout in its place (`stage_layout`: the micro-batches' axis divided by m).
    """

    mesh: StageMesh
    s: int

    def groups(self, groups) -> list[list[int]]:
        return [self.mesh.collapse(self.s, g) for g in groups]

    def layout(self, layout: Layout) -> Layout:
        if self.mesh.microbatches == 1:
            return remap_layout(layout, self.mesh.device_map(self.s))
        if not set(layout.devices) & set(self.mesh.virtual):
            return layout
        return stage_layout(layout, self.mesh, self.s, f"layout '{layout}'")[0]


LOCAL, MEET, SPLIT, CROSS, MAPPED = "local", "meet", "split", "cross", "mapped"
# with micro-batches beside other groups: an exchange whose transfers each stay on one device (VLOCAL)
# runs per micro-batch as that micro-batch's virtual device (`comm.exchange {microbatch_ranks}`)
VLOCAL = "vlocal"
# with micro-batches beside other groups: a sum across groups and micro-batches (XSPAN, resolved by its
# operand into XMEET: the micro-batches' sum then the cross-group sum, or XPOST: the sum of a value
# zeroed on all but one micro-batch by a ZERO, a local_zero over the micro-batches of a summed value)
XSPAN, XMEET, XPOST, ZERO = "xspan", "xmeet", "xpost", "zero"


def _run_as_virtual(o: Operation, mesh: StageMesh, s: int) -> None:
    """Let an exchange (`VLOCAL`) or a dropout over the virtual devices run on stage s per micro-batch."""
    o.properties["microbatch_ranks"] = i64_array(mesh.virtual)
    o.properties["stage_ranks"] = i64_array(mesh.stages[s])


def _sums_microbatches(o: comm.ExchangeOp, mesh: StageMesh) -> bool:
    """Return whether an exchange with other groups takes the virtual group's pieces as partial sums
    over the micro-batches (the major axis) and gives every micro-batch the same result."""
    m = mesh.microbatches

    def major(layout: Layout):
        g = next((g for g in layout.groups if g.devices == mesh.virtual), None)
        return g.states.axes[0] if g is not None and g.states.axes else None

    src, dst = major(o.src.data), major(o.dst.data)
    return (src is not None and src[0] == PARTIAL and src[1] % m == 0
            and (dst is None or (dst[0] == DUP and dst[1] % m == 0)))


def classify_collective(o: Operation, mesh: StageMesh) -> tuple[str, tuple[tuple[int, ...], ...]]:
    """Return how the stages run a collective of the one-group program, and over which stage positions.

    (LOCAL, groups) for a collective inside one micro-batch; (MEET, groups Q) for an
    all-reduce over all micro-batches times Q (a sum over micro-batches, then an all-reduce
    over Q); (SPLIT, groups Q) for a local split over all micro-batches times Q, micro-batch
    major (micro-batch i's slice i of m, then a local split over Q); (CROSS, ()) for a
    collective with other groups of a heterogeneous strategy (`hetero_pipeline`: it runs on
    one stage, every virtual device renamed to that stage's real one); (MAPPED, ()) for one
    that names other groups' devices but moves no data to or from them (an exchange whose
    transfers stay inside each group): each stage runs it with its real devices. With
    micro-batches beside other groups: (XSPAN, ()) for a cross-group all-reduce (each group's
    virtual part all micro-batches times one position set), (ZERO, groups Q) for a local_zero
    over the micro-batches (of a value every micro-batch holds whole).
    """
    size, m = mesh.size, mesh.microbatches
    if mesh.foreign and comm_devices(o) & mesh.foreign:
        crossing = partners(o, frozenset(mesh.virtual))
        if m == 1:
            return (CROSS if crossing else MAPPED), ()
        virtual = set(mesh.virtual)
        if isinstance(o, comm.ExchangeOp) and not crossing and all(
                s == d for s, d, _ in o.transfer_list() if s in virtual or d in virtual):
            return VLOCAL, ()
        if isinstance(o, comm.ExchangeOp) and _sums_microbatches(o, mesh):
            return XSPAN, ()  # a sum across groups of partial pieces (the micro-batches' among them)
        if not crossing or not isinstance(o, comm.AllReduceOp):
            raise PassError(f"pipeline-split: '{o.name}' moves data across device groups inside a micro-batch; "
                            f"with microbatches={m} a pipelined group beside other groups may only sum across groups "
                            "(all-reduces of gradients and the loss), so use microbatches=1 (or the same tp in every "
                            "group)")
        for g in o.rank_groups:  # type: ignore[attr-defined]
            by_mb: dict[int, set[int]] = {}
            for p in mesh.positions([d for d in g if d not in mesh.foreign]):
                by_mb.setdefault(p // size, set()).add(p % size)
            if by_mb and (len(by_mb) != m or len({frozenset(v) for v in by_mb.values()}) != 1):
                raise PassError(f"pipeline-split: '{o.name}' group {list(g)} sums across device groups over some "
                                f"but not all {m} micro-batches, or other positions in each (as tensor parallelism "
                                "in several pipelined groups does: use tp=1 there, or microbatches=1)")
        return XSPAN, ()
    groups = [mesh.positions(g) for g in o.rank_groups]  # type: ignore[attr-defined]
    kind = LOCAL
    out: set[tuple[int, ...]] = set()
    if all(len({p // size for p in g}) == 1 for g in groups):
        out = {tuple(p % size for p in g) for g in groups}
    else:
        zero = bool(mesh.foreign) and isinstance(o, comm.LocalZeroOp)
        if not isinstance(o, (comm.AllReduceOp, comm.LocalSplitOp)) and not zero:
            raise PassError(f"pipeline-split: '{o.name}' over {[list(g) for g in o.rank_groups]} "  # type: ignore
                            "spans micro-batches; only all-reduces (sums over the micro-batches) and local "
                            "splits may")
        kind = MEET if isinstance(o, comm.AllReduceOp) else ZERO if zero else SPLIT
        for g in groups:
            by_mb: dict[int, list[int]] = {}
            for p in g:
                by_mb.setdefault(p // size, []).append(p % size)
            mb_major = [p // size for p in g] == sorted(p // size for p in g)
            if len(by_mb) != m or len({tuple(v if kind == SPLIT else sorted(v)) for v in by_mb.values()}) != 1 \
                    or (kind == SPLIT and not mb_major):
                raise PassError(f"pipeline-split: '{o.name}' group {[mesh.virtual[p] for p in g]} spans some "
                                f"but not all {m} micro-batches, or other positions in each")
            first = by_mb[min(by_mb)]
            out.add(tuple(first if kind == SPLIT else sorted(first)))
    flat = sorted(q for g in out for q in g)
    if flat != list(range(size)):
        raise PassError(f"pipeline-split: '{o.name}' over {[list(g) for g in o.rank_groups]}: "  # type: ignore
                        "its groups differ between micro-batches, so the stage cannot run it as one collective")
    return kind, tuple(sorted(out))


def stage_layout(layout: Layout | None, mesh: StageMesh, s: int, what: str) -> tuple[Layout, int | None]:
    """Return (the layout of a value on stage s's devices, the tensor dim split over the micro-batches).

    The major axis of the one-group layout holds the micro-batches: its degree is divided by
    m. The dim is None when the micro-batches hold replicas or partial sums (or m = 1). In a
    union with other groups (`virtual=...`) the stage's group replaces the virtual one.
    """
    mine = [i for i, g in enumerate(layout.groups) if g.devices == mesh.virtual] if layout is not None else []
    if layout is None or not mine or (len(layout.groups) > 1 and not mesh.foreign):
        raise PassError(f"pipeline-split: {what} has layout '{layout}', not one over the one-group "
                        f"program's devices {list(mesh.virtual)}")
    states = layout.groups[mine[0]].states
    m = mesh.microbatches
    dim = None
    if m > 1:
        axis, degree = states.axes[0]
        if degree % m:
            raise PassError(f"pipeline-split: {what} is laid out as '{layout}'; with {m} micro-batches its major "
                            f"mesh axis must have a degree divisible by {m} (it holds the micro-batches)")
        states = DistributedStates(((axis, degree // m), *states.axes[1:]))
        dim = axis.dim if axis.kind == "split" else None
    groups = list(layout.groups)  # a union with other groups (hetero_pipeline): the stage in the group's place
    groups[mine[0]] = Group(mesh.stages[s], states)
    return Layout(tuple(groups), layout.hetero, layout.shares), dim


def stage_type(typ: TensorType, mesh: StageMesh, s: int, what: str) -> tuple[TensorType, int | None]:
    """Return (the annotated type `typ` of the one-group program on stage s, the micro-batch dim):
    one micro-batch's global shape (the dim split over micro-batches divided by m), the stage's layout."""
    layout, dim = stage_layout(layout_of(typ), mesh, s, what)
    shape = list(typ.get_shape())
    if dim is not None and len(layout.groups) == 1:  # (a union keeps the whole batch's shape)
        shape[dim] //= mesh.microbatches
    return with_layout(TensorType(typ.element_type, shape), layout), dim


def _restage_global_types(ops, mesh: StageMesh, s: int) -> None:
    """Put the `global_type` of position-dependent ops (embedding, one_hot, dropout) on stage s.

    A dropout of one micro-batch (split over the micro-batches, one device group) also records
    their number and dim, so that the runtime keys its mask by the whole tensor's indices."""
    for o in ops:
        typ = o.properties.get("global_type")
        if isinstance(typ, TensorType) and layout_of(typ) is not None \
                and not isinstance(o, (graph.ParameterOp, graph.InputOp)):
            staged, dim = stage_type(typ, mesh, s, f"the result of '{o.name}'")
            if isinstance(o, graph.DropoutOp) and dim is not None and len(layout_of(typ).groups) > 1:  # type: ignore
                _run_as_virtual(o, mesh, s)  # beside other groups: the virtual layout, as each micro-batch's device
                continue
            o.properties["global_type"] = staged
            if isinstance(o, graph.DropoutOp) and dim is not None:
                o.properties["microbatches"] = IntegerAttr(mesh.microbatches, i64)
                o.properties["microbatch_dim"] = IntegerAttr(dim, i64)


def _layers(ops: list[Operation], forward_end: int) -> tuple[list[list[Operation]], dict[str, int], str]:
    """Return (layer -> forward ops that are the layer, parameter name -> layer, what a layer is)."""
    calls = [op for op in ops[:forward_end] if isinstance(op, func.CallOp)
             and op.callee.root_reference.data.endswith("_fwd")]
    params: dict[str, int] = {}
    if calls:
        for k, call in enumerate(calls):
            for v in call.operands:
                if isinstance(v.owner, graph.ParameterOp):
                    params.setdefault(v.owner.tensor_name.data, k)
        return [[c] for c in calls], params, "block calls"
    prefixes: list[str] = []
    for op in ops[:forward_end]:
        if isinstance(op, graph.ParameterOp) and any(u.operation in ops[:forward_end] for u in op.result.uses):
            name = op.tensor_name.data
            prefix = name.rsplit(".", 1)[0] if "." in name else name
            if prefix not in prefixes:
                prefixes.append(prefix)
            params[name] = prefixes.index(prefix)
    return [[] for _ in prefixes], params, "parameter groups"


@dataclass(frozen=True)
class PipelineSplit(ModulePass):
    """Split a stage-shaped one-group physical step into one group module per pipeline stage."""

    name = "pipeline-split"

    #: the id of the module's strategy to read (None: its only one)
    strategy_id: int | None = None

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        record = module_strategy(op, self.strategy_id, self.name)
        for pipe in pipelines(record.strategy, record.microbatches):
            split_group(op, pipe.devices, pipe.pp, pipe.tp, record.microbatches, record.schedule, pipe.layers,
                        pipe.virtual(record.microbatches) if pipe.union is not None else None)


def split_group(op: ModuleOp, devices: tuple[int, ...], pp: int, tp: int, m: int, schedule_name: str,
                layer_counts: tuple[int, ...] | None, virtual_devices: tuple[int, ...] | None) -> None:
    """Cut the physical step of one pipelined group (its virtual devices: `virtual_devices`, or the
    module's only group) into one group module per stage (see the module docstring)."""
    if pp < 2 or len(devices) % pp:
        raise PassError(f"pipeline-split: pp={pp} stages do not divide the {len(devices)} devices "
                        f"{list(devices)} (and a pipeline needs pp >= 2)")
    size = len(devices) // pp
    if tp < 1 or size % tp:
        raise PassError(f"pipeline-split: tp={tp} does not divide the {size} devices of a stage")
    stage_devices = tuple(devices[s * size:(s + 1) * size] for s in range(pp))
    groups = physical_groups(op)
    schedule = SCHEDULES[schedule_name]
    dp = size // tp
    other_groups: list[tuple[tuple[int, ...], ModuleOp]] = []
    if virtual_devices is not None:  # a pipelined group beside other groups (hetero_pipeline)
        want = tuple(virtual_devices)
        mine = [g for g in groups if g[0] == want]
        if len(mine) != 1 or len(want) != m * size:
            raise PassError(f"pipeline-split: virtual devices {list(want)} must be the devices of one group of the "
                            f"input, {m} micro-batch(es) x {size} devices of a stage (it has groups "
                            f"{[list(g) for g, _ in groups]})")
        other_groups = [g for g in groups if g[0] != want]
        groups = mine
        if set(devices) & {d for g, _ in other_groups for d in g}:
            raise PassError(f"pipeline-split: devices {list(devices)} overlap another group's "
                            f"{[list(g) for g, _ in other_groups]}")
    if len(groups) != 1 or len(groups[0][0]) != m * size:
        raise PassError(f"pipeline-split: the input must be the physical IR of one group of {m * size} devices, "
                        f"{m} micro-batch(es) x {size} devices of a stage (`[0-{m * size - 1}]: dp={m * dp} "
                        f"tp={tp}` before the split) (it has groups {[list(g) for g, _ in groups]}); "
                        "with other device groups beside it, name its devices with virtual=...")
    (virtual, group), = groups
    if op is group:
        raise PassError("pipeline-split: the physical module must hold its group module (run specialize-groups)")
    foreign = frozenset(d for g, _ in other_groups for d in g)
    if foreign & set(virtual):
        raise PassError(f"pipeline-split: the virtual devices {list(virtual)} overlap another group's")
    mesh = StageMesh(stage_devices, tuple(virtual), m, foreign)
    functions = [f for f in group.body.block.ops if isinstance(f, func.FuncOp)]
    step = next((f for f in functions if f.sym_name.data == "train_step"), None)
    if step is None:
        raise PassError("pipeline-split: the group has no @train_step")
    ops = [o for o in step.body.block.ops if not isinstance(o, func.ReturnOp)]
    collectives: dict[Operation, tuple[str, tuple[tuple[int, ...], ...]]] = {}
    for f in functions:
        for o in f.walk():
            if o.dialect_name() != "comm":
                continue
            if not hasattr(o, "rank_groups") and not (isinstance(o, comm.ExchangeOp)
                                                      and comm_devices(o) & mesh.foreign):
                raise PassError(f"pipeline-split: '{o.name}' in the one-group step: only collectives are "
                                "supported there (point-to-point messages are the split's own)")
            collectives[o] = classify_collective(o, mesh)
            if f is not step and collectives[o][0] not in (LOCAL, MAPPED, VLOCAL):
                raise PassError(f"pipeline-split: '{o.name}' in @{f.sym_name.data} spans micro-batches or "
                                "device groups; only the step itself may")
    leaves: dict[Operation, bool] = {}  # leaf -> split over the micro-batches
    for o in ops:
        if isinstance(o, (graph.ParameterOp, graph.InputOp)):
            what = f"{'parameter' if isinstance(o, graph.ParameterOp) else 'input'} '{o.tensor_name.data}'"
            _, dim = stage_layout(layout_of(o.properties["global_type"]), mesh, 0, what)
            # batch inputs come in micro-batches (one micro-batch: every input of rank >= 1)
            leaves[o] = dim is not None or (m == 1 and isinstance(o, graph.InputOp)
                                            and len(o.result.type.get_shape()) > 0)
            if dim is not None and (isinstance(o, graph.ParameterOp) or dim != 0):
                raise PassError(f"pipeline-split: {what} is split over the micro-batches along dim {dim}; "
                                "only batch inputs may be, along dim 0 (ZeRO is not combined with pipeline "
                                "stages)")
    plan = schedule(pp, m)
    try:
        order = check_schedule(plan, m)
    except PipelineScheduleError as err:
        raise PassError(f"pipeline-split: schedule '{schedule_name}': {err}") from None
    post = {o for o, k in _kinds(ops, collectives, leaves, m).items() if k == "post"}
    stages = _assign(ops, pp, layer_counts, post)
    placed: dict[Operation, tuple[int, Operation]] = {}
    taken = {f.sym_name.data for f in functions} & {FORWARD_FN, BACKWARD_FN}
    if taken:
        raise PassError(f"pipeline-split: the group already has a function @{', @'.join(sorted(taken))}; "
                        "those names are the stages' own")
    programs = _emit_stages(ops, stages, mesh, schedule_name, order, collectives, leaves, placed)
    modules = []
    for s, devs in enumerate(stage_devices):
        fn = func.FuncOp("train_step", ((), ()))
        fn.body.block.add_ops([*programs[s].step, func.ReturnOp()])
        others = [programs[s].forward, programs[s].backward] + [f.clone() for f in functions if f is not step]
        for f in others[2:]:  # the callees' collectives (inside one micro-batch) on this stage's devices
            for o in f.walk():
                if o.dialect_name() == "comm" and classify_collective(o, mesh)[0] == VLOCAL:
                    _run_as_virtual(o, mesh, s)
                elif o.dialect_name() == "comm" and classify_collective(o, mesh)[0] == MAPPED:
                    remap_op(o, mesh.device_map(s))
                elif o.dialect_name() == "comm":
                    o.properties["groups"] = comm.groups_attr(mesh.real(s, classify_collective(o, mesh)[1]))
            _restage_global_types(f.walk(), mesh, s)
        module = ModuleOp([fn, *others], attributes={DEVICES_ATTR: devices_attr(devs),
                                                    STAGE_ATTR: IntegerAttr(s, i64),
                                                    MICROBATCHES_ATTR: IntegerAttr(m, i64)})
        modules.append(module)
    if other_groups:  # cross-group collectives onto the stages' devices, the other groups in a safe order
        join_groups(modules, stage_devices, virtual, [mesh.remap(s) for s in range(pp)],
                    [o for o in ops if collectives.get(o, (LOCAL,))[0] in (CROSS, XMEET, XPOST)], placed,
                    other_groups)
    for module in modules:  # the stages where the one-group module was
        op.body.block.insert_op_before(module, group)
    group.detach()
    group.erase()
    for gi, (_, module) in enumerate(physical_groups(op)):
        module.sym_name = StringAttr(f"group{gi}")


FREE = -1
_VIEWS = (graph.TransposeOp, graph.ReshapeOp, graph.BroadcastOp, graph.CastOp)


def _stage_of_layers(n: int, pp: int, counts: tuple[int, ...] | None, what: str,
                     costs: tuple[list[int], int, int] | None = None) -> list[int]:
    """Return each of n layers' stage: the given counts per stage, else contiguous ranges balanced
    by cost (`costs`: each layer's, then what the first and the last stage do besides their
    layers; the largest stage cost as small as it can be, ties giving earlier stages more
    layers), else by count."""
    if n < pp:
        raise PassError(f"pipeline-split: pp={pp} stages need at least {pp} layers, but the model has {n} layers "
                        f"({what}); use pp <= {n}")
    if counts is None and costs is not None:
        counts = _balanced_counts(*costs, pp)
    if counts is None:
        return [k * pp // n for k in range(n)]
    if sum(counts) != n:
        raise PassError(f"pipeline-split: layers={':'.join(map(str, counts))} gives {sum(counts)} layers to the "
                        f"stages, but the model has {n} layers ({what}); the counts must add up to {n}")
    return [s for s, c in enumerate(counts) for _ in range(c)]


def _balanced_counts(layer_costs: list[int], first: int, last: int, pp: int) -> tuple[int, ...]:
    """Return per-stage layer counts (each >= 1, contiguous) whose largest stage cost is smallest:
    stage 0 also pays `first`, the last stage `last`; among the best, earlier stages take more layers."""
    n = len(layer_costs)
    prefix = [0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, a: int, b: int) -> int:  # stage s holding layers a..b-1
        return prefix[b] - prefix[a] + (first if s == 0 else 0) + (last if s == pp - 1 else 0)

    from functools import lru_cache

    @lru_cache(maxsize=None)
    def best(s: int, a: int) -> tuple[int, tuple[int, ...]]:
        """The best (largest stage cost, counts) for stages s.. holding layers a.."""
        if s == pp - 1:
            return cost(s, a, n), (n - a,)
        options = []
        for b in range(n - (pp - 1 - s), a, -1):  # more layers first: ties keep the larger count
            rest, counts = best(s + 1, b)
            options.append((max(cost(s, a, b), rest), (b - a, *counts)))
        return min(options, key=lambda o: o[0])

    return best(0, 0)[1]


def _op_cost(op: Operation, funcs: dict[str, func.FuncOp]) -> int:
    """Return a rough cost of running `op` once: 2mnk for a matmul, one per result element
    otherwise, a callee's ops summed for a call."""
    if isinstance(op, func.CallOp):
        callee = funcs.get(op.callee.root_reference.data)
        return sum(_op_cost(o, funcs) for o in callee.body.block.ops) if callee is not None else 0
    total = 0
    for r in op.results:
        if isinstance(r.type, TensorType):
            elements = 1
            for d in r.type.get_shape():
                elements *= d
            total += elements
    if isinstance(op, graph.MatmulOp):
        total *= 2 * op.operands[0].type.get_shape()[-1]  # type: ignore[attr-defined]
    return total


def _layer_costs(ops: list[Operation], forward_end: int, layers: list[list[Operation]],
                 layer_of_param: dict[str, int], funcs: dict[str, func.FuncOp]) -> tuple[list[int], int, int]:
    """Return (each layer's forward cost, the forward cost before the first layer, after the last one).

    A layer's cost is that of its block call, or (layers as parameter groups) of the forward
    ops reading its parameters; the rest of the forward counts for the first stage when it
    comes before the first layer (an embedding), for the last when after the last (a head, the loss).
    """
    costs = [0] * len(layers)
    first = last = 0
    seen_layer = False
    where = {o: k for k, group in enumerate(layers) for o in group}
    for op in ops[:forward_end]:
        k = where.get(op)
        if k is None and not any(layers):  # parameter groups: the op of the layer whose weight it reads
            k = next((layer_of_param[v.owner.tensor_name.data] for v in op.operands
                      if isinstance(v.owner, graph.ParameterOp) and v.owner.tensor_name.data in layer_of_param), None)
        c = _op_cost(op, funcs)
        if k is not None:
            costs[k] += c
            seen_layer = True
            last = 0  # what follows a layer counts only when no layer comes after it
        elif not seen_layer:
            first += c
        else:
            last += c
    return costs, first, last


def _assign(ops: list[Operation], pp: int, counts: tuple[int, ...] | None = None,
            post: frozenset[Operation] | set[Operation] = frozenset()) -> dict[Operation, int]:
    """Return op -> stage (FREE for ops every stage may compute itself); see the module docstring.

    `post` holds the ops that run after every action of the schedule (the update, the sums
    over micro-batches and what follows them)."""
    forward_end = next((i + 1 for i, o in enumerate(ops) if isinstance(o, graph.OutputOp)
                        and o.tensor_name.data == "loss"), None)
    if forward_end is None:
        raise PassError("pipeline-split: the step has no graph.output \"loss\" (the end of the forward)")
    layers, layer_of_param, what = _layers(ops, forward_end)
    module = ops[0].parent_op().parent_op() if ops and ops[0].parent_op() is not None else None
    funcs = {f.sym_name.data: f for f in module.body.block.ops if isinstance(f, func.FuncOp)} \
        if isinstance(module, ModuleOp) else {}
    costs = _layer_costs(ops, forward_end, layers, layer_of_param, funcs) if len(layers) >= pp else None
    stage_of_layer = _stage_of_layers(len(layers), pp, counts, what, costs)
    param_stage: dict[str, int] = {name: stage_of_layer[k] for name, k in layer_of_param.items()}
    layer_ops = {o: stage_of_layer[k] for k, group in enumerate(layers) for o in group}
    stage: dict[Operation, int] = {}
    value_stage = lambda v: stage.get(v.owner, FREE) if isinstance(v.owner, Operation) else FREE  # noqa: E731

    def param_name(o: Operation) -> str | None:
        return o.tensor_name.data if isinstance(o, graph.ParameterOp) else None

    def owner_of_state(name: str) -> int | None:
        if name in param_stage:
            return param_stage[name]
        if name.startswith("opt.") and name.count(".") >= 2:
            return param_stage.get(name.split(".", 2)[2])
        return None

    undecided: list[Operation] = []
    views: list[Operation] = []
    pinned_ops: set[Operation] = set()  # backward ops that read a parameter
    forward_ops = set(ops[:forward_end])
    for i, o in enumerate(ops):
        if isinstance(o, graph.ParameterOp):
            continue  # decided below, when a user settles it
        if isinstance(o, graph.AssignOp):
            s = owner_of_state(o.tensor_name.data)
            stage[o] = FREE if s is None else s
            continue
        if isinstance(o, graph.OutputOp):
            stage[o] = FREE if o.tensor_name.data == "loss" else value_stage(o.value)
            continue
        forward = i < forward_end
        params = [v.owner for v in o.operands if isinstance(v.owner, graph.ParameterOp)]
        pinned = [s for p in params if (s := owner_of_state(param_name(p))) is not None]
        others = {value_stage(v) for v in o.operands if not isinstance(v.owner, graph.ParameterOp)} - {FREE}
        if o in layer_ops:
            s = layer_ops[o]
        elif forward:
            s = max([*pinned, *others], default=None)
            if s is None and params:
                s = 0
            unclaimed = [p for p in params if owner_of_state(param_name(p)) is None]
            if s is not None:
                for p in unclaimed:
                    param_stage.setdefault(param_name(p), s)
        elif pinned:
            s = max(pinned)
            pinned_ops.add(o)
        elif any(v.owner in pinned_ops for v in o.operands):  # uses a weight's transpose: with the weight
            s = max(stage[v.owner] for v in o.operands if v.owner in pinned_ops)
        elif isinstance(o, _VIEWS) and others and all(v.owner in forward_ops for v in o.operands
                                                       if value_stage(v) != FREE):
            views.append(o)  # a view of a forward value (a residual's transpose): with its users
            stage[o] = -2
            continue
        elif -2 in others:
            undecided.append(o)
            stage[o] = -2
            continue
        elif len(others) == 1:
            s = next(iter(others))
        elif not others:
            s = None  # free
        else:
            undecided.append(o)
            stage[o] = -2  # not FREE: decided in the reverse pass
            continue
        stage[o] = FREE if s is None else s
    # Backward values made in an action flow from later stages to earlier ones (B(i) runs on
    # stage s+1 before stage s); values made after every action ("post") go anywhere.
    where = {o: i for i, o in enumerate(ops)}
    resolved = sorted([*undecided, *views], key=where.__getitem__)
    for o in reversed(resolved):
        users = [u.operation for r in o.results for u in r.uses
                 if u.operation in stage and not isinstance(u.operation, graph.OutputOp)]
        stages = {stage[u] for u in users} - {FREE, -2}
        floor = max({stage[u] for u in users if u not in post} - {FREE, -2}, default=0)
        if stages:
            stage[o] = max(stages) if o in views else max(min(stages), floor)
        else:
            stage[o] = max(value_stage(v) for v in o.operands)
    for o in resolved:  # then up to where its forward operands (else its operands) live, where allowed
        made = [v for v in o.operands if value_stage(v) != FREE]
        forward = {value_stage(v) for v in made if v.owner in forward_ops}
        backward = {value_stage(v) for v in made if v.owner not in forward_ops and v.owner not in post}
        if o in post:  # runs after every action, anywhere: with its one producer (a gradient's norm)
            up = value_stage(made[0]) if len(made) == 1 else FREE
        else:
            up = min(max(forward or backward, default=FREE), min(backward, default=pp))
        if up > stage[o]:
            stage[o] = up
    for o in ops:
        if isinstance(o, graph.ParameterOp):
            s = owner_of_state(o.tensor_name.data)
            stage[o] = FREE if s is None else s
        elif isinstance(o, graph.OutputOp) and o.tensor_name.data != "loss":
            stage[o] = max(value_stage(o.value), 0)
    return stage


def _kinds(ops: list[Operation], collectives: dict[Operation, tuple],
           leaves: dict[Operation, bool], microbatches: int) -> dict[Operation, str]:
    """Return op -> "mb" (runs once per micro-batch: it depends on an input split over the
    micro-batches), "post" (after the accumulation: it depends on an all-reduce over the
    micro-batches) or "step" (once). Resolves each XSPAN in `collectives` into XMEET or XPOST."""
    kind: dict[Operation, str] = {}
    for o in ops:
        c = collectives.get(o, (LOCAL,))[0]
        if c in (XSPAN, ZERO, XPOST):  # across micro-batches (and groups): by what the operand is
            x = o.operands[0].owner
            k = kind.get(x, "step")  # type: ignore[call-overload]
            if c == ZERO and k == "mb":
                raise PassError(f"pipeline-split: '{o.name}' zeroes all but one micro-batch's value before it is "
                                "summed over them; a pipelined stage cannot")
            if c == XSPAN and k != "mb":
                if collectives.get(x, (LOCAL,))[0] != ZERO:  # type: ignore[call-overload]
                    raise PassError(f"pipeline-split: '{o.name}' sums across device groups a value that every "
                                    "micro-batch holds whole; a pipelined stage cannot")
                collectives[o] = (XPOST, ())  # only micro-batch 0's copy is not zero: one sum across groups
            elif c == XSPAN:
                collectives[o] = (XMEET, ())  # the micro-batches' sum, then the sum across groups
        c = collectives.get(o, (LOCAL,))[0]
        if c in (MEET, XMEET) or o.dialect_name() == "optim":  # the update comes last
            kind[o] = "post"
        elif c == VLOCAL:  # each micro-batch's own piece
            kind[o] = "mb"
        elif o in leaves:
            kind[o] = "mb" if leaves[o] else "step"
        elif collectives.get(o, (LOCAL,))[0] == SPLIT:  # micro-batch i's slice: one per micro-batch
            if kind.get(o.operands[0].owner) == "post":
                raise PassError(f"pipeline-split: '{o.name}' splits a value summed over the micro-batches "
                                "across them again")
            kind[o] = "mb"
        else:
            ks = {kind.get(v.owner, "step") for v in o.operands}
            kind[o] = "post" if "post" in ks else "mb" if "mb" in ks else "step"
            if kind[o] == "mb" and isinstance(o, (graph.AssignOp, graph.OutputOp)) and microbatches == 1:
                kind[o] = "post"  # one micro-batch: its value is the sum over the micro-batches
            elif kind[o] == "mb" and isinstance(o, (graph.AssignOp, graph.OutputOp)):
                raise PassError(f"pipeline-split: '{o.name}' \"{o.tensor_name.data}\" would be one value per "
                                "micro-batch; only values summed over the micro-batches can be outputs or assigned")
    return kind


STEP, FWD, BWD = "step", "F", "B"  # where a value is made on a stage: its @train_step, forward or backward
FORWARD_FN, BACKWARD_FN = "pipeline_forward", "pipeline_backward"
#: message tags are 1, 2, ...; MPI promises at least this many
MAX_TAG = 32767


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


def _emit_stages(ops: list[Operation], stages: dict[Operation, int], mesh: StageMesh, schedule: str,
                 order: list[tuple[int, tuple[str, int]]],
                 collectives: dict[Operation, tuple[str, tuple[tuple[int, ...], ...]]],
                 leaves: dict[Operation, bool],
                 placed: dict[Operation, tuple[int, Operation]] | None = None) -> list[StageProgram]:
    """Return each stage's program (see the module docstring, A stage's program and Messages).

    @train_step: the ops every micro-batch shares (parameters, their views, copies of free
    ops), one `pipeline.run` of the stage's forward and backward on each micro-batch in the
    schedule's order (its results: the values summed over the micro-batches), then what
    follows the sums (the all-reduces over the stage's dp ranks, the update) and the outputs.

    A value used on another stage than its producer's is sent once it is made and received
    before its first use; every message has its own tag (1, 2, ...), the same at both ends.
    A value that is summed over micro-batches for another stage is summed by its producer's
    `pipeline.run` and sent after it. `placed` receives (stage, clone) of each collective
    with other device groups.
    """
    m = mesh.microbatches
    kind = _kinds(ops, collectives, leaves, m)
    pp = len(mesh.stages)
    forward_end = next(i + 1 for i, o in enumerate(ops) if isinstance(o, graph.OutputOp)
                       and o.tensor_name.data == "loss")
    where = {o: j for j, o in enumerate(ops)}
    position = {sa: k for k, sa in enumerate(order)}

    def coll(o: Operation) -> str:
        return collectives.get(o, (LOCAL,))[0]

    def region_of(o: Operation) -> str:
        if kind[o] == "mb":
            return FWD if where[o] < forward_end else BWD
        return STEP

    def stage_of(v: SSAValue) -> int:
        return stages.get(v.owner, FREE) if isinstance(v.owner, Operation) else FREE

    def runs_on(o: Operation, s: int) -> bool:
        t = stages[o]
        return t == s or (t == FREE and isinstance(o, (graph.AssignOp, graph.OutputOp)))

    def micro_batched(o: Operation) -> bool:
        """A source of one slice per micro-batch: a batch input, or a split over the micro-batches."""
        return (o in leaves and leaves[o]) or coll(o) == SPLIT

    # -- messages: (value, "mb" | "one" | "sum", src stage, dst stage) -> tag ----------------
    messages: dict[tuple[SSAValue, str, int, int], int] = {}
    for c in range(pp):
        for o in ops:
            if not runs_on(o, c):
                continue
            if coll(o) in (MEET, XMEET):
                uses = [(o.operands[0], "sum")]
            elif coll(o) == SPLIT:
                uses = [(o.operands[0], "one")]
            else:  # a micro-batch's value used after the run (one micro-batch) is its sum
                after = region_of(o) == STEP
                uses = [(v, ("sum" if after else "mb") if kind.get(v.owner) == "mb" else "one")  # type: ignore
                        for v in o.operands]
            for v, how in uses:
                t = stage_of(v)
                if t in (FREE, c) or (v, how, t, c) in messages:
                    continue
                if how == "mb":
                    made, used = region_of(v.owner), region_of(o)  # type: ignore[arg-type]
                    if any(position[(t, (made, i))] > position[(c, (used, i))] for i in range(m)):
                        raise PassError(f"pipeline-split: '{v.owner.name}' on stage {t} is made in an action that "
                                        f"comes after the one of stage {c} that uses it; this stage assignment "
                                        f"does not fit the schedule")
                messages[(v, how, t, c)] = len(messages) + 1
    if len(messages) > MAX_TAG:
        raise PassError(f"pipeline-split: the stages exchange {len(messages)} different messages; message tags "
                        f"go up to {MAX_TAG}")
    sends_of: dict[tuple[SSAValue, int], list[tuple[str, int, int]]] = {}
    for (v, how, t, c), tag in messages.items():
        sends_of.setdefault((v, t), []).append((how, c, tag))

    def pairs(t: int, c: int) -> list[list[int]]:
        """Return the (src, dst) pairs from stage t to stage c: the same position on both."""
        return [[a, b] for a, b in zip(mesh.stages[t], mesh.stages[c])]

    out = []
    for s in range(pp):
        pre: list[Operation] = []
        post: list[Operation] = []
        cursor = [pre]  # where @train_step's ops go now: pre (before the run), then post
        fns = {FWD: _Function(), BWD: _Function()}
        vmap: dict[tuple[SSAValue, str], SSAValue] = {}
        stacked: dict[Operation, SSAValue] = {}  # micro-batched source -> its stacked value in @train_step
        sum_of: dict[SSAValue, SSAValue] = {}  # value -> placeholder of its sum in @train_step
        sums = _Function()  # (only its placeholders: the run's results, made last)
        stash_from: dict[SSAValue, SSAValue] = {}  # value -> the forward's value the backward gets

        def emit(region: str, op: Operation) -> None:
            (cursor[0] if region == STEP else fns[region].ops).append(op)

        def send_made(v: SSAValue, new: SSAValue, region: str) -> None:
            """Send a value made here to the stages that use it (sums are sent after the run)."""
            for how, c, tag in sends_of.get((v, s), []):
                if how != "sum":
                    emit(region, comm.SendOp(new, pairs(s, c), tag))

        def recv(v: SSAValue, how: str, t: int, region: str) -> SSAValue:
            op = comm.RecvOp(pairs(t, s), v.type, messages[(v, how, t, s)])
            emit(region, op)
            return op.result

        def get(v: SSAValue, region: str) -> SSAValue:
            key = (v, region)
            if key in vmap:
                return vmap[key]
            owner = v.owner
            t = stage_of(v)
            mb = isinstance(owner, Operation) and kind.get(owner) == "mb"
            if region == STEP:
                if mb and m == 1 and t in (s, FREE):  # one micro-batch's value: its own sum
                    vmap[key] = summed(v)
                elif mb and m == 1:
                    vmap[key] = recv(v, "sum", t, STEP)
                elif t == FREE and isinstance(owner, Operation) and not mb:
                    clone(owner, STEP)
                elif t != s and not mb:
                    vmap[key] = recv(v, "one", t, STEP)
                else:
                    raise PassError(f"pipeline-split: internal error: stage {s} uses '{getattr(owner, 'name', owner)}'"
                                    " in @train_step before it is made there")
                return vmap[key]
            fn = fns[region]
            if not mb:  # a value every micro-batch shares: an argument
                inner = before_run(v)
                if inner not in fn.shared:
                    fns[FWD].shared.setdefault(inner, fns[FWD].placeholder(inner.type))
                    fns[BWD].shared.setdefault(inner, fns[BWD].placeholder(inner.type))
                vmap[key] = fn.shared[inner]
            elif micro_batched(owner):  # type: ignore[arg-type]
                source(owner)  # type: ignore[arg-type]
                if owner not in fn.slices:
                    for f in fns.values():
                        f.slices.setdefault(owner, f.placeholder(v.type))  # type: ignore[arg-type]
                vmap[key] = fn.slices[owner]  # type: ignore[index]
            elif region == BWD and (v, FWD) in vmap:  # made (or received) by the forward: stashed
                if v not in fn.stash:
                    fn.stash[v] = fn.placeholder(v.type)
                    stash_from[v] = vmap[(v, FWD)]
                vmap[key] = fn.stash[v]
            elif t == FREE:
                clone(owner, region)  # type: ignore[arg-type]
            elif t != s:
                vmap[key] = recv(v, "mb", t, region)
            else:
                raise PassError(f"pipeline-split: internal error: stage {s} uses '{owner.name}' "  # type: ignore
                                f"in its {'forward' if region == FWD else 'backward'} before it is made there")
            return vmap[key]

        def place(o: Operation, new: Operation) -> None:
            """Record where a collective across device groups runs (one stage)."""
            if placed is not None:
                if o in placed:
                    raise PassError(f"pipeline-split: '{o.name}' across device groups would run on stages "
                                    f"{placed[o][0]} and {s}; it must have one stage")
                placed[o] = (s, new)

        def clone(o: Operation, region: str) -> None:
            mapping = {v: get(v, region) for v in o.operands}
            new = o.clone(value_mapper=mapping)
            if coll(o) in (CROSS, XPOST):  # with other groups: on this stage's devices
                remap_op(new, mesh.remap(s))
                place(o, new)
            elif coll(o) in (MAPPED, ZERO):
                remap_op(new, mesh.remap(s))
            elif coll(o) == VLOCAL:
                _run_as_virtual(new, mesh, s)
            elif o in collectives:  # a collective inside one micro-batch, over this stage's devices
                new.properties["groups"] = comm.groups_attr(mesh.real(s, collectives[o][1]))
            if isinstance(new, (graph.ParameterOp, graph.InputOp)):
                typ = new.properties["global_type"]
                assert isinstance(typ, TensorType)
                new.properties["global_type"] = stage_type(typ, mesh, s, f"'{o.tensor_name.data}'")[0]
            else:
                _restage_global_types([new], mesh, s)
            emit(region, new)
            for old, r in zip(o.results, new.results):
                vmap[(old, region)] = r
                send_made(old, r, region)

        def source(o: Operation) -> None:
            """Make (in @train_step, before the run) the stacked value of a micro-batched source."""
            if o in stacked:
                return
            if isinstance(o, graph.InputOp) and mesh.foreign and m > 1:
                stacked[o] = _union_input_microbatches(o, mesh, s, pre)
            elif isinstance(o, graph.InputOp):  # NAME@mb: the batch as [m, rows / m, ...]
                typ = stage_type(o.properties["global_type"], mesh, s, f"'{o.tensor_name.data}'")[0]  # type: ignore
                read = graph.InputOp(f"{o.tensor_name.data}@mb", _stacked(o.result.type, m))  # type: ignore[arg-type]
                read.properties["global_type"] = with_layout(_stacked(typ, m), _stacked_layout(layout_of(typ)))
                pre.append(read)
                stacked[o] = read.result
            else:  # a split over the micro-batches (dim 0), then over the stage's positions
                dim = o.dim.value.data  # type: ignore[attr-defined]
                if dim != 0:
                    raise PassError(f"pipeline-split: '{o.name}' splits a value over the micro-batches along dim "
                                    f"{dim}; a pipeline stage takes micro-batches along dim 0 only")
                x = before_run(o.operands[0])
                shape = list(x.type.get_shape())  # type: ignore[attr-defined]
                whole = graph.ReshapeOp(x, TensorType(x.type.element_type, [m, shape[0] // m, *shape[1:]]))  # type: ignore
                pre.append(whole)
                value = whole.result
                real = mesh.real(s, collectives[o][1])
                if len(real[0]) > 1:
                    split_op = comm.LocalSplitOp(value, real, _stacked(o.results[0].type, m), dim=1)  # type: ignore
                    pre.append(split_op)
                    value = split_op.result
                stacked[o] = value

        def before_run(v: SSAValue) -> SSAValue:
            """Return `v` made (or received) in @train_step before the run."""
            saved, cursor[0] = cursor[0], pre
            try:
                return get(v, STEP)
            finally:
                cursor[0] = saved

        def summed(v: SSAValue) -> SSAValue:
            """Return (a placeholder for) the sum over micro-batches of a value this stage makes."""
            if v not in sum_of:
                region = region_of(v.owner) if isinstance(v.owner, Operation) and v.owner in kind else FWD
                region = FWD if region == STEP else region
                fns[region].sums.append(get(v, region))
                sum_of[v] = sums.placeholder(v.type)
                sum_regions.append((v, region))
            return sum_of[v]

        sum_regions: list[tuple[SSAValue, str]] = []

        # 1. pre: what every micro-batch shares
        for o in ops:
            if runs_on(o, s) and kind[o] == "step" and not isinstance(o, (graph.AssignOp, graph.OutputOp)):
                clone(o, STEP)
        # 2. the forward and backward of one micro-batch
        for o in ops:
            if runs_on(o, s) and kind[o] == "mb" and not micro_batched(o):
                clone(o, region_of(o))
        # 3. post: the sums the other stages need, then what follows the sums
        cursor[0] = post
        for (v, how, t, c), tag in messages.items():
            if t == s and how == "sum":
                post.append(comm.SendOp(summed(v), pairs(s, c), tag))
        for o in ops:
            if not runs_on(o, s) or (kind[o] != "post" and not isinstance(o, (graph.AssignOp, graph.OutputOp))):
                continue
            if coll(o) in (MEET, XMEET):  # the sum over micro-batches, then over the stage's dp ranks (or groups)
                v = o.operands[0]
                t = stage_of(v)
                acc = summed(v) if t in (s, FREE) else recv(v, "sum", t, STEP)
                if coll(o) == XMEET and isinstance(o, comm.ExchangeOp):  # the stage's pieces in the virtual ones'
                    across = o.clone(value_mapper={o.input: acc})
                    remap_op(across, mesh.remap(s))
                    post.append(across)
                    place(o, across)
                    acc = across.result
                elif coll(o) == XMEET:
                    reduce = comm.AllReduceOp(acc, mesh.remap(s).groups(o.rank_groups), o.result.type)  # type: ignore
                    post.append(reduce)
                    place(o, reduce)
                    acc = reduce.result
                elif len((real := mesh.real(s, collectives[o][1]))[0]) > 1:
                    reduce = comm.AllReduceOp(acc, real, o.result.type)  # type: ignore[arg-type]
                    post.append(reduce)
                    acc = reduce.result
                vmap[(o.result, STEP)] = acc  # type: ignore[attr-defined]
                send_made(o.result, acc, STEP)  # type: ignore[attr-defined]
            else:
                clone(o, STEP)
        out.append(_assemble_stage(s, pp, schedule, m, fns, stacked, stash_from, sum_regions, sum_of, sums,
                                   pre, post))
    return out


def _assemble_stage(s: int, pp: int, schedule: str, m: int, fns: dict[str, _Function],
                    stacked: dict[Operation, SSAValue], stash_from: dict[SSAValue, SSAValue],
                    sum_regions: list[tuple[SSAValue, str]],
                    sum_of: dict[SSAValue, SSAValue], sums: _Function,
                    pre: list[Operation], post: list[Operation]) -> StageProgram:
    """Return the stage's program from its parts: @train_step = pre, `pipeline.run`, post."""
    fwd, bwd = fns[FWD], fns[BWD]
    shared = list(fwd.shared)  # the step values, in first-use order (the same keys in both)
    sources = list(fwd.slices)
    stash = list(bwd.stash)
    forward = fwd.build(FORWARD_FN, [fwd.shared[v] for v in shared] + [fwd.slices[o] for o in sources],
                        [stash_from[v] for v in stash] + fwd.sums)
    backward = bwd.build(BACKWARD_FN, [bwd.shared[v] for v in shared] + [bwd.slices[o] for o in sources]
                         + [bwd.stash[v] for v in stash], bwd.sums)
    order = [v for v, r in sum_regions if r == FWD] + [v for v, r in sum_regions if r == BWD]
    run = pipeline.RunOp(FORWARD_FN, BACKWARD_FN, shared, [stacked[o] for o in sources],
                         [v.type for v in order], schedule=schedule, stage=s, stages=pp, microbatches=m,
                         stash=len(stash))
    for v, r in zip(order, run.results):
        sum_of[v].replace_all_uses_with(r)
    sums.scratch.erase(safe_erase=True)
    return StageProgram([*pre, run, *post], forward, backward)


def _stacked(typ: TensorType, m: int) -> TensorType:
    """Return the type of m slices of `typ` stacked along a new leading dim (no layout)."""
    return TensorType(typ.element_type, [m, *typ.get_shape()])


def _stacked_layout(layout: Layout | None) -> Layout:
    """Return a one-micro-batch layout for the stacked tensor: every split dim one further."""
    assert layout is not None
    groups = tuple(Group(g.devices, DistributedStates(tuple((split(a.dim + 1) if a.kind == "split" else a, d)
                                                            for a, d in g.states.axes))) for g in layout.groups)
    hetero = split(layout.hetero.dim + 1) if layout.hetero.kind == "split" else layout.hetero
    return Layout(groups, hetero, layout.shares)


def _union_input_microbatches(o: graph.InputOp, mesh: StageMesh, s: int, pre: list[Operation]) -> SSAValue:
    """Return the micro-batches of a batch input that the other groups share (hetero_pipeline), stacked:
    the stage reads its group's rows whole, views them as [m, rows / m, ...], then splits dim 1 over its
    dp ranks (the other groups' rows are in the same input)."""
    m = mesh.microbatches
    typ = o.properties["global_type"]
    layout = layout_of(typ)  # type: ignore[arg-type]
    g = next(g for g in layout.groups if g.devices == mesh.virtual)  # type: ignore[union-attr]
    (axis, degree), *rest = g.states.axes
    if axis != split(0) or any(a.kind != "dup" for a, _ in rest):
        raise PassError(f"pipeline-split: input '{o.tensor_name.data}' is laid out as '{layout}'; beside "
                        "other device groups a pipelined group's micro-batches need it split along dim 0 only")
    dp = degree // m
    tp = mesh.size // dp
    groups = [Group(mesh.stages[s], DistributedStates.of((DUP, mesh.size))) if h is g else h
              for h in layout.groups]  # type: ignore[union-attr]
    whole = Layout(tuple(groups), layout.hetero, layout.shares)  # type: ignore[union-attr]
    shape = whole.local_shape(mesh.stages[s][0], typ.get_shape())  # type: ignore[union-attr]
    read = graph.InputOp(o.tensor_name.data, TensorType(o.result.type.element_type, shape))
    read.properties["global_type"] = with_layout(typ, whole)  # type: ignore[arg-type]
    rows = graph.ReshapeOp(read.result, TensorType(o.result.type.element_type, [m, shape[0] // m, *shape[1:]]))
    pre.extend([read, rows])
    if dp == 1:
        return rows.result
    real = [[mesh.stages[s][d * tp + t] for d in range(dp)] for t in range(tp)]
    split_op = comm.LocalSplitOp(rows.result, real, _stacked(o.result.type, m), dim=1)
    pre.append(split_op)
    return split_op.result
