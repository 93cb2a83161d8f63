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
        "aten.adaptive_avg_pool1d.default", "aten.avg_pool1d.default",
        "aten._adaptive_avg_pool2d.default", "aten._adaptive_avg_pool3d.default", "aten.avg_pool2d.default",
        "aten.avg_pool3d.default", "aten.max_pool2d_with_indices.default", "aten.max_pool3d_with_indices.default",
        "aten.reflection_pad1d.default", "aten.reflection_pad2d.default", "aten.reflection_pad3d.default",
        "aten.replication_pad2d.default", "aten.replication_pad3d.default", "aten.upsample_bilinear2d.vec",
        "aten.upsample_nearest2d.vec", "aten.grid_sampler_2d.default", "aten.col2im.default",
        "aten._native_batch_norm_legit.default", "aten._native_batch_norm_legit.no_stats",
        "aten._native_batch_norm_legit_no_training.default", "aten.native_group_norm.default",
    ), "an image op (pooling, padding modes, resampling, batch and group norms): hspmd has no image ops"),
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
                     "aten.sym_stride.int", "aten.sym_is_contiguous.default", "aten.resize_.default"),
                    "memory layout or symbolic sizes: concrete at import (evaluated by PyTorch), never "
                    "of a traced value in a static graph"),
    **dict.fromkeys(("aten.arange.start_step", "aten.full.default", "aten.scalar_tensor.default"),
                    "made from numbers alone: PyTorch evaluates it when the model is imported"),
    **dict.fromkeys(("aten.prod.default", "aten.prod.dim_int"),
                    "a product reduction: hspmd reduces by sums and maxima"),
    "aten.masked_scatter.default": "its positions depend on the data (a mask of the batch picks how many "
                                   "values it takes)",
    "aten.atan2.out": "an out= variant (export gives the functional op)",
}


def core_aten_ops() -> list[str]:
    """Return the names of PyTorch's Core ATen ops (the overloads tagged `core`), sorted: every ATen
    op of the registry (`dir(torch.ops.aten)` lists only those already looked up, which depends on
    what ran before in the process)."""
    import torch

    names = []
    every = {s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("aten::")}
    for name in sorted(every | set(dir(torch.ops.aten))):
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
    """Return the exported program `ep` in Core ATen and the kept ops (`run_decompositions`), its
    higher-order ops inlined first and where it stops gradients marked (`keep_gradient_stops`)."""
    keep_gradient_stops(ep)
    return ep.run_decompositions(decomposition_table())


# ----------------------------------------------------------------------------- where gradients stop

#: the operator that marks a value whose gradient PyTorch does not compute (`torch.ops.hspmd.stop_gradient`)
STOP_GRADIENT = "hspmd.stop_gradient.default"


class HigherOrderOpError(Exception):
    """The export holds a higher-order op the importer does not inline (the message names it)."""


def _define_stop_gradient() -> None:
    """Define `torch.ops.hspmd.stop_gradient` once: the values, no gradient."""
    import torch

    if hasattr(torch.ops, "hspmd") and hasattr(torch.ops.hspmd, "stop_gradient"):
        return

    @torch.library.custom_op("hspmd::stop_gradient", mutates_args=(), schema="(Tensor x) -> Tensor")
    def stop_gradient(x):
        return x.clone()

    @stop_gradient.register_fake
    def _(x):
        return torch.empty_like(x)

    torch.library.register_autograd("hspmd::stop_gradient", lambda ctx, g: None)


def keep_gradient_stops(ep) -> None:
    """Rewrite `ep`'s graph in place so that PyTorch's decompositions keep where it stops
    gradients: `detach` becomes `hspmd.stop_gradient` (the decompositions would make it an
    alias), a region under `torch.no_grad()` (`wrap_with_set_grad_enabled(False, ...)`) is
    inlined with its results marked so, one under `torch.enable_grad()` or `autocast` is inlined
    as it is, and a `cond` whose predicate is a constant is its branch. Any other higher-order op
    raises `HigherOrderOpError` naming it."""
    import torch

    gm = ep.graph_module
    graph = gm.graph
    stop = None
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        name = str(node.target)
        if node.target is torch.ops.aten.detach.default:
            stop = stop or _stop_op()
            node.target = stop
            continue
        if not name.startswith("higher_order.") and not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        hop = getattr(node.target, "__name__", name)
        if hop == "wrap_with_set_grad_enabled":
            enabled, sub, *args = node.args
            _inline(gm, node, getattr(gm, sub.target), args, stop=None if enabled else (stop := stop or _stop_op()))
        elif hop == "wrap_with_autocast":
            *_, sub = node.args[:5]
            _inline(gm, node, getattr(gm, sub.target), node.args[5:], stop=None)
        elif hop == "cond" and isinstance(node.args[0], bool):
            branch = node.args[1] if node.args[0] else node.args[2]
            _inline(gm, node, getattr(gm, branch.target), list(node.args[3]), stop=None)
        else:
            raise HigherOrderOpError(f"the exported graph holds the higher-order op {hop} "
                                     f"(a submodule {'with a condition computed from the batch ' if hop == 'cond' else ''}"
                                     "that hspmd cannot inline)")
    graph.eliminate_dead_code()
    gm.recompile()


def _stop_op():
    import torch

    _define_stop_gradient()
    return torch.ops.hspmd.stop_gradient.default


def _inline(gm, node, sub, args, stop) -> None:
    """Put the nodes of submodule `sub` (called with `args`) in place of `node`; its results
    (through `stop`, where given, for the float ones it computes) replace `node`'s (a tuple: its
    getitems). A result that is one of `args` passed through is the caller's tensor itself: under
    `torch.no_grad()`, `x.to(x.dtype)` returns `x`, and the export hands that result on to the
    code after the region, which uses `x` with its gradient (DeepSeek-V3.2-style indexers do)."""
    import torch

    graph = gm.graph
    env = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for p, a in zip(placeholders, args):
        env[p] = a
    results = None
    with graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                results = torch.fx.node.map_arg(n.args[0], lambda x: env[x])
                continue
            if n.op == "get_attr":  # a constant of the submodule: move it to the parent
                value = getattr(sub, n.target)
                target = f"_inlined_{id(sub)}_{n.target}".replace(".", "_")
                setattr(gm, target, value)
                env[n] = graph.get_attr(target)
                env[n].meta = dict(n.meta)
                continue
            env[n] = graph.node_copy(n, lambda x: env[x])
        outs = list(results) if isinstance(results, (list, tuple)) else [results]
        if stop is not None:  # a result that is an argument passed through (`x.to(x.dtype)` is `x`) keeps its gradient
            passed = {id(env[p]) for p in placeholders}
            outs = [graph.call_function(stop, (o,)) if _is_float(o) and id(_same_tensor(o)) not in passed else o
                    for o in outs]
            for o, src in zip(outs, results if isinstance(results, (list, tuple)) else [results]):
                if o is not src:
                    o.meta = dict(src.meta)
    for user in list(node.users):
        if user.op == "call_function" and user.target is __import__("operator").getitem:
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
    if node.users:
        node.replace_all_uses_with(outs[0] if len(outs) == 1 else outs)
    graph.erase_node(node)


#: conversions that return their input itself where it has the dtype already (`Tensor.to`)
_CONVERSIONS = ("aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten.to.other")


def _same_tensor(node):
    """Return the node whose tensor `node`'s is: through conversions to the dtype it has."""
    while (getattr(node, "op", None) == "call_function" and str(node.target) in _CONVERSIONS and node.args
           and getattr(node.meta.get("val"), "dtype", None) == getattr(node.args[0].meta.get("val"), "dtype", 0)):
        node = node.args[0]
    return node


def _is_float(node) -> bool:
    val = getattr(node, "meta", {}).get("val")
    return getattr(val, "is_floating_point", lambda: False)()
