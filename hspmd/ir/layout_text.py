"""Layout text for people (lark grammar, DESIGN.md section 3): parse and print.

    [0-3]: split(0)=2, dup=2                               one group, order as written
    [0-3]: split(1)=4 | [4,5]: split(1)=2 ; hetero=dup      two replicas, TP4 and TP2
    [0,1]: dup=2 | [2]: dup=1 ; hetero=split(0), shares=3:1 batch split 3:1 over groups

Device lists take numbers, runs and strided runs (`[0,1,4-5]`, `[3-65531:8]`), or XLA's iota
form for a mesh read in another order (`[8]<=[2,4]T(1,0)`: devices 0,4,1,5,2,6,3,7; `*step` and
`+start` scale and move it); whitespace is free. A group's devices are a `DeviceRange`
(`hspmd.ir.devices`), so the text of a group of 65,536 devices is as short as that of 4.
Printing is canonical (`str(layout)`): a range prints as `a-b`, `a-b:s` or the iota form, an
irregular list with its runs of three or more consecutive devices as `a-b`; the
hetero clause appears only with several groups, shares only with hetero split. Syntax errors
raise `LayoutSyntaxError` (line, column, caret, what was expected); well-formed text that
describes an impossible layout raises `LayoutError`.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from hspmd.ir.devices import DeviceRange, DeviceSetError, concat, iota_members
from hspmd.ir.layout import DUP, PARTIAL, Axis, DistributedStates, Group, Layout, LayoutError, split

__all__ = ["LayoutSyntaxError", "LayoutError", "parse_layout", "parse_states", "format_layout",
           # shared with the strategy grammar
           "DEVLIST_GRAMMAR", "caret_message", "terminal_words", "syntax_error", "devices_of", "parse_device_set"]

DEVLIST_GRAMMAR = r"""
devset: "[" devlist "]" iota?
devlist: devitem ("," devitem)*
devitem: INT             -> dev
       | INT "-" INT     -> devrange
       | INT "-" INT ":" INT -> devstride
iota: "<=" "[" intlist "]" perm? scale? offset?
    | "<=" "[" intlist "]" "@" "[" intlist "]" offset? -> box
perm: "T" "(" intlist ")"
scale: "*" INT
offset: "+" INT
intlist: INT ("," INT)*
%import common.INT
%import common.WS
%ignore WS
"""

_LAYOUT_GRAMMAR = r"""
layout: group ("|" group)* hetero?
states: axisdeg ("," axisdeg)*
group: devset ":" states
axisdeg: axis "=" INT
axis: NAME ("(" INT ")")?
hetero: ";" "hetero" "=" axis ("," "shares" "=" shares)?
shares: INT (":" INT)*
NAME: /[A-Za-z_][A-Za-z_0-9]*/
""" + DEVLIST_GRAMMAR

_PARSER = Lark(_LAYOUT_GRAMMAR, start=["layout", "states", "devset"], parser="lalr", maybe_placeholders=False)


def caret_message(message: str, text: str, line: int, column: int, expected: str | None) -> str:
    """Return `message`, the offending line of `text`, and a caret under `column` with what was expected."""
    lines = text.split("\n")
    src = lines[line - 1] if 0 < line <= len(lines) else ""
    caret = " " * (column - 1) + "^" + (f" expected {expected}" if expected else "")
    return f"{message}\n{src}\n{caret}"


class LayoutSyntaxError(ValueError):
    """Bad layout syntax; `text`, `line`, `column` (1-based) and `expected` (human words) say where and what."""

    def __init__(self, message: str, text: str, line: int, column: int, expected: str | None = None):
        self.message, self.text, self.line, self.column, self.expected = message, text, line, column, expected
        super().__init__(caret_message(message, text, line, column, expected))


def _words(names: Iterable[str]) -> str:
    """Return 'a, b or c' for a few human words."""
    items = sorted(set(names))
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def terminal_words(parser: Lark, special: dict[str, str]) -> Callable[[Iterable[str]], str]:
    """Return a function naming a set of lark terminals in human words."""
    patterns = {t.name: t.pattern for t in parser.terminals}

    def name(term: str) -> str:
        if term in special:
            return special[term]
        pat = patterns.get(term)
        if pat is not None and pat.type == "str":
            return f"'{pat.value}'"
        return term.lower()

    return lambda terms: _words(name(t) for t in terms)


_LAYOUT_WORDS = terminal_words(_PARSER, {"INT": "a number", "NAME": "an axis (split(d), dup or partial)",
                                          "$END": "end of text"})


def _end_position(text: str) -> tuple[int, int]:
    """Return (line, column) just after the last non-blank character of `text`."""
    body = text.rstrip()
    line = body.count("\n") + 1
    return line, len(body) - (body.rfind("\n") + 1) + 1


def syntax_error(err: UnexpectedInput, text: str, what: str, words: Callable[[Iterable[str]], str],
                 cls: type[ValueError]) -> ValueError:
    """Return a `cls` error (caret style) for a lark parse error in `text`."""
    if isinstance(err, UnexpectedToken):
        if err.token.type == "$END":
            line, column = _end_position(text)
            found = "end of text"
        else:
            line, column = err.line, err.column
            found = f"'{err.token.value}'"
        expected = err.accepts or err.expected
    elif isinstance(err, UnexpectedCharacters):
        line, column = err.line, err.column
        found = f"'{err.char}'"
        expected = err.allowed or set()
    else:  # pragma: no cover - other lark errors (UnexpectedEOF) do not occur with LALR
        line, column = _end_position(text)
        found = "end of text"
        expected = getattr(err, "expected", set())
    exp = words(expected) if expected else None
    return cls(f"bad {what} at line {line}, column {column}: unexpected {found}", text, line, column, exp)


def _err(text: str, tok: Token, message: str, expected: str | None = None) -> LayoutSyntaxError:
    return LayoutSyntaxError(f"bad layout text at line {tok.line}, column {tok.column}: {message}",
                             text, tok.line, tok.column, expected)


def devices_of(tree: Tree, text: str, error: Callable[[str, Token, str, str | None], ValueError]) -> DeviceRange:
    """Return the devices of a `devset` tree (runs kept as ranges, order kept); a set that repeats
    an id comes back as its tuple of ids, for its group to refuse."""
    devlist, *iota = tree.children
    if iota:
        return _iota_devices(devlist, iota[0], text, error)
    parts: list[DeviceRange] = []
    for item in devlist.children:
        if item.data == "dev":
            parts.append(DeviceRange(int(item.children[0])))
            continue
        lo, hi, *step = item.children
        s = int(step[0]) if step else 1
        if int(hi) < int(lo):
            raise error(text, lo, f"range {lo}-{hi} runs backwards", "a range a-b with a <= b")
        if s < 1 or (int(hi) - int(lo)) % s:
            raise error(text, step[0], f"step {s} of {lo}-{hi} does not reach {hi} from {lo}",
                        "a step >= 1 that divides b - a")
        parts.append(DeviceRange.span(int(lo), (int(hi) - int(lo)) // s + 1, s))
    try:
        return concat(parts)
    except DeviceSetError:  # repeated ids: the group (or strategy) that takes them says why, in its words
        return tuple(d for p in parts for d in p)  # type: ignore[return-value]


def _iota_devices(devlist: Tree, iota: Tree, text: str, error) -> DeviceRange:
    """Return the devices of `[n]<=[r...]T(p)*s+o` or of the box `[n]<=[shape]@[strides]+o`."""
    first = devlist.children[0].children[0]
    if len(devlist.children) != 1 or devlist.children[0].data != "dev":
        raise error(text, first, "an iota expression takes one dim, its number of devices ([n]<=[...])", "[n]")
    if iota.data == "box":
        shape, strides = ([int(t) for t in c.children] for c in iota.children[:2])
        start = int(iota.children[2].children[0]) if len(iota.children) > 2 else 0
        if len(shape) != len(strides) or math.prod(shape) != int(first) or 0 in shape:
            raise error(text, first, f"a box of {int(first)} devices needs a shape that holds them and one stride "
                        "per dim", "[n]<=[shape]@[strides]")
        try:
            return DeviceRange.box(start, shape, strides)
        except DeviceSetError as err:
            raise error(text, first, str(err), None) from None
    parts = {c.data: [int(t) for t in (c.children[0].children if c.data == "perm" else c.children)]
             for c in iota.children[1:]}
    reshape = [int(t) for t in iota.children[0].children]
    try:
        _, members = iota_members([int(first)], reshape, parts.get("perm"), (parts.get("scale") or [1])[0],
                                  (parts.get("offset") or [0])[0])
    except DeviceSetError as err:
        raise error(text, first, str(err), None) from None
    return members


def _axis(tree: Tree, text: str) -> Axis:
    name, *dim = tree.children
    if name == "split":
        if not dim:
            raise _err(text, name, "split needs a tensor dim", "split(d)")
        return split(int(dim[0]))
    if name in ("dup", "partial"):
        if dim:
            raise _err(text, name, f"{name} takes no dim", f"'{name}' without '(...)'")
        return DUP if name == "dup" else PARTIAL
    raise _err(text, name, f"unknown axis '{name}'", "split(d), dup or partial")


def _states(tree: Tree, text: str) -> DistributedStates:
    return DistributedStates(tuple((_axis(ad.children[0], text), int(ad.children[1])) for ad in tree.children))


def _parse(text: str, start: str) -> Tree:
    if not isinstance(text, str):
        raise TypeError(f"layout text must be a str, got {type(text).__name__}")
    try:
        return _PARSER.parse(text, start=start)
    except UnexpectedInput as err:
        raise syntax_error(err, text, "layout text", _LAYOUT_WORDS, LayoutSyntaxError) from None


def parse_layout(text: str) -> Layout:
    """Return the Layout that `text` describes.

    >>> str(parse_layout("[0,1]:dup=2|[2]:dup=1;hetero=split(0),shares=3:1"))
    '[0,1]: dup=2 | [2]: dup=1 ; hetero=split(0), shares=3:1'
    """
    tree = _parse(text, "layout")
    groups, hetero, shares = [], DUP, None
    for child in tree.children:
        if child.data == "group":
            devset, states = child.children
            groups.append(Group(devices_of(devset, text, _err), _states(states, text)))
        else:
            hetero = _axis(child.children[0], text)
            if len(child.children) > 1:
                shares = tuple(int(t) for t in child.children[1].children)
    return Layout(tuple(groups), hetero, shares)


def parse_states(text: str) -> DistributedStates:
    """Return the DistributedStates that `text` (e.g. `split(0)=2, dup=2`) describes."""
    return _states(_parse(text, "states"), text)


def parse_device_set(text: str) -> DeviceRange:
    """Return the devices that `text` names, in brackets as a group writes them: `[0-3]`, `[0-7:2]`,
    `[8]<=[2,4]T(1,0)`."""
    return devices_of(_parse(text, "devset"), text, _err)


def format_layout(layout: Layout) -> str:
    """Return the canonical text of `layout` (the same as `str(layout)`)."""
    return str(layout)
