"""`apply-strategy`: turn strategy text into layouts on the step's parameters, inputs and residual stream.

`apply-strategy{strategy="[0-3]: dp=2 tp=2"}` sets the type of every `graph.parameter` and
`graph.input` of the step to a layout over the group's devices (with tp, also the residual
stream, and a vocabulary-parallel rewrite of the loss); other values are left to
`propagate-layouts`. The group's devices form a mesh `dp` major, `tp` minor: with dp=2 tp=2
devices 0,1 are one tensor-parallel pair, 2,3 the other.

* inputs: split along their first (batch) dim over dp, replicated over tp (a scalar input is
  replicated);
* parameters: replicated over dp; over tp, Megatron-style (below), else replicated;
* optimizer state `opt.<kind>.NAME` shaped like parameter NAME: NAME's layout.

**Tensor parallelism (tp > 1): which weights are column- and row-parallel.** A forward walk of
the logical IR, into callees (`func.call` operands that are parameters map to the callee's
arguments; a callee is classified once for all its calls), looks at each `graph.matmul` whose
right operand is a 2-D parameter `W [in, out]` (possibly through `graph.cast`):

1. if its left operand derives from no column candidate, `W` is a *column candidate*: its
   result is marked as derived from `W`;
2. if its left operand derives from column candidates (through any ops but another such
   matmul and layer/RMS norms, which start afresh), `W` is *row-parallel*, `split(0)` over tp,
   and those candidates are *column-parallel*, `split(1)` over tp;
3. a candidate that no row-parallel matmul consumes (an MLP's last layer; an LM head is split
   over the vocabulary, below) stays replicated, as do weights classified both ways, norms and
   row-parallel biases;
   the bias `b` of a column-parallel weight (`matmul(x, W) + broadcast(b)`) is `split(0)`.

So in a transformer block q/k/v (or the fused qkv) and the MLP's first weights (fc, w1, w3)
are column-parallel, the attention output projection and the MLP's last weight row-parallel:
the forward needs one all-reduce per pair (after the row-parallel matmul), the backward one
per pair too. The propagation of layouts decides everything else, so a weight classified
"wrongly" costs collectives, never correctness. A column output reshaped into heads
(`[B,T,D] -> [B,T,H,hd]`, or GPT's head-major fused qkv `[B,T,3D] -> [B,T,H,3*hd]`) is split
by heads, so the attention runs head-parallel with no gather.

**Vocabulary parallelism (one group).** An embedding table (`graph.embedding`'s table) is
`split(0)` over tp (role "vocab-table"), and a column candidate whose matmul makes the logits of
a `graph.softmax_cross_entropy` (the LM head) `split(1)` ("vocab-head"), where tp divides the
vocabulary (else they stay replicated). That loss and its gradient are rewritten into the
vocabulary-parallel form of `vocab_parallel.split_cross_entropy`. Heterogeneous groups keep the
vocabulary whole.

**The residual stream (tp > 1, one group).** The activations [batch, sequence, ...] the step
passes into its first function block (after the embeddings) are laid out `split(0)` over dp
and, over tp, replicated, or with `sp=1` (Megatron sequence parallelism) `split(1)`; with sp,
each row-parallel output inside the blocks (after its bias) is `split(1)` too, so its partial
sums are reduce-scattered into the stream, and propagation all-gathers the column-parallel
inputs (see `residual_stream`).

**Uneven pieces (one group of dp and tp).** Where tp does not divide a column-parallel dim or
the head count a column output is reshaped into (`[0,1]: tp=2` over 3 heads), the group is laid
out over its tp sub-groups in uneven pieces (`uneven_tensor_parallel`: 2 heads and 1), the
vocabulary kept whole, and each row-parallel output laid out like the batch.

Bad input: such a dim or head count beside other groups or with pp, sp or ep, or smaller than
tp (a rank would hold nothing), raises one `PassError` naming the parameter, its shape, tp and
the rule; so does a sequence that sp=1 cannot split over tp, or sp=1 on a model without blocks.

**Heterogeneous data parallelism (several groups, HetSeq-style).** With
`[0,1]: dp=2 share=3 | [2]: dp=1 share=1` every group replicates the parameters (a union of
groups each `dup=n_g`, `hetero=dup`); each batch input is split along dim 0 across the groups
by their shares (`hetero=split(0), shares=3:1`: group g gets `apportion(B, shares)[g]` rows)
and within a group over its dp. A group whose rows its dp does not divide (or that gets no
rows) raises one PassError naming the input, its shape, the shares and the rule. The loss is
`sum(per-sample) * (1/B)` with the global B, so each group's partial sum is already weighted by
its share of the samples: summing the groups' partial gradients gives the 1-device gradient.
tp inside groups (`[0,1]: tp=2 share=2 | [2]: tp=1 share=1`): a parameter's layout is the union
of its layout in each group (column weight `split(1)=2` in group 0, whole in group 1;
`hetero=dup`), so its gradient (partial across groups, split in group 0) reaches it by one
`exchange` (see `reshard_plan._exchange`). Pipeline parallelism raises "not supported yet".
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Block, SSAValue
from xdsl.passes import ModulePass
from xdsl.rewriter import Rewriter

from hspmd.dialects import graph
from hspmd.dialects.dist import record_strategy, tp_splits_of, with_layout
from hspmd.dialects.graph.shape import reshape_factors
from hspmd.ir.strategy import (
    Strategy, StrategyError, StrategyGroup, StrategyRecord, even_out_rows, parse_strategy,
)
from hspmd.ir.stacked_names import is_stacked, layer_names, layer_range
from hspmd.ir.layout import DUP, DistributedStates, Group, Layout, LayoutError, apportion, split
from hspmd.transforms.expert_parallel import expert_layout, expert_tp_dims, uneven_experts_layout
from hspmd.transforms import uneven_tensor_parallel as uneven_tp
from hspmd.transforms.pipeline.balance import check_pipeline_layers
from hspmd.transforms.pipeline.virtual import annotation_strategy, check_microbatches
from hspmd.transforms.util import PassError, callee_of, step_function
from hspmd.transforms.vocab_parallel import split_cross_entropy

COLUMN, ROW, COLUMN_BIAS, EXPERT = "column", "row", "column-bias", "expert"
#: an expert weight that tp splits along its input dim 1 (the second expert matmul's); `EXPERT`'s along dim 2
EXPERT_ROW = "expert-row"
EXPERTS = (EXPERT, EXPERT_ROW)
VOCAB_TABLE, VOCAB_HEAD = "vocab-table", "vocab-head"
#: where tp over a count it does not divide is refused, why
UNEVEN_ONLY = (" (uneven pieces are laid out for a strategy of one group of dp and tp only: not beside other "
               "groups, nor with pp, sp or ep)")
#: a tag beside a weight's role: `heads:H`, its output (a row weight: its input) is cut into H heads
HEADS = "heads:"
#: the role of a weight the module's tp plan splits (`dist.TP_SPLIT_ATTR`): `split:D`, along dim D
PLANNED = "split:"


def strategy_group(strategy: Strategy) -> StrategyGroup:
    """Return the one group of `strategy`; raise PassError for what is not supported yet."""
    if len(strategy.groups) != 1:
        raise PassError(
            f"strategy '{strategy}' has {len(strategy.groups)} device groups; "
            "use strategy_layouts for heterogeneous groups (dp only)"
        )
    (group,) = strategy.groups
    if group.pp != 1:
        raise PassError(f"strategy '{strategy}': pipeline parallelism is not supported yet (pp=1)")
    return group


def _check_hetero(strategy: Strategy) -> None:
    for g in strategy.groups:
        if g.pp != 1:
            raise PassError(f"strategy '{strategy}': pipeline parallelism is not supported yet (pp=1)")


def strategy_layouts(strategy: Strategy) -> tuple[Layout, Layout]:
    """Return (replicated parameter layout, batch layout) of a strategy.

    One group: replicated / `split(0)` over dp (and dup over tp). Several groups (dp only):
    every group replicates the parameters (`hetero=dup`); the batch is split along dim 0
    across groups by their shares (`hetero=split(0)`) and within each group over its dp.
    """
    if len(strategy.groups) == 1:
        group = strategy_group(strategy)
        params = Layout.replicated(group.devices)
        batch = Layout.spmd(group.devices, DistributedStates.of((split(0), group.batch_ranks), (DUP, group.tp)))
        return params, batch
    _check_hetero(strategy)
    gs = strategy.groups
    params = hetero_role_layout(strategy, None)
    batch = Layout(tuple(Group(g.devices, DistributedStates.of((split(0), g.batch_ranks), (DUP, g.tp))) for g in gs),
                   split(0), tuple(g.share for g in gs))
    return params, batch


def hetero_role_layout(strategy: Strategy, role: str | None) -> Layout:
    """Return a parameter's layout over several groups: each group's own `role_layout` states, hetero dup."""
    groups = []
    for g in strategy.groups:
        (group,) = role_layout(g, role).groups
        groups.append(Group(g.devices, group.states))
    return Layout(tuple(groups), DUP)


def check_batch_rows(strategy: Strategy, name: str, shape) -> None:
    """Raise PassError unless every group's dp divides the rows `apportion(B, shares)` gives it."""
    shares = tuple(g.share for g in strategy.groups)
    rows = apportion(shape[0], shares)
    for g, r in zip(strategy.groups, rows):
        if r == 0 or r % g.batch_ranks:
            raise PassError(
                f"apply-strategy: input '{name}' of shape {_shape_text(shape)} cannot be split by shares "
                f"{':'.join(map(str, shares))}: its {shape[0]} batch rows are apportioned "
                f"{'+'.join(map(str, rows))} to the groups, and group '{g}' gets {r} rows, which must be "
                f"at least one and divisible by its dp={g.dp}" + (f" times ep={g.ep}" if g.ep > 1 else "")
                + " (each group splits its rows equally over its dp" + (" and ep ranks)" if g.ep > 1 else ")"))


def role_layout(group: StrategyGroup, role: str | None) -> Layout:
    """Return the layout of a parameter with tensor-parallel `role` (None: replicated), or an
    expert weight's (`EXPERT`: split along the expert dim over ep)."""
    if role in EXPERTS:
        return expert_layout(group, 1 if role == EXPERT_ROW else 2)
    dim = {COLUMN: 1, ROW: 0, COLUMN_BIAS: 0, VOCAB_TABLE: 0, VOCAB_HEAD: 1}.get(role)  # type: ignore[arg-type]
    if role is not None and role.startswith(PLANNED):
        dim = int(role[len(PLANNED):])
    if dim is None:
        return Layout.replicated(group.devices)
    return Layout.spmd(group.devices, DistributedStates.of((DUP, group.batch_ranks), (split(dim), group.tp)))


# ----------------------------------------------------------------------------- classification


class _Walk:
    """Classify parameters as column/row-parallel (see the module docstring)."""

    def __init__(self, tp: int, vocab: bool = False, uneven: bool = False) -> None:
        self.tp = tp
        self.vocab = vocab  # also split embedding tables and the LM head over the vocabulary
        self.uneven = uneven  # record head counts tp does not divide (as HEADS tags) instead of raising
        self.callees: dict[str, dict[int, set[str]]] = {}  # callee name -> arg index -> roles
        self.names: dict[Hashable, str] = {}  # key -> a parameter name for messages
        self.row_matmuls: list[graph.MatmulOp] = []  # the row-parallel matmuls met (callees once)

    @staticmethod
    def _through_casts(v: SSAValue) -> SSAValue:
        while isinstance(v.owner, graph.CastOp):
            v = v.owner.input
        return v

    def block_roles(self, block: Block, keys: dict[SSAValue, Hashable], describe) -> dict[Hashable, set[str]]:
        """Return {key: roles} for the parameters of `block` (values in `keys`)."""
        roles: dict[Hashable, set[str]] = {}
        taint: dict[SSAValue, frozenset[Hashable]] = {}
        candidates: dict[Hashable, list[graph.MatmulOp]] = {}
        paired: set[Hashable] = set()

        def key_of(v: SSAValue) -> Hashable | None:
            return keys.get(self._through_casts(v))

        for op in block.ops:
            if isinstance(op, graph.OutputOp) and op.tensor_name.data == "loss":
                break  # the forward ends here: the backward's values would carry one layer's marks into another's
            if isinstance(op, graph.MatmulOp) and len(op.rhs.type.get_shape()) == 2 \
                    and (k := key_of(op.rhs)) is not None:
                sources = taint.get(op.lhs, frozenset())
                if sources:
                    roles.setdefault(k, set()).add(ROW)
                    roles[k].update(t for s in sources for t in roles.get(s, ()) if t.startswith(HEADS))
                    paired.update(sources)
                    self.row_matmuls.append(op)
                else:
                    candidates.setdefault(k, []).append(op)
                    taint[op.result] = frozenset({k})
                continue
            if isinstance(op, (graph.LayerNormOp, graph.RmsNormOp)):
                continue
            if isinstance(op, graph.EmbeddingOp) and self.vocab and (k := key_of(op.table)) is not None \
                    and op.table.type.get_shape()[0] % self.tp == 0:
                roles.setdefault(k, set()).add(VOCAB_TABLE)
                continue
            if isinstance(op, (func.CallOp, graph.ScanOp)):  # a scan's stacked operand: its layers' roles
                callee = callee_of(op)
                inner = self.callee_roles(callee, {i: k for i, v in enumerate(op.operands)
                                                   if (k := key_of(v)) is not None})
                for i, rs in inner.items():
                    if (k := key_of(op.operands[i])) is not None:
                        roles.setdefault(k, set()).update(rs)
                continue
            sources = frozenset().union(*(taint.get(v, frozenset()) for v in op.operands))
            if not sources:
                continue
            for r in op.results:
                taint[r] = sources
            if isinstance(op, graph.ReshapeOp) and (h := self._check_heads(op, sources, describe)):
                for s in sources:
                    roles.setdefault(s, set()).add(f"{HEADS}{h}")
        if self.vocab:
            for head in self.loss_heads(block, candidates):
                if head not in paired:
                    roles.setdefault(head, set()).add(VOCAB_HEAD)
        for k in paired:
            roles.setdefault(k, set()).add(COLUMN)
            for mm in candidates.get(k, []):
                for use in mm.result.uses:
                    add = use.operation
                    if not isinstance(add, graph.AddOp):
                        continue
                    other = add.operands[1 - use.index]
                    if isinstance(other.owner, graph.BroadcastOp):
                        b = key_of(other.owner.input)
                        if b is not None and len(other.owner.input.type.get_shape()) == 1:
                            roles.setdefault(b, set()).add(COLUMN_BIAS)
                            roles[b].update(t for t in roles.get(k, ()) if t.startswith(HEADS))
        return roles

    def loss_heads(self, block: Block, candidates: dict[Hashable, list[graph.MatmulOp]]) -> set[Hashable]:
        """Return the column candidates whose matmul makes the logits of a cross-entropy (through
        casts) and whose class count tp divides: the LM heads a vocabulary split suits."""
        made = {mm.result: k for k, mms in candidates.items() for mm in mms}
        heads = set()
        for op in block.ops:
            if isinstance(op, graph.SoftmaxCrossEntropyOp) and (k := made.get(self._through_casts(op.logits))) \
                    is not None and op.logits.type.get_shape()[-1] % self.tp == 0:
                heads.add(k)
        return heads

    def callee_roles(self, callee: func.FuncOp, arg_keys: dict[int, Hashable]) -> dict[int, set[str]]:
        """Return {argument index: roles} of `callee`'s parameter arguments (once per callee)."""
        name = callee.sym_name.data
        if name not in self.callees:
            self.callees[name] = {}  # a recursive call sees no roles
            args = callee.body.block.args
            keys = {args[i]: i for i in arg_keys if i < len(args)}
            self.callees[name] = self.block_roles(
                callee.body.block, keys, lambda k: self.names.get(arg_keys.get(k), f"argument {k} of @{name}"))
        return self.callees[name]

    def _check_heads(self, op: graph.ReshapeOp, sources, describe) -> int | None:
        """Return the head count a column output's last (split) dim is reshaped into (None: not into heads);
        raise if tp does not divide it, unless uneven pieces are allowed."""
        src, dst = op.input.type.get_shape(), op.result.type.get_shape()
        a, _, extents = reshape_factors(src, dst)
        extent = dict(extents).get(a[-1])
        if extent is not None and extent % self.tp and not self.uneven:
            k = sorted(map(str, sources))[0]
            raise PassError(
                f"apply-strategy: tp={self.tp} does not divide the {extent} heads that the output of "
                f"column-parallel weight {describe(next(s for s in sources if str(s) == k))} is reshaped into "
                f"({_shape_text(src)} -> {_shape_text(dst)}); its output dim is split tp ways, which must "
                f"divide the head count{UNEVEN_ONLY}"
            )
        return extent


def _shape_text(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def tensor_parallel_roles(module: ModuleOp, tp: int, vocab: bool = False) -> dict[str, str]:
    """Return {parameter name: role} for tensor parallelism of `tp`: "column", "row",
    "column-bias", and with `vocab` "vocab-table" (an embedding table) and "vocab-head" (an LM head)."""
    return tensor_parallel_plan(module, tp, vocab)[0]


def tensor_parallel_plan(module: ModuleOp, tp: int, vocab: bool = False,
                         uneven: bool = False) -> tuple[dict[str, str], dict[str, int]]:
    """Return ({parameter name: role}, {parameter name: heads}) for tensor parallelism of `tp`.

    The roles are `tensor_parallel_roles`'; the heads say, for a column weight whose output is
    reshaped into H heads (and its bias, and the row weight its heads feed), H. A head count
    that tp does not divide raises PassError unless `uneven` (uneven pieces are allowed).
    """
    step = step_function(module)
    walk = _Walk(tp, vocab, uneven)
    params = {o.result: o.tensor_name.data for o in step.body.block.ops if isinstance(o, graph.ParameterOp)}
    shapes = {o.tensor_name.data: layer_shape(o) for o in step.body.block.ops if isinstance(o, graph.ParameterOp)}
    walk.names = {n: param_text(n, shapes[n]).replace(" of shape", "") for n in params.values()}
    tagged = walk.block_roles(step.body.block, params, lambda k: walk.names[k])
    roles, heads = {}, {}
    for name, rs in tagged.items():
        plain = {r for r in rs if not r.startswith(HEADS)}
        if len(plain) == 1:
            roles[name] = next(iter(plain))
        counts = sorted(int(r[len(HEADS):]) for r in rs if r.startswith(HEADS))
        if counts:
            heads[name] = counts[0]
    return roles, heads


_RULE = {COLUMN: "column-parallel weight [in, out] is split along its output dim 1",
         ROW: "row-parallel weight [in, out] is split along its input dim 0",
         COLUMN_BIAS: "the bias of a column-parallel weight is split like its output dim",
         VOCAB_TABLE: "an embedding table [V, D] is split along its vocabulary dim 0",
         VOCAB_HEAD: "an LM head [D, V] is split along its vocabulary dim 1",
         EXPERT: "expert weight [E, ...] is split along its expert dim 0",
         EXPERT_ROW: "expert weight [E, ...] is split along its expert dim 0"}


def split_vocabulary_losses(module: ModuleOp, roles: dict[str, str], tp: int) -> int:
    """Rewrite each cross-entropy of the step whose logits a vocab-head matmul makes (through
    casts) into the vocabulary-parallel form (`vocab_parallel`); return how many there were."""
    block = step_function(module).body.block
    heads = {o.result for o in block.ops if isinstance(o, graph.ParameterOp) and roles.get(o.tensor_name.data) == VOCAB_HEAD}
    losses = []
    for o in block.ops:
        if isinstance(o, graph.SoftmaxCrossEntropyOp):
            src = _Walk._through_casts(o.logits)
            if isinstance(src.owner, graph.MatmulOp) and _Walk._through_casts(src.owner.rhs) in heads:
                losses.append(o)
    for o in losses:
        split_cross_entropy(o, tp)
    return len(losses)


def _row_output(mm: graph.MatmulOp) -> SSAValue:
    """Return a row-parallel matmul's output: its result, or `result + broadcast(bias)` after it."""
    uses = list(mm.result.uses)
    if len(uses) == 1 and isinstance(add := uses[0].operation, graph.AddOp):
        other = add.operands[1 - uses[0].index]
        if isinstance(other.owner, graph.BroadcastOp) and len(other.owner.input.type.get_shape()) == 1:
            return add.result
    return mm.result


def residual_stream(module: ModuleOp, group: StrategyGroup) -> int:
    """Lay out the residual stream of a tp > 1 step; return how many values were laid out.

    The residual stream enters the function blocks (transformer layers) as activations
    [batch, sequence, ...] that the step computes from the batch before any block (the first
    block's input, made by the embeddings). Without sp it is replicated over tp (a vocabulary-
    split lookup's partial sums are all-reduced there, once, as Megatron does, rather than
    inside the blocks, which would reduce the saved input again in the backward). With sp=1
    (Megatron-SP) it is split along the sequence, `split(1)` over tp, and so is each row-parallel
    output inside the blocks (its partial sums are reduce-scattered into the stream). Both get
    `split(0)` over dp; what the blocks return, the gradients entering them and everything else
    follow by propagation.
    """
    block = step_function(module).body.block
    batch: set[SSAValue] = set()
    later: set[SSAValue] = set()  # values computed from a block's result
    for o in block.ops:
        if isinstance(o, (func.CallOp, graph.ScanOp)) or any(v in later for v in o.operands):
            later.update(o.results)
        if isinstance(o, graph.InputOp) or any(v in batch for v in o.operands):
            batch.update(o.results)
    batch -= later
    layout = Layout.spmd(group.devices, DistributedStates.of((split(0), group.batch_ranks), (split(1) if group.sp else DUP,
                                                                                     group.tp)))
    seeded: list[SSAValue] = []
    for o in block.ops:
        if not isinstance(o, (func.CallOp, graph.ScanOp)):
            continue
        for v in o.operands:
            shape = v.type.get_shape() if hasattr(v.type, "get_shape") else ()
            if v in batch and len(shape) >= 3 and not isinstance(v.owner, (func.CallOp, graph.ScanOp)) \
                    and v not in seeded:
                if group.sp and shape[1] % group.tp:
                    raise PassError(
                        f"apply-strategy: sp=1 cannot split the residual stream {_shape_text(shape)} (the "
                        f"input of @{callee_of(o).sym_name.data}) along its sequence dim 1 over tp={group.tp}: "
                        f"sequence parallelism splits the sequence over the tp ranks, so tp must divide {shape[1]}")
                seeded.append(v)
    if not group.sp:
        for v in seeded:
            Rewriter.replace_value_with_new_type(v, with_layout(v.type, layout))
        return len(seeded)
    if not seeded:
        raise PassError(
            "apply-strategy: sp=1 found no residual stream: sequence parallelism splits the activations "
            "[batch, sequence, ...] that the step passes into its function blocks (transformer layers), "
            "and this model passes none")
    # Inside the blocks, each row-parallel output (partial sums over tp) joins the residual
    # stream split along the sequence: a reduce-scatter instead of an all-reduce.
    walk = _Walk(group.tp)
    walk.block_roles(block, {o.result: o.tensor_name.data for o in block.ops if isinstance(o, graph.ParameterOp)}, str)
    for mm in walk.row_matmuls:
        out = _row_output(mm)
        if len(out.type.get_shape()) >= 3 and out.type.get_shape()[1] % group.tp == 0 and out not in seeded:
            seeded.append(out)
    for v in seeded:
        Rewriter.replace_value_with_new_type(v, with_layout(v.type, layout))
    return len(seeded)


@dataclass(frozen=True)
class ApplyStrategy(ModulePass):
    """Lay out parameters and inputs as the strategy says."""

    name = "apply-strategy"
    #: the strategy checks: what this pass refuses is the user's input (every pass after it is the
    #: compiler's own: `hspmd.compiler.run_passes` reports its failures as internal errors)
    checks_input = True
    strategy: str = "[0]: dp=1"
    #: micro-batches per step and the pipeline schedule, for a strategy with pp > 1
    microbatches: int = 1
    schedule: str = "gpipe"
    #: the id the strategy is recorded under (a module may carry several)
    id: int = 0

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        try:
            written = parsed = parse_strategy(self.strategy)
            rows = _batch_rows(op)
            # uneven rows inside a group: two even groups (not beside pipelines: their micro-batch
            # and stage checks assume the groups as written)
            if rows is not None and not any(g.pp > 1 for g in parsed.groups):
                parsed = even_out_rows(parsed, rows)
            record = StrategyRecord(self.id, parsed, self.microbatches, self.schedule)
        except StrategyError as err:
            raise PassError(str(err)) from None
        check_microbatches(op, record)
        check_pipeline_layers(list(step_function(op).body.block.ops), record.strategy.groups)
        record_strategy(op, record)
        strategy = annotation_strategy(record)
        try:
            lay_out(op, strategy, uneven=strategy == record.strategy)
        except PassError as err:
            if parsed != written:
                raise PassError(f"{err} (strategy '{written}' splits {rows} rows unevenly over dp, so it runs as "
                                f"'{parsed}')") from None
            if strategy == record.strategy or len(strategy.groups) == 1:
                raise
            raise PassError(f"{err} (strategy '{record.strategy}' is annotated as '{strategy}': a pipelined group "
                            "as one stage, each micro-batch a virtual dp rank)") from None


def _batch_rows(op: ModuleOp) -> int | None:
    """Return the batch rows of the step's inputs (dim 0 of the first that has dims), None without one."""
    for o in step_function(op).body.block.ops:
        if isinstance(o, graph.InputOp) and o.result.type.get_shape():
            return o.result.type.get_shape()[0]
    return None


def lay_out(op: ModuleOp, strategy: Strategy, uneven: bool = False) -> None:
    """Lay out the parameters and inputs of `op`'s step as `strategy` says (a pipeline's stage-shaped one).

    With `uneven`, a group whose tensor-parallel dims tp does not divide is laid out in uneven
    pieces (`uneven_tensor_parallel`); else such a group raises PassError.
    """
    hetero = len(strategy.groups) > 1
    if hetero and any(g.sp for g in strategy.groups):
        raise PassError(f"apply-strategy: strategy '{strategy}': sequence parallelism (sp=1) across several "
                        "device groups is not supported yet; use sp=1 with one group")
    params, batch = strategy_layouts(strategy)
    group = strategy.groups[0] if hetero else strategy_group(strategy)
    leaves = [o for o in step_function(op).body.block.ops if isinstance(o, (graph.ParameterOp, graph.InputOp))]
    roles: dict[str, str] = {}
    uneven = uneven and not hetero and group.sp == 0 and group.ep == 1  # uneven tp pieces: one plain dp/tp group
    planned = tp_splits_of(op)  # a module's own plan (an imported PyTorch model's) instead of the walk
    for tp in sorted({g.tp for g in strategy.groups} - {1}) if not planned else ():  # roles do not depend on tp
        roles, heads = tensor_parallel_plan(op, tp, vocab=not hetero, uneven=uneven)
        group = next(g for g in strategy.groups if g.tp == tp)
        shapes = {o.tensor_name.data: layer_shape(o) for o in leaves if isinstance(o, graph.ParameterOp)}
        if uneven and uneven_tp.needs_uneven(shapes, roles, heads, tp):
            _lay_out_uneven(leaves, group, roles, heads)
            _seed_uneven_row_outputs(op, group)
            return
    if planned:
        roles = {o.tensor_name.data: f"{PLANNED}{planned[layer_names(o.tensor_name.data)[0]]}" for o in leaves
                 if isinstance(o, graph.ParameterOp) and layer_names(o.tensor_name.data)[0] in planned}
    if not hetero and group.tp > 1 and not planned:
        split_vocabulary_losses(op, roles, group.tp)
    if not hetero and group.tp > 1:
        residual_stream(op, group)
    if any(g.ep > 1 for g in strategy.groups) or (hetero and strategy.expert_shares is not None):
        roles.update({name: EXPERT_ROW if dim == 1 else EXPERT for name, dim in expert_tp_dims(op).items()})
    names = {o.tensor_name.data: layer_shape(o) for o in leaves if isinstance(o, graph.ParameterOp)}
    for leaf in leaves:
        name = leaf.tensor_name.data
        shape = layer_shape(leaf) if isinstance(leaf, graph.ParameterOp) else leaf.result.type.get_shape()
        if isinstance(leaf, graph.InputOp):
            layout, kind = (batch if shape else params), "input"
            if hetero and shape:
                check_batch_rows(strategy, name, shape)
            elif shape and group.ep > 1 and shape[0] % group.batch_ranks:  # (uneven rows over dp alone are evened out)
                raise PassError(
                    f"apply-strategy: input '{name}' of shape {_shape_text(shape)} cannot be split over group "
                    f"'{group}': its {shape[0]} batch rows must be divisible by dp={group.dp} times ep={group.ep} "
                    f"= {group.batch_ranks} (expert-parallel ranks take rows of their own, in equal parts)")
        else:
            kind = "parameter"
            role = roles.get(name)
            if role is None and name.startswith("opt."):  # optimizer state follows its parameter
                owner = name.split(".", 2)[-1]
                if names.get(owner) == shape:
                    role = roles.get(owner)
            layout = hetero_role_layout(strategy, role) if hetero else role_layout(group, role)
            if role in EXPERTS and hetero and strategy.expert_shares is not None:
                layout = uneven_experts_layout(strategy, name, shape, 1 if role == EXPERT_ROW else 2)
            if role is not None:
                try:
                    layout.check_shape(shape, f"parameter '{name}'")
                except LayoutError as err:
                    if role in EXPERTS:
                        raise PassError(f"apply-strategy: ep cannot split parameter {param_text(name, shape)}: the "
                                        f"{_RULE[role]} over ep into '{layout}', but "
                                        f"{str(err).rsplit(': ', 1)[-1]}") from None
                    raise PassError(
                        f"apply-strategy: tp={group.tp} cannot split parameter {param_text(name, shape)}: the "
                        f"{_RULE.get(role, 'plan splits it along dim ' + role[len(PLANNED):])} over tp into '{layout}', but "
                        f"{str(err).rsplit(': ', 1)[-1]}{UNEVEN_ONLY}") from None
        try:
            layout.check_shape(shape, f"{kind} '{name}'")
        except LayoutError as err:
            raise PassError(f"apply-strategy: strategy '{strategy}': {err}") from None
        if kind == "parameter" and is_stacked(name):  # each layer laid out as one, the stacking dim whole
            layout = layout.shift_dims(1)
        Rewriter.replace_value_with_new_type(leaf.result, with_layout(leaf.result.type, layout))


def param_text(name: str, shape) -> str:
    """Return how messages name parameter `name` of (per-layer) shape `shape`: `'w' of shape [4, 8]`,
    for a stacked parameter `'blocks.[0:2].w' of shape [4, 8] (each of layers 0 to 1)`, `(each of
    layers 1, 3, ... 47)` for every other layer."""
    text = f"'{name}' of shape {_shape_text(shape)}"
    layers = layer_range(name)
    if layers is None:
        return text
    if isinstance(layers, range) and layers.step == 1:
        return f"{text} (each of layers {layers[0]} to {layers[-1]})"
    return f"{text} (each of layers {layers[0]}, {layers[1]}, ... {layers[-1]})"


def layer_shape(param: graph.ParameterOp) -> tuple[int, ...]:
    """Return the shape of one layer of `param`: its shape, or without the stacking dim where it
    is a stacked parameter (or its optimizer state; `stacked_names`)."""
    shape = param.result.type.get_shape()
    return shape[1:] if is_stacked(param.tensor_name.data) else shape


def _lay_out_uneven(leaves, group: StrategyGroup, roles: dict[str, str], heads: dict[str, int]) -> None:
    """Lay out `leaves` over the tp sub-groups of `group` in uneven pieces (`uneven_tensor_parallel`);
    the vocabulary stays whole, as beside other groups. A stacked parameter's layers are laid out
    each as one (its stacking dim whole)."""
    params = {o.tensor_name.data: layer_shape(o) for o in leaves if isinstance(o, graph.ParameterOp)}
    for leaf in leaves:
        name = leaf.tensor_name.data
        shape = layer_shape(leaf) if isinstance(leaf, graph.ParameterOp) else leaf.result.type.get_shape()
        if isinstance(leaf, graph.InputOp):
            kind = "input"
            layout = uneven_tp.batch_layout(group) if shape else uneven_tp.replicated_layout(group)
        else:
            kind, owner = "parameter", name
            if name not in roles and name.startswith("opt.") and params.get(name.split(".", 2)[-1]) == shape:
                owner = name.split(".", 2)[-1]  # optimizer state follows its parameter
            role = roles.get(owner)
            if role not in uneven_tp.SPLIT_DIM:
                layout = uneven_tp.replicated_layout(group)
            else:
                shares = uneven_tp.weight_shares(owner, heads, group.tp)
                dim = uneven_tp.SPLIT_DIM[role]
                if heads.get(owner, group.tp) < group.tp or shape[dim] < group.tp:
                    what = (f"its {heads[owner]} heads leave" if heads.get(owner, group.tp) < group.tp
                            else f"its dim {dim} of size {shape[dim]} leaves")
                    raise PassError(
                        f"apply-strategy: tp={group.tp} cannot split parameter {param_text(name, shape)}: "
                        f"the {_RULE[role]} over tp, and {what} a tp rank with nothing; use tp <= "
                        f"{heads.get(owner, shape[dim])}")
                layout = uneven_tp.weight_layout(group, role, shares)
        if kind == "parameter" and is_stacked(name):
            layout, shape = layout.shift_dims(1), leaf.result.type.get_shape()
        try:
            layout.check_shape(shape, f"{kind} '{name}'")
        except LayoutError as err:
            raise PassError(str(err)) from None
        Rewriter.replace_value_with_new_type(leaf.result, with_layout(leaf.result.type, layout))


def _seed_uneven_row_outputs(op: ModuleOp, group: StrategyGroup) -> None:
    """Lay each row-parallel output (after its bias) whose dim 0 is the batch out as the batch is
    under uneven tp: its partial sums across the tp sub-groups are then all-reduced into rows
    split over dp, as the even case keeps them (left to propagation, the bias add would take the
    replicated bias's layout and gather the rows over dp, to cut them again after)."""
    rows = _batch_rows(op)
    block = step_function(op).body.block
    walk = _Walk(group.tp, uneven=True)
    walk.block_roles(block, {o.result: o.tensor_name.data for o in block.ops if isinstance(o, graph.ParameterOp)}, str)
    layout = uneven_tp.batch_layout(group)
    for mm in walk.row_matmuls:
        out = _row_output(mm)
        shape = out.type.get_shape()
        if len(shape) >= 2 and shape[0] == rows and rows % group.batch_ranks == 0:
            Rewriter.replace_value_with_new_type(out, with_layout(out.type, layout))
