"""The `dist` dialect: HSPMD layouts as IR attributes, and resharding between layouts.

A layout rides in the encoding of a tensor type, so at the annotated level every value
carries one: `tensor<64x32xf32, #dist.layout<"[0,1]: split(0)=2">>`. The text inside the
quotes is the layout grammar of `hspmd.ir.layout_text`, the same text users write.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, TypeVar

from xdsl.dialects.builtin import ArrayAttr, NoneAttr, StringAttr, TensorType
from xdsl.ir import Attribute, Data, Dialect, Operation, SSAValue, TypeAttribute
from xdsl.irdl import (
    IRDLOperation,
    ParsePropInAttrDict,
    irdl_attr_definition,
    irdl_op_definition,
    operand_def,
    opt_prop_def,
    prop_def,
    result_def,
)
from xdsl.parser import AttrParser
from xdsl.printer import Printer
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.traced import as_tensor, fail
from hspmd.ir.devices import (DeviceRange, DeviceSetError, RankGroups, RankPairs, parse_devices, parse_rank_groups,
                               parse_rank_pairs)
from hspmd.ir.layout import Layout, LayoutError
from hspmd.ir.layout_text import LayoutSyntaxError, parse_layout
from hspmd.ir.strategy import StrategyError, StrategyRecord, parse_strategy

__all__ = ["AnnotateOp", "DevicesAttr", "Dist", "LayoutAttr", "QuotedTextAttr", "RankGroupsAttr", "RankPairsAttr", "MESH_AXES", "ReshardOp", "STRATEGIES_ATTR", "StrategyAttr",
           "layout_of", "module_strategies", "record_strategy", "with_layout", "without_layout"]

# the mesh axes a strategy gives each device group, which `dist.annotate` may name per dim
MESH_AXES = ("dp", "tp")


_T = TypeVar("_T")


class QuotedTextAttr(Data[_T]):
    """An attribute written as one quoted text, `#dist.NAME<"TEXT">`, whose data `read` makes from
    the text and `str()` writes back: a subclass says only what its text is and how to read it."""

    #: what the text is, as a parse error names it (`bad device set: ...`)
    TEXT_NAME: ClassVar[str]
    #: what `read` raises on a bad text
    TEXT_ERRORS: ClassVar[tuple[type[Exception], ...]] = (DeviceSetError,)

    @staticmethod
    def read(text: str) -> _T:
        """Return the data that `text` writes (`TEXT_ERRORS` if it writes none)."""
        raise NotImplementedError

    @classmethod
    def parse_parameter(cls, parser: AttrParser) -> _T:
        with parser.in_angle_brackets():
            pos = parser.pos
            text = parser.parse_str_literal(f" (the {cls.TEXT_NAME})")
            try:
                return cls.read(text)
            except cls.TEXT_ERRORS as err:
                parser.raise_error(f"bad {cls.TEXT_NAME}: {err}", pos, parser.pos)

    def print_parameter(self, printer: Printer) -> None:
        with printer.in_angle_brackets():
            printer.print_string_literal(str(self.data))


@irdl_attr_definition
class LayoutAttr(QuotedTextAttr[Layout]):
    """`#dist.layout<"TEXT">`: one HSPMD layout (groups, per-group states, hetero axis, shares)."""

    name = "dist.layout"
    TEXT_NAME = "layout"
    TEXT_ERRORS = (LayoutSyntaxError, LayoutError)
    read = staticmethod(parse_layout)


@irdl_attr_definition
class DevicesAttr(QuotedTextAttr[DeviceRange]):
    """`#dist.devices<"0-4095">`: a set of devices as a range (`hspmd.ir.devices.DeviceRange`): a
    physical group module's devices (`hspmd.devices`), as short for 65,536 devices as for 4."""

    name = "dist.devices"
    TEXT_NAME = "device set"
    read = staticmethod(parse_devices)


@irdl_attr_definition
class RankGroupsAttr(QuotedTextAttr[RankGroups]):
    """`#dist.groups<"[8,2]<=[16]">`: the disjoint, equal rank groups of a collective, in XLA's iota
    form (`[groups,size]<=[reshape]T(perm)`) or, where irregular or shorter, listed (`{0,2},{1,3}`);
    a rank finds its group and its position in it from its id (`RankGroups.group_of`)."""

    name = "dist.groups"
    TEXT_NAME = "rank groups"
    read = staticmethod(parse_rank_groups)


@irdl_attr_definition
class RankPairsAttr(QuotedTextAttr[RankPairs]):
    """`#dist.pairs<"0-2047->2048-4095">`: a send's or receive's [src, dst] pairs, sources and
    destinations as two ranges (`src[i]` sends to `dst[i]`)."""

    name = "dist.pairs"
    TEXT_NAME = "rank pairs"
    read = staticmethod(parse_rank_pairs)


@irdl_attr_definition
class StrategyAttr(Data[StrategyRecord]):
    """`#dist.strategy<id = 0, "[0-3]: dp=1 tp=2 pp=2", microbatches = 4, schedule = "1f1b">`: a strategy
    as IR data (`hspmd.ir.strategy.StrategyRecord`), in the module's `dist.strategies` list.

    `apply-strategy` records it; every later pass that needs the strategy reads it from there.
    """

    name = "dist.strategy"

    @classmethod
    def parse_parameter(cls, parser: AttrParser) -> StrategyRecord:
        def key(word: str) -> None:
            parser.parse_keyword(word)
            parser.parse_punctuation("=")

        with parser.in_angle_brackets():
            start = parser.pos
            key("id")
            sid = parser.parse_integer(allow_boolean=False, allow_negative=False)
            parser.parse_punctuation(",")
            text_pos = parser.pos
            text = parser.parse_str_literal(" (the strategy text)")
            parser.parse_punctuation(",")
            key("microbatches")
            m = parser.parse_integer(allow_boolean=False, allow_negative=False)
            parser.parse_punctuation(",")
            key("schedule")
            schedule = parser.parse_str_literal(" (the pipeline schedule name)")
            try:
                strategy = parse_strategy(text)
            except StrategyError as err:
                parser.raise_error(f"bad strategy: {err}", text_pos, text_pos + len(text) + 2)
            try:
                return StrategyRecord(sid, strategy, m, schedule)
            except StrategyError as err:
                parser.raise_error(f"bad strategy record: {err}", start, parser.pos)

    def print_parameter(self, printer: Printer) -> None:
        r = self.data
        with printer.in_angle_brackets():
            printer.print_string(f"id = {r.id}, ")
            printer.print_string_literal(str(r.strategy))
            printer.print_string(f", microbatches = {r.microbatches}, schedule = ")
            printer.print_string_literal(r.schedule)


#: the module attribute holding the module's strategies: `[#dist.strategy<id = 0, ...>, ...]`
STRATEGIES_ATTR = "dist.strategies"


def module_strategies(module: Operation) -> tuple[StrategyRecord, ...]:
    """Return the strategies recorded on `module` (`dist.strategies`), in id order; () if none."""
    attr = module.attributes.get(STRATEGIES_ATTR)
    if attr is None:
        return ()
    assert isinstance(attr, ArrayAttr)
    return tuple(sorted((a.data for a in attr.data if isinstance(a, StrategyAttr)), key=lambda r: r.id))


def record_strategy(module: Operation, record: StrategyRecord) -> None:
    """Add `record` to the strategies of `module`, replacing one with the same id."""
    kept = [r for r in module_strategies(module) if r.id != record.id]
    module.attributes[STRATEGIES_ATTR] = ArrayAttr([StrategyAttr(r) for r in sorted([*kept, record],
                                                                                     key=lambda r: r.id)])


#: the module attribute of a tensor-parallel plan: parameter (per-layer name) -> the dim tp splits
#: (an imported PyTorch model's plan, `hspmd.frontend.torch_import`); `apply-strategy` follows it
TP_SPLIT_ATTR = "hspmd.tp_split"


def record_tp_splits(module: Operation, splits: dict[str, int]) -> None:
    """Record on `module` the dim tp splits of each parameter named in `splits` (`TP_SPLIT_ATTR`)."""
    from xdsl.dialects.builtin import DictionaryAttr, IntegerAttr, i64

    module.attributes[TP_SPLIT_ATTR] = DictionaryAttr({k: IntegerAttr(v, i64) for k, v in sorted(splits.items())})


def tp_splits_of(module: Operation) -> dict[str, int]:
    """Return the tp split dims `module` records (`TP_SPLIT_ATTR`), {} where it records none."""
    attr = module.attributes.get(TP_SPLIT_ATTR)
    return {k: v.value.data for k, v in attr.data.items()} if attr is not None else {}  # type: ignore[attr-defined]


def layout_of(value: SSAValue | Attribute) -> Layout | None:
    """Return the layout in a tensor value's (or type's) encoding, or None if it has none."""
    typ = value.type if isinstance(value, SSAValue) else value
    if isinstance(typ, TensorType) and isinstance(typ.encoding, LayoutAttr):
        return typ.encoding.data
    return None


def with_layout(typ: Attribute, layout: Layout) -> TensorType:
    """Return tensor type `typ` carrying `layout` in its encoding."""
    assert isinstance(typ, TensorType)
    return TensorType(typ.element_type, typ.get_shape(), LayoutAttr(layout))


def without_layout(typ: Attribute, shape: tuple[int, ...] | None = None) -> TensorType:
    """Return tensor type `typ` with no encoding, optionally with another shape."""
    assert isinstance(typ, TensorType)
    return TensorType(typ.element_type, typ.get_shape() if shape is None else shape, NoneAttr())


@irdl_op_definition
class ReshardOp(IRDLOperation):
    """Same tensor, another layout: the compiler lowers it into `comm` ops.

    At the annotated level the two layouts are in the operand and result types. After
    `specialize-groups` the types are local pieces and the layouts move to `src` and `dst`,
    until `lower-reshard` replaces the op with collectives.
    """

    name = "dist.reshard"
    irdl_options = (ParsePropInAttrDict(),)
    NO_SHARDING_RULE: ClassVar[str] = "it is the change of layout: insert-reshard places it where a consumer needs one"
    NO_VJP: ClassVar[str] = "placed after autodiff (the annotated level)"
    NO_KERNEL: ClassVar[str] = "lower-reshard replaces it with comm ops"
    NO_FRONTEND: ClassVar[str] = "placed by insert-reshard and apply-annotations"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    src = opt_prop_def(LayoutAttr)
    dst = opt_prop_def(LayoutAttr)
    #: the annotated result type (its global shape), which local types cannot always tell when
    #: pieces are uneven; specialize-groups records it, lower-reshard reads it
    global_type = opt_prop_def(TypeAttribute)
    RECORDS_GLOBAL_TYPE: ClassVar[bool] = True
    assembly_format = "$input attr-dict `:` type($input) `->` type($result)"

    def __init__(self, input: SSAValue, result_type: Attribute, src: Layout | None = None, dst: Layout | None = None):
        props = {} if src is None or dst is None else {"src": LayoutAttr(src), "dst": LayoutAttr(dst)}
        super().__init__(operands=[input], result_types=[result_type], properties=props)

    def layouts(self) -> tuple[Layout, Layout]:
        """Return (source layout, destination layout), from the types or the properties."""
        if self.src is not None and self.dst is not None:
            return self.src.data, self.dst.data
        src, dst = layout_of(self.input), layout_of(self.result)
        assert src is not None and dst is not None
        return src, dst

    def verify_(self) -> None:
        src, dst = self.input.type, self.result.type
        assert isinstance(src, TensorType) and isinstance(dst, TensorType)
        if src.element_type != dst.element_type:
            raise VerifyException("'dist.reshard' keeps the element type; only the layout changes")
        if (self.src is None) != (self.dst is None):
            raise VerifyException("'dist.reshard' needs both 'src' and 'dst' or neither")
        if self.src is None:
            # the operand may lack one only before propagate-layouts (apply-annotations places
            # reshards whose operand propagation lays out); the annotated level checks every value
            if layout_of(dst) is None:
                raise VerifyException("'dist.reshard' needs a layout on its result")
            if src.get_shape() != dst.get_shape():
                raise VerifyException("'dist.reshard' keeps the global shape; only the layout changes")


@irdl_op_definition
class AnnotateOp(IRDLOperation):
    """`hs.annotate`: the same tensor, with the layout the user asks for (logical level).

    `spec` names, per dim, the strategy's mesh axis that splits it (`"dp"`, `"tp"`) or `""`
    for none, like a JAX PartitionSpec; or `layout` gives a whole layout over named devices.
    `apply-annotations` turns the op into a `dist.reshard` to that layout, which propagation
    then keeps (a user's layout wins) and `lower-reshard` carries out. Its gradient is
    annotated alike.
    """

    name = "dist.annotate"
    irdl_options = (ParsePropInAttrDict(),)
    NO_SHARDING_RULE: ClassVar[str] = "apply-annotations turns it into a dist.reshard to its layout"
    NO_KERNEL: ClassVar[str] = "apply-annotations replaces it before the physical level"
    FRONTEND: ClassVar[tuple[str, ...]] = ("annotate",)
    input = operand_def(TensorType)
    result = result_def(TensorType)
    spec = prop_def(ArrayAttr)
    layout = opt_prop_def(LayoutAttr)
    assembly_format = "$input attr-dict `:` type($input) `->` type($result)"

    def __init__(self, input: SSAValue, spec: tuple[str, ...] = (), layout: Layout | None = None):
        props: dict[str, Attribute] = {"spec": ArrayAttr([StringAttr(a) for a in spec])}
        if layout is not None:
            props["layout"] = LayoutAttr(layout)
        super().__init__(operands=[input], result_types=[input.type], properties=props)

    def axes(self) -> tuple[str, ...]:
        """Return the mesh axis (or "") of each dim; () when the op names a whole layout."""
        return tuple(a.data for a in self.spec.data)  # type: ignore[attr-defined]

    def vjp(self, gs, emit):  # the gradient of an annotated value is laid out alike
        layout = self.layout.data if self.layout is not None else None
        return [lambda: emit(AnnotateOp(gs[0], self.axes(), layout))]

    def verify_(self) -> None:
        typ = self.input.type
        assert isinstance(typ, TensorType)
        if self.result.type != typ:
            raise VerifyException("'dist.annotate' keeps its operand's type")
        axes = self.axes()
        if self.layout is not None:
            if axes:
                raise VerifyException("'dist.annotate' takes a spec or a layout, not both")
            try:
                self.layout.data.check_shape(tuple(typ.get_shape()))
            except LayoutError as err:
                raise VerifyException(f"'dist.annotate' layout '{self.layout.data}' does not fit "
                                      f"{list(typ.get_shape())}: {err}") from None
            return
        if len(axes) != len(typ.get_shape()):
            raise VerifyException(f"'dist.annotate' spec {list(axes)} needs one entry per dim of "
                                  f"{list(typ.get_shape())}")
        for a in axes:
            if a and a not in MESH_AXES:
                raise VerifyException(f"'dist.annotate' spec names mesh axis '{a}'; the axes are "
                                      f"{', '.join(MESH_AXES)} (or \"\" for none)")
            if a and axes.count(a) > 1:
                raise VerifyException(f"'dist.annotate' spec {list(axes)} names '{a}' twice; a mesh axis splits one dim")


# ----------------------------------------------------------------------------- frontend


def annotate(x, spec: Sequence[str | None] | str):
    """Return `x` laid out as `spec` says: a mesh axis or None per dim, or a layout's text (as
    JAX's sharding constraints do).

        h = hs.annotate(x @ w, ("dp", None, "tp"))   # batch over dp, features over tp
        h = hs.annotate(h, "[0-3]: split(0)=2, dup=2")  # or a whole layout over named devices

    A spec names, per dim, the strategy's mesh axis that splits it (`"dp"` or `"tp"`, each at most
    once) or None. It is read against each device group of the strategy (`apply-annotations`):
    a group's mesh is dp major, tp minor, so `("dp", None, "tp")` under `[0-3]: dp=2 tp=2` is
    `[0-3]: split(0)=2, split(2)=2`; over several groups, a dim on "dp" is split across the
    groups by their shares, as the batch is. A layout text must use the strategy's devices.
    Propagation keeps an annotated layout (a user's layout wins) and lays everything else out
    around it; the gradient of an annotated value is annotated alike.
    """
    x = as_tensor(x, "annotate")
    if isinstance(spec, str):
        try:
            layout = parse_layout(spec)
            layout.check_shape(x.shape)
        except (LayoutSyntaxError, LayoutError) as err:
            raise fail("annotate", f"layout '{spec}' for a tensor of shape {list(x.shape)}: {err}") from None
        return x.tracer.emit(AnnotateOp(x.value, (), layout))
    axes = tuple("" if a is None else a for a in spec)
    if len(axes) != x.ndim:
        raise fail("annotate", f"spec {list(spec)} has {len(axes)} entries for a tensor of shape {list(x.shape)}; "
                               "give one per dim (a mesh axis or None)")
    for a in axes:
        if a and a not in MESH_AXES:
            raise fail("annotate", f"spec {list(spec)} names '{a}'; the mesh axes are {', '.join(MESH_AXES)} "
                                   "(or None for a dim nobody splits)")
        if a and axes.count(a) > 1:
            raise fail("annotate", f"spec {list(spec)} names '{a}' twice; a mesh axis splits one dim")
    return x.tracer.emit(AnnotateOp(x.value, axes))


Dist = Dialect("dist", [ReshardOp, AnnotateOp], [LayoutAttr, StrategyAttr, DevicesAttr, RankGroupsAttr, RankPairsAttr])
