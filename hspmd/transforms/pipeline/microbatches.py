"""A stage's micro-batched sources: the batch (or a split over the micro-batches) as m stacked slices.

`pipeline.run` gives action i slice i of each `microbatched` operand along its leading dim; these
helpers make those stacked values in a stage's `@train_step` before the run.
"""

from __future__ import annotations

from xdsl.dialects.builtin import TensorType
from xdsl.ir import Operation, SSAValue

from hspmd.dialects import comm, graph
from hspmd.dialects.dist import layout_of, with_layout
from hspmd.ir.layout import DUP, DistributedStates, Group, Layout, split
from hspmd.transforms.pipeline.stage_mesh import StageMesh, stage_type, staged_layout
from hspmd.transforms.util import PassError

__all__ = ["global_type", "stack_input", "stack_split", "stacked", "union_input_microbatches"]


def global_type(o: Operation) -> TensorType:
    """Return an op's `global_type` property (a tensor type)."""
    typ = o.properties["global_type"]
    assert isinstance(typ, TensorType)
    return typ


def stacked(typ: TensorType, m: int) -> TensorType:
    """Return the type of m slices of `typ` stacked along a new leading dim (no layout)."""
    return TensorType(typ.element_type, [m, *typ.get_shape()])


def _stacked_layout(layout: Layout | None) -> Layout:
    """Return a one-micro-batch layout for the stacked tensor: every split dim one further."""
    assert layout is not None
    groups = tuple(Group(g.devices, DistributedStates(tuple((split(a.dim + 1) if a.kind == "split" else a, d)
                                                            for a, d in g.states.axes))) for g in layout.groups)
    hetero = split(layout.hetero.dim + 1) if layout.hetero.kind == "split" else layout.hetero
    return Layout(groups, hetero, layout.shares)


def stack_input(o: graph.InputOp, mesh: StageMesh, s: int, pre: list[Operation]) -> SSAValue:
    """Return `NAME@mb`, the batch input of stage s as [m, rows / m, ...] (the worker makes it)."""
    m = mesh.microbatches
    typ = stage_type(global_type(o), mesh, s, f"'{o.tensor_name.data}'")[0]
    result = o.result.type
    assert isinstance(result, TensorType)
    read = graph.InputOp(f"{o.tensor_name.data}@mb", stacked(result, m))
    read.properties["global_type"] = with_layout(stacked(typ, m), _stacked_layout(layout_of(typ)))
    pre.append(read)
    return read.result


def stack_split(o: comm.LocalSplitOp, x: SSAValue, real: list[list[int]], m: int, pre: list[Operation]) -> SSAValue:
    """Return the slices of a local split over the micro-batches (dim 0) of `x`, then over the
    stage's positions (`real`, when a group has more than one device)."""
    dim = o.dim.value.data
    if dim != 0:
        raise PassError(f"pipeline-split: '{o.name}' splits a value over the micro-batches along dim "
                        f"{dim}; a pipeline stage takes micro-batches along dim 0 only")
    typ = x.type
    assert isinstance(typ, TensorType)
    shape = list(typ.get_shape())
    whole = graph.ReshapeOp(x, TensorType(typ.element_type, [m, shape[0] // m, *shape[1:]]))
    pre.append(whole)
    value = whole.result
    if len(real[0]) > 1:
        result = o.results[0].type
        assert isinstance(result, TensorType)
        split_op = comm.LocalSplitOp(value, real, stacked(result, m), dim=1)
        pre.append(split_op)
        value = split_op.result
    return value


def union_input_microbatches(o: graph.InputOp, mesh: StageMesh, s: int, pre: list[Operation]) -> SSAValue:
    """Return the micro-batches of a batch input that the other groups share, stacked: the stage
    reads its group's rows whole, views them as [m, rows / m, ...], then splits dim 1 over its dp
    ranks (the other groups' rows are in the same input)."""
    m = mesh.microbatches
    typ = global_type(o)
    layout = staged_layout(typ)
    g = next(g for g in layout.groups if g.devices == mesh.virtual)
    (axis, degree), *rest = g.states.axes
    if axis != split(0) or any(a.kind != "dup" for a, _ in rest):
        raise PassError(f"pipeline-split: input '{o.tensor_name.data}' is laid out as '{layout}'; beside "
                        "other device groups a pipelined group's micro-batches need it split along dim 0 only")
    dp = degree // m
    tp = mesh.size // dp
    groups = [Group(mesh.stages[s], DistributedStates.of((DUP, mesh.size))) if h is g else h
              for h in layout.groups]
    whole = Layout(tuple(groups), layout.hetero, layout.shares)
    shape = whole.local_shape(mesh.stages[s][0], typ.get_shape())
    result = o.result.type
    assert isinstance(result, TensorType)
    element = result.element_type
    read = graph.InputOp(o.tensor_name.data, TensorType(element, shape))
    read.properties["global_type"] = with_layout(typ, whole)
    rows = graph.ReshapeOp(read.result, TensorType(element, [m, shape[0] // m, *shape[1:]]))
    pre.extend([read, rows])
    if dp == 1:
        return rows.result
    real = [[mesh.stages[s][d * tp + t] for d in range(dp)] for t in range(tp)]
    split_op = comm.LocalSplitOp(rows.result, real, stacked(result, m), dim=1)
    pre.append(split_op)
    return split_op.result
