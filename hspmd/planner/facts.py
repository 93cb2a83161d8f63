"""What a strategy's cost is made of, read once from the IR of a few probe compiles of a script.

`model_facts(script, max_devices)` traces the script's training step once, then lays it out
under a handful of probe strategies and reads their physical IR:

* `[0]: dp=1`: matmul FLOPs (callees counted per call), the bytes that the other ops write
  (the optimizer's update ops apart: they scale with the parameters, not with the batch), the
  parameter and optimizer-state bytes, and the one device's planned peak memory, whose rest
  (peak minus parameters, states and inputs) is the activation memory of the whole batch;
* `[0,1]: tp=2`: the operand bytes and the number of the collectives tensor parallelism adds
  per step (activations: they scale with the rows a rank computes);
* `[0,1]: tp=2` and `[0,1]: tp=2 sp=1` again, for what one rank runs (`TensorParallelFacts`):
  the non-matmul bytes, activation memory and kernels tensor parallelism does not split
  (without sequence parallelism, the residual stream's), and its collectives by kind;
* `[0,1]: dp=2`: the gradient all-reduces its schedule runs blocking and those it buckets
  (`DataParallelSync`: a model whose optimizer reads each gradient as soon as it is summed
  gets no buckets, so nothing overlaps);
* `[0,1]: ep=2`, for a model with expert layers: the expert weights' bytes and the all-to-alls
  and gradient sums of one rank (`ExpertParallelFacts`);
* `[0,1]: pp=2`: the bytes a stage sends to the next per step;
* `[0]: dp=1 recompute=block` and `recompute=selective` (a model with layer functions): the matmul
  FLOPs and activation memory of the step that recomputes (`ModelFacts.recompute`);
* `tp=4`, `tp=8` (up to `max_devices`) annotated only, to learn which tp degrees the model's
  shapes allow (heads, hidden sizes, vocabulary) and how unevenly each splits the weights (a
  degree that does not divide a head count or width is allowed if every rank gets a piece:
  `tp_imbalance`, the busiest rank's share over 1/tp).

Everything is per step for the script's whole batch; `cost.group_cost` scales it to the rows,
degrees and micro-batches of a candidate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp

from hspmd.codegen.report import call_counts, collective_report, tensor_nbytes
from hspmd.codegen.schedule import build_schedule
from hspmd.codegen.schedule.analysis import op_matmul_flops
from hspmd.codegen.schedule.flatten import flatten
from hspmd.compiler import annotate, loss_scale, run_passes, script_optimizer, to_physical, trace_script, training_passes
from hspmd.dialects import graph
from hspmd.dialects.dist import layout_of
from hspmd.dialects.levels import physical_groups, verify_logical
from hspmd.frontend.script import ModelScript
from hspmd.ir.strategy import StrategyRecord, parse_strategy
from hspmd.transforms.util import PassError

__all__ = ["DataParallelSync", "ExpertParallelFacts", "ModelFacts", "TensorParallelFacts", "model_facts"]

#: the tp degrees the planner considers (beyond 8, tensor parallelism rarely pays off)
TP_DEGREES = (2, 4, 8)
#: the prefix of optimizer-state parameters
STATE_PREFIX = "opt."


@dataclass(frozen=True)
class ModelFacts:
    """Per step, for the script's whole batch (see the module docstring)."""

    rows: int  # batch rows per step
    layers: int  # repeated blocks (1 when the model has none)
    matmul_flops: float
    matmul_calls: int  # matmuls per step: their mean size picks the rate from a profile
    activation_bytes_written: float  # bytes the non-matmul ops write (batch-proportional)
    update_bytes_written: float  # bytes the optimizer's update ops write (parameter-proportional)
    param_bytes: int  # trainable parameters (= gradient bytes)
    state_bytes: int  # optimizer states
    activation_bytes: int  # one device's planned peak less parameters, states and inputs
    tp_degrees: tuple[int, ...]  # tp degrees whose layouts fit the model (1 first)
    tp_bytes: float  # operand bytes of the collectives tp=2 adds
    tp_calls: int  # how many of them
    pp_bytes: float  # bytes a stage sends to the next (tp=1, one micro-batch)
    max_pp: int  # the most pipeline stages the model can be cut into (1: none)
    ops: int = 0  # kernels one device runs per step (each costs a launch, whatever its size)
    param_tensors: int = 1  # trainable parameters (ZeRO syncs each one with its own collectives)
    #: per degree of `tp_degrees`, how much more than 1/tp of the tp-split weights the busiest tp
    #: rank holds (1.0 where tp divides every split dim; 3 heads over tp=2: 4/3); () means all even
    tp_imbalance: tuple[float, ...] = ()
    # what one rank of `[0,1]: tp=2` runs (its part of the whole batch), and of `[0,1]: tp=2 sp=1`
    # (`sp` is None when the model cannot run sequence parallelism): see `TensorParallelFacts`
    tp: TensorParallelFacts | None = None
    sp: TensorParallelFacts | None = None
    # the gradient sums of `[0,1]: dp=2` as its schedule runs them: blocking all-reduces
    # (bytes per call, calls) and bucketed, overlapped ones (bytes of each bucket); None: not read
    dp_sync: DataParallelSync | None = None
    # a mixture-of-experts model's expert parallelism (`[0,1]: ep=2`); None: no expert layers
    ep: ExpertParallelFacts | None = None
    #: per recompute mode the one device's step runs ("block", "selective"): its matmul FLOPs and its
    #: activation memory over those without recompute (the FLOPs grow, the memory shrinks); empty
    #: where the model has no layer functions to recompute
    recompute: tuple[tuple[str, float, float], ...] = ()

    def recompute_ratios(self, mode: str) -> tuple[float, float] | None:
        """Return (FLOPs, activation memory) of the step recomputing in `mode` over those without, or None."""
        return next(((grow, shrink) for m, grow, shrink in self.recompute if m == mode), None)

    @property
    def recompute_modes(self) -> tuple[str, ...]:
        """Return the recompute modes that change this model's step."""
        return tuple(m for m, _, _ in self.recompute)

    def tp_busiest(self, tp: int) -> float:
        """Return the busiest tp rank's work over an even 1/tp share (1.0 when tp divides the model's dims)."""
        if tp in self.tp_degrees and len(self.tp_imbalance) == len(self.tp_degrees):
            return self.tp_imbalance[self.tp_degrees.index(tp)]
        return 1.0

    def mean_matmul_flops(self) -> float:
        """Return the FLOPs of an average matmul of the whole batch."""
        return self.matmul_flops / max(1, self.matmul_calls)


@dataclass(frozen=True)
class TensorParallelFacts:
    """One rank of a tp=2 probe (with or without sequence parallelism), for the whole batch.

    A tp=t rank runs the part of the non-matmul work and activation memory that tensor
    parallelism splits over t and all of the part it replicates (without sp: the layer norms,
    residual adds and dropout of the residual stream); with one device's and one tp=2 rank's
    amounts the two parts are known: split = 2 (one - tp2), replicated = one - split
    (`per_rank`).
    """

    activation_bytes_written: float  # bytes its non-matmul, non-optimizer ops write
    activation_bytes: int  # its planned peak less parameters, states and inputs
    ops: int  # kernels it runs per step (collectives apart)
    collectives: tuple[tuple[str, float, int], ...]  # (kind, bytes per call, calls) of the collectives it runs
    steps: int = 0  # the other steps of its plan (bucket starts and waits, polls): each costs a dispatch

    @staticmethod
    def per_rank(one: float, two: float, t: int) -> float:
        """Return a tp=`t` rank's amount from one device's (`one`) and a tp=2 rank's (`two`)."""
        split = min(max(2.0 * (one - two), 0.0), one)
        return (one - split) + split / t


@dataclass(frozen=True)
class DataParallelSync:
    """The gradient sums one rank of `[0,1]: dp=2` runs per step, as its schedule has them
    (`build_schedule`: an all-reduce read right after it is made stays blocking, several such
    in a row are summed in one blocking (coalesced) bucket; others share buckets that overlap
    the backward)."""

    blocking_bytes: float  # bytes of the blocking all-reduces over the dp pair, together
    blocking_calls: int  # blocking collectives: a coalesced bucket counts as one
    bucket_bytes: tuple[int, ...]  # bytes of each bucket that overlaps


@dataclass(frozen=True)
class ExpertParallelFacts:
    """What expert parallelism changes, read from one device and one rank of `[0,1]: ep=2`.

    ep ranks split the batch as dp ranks do and the expert weights along the expert dim, so
    a rank computes what a dp rank would (its experts for every token of its ep group), holds
    1/ep of the experts, moves tokens to the experts and back by all-to-alls, and sums the
    other parameters' gradients over dp*ep ranks but the experts' over dp only.
    """

    experts: int  # experts per layer (an ep degree divides it)
    expert_param_bytes: int  # the expert weights (gradients alike), whole
    expert_tensors: int  # how many expert weights (each summed over dp with its own all-reduce)
    all_to_all: tuple[float, int]  # (bytes per call, calls) of an ep=2 rank: half the batch
    sync: DataParallelSync  # the gradient sums of an ep=2 rank (the non-expert parameters)


def _expert_weights(fn: func.FuncOp) -> list[tuple[int, ...]]:
    """Return the shapes of the expert weights of a one-device step: the right operands of
    `graph.expert_matmul` that are parameters [E, k, n] (looked up through calls)."""
    shapes = set()
    for op in fn.parent_op().walk():
        if isinstance(op, graph.ExpertMatmulOp):
            t = op.operands[1].type
            shapes.add(tuple(t.get_shape()))  # type: ignore[attr-defined]
    params = [tuple(op.result.type.get_shape()) for op in fn.walk()  # type: ignore[attr-defined]
              if isinstance(op, graph.ParameterOp) and not op.tensor_name.data.startswith(STATE_PREFIX)]
    return [p for p in params if p in shapes and len(p) == 3]


def _expert_parallel(logical: ModuleOp, one: dict, one_physical: ModuleOp) -> ExpertParallelFacts | None:
    weights = _expert_weights(_step_fn(one_physical))
    if not weights:
        return None
    experts = weights[0][0]
    try:
        physical = to_physical(_layout(logical, "[0,1]: ep=2"))
    except PassError:
        return None
    rank = _one_device(physical)
    by_kind = {k: (b, c) for k, b, c in _collectives_by_kind(physical)}
    return ExpertParallelFacts(experts, 2 * (one["params"] - rank["params"]), len(weights),
                               by_kind.get("all_to_all", (0.0, 0)), _dp_sync(physical))


def _dp_sync(physical: ModuleOp) -> DataParallelSync:
    schedule = build_schedule(_step_fn(physical), 0)
    blocking = [tensor_nbytes(s.op.operands[0].type) for s in schedule.steps
                if s.kind == "op" and s.op is not None and s.op.name == "comm.all_reduce"]
    blocking += [b.nbytes() for b in schedule.buckets if b.blocking]
    return DataParallelSync(float(sum(blocking)), len(blocking),
                            tuple(b.nbytes() for b in schedule.buckets if not b.blocking))


def _step_fn(module: ModuleOp) -> func.FuncOp:
    (_, group), *_ = physical_groups(module)
    return next(op for op in group.body.block.ops if isinstance(op, func.FuncOp) and op.sym_name.data == "train_step")


def _layout(logical: ModuleOp, strategy: str) -> ModuleOp:
    return annotate(logical.clone(), StrategyRecord(0, parse_strategy(strategy), 1, "gpipe"))


def _one_device(physical: ModuleOp) -> dict:
    fn = _step_fn(physical)
    flops = calls = ops = 0
    act = upd = 0.0
    for node in flatten(fn).nodes:
        op = node.op
        if op is None or op.name.startswith(("comm.", "func.", "pipeline.")):
            continue
        ops += 1
        mm = op_matmul_flops(op)
        if mm:
            flops += mm
            calls += 1
        else:
            written = sum(tensor_nbytes(r.type) for r in op.results)
            if op.name.startswith("optim."):
                upd += written
            else:
                act += written
    params = states = inputs = tensors = 0
    for op in fn.walk():
        if isinstance(op, graph.ParameterOp):
            if op.tensor_name.data.startswith(STATE_PREFIX):
                states += tensor_nbytes(op.result.type)
            else:
                params += tensor_nbytes(op.result.type)
                tensors += 1
        elif isinstance(op, graph.InputOp):
            inputs += tensor_nbytes(op.result.type)
    peak = build_schedule(fn, 0).peak_bytes
    counts = call_counts(fn.parent_op())
    layers = max((c for name, c in counts.items() if name != "train_step"), default=1) or 1
    return {"flops": flops, "calls": calls, "act": act, "upd": upd, "params": params, "states": states,
            "activations": max(0, peak - params - states - inputs), "layers": layers, "ops": ops,
            "tensors": tensors}


def _collectives(physical: ModuleOp, ops: tuple[str, ...]) -> tuple[float, int]:
    """Return (operand bytes, calls) per step of the `ops` collectives rank 0 takes part in."""
    total, calls = 0.0, 0
    for row in collective_report(physical):
        if 0 in row.devices and row.op in ops:
            item = 2 if row.element_type in ("f16", "bf16") else 8 if row.element_type in ("f64", "i64") else 4
            total += float(np.prod(row.shape, dtype=np.int64)) * item * row.calls
            calls += row.calls
    return total, calls


_KINDS = {"comm.all_reduce": "all_reduce", "comm.all_gather": "all_gather", "comm.reduce_scatter": "reduce_scatter",
          "comm.all_to_all": "all_to_all"}


def _collectives_by_kind(physical: ModuleOp) -> tuple[tuple[str, float, int], ...]:
    """Return (kind, mean bytes per call, calls) per step of the collectives rank 0 runs; bytes
    are the operand's (all_gather: the result's), as `DeviceProfile.time` takes them."""
    total: dict[str, list[float]] = {}
    for row in collective_report(physical):
        kind = _KINDS.get(row.op)
        if kind is None or 0 not in row.devices or not any(0 in g for g in row.groups):
            continue
        item = 2 if row.element_type in ("f16", "bf16") else 8 if row.element_type in ("f64", "i64") else 4
        shape = row.result_shape if kind == "all_gather" else row.shape
        acc = total.setdefault(kind, [0.0, 0])
        acc[0] += float(np.prod(shape, dtype=np.int64)) * item * row.calls
        acc[1] += row.calls
    return tuple((k, b / c, int(c)) for k, (b, c) in sorted(total.items()) if c)


def _tensor_parallel(physical: ModuleOp) -> TensorParallelFacts:
    rank = _one_device(physical)
    schedule = build_schedule(_step_fn(physical), 0)
    steps = sum(1 for s in schedule.steps if s.kind in ("poll", "bucket-start", "bucket-wait"))
    return TensorParallelFacts(rank["act"], rank["activations"], rank["ops"], _collectives_by_kind(physical), steps)


def _tp_imbalance(annotated: ModuleOp, tp: int) -> float:
    """Return the busiest tp rank's share of the tp-split weights times tp (weighted by size):
    1.0 where tp divides every split dim; above 1 where weights lie in uneven pieces across tp
    sub-groups (`hetero=split`, `transforms/uneven_tensor_parallel.py`)."""
    total = busiest = 0.0
    for op in annotated.walk():
        if not isinstance(op, graph.ParameterOp) or (lay := layout_of(op.result)) is None:
            continue
        shape = tuple(op.result.type.get_shape())
        if len(lay.groups) < 2 or lay.hetero.kind != "split" or not shape:
            continue
        dim, size = lay.hetero.dim, float(np.prod(shape))
        total += size
        busiest += size * tp * max(lay.group_shape(g, shape)[dim] for g in range(len(lay.groups))) / shape[dim]
    return busiest / total if total else 1.0


def model_facts(script: ModelScript, max_devices: int) -> ModelFacts:
    """Return the facts of `script` the planner prices candidates with (the module docstring).

    Raises the compiler's errors (`PassError`, `ScriptError`, ...) when the script itself does not
    compile on one device.
    """
    first = next(script.batches(shapes_only=True))
    rows = int(np.shape(next(iter(first.values())))[0])
    logical = trace_script(script)
    run_passes(logical, training_passes(script_optimizer(script), loss_scale(script)))
    verify_logical(logical)
    one_physical = to_physical(_layout(logical, "[0]: dp=1"))
    one = _one_device(one_physical)
    tp_degrees, tp_bytes, tp_calls, tp_imbalance = [1], 0.0, 0, [1.0]
    tp_facts = sp_facts = None
    for t in TP_DEGREES:
        if t > max_devices:
            break
        try:
            annotated = _layout(logical, f"[0-{t - 1}]: tp={t}")
        except PassError:
            break
        tp_degrees.append(t)
        tp_imbalance.append(_tp_imbalance(annotated, t))
        if t == 2:
            physical = to_physical(annotated)
            tp_bytes, tp_calls = _collectives(physical, ("comm.all_reduce", "comm.all_gather",
                                                         "comm.reduce_scatter", "comm.all_to_all"))
            tp_facts = _tensor_parallel(physical)
            try:
                sp_facts = _tensor_parallel(to_physical(_layout(logical, "[0,1]: tp=2 sp=1")))
            except PassError:
                sp_facts = None  # no function blocks, or a sequence tp does not divide
    dp_sync = _dp_sync(to_physical(_layout(logical, "[0,1]: dp=2"))) if max_devices >= 2 else None
    ep_facts = _expert_parallel(logical, one, one_physical) if max_devices >= 2 else None
    pp_bytes, max_pp = 0.0, 1
    if max_devices >= 2:
        try:
            pp_bytes, _ = _collectives(to_physical(_layout(logical, "[0,1]: pp=2")), ("comm.send",))
            max_pp = one["layers"] if one["layers"] > 1 else 2
        except PassError:
            pass
    return ModelFacts(rows, one["layers"], float(one["flops"]), one["calls"], one["act"], one["upd"],
                      one["params"], one["states"], one["activations"], tuple(tp_degrees), tp_bytes, tp_calls,
                      pp_bytes, max_pp, one["ops"], one["tensors"], tuple(tp_imbalance), tp_facts, sp_facts, dp_sync,
                      ep_facts, _recompute(script, one))


def _recompute(script: ModelScript, one: dict) -> tuple[tuple[str, float, float], ...]:
    """Return (mode, matmul FLOPs, activation bytes) of the one-device step under each recompute
    mode that changes it, over those of `one` (the step without recompute) (the probe `[0]: dp=1 recompute=MODE`, traced again: recompute is decided
    at autodiff)."""
    if one["layers"] <= 1:
        return ()
    out = []
    for mode in ("block", "selective"):
        logical = trace_script(script)
        run_passes(logical, training_passes(script_optimizer(script), loss_scale(script), recompute=mode))
        probe = _one_device(to_physical(_layout(logical, f"[0]: dp=1 recompute={mode}")))
        if probe["flops"] != one["flops"] or probe["activations"] != one["activations"]:
            out.append((mode, probe["flops"] / max(1, one["flops"]), probe["activations"] / max(1, one["activations"])))
    return tuple(out)
