"""Layout text: parsing, canonical printing, round trips, and where errors point."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd.ir.layout import DUP, PARTIAL, DistributedStates, Group, Layout, LayoutError, split
from hspmd.ir.layout_text import LayoutSyntaxError, format_layout, parse_layout, parse_states
from test_layout import layouts


def test_design_examples():
    a = parse_layout("[0-3]: split(0)=2, dup=2")
    assert a == Layout.spmd((0, 1, 2, 3), DistributedStates.of((split(0), 2), (DUP, 2)))
    b = parse_layout("[0-3]: split(1)=4 | [4,5]: split(1)=2 ; hetero=dup")
    assert b.groups[1] == Group((4, 5), DistributedStates.of((split(1), 2))) and b.hetero == DUP
    c = parse_layout("[0,1]: dup=2 | [2]: dup=1 ; hetero=split(0), shares=3:1")
    assert c.hetero == split(0) and c.shares == (3, 1) and c.groups[1].states == DistributedStates()
    for text in ("[0-3]: split(0)=2, dup=2", "[0-3]: split(1)=4 | [4,5]: split(1)=2 ; hetero=dup",
                 "[0,1]: dup=2 | [2]: dup=1 ; hetero=split(0), shares=3:1"):
        assert str(parse_layout(text)) == text


def test_whitespace_ranges_and_canonical_printing():
    lay = parse_layout(" [ 7 , 0-2,4 ,5 ]:partial = 3 ,split( 1 )=2\n|[9]:dup=1;hetero=partial")
    assert lay.groups[0].devices == (7, 0, 1, 2, 4, 5)
    assert format_layout(lay) == "[7,0-2,4,5]: partial=3, split(1)=2 | [9]: dup=1 ; hetero=partial"
    assert str(parse_layout("[0-1]: dup=2")) == "[0,1]: dup=2"
    assert str(parse_layout("[3,2,1,0]: split(0)=4")) == "[3,2,1,0]: split(0)=4"
    # degree-1 entries vanish, single groups drop the hetero clause, shares default to 1s
    assert str(parse_layout("[0,1]: dup=1, split(0)=2")) == "[0,1]: split(0)=2"
    assert str(parse_layout("[0,1]: dup=2 ; hetero=split(0), shares=5")) == "[0,1]: dup=2"
    assert str(parse_layout("[0]: dup=1 | [1]: dup=1 ; hetero=split(1)")) == \
        "[0]: dup=1 | [1]: dup=1 ; hetero=split(1), shares=1:1"
    assert parse_states("split(0)=2, dup=2") == DistributedStates.of((split(0), 2), (DUP, 2))
    assert parse_states("partial=2").degree(PARTIAL) == 2


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 3).flatmap(lambda nd: layouts(nd)))
def test_text_round_trip(lay):
    text = str(lay)
    back = parse_layout(text)
    assert back == lay and hash(back) == hash(lay) and str(back) == text


def caret_column(err: LayoutSyntaxError) -> int:
    """Return the column the caret line of the message points at (1-based)."""
    return str(err).split("\n")[2].index("^") + 1


@pytest.mark.parametrize("text, line, column, expected", [
    ("[0,1: dup=2", 1, 5, "',', '-' or ']'"),
    ("[0,1]: dup=2 |", 1, 15, "'['"),
    ("", 1, 1, "'['"),
    ("[0,1] dup=2", 1, 7, "':' or '<='"),
    ("[0,1]: dup 2", 1, 12, "'(' or '='"),
    ("[0-3]: split(0)=2, dupe=2", 1, 20, "split(d), dup or partial"),
    ("[0-3]: split=4", 1, 8, "split(d)"),
    ("[0,1]: dup(0)=2", 1, 8, "'dup' without '(...)'"),
    ("[0,1]: dup=2 | [2]: dup=1 ; heter=dup", 1, 29, "'hetero'"),
    ("[0,1]: dup=2 | [2]: dup=1 ; hetero=split(0), shares=3:", 1, 55, "a number"),
    ("[0-3]: split(0)=2,\n  dup=2 $", 2, 9, "',', ';' or '|'"),
    ("[3-0]: dup=4", 1, 2, "a range a-b with a <= b"),
    ("[0,1]: dup=x", 1, 12, "a number"),
])
def test_syntax_errors_point_at_the_column(text, line, column, expected):
    with pytest.raises(LayoutSyntaxError) as info:
        parse_layout(text)
    err = info.value
    assert (err.text, err.line, err.column, err.expected) == (text, line, column, expected)
    msg = str(err).split("\n")
    assert msg[1] == text.split("\n")[line - 1]
    assert caret_column(err) == column
    assert msg[2].endswith(f"^ expected {expected}")
    assert f"line {line}, column {column}" in msg[0]


def test_syntax_error_message_shape():
    with pytest.raises(LayoutSyntaxError) as info:
        parse_layout("[0,1: dup=2")
    assert str(info.value) == ("bad layout text at line 1, column 5: unexpected ':'\n"
                               "[0,1: dup=2\n"
                               "    ^ expected ',', '-' or ']'")


@pytest.mark.parametrize("text, match", [
    ("[0-2]: split(0)=2", r"group '\[0-2\]: split\(0\)=2' lists 3 devices but its degrees multiply to 2"),
    ("[0,1]: dup=2 | [1,2]: dup=2", "puts device 1 in groups 0 and 1"),
    ("[0,0]: dup=2", "more than once"),
    ("[0,1]: dup=2, dup=1", "more than once"),
    ("[0,1]: dup=2 | [2]: dup=1 ; hetero=dup, shares=1:2", "shares need hetero=split"),
    ("[0,1]: dup=2 | [2]: dup=1 ; hetero=split(0), shares=1", "has 2 groups but shares 1"),
    ("[0,1]: dup=2 | [2]: dup=1 ; hetero=split(0), shares=1:0", "one positive share per group"),
    ("[0]: dup=0", "degrees must be >= 1"),
])
def test_semantic_errors_are_layout_errors(text, match):
    with pytest.raises(LayoutError, match=match) as info:
        parse_layout(text)
    assert not isinstance(info.value, LayoutSyntaxError)


def test_parse_layout_rejects_non_text():
    with pytest.raises(TypeError):
        parse_layout(3)  # type: ignore[arg-type]
