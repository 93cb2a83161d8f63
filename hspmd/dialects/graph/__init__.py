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
from hspmd.dialects.graph.base import (  # noqa: F401
    tensor_shape,
    tensor_type,
    i64_array,
    stops_gradient,
    check_same_shape,
    check_same_element_type,
    TensorOp,
    BinaryOp,
    UnaryOp,
    check_float,
    check_integer,
    check_dim,
    int_attr,
    float_attr,
    ElementwiseOp,
    UnaryGradOp,
    FLOAT_TYPES,
)
from hspmd.dialects.graph.leaves import (  # noqa: F401
    ParameterOp,
    InputOp,
    ConstantOp,
    IotaOp,
    OutputOp,
    AssignOp,
)
from hspmd.dialects.graph.arithmetic import (  # noqa: F401
    AddOp,
    SubOp,
    MulOp,
    DivOp,
    ScaleOp,
    CastOp,
    PowOp,
    PowGradOp,
)
from hspmd.dialects.graph.activations import (  # noqa: F401
    ReluOp,
    ReluGradOp,
    ExpOp,
    LogOp,
    SqrtOp,
    RsqrtOp,
    TanhOp,
    TanhGradOp,
    SigmoidOp,
    SigmoidGradOp,
    SiluOp,
    SiluGradOp,
    GELU_APPROXIMATIONS,
    GeluOp,
    GeluGradOp,
)
from hspmd.dialects.graph.matmul import (  # noqa: F401
    MatmulBase,
    MatmulOp,
    MatmulRhsGradOp,
)
from hspmd.dialects.graph.shape import (  # noqa: F401
    TransposeOp,
    ReshapeOp,
    BroadcastOp,
    SliceOp,
    SplitOp,
    ConcatOp,
)
from hspmd.dialects.graph.reductions import (  # noqa: F401
    ReduceSumOp,
    ReduceMaxOp,
    ReduceMaxGradOp,
)
from hspmd.dialects.graph.softmax import (  # noqa: F401
    SoftmaxOp,
    SoftmaxGradOp,
    CausalMaskOp,
)
from hspmd.dialects.graph.norms import (  # noqa: F401
    LayerNormOp,
    LayerNormGradOp,
    RmsNormOp,
    RmsNormGradOp,
)
from hspmd.dialects.graph.losses import (  # noqa: F401
    EmbeddingOp,
    EmbeddingGradOp,
    SoftmaxCrossEntropyOp,
    SoftmaxCrossEntropyGradOp,
    OneHotOp,
    LabelMaskOp,
    BinaryCrossEntropyOp,
    BinaryCrossEntropyGradOp,
)
from hspmd.dialects.graph.positions import (  # noqa: F401
    RopeOp,
    RopeGradOp,
    DropoutOp,
)
from hspmd.dialects.graph.moe import (  # noqa: F401
    ExpertMatmulOp,
    ExpertMatmulRhsGradOp,
    MoeRouteOp,
    MoeDispatchOp,
    MoeCombineOp,
    MoeWeightsGradOp,
)
from hspmd.dialects.graph.scan import (  # noqa: F401
    stacked_type,
    ScanOp,
)

Graph = Dialect(
    "graph",
    [
        ParameterOp,
        InputOp,
        ConstantOp,
        IotaOp,
        OutputOp,
        AssignOp,
        AddOp,
        SubOp,
        MulOp,
        DivOp,
        ReluOp,
        ReluGradOp,
        ScaleOp,
        MatmulOp,
        MatmulRhsGradOp,
        TransposeOp,
        ReshapeOp,
        BroadcastOp,
        ReduceSumOp,
        ReduceMaxOp,
        ReduceMaxGradOp,
        ExpOp,
        LogOp,
        SqrtOp,
        RsqrtOp,
        TanhOp,
        TanhGradOp,
        SigmoidOp,
        SigmoidGradOp,
        BinaryCrossEntropyOp,
        BinaryCrossEntropyGradOp,
        SiluOp,
        SiluGradOp,
        GeluOp,
        GeluGradOp,
        PowOp,
        PowGradOp,
        CastOp,
        SoftmaxOp,
        SoftmaxGradOp,
        LayerNormOp,
        LayerNormGradOp,
        RmsNormOp,
        RmsNormGradOp,
        EmbeddingOp,
        EmbeddingGradOp,
        CausalMaskOp,
        SliceOp,
        SplitOp,
        ConcatOp,
        SoftmaxCrossEntropyOp,
        SoftmaxCrossEntropyGradOp,
        OneHotOp,
        LabelMaskOp,
        RopeOp,
        RopeGradOp,
        DropoutOp,
        ExpertMatmulOp,
        ExpertMatmulRhsGradOp,
        MoeRouteOp,
        MoeDispatchOp,
        MoeCombineOp,
        MoeWeightsGradOp,
        ScanOp,
    ],
    [],
)
