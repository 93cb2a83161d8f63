"""The `comm` dialect: collectives and point-to-point transfers over rank groups.

`groups` holds disjoint, equal groups of global ranks (`#dist.groups<"[8192,8]<=[65536]">`, XLA's
iota form; IR written before ranges lists them, `[array<i64: 0, 1>, ...]`, and still reads);
every rank of the program takes part in the one group that holds it, and its position in that
group is its chunk index. The program text is the same on every rank (SPMD) and does not list
the ranks where a mesh axis names them: a rank finds its own group and position from its id at
run time (`RankGroups.group_of`).

At the annotated level these ops carry layouts in their types (global shapes); after
specialisation the types are the local pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from xdsl.dialects.builtin import ArrayAttr, DenseArrayBase, IntegerAttr, TensorType, i64
from xdsl.ir import Attribute, Dialect, Operation, SSAValue
from xdsl.irdl import (
    IRDLOperation,
    ParsePropInAttrDict,
    irdl_op_definition,
    operand_def,
    opt_prop_def,
    prop_def,
    result_def,
)
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.dist import LayoutAttr, RankGroupsAttr, RankPairsAttr
from hspmd.dialects.graph.base import i64_array, tensor_shape
from hspmd.ir.devices import DeviceRange, DeviceSetError, RankGroups, RankPairs
from hspmd.ir.layout import Layout

__all__ = ["COALESCE_ATTR", "Comm", "groups_attr", "groups_of", "members", "pair_partner", "pairs_attr", "talks_with"]

Groups = tuple[tuple[int, ...], ...]

#: on a `comm.all_reduce` whose group spans several device groups: the run of such sums it is
#: summed with, in one collective (`coalesce-group-sums`); every program of the run's ranks
#: marks the same run with the same number, so they all make the same bucket
COALESCE_ATTR = "coalesce"


def groups_attr(groups: Sequence[Sequence[int]] | RankGroups) -> RankGroupsAttr:
    """Return `#dist.groups<"...">` for rank groups (a RankGroups, or a list of equal disjoint groups)."""
    return RankGroupsAttr(RankGroups.of(groups))


def pairs_attr(pairs: Sequence[Sequence[int]] | RankPairs) -> RankPairsAttr:
    """Return `#dist.pairs<"0-3->4-7">` for a send's or receive's [src, dst] pairs."""
    return RankPairsAttr(RankPairs.of(pairs))


def pair_partner(pairs: Attribute, rank: int, role: str) -> int | None:
    """Return the rank `rank` sends to (`role` "src") or receives from ("dst") along `pairs`, found
    from its id (None: it takes no part in that role)."""
    found = groups_of(pairs)
    if isinstance(found, RankPairs):
        return found.partner(rank, role)
    if role == "src":
        return next((d for s, d in found if s == rank), None)
    return next((s for s, d in found if d == rank), None)


def members(op: Operation) -> tuple[DeviceRange, ...] | None:
    """Return the ranks communication op `op` involves (`talks_with`), as ranges where it has them
    (a collective's groups' members; a transfer's sources and destinations; an exchange's members);
    None for local ops and ops outside this dialect."""
    if isinstance(op, (LocalSplitOp, LocalZeroOp)):
        return None
    if isinstance(op, _Collective):
        return (op.rank_groups.members,)
    if isinstance(op, (SendOp, RecvOp)):
        found = groups_of(op.pairs)
        if isinstance(found, RankPairs):
            return (found.src, found.dst)
        return (DeviceRange.of(sorted({r for pair in found for r in pair})),)
    if isinstance(op, ExchangeOp):
        return (DeviceRange.of(op.members()),)
    return None


def groups_of(attr: Attribute) -> Groups | RankGroups | RankPairs:
    """Return the rank groups an attribute holds: a RankGroups for `#dist.groups`, RankPairs for
    `#dist.pairs`, tuples for an ArrayAttr of i64 arrays (IR written before ranges)."""
    if isinstance(attr, (RankGroupsAttr, RankPairsAttr)):
        return attr.data
    return tuple(tuple(g.get_values()) for g in attr.data)  # type: ignore[union-attr]


class _CommOp(IRDLOperation):
    """What every comm op says of itself (`dialects/interfaces.py`): it exists at the physical
    level only, and the runtime's communicator runs it."""

    NO_SHARDING_RULE: ClassVar[str] = "a physical-level op over explicit ranks: made by lower-reshard and the pipeline cut"
    NO_VJP: ClassVar[str] = "made after autodiff, at the physical level"
    NO_KERNEL: ClassVar[str] = "the runtime's communicator runs it (runtime/comm_kernels.py)"
    NO_FRONTEND: ClassVar[str] = "made by lower-reshard and the pipeline passes"


class _Collective(_CommOp):
    """A collective over `groups`: `%r = comm.X %x {groups = [...], ...} : T -> T`."""

    irdl_options = (ParsePropInAttrDict(),)
    input = operand_def(TensorType)
    result = result_def(TensorType)
    groups = prop_def(RankGroupsAttr | ArrayAttr)
    assembly_format = "$input attr-dict `:` type($input) `->` type($result)"

    def __init__(self, input: SSAValue, groups: Sequence[Sequence[int]] | RankGroups, result_type: Attribute,
                 **props: int):
        properties: dict[str, Attribute] = {"groups": groups_attr(groups)}
        properties.update({k: IntegerAttr(v, i64) for k, v in props.items()})
        super().__init__(operands=[input], result_types=[result_type], properties=properties)

    @property
    def rank_groups(self) -> RankGroups:
        """The rank groups of this collective (computed from their range, not listed)."""
        groups = self.groups
        if isinstance(groups, RankGroupsAttr):
            return groups.data
        return RankGroups.of(groups_of(groups))  # IR written before ranges: listed

    def group_size(self) -> int:
        return self.rank_groups.size

    def verify_(self) -> None:
        if isinstance(self.groups, ArrayAttr):  # IR written before ranges: each group listed
            if not all(isinstance(g, DenseArrayBase) for g in self.groups.data):
                raise VerifyException(f"'{self.name}' groups must be a list of array<i64: ...>")
            listed = groups_of(self.groups)
            try:
                RankGroups.of(listed)
            except DeviceSetError:
                sizes = {len(g) for g in listed}
                what = "differ in size" if len(sizes) != 1 else "overlap"
                raise VerifyException(f"'{self.name}' groups {listed} {what}") from None
        if self.input.type.element_type != self.result.type.element_type:  # type: ignore[attr-defined]
            raise VerifyException(f"'{self.name}' keeps the element type")
        self.verify_shapes(tensor_shape(self.input), tensor_shape(self.result))

    def verify_shapes(self, src: tuple[int, ...], dst: tuple[int, ...]) -> None:
        if src != dst:
            raise VerifyException(f"'{self.name}' keeps the shape, got {list(src)} -> {list(dst)}")

    def _dim(self, name: str) -> int:
        return getattr(self, name).value.data


class _Resizing(_Collective):
    """A collective that changes dim `dim` by the group size at the physical level."""

    dim = prop_def(IntegerAttr)
    GROWS: ClassVar[bool] = True

    def verify_shapes(self, src: tuple[int, ...], dst: tuple[int, ...]) -> None:
        d = self._dim("dim")
        if not 0 <= d < len(src) or len(src) != len(dst):
            raise VerifyException(f"'{self.name}' dim {d} is not a dim of {list(src)}")
        if src == dst:  # annotated level: global shapes do not change
            return
        n = self.group_size()
        small, big = (src, dst) if self.GROWS else (dst, src)
        expect = tuple(s * n if i == d else s for i, s in enumerate(small))
        if big != expect:
            raise VerifyException(
                f"'{self.name}' over groups of {n} along dim {d} cannot turn {list(src)} into {list(dst)}"
            )


@irdl_op_definition
class AllReduceOp(_Collective):
    """Sum over each group; every member gets the sum."""

    name = "comm.all_reduce"


@irdl_op_definition
class BroadcastOp(_Collective):
    """Every member gets the value of the member at position `root` of its group."""

    name = "comm.broadcast"
    root = prop_def(IntegerAttr)


@irdl_op_definition
class AllGatherOp(_Resizing):
    """Concatenation of the members' pieces along `dim`, in group order.

    With `sizes` (every member's extent along `dim`, in group order: uneven pieces, as
    groups with unequal shares hold) the result's extent is their sum, the same on every rank.
    """

    name = "comm.all_gather"
    sizes = opt_prop_def(DenseArrayBase)

    def verify_shapes(self, src: tuple[int, ...], dst: tuple[int, ...]) -> None:
        if self.sizes is None:
            return super().verify_shapes(src, dst)
        d, sizes = self._dim("dim"), tuple(self.sizes.get_values())
        if len(sizes) != self.group_size():
            raise VerifyException(f"'{self.name}' has {len(sizes)} sizes for groups of {self.group_size()}")
        if not 0 <= d < len(src) or len(src) != len(dst) or src == dst:
            return
        if dst[d] != sum(sizes) or src[d] not in sizes or any(a != b for i, (a, b) in enumerate(zip(src, dst)) if i != d):
            raise VerifyException(
                f"'{self.name}' with sizes {list(sizes)} along dim {d} cannot turn {list(src)} into {list(dst)}")


@irdl_op_definition
class ReduceScatterOp(_Resizing):
    """Sum over each group; member i keeps chunk i along `dim`."""

    name = "comm.reduce_scatter"
    GROWS: ClassVar[bool] = False


@irdl_op_definition
class LocalSplitOp(_Resizing):
    """No transfer: member i keeps chunk i along `dim` of its (replicated) value."""

    name = "comm.local_split"
    GROWS: ClassVar[bool] = False


@irdl_op_definition
class LocalZeroOp(_Collective):
    """No transfer: the member at position 0 keeps its value, the others hold zeros (replicas to partial sums)."""

    name = "comm.local_zero"


@irdl_op_definition
class AllToAllOp(_Collective):
    """Member i sends chunk j along `split_dim` to member j; received chunks join along `concat_dim`."""

    name = "comm.all_to_all"
    split_dim = prop_def(IntegerAttr)
    concat_dim = prop_def(IntegerAttr)

    def verify_shapes(self, src: tuple[int, ...], dst: tuple[int, ...]) -> None:
        if src == dst:
            return
        n, s, c = self.group_size(), self._dim("split_dim"), self._dim("concat_dim")
        expect = list(src)
        expect[s] //= n
        expect[c] *= n
        if tuple(expect) != dst or src[s] % n:
            raise VerifyException(f"'{self.name}' cannot turn {list(src)} into {list(dst)}")


def _message_properties(pairs: Sequence[Sequence[int]] | RankPairs, tag: int) -> dict[str, Attribute]:
    """Return the properties of a send or receive: its pairs, and its tag unless it is 0."""
    props: dict[str, Attribute] = {"pairs": pairs_attr(pairs)}
    if tag:
        props["tag"] = IntegerAttr(tag, i64)
    return props


def _tag_value(tag: IntegerAttr | None) -> int:
    return tag.value.data if tag is not None else 0


@irdl_op_definition
class SendOp(_CommOp):
    """Sends the value along `pairs` ([src, dst] rank pairs): a rank that is a src sends to its dst.

    The send does not wait for its receive (the runtime waits for every send at the end of
    the step), so a program's sends never block it. `tag` (default 0) tells messages between
    the same two ranks apart: a receive takes the oldest message from its src with its tag.
    """

    name = "comm.send"
    irdl_options = (ParsePropInAttrDict(),)
    input = operand_def(TensorType)
    pairs = prop_def(RankPairsAttr | ArrayAttr)
    tag = opt_prop_def(IntegerAttr)
    assembly_format = "$input attr-dict `:` type($input)"

    def __init__(self, input: SSAValue, pairs: Sequence[Sequence[int]] | RankPairs, tag: int = 0):
        super().__init__(operands=[input], properties=_message_properties(pairs, tag))

    @property
    def tag_value(self) -> int:
        """Return the message tag (0 when the op has none)."""
        return _tag_value(self.tag)


@irdl_op_definition
class RecvOp(_CommOp):
    """Receives a value along `pairs` ([src, dst] rank pairs): a rank that is a dst receives from its src.

    It takes the oldest message from its src with the same `tag` (default 0), and blocks until one comes.
    """

    name = "comm.recv"
    irdl_options = (ParsePropInAttrDict(),)
    result = result_def(TensorType)
    pairs = prop_def(RankPairsAttr | ArrayAttr)
    tag = opt_prop_def(IntegerAttr)
    assembly_format = "attr-dict `:` type($result)"

    def __init__(self, pairs: Sequence[Sequence[int]] | RankPairs, result_type: Attribute, tag: int = 0):
        super().__init__(result_types=[result_type], properties=_message_properties(pairs, tag))

    @property
    def tag_value(self) -> int:
        """Return the message tag (0 when the op has none)."""
        return _tag_value(self.tag)


@irdl_op_definition
class ExchangeOp(_CommOp):
    """Batched point-to-point over the finest common slices (the general reshard between unions).

    The op names the transition, not its transfers: `src` and `dst` layouts and the tensor's
    global `shape`, so its size does not grow with the number of ranks. The transfers follow
    from them (`hspmd.ir.reshard_plan.exchange_step`, the same list on every rank): every rank
    of `src` and `dst` starts its result from zeros and adds each transfer into it (several
    into one region sum); transfers run in list order, every rank sending and receiving its
    own in that one global order, so each blocking send meets its receive (the earliest
    unfinished transfer always has both ends at it).

    In a pipeline stage's forward or backward an exchange may keep the layouts of the
    stage-shaped step's *virtual* devices (one per micro-batch and stage position) when every
    transfer of theirs stays on one device: `microbatch_ranks` lists the virtual devices
    (micro-batch major) and `stage_ranks` the stage's real ones, and the rank at stage position
    q runs micro-batch i's transfers as virtual device `microbatch_ranks[i * len(stage_ranks) + q]`.
    """

    name = "comm.exchange"
    irdl_options = (ParsePropInAttrDict(),)
    input = operand_def(TensorType)
    result = result_def(TensorType)
    src = prop_def(LayoutAttr)
    dst = prop_def(LayoutAttr)
    shape = prop_def(DenseArrayBase)
    microbatch_ranks = opt_prop_def(DenseArrayBase)
    stage_ranks = opt_prop_def(DenseArrayBase)
    assembly_format = "$input attr-dict `:` type($input) `->` type($result)"

    def __init__(self, input: SSAValue, src: Layout, dst: Layout, shape: Sequence[int], result_type: Attribute):
        super().__init__(operands=[input], result_types=[result_type],
                         properties={"src": LayoutAttr(src), "dst": LayoutAttr(dst), "shape": i64_array(shape)})

    def global_shape(self) -> tuple[int, ...]:
        """Return the global shape of the tensor being moved."""
        return tuple(self.shape.get_values())  # type: ignore[arg-type]

    def members(self) -> tuple[int, ...]:
        """Return every rank taking part (holding a source or a destination piece), sorted."""
        return tuple(sorted(set(self.src.data.devices) | set(self.dst.data.devices)))

    def transfer_list(self) -> tuple[tuple[int, int, tuple[tuple[int, int, int], ...]], ...]:
        """Return (src, dst, ((src_start, dst_start, size) per dim)) for each transfer, in order."""
        from hspmd.ir.reshard_plan import exchange_step

        step = exchange_step(self.src.data, self.dst.data, self.global_shape())
        return tuple((s, d, tuple((a, c, b - a) for (a, b), (c, _) in zip(sr, dr))) for s, sr, d, dr in step.transfers)

    def verify_(self) -> None:
        from hspmd.ir.layout import LayoutError

        shape = self.global_shape()
        if len(shape) != len(tensor_shape(self.result)) or any(n < 0 for n in shape):
            raise VerifyException(f"'{self.name}' global shape {list(shape)} does not fit a rank-"
                                  f"{len(tensor_shape(self.result))} result")
        for role, layout in (("src", self.src.data), ("dst", self.dst.data)):
            try:
                layout.check_shape(shape)
            except LayoutError as err:
                raise VerifyException(f"'{self.name}' {role} layout '{layout}' does not fit shape {list(shape)}: {err}")


def talks_with(op: Operation) -> frozenset[int]:
    """Return the ranks communication op `op` involves: a collective's groups, a transfer's
    pairs, an exchange's members; none for local ops (`local_split`, `local_zero`) and for ops
    outside this dialect."""
    found = members(op)
    return frozenset() if found is None else frozenset(r for part in found for r in part)


Comm = Dialect(
    "comm",
    [AllReduceOp, BroadcastOp, AllGatherOp, ReduceScatterOp, LocalSplitOp, LocalZeroOp, AllToAllOp, SendOp, RecvOp,
     ExchangeOp],
    [],
)
