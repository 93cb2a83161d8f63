"""Every level prints and parses back to a structurally equal module."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st
from test_devices import boxes
from test_layout import layouts
from xdsl.dialects.builtin import TensorType, f32

from conftest import EXAMPLES
from hspmd.dialects import comm, dist, graph
from hspmd.dialects.dist import LayoutAttr, layout_of, with_layout
from hspmd.compiler import compile_script
from hspmd.frontend.script import load_script
from hspmd.frontend.tracing import Tracer
from hspmd.dialects.context import make_context, module_text, parse_module
from hspmd.dialects.levels import devices_attr
from hspmd.ir.devices import RankGroups, RankPairs


def _roundtrip(module):
    text = module_text(module)
    again = parse_module(text)
    assert again.is_structurally_equivalent(module)
    assert module_text(again) == text
    return again


@settings(max_examples=60, deadline=None)
@given(src=layouts(2), dst=layouts(2))
def test_random_layouts_roundtrip_through_ir_text(src, dst):
    t = Tracer()
    x = t.input("x", (8, 8), "float32")
    src_type = with_layout(x.value.type, src)
    reshard = dist.ReshardOp(x.value, with_layout(x.value.type, dst))
    module = t.finish()
    from xdsl.rewriter import Rewriter

    Rewriter.replace_value_with_new_type(x.value, src_type)
    module.body.block.first_op.body.block.insert_op_before(reshard, module.body.block.first_op.body.block.last_op)
    again = _roundtrip(module)
    op = next(o for o in again.walk() if isinstance(o, dist.ReshardOp))
    assert layout_of(op.input) == src and layout_of(op.result) == dst
    assert hash(LayoutAttr(src)) == hash(LayoutAttr(layout_of(op.input)))


@settings(max_examples=30, deadline=None)
@given(groups=st.sampled_from([((0, 1),), ((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0, 1, 2, 3),)]), dim=st.integers(0, 1))
def test_comm_ops_roundtrip(groups, dim):
    from xdsl.dialects import func
    from xdsl.dialects.builtin import ModuleOp
    from xdsl.ir import Block, Region

    n = len(groups[0])
    block = Block()
    x = graph.InputOp("x", TensorType(f32, (8, 8)))
    block.add_op(x)
    local = [8, 8]
    local[dim] //= n
    big = [8, 8]
    big[dim] *= n
    ops = [
        comm.AllReduceOp(x.result, groups, TensorType(f32, (8, 8))),
        comm.AllGatherOp(x.result, groups, TensorType(f32, big), dim=dim),
        comm.ReduceScatterOp(x.result, groups, TensorType(f32, local), dim=dim),
        comm.LocalSplitOp(x.result, groups, TensorType(f32, local), dim=dim),
        comm.LocalZeroOp(x.result, groups, TensorType(f32, (8, 8))),
        comm.BroadcastOp(x.result, groups, TensorType(f32, (8, 8)), root=0),
        comm.SendOp(x.result, [(0, 1)]),
        comm.RecvOp([(0, 1)], TensorType(f32, (8, 8))),
    ]
    for op in ops:
        block.add_op(op)
    block.add_op(func.ReturnOp())
    module = ModuleOp([func.FuncOp("train_step", ((), ()), Region(block))])
    module.attributes["hspmd.devices"] = devices_attr(sorted(r for g in groups for r in g))
    module.verify()
    _roundtrip(module)


def test_compiled_levels_roundtrip():
    compiled = compile_script(load_script(os.path.join(EXAMPLES, "mlp.py")), "[0-3]: dp=4", 4)
    for level in (compiled.logical, compiled.annotated, compiled.physical):
        _roundtrip(level)


def _attr_text(attr) -> str:
    from io import StringIO

    from xdsl.printer import Printer

    out = StringIO()
    Printer(stream=out).print_attribute(attr)
    return out.getvalue()


@settings(max_examples=25, deadline=None)
@given(case=boxes(), data=st.data())
def test_device_set_attributes_roundtrip_and_name_their_bad_text(case, data):
    """`#dist.devices`, `#dist.groups` and `#dist.pairs` print their data's text, parse it back, and
    name what a bad text is meant to be."""
    from xdsl.parser import Parser
    from xdsl.utils.exceptions import ParseError

    devices, ids = case
    size = data.draw(st.sampled_from([k for k in range(1, len(ids) + 1) if len(ids) % k == 0]))
    groups = RankGroups.along(devices, (len(ids) // size, size), data.draw(st.integers(0, 1)))
    attrs = [dist.DevicesAttr(devices), dist.RankGroupsAttr(groups), dist.RankPairsAttr(RankPairs(devices, devices.sorted()))]
    for attr in attrs:
        text = _attr_text(attr)
        assert text == f'#{attr.name}<"{attr.data}">'
        again = Parser(make_context(), text).parse_attribute()
        assert again == attr and hash(again) == hash(attr) and _attr_text(again) == text
        bad = f'#{attr.name}<"{attr.data}-">'
        try:
            Parser(make_context(), bad).parse_attribute()
        except ParseError as err:
            assert f"bad {attr.TEXT_NAME}: " in str(err), str(err)
        else:
            raise AssertionError(f"{bad} parsed")
