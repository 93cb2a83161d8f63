"""`hs.annotate`: ask for a layout on any value of the model, as JAX's sharding constraints do.

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

from __future__ import annotations

from collections.abc import Sequence

from hspmd.dialects.dist import MESH_AXES, AnnotateOp
from hspmd.frontend.tracing import Tensor, fail
from hspmd.ir.layout import LayoutError
from hspmd.ir.layout_text import LayoutSyntaxError, parse_layout

__all__ = ["annotate"]


def annotate(x: Tensor, spec: Sequence[str | None] | str) -> Tensor:
    """Return `x` laid out as `spec` says: a mesh axis or None per dim, or a layout's text."""
    if not isinstance(x, Tensor):
        if hasattr(x, "traced"):  # a Parameter bound to the running trace
            x = x.traced("annotate")
        else:
            raise fail("annotate", f"expected a tensor, got {type(x).__name__}")
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
