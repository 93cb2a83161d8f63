"""Embeddings: the row lookup of a table and its gradient, the scatter-add of rows (a table
split along its vocabulary holds one range of rows: `graph.one_hot` reads the same ranges)."""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
from xdsl.dialects.builtin import (
    TensorType,
    TypeAttribute,
)
from xdsl.ir import Attribute, Operation, SSAValue
from xdsl.irdl import (
    irdl_op_definition,
    operand_def,
    opt_prop_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from hspmd.dialects.cuda_c import KernelCode, c_type, flat_kernel, kernel_params, rank_defaults, rank_value, retype
from hspmd.dialects.dist import layout_of
from hspmd.dialects.graph.base import (
    TensorOp,
    check_integer,
    check_same_element_type,
    piece_starts,
    result_shape,
    tensor_shape,
    whole_piece,
)
from hspmd.dialects.interfaces import Kernel, KernelContext
from hspmd.dialects.op_rule import OpRule, factors
from hspmd.dialects.traced import as_tensor, fail, require_float, typed
from hspmd.ir.layout import PARTIAL

__all__ = [
    "EmbeddingOp",
    "EmbeddingGradOp",
]


# ----------------------------------------------------------------------------- a split vocabulary


def annotated_piece(op: Operation, rank: int):
    """Return (global shape, layout) of `op`'s result from its `global_type`, or None where the
    op runs whole (logical IR, a one-device program, or a rank the layout does not name)."""
    typ = getattr(op, "global_type", None)
    layout = layout_of(typ) if typ is not None else None
    if layout is None or rank not in layout.devices:
        return None
    return typ.get_shape(), layout  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- embeddings


#: groups of more repeats of one id than this are summed one group at a time (`np.add.reduce`);
#: the others in one vectorized pass per repeat
_SCATTER_PASSES = 16


def scatter_add_rows(out: np.ndarray, index: np.ndarray, rows: np.ndarray, native=None) -> np.ndarray:
    """Add row i of `rows` into row `index[i]` of `out`, in place, in the order of i; return `out`.

    The same bits as `np.add.at(out, index, rows)` (each row of `out` gets its rows added one
    by one in order). With `native` (the runtime's `hspmd.runtime.cpu.native`, as a kernel gets it
    in `KernelContext.native`; None: NumPy only) in one C++ pass where its library is built
    (`native.scatter_add_rows`: 0.1 ms against 1.1-1.4 ms for GPT-tiny's 2048 ids). Else
    about 9x faster than `np.add.at` on a GPT's ids: the rows are grouped by index (a
    stable sort) and the k-th row of every group is added in one vectorized pass, so the
    passes number the most repeats of one index among the groups of at most `_SCATTER_PASSES`
    rows. A larger group (a byte-level GPT's space: hundreds of repeats) is added into its row
    of `out` row after row on its own (`np.add.reduce`, `reduceat` and `accumulate` over the
    leading axis sum pairwise or cast differently for some shapes and dtypes: other bits).
    """
    if index.size == 0 or native is not None and native.scatter_add_rows(out, index, rows):
        return out
    order = np.argsort(index, kind="stable")
    sorted_index = index[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_index[1:] != sorted_index[:-1])))
    counts = np.diff(np.append(starts, index.size))
    grouped = rows[order]
    targets = sorted_index[starts]
    large = counts > _SCATTER_PASSES
    for t, s, c in zip(targets[large], starts[large], counts[large]):
        acc = out[t]
        for row in grouped[s:s + c]:
            np.add(acc, row, out=acc)
    small = ~large
    for k in range(int(counts[small].max(initial=0))):
        more = small & (counts > k)
        out[targets[more]] += grouped[starts[more] + k]
    return out


def embedding_grad_values(ids: np.ndarray, dy: np.ndarray, vocab: int, native=None) -> np.ndarray:
    """Scatter-add the rows of `dy` into a zero [vocab, D] table at `ids` (in the order of the ids;
    `native` as for `scatter_add_rows`)."""
    out = np.zeros((vocab, dy.shape[-1]), dtype=dy.dtype)
    return scatter_add_rows(out, ids.reshape(-1), dy.reshape(-1, dy.shape[-1]), native)


@irdl_op_definition
class EmbeddingOp(TensorOp):
    """Row lookup `table[ids]`: table [V, D], integer ids [...] -> [..., D]."""

    name = "graph.embedding"
    ATEN: ClassVar[tuple[str, ...]] = ("aten.embedding.default",)
    table = operand_def(TensorType)
    ids = operand_def(TensorType)
    result = result_def(TensorType)
    global_type = opt_prop_def(TypeAttribute)
    traits = traits_def(Pure())
    #: a vocabulary-split table gives a partial result (each rank looks up the rows it owns,
    #: zeros elsewhere): the kernel finds its rows' offset from the result's annotated layout
    RECORDS_GLOBAL_TYPE: ClassVar[bool] = True
    FRONTEND: ClassVar[tuple[str, ...]] = ("embedding",)

    def __init__(self, table: SSAValue, ids: SSAValue, result_type: Attribute):
        super().__init__(operands=[table, ids], result_types=[result_type])

    def verify_(self) -> None:
        t, i, r = tensor_shape(self.table), tensor_shape(self.ids), tensor_shape(self.result)
        if len(t) != 2 or r != (*i, t[1]):
            raise VerifyException(f"'{self.name}' needs table [V, D] and ids [...] giving [..., D], "
                                  f"got {list(t)}, {list(i)} -> {list(r)}")
        check_integer(self, self.ids, "ids")
        check_same_element_type(self, self.table, self.result)

    def sharding_rule(self) -> OpRule:
        # vocabulary-parallel (Megatron): a table split along V gives each rank the rows it
        # owns and zeros for other ids, so `v`, missing from the result, leaves partial sums.
        # Not linear in the table: a partial result then always means a split vocabulary
        # (the kernel reads its rows' offset from the partial coordinate).
        b = factors("b", len(tensor_shape(self.ids)))
        return OpRule((("v", "e"), b), ((*b, "e"),))

    def vjp(self, gs, emit):
        g = gs[0]
        return [lambda: emit(EmbeddingGradOp(self.ids, g, self.table.type)), None]

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        """`table[ids]`; with a vocabulary-split table (a partial result) the rows this rank owns,
        zeros for the other ids: its table piece starts at (its coordinate on the partial axis) * rows."""
        rank = ctx.rank
        found = annotated_piece(self, rank)
        part = None
        if found is not None:
            layout = found[1]
            for group in layout.groups:
                if rank in group.devices:
                    part = group.states.coords(group.devices.index(rank)).get(PARTIAL)
        if part is None:
            return lambda table, ids: table[ids]

        def lookup(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
            local = ids - part * table.shape[0]
            inside = (local >= 0) & (local < table.shape[0])
            out = table[np.where(inside, local, 0)]
            out[~inside] = 0
            return out

        return lookup

    def cuda_kernel(self, name: str) -> KernelCode:
        """Per element of the result: its id's row of the table (NaN for an id out of range,
        where NumPy raises)."""
        vocab, dim = tensor_shape(self.table)
        values = {}  # a rank of a partial layout: (1, where its rows start); zeros elsewhere for ids it lacks
        if not whole_piece(self):
            layout = layout_of(self.global_type)
            for group in layout.groups:
                for pos, rank in enumerate(group.devices):
                    part = group.states.coords(pos).get(PARTIAL)
                    values[rank] = (0, 0) if part is None else (1, part * vocab)
        body = (f"const long id = (long)in1[i / {dim}L] - {rank_value(name, 1)};\n"
                f"    out0[i] = (id >= 0 && id < {vocab}L) ? (T)in0[id * {dim}L + i % {dim}L] "
                f": ({rank_value(name, 0)} ? (T)0 : (T)HS_NAN);")
        code = flat_kernel(name, self, c_type(self.result.type), body)
        return KernelCode(rank_defaults(name, (0, 0)) + code.source, code.launches, rank_values=values)


@irdl_op_definition
class EmbeddingGradOp(TensorOp):
    """Scatter-add `out[ids[...]] += dy[...]` into zeros [V, D] (V from the result type)."""

    name = "graph.embedding_grad"
    ids = operand_def(TensorType)
    dy = operand_def(TensorType)
    result = result_def(TensorType)
    global_type = opt_prop_def(TypeAttribute)
    traits = traits_def(Pure())
    #: a result split along V holds the rows of one vocabulary range: the kernel scatters only
    #: the ids in that range, at the offset the result's annotated layout gives
    RECORDS_GLOBAL_TYPE: ClassVar[bool] = True
    NO_VJP: ClassVar[str] = "a gradient op (no second derivatives)"

    def __init__(self, ids: SSAValue, dy: SSAValue, result_type: Attribute):
        super().__init__(operands=[ids, dy], result_types=[result_type])

    def verify_(self) -> None:
        i, g, r = tensor_shape(self.ids), tensor_shape(self.dy), tensor_shape(self.result)
        if len(r) != 2 or g != (*i, r[1]):
            raise VerifyException(f"'{self.name}' needs ids [...] and dy [..., D] giving [V, D], "
                                  f"got {list(i)}, {list(g)} -> {list(r)}")
        check_integer(self, self.ids, "ids")
        check_same_element_type(self, self.dy, self.result)

    def sharding_rule(self) -> OpRule:
        # the id dims are summed over: split, they leave partial sums;
        # a result split along V scatters only its ids' rows
        b = factors("b", len(tensor_shape(self.ids)))
        return OpRule((b, (*b, "e")), (("v", "e"),), frozenset({1}))

    def numpy_kernel(self, ctx: KernelContext) -> Kernel:
        """Scatter-add `dy` at `ids` into this rank's rows of the table gradient (all rows, or the
        vocabulary range its result piece covers when the result is split along V)."""
        rank, native = ctx.rank, ctx.native
        vocab = result_shape(self)[0]
        found = annotated_piece(self, rank)
        start = found[1].slices(rank, found[0])[0].start if found is not None else 0
        if start == 0 and (found is None or found[0][0] == vocab):
            return lambda ids, dy: embedding_grad_values(ids, dy, vocab, native)

        def grad(ids: np.ndarray, dy: np.ndarray) -> np.ndarray:
            local = ids.reshape(-1) - start
            inside = (local >= 0) & (local < vocab)
            out = np.zeros((vocab, dy.shape[-1]), dtype=dy.dtype)
            return scatter_add_rows(out, local[inside], dy.reshape(-1, dy.shape[-1])[inside], native)

        return grad

    def cuda_kernel(self, name: str) -> KernelCode:
        """The ids sorted with their positions, then a block per row v of the table's gradient,
        its threads over the columns, each adding the rows of `dy` whose id is v in the order of
        the ids: the bits of the NumPy kernel's scatter, with no atomics.

        `NAME_keys` makes a key per id, (id - the piece's first row) << 32 | its position (ids
        outside the piece's rows: the largest key); `NAME_sort` launches sort the keys (a bitonic
        sort over the next power of two P of the ids, one launch per pass: k and j in `n1`); `NAME`
        finds row v's keys by binary search and sums their rows. Work: P log^2 P for the sort,
        then rows x (log P + columns) plus ids x columns, where a block per row scanning every id
        would take rows x columns x ids (a vocabulary of 50,257 and 8,192 ids: 3e11)."""
        vocab, dim = tensor_shape(self.result)
        ids = math.prod(tensor_shape(self.ids))
        padded = 1 << max(1, (ids - 1).bit_length())
        starts = piece_starts(self)  # a piece split along V: its rows' ids start where it starts
        item = 8 if c_type(self.result.type) == "double" else 4  # scratch is in the kernel's compute type
        params = ", ".join(kernel_params(self, scratch=1))
        src = (f"// {name}: graph.embedding_grad: the ids sorted with their positions, then a block per row\n"
               + rank_defaults(name, (0, 0)) +
               f"HS_KERNEL void {name}_keys({params}) {{\n"
               f"  long long* key = (long long*)scratch0;\n"
               f"  HS_FOR(i, n0) {{\n"
               f"    const long long id = i < {ids}L ? (long long)in0[i] - {rank_value(name, 0)} : -1LL;\n"
               f"    key[i] = id >= 0 && id < {vocab}LL ? (id << 32) | (long long)i : 0x7fffffffffffffffLL;\n"
               f"  }}\n}}\n"
               f"HS_KERNEL void {name}_sort({params}) {{\n"
               f"  long long* key = (long long*)scratch0;\n"
               f"  const long k = n1 >> 32, j = n1 & 0xffffffffL;\n"
               f"  HS_FOR(i, n0) {{\n"
               f"    const long p = i ^ j;\n"
               f"    if (p > i) {{\n"
               f"      const long long a = key[i], b = key[p];\n"
               f"      if ((a > b) == ((i & k) == 0)) {{ key[i] = b; key[p] = a; }}\n"
               f"    }}\n  }}\n}}\n"
               f"HS_KERNEL void {name}({params}) {{\n"
               f"  const long long* key = (const long long*)scratch0;\n"
               f"  HS_ROWS(v, n0) {{\n"
               f"    long lo = 0, hi = {padded}L, end = 0;\n"
               f"    while (lo < hi) {{ const long m = (lo + hi) / 2; if (key[m] < ((long long)v << 32)) lo = m + 1; else hi = m; }}\n"
               f"    end = lo, hi = {padded}L;\n"
               f"    while (end < hi) {{ const long m = (end + hi) / 2; if (key[m] < ((long long)(v + 1) << 32)) end = m + 1; else hi = m; }}\n"
               f"    HS_COLS(j, n1) {{\n"
               f"      T acc = 0;\n"
               f"      for (long s = lo; s < end; ++s) acc += in1[(key[s] & 0xffffffffLL) * {dim}L + j];\n"
               f"      out0[v * {dim}L + j] = acc;\n"
               f"    }}\n  }}\n}}\n")
        passes = [f"elementwise {name}_sort {padded} {(k << 32) | j}"
                  for k in (1 << e for e in range(1, padded.bit_length())) for j in (k >> s for s in range(1, k.bit_length()))]
        launches = [f"elementwise {name}_keys {padded} 0", *passes, f"row {name} {vocab} {dim}"]
        return KernelCode(retype(src, c_type(self.result.type)), launches, scratch=[padded * 8 // item],
                          rank_values=starts)


# ----------------------------------------------------------------------------- frontend


def embedding(table, ids):
    """Return `table[ids]`: table [V, D] float, integer ids [...] -> [..., D]."""
    table, ids = as_tensor(table, "embedding"), as_tensor(ids, "embedding")
    if table.ndim != 2:
        raise fail("embedding", f"the table must be [V, D], got {list(table.shape)}")
    if not ids.dtype.startswith("int"):
        raise fail("embedding", f"ids must be integers, got {ids.dtype}")
    require_float(table, "embedding")
    return table.tracer.emit(EmbeddingOp(table.value, ids.value, typed(table, (*ids.shape, table.shape[1]))))
