"""PyTorch's decompositions as the importer uses them: Core ATen, keeping whole the ops hspmd has.

`torch.export` gives a graph of whatever ATen ops the model's code called (`chunk`, `baddbmm`,
`numpy_T`, ...). `decompose(ep)` runs it through `ep.run_decompositions(table)`, with
`table` PyTorch's own `torch.export.default_decompositions()` less the ops in `KEPT`: what is left
is Core ATen (a fixed, documented set of about 190 ops, `core_aten_ops()`) plus the ops hspmd
keeps whole because it has them as ops that fusion, sharding rules and the GPU kernels
recognise (a linear layer stays one `graph.matmul`, attention stays `softmax(q k^T) v`, a norm
stays one row kernel, the loss stays `graph.softmax_cross_entropy`).

`NOT_TRANSLATED` says, for each Core ATen op the importer has no translator for, why
(`tests/test_torch_import_coverage.py` lists every Core ATen op with its translator or its reason).
"""

from __future__ import annotations

#: ATen ops hspmd keeps whole (it has them as ops): PyTorch's decompositions leave them alone
KEPT = (
    "linear.default", "matmul.default", "layer_norm.default", "rms_norm.default",
    "softmax.int", "_softmax.default", "log_softmax.int", "_log_softmax.default",
    "gelu.default", "silu.default", "scaled_dot_product_attention.default", "embedding.default",
    "cross_entropy_loss.default", "dropout.default",
)

#: Core ATen ops without a translator, and why (an exported graph holding one stops the import there)
NOT_TRANSLATED: dict[str, str] = {
    **dict.fromkeys((
        "aten._adaptive_avg_pool2d.default", "aten._adaptive_avg_pool3d.default", "aten.avg_pool2d.default",
        "aten.avg_pool3d.default", "aten.max_pool2d_with_indices.default", "aten.max_pool3d_with_indices.default",
        "aten.reflection_pad1d.default", "aten.reflection_pad2d.default", "aten.reflection_pad3d.default",
        "aten.replication_pad2d.default", "aten.replication_pad3d.default", "aten.upsample_bilinear2d.vec",
        "aten.upsample_nearest2d.vec", "aten.grid_sampler_2d.default", "aten.col2im.default",
        "aten._native_batch_norm_legit.default", "aten._native_batch_norm_legit.no_stats",
        "aten._native_batch_norm_legit_no_training.default", "aten.native_group_norm.default",
    ), "an image op (pooling, padding modes, resampling, batch and group norms): hspmd has no image ops"),
    "aten.convolution.default": "a convolution: hspmd has no convolution op",
    **dict.fromkeys(("aten._fft_c2r.default", "aten._fft_r2c.default"),
                    "a Fourier transform: hspmd has no complex tensors"),
    **dict.fromkeys(("aten._cdist_forward.default", "aten._pdist_forward.default", "aten._embedding_bag.default"),
                    "a fused op of a layer that language models do not use (distances, an embedding bag)"),
    **dict.fromkeys((
        "aten._adaptive_avg_pool2d_backward.default", "aten.avg_pool2d_backward.default",
        "aten.convolution_backward.default", "aten.embedding_dense_backward.default",
        "aten.max_pool2d_with_indices_backward.default", "aten.native_group_norm_backward.default",
        "aten.native_layer_norm_backward.default",
    ), "a backward op: hspmd differentiates the forward graph itself (autodiff)"),
    **dict.fromkeys(("aten.nonzero.default", "aten._local_scalar_dense.default"),
                    "its result's shape or value depends on the data (hspmd programs have static shapes "
                    "and no host reads)"),
    **dict.fromkeys(("aten.rand.default", "aten.randn.default", "aten.randperm.default"),
                    "random numbers drawn by the model (hspmd draws its own, for dropout only)"),
    **dict.fromkeys(("aten.empty.memory_format", "aten.empty_strided.default", "aten.as_strided.default",
                     "aten.sym_numel.default", "aten.sym_size.int", "aten.sym_storage_offset.default",
                     "aten.sym_stride.int"),
                    "memory layout or symbolic sizes: concrete at import (evaluated by PyTorch), never "
                    "of a traced value in a static graph"),
    "aten.masked_scatter.default": "its positions depend on the data (a mask of the batch picks how many "
                                   "values it takes)",
    "aten.atan2.out": "an out= variant (export gives the functional op)",
}


def core_aten_ops() -> list[str]:
    """Return the names of PyTorch's Core ATen ops (the overloads tagged `core`), sorted."""
    import torch

    names = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if packet is None or not hasattr(packet, "overloads"):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if torch.Tag.core in op.tags:
                names.append(str(op))
    return sorted(names)


def decomposition_table() -> dict:
    """Return `torch.export.default_decompositions()` without the ops in `KEPT`."""
    import torch

    table = torch.export.default_decompositions()
    for name in KEPT:
        packet, overload = name.split(".")
        table.pop(getattr(getattr(torch.ops.aten, packet), overload), None)
    return table


def decompose(ep):
    """Return the exported program `ep` in Core ATen and the kept ops (`run_decompositions`)."""
    return ep.run_decompositions(decomposition_table())
