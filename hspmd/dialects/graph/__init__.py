"""The `graph` dialect: logical tensor operations of a training step, one module per op family.

Every op works on builtin `tensor<...>` values. At the logical level the shapes are global;
at the annotated level the same ops carry a `#dist.layout` in each tensor type's encoding;
at the physical level the shapes are the local shapes of one rank. Shape rules hold at every
level, which is why no op stores a shape of its own: the result type is the shape.

Each family's module holds, beside every op's IRDL definition, what the rest of hspmd asks of
the op: its sharding rule, its gradient, its NumPy kernel and kernel facts, its CUDA C and its
frontend function (`hspmd/dialects/interfaces.py` lists the interfaces). This package
re-exports every op, so `graph.MatmulOp` names an op wherever it is defined.
"""

from xdsl.ir import Dialect
from xdsl.irdl import IRDLOperation

from hspmd.dialects.graph import (
    leaves,
    arithmetic,
    activations,
    matmul,
    shape,
    reductions,
    softmax,
    attention,
    norms,
    embedding,
    losses,
    positions,
    moe,
    elementary,
    indexing,
    scan,
)
from hspmd.dialects.graph.base import *  # noqa: F403
from hspmd.dialects.graph.leaves import *  # noqa: F403
from hspmd.dialects.graph.arithmetic import *  # noqa: F403
from hspmd.dialects.graph.activations import *  # noqa: F403
from hspmd.dialects.graph.matmul import *  # noqa: F403
from hspmd.dialects.graph.shape import *  # noqa: F403
from hspmd.dialects.graph.reductions import *  # noqa: F403
from hspmd.dialects.graph.softmax import *  # noqa: F403
from hspmd.dialects.graph.attention import *  # noqa: F403
from hspmd.dialects.graph.norms import *  # noqa: F403
from hspmd.dialects.graph.embedding import *  # noqa: F403
from hspmd.dialects.graph.losses import *  # noqa: F403
from hspmd.dialects.graph.positions import *  # noqa: F403
from hspmd.dialects.graph.moe import *  # noqa: F403
from hspmd.dialects.graph.elementary import *  # noqa: F403
from hspmd.dialects.graph.indexing import *  # noqa: F403
from hspmd.dialects.graph.scan import *  # noqa: F403

#: the op families, each a module of ops with everything hspmd knows of them
FAMILIES = (leaves, arithmetic, activations, matmul, shape, reductions, softmax, attention, norms, embedding, losses, positions, moe, elementary, indexing, scan)


def _ops_of(module) -> list[type[IRDLOperation]]:
    """Return the ops a family module exports (its `__all__`), in their order there."""
    values = (getattr(module, name) for name in module.__all__)
    return [v for v in values if isinstance(v, type) and issubclass(v, IRDLOperation) and hasattr(v, "name")]


Graph = Dialect("graph", [op for module in FAMILIES for op in _ops_of(module)], [])
