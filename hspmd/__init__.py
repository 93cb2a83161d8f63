"""hspmd: write a model as for one device; train it on many, alike or not.

    import hspmd as hs
    class MLP(hs.nn.Module): ...
    logits = hs.relu(x @ w); loss = hs.cross_entropy(logits, labels)
"""

from hspmd.frontend import nn
from hspmd.frontend import optim
from hspmd.frontend.annotate import annotate
from hspmd.frontend.ops import (
    causal_mask,
    cast,
    concat,
    cross_entropy,
    divide,
    dropout,
    embedding,
    exp,
    expert_matmul,
    gelu,
    layer_norm,
    log,
    matmul,
    max,
    moe_combine,
    moe_dispatch,
    moe_route,
    power,
    relu,
    rms_norm,
    rope,
    rsqrt,
    silu,
    slice,
    softmax,
    split,
    sqrt,
    tanh,
    sigmoid,
    binary_cross_entropy_with_logits,
)
from hspmd.frontend.tracing import Tensor, TraceError

__all__ = [
    "Tensor",
    "TraceError",
    "annotate",
    "cast",
    "causal_mask",
    "concat",
    "cross_entropy",
    "divide",
    "dropout",
    "embedding",
    "exp",
    "expert_matmul",
    "gelu",
    "layer_norm",
    "log",
    "matmul",
    "max",
    "moe_combine",
    "moe_dispatch",
    "moe_route",
    "nn",
    "optim",
    "power",
    "relu",
    "rms_norm",
    "rope",
    "rsqrt",
    "silu",
    "slice",
    "softmax",
    "split",
    "sqrt",
    "tanh",
    "sigmoid",
    "binary_cross_entropy_with_logits",
]
__version__ = "0.1.0"
