"""Layer functions alike but for their literals become one function that takes them (for `stack-layers`).

An imported transformer whose layers differ only in a constant table computes each kind of layer
in a function of its own: Gemma-3's sliding-window layers read the local rotary tables and its
full-attention layers the global ones, so `@Gemma3DecoderLayer_0` and `@Gemma3DecoderLayer_1`
are the same ops but for two `graph.literal`s. `stack-layers` can stack a chain of calls of one
function only, so this step makes such functions one:

    %y = func.call @L_0(%w..., %x)        ->   %y = func.call @L_0_literals(%w..., %x, %tables, %k0)
    %z = func.call @L_1(%v..., %y)        ->   %z = func.call @L_0_literals(%v..., %y, %tables, %k1)

where `%tables` holds each differing literal of every function stacked (one `graph.literal` of
shape [functions, ...], a value every call shares) and `%k0`, `%k1` are 0-d integer literals,
the function's own number; the new function reads its literal as `graph.take(%tables, %k, dim
0)`, the very bits the literal held. A chain of the new function's calls then stacks (period 1),
the per-call numbers stacked into one literal; the tables are read, not copied, per layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, i64
from xdsl.ir import Block, Operation, Region, SSAValue

from hspmd.dialects import graph


def _structure(fn: func.FuncOp) -> tuple:
    """Return what two functions must share to be one but for their literals' values: each op's
    name, properties and attributes (a literal's data aside), result types and operands."""
    index: dict[SSAValue, tuple[int, int]] = {a: (-1, j) for j, a in enumerate(fn.body.block.args)}
    out = [tuple(str(a.type) for a in fn.body.block.args)]
    for i, op in enumerate(fn.body.block.ops):
        if op.regions:
            return (id(fn),)  # nested regions: compared as themselves only
        props = tuple(sorted((k, str(v)) for k, v in op.properties.items()
                             if not (isinstance(op, graph.LiteralOp) and k == "data")))
        attrs = tuple(sorted((k, str(v)) for k, v in op.attributes.items()))
        out.append((op.name, props, attrs, tuple(str(r.type) for r in op.results),
                    tuple(index.get(v, ("outer", id(v))) for v in op.operands)))
        for k, r in enumerate(op.results):
            index[r] = (i, k)
    return tuple(out)


def _differing_literals(fns: Sequence[func.FuncOp]) -> list[int]:
    """Return the positions (op indices) of the literals whose data differ among `fns` (alike)."""
    ops = [list(f.body.block.ops) for f in fns]
    return [i for i, op in enumerate(ops[0]) if isinstance(op, graph.LiteralOp)
            and len({o[i].data.data for o in ops}) > 1]  # type: ignore[union-attr]


def _one_function(module: ModuleOp, fns: Sequence[func.FuncOp], where: list[int]) -> func.FuncOp:
    """Add a function computing `fns[0]` with the literals at `where` read from table arguments
    at an index argument (see the module docstring); return it."""
    first = fns[0]
    literals = [list(first.body.block.ops)[i] for i in where]
    tables = [graph.stacked_type(lit.results[0].type, len(fns)) for lit in literals]
    index_type = graph.tensor_type(i64, ())
    types = [a.type for a in first.body.block.args] + tables + [index_type]
    body = Block(arg_types=types)
    mapping: dict[SSAValue, SSAValue] = dict(zip(first.body.block.args, body.args))
    table_args, index = body.args[len(first.body.block.args):-1], body.args[-1]
    replaced = {id(lit): t for lit, t in zip(literals, table_args)}
    for op in first.body.block.ops:
        if id(op) in replaced:
            take = graph.TakeOp(replaced[id(op)], index, 0, op.results[0].type)
            body.add_op(take)
            mapping[op.results[0]] = take.result
            continue
        body.add_op(op.clone(value_mapper=mapping))
    names = {o.sym_name.data for o in module.body.block.ops if isinstance(o, func.FuncOp)}
    name, k = f"{first.sym_name.data}_literals", 1
    while name in names:
        k += 1
        name = f"{first.sym_name.data}_literals_{k}"
    out_types = list(first.function_type.outputs.data)
    made = func.FuncOp(name, (types, out_types), Region(body), visibility="private")
    module.body.block.insert_op_after(made, fns[-1])
    return made


def unify_literals(module: ModuleOp, calls: Sequence[func.CallOp]) -> set[str]:
    """Make the functions `calls` call that are alike but for some literals one function (see the
    module docstring), rewriting `calls` in place (the list's calls are replaced: read the block
    again); return the names of the functions no call of `calls` calls any more."""
    funcs = {o.sym_name.data: o for o in module.body.block.ops if isinstance(o, func.FuncOp)}
    names = list(dict.fromkeys(c.callee.root_reference.data for c in calls))
    groups: dict[tuple, list[str]] = {}
    for n in names:
        groups.setdefault(_structure(funcs[n]), []).append(n)
    replaced: set[str] = set()
    for members in groups.values():
        if len(members) < 2:
            continue
        fns = [funcs[n] for n in members]
        where = _differing_literals(fns)
        if not where:
            continue  # alike to the bit: nothing to take (the importer would have made them one)
        made = _one_function(module, fns, where)
        first_call = next(c for c in calls if c.callee.root_reference.data in members)
        block = first_call.parent_block()
        tables: list[Operation] = []
        for i in where:
            values = np.stack([list(f.body.block.ops)[i].values() for f in fns])  # type: ignore[attr-defined]
            lit = list(fns[0].body.block.ops)[i]
            tables.append(graph.LiteralOp(values, graph.stacked_type(lit.results[0].type, len(fns))))
        for t in tables:
            block.insert_op_before(t, first_call)  # type: ignore[union-attr]
        for c in calls:
            name = c.callee.root_reference.data
            if name not in members:
                continue
            number = graph.LiteralOp(np.array(members.index(name), dtype=np.int64), graph.tensor_type(i64, ()))
            new = func.CallOp(made.sym_name.data, [*c.operands, *(t.results[0] for t in tables), number.result],
                              [r.type for r in c.results])
            block.insert_op_before(number, c)  # type: ignore[union-attr]
            block.insert_op_before(new, c)  # type: ignore[union-attr]
            for old, r in zip(c.results, new.results):
                old.replace_all_uses_with(r)
            c.detach()
            c.erase()
        replaced.update(members)
    return replaced
