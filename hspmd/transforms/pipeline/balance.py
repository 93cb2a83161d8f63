"""Layers of a stage-shaped step and how many of them each pipeline stage takes.

A *layer* is a forward `func.call` of a `*_fwd` block function (a model without block calls:
the parameters' name prefixes, `layers.0.weight` -> `layers.0`). With `layers="3,1"` stage s
takes the next `layers[s]` of them; else contiguous ranges balanced by cost: a layer costs its
forward ops (a matmul 2mnk, any other op one per result element), stage 0 also pays the forward
before the first layer (the embedding) and the last stage what follows the last layer (the head,
the loss); the counts make the largest stage cost smallest (ties: earlier stages take more).
"""

from __future__ import annotations

from functools import lru_cache

from xdsl.dialects import func
from xdsl.dialects.builtin import TensorType
from xdsl.ir import Operation

from hspmd.dialects import graph
from hspmd.transforms.util import PassError

__all__ = ["balanced_counts", "check_pipeline_layers", "layer_costs", "layers_of", "op_cost", "stage_of_layers"]


def layers_of(ops: list[Operation], forward_end: int) -> tuple[list[list[Operation]], dict[str, int], str]:
    """Return (layer -> forward ops that are the layer, parameter name -> layer, what a layer is).

    A forward `graph.scan` of a `*_fwd` function (stacked layers, cut at the stage boundaries by
    `cut-stacked-layers`) is one unit, as a call is. A parameter is the layer's that reads it,
    directly or through casts (mixed precision casts each parameter before its layer)."""
    calls = [op for op in ops[:forward_end] if (isinstance(op, func.CallOp) or isinstance(op, graph.ScanOp)
                                                and not op.is_reverse)
             and op.callee.root_reference.data.endswith("_fwd")]
    params: dict[str, int] = {}
    if calls:
        for k, call in enumerate(calls):
            for v in call.operands:
                while isinstance(v.owner, graph.CastOp):  # a mixed-precision step's cast of a parameter
                    v = v.owner.input
                if isinstance(v.owner, graph.ParameterOp):
                    params.setdefault(v.owner.tensor_name.data, k)
        return [[c] for c in calls], params, "block calls"
    # parameter groups in the order the forward first uses them (not the order they are declared
    # in: a post-norm layer declares its norm before the attention whose output it normalises)
    forward = ops[:forward_end]
    position = {op: i for i, op in enumerate(forward)}
    first_use: dict[str, int] = {}
    for op in forward:
        if not isinstance(op, graph.ParameterOp):
            continue
        uses, seen = [], [op.result]
        while seen:  # through the casts a mixed-precision step puts after each parameter
            v = seen.pop()
            for u in v.uses:
                if isinstance(u.operation, graph.CastOp) and u.operation in position:
                    seen.append(u.operation.result)
                elif u.operation in position:
                    uses.append(position[u.operation])
        if uses:
            first_use[op.tensor_name.data] = min(uses)
    prefixes: list[str] = []
    for name in sorted(first_use, key=lambda n: first_use[n]):
        prefix = name.rsplit(".", 1)[0] if "." in name else name
        if prefix not in prefixes:
            prefixes.append(prefix)
        params[name] = prefixes.index(prefix)
    return [[] for _ in prefixes], params, "parameter groups"



def check_pipeline_layers(ops: list[Operation], groups) -> None:
    """Raise PassError unless the forward of the step `ops` has the layers each strategy group of
    `groups` with pp > 1 cuts into stages: at least pp, and as many as its `layers=` counts add up
    to. Layers are counted as the pipeline passes count them (`layers_of`: block calls, a stack's
    layers, else parameter groups); `apply-strategy` asks before any pass cuts a stage."""
    end = next((i + 1 for i, o in enumerate(ops) if isinstance(o, graph.OutputOp) and o.tensor_name.data == "loss"),
               len(ops))
    layers, _, what = layers_of(ops, end)
    n = sum(g[0].num_iterations if g and isinstance(g[0], graph.ScanOp) else 1 for g in layers)
    for pipe in (g for g in groups if g.pp > 1):
        group = str(pipe)
        if n < pipe.pp:
            raise PassError(f"apply-strategy: group '{group}' cuts the model into {pipe.pp} pipeline stages of at "
                            f"least one layer each, but the model has {n} layer{'s' if n != 1 else ''} ({what}); "
                            f"use pp <= {n}")
        if pipe.layers is not None and sum(pipe.layers) != n:
            raise PassError(f"apply-strategy: group '{group}' gives layers={':'.join(map(str, pipe.layers))}, "
                            f"{sum(pipe.layers)} layers to its stages, but the model has {n} layers ({what}); "
                            f"the counts must add up to {n}")


def stage_of_layers(n: int, pp: int, counts: tuple[int, ...] | None, what: str,
                     costs: tuple[list[int], int, int] | None = None) -> list[int]:
    """Return each of n layers' stage: the given counts per stage, else contiguous ranges balanced
    by cost (`costs`: each layer's, then what the first and the last stage do besides their
    layers; the largest stage cost as small as it can be, ties giving earlier stages more
    layers), else by count."""
    if n < pp:
        raise PassError(f"pipeline-split: pp={pp} stages need at least {pp} layers, but the model has {n} layers "
                        f"({what}); use pp <= {n}")
    if counts is None and costs is not None:
        counts = balanced_counts(*costs, pp)
    if counts is None:
        return [k * pp // n for k in range(n)]
    if sum(counts) != n:
        raise PassError(f"pipeline-split: layers={':'.join(map(str, counts))} gives {sum(counts)} layers to the "
                        f"stages, but the model has {n} layers ({what}); the counts must add up to {n}")
    return [s for s, c in enumerate(counts) for _ in range(c)]


def balanced_counts(layer_costs: list[int], first: int, last: int, pp: int) -> tuple[int, ...]:
    """Return per-stage layer counts (each >= 1, contiguous) whose largest stage cost is smallest:
    stage 0 also pays `first`, the last stage `last`; among the best, earlier stages take more layers."""
    n = len(layer_costs)
    prefix = [0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, a: int, b: int) -> int:  # stage s holding layers a..b-1
        return prefix[b] - prefix[a] + (first if s == 0 else 0) + (last if s == pp - 1 else 0)

    @lru_cache(maxsize=None)
    def best(s: int, a: int) -> tuple[int, tuple[int, ...]]:
        """The best (largest stage cost, counts) for stages s.. holding layers a.."""
        if s == pp - 1:
            return cost(s, a, n), (n - a,)
        options = []
        for b in range(n - (pp - 1 - s), a, -1):  # more layers first: ties keep the larger count
            rest, counts = best(s + 1, b)
            options.append((max(cost(s, a, b), rest), (b - a, *counts)))
        return min(options, key=lambda o: o[0])

    return best(0, 0)[1]


def op_cost(op: Operation, funcs: dict[str, func.FuncOp]) -> int:
    """Return a rough cost of running `op` once: 2mnk for a matmul, one per result element
    otherwise, a callee's ops summed for a call."""
    if isinstance(op, (func.CallOp, graph.ScanOp)):
        callee = funcs.get(op.callee.root_reference.data)
        times = op.num_iterations if isinstance(op, graph.ScanOp) else 1
        return times * sum(op_cost(o, funcs) for o in callee.body.block.ops) if callee is not None else 0
    total = 0
    for r in op.results:
        if isinstance(r.type, TensorType):
            elements = 1
            for d in r.type.get_shape():
                elements *= d
            total += elements
    if isinstance(op, (graph.MatmulOp, graph.ExpertMatmulOp)):
        lhs = op.operands[0].type
        assert isinstance(lhs, TensorType)
        total *= 2 * lhs.get_shape()[-1]
    return total


def layer_costs(ops: list[Operation], forward_end: int, layers: list[list[Operation]],
                 layer_of_param: dict[str, int], funcs: dict[str, func.FuncOp]) -> tuple[list[int], int, int]:
    """Return (each layer's forward cost, the forward cost before the first layer, after the last one).

    A layer's cost is that of its block call, or (layers as parameter groups) of the forward
    ops reading its parameters; the rest of the forward counts for the first stage when it
    comes before the first layer (an embedding), for the last when after the last (a head, the loss).
    """
    costs = [0] * len(layers)
    first = last = 0
    seen_layer = False
    where = {o: k for k, group in enumerate(layers) for o in group}
    for op in ops[:forward_end]:
        k = where.get(op)
        if k is None and not any(layers):  # parameter groups: the op of the layer whose weight it reads
            k = next((layer_of_param[v.owner.tensor_name.data] for v in op.operands
                      if isinstance(v.owner, graph.ParameterOp) and v.owner.tensor_name.data in layer_of_param), None)
        c = op_cost(op, funcs)
        if k is not None:
            costs[k] += c
            seen_layer = True
            last = 0  # what follows a layer counts only when no layer comes after it
        elif not seen_layer:
            first += c
        else:
            last += c
    return costs, first, last

