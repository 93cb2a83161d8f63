"""Pass pipelines: the standard level-to-level pipelines and a runner for pass specs."""

from __future__ import annotations

from collections.abc import Callable

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass, PassPipeline

from hspmd.transforms import get_all_passes


def logical_pipeline(lr: float) -> str:
    """Return the pass spec that turns a traced forward step into a training step."""
    return f"autodiff,sgd{{lr={lr!r}}}"


def annotate_pipeline(strategy: str) -> str:
    """Return the pass spec that takes logical IR to annotated IR under `strategy`.

    A strategy asking for ZeRO (`zero=1` or `zero=2`) adds `shard-optimizer-state` right after
    `apply-strategy`; a strategy that does not parse is left for apply-strategy to report.
    """
    from hspmd.frontend.strategy import StrategyError, parse_strategy

    quoted = strategy.replace("\\", "\\\\").replace('"', '\\"')
    try:
        zero = any(g.zero for g in parse_strategy(strategy).groups)
    except (StrategyError, TypeError):
        zero = False
    shard = f'shard-optimizer-state{{strategy="{quoted}"}},' if zero else ""
    return (f'apply-strategy{{strategy="{quoted}"}},apply-annotations{{strategy="{quoted}"}},{shard}'
            'propagate-layouts,insert-reshard')


PHYSICAL_PIPELINE = "specialize-groups,lower-reshard"


def build_passes(spec: str, extra: dict[str, Callable[[], type[ModulePass]]] | None = None) -> list[ModulePass]:
    """Return the passes a textual pipeline spec (`a,b{opt=1}`) names."""
    available = {**get_all_passes(), **(extra or {})}
    return list(PassPipeline.parse_spec(available, spec).passes)


def run_passes(module: ModuleOp, spec: str, ctx: Context | None = None) -> ModuleOp:
    """Run the passes of `spec` on `module` in place, verify, and return it."""
    from hspmd.ir.context import make_context

    ctx = ctx or make_context()
    for p in build_passes(spec):
        p.apply(ctx, module)
    module.verify()
    return module
