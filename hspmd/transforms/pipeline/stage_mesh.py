"""How a stage-shaped program's virtual devices map onto the stages' real ones.

`StageMesh` holds each stage's real devices and the one-group program's virtual devices: virtual
position `p` is micro-batch `p // S` at stage position `p % S` (S devices per stage, dp major,
tp minor). `classify_collective` says how the stages run each collective of the one-group
program (LOCAL inside one micro-batch, MEET an all-reduce over the micro-batches, SPLIT a local
split across them, and with other device groups CROSS, MAPPED, VLOCAL, XSPAN -> XMEET/XPOST,
ZERO); `stage_layout` / `stage_type` give a value's layout and type on a stage.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from xdsl.dialects.builtin import IntegerAttr, TensorType, i64
from xdsl.ir import Operation

from hspmd.dialects import comm, graph
from hspmd.dialects.dist import layout_of, with_layout
from hspmd.dialects.graph import i64_array
from hspmd.ir.devices import DeviceRange, RankGroups
from hspmd.ir.layout import DUP, PARTIAL, DistributedStates, Group, Layout
from hspmd.transforms.pipeline.devices import comm_devices, partners, rank_groups, remap_layout
from hspmd.transforms.util import PassError, StrategyLimitError

__all__ = ["CROSS", "LOCAL", "MAPPED", "MEET", "SPLIT", "VLOCAL", "XMEET", "XPOST", "XSPAN", "ZERO",
           "StageMesh", "StageRemap", "classify_collective", "restage_global_types", "run_as_virtual",
           "stage_layout", "stage_type"]


@dataclass(frozen=True)
class StageMesh:
    """The real devices of each stage and how the one-group program's virtual devices map onto them.

    Virtual position `p` (index in `virtual`) is micro-batch `p // size` at stage position
    `p % size`; stage position q is real device `stages[s][q]` on stage s (q = d*tp + t).
    """

    stages: tuple[DeviceRange, ...]
    virtual: DeviceRange
    microbatches: int
    #: the devices of the other groups of a heterogeneous strategy (`virtual=...`)
    foreign: frozenset[int] = frozenset()
    #: `stage_type`'s results so far, (type, stage) -> (type on the stage, micro-batch dim)
    types: dict[tuple[TensorType, int], tuple[TensorType, int | None]] = field(
        default_factory=dict, compare=False, hash=False, repr=False)
    #: `stage_layout`'s results so far, (layout, stage) -> (layout on the stage, micro-batch dim)
    layouts: dict[tuple[Layout | None, int], tuple[Layout, int | None]] = field(
        default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(DeviceRange.of(st) for st in self.stages))
        object.__setattr__(self, "virtual", DeviceRange.of(self.virtual))

    def device_map(self, s: int) -> dict[int, int]:
        """Return virtual device -> stage s's real device (one micro-batch: position p is `stages[s][p]`)."""
        return {v: self.stages[s][p % self.size] for p, v in enumerate(self.virtual)}

    def collapse(self, s: int, group: Sequence[int]) -> list[int]:
        """Return a rank group with virtual devices on stage s's real devices (position p -> p % size),
        each once, in first-seen order; other groups' devices stay."""
        out: list[int] = []
        seen: set[int] = set()
        for d in group:
            real = self.stages[s][self.virtual.index(d) % self.size] if d in self.virtual else d
            if real not in seen:
                seen.add(real)
                out.append(real)
        return out

    def remap(self, s: int) -> "StageRemap":
        """Return how stage s renames the virtual devices in rank groups and layouts."""
        return StageRemap(self, s)

    @property
    def size(self) -> int:
        """Return the number of devices of one stage (dp * tp)."""
        return len(self.stages[0])

    def positions(self, group: Sequence[int]) -> list[int]:
        """Return the virtual positions of a rank group of virtual devices."""
        try:
            return [self.virtual.index(d) for d in group]
        except ValueError:
            raise PassError(f"pipeline-split: rank group {list(group)} names a device outside the "
                            f"one-group program's devices {list(self.virtual)}") from None

    def real(self, s: int, groups: Iterable[Sequence[int]] | RankGroups) -> list[list[int]] | RankGroups:
        """Return stage `s`'s real devices for groups of stage positions (computed from the stage's
        range where the positions are rank groups)."""
        if isinstance(groups, RankGroups):
            return RankGroups(self.stages[s].take(groups.members), groups.size)
        return [[self.stages[s][q] for q in g] for g in groups]


@dataclass(frozen=True)
class StageRemap:
    """Rank groups and layouts of the one-group program (and of the groups beside it) on stage s.

    Rank groups collapse (`StageMesh.collapse`); a layout whose group is the virtual devices
    gets the stage's layout in its place (`stage_layout`: the micro-batches' axis divided by m).
    """

    mesh: StageMesh
    s: int

    def groups(self, groups: Sequence[Sequence[int]]) -> list[list[int]]:
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


def run_as_virtual(o: Operation, mesh: StageMesh, s: int) -> None:
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


def _one_microbatch(o: Operation, mesh: StageMesh) -> RankGroups | None:
    """Return the stage positions of a collective in a pipeline of one micro-batch and one group
    (each group inside the one micro-batch), computed from the groups' range; None where the
    general classification must list them (micro-batches, other groups, groups listed, or groups
    whose order differs from the listed positions' sorted order)."""
    groups = getattr(o, "rank_groups", None)
    if mesh.microbatches != 1 or mesh.foreign or not isinstance(groups, RankGroups) or groups.members.ids is not None:
        return None
    if not groups.members.issubset(mesh.virtual) or len(groups.members) != mesh.size:
        return None
    positions = RankGroups(mesh.virtual.positions(groups.members), groups.size)
    firsts = positions.members.take(DeviceRange.span(0, len(positions), groups.size)) if len(positions) > 1 else None
    if positions.members.ids is not None or (firsts is not None and (firsts.ids is not None or len(firsts.shape) > 1)):
        return None  # listed, or groups not in increasing order of their first position
    return positions


def classify_collective(o: Operation, mesh: StageMesh) -> tuple[str, tuple[tuple[int, ...], ...]]:
    """Return how the stages run a collective of the one-group program, and over which stage positions.

    (LOCAL, groups) for a collective inside one micro-batch; (MEET, groups Q) for an
    all-reduce over all micro-batches times Q (a sum over micro-batches, then an all-reduce
    over Q); (SPLIT, groups Q) for a local split over all micro-batches times Q, micro-batch
    major (micro-batch i's slice i of m, then a local split over Q); (CROSS, ()) for a
    collective with other groups of a heterogeneous strategy (`join-pipeline-groups`: it runs on
    one stage, every virtual device renamed to that stage's real one); (MAPPED, ()) for one
    that names other groups' devices but moves no data to or from them (an exchange whose
    transfers stay inside each group): each stage runs it with its real devices. With
    micro-batches beside other groups: (XSPAN, ()) for a cross-group all-reduce (each group's
    virtual part all micro-batches times one position set), (ZERO, groups Q) for a local_zero
    over the micro-batches (of a value every micro-batch holds whole).
    """
    size, m = mesh.size, mesh.microbatches
    fast = _one_microbatch(o, mesh)
    if fast is not None:
        return LOCAL, fast
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
            raise StrategyLimitError(f"pipeline-split: '{o.name}' moves data across device groups inside a micro-batch; "
                            f"with microbatches={m} a pipelined group beside other groups may only sum across groups "
                            "(all-reduces of gradients and the loss), so use microbatches=1 (or the same tp in every "
                            "group)")
        for g in rank_groups(o):
            by_mb: dict[int, set[int]] = {}
            for p in mesh.positions([d for d in g if d not in mesh.foreign]):
                by_mb.setdefault(p // size, set()).add(p % size)
            if by_mb and (len(by_mb) != m or len({frozenset(v) for v in by_mb.values()}) != 1):
                raise StrategyLimitError(f"pipeline-split: '{o.name}' group {list(g)} sums across device groups over "
                                         f"some but not all {m} micro-batches, or other positions in each (as tensor "
                                         "parallelism in several pipelined groups does: use tp=1 there, or "
                                         "microbatches=1)")
        return XSPAN, ()
    groups = [mesh.positions(g) for g in rank_groups(o)]
    kind = LOCAL
    out: set[tuple[int, ...]] = set()
    if all(len({p // size for p in g}) == 1 for g in groups):
        out = {tuple(p % size for p in g) for g in groups}
    else:
        zero = bool(mesh.foreign) and isinstance(o, comm.LocalZeroOp)
        if not isinstance(o, (comm.AllReduceOp, comm.LocalSplitOp)) and not zero:
            # the user's strategy, not a broken input: an op mixing the batch's rows (a gather of
            # the whole batch) cannot run one micro-batch at a time
            raise StrategyLimitError(f"pipeline-split: '{o.name}' over {rank_groups(o)} spans micro-batches (an "
                                     "op that mixes the batch's rows); only all-reduces (sums over the "
                                     f"micro-batches) and local splits may: use microbatches=1 (it has {m})")
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
        raise PassError(f"pipeline-split: '{o.name}' over {rank_groups(o)}: "
                        "its groups differ between micro-batches, so the stage cannot run it as one collective")
    return kind, tuple(sorted(out))


def stage_layout(layout: Layout | None, mesh: StageMesh, s: int, what: str) -> tuple[Layout, int | None]:
    """Return (the layout of a value on stage s's devices, the tensor dim split over the micro-batches).

    The major axis of the one-group layout holds the micro-batches: its degree is divided by
    m. The dim is None when the micro-batches hold replicas or partial sums (or m = 1). In a
    union with other groups (`virtual=...`) the stage's group replaces the virtual one.
    (Memoized on the mesh, like `stage_type`.)
    """
    key = (layout, s)
    if key not in mesh.layouts:
        mesh.layouts[key] = _stage_layout(layout, mesh, s, what)
    return mesh.layouts[key]


def _stage_layout(layout: Layout | None, mesh: StageMesh, s: int, what: str) -> tuple[Layout, int | None]:
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
    groups = list(layout.groups)  # a union with other groups (join-pipeline-groups): the stage in the group's place
    groups[mine[0]] = Group(mesh.stages[s], states)
    return Layout(tuple(groups), layout.hetero, layout.shares), dim


def staged_layout(typ: TensorType) -> Layout:
    """Return the layout of an annotated type (one that has a layout)."""
    layout = layout_of(typ)
    assert layout is not None
    return layout


def stage_type(typ: TensorType, mesh: StageMesh, s: int, what: str) -> tuple[TensorType, int | None]:
    """Return (the annotated type `typ` of the one-group program on stage s, the micro-batch dim):
    one micro-batch's global shape (the dim split over micro-batches divided by m), the stage's layout.
    (Memoized on the mesh: many ops share a type, and building one costs more than looking it up.)"""
    key = (typ, s)
    if key not in mesh.types:
        layout, dim = stage_layout(layout_of(typ), mesh, s, what)
        shape = list(typ.get_shape())
        if dim is not None and len(layout.groups) == 1:  # (a union keeps the whole batch's shape)
            shape[dim] //= mesh.microbatches
        mesh.types[key] = (with_layout(TensorType(typ.element_type, shape), layout), dim)
    return mesh.types[key]


def restage_global_types(ops: Iterable[Operation], mesh: StageMesh, s: int) -> None:
    """Put the `global_type` of position-dependent ops (embedding, one_hot, dropout) on stage s.

    A dropout of one micro-batch (split over the micro-batches, one device group) also records
    their number and dim, so that the runtime keys its mask by the whole tensor's indices."""
    for o in ops:
        typ = o.properties.get("global_type")
        if isinstance(typ, TensorType) and layout_of(typ) is not None \
                and not isinstance(o, (graph.ParameterOp, graph.InputOp)):
            staged, dim = stage_type(typ, mesh, s, f"the result of '{o.name}'")
            if isinstance(o, graph.DropoutOp) and dim is not None and len(staged_layout(typ).groups) > 1:
                run_as_virtual(o, mesh, s)  # beside other groups: the virtual layout, as each micro-batch's device
                continue
            o.properties["global_type"] = staged
            if isinstance(o, graph.DropoutOp) and dim is not None:
                o.properties["microbatches"] = IntegerAttr(mesh.microbatches, i64)
                o.properties["microbatch_dim"] = IntegerAttr(dim, i64)

