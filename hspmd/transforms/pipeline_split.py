"""`pipeline-split`: one device's physical training step -> one program per pipeline stage.

`pipeline-split{devices="0,1"}` takes the physical IR of a one-device group (what
`specialize-groups,lower-reshard` make of `[d]: dp=1`) and replaces it by one group module
per stage, stage `s` on `devices[s]`, each with its own `@train_step`. Every op of the step
goes to one stage:

* **layers**: the forward `func.call`s of `*_fwd` block functions, in order (a model without
  block calls: the parameter name prefixes, `layers.0.weight` -> `layers.0`); layer k of n goes
  to stage `k * pp // n` (contiguous ranges, balanced by count), and the parameters it reads
  with it. Fewer layers than stages is refused with one message naming both numbers.
* **forward** ops (up to `graph.output "loss"`): the last stage among their operands and the
  parameters they read (a parameter no layer claims goes to its first forward user's stage:
  the embedding to stage 0, the head to the last);
* **backward and update** ops: the stage of a parameter they read; else the one stage all
  their operands come from; else the first stage among their users (so an activation's
  gradient is computed where its layer lives); `graph.assign` with its parameter; optimizer
  state `opt.<kind>.NAME` with parameter NAME;
* **free** values (constants, inputs, scalar optimizer state like `opt.step`, and ops of only
  those) belong to no stage: each stage that needs one computes its own copy (and updates its
  own copy of `opt.step`).

A value used on another stage than its producer's is sent with `comm.send` right after it is
made and received with `comm.recv` at the same place of the consumer's program. Every stage's
program is a subsequence of the one-device step, send and receive sitting at the same position,
so the blocking point-to-point messages are matched in one global order: no deadlock, and every
stage computes exactly the numbers of the one-device step. `graph.output "loss"` is on every
stage (the loss is sent to the others). The group modules carry `hspmd.pipeline_stage`.

**Micro-batches** (`microbatches=m` > 1): the input is then the physical IR of `[0..m-1]: dp=m`,
one virtual device per micro-batch, so every op already has micro-batch shapes and the
`comm.all_reduce`s over the group mark exactly where micro-batches meet (the gradients, the
loss). Ops that depend on a batch input run once per micro-batch (batch input `x` becomes
inputs `x@mb0` ... `x@mb{m-1}`, which the worker cuts from the global batch); each all-reduce
becomes a sum of the m micro-batch values, left to right like the all-reduce it replaces;
ops after it (the update) run once. The order of the micro-batches is the `schedule`'s
(`hspmd.runtime.schedule_pipeline`, checked complete and runnable): the program is unrolled
in its order, forward ops of micro-batch i for action ("F", i), backward ops for ("B", i). All
stages walk one global sequence of actions, so a schedule must give every stage the same order
(GPipe); 1F1B, whose stages differ, is refused with a message (it needs paired send/receive).
The module carries `hspmd.microbatches`. Other collectives in the input are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerAttr, ModuleOp, StringAttr, TensorType, i64
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass

from hspmd.dialects import comm, graph
from hspmd.dialects.dist import layout_of, with_layout
from hspmd.ir.layout import Layout
from hspmd.ir.levels import DEVICES_ATTR, devices_attr, physical_groups
from hspmd.runtime.schedule_pipeline import SCHEDULES, PipelineScheduleError, check_schedule
from hspmd.transforms.util import PassError

STAGE_ATTR = "hspmd.pipeline_stage"
MICROBATCHES_ATTR = "hspmd.microbatches"


def parse_devices(text: str) -> tuple[int, ...]:
    try:
        devices = tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError:
        raise PassError(f"pipeline-split: devices '{text}' is not a comma-separated list of device numbers") from None
    if len(devices) < 2 or len(set(devices)) != len(devices):
        raise PassError(f"pipeline-split: devices '{text}' must name at least 2 distinct devices (one per stage)")
    return devices


def _layers(ops: list[Operation], forward_end: int) -> tuple[list[list[Operation]], dict[str, int], str]:
    """Return (layer -> forward ops that are the layer, parameter name -> layer, what a layer is)."""
    calls = [op for op in ops[:forward_end] if isinstance(op, func.CallOp)
             and op.callee.root_reference.data.endswith("_fwd")]
    params: dict[str, int] = {}
    if calls:
        for k, call in enumerate(calls):
            for v in call.operands:
                if isinstance(v.owner, graph.ParameterOp):
                    params.setdefault(v.owner.tensor_name.data, k)
        return [[c] for c in calls], params, "block calls"
    prefixes: list[str] = []
    for op in ops[:forward_end]:
        if isinstance(op, graph.ParameterOp) and any(u.operation in ops[:forward_end] for u in op.result.uses):
            name = op.tensor_name.data
            prefix = name.rsplit(".", 1)[0] if "." in name else name
            if prefix not in prefixes:
                prefixes.append(prefix)
            params[name] = prefixes.index(prefix)
    return [[] for _ in prefixes], params, "parameter groups"


@dataclass(frozen=True)
class PipelineSplit(ModulePass):
    """Split a one-device physical step into one group module per pipeline stage."""

    name = "pipeline-split"

    devices: str = "0,1"
    microbatches: int = 1
    schedule: str = "gpipe"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        devices = parse_devices(self.devices)
        pp = len(devices)
        groups = physical_groups(op)
        m = self.microbatches
        if m < 1:
            raise PassError(f"pipeline-split: microbatches={m}; it must be >= 1")
        schedule = SCHEDULES.get(self.schedule)
        if schedule is None:
            raise PassError(f"pipeline-split: unknown schedule '{self.schedule}' (known: {', '.join(SCHEDULES)})")
        if len(groups) != 1 or len(groups[0][0]) != m:
            raise PassError(f"pipeline-split: the input must be the physical IR of one group of {m} devices, "
                            "one per micro-batch (`[0-{m-1}]: dp={m}` before the split) "
                            f"(it has groups {[list(g) for g, _ in groups]}); pipeline stages with dp or tp "
                            "inside are not supported yet")
        (virtual, group), = groups
        functions = [f for f in group.body.block.ops if isinstance(f, func.FuncOp)]
        step = next((f for f in functions if f.sym_name.data == "train_step"), None)
        if step is None:
            raise PassError("pipeline-split: the group has no @train_step")
        ops = [o for o in step.body.block.ops if not isinstance(o, func.ReturnOp)]
        for o in ops:
            if o.dialect_name() == "comm" and not (isinstance(o, comm.AllReduceOp) and
                                                    set(o.rank_groups[0]) == set(virtual)):
                raise PassError(f"pipeline-split: '{o.name}' over {list(map(list, o.rank_groups))}: only "
                                "all-reduces over all micro-batches are supported in a pipelined step")
        plan = schedule(pp, m)
        try:
            check_schedule(plan, m)
        except PipelineScheduleError as err:
            raise PassError(f"pipeline-split: schedule '{self.schedule}': {err}") from None
        if any(acts != plan[0] for acts in plan):
            raise PassError(f"pipeline-split: schedule '{self.schedule}' runs the micro-batches in a different "
                            "order on each stage; that needs paired send/receive (not supported yet): use gpipe")
        blocks = plan[0]
        stages = _assign(ops, pp)
        modules = []
        for s, dev in enumerate(devices):
            body = _emit(ops, stages, s, devices, blocks, m)
            fn = func.FuncOp("train_step", ((), ()))
            fn.body.block.add_ops([*body, func.ReturnOp()])
            others = [f.clone() for f in functions if f is not step]
            module = ModuleOp([fn, *others], attributes={DEVICES_ATTR: devices_attr((dev,)),
                                                        STAGE_ATTR: IntegerAttr(s, i64),
                                                        MICROBATCHES_ATTR: IntegerAttr(m, i64)})
            module.sym_name = StringAttr(f"group{s}")
            modules.append(module)
        if op is group:
            raise PassError("pipeline-split: the physical module must hold its group module (run specialize-groups)")
        group.detach()
        group.erase()
        for m in modules:
            op.body.block.add_op(m)


FREE = -1


def _assign(ops: list[Operation], pp: int) -> dict[Operation, int]:
    """Return op -> stage (FREE for ops every stage may compute itself); see the module docstring."""
    forward_end = next((i + 1 for i, o in enumerate(ops) if isinstance(o, graph.OutputOp)
                        and o.tensor_name.data == "loss"), None)
    if forward_end is None:
        raise PassError("pipeline-split: the step has no graph.output \"loss\" (the end of the forward)")
    layers, layer_of_param, what = _layers(ops, forward_end)
    n = len(layers)
    if n < pp:
        raise PassError(f"pipeline-split: pp={pp} stages need at least {pp} layers, but the model has {n} layers "
                        f"({what}); use pp <= {n}")
    stage_of_layer = [k * pp // n for k in range(n)]
    param_stage: dict[str, int] = {name: stage_of_layer[k] for name, k in layer_of_param.items()}
    layer_ops = {o: stage_of_layer[k] for k, group in enumerate(layers) for o in group}
    stage: dict[Operation, int] = {}
    value_stage = lambda v: stage.get(v.owner, FREE) if isinstance(v.owner, Operation) else FREE  # noqa: E731

    def param_name(o: Operation) -> str | None:
        return o.tensor_name.data if isinstance(o, graph.ParameterOp) else None

    def owner_of_state(name: str) -> int | None:
        if name in param_stage:
            return param_stage[name]
        if name.startswith("opt.") and name.count(".") >= 2:
            return param_stage.get(name.split(".", 2)[2])
        return None

    undecided: list[Operation] = []
    for i, o in enumerate(ops):
        if isinstance(o, graph.ParameterOp):
            continue  # decided below, when a user settles it
        if isinstance(o, graph.AssignOp):
            s = owner_of_state(o.tensor_name.data)
            stage[o] = FREE if s is None else s
            continue
        if isinstance(o, graph.OutputOp):
            stage[o] = FREE if o.tensor_name.data == "loss" else value_stage(o.value)
            continue
        forward = i < forward_end
        params = [v.owner for v in o.operands if isinstance(v.owner, graph.ParameterOp)]
        pinned = [s for p in params if (s := owner_of_state(param_name(p))) is not None]
        others = {value_stage(v) for v in o.operands if not isinstance(v.owner, graph.ParameterOp)} - {FREE}
        if o in layer_ops:
            s = layer_ops[o]
        elif forward:
            s = max([*pinned, *others], default=None)
            if s is None and params:
                s = 0
            unclaimed = [p for p in params if owner_of_state(param_name(p)) is None]
            if s is not None:
                for p in unclaimed:
                    param_stage.setdefault(param_name(p), s)
        elif pinned:
            s = max(pinned)
        elif -2 in others:
            undecided.append(o)
            stage[o] = -2
            continue
        elif len(others) == 1:
            s = next(iter(others))
        elif not others:
            s = None  # free
        else:
            undecided.append(o)
            stage[o] = -2  # not FREE: decided in the reverse pass
            continue
        stage[o] = FREE if s is None else s
    for o in reversed(undecided):
        users = {stage[u.operation] for r in o.results for u in r.uses
                 if u.operation in stage and not isinstance(u.operation, graph.OutputOp)} - {FREE, -2}
        if users:
            stage[o] = min(users)
        else:
            stage[o] = max(value_stage(v) for v in o.operands)
    for o in ops:
        if isinstance(o, graph.ParameterOp):
            s = owner_of_state(o.tensor_name.data)
            stage[o] = FREE if s is None else s
        elif isinstance(o, graph.OutputOp) and o.tensor_name.data != "loss":
            stage[o] = max(value_stage(o.value), 0)
    return stage


def _kinds(ops: list[Operation]) -> dict[Operation, str]:
    """Return op -> "mb" (runs once per micro-batch: it depends on a batch input), "post" (after
    the accumulation: it depends on an all-reduce over the micro-batches) or "step" (once)."""
    kind: dict[Operation, str] = {}
    for o in ops:
        if isinstance(o, comm.AllReduceOp):
            kind[o] = "post"
        elif isinstance(o, graph.InputOp):
            kind[o] = "mb" if o.properties["global_type"].get_shape() != o.result.type.get_shape() else "step"
        else:
            ks = {kind.get(v.owner, "step") for v in o.operands}
            kind[o] = "post" if "post" in ks else "mb" if "mb" in ks else "step"
            if kind[o] == "mb" and isinstance(o, (graph.AssignOp, graph.OutputOp)):
                raise PassError(f"pipeline-split: '{o.name}' \"{o.tensor_name.data}\" would be one value per "
                                "micro-batch; only values summed over the micro-batches can be outputs or assigned")
    return kind


def _emit(ops: list[Operation], stages: dict[Operation, int], s: int, devices: tuple[int, ...],
          blocks: list[tuple[str, int]], microbatches: int) -> list[Operation]:
    """Return the ops of stage `s`'s step: its ops (once per micro-batch where they depend on the
    batch, in the order of `blocks`), copies of free ops it needs, sends and receives, the sums
    over micro-batches (in place of the all-reduces of the one-group program), then the update."""
    body: list[Operation] = []
    vmap: dict[tuple[SSAValue, int | None], SSAValue] = {}
    dev = devices[s]
    kind = _kinds(ops)
    forward_end = next(i + 1 for i, o in enumerate(ops) if isinstance(o, graph.OutputOp)
                       and o.tensor_name.data == "loss")

    def key(v: SSAValue, inst: int | None) -> tuple[SSAValue, int | None]:
        return (v, inst if kind.get(v.owner, "step") == "mb" else None)  # type: ignore[arg-type]

    def clone(o: Operation, inst: int | None) -> Operation:
        mapping = {v: get(v, inst) for v in o.operands}
        new = o.clone(value_mapper=mapping)
        if isinstance(new, (graph.ParameterOp, graph.InputOp)):
            typ = new.properties["global_type"]
            if isinstance(typ, TensorType) and layout_of(typ) is not None:
                if kind[o] == "mb":  # a micro-batch of a batch input: its own name and shape
                    new.properties["tensor_name"] = StringAttr(f"{o.tensor_name.data}@mb{inst}")
                    typ = o.result.type
                new.properties["global_type"] = with_layout(typ, Layout.replicated((dev,)))
        body.append(new)
        for old, r in zip(o.results, new.results):
            vmap[key(old, inst)] = r
        return new

    def get(v: SSAValue, inst: int | None) -> SSAValue:
        k = key(v, inst)
        if k not in vmap:
            owner = v.owner
            if not isinstance(owner, Operation) or stages.get(owner, FREE) != FREE:
                raise PassError(f"pipeline-split: internal error: stage {s} uses a value of another stage "
                                f"('{getattr(owner, 'name', owner)}') before receiving it")
            clone(owner, k[1])
        return vmap[k]

    def consumers(r: SSAValue) -> set[int]:
        out: set[int] = set()
        for u in r.uses:
            t = stages.get(u.operation, FREE)
            out |= set(range(len(devices))) if t == FREE else {t}
        return out

    def transfer(o: Operation, inst: int | None) -> None:
        t = stages[o]
        for r in o.results:
            for c in sorted(consumers(r) - {t}):
                if t == s:
                    body.append(comm.SendOp(vmap[key(r, inst)], [[devices[t], devices[c]]]))
                elif c == s:
                    recv = comm.RecvOp([[devices[t], devices[c]]], r.type)
                    body.append(recv)
                    vmap[key(r, inst)] = recv.result

    def process(o: Operation, inst: int | None) -> None:
        t = stages[o]
        if t == FREE:
            if isinstance(o, (graph.AssignOp, graph.OutputOp)):
                clone(o, inst)
            return
        if isinstance(o, comm.AllReduceOp):  # the sum over micro-batches, in micro-batch order
            if t == s:
                (x,) = o.operands
                acc = get(x, 0)
                for i in range(1, microbatches):
                    add = graph.AddOp(acc, get(x, i), o.result.type)
                    body.append(add)
                    acc = add.result
                vmap[(o.result, None)] = acc
        elif t == s:
            clone(o, inst)
        transfer(o, inst)

    done: set[Operation] = set()
    for phase, i in blocks:
        for o in ops[:forward_end] if phase == "F" else ops[forward_end:]:
            if kind[o] == "mb":
                process(o, i)
            elif kind[o] == "step" and o not in done:
                done.add(o)
                process(o, None)
    for o in ops:
        if kind[o] != "mb" and o not in done:
            done.add(o)
            process(o, None)
    return body
