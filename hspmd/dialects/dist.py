"""The `dist` dialect: HSPMD layouts as IR attributes, and resharding between layouts.

A layout rides in the encoding of a tensor type, so at the annotated level every value
carries one: `tensor<64x32xf32, #dist.layout<"[0,1]: split(0)=2">>`. The text inside the
quotes is the layout grammar of `hspmd.ir.layout_text`, the same text users write.
"""

from __future__ import annotations

from xdsl.dialects.builtin import NoneAttr, TensorType
from xdsl.ir import Attribute, Data, Dialect, SSAValue
from xdsl.irdl import (
    IRDLOperation,
    ParsePropInAttrDict,
    irdl_attr_definition,
    irdl_op_definition,
    operand_def,
    opt_prop_def,
    result_def,
)
from xdsl.parser import AttrParser
from xdsl.printer import Printer
from xdsl.utils.exceptions import VerifyException

from hspmd.ir.layout import Layout, LayoutError

__all__ = ["Dist", "LayoutAttr", "ReshardOp", "layout_of", "with_layout", "without_layout"]


@irdl_attr_definition
class LayoutAttr(Data[Layout]):
    """`#dist.layout<"TEXT">`: one HSPMD layout (groups, per-group states, hetero axis, shares)."""

    name = "dist.layout"

    @classmethod
    def parse_parameter(cls, parser: AttrParser) -> Layout:
        from hspmd.ir.layout_text import LayoutSyntaxError, parse_layout

        with parser.in_angle_brackets():
            pos = parser.pos
            text = parser.parse_str_literal("layout text")
            try:
                return parse_layout(text)
            except (LayoutSyntaxError, LayoutError) as err:
                parser.raise_error(f"bad layout: {err}", pos, parser.pos)

    def print_parameter(self, printer: Printer) -> None:
        with printer.in_angle_brackets():
            printer.print_string_literal(str(self.data))


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
    input = operand_def(TensorType)
    result = result_def(TensorType)
    src = opt_prop_def(LayoutAttr)
    dst = opt_prop_def(LayoutAttr)
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
            if layout_of(src) is None or layout_of(dst) is None:
                raise VerifyException("'dist.reshard' needs a layout on its operand and its result")
            if src.get_shape() != dst.get_shape():
                raise VerifyException("'dist.reshard' keeps the global shape; only the layout changes")


Dist = Dialect("dist", [ReshardOp], [LayoutAttr])
