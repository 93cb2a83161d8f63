"""hspmd: write a model as for one device; train it on many, alike or not.

    import hspmd as hs
    class MLP(hs.nn.Module): ...
    logits = hs.relu(x @ w); loss = hs.cross_entropy(logits, labels)
"""

from hspmd.frontend import nn
from hspmd.frontend.ops import cross_entropy, matmul, relu
from hspmd.frontend.tracing import Tensor, TraceError

__all__ = ["Tensor", "TraceError", "cross_entropy", "matmul", "nn", "relu"]
__version__ = "0.1.0"
