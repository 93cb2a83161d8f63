"""`cut-stacked-layers`: cut each stack of layers at the pipeline's stage boundaries.

A program whose layers are stacked (`stack-layers`: one `graph.scan` over parameters such as
`blocks.[0:8].attn.proj.weight`) holds all layers in one op; a pipeline puts contiguous layer
ranges on its stages. This pass, run on the stage-shaped step before `assign-pipeline-stages`,
decides each layer's stage as that pass would for calls (`balance.py`: the strategy's `layers`
counts, else ranges balanced by forward cost) and cuts every stacked value at the boundaries:

    %w = graph.parameter "blocks.[0:8].w" : tensor<8x...>          ->  "blocks.[0:5].w" : tensor<5x...>,
                                                                        "blocks.[5:8].w" : tensor<3x...>
    %x = graph.scan @Block_0_fwd(%w, %x0) {length = 8}              ->  a scan of 5 layers, then one of 3
    %g = graph.scan @Block_0_bwd(...) {length = 8, reverse}         ->  the 3 layers' backward, then the 5's
    optim.adam / mul_scalar / where_finite / comm.all_reduce / graph.cast of a stack -> one per piece
    a collective along another dim than 0 (comm.local_split, ...)   ->  one per piece
    optim.sum_squares of a stack                                    ->  one per piece, added in order
    graph.reduce_sum over the layers (an invariant's gradient)      ->  one per piece, added as they are made
    graph.iota (a per-layer counter)                                ->  one per piece, from its first layer's
    graph.literal (per-layer numbers of imported blocks)            ->  one per piece, its layers' rows
    graph.assign "blocks.[0:8].w"                                   ->  "blocks.[0:5].w", "blocks.[5:8].w"

Each piece of a forward scan is marked with its stage (`pipeline.layer_stage`), which
`assign-pipeline-stages` takes as given. A stage's program then holds one scan per stack, however
many layers it has: the pipeline's IR, like the rest, does not grow with the layer count.

Anything else that reads a stack as a whole cannot be cut: PassError naming the op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerAttr, ModuleOp, TensorType, i64
from xdsl.ir import Attribute, Operation, SSAValue
from xdsl.passes import ModulePass

from hspmd.dialects import comm, graph, optim
from hspmd.ir.stacked_names import layer_range, slice_name
from hspmd.transforms.pipeline.balance import balanced_counts, op_cost, stage_of_layers
from hspmd.transforms.pipeline.group import PipelinedGroup, find_group, forward_end
from hspmd.transforms.pipeline.virtual import Pipeline, selected_pipelines
from hspmd.transforms.util import PassError

__all__ = ["LAYER_STAGE_ATTR", "CutStackedLayers", "cut_stacks"]

#: a forward layer unit (a scan's piece, or a block call) of a stage-shaped step: its stage
LAYER_STAGE_ATTR = "pipeline.layer_stage"

#: ops that work slice by slice along a stack's leading dim (one op per piece after the cut): the
#: updates (kept or not: `where_finite`), casts and all-reduces of stacked values, and the sum
#: making a per-layer counter (`broadcast(step) + graph.iota`, a broadcast of a value that is not a stack)
_SLICEWISE = (optim.AdamOp, optim.SGDOp, optim.MulScalarOp, optim.WhereFiniteOp, graph.CastOp, comm.AllReduceOp,
              graph.AddOp, graph.BroadcastOp)

Pieces = list[tuple[int, int]]  # (start, stop) of each piece, in the stack's slice numbers


def _layerwise_collective(o: Operation) -> bool:
    """Return whether `o` is a collective that moves a stack's pieces along dims other than the
    stacking dim 0 (a stacked weight's column split over tp): it works on each layer's slice alone,
    and what it makes is a stack too."""
    if isinstance(o, (comm.LocalSplitOp, comm.AllGatherOp, comm.ReduceScatterOp)):
        return o.dim.value.data != 0
    if isinstance(o, comm.AllToAllOp):
        return o.split_dim.value.data != 0 and o.concat_dim.value.data != 0
    return isinstance(o, comm.LocalZeroOp)


def _units(ops: list[Operation], end: int) -> list[Operation]:
    """Return the forward layer units in order: forward scans of a `*_fwd` function, block calls."""
    return [o for o in ops[:end] if (isinstance(o, graph.ScanOp) and not o.is_reverse
                                     or isinstance(o, func.CallOp))
            and o.callee.root_reference.data.endswith("_fwd")]


def _layer_stages(g: PipelinedGroup, pipe: Pipeline, units: list[Operation]) -> list[list[int]]:
    """Return each unit's layers' stages, as `assign-pipeline-stages` balances block calls."""
    funcs = {f.sym_name.data: f for f in g.functions}
    end = forward_end(g.ops)

    def layer_cost(unit: Operation) -> int:
        callee = funcs.get(unit.callee.root_reference.data)  # type: ignore[attr-defined]
        return sum(op_cost(o, funcs) for o in callee.body.block.ops) if callee is not None else 0

    counts = [u.num_iterations if isinstance(u, graph.ScanOp) else 1 for u in units]
    costs = [layer_cost(u) for u, c in zip(units, counts) for _ in range(c)]
    where = {u: k for k, u in enumerate(units)}
    first = last = 0
    seen = False
    for o in g.ops[:end]:
        if o in where:
            seen, last = True, 0
        elif not seen:
            first += op_cost(o, funcs)
        else:
            last += op_cost(o, funcs)
    n = len(costs)
    if pipe.layers is None and n >= pipe.pp:
        stages = stage_of_layers(n, pipe.pp, balanced_counts(costs, first, last, pipe.pp), "layers")
    else:
        stages = stage_of_layers(n, pipe.pp, pipe.layers, "layers")
    out, k = [], 0
    for c in counts:
        out.append(stages[k:k + c])
        k += c
    return out


def _pieces(stages: Sequence[int]) -> tuple[Pieces, list[int]]:
    """Return the runs of equal stage in `stages` as (start, stop) pieces, and each piece's stage."""
    pieces, owners = [], []
    for i, s in enumerate(stages):
        if pieces and owners[-1] == s:
            pieces[-1] = (pieces[-1][0], i + 1)
        else:
            pieces.append((i, i + 1))
            owners.append(s)
    return pieces, owners


def _piece_type(typ: Attribute, a: int, b: int) -> TensorType:
    assert isinstance(typ, TensorType)
    return TensorType(typ.element_type, (b - a, *typ.get_shape()[1:]), typ.encoding)


class _Cutter:
    """Cuts the stacked values of one forward scan's family (module docstring)."""

    def __init__(self, length: int, pieces: Pieces, family: set[SSAValue]) -> None:
        self.length, self.pieces, self.family = length, pieces, family
        self.parts: dict[SSAValue, list[SSAValue]] = {}  # a stacked value -> its pieces' values
        self.done: list[Operation] = []  # ops replaced, erased at the end

    def stacked(self, v: SSAValue) -> bool:
        return v in self.family

    def of(self, v: SSAValue, user: Operation) -> list[SSAValue]:
        if v not in self.parts:
            raise PassError(f"cut-stacked-layers: '{user.name}' reads a stack of {self.length} layers that comes "
                            f"from '{v.owner.name}', which the cut does not split")  # type: ignore[union-attr]
        return self.parts[v]

    def parameter(self, p: graph.ParameterOp) -> None:
        name = p.tensor_name.data
        span = layer_range(name)
        if span is None:
            raise PassError(f"cut-stacked-layers: parameter '{name}' is stacked ({self.length} layers) but its "
                            "name holds no layer range")
        gtype = p.properties.get("global_type")
        made = []
        for a, b in self.pieces:
            new = graph.ParameterOp(slice_name(name, a, b), p.init.data,
                                    _piece_type(p.result.type, a, b),
                                    _piece_type(gtype, a, b) if gtype is not None else None)
            new.attributes.update(p.attributes)
            p.parent_block().insert_op_before(new, p)  # type: ignore[union-attr]
            made.append(new.result)
        self.parts[p.result] = made
        self.done.append(p)

    def scan(self, s: graph.ScanOp, owners: list[int] | None) -> None:
        order = list(range(len(self.pieces)))
        if s.is_reverse:
            order.reverse()
        carries = s.carries()
        args: list[SSAValue] = list(s.args)
        outs: list[list[SSAValue | None]] = [[None] * len(self.pieces) for _ in s.outs]
        stacked = set(s.stacked_args())
        for k in order:
            a, b = self.pieces[k]
            operands = [self.of(v, s)[k] if j in stacked else args[j] for j, v in enumerate(s.args)]
            types = [_piece_type(r.type, a, b) if s.result_stacked(i) else r.type for i, r in enumerate(s.outs)]
            new = graph.ScanOp(s.callee.root_reference.data, operands, types, length=b - a, stacked=sorted(stacked),
                               carry_args=[j for j, _ in carries], carry_results=[r for _, r in carries],
                               reverse=s.is_reverse)
            if owners is not None:
                new.attributes[LAYER_STAGE_ATTR] = IntegerAttr(owners[k], i64)
            s.parent_block().insert_op_before(new, s)  # type: ignore[union-attr]
            for j, r in carries:
                args[j] = new.outs[r]
            for i, r in enumerate(new.outs):
                outs[i][k] = r
        for i, r in enumerate(s.outs):
            if s.result_stacked(i):
                self.parts[r] = outs[i]  # type: ignore[assignment]
            else:
                r.replace_all_uses_with(args[next(j for j, res in carries if res == i)])
        self.done.append(s)

    def slicewise(self, o: Operation) -> None:
        results: list[list[SSAValue]] = [[] for _ in o.results]
        for k, (a, b) in enumerate(self.pieces):
            operands = [self.of(v, o)[k] if self.stacked(v) else v for v in o.operands]
            types = [_piece_type(r.type, a, b) if self.stacked(r) else r.type for r in o.results]
            new = type(o).create(operands=operands, result_types=types, properties=dict(o.properties),
                                 attributes=dict(o.attributes))
            o.parent_block().insert_op_before(new, o)  # type: ignore[union-attr]
            for i, r in enumerate(new.results):
                results[i].append(r)
        for r, pieces in zip(o.results, results):
            if not self.stacked(r):
                raise PassError(f"cut-stacked-layers: '{o.name}' makes a value that is not a stack from a stack")
            self.parts[r] = pieces
        self.done.append(o)

    def iota(self, o: graph.IotaOp) -> None:
        start, step = o.start.value.data, o.step.value.data
        gtype = o.properties.get("global_type")
        pieces = []
        for a, b in self.pieces:
            new = graph.IotaOp(start + a * step, step, _piece_type(o.result.type, a, b))
            if gtype is not None:
                new.properties["global_type"] = _piece_type(gtype, a, b)
            o.parent_block().insert_op_before(new, o)  # type: ignore[union-attr]
            pieces.append(new.result)
        self.parts[o.result] = pieces
        self.done.append(o)

    def literal(self, o: graph.LiteralOp) -> None:
        values = o.values()
        gtype = o.global_type
        pieces = []
        for a, b in self.pieces:
            new = graph.LiteralOp(values[a:b], _piece_type(gtype if gtype is not None else o.result.type, a, b))
            if gtype is not None:  # the rows of the whole, this rank's piece of them
                new = graph.LiteralOp.create(properties={**new.properties, "global_type": _piece_type(gtype, a, b)},
                                             attributes=dict(o.attributes),
                                             result_types=[_piece_type(o.result.type, a, b)])
            o.parent_block().insert_op_before(new, o)  # type: ignore[union-attr]
            pieces.append(new.result)
        self.parts[o.result] = pieces
        self.done.append(o)

    def sum_squares(self, o: optim.SumSquaresOp) -> None:
        self._summed(o, self.of(o.operands[0], o), lambda piece: optim.SumSquaresOp(piece, o.result.type))

    def sum_layers(self, o: graph.ReduceSumOp) -> None:
        """A sum over the stacking dim (the gradient of a scan's invariant float argument, summed
        over the layers): the pieces' sums, added in the order the pieces are made (a backward
        scan's from the last layers down, so that each stage adds its own to what the stage
        after it handed back)."""
        pieces = self.of(o.input, o)
        backward = isinstance(o.input.owner, graph.ScanOp) and o.input.owner.is_reverse
        self._summed(o, list(reversed(pieces)) if backward else pieces,
                     lambda piece: graph.ReduceSumOp(piece, [0], o.result.type))

    def _summed(self, o: Operation, pieces: list[SSAValue], part) -> None:
        """Replace reduction `o` of a stack by `part(piece)` of each of `pieces`, added in turn."""
        total = None
        for piece in pieces:
            made = part(piece)
            o.parent_block().insert_op_before(made, o)  # type: ignore[union-attr]
            if total is None:
                total = made.results[0]
            else:
                add = graph.AddOp(total, made.results[0])
                o.parent_block().insert_op_before(add, o)  # type: ignore[union-attr]
                total = add.result
        o.results[0].replace_all_uses_with(total)  # type: ignore[arg-type]
        self.done.append(o)

    def named(self, o: graph.AssignOp | graph.OutputOp) -> None:
        name = o.tensor_name.data
        prefix = "grad:" if name.startswith("grad:") else ""
        span = layer_range(name)
        if span is None:
            raise PassError(f"cut-stacked-layers: '{o.name}' \"{name}\" of a stack has no layer range in its name")
        for (a, b), piece in zip(self.pieces, self.of(o.operands[0], o)):
            piece_name = prefix + slice_name(name[len(prefix):], a, b)
            new = type(o)(piece_name, piece)
            o.parent_block().insert_op_before(new, o)  # type: ignore[union-attr]
        self.done.append(o)

    def finish(self) -> None:
        for o in reversed(self.done):
            o.detach()
            o.erase()


def cut_stacks(g: PipelinedGroup, pipe: Pipeline) -> int:
    """Cut the stacks of layers of pipelined group `g` at its stage boundaries; return how many
    scans were cut (0: it has none to cut, block calls only)."""
    end = forward_end(g.ops)
    units = _units(g.ops, end)
    if not any(isinstance(u, graph.ScanOp) for u in units):
        return 0
    stages = _layer_stages(g, pipe, units)
    cut = 0
    for unit, layer_stages in zip(units, stages):
        if isinstance(unit, func.CallOp):
            unit.attributes[LAYER_STAGE_ATTR] = IntegerAttr(layer_stages[0], i64)
            continue
        pieces, owners = _pieces(layer_stages)
        if len(pieces) == 1:
            unit.attributes[LAYER_STAGE_ATTR] = IntegerAttr(owners[0], i64)
            continue
        _cut_family(g, unit, pieces, owners)
        cut += 1
    return cut


def _cut_family(g: PipelinedGroup, forward: graph.ScanOp, pieces: Pieces, owners: list[int]) -> None:
    """Cut every stacked value reachable from `forward` through ops that work along the stack: a
    scan's stacked operands and results, and a slice-wise op's operands and results of the shape
    of the stacked value it was reached by."""

    def stacked_of(o: Operation) -> list[SSAValue]:
        if isinstance(o, graph.ScanOp):
            return [o.args[j] for j in o.stacked_args()] + [r for k, r in enumerate(o.outs) if o.result_stacked(k)]
        return []

    family: set[SSAValue] = set()
    todo = stacked_of(forward)
    while todo:
        v = todo.pop()
        if v in family:
            continue
        family.add(v)
        shape = graph.tensor_shape(v)
        for o in [u.operation for u in v.uses] + ([v.owner] if isinstance(v.owner, Operation) else []):
            if isinstance(o, graph.ScanOp):
                todo.extend(x for x in stacked_of(o) if x not in family)
            elif isinstance(o, _SLICEWISE):
                todo.extend(x for x in (*o.operands, *o.results)
                            if x not in family and isinstance(x.type, TensorType) and graph.tensor_shape(x) == shape)
            elif _layerwise_collective(o):
                todo.extend(x for x in (*o.operands, *o.results) if x not in family)
    cutter = _Cutter(forward.num_iterations, pieces, family)
    for o in list(g.step.body.block.ops):
        touches = any(v in family for v in (*o.operands, *o.results))
        if not touches:
            continue
        if isinstance(o, graph.ParameterOp):
            cutter.parameter(o)
        elif isinstance(o, graph.ScanOp):
            cutter.scan(o, owners if o is forward else None)
        elif isinstance(o, graph.IotaOp):
            cutter.iota(o)
        elif isinstance(o, graph.LiteralOp):
            cutter.literal(o)
        elif isinstance(o, graph.BroadcastOp) and o.input in family:
            raise PassError(f"cut-stacked-layers: '{o.name}' broadcasts a stack of {forward.num_iterations} layers; "
                            "a pipeline cannot cut it into its stages' layers")
        elif isinstance(o, _SLICEWISE) or _layerwise_collective(o):
            cutter.slicewise(o)
        elif isinstance(o, optim.SumSquaresOp):
            cutter.sum_squares(o)
        elif isinstance(o, graph.ReduceSumOp) and list(o.dims.get_values()) == [0] and o.input in family:
            cutter.sum_layers(o)
        elif isinstance(o, (graph.AssignOp, graph.OutputOp)):
            cutter.named(o)
        else:
            raise PassError(f"cut-stacked-layers: '{o.name}' reads a stack of {forward.num_iterations} layers as a "
                            "whole; a pipeline cannot cut it into its stages' layers")
    cutter.finish()


@dataclass(frozen=True)
class CutStackedLayers(ModulePass):
    """Cut the stacked layers of each pipelined group's stage-shaped step at its stage boundaries."""

    name = "cut-stacked-layers"

    #: the id of the module's strategy to read (None: its only one)
    strategy_id: int | None = None
    #: the pipelined group to cut (its index among the strategy's pipelined groups; None: all)
    group: int | None = None

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        record, pipes = selected_pipelines(op, self.strategy_id, self.group, self.name)
        for pipe in pipes:
            cut_stacks(find_group(op, pipe, record.microbatches), pipe)
