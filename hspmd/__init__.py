"""hspmd: write a model as for one device; train it on many, alike or not.

    import hspmd as hs
    class MLP(hs.nn.Module): ...
    logits = hs.relu(x @ w); loss = hs.cross_entropy(logits, labels)
"""

import os as _os

# OpenBLAS's threads busy-wait 2^28 cycles (about 0.1 s) after each product by default, taking a
# core from whatever runs next: the fused kernels' helpers, and the two one-thread products of a
# pair (`runtime/cpu/paired_matmul.py`), which then ran at half speed. 2^8 cycles: they sleep at
# once. Read when NumPy's OpenBLAS loads, so only if NumPy is not imported yet; a value set in
# the environment is kept.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "8")

from hspmd import data
from hspmd.frontend import nn
from hspmd.frontend import optim
from hspmd.frontend.ops import (
    annotate,
    causal_mask,
    cast,
    concat,
    cross_entropy,
    divide,
    dropout,
    embedding,
    erf,
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
from hspmd.frontend.functions import checkpoint
from hspmd.frontend.tracing import Tensor, TraceError
from hspmd.frontend.torch_import import TorchImportError, from_torch

__all__ = [
    "Tensor",
    "data",
    "checkpoint",
    "TorchImportError",
    "TraceError",
    "from_torch",
    "annotate",
    "cast",
    "causal_mask",
    "concat",
    "cross_entropy",
    "divide",
    "dropout",
    "embedding",
    "erf",
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
