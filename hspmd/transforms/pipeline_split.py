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
  dp=1, tp=2); a batch input split over them (`split(0)`) becomes one input per micro-batch,
  `x@mb0` ... `x@mb{m-1}` (global batch / m rows each, split over the stage's dp ranks),
  which the worker cuts from the global batch. A parameter split over micro-batches (ZeRO)
  is refused.

Every op of the step goes to one stage:

* **layers**: the forward `func.call`s of `*_fwd` block functions, in order (a model without
  block calls: the parameter name prefixes, `layers.0.weight` -> `layers.0`); with
  `layers="3,1"` stage s takes the next `layers[s]` of them (the counts must add up to the
  number of layers), else layer k of n goes to stage `k * pp // n` (contiguous ranges,
  balanced by count); the parameters a layer reads go with it. Fewer layers than stages is
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
every q; see Schedules below for where); with one micro-batch every stage computes exactly the
numbers of the one-group step. `graph.output "loss"` is on every stage (the loss is sent to
the others). The group modules carry `hspmd.pipeline_stage` and `hspmd.microbatches`; a
stage's program is the same for each of its ranks and does not grow with them.

**Micro-batches** (`microbatches=m` > 1): ops that depend on a micro-batch input run once per
micro-batch; the all-reduces spanning micro-batches are the sums above; ops after them, and
the optimizer's ops, run once at the end.

**Schedules.** Each stage's program is unrolled in the order of its list in the `schedule`
(`hspmd.runtime.schedule_pipeline`: "gpipe" or "1f1b", checked complete and runnable): the
stage's forward ops of micro-batch i for action ("F", i), its backward ops for ("B", i), then
the update. Every message gets a key: the position of the action that first uses it in one
global order of all stages' actions (`check_schedule`'s), then the producer's place in the
one-group step. Each stage issues its messages in key order (a send as soon as its value is
made and every smaller key is issued; before an op, every message up to the receives it
needs), so both ends of every blocking send/receive meet in one global order: no deadlock,
for 1F1B as for GPipe (collectives inside a stage are met by all its positions at the same
point of the same program). A stage assignment in which an action would need a value that a
later action makes is refused with a message naming the op.

**Beside other device groups** (`virtual="0,1"`: the devices of the stage-shaped group in a
physical IR with several groups): only that group's module is cut; in leaves' union layouts
the stage takes the virtual group's place (its micro-batch axis divided by m; the batch shape
stays the whole batch's); a collective that moves data to or from another group is `CROSS`
(one micro-batch: it runs on one stage, renamed onto its devices), one that only names other
groups' devices is `MAPPED`. With m > 1 micro-batches, a cross-group all-reduce of a
per-micro-batch value (`XMEET`) becomes the sum over the micro-batches, then one all-reduce
with the other groups; a local_zero over the micro-batches of a summed value (`ZERO`) becomes
one over the stage and the cross-group all-reduce after it (`XPOST`) runs once; a batch input
the other groups share is read as the group's rows, then micro-batch i's slice is split over
the stage's dp ranks; other exchanges across groups are refused. Then
`hetero_pipeline.join_groups` remaps and re-orders the other groups' modules (see its
docstring for why no rank deadlocks).
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerAttr, ModuleOp, StringAttr, TensorType, i64
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass

from hspmd.dialects import comm, graph
from hspmd.dialects.dist import layout_of, with_layout
from hspmd.ir.layout import DUP, DistributedStates, Group, Layout, split
from hspmd.ir.levels import DEVICES_ATTR, devices_attr, physical_groups
from hspmd.runtime.schedule_pipeline import SCHEDULES, PipelineScheduleError, check_schedule
from hspmd.transforms.hetero_pipeline import (MICROBATCHES_ATTR, STAGE_ATTR, comm_devices, join_groups,  # noqa: F401
                                              partners, remap_layout, remap_op)
from hspmd.transforms.util import PassError

# STAGE_ATTR ("hspmd.pipeline_stage") and MICROBATCHES_ATTR ("hspmd.microbatches") come from hetero_pipeline


def parse_devices(text: str) -> tuple[int, ...]:
    """Return the devices of option `devices` ("0,1,2,3", stage-major)."""
    try:
        devices = tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError:
        raise PassError(f"pipeline-split: devices '{text}' is not a comma-separated list of device numbers") from None
    if len(devices) < 2 or len(set(devices)) != len(devices):
        raise PassError(f"pipeline-split: devices '{text}' must name at least 2 distinct devices (at least one per stage)")
    return devices


def parse_layers(text: str, pp: int) -> tuple[int, ...] | None:
    """Return the per-stage layer counts of option `layers` ("3,1"; "" -> None: balanced)."""
    if not text.strip():
        return None
    try:
        counts = tuple(int(t) for t in text.replace(":", ",").replace(" ", "").split(",") if t)
    except ValueError:
        raise PassError(f"pipeline-split: layers '{text}' is not a comma-separated list of layer counts") from None
    if len(counts) != pp or any(c < 1 for c in counts):
        raise PassError(f"pipeline-split: layers '{text}' must give one count >= 1 for each of the {pp} stages")
    return counts


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
# with micro-batches beside other groups: a sum across groups and micro-batches (XSPAN, resolved by its
# operand into XMEET: the micro-batches' sum then the cross-group sum, or XPOST: the sum of a value
# zeroed on all but one micro-batch by a ZERO, a local_zero over the micro-batches of a summed value)
XSPAN, XMEET, XPOST, ZERO = "xspan", "xmeet", "xpost", "zero"


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
        if not crossing or not isinstance(o, comm.AllReduceOp):
            raise PassError(f"pipeline-split: '{o.name}' names other device groups inside a micro-batch; with "
                            f"microbatches={m} a pipelined group beside other groups may only sum across groups "
                            "(all-reduces of gradients and the loss), so use microbatches=1 (or tp=1 in every group)")
        for g in o.rank_groups:  # type: ignore[attr-defined]
            by_mb: dict[int, set[int]] = {}
            for p in mesh.positions([d for d in g if d not in mesh.foreign]):
                by_mb.setdefault(p // size, set()).add(p % size)
            if by_mb and (len(by_mb) != m or len({frozenset(v) for v in by_mb.values()}) != 1):
                raise PassError(f"pipeline-split: '{o.name}' group {list(g)} sums across device groups over some "
                                f"but not all {m} micro-batches, or other positions in each")
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
    """Put the `global_type` of position-dependent ops (embedding, one_hot, dropout) on stage s."""
    for o in ops:
        typ = o.properties.get("global_type")
        if isinstance(typ, TensorType) and layout_of(typ) is not None \
                and not isinstance(o, (graph.ParameterOp, graph.InputOp)):
            o.properties["global_type"] = stage_type(typ, mesh, s, f"the result of '{o.name}'")[0]


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

    devices: str = "0,1"
    pp: int = 0  # 0: one device per stage
    tp: int = 1
    microbatches: int = 1
    schedule: str = "gpipe"
    layers: str = ""
    # the pipelined group's virtual devices when other device groups sit beside it ("": one group)
    virtual: str = ""

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        devices = parse_devices(self.devices)
        pp = self.pp or len(devices)
        if pp < 2 or len(devices) % pp:
            raise PassError(f"pipeline-split: pp={pp} stages do not divide the {len(devices)} devices "
                            f"'{self.devices}' (and a pipeline needs pp >= 2)")
        size = len(devices) // pp
        if self.tp < 1 or size % self.tp:
            raise PassError(f"pipeline-split: tp={self.tp} does not divide the {size} devices of a stage")
        stage_devices = tuple(devices[s * size:(s + 1) * size] for s in range(pp))
        layer_counts = parse_layers(self.layers, pp)
        groups = physical_groups(op)
        m = self.microbatches
        if m < 1:
            raise PassError(f"pipeline-split: microbatches={m}; it must be >= 1")
        schedule = SCHEDULES.get(self.schedule)
        if schedule is None:
            raise PassError(f"pipeline-split: unknown schedule '{self.schedule}' (known: {', '.join(SCHEDULES)})")
        dp = size // self.tp
        other_groups: list[tuple[tuple[int, ...], ModuleOp]] = []
        if self.virtual.strip():  # a pipelined group beside other groups (hetero_pipeline)
            want = parse_devices(self.virtual) if "," in self.virtual else (int(self.virtual),)
            mine = [g for g in groups if g[0] == want]
            if len(mine) != 1 or len(want) != m * size:
                raise PassError(f"pipeline-split: virtual='{self.virtual}' must be the devices of one group of the "
                                f"input, {m} micro-batch(es) x {size} devices of a stage (it has groups "
                                f"{[list(g) for g, _ in groups]})")
            other_groups = [g for g in groups if g[0] != want]
            groups = mine
            if set(devices) & {d for g, _ in other_groups for d in g}:
                raise PassError(f"pipeline-split: devices '{self.devices}' overlap another group's "
                                f"{[list(g) for g, _ in other_groups]}")
        if len(groups) != 1 or len(groups[0][0]) != m * size:
            raise PassError(f"pipeline-split: the input must be the physical IR of one group of {m * size} devices, "
                            f"{m} micro-batch(es) x {size} devices of a stage (`[0-{m * size - 1}]: dp={m * dp} "
                            f"tp={self.tp}` before the split) (it has groups {[list(g) for g, _ in groups]}); "
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
                if f is not step and collectives[o][0] not in (LOCAL, MAPPED):
                    raise PassError(f"pipeline-split: '{o.name}' in @{f.sym_name.data} spans micro-batches or "
                                    "device groups; only the step itself may")
        leaves: dict[Operation, bool] = {}  # leaf -> split over the micro-batches
        for o in ops:
            if isinstance(o, (graph.ParameterOp, graph.InputOp)):
                what = f"{'parameter' if isinstance(o, graph.ParameterOp) else 'input'} '{o.tensor_name.data}'"
                _, dim = stage_layout(layout_of(o.properties["global_type"]), mesh, 0, what)
                leaves[o] = dim is not None
                if dim is not None and (isinstance(o, graph.ParameterOp) or dim != 0):
                    raise PassError(f"pipeline-split: {what} is split over the micro-batches along dim {dim}; "
                                    "only batch inputs may be, along dim 0 (ZeRO is not combined with pipeline "
                                    "stages)")
        plan = schedule(pp, m)
        try:
            order = check_schedule(plan, m)
        except PipelineScheduleError as err:
            raise PassError(f"pipeline-split: schedule '{self.schedule}': {err}") from None
        post = {o for o, k in _kinds(ops, collectives, leaves).items() if k == "post"}
        stages = _assign(ops, pp, layer_counts, post)
        placed: dict[Operation, tuple[int, Operation]] = {}
        bodies = _emit_stages(ops, stages, mesh, plan, order, collectives, leaves, placed)
        modules = []
        for s, devs in enumerate(stage_devices):
            fn = func.FuncOp("train_step", ((), ()))
            fn.body.block.add_ops([*bodies[s], func.ReturnOp()])
            others = [f.clone() for f in functions if f is not step]
            for f in others:  # the callees' collectives (inside one micro-batch) on this stage's devices
                for o in f.walk():
                    if o.dialect_name() == "comm" and classify_collective(o, mesh)[0] == MAPPED:
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


def _stage_of_layers(n: int, pp: int, counts: tuple[int, ...] | None, what: str) -> list[int]:
    """Return each of n layers' stage: the given counts per stage, else contiguous balanced ranges."""
    if n < pp:
        raise PassError(f"pipeline-split: pp={pp} stages need at least {pp} layers, but the model has {n} layers "
                        f"({what}); use pp <= {n}")
    if counts is None:
        return [k * pp // n for k in range(n)]
    if sum(counts) != n:
        raise PassError(f"pipeline-split: layers={':'.join(map(str, counts))} gives {sum(counts)} layers to the "
                        f"stages, but the model has {n} layers ({what}); the counts must add up to {n}")
    return [s for s, c in enumerate(counts) for _ in range(c)]


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
    stage_of_layer = _stage_of_layers(len(layers), pp, counts, what)
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
           leaves: dict[Operation, bool]) -> dict[Operation, str]:
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
            if kind[o] == "mb" and isinstance(o, (graph.AssignOp, graph.OutputOp)):
                raise PassError(f"pipeline-split: '{o.name}' \"{o.tensor_name.data}\" would be one value per "
                                "micro-batch; only values summed over the micro-batches can be outputs or assigned")
    return kind


Key = tuple  # (position of the consumer's action in the global order, producer op index, instance, result, dst)


def _emit_stages(ops: list[Operation], stages: dict[Operation, int], mesh: StageMesh,
                 plan: list[list[tuple[str, int]]], order: list[tuple[int, tuple[str, int]]],
                 collectives: dict[Operation, tuple[str, tuple[tuple[int, ...], ...]]],
                 leaves: dict[Operation, bool],
                 placed: dict[Operation, tuple[int, Operation]] | None = None) -> list[list[Operation]]:
    """Return each stage's step ops: its ops in the order of its schedule (once per micro-batch
    where they depend on the batch), copies of the free ops it needs, the sums over micro-batches
    (in place of the all-reduces of the one-group program), the update, and its sends/receives.

    Every message gets a key: the position, in `order` (one global order of all stages' actions),
    of the action that first uses it, then the producer's place in the one-group step. Each
    stage issues its messages in key order (a send as soon as it is made and all smaller keys
    are issued; before an op, every message up to the receives it needs), so the two ends of
    every blocking send/receive meet in one global order: no deadlock, for any schedule.
    `placed` receives (stage, clone) of each collective with other device groups.
    """
    kind = _kinds(ops, collectives, leaves)
    microbatches = mesh.microbatches
    forward_end = next(i + 1 for i, o in enumerate(ops) if isinstance(o, graph.OutputOp)
                       and o.tensor_name.data == "loss")
    where = {o: j for j, o in enumerate(ops)}
    position = {sa: k for k, sa in enumerate(order)}
    post = len(order)
    pp = len(mesh.stages)

    def inst_of(v: SSAValue, inst: int | None) -> int | None:
        return inst if kind.get(v.owner, "step") == "mb" else None  # type: ignore[arg-type]

    def uses(o: Operation, inst: int | None) -> list[tuple[SSAValue, int | None]]:
        if collectives.get(o, (LOCAL,))[0] in (MEET, XMEET):
            return [(o.operands[0], inst_of(o.operands[0], i)) for i in range(microbatches)]
        return [(v, inst_of(v, inst)) for v in o.operands]

    def runs_on(o: Operation, s: int) -> bool:
        t = stages[o]
        return t == s or (t == FREE and isinstance(o, (graph.AssignOp, graph.OutputOp)))

    items: list[list[tuple[Operation, int | None, int]]] = []
    for s in range(pp):
        done: set[Operation] = set()
        mine: list[tuple[Operation, int | None, int]] = []
        for phase, i in plan[s]:
            at = position[(s, (phase, i))]
            for o in ops[:forward_end] if phase == "F" else ops[forward_end:]:
                if isinstance(o, (graph.AssignOp, graph.OutputOp)):
                    continue  # outputs and assignments come last
                if kind[o] == "mb":
                    mine.append((o, i, at))
                elif kind[o] == "step" and o not in done:
                    done.add(o)
                    mine.append((o, None, at))
        mine.extend((o, None, post) for o in ops if kind[o] != "mb" and o not in done)
        items.append([it for it in mine if runs_on(it[0], s)])

    # messages: (value, instance, src, dst) -> key, the first use on dst deciding
    messages: dict[tuple[SSAValue, int | None, int, int], Key] = {}
    for c in range(pp):
        for o, inst, at in items[c]:
            for v, k in uses(o, inst):
                producer = v.owner
                t = stages.get(producer, FREE) if isinstance(producer, Operation) else FREE
                if t in (FREE, c) or (v, k, t, c) in messages:
                    continue
                messages[(v, k, t, c)] = (at, where[producer], -1 if k is None else k,
                                          list(producer.results).index(v), c)
    made = {(r, inst_of(r, inst)): at for s in range(pp) for o, inst, at in items[s] for r in o.results}
    for (v, k, t, c), key in messages.items():
        if made[(v, k)] >= key[0] and key[0] != post:
            raise PassError(f"pipeline-split: '{v.owner.name}' on stage {t} is made in an action that comes after "
                            f"the one of stage {c} that uses it; this stage assignment does not fit the schedule")

    def pairs(t: int, c: int) -> list[list[int]]:
        """Return the (src, dst) pairs from stage t to stage c: the same position on both."""
        return [[a, b] for a, b in zip(mesh.stages[t], mesh.stages[c])]

    out = []
    for s in range(pp):
        body: list[Operation] = []
        vmap: dict[tuple[SSAValue, int | None], SSAValue] = {}
        events = sorted((key, v, k, t, c) for (v, k, t, c), key in messages.items() if s in (t, c))
        next_event = 0

        def get(v: SSAValue, inst: int | None) -> SSAValue:
            k = (v, inst_of(v, inst))
            if k not in vmap:
                owner = v.owner
                if not isinstance(owner, Operation) or stages.get(owner, FREE) != FREE:
                    raise PassError(f"pipeline-split: internal error: stage {s} uses a value of another stage "
                                    f"('{getattr(owner, 'name', owner)}') before receiving it")
                clone(owner, k[1])
            return vmap[k]

        def place(o: Operation, new: Operation) -> None:
            """Record where a collective across device groups runs (one stage)."""
            if placed is not None:
                if o in placed:
                    raise PassError(f"pipeline-split: '{o.name}' across device groups would run on stages "
                                    f"{placed[o][0]} and {s}; it must have one stage")
                placed[o] = (s, new)

        def clone(o: Operation, inst: int | None) -> None:
            if isinstance(o, graph.InputOp) and leaves.get(o) and mesh.foreign:
                return micro_batch_of_union_input(o, inst)
            mapping = {v: get(v, inst) for v in o.operands}
            new = o.clone(value_mapper=mapping)
            if collectives.get(o, (LOCAL,))[0] in (CROSS, XPOST):  # with other groups: on this stage's devices
                remap_op(new, mesh.remap(s))
                place(o, new)
            elif collectives.get(o, (LOCAL,))[0] in (MAPPED, ZERO):
                remap_op(new, mesh.remap(s))
            elif o in collectives:  # a collective inside one micro-batch, over this stage's devices
                new.properties["groups"] = comm.groups_attr(mesh.real(s, collectives[o][1]))
            if isinstance(new, (graph.ParameterOp, graph.InputOp)):
                typ = new.properties["global_type"]
                assert isinstance(typ, TensorType)
                new.properties["global_type"], dim = stage_type(typ, mesh, s, f"'{o.tensor_name.data}'")
                if dim is not None:  # a micro-batch of a batch input: its own name and global shape
                    new.properties["tensor_name"] = StringAttr(f"{o.tensor_name.data}@mb{inst}")
            else:
                _restage_global_types([new], mesh, s)
            body.append(new)
            for old, r in zip(o.results, new.results):
                vmap[(old, inst_of(old, inst))] = r

        def micro_batch_of_union_input(o: Operation, inst: int | None) -> None:
            """Micro-batch `inst` of a batch input that the other groups share (hetero_pipeline): the
            stage reads its group's rows whole (once), then slices the micro-batch's rows and splits
            them over its dp ranks (the worker's `x@mbI` are slices of the whole batch, which holds
            the other groups' rows too)."""
            typ = o.properties["global_type"]
            layout = layout_of(typ)
            g = next(g for g in layout.groups if g.devices == mesh.virtual)  # type: ignore[union-attr]
            (axis, degree), *rest = g.states.axes
            if axis != split(0) or any(a.kind != "dup" for a, _ in rest):
                raise PassError(f"pipeline-split: input '{o.tensor_name.data}' is laid out as '{layout}'; beside "
                                "other device groups a pipelined group's micro-batches need it split along dim 0 only")
            dp = degree // microbatches
            tp = mesh.size // dp
            if (o.result, -1) not in vmap:
                groups = [Group(mesh.stages[s], DistributedStates.of((DUP, mesh.size))) if h is g else h
                          for h in layout.groups]  # type: ignore[union-attr]
                whole = Layout(tuple(groups), layout.hetero, layout.shares)  # type: ignore[union-attr]
                shape = whole.local_shape(mesh.stages[s][0], typ.get_shape())  # type: ignore[union-attr]
                read = graph.InputOp(o.tensor_name.data, TensorType(o.result.type.element_type, shape))
                read.properties["global_type"] = with_layout(typ, whole)
                body.append(read)
                vmap[(o.result, -1)] = read.result
            rows = vmap[(o.result, -1)]
            shape = list(rows.type.get_shape())  # type: ignore[attr-defined]
            shape[0] //= microbatches
            piece = graph.SliceOp(rows, 0, (inst or 0) * shape[0], TensorType(o.result.type.element_type, shape))
            body.append(piece)
            result = piece.result
            if dp > 1:
                real = [[mesh.stages[s][d * tp + t] for d in range(dp)] for t in range(tp)]
                split_op = comm.LocalSplitOp(piece.result, real, o.result.type, dim=0)
                body.append(split_op)
                result = split_op.result
            vmap[(o.result, inst_of(o.result, inst))] = result

        def issue(upto: Key | None) -> None:
            """Issue events in key order: all up to `upto`, then sends already made (upto None: sends only)."""
            nonlocal next_event
            while next_event < len(events):
                key, v, k, t, c = events[next_event]
                if t == s:
                    if (v, k) not in vmap:
                        if upto is not None and key <= upto:
                            raise PassError("pipeline-split: internal error: a send is due before its value is made")
                        return
                    body.append(comm.SendOp(vmap[(v, k)], pairs(t, c)))
                else:
                    if upto is None or key > upto:
                        return
                    recv = comm.RecvOp(pairs(t, c), v.type)
                    body.append(recv)
                    vmap[(v, k)] = recv.result
                next_event += 1

        for o, inst, _ in items[s]:
            need = [messages[(v, k, stages[v.owner], s)] for v, k in uses(o, inst)
                    if (v, k) not in vmap and (v, k, stages.get(v.owner, FREE), s) in messages]
            if need:
                issue(max(need))
            if collectives.get(o, (LOCAL,))[0] in (MEET, XMEET):  # the sum over micro-batches, in their order,
                vals = [get(v, k) for v, k in uses(o, inst)]  # then over the stage's dp ranks (and other groups)
                acc = vals[0]
                for x in vals[1:]:
                    add = graph.AddOp(acc, x, o.result.type)
                    body.append(add)
                    acc = add.result
                if collectives[o][0] == XMEET:
                    reduce = comm.AllReduceOp(acc, mesh.remap(s).groups(o.rank_groups), o.result.type)  # type: ignore
                    body.append(reduce)
                    place(o, reduce)
                    acc = reduce.result
                elif len((real := mesh.real(s, collectives[o][1]))[0]) > 1:
                    reduce = comm.AllReduceOp(acc, real, o.result.type)
                    body.append(reduce)
                    acc = reduce.result
                vmap[(o.result, None)] = acc
            elif collectives.get(o, (LOCAL,))[0] == SPLIT:  # slice `inst` of m, then split over the dp ranks
                x = get(o.operands[0], inst)
                dim = o.dim.value.data  # type: ignore[attr-defined]
                shape = list(x.type.get_shape())  # type: ignore[attr-defined]
                shape[dim] //= microbatches
                piece = graph.SliceOp(x, dim, inst * shape[dim], TensorType(o.result.type.element_type, shape))
                body.append(piece)
                real = mesh.real(s, collectives[o][1])
                result = piece.result
                if len(real[0]) > 1:
                    split_op = comm.LocalSplitOp(piece.result, real, o.result.type, dim=dim)
                    body.append(split_op)
                    result = split_op.result
                vmap[(o.result, inst)] = result
            else:
                clone(o, inst)
            issue(None)
        issue((post + 1,))
        if next_event != len(events):
            raise PassError(f"pipeline-split: internal error: stage {s} leaves messages unsent")
        out.append(body)
    return out
