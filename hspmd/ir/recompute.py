"""The mark that asks `autodiff` to recompute a function's forward in its backward (see
`hspmd/transforms/recompute.py`): a function attribute `hspmd.recompute = "block"|"selective"`,
set by the `recompute` pass and by `hs.checkpoint`."""

from __future__ import annotations

from xdsl.dialects import func
from xdsl.dialects.builtin import StringAttr

__all__ = ["MODES", "RECOMPUTE_ATTR", "mark", "recompute_mode"]

#: the function attribute that asks autodiff to recompute (its value: the mode)
RECOMPUTE_ATTR = "hspmd.recompute"
MODES = ("none", "block", "selective")


def recompute_mode(function: func.FuncOp) -> str:
    """Return the recompute mode `function` is marked with ("none" when it is not)."""
    attr = function.attributes.get(RECOMPUTE_ATTR)
    return attr.data if isinstance(attr, StringAttr) else "none"


def mark(function: func.FuncOp, mode: str) -> None:
    """Mark `function` for recompute in `mode` (a stronger mark already there is kept: block wins)."""
    if mode not in MODES:
        raise ValueError(f"recompute: mode '{mode}' is not one of {', '.join(MODES)}")
    if MODES.index(mode) > MODES.index(recompute_mode(function)):
        function.attributes[RECOMPUTE_ATTR] = StringAttr(mode)
