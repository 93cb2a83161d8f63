"""`pipeline-split`: one device's physical training step -> one program per pipeline stage.

`pipeline-split{devices="0,1" microbatches=1 schedule="gpipe"}` takes the physical IR of a
one-device group (what `specialize-groups,lower-reshard` make of `[d]: dp=1`; with micro-batches
see below) and replaces it by one group module
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
  their operands come from, or the stage of a weight's transpose they use; a view (transpose,
  reshape, broadcast, cast) of forward values only goes to its users' last stage; else the
  first stage among their users (so an activation's gradient is computed where its layer
  lives); `graph.assign` with its parameter; optimizer
  state `opt.<kind>.NAME` with parameter NAME;
* **free** values (constants, inputs, scalar optimizer state like `opt.step`, and ops of only
  those) belong to no stage: each stage that needs one computes its own copy (and updates its
  own copy of `opt.step`).

A value used on another stage than its producer's is sent with `comm.send` and received with
`comm.recv` (see Schedules below for where); with one micro-batch every stage computes exactly
the numbers of the one-device step. `graph.output "loss"` is on every
stage (the loss is sent to the others). The group modules carry `hspmd.pipeline_stage`.

**Micro-batches** (`microbatches=m` > 1): the input is then the physical IR of `[0..m-1]: dp=m`,
one virtual device per micro-batch, so every op already has micro-batch shapes and the
`comm.all_reduce`s over the group mark exactly where micro-batches meet (the gradients, the
loss). Ops that depend on a batch input run once per micro-batch (batch input `x` becomes
inputs `x@mb0` ... `x@mb{m-1}`, which the worker cuts from the global batch); each all-reduce
becomes a sum of the m micro-batch values, left to right like the all-reduce it replaces;
ops after it, and the optimizer's ops, run once at the end. The module carries
`hspmd.microbatches`. Other collectives in the input are refused.

**Schedules.** Each stage's program is unrolled in the order of its list in the `schedule`
(`hspmd.runtime.schedule_pipeline`: "gpipe" or "1f1b", checked complete and runnable): the
stage's forward ops of micro-batch i for action ("F", i), its backward ops for ("B", i), then
the update. Every message gets a key: the position of the action that first uses it in one
global order of all stages' actions (`check_schedule`'s), then the producer's place in the
one-group step. Each stage issues its messages in key order (a send as soon as its value is
made and every smaller key is issued; before an op, every message up to the receives it
needs), so both ends of every blocking send/receive meet in one global order: no deadlock,
for 1F1B as for GPipe. A stage assignment in which an action would need a value that a later
action makes is refused with a message naming the op.
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
            order = check_schedule(plan, m)
        except PipelineScheduleError as err:
            raise PassError(f"pipeline-split: schedule '{self.schedule}': {err}") from None
        stages = _assign(ops, pp)
        bodies = _emit_stages(ops, stages, devices, plan, order, m)
        modules = []
        for s, dev in enumerate(devices):
            body = bodies[s]
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
_VIEWS = (graph.TransposeOp, graph.ReshapeOp, graph.BroadcastOp, graph.CastOp)


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
    views: list[Operation] = []
    pinned_ops: set[Operation] = set()  # backward ops that read a parameter
    forward_ops = set(ops[:forward_end])
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
            pinned_ops.add(o)
        elif any(v.owner in pinned_ops for v in o.operands):  # uses a weight's transpose: with the weight
            s = max(stage[v.owner] for v in o.operands if v.owner in pinned_ops)
        elif isinstance(o, _VIEWS) and others and all(v.owner in forward_ops for v in o.operands
                                                       if value_stage(v) != FREE):
            views.append(o)  # a view of a forward value (a residual's transpose): with its users
            stage[o] = -2
            continue
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
    for o in sorted([*undecided, *views], key=ops.index, reverse=True):
        users = {stage[u.operation] for r in o.results for u in r.uses
                 if u.operation in stage and not isinstance(u.operation, graph.OutputOp)} - {FREE, -2}
        if users:
            stage[o] = max(users) if o in views else min(users)
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
        if isinstance(o, comm.AllReduceOp) or o.dialect_name() == "optim":  # the update comes last
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


Key = tuple  # (position of the consumer's action in the global order, producer op index, instance, result, dst)


def _emit_stages(ops: list[Operation], stages: dict[Operation, int], devices: tuple[int, ...],
                 plan: list[list[tuple[str, int]]], order: list[tuple[int, tuple[str, int]]],
                 microbatches: int) -> list[list[Operation]]:
    """Return each stage's step ops: its ops in the order of its schedule (once per micro-batch
    where they depend on the batch), copies of the free ops it needs, the sums over micro-batches
    (in place of the all-reduces of the one-group program), the update, and its sends/receives.

    Every message gets a key: the position, in `order` (one global order of all stages' actions),
    of the action that first uses it, then the producer's place in the one-group step. Each
    stage issues its messages in key order (a send as soon as it is made and all smaller keys
    are issued; before an op, every message up to the receives it needs), so the two ends of
    every blocking send/receive meet in one global order: no deadlock, for any schedule.
    """
    kind = _kinds(ops)
    forward_end = next(i + 1 for i, o in enumerate(ops) if isinstance(o, graph.OutputOp)
                       and o.tensor_name.data == "loss")
    where = {o: j for j, o in enumerate(ops)}
    position = {sa: k for k, sa in enumerate(order)}
    post = len(order)
    pp = len(devices)

    def inst_of(v: SSAValue, inst: int | None) -> int | None:
        return inst if kind.get(v.owner, "step") == "mb" else None  # type: ignore[arg-type]

    def uses(o: Operation, inst: int | None) -> list[tuple[SSAValue, int | None]]:
        if isinstance(o, comm.AllReduceOp):
            return [(o.operands[0], inst_of(o.operands[0], i)) for i in range(microbatches)]
        return [(v, inst_of(v, inst)) for v in o.operands]

    def runs_on(o: Operation, s: int) -> bool:
        t = stages[o]
        return t == s or (t == FREE and isinstance(o, (graph.AssignOp, graph.OutputOp)))

    items: list[list[tuple[Operation, int | None, int]]] = []
    for s in range(pp):
        done: set[Operation] = set()
        mine: list[tuple[Operation, int | None, int]] = []
        for phase, i in plan[s]:
            at = position[(s, (phase, i))]
            for o in ops[:forward_end] if phase == "F" else ops[forward_end:]:
                if isinstance(o, (graph.AssignOp, graph.OutputOp)):
                    continue  # outputs and assignments come last
                if kind[o] == "mb":
                    mine.append((o, i, at))
                elif kind[o] == "step" and o not in done:
                    done.add(o)
                    mine.append((o, None, at))
        mine.extend((o, None, post) for o in ops if kind[o] != "mb" and o not in done)
        items.append([it for it in mine if runs_on(it[0], s)])

    # messages: (value, instance, src, dst) -> key, the first use on dst deciding
    messages: dict[tuple[SSAValue, int | None, int, int], Key] = {}
    for c in range(pp):
        for o, inst, at in items[c]:
            for v, k in uses(o, inst):
                producer = v.owner
                t = stages.get(producer, FREE) if isinstance(producer, Operation) else FREE
                if t in (FREE, c) or (v, k, t, c) in messages:
                    continue
                messages[(v, k, t, c)] = (at, where[producer], -1 if k is None else k,
                                          list(producer.results).index(v), c)
    made = {(r, inst_of(r, inst)): at for s in range(pp) for o, inst, at in items[s] for r in o.results}
    for (v, k, t, c), key in messages.items():
        if made[(v, k)] >= key[0] and key[0] != post:
            raise PassError(f"pipeline-split: '{v.owner.name}' on stage {t} is made in an action that comes after "
                            f"the one of stage {c} that uses it; this stage assignment does not fit the schedule")

    out = []
    for s in range(pp):
        body: list[Operation] = []
        vmap: dict[tuple[SSAValue, int | None], SSAValue] = {}
        dev = devices[s]
        events = sorted((key, v, k, t, c) for (v, k, t, c), key in messages.items() if s in (t, c))
        next_event = 0

        def get(v: SSAValue, inst: int | None) -> SSAValue:
            k = (v, inst_of(v, inst))
            if k not in vmap:
                owner = v.owner
                if not isinstance(owner, Operation) or stages.get(owner, FREE) != FREE:
                    raise PassError(f"pipeline-split: internal error: stage {s} uses a value of another stage "
                                    f"('{getattr(owner, 'name', owner)}') before receiving it")
                clone(owner, k[1])
            return vmap[k]

        def clone(o: Operation, inst: int | None) -> None:
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
                vmap[(old, inst_of(old, inst))] = r

        def issue(upto: Key | None) -> None:
            """Issue events in key order: all up to `upto`, then sends already made (upto None: sends only)."""
            nonlocal next_event
            while next_event < len(events):
                key, v, k, t, c = events[next_event]
                if t == s:
                    if (v, k) not in vmap:
                        if upto is not None and key <= upto:
                            raise PassError("pipeline-split: internal error: a send is due before its value is made")
                        return
                    body.append(comm.SendOp(vmap[(v, k)], [[devices[t], devices[c]]]))
                else:
                    if upto is None or key > upto:
                        return
                    recv = comm.RecvOp([[devices[t], devices[c]]], v.type)
                    body.append(recv)
                    vmap[(v, k)] = recv.result
                next_event += 1

        for o, inst, _ in items[s]:
            need = [messages[(v, k, stages[v.owner], s)] for v, k in uses(o, inst)
                    if (v, k) not in vmap and (v, k, stages.get(v.owner, FREE), s) in messages]
            if need:
                issue(max(need))
            if isinstance(o, comm.AllReduceOp):  # the sum over micro-batches, in micro-batch order
                vals = [get(v, k) for v, k in uses(o, inst)]
                acc = vals[0]
                for x in vals[1:]:
                    add = graph.AddOp(acc, x, o.result.type)
                    body.append(add)
                    acc = add.result
                vmap[(o.result, None)] = acc
            else:
                clone(o, inst)
            issue(None)
        issue((post + 1,))
        if next_event != len(events):
            raise PassError(f"pipeline-split: internal error: stage {s} leaves messages unsent")
        out.append(body)
    return out
