"""`fuse-silu`: `x * sigmoid(x)` becomes one `graph.silu(x)` (docs/your-own-pass.md).

Run it before autodiff (`--pass-before autodiff=fuse-silu`): the forward then computes one op
where it computed two, and autodiff differentiates `graph.silu` by its own rule (one
`graph.silu_grad`) instead of the product's and the sigmoid's, keeping only `x` for the backward.
"""

from dataclasses import dataclass

from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import (
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)

from hspmd.dialects import graph


class MulOfSigmoid(RewritePattern):
    """`graph.mul(x, graph.sigmoid(x))` (either order) -> `graph.silu(x)`."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: graph.MulOp, rewriter: PatternRewriter) -> None:
        for x, s in ((op.lhs, op.rhs), (op.rhs, op.lhs)):
            if isinstance(s.owner, graph.SigmoidOp) and s.owner.input == x and x.type == op.result.type:
                sigmoid = s.owner
                rewriter.replace_op(op, graph.SiluOp(x))
                if not sigmoid.result.uses:  # the product was its only reader
                    rewriter.erase_op(sigmoid)
                return


@dataclass(frozen=True)
class FuseSilu(ModulePass):
    """Fuse `x * sigmoid(x)` into `graph.silu(x)`."""

    name = "fuse-silu"

    def apply(self, ctx, op) -> None:
        PatternRewriteWalker(MulOfSigmoid()).rewrite_module(op)
