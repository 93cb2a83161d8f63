"""`apply-annotations`: turn each `hs.annotate` (`dist.annotate`) into a `dist.reshard` to its layout.

`apply-annotations` runs after `apply-strategy` (whose strategy it reads from the module's
`dist.strategies`; a pipeline's is its stage-shaped one), before `propagate-layouts`, over every function of the module (block functions included). A
`dist.annotate` whose spec names a mesh axis per dim becomes the layout of that spec in each
device group of the strategy (mesh dp major, tp minor: `("dp", "", "tp")` under `dp=2 tp=2` is
`split(0)=2, split(2)=2`; an axis of degree 1 splits nothing); over several groups, a dim on
"dp" is split across the groups by their shares (`hetero=split(d)`, as the batch is), else the
groups hold it alike (`hetero=dup`). A `dist.annotate` with a whole layout keeps it, which must
use exactly the strategy's devices.

The op becomes `dist.reshard` from its (yet unknown) operand layout to that layout: the result
carries a layout before propagation starts, so it wins over what the rules would give, the
operand is laid out by propagation as usual, and `insert-reshard`/`lower-reshard` treat the
reshard like any other. Bad input (a dim that a degree does not divide, a layout over other
devices) raises one PassError naming the value's shape, the layout and the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass
from xdsl.rewriter import Rewriter

from hspmd.dialects import dist
from hspmd.dialects.dist import with_layout
from hspmd.ir.strategy import Strategy, StrategyGroup
from hspmd.ir.layout import DUP, DistributedStates, Group, Layout, LayoutError, split
from hspmd.transforms.pipeline.virtual import annotation_strategy
from hspmd.transforms.util import PassError, module_strategy


def _group_states(group: StrategyGroup, axes: tuple[str, ...]) -> DistributedStates:
    def role(axis: str):
        return split(axes.index(axis)) if axis in axes else DUP

    dp, tp = role("dp"), role("tp")
    rows = group.batch_ranks  # "dp" is the batch's axis: with ep its ranks split the batch too
    if dp == DUP and tp == DUP:  # the layout algebra names each axis once
        return DistributedStates.of((DUP, rows * group.tp))
    return DistributedStates.of((dp, rows), (tp, group.tp))


def spec_layout(strategy: Strategy, axes: tuple[str, ...]) -> Layout:
    """Return the layout that mesh-axis spec `axes` (one entry per dim, "" for none) means under `strategy`.

    >>> from hspmd.ir.strategy import parse_strategy
    >>> str(spec_layout(parse_strategy("[0-3]: dp=2 tp=2"), ("dp", "", "tp")))
    '[0-3]: split(0)=2, split(2)=2'
    >>> str(spec_layout(parse_strategy("[0,1]: dp=2 share=3 | [2]: dp=1"), ("dp", "")))
    '[0,1]: split(0)=2 | [2]: dup=1 ; hetero=split(0), shares=3:1'
    """
    groups = tuple(Group(g.devices, _group_states(g, axes)) for g in strategy.groups)
    if len(groups) == 1:
        return Layout(groups)
    if "dp" in axes:
        return Layout(groups, split(axes.index("dp")), tuple(g.share for g in strategy.groups))
    return Layout(groups, DUP)


@dataclass(frozen=True)
class ApplyAnnotations(ModulePass):
    """Replace every `dist.annotate` by a `dist.reshard` to the layout it asks for under the strategy."""

    name = "apply-annotations"
    #: checks the script's `hs.annotate` layouts against the strategy (user input, as apply-strategy)
    checks_input = True
    #: the id of the module's strategy to read (None: its only one)
    strategy_id: int | None = None

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        annotations = [o for o in op.walk() if isinstance(o, dist.AnnotateOp)]
        if not annotations:
            return
        strategy = annotation_strategy(module_strategy(op, self.strategy_id, self.name))
        for ann in annotations:
            shape = tuple(ann.input.type.get_shape())  # type: ignore[attr-defined]
            if ann.layout is not None:
                layout = ann.layout.data
                if sorted(layout.devices) != sorted(strategy.devices):
                    raise PassError(f"apply-annotations: a value of shape {list(shape)} is annotated "
                                    f"'{layout}', over other devices than the strategy '{strategy}'; an "
                                    "annotation's layout must use exactly the strategy's devices")
                what = f"'{layout}'"
            else:
                layout = spec_layout(strategy, ann.axes())
                what = f"spec {[a or None for a in ann.axes()]} (under '{strategy}': '{layout}')"
            try:
                layout.check_shape(shape)
            except LayoutError as err:
                raise PassError(f"apply-annotations: a value of shape {list(shape)} annotated {what} cannot be "
                                f"laid out so: {err}") from None
            reshard = dist.ReshardOp(ann.input, with_layout(ann.input.type, layout))
            Rewriter.replace_op(ann, reshard)
