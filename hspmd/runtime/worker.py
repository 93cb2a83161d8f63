"""One rank of a training run: load the bundle's program for this rank, build the plan, train.

`python -m hspmd.runtime.worker BUNDLE [--steps K] [--log FILE] [--checkpoint FILE]
[--checkpoint-dir D --checkpoint-every K --keep N] [--resume PATH | --init-from FILE] [--trace FILE]
[--progress bar|lines]` is what `hspmd run` starts under mpiexec; `train` is the same loop for
any communicator, so tests run it on in-process ranks too. Rank 0 reports each step
(`progress`: a live bar, or one plain line per step) and writes the log. With `--trace` every
rank records its events (`trace.Tracer`) and rank 0 gathers them into one trace file.

With a checkpoint directory each rank writes `D/.ranks/rank-<r>.pid` ("<host> <pid>") at
start-up, for launchers and tests that watch or kill ranks (`hspmd run --elastic`), and the
environment variable `HSPMD_FAULT=rank:step` kills that rank at that step (`hspmd.runtime.launcher.fault`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import sys
import socket
import time
from dataclasses import dataclass, field, replace

import numpy as np

from hspmd.dialects.context import IRTextError, parse_module
from hspmd.dialects.levels import LevelError, physical_groups, verify_physical
from hspmd.codegen.bundle import BundleError, read_manifest
from hspmd.codegen.schedule.model import Leaf
from hspmd.data.errors import DataError
from hspmd.runtime.data.batching import BatchError, split_microbatches  # noqa: F401  (worker.split_microbatches)
from hspmd.runtime.data.feed import DataElsewhere, open_feed, verify_data
from hspmd.runtime.checkpoint import gather_parameters, save_checkpoint
from hspmd.runtime.stacked import layer_leaves, per_layer, stacked
from hspmd.runtime.checkpoint.manifest import CheckpointError, read_manifest as read_checkpoint_manifest, resolve_checkpoint
from hspmd.runtime.checkpoint.reader import CheckpointElsewhere, load_global_file, load_state
from hspmd.runtime.checkpoint.writer import CheckpointWriter, RunInfo
from hspmd.runtime.launcher.fault import fault_point
from hspmd.runtime.kernel_exec import BACKENDS, select_program
from hspmd.runtime.comm.base import CommError, Communicator
from hspmd.dialects import graph
from hspmd.dialects.dist import layout_of
from hspmd.ir.loss_scaling import SCALE_STATE
from hspmd.ir.types import dtype_name
from hspmd.runtime.cuda.plan import DevicePlanError
from hspmd.runtime.plan import Plan, PlanError, build_plan
from hspmd.runtime.progress import Progress
from hspmd.runtime.switch import SwitchStats, Switcher, bundle_holdings
from hspmd.runtime.launcher.idle import RankSubset, idle_ranks
from hspmd.runtime.launcher.leave import LeaveError, LeaveSignal, leave_target, parse_leave
from hspmd.ir.switch_plan import SwitchError
from hspmd.runtime.trace import Tracer, traced, write_trace
from hspmd.runtime.comm.nodes import node_aware
from hspmd.runtime.launcher.heartbeat import Heartbeat
from hspmd.runtime.launcher.standby import StandbyDismissed
from hspmd.runtime.launcher.peer.copier import PeerCopyError
from hspmd.runtime.launcher.peer.session import PeerOptions, PeerRestoreError, restart_line, restore as restore_from_peers, start_copies
from hspmd.dialects.pipeline import STAGE_ATTR
from hspmd.ir.lr_schedule import ScheduleError, schedule_from_spec


class RunError(Exception):
    """A run cannot start or go on; the message says why."""


class QuietRunError(RunError):
    """A run cannot go on because another rank failed; that rank says why, this one says nothing."""


class AgreedRunError(RunError):
    """A run cannot go on, and every rank knows it (no rank waits for another): said, no abort."""


def _write_pid(directory: str, rank: int) -> None:
    """Write `directory/.ranks/rank-<r>.pid`: this rank's host and process id."""
    ranks = os.path.join(directory, ".ranks")
    os.makedirs(ranks, exist_ok=True)
    path = os.path.join(ranks, f"rank-{rank}.pid")
    with open(path + ".part", "w") as f:
        f.write(f"{socket.gethostname()} {os.getpid()}\n")
    os.replace(path + ".part", path)


@dataclass
class RunResult:
    """What a rank saw: the losses per step and, on rank 0, the final global parameters."""

    losses: list[float] = field(default_factory=list)
    params: dict[str, np.ndarray] | None = None
    initial_params: dict[str, np.ndarray] | None = None  # with keep_outputs, on rank 0
    outputs: list[dict[str, np.ndarray]] = field(default_factory=list)  # with keep_outputs: this rank's, per step
    lrs: list[float] = field(default_factory=list)  # the learning rate fed as input "lr", per step (if it has one)
    first_step: int = 1  # the first step this run trained (after a resume, the checkpoint's step + 1)
    checkpoint_stall_s: list[float] = field(default_factory=list)  # the training thread's time in each checkpoint
    switches: list[tuple[int, int, int, SwitchStats]] = field(default_factory=list)  # (step, from, to, stats)
    step_s: list[float] = field(default_factory=list)  # each step's time in the plan (as the log's time_s)
    left: list[tuple[int, list[int]]] = field(default_factory=list)  # (step, ranks that left before it)
    idle: bool = False  # the strategy left this rank out: it ran no step (hspmd.runtime.launcher.idle)


@dataclass(frozen=True)
class CheckpointOptions:
    """Where a run writes sharded checkpoints and what it starts from (docs/checkpoints.md)."""

    directory: str | None = None  # write D/step-<k>/ ...
    every: int | None = None  # ... every K steps, and after the last
    keep: int | None = None  # keep the newest N
    resume: str | None = None  # continue from D (its newest) or D/step-<k>
    init_from: str | None = None  # start from a file of global tensors


def load_script_module(script: str):
    """Return the model script at `script` as a loaded module (it provides the data)."""
    spec = importlib.util.spec_from_file_location("hspmd_data_" + os.path.basename(script).split(".")[0], script)
    if spec is None or spec.loader is None or not os.path.isfile(script):
        raise RunError(f"{script}: the bundle's model script is missing (it provides the data)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_batches(script: str, config: dict):
    """Return the global batches of the model script at `script` (its `batches(config)`, or its
    `dataset(config)` read batch by batch)."""
    from hspmd.data.script import has_dataset, script_batches

    module = load_script_module(script)
    return script_batches(module, config) if has_dataset(module) else iter(module.batches(config))


def _quiet_unless(speak: bool):
    """Return a context that keeps stderr as it is when `speak`, else silences it."""
    return contextlib.nullcontext() if speak else contextlib.redirect_stderr(io.StringIO())


def step_inputs(step: int, config: dict, input_names) -> dict[str, np.ndarray]:
    """Return the per-step scalar inputs the plan reads: "lr" (from the schedule) and "step".

    "lr" follows `config["lr_schedule"]` (a `hspmd.ir.lr_schedule` spec; a constant
    `config["lr"]` without one); "step" is the step number, counting from 1.
    """
    out: dict[str, np.ndarray] = {}
    if "lr" in input_names:
        spec = config.get("lr_schedule") or ({"kind": "constant", "lr": config["lr"]} if "lr" in config else None)
        if spec is None:
            raise RunError("the program reads input 'lr' but the config has neither 'lr_schedule' nor 'lr'")
        try:
            out["lr"] = np.asarray(schedule_from_spec(spec)(step), dtype=np.float64)
        except ScheduleError as err:
            raise RunError(f"config 'lr_schedule': {err}") from None
    if "step" in input_names:
        out["step"] = np.asarray(step, dtype=np.int64)
    return out


def _loss_scale(state: dict) -> float | None:
    """Return the dynamic loss scale this rank's `state` holds (host or device array), or None."""
    value = state.get(SCALE_STATE)
    return None if value is None else float(np.asarray(value).reshape(-1)[0])


def train(
    bundle: str,
    comm: Communicator,
    steps: int | None = None,
    log: str | None = None,
    checkpoint: str | None = None,
    quiet: bool = False,
    keep_outputs: bool = False,
    kernels: str = "cpu",
    checkpoints: CheckpointOptions | None = None,
    log_append: bool = False,
    trace: str | None = None,
    progress_bar: bool = False,
    switch_every: int | None = None,
    strategy_order: list[int] | None = None,
    leave_at: tuple[int, int] | None = None,
    device: str = "cpu",
    cuda_graph: bool = True,
    peer: PeerOptions | None = None,
    standby=None,
    ranks_per_node: int | None = None,
) -> RunResult:
    """Run `steps` training steps of `bundle` as `comm.rank` and return what this rank saw.

    `kernels` picks how elementwise chains and row reductions run (`kernel_exec.BACKENDS`):
    "cpu" runs the bundle's kernel-level program, its fused kernels built as C++ from their
    CUDA source (the physical program, NumPy per op, said once, where no compiler is found or
    the bundle has no kernel level), "numpy" runs the physical program NumPy per op, "cuda" is
    for CuPy (falls back to "cpu" without a GPU). `device` "cuda" runs the bundle's GPU program
    on the rank's GPU instead (`hspmd.runtime.cuda`: parameters and optimizer states on the
    device for the whole run; `cuda_graph`: each step replayed as one CUDA graph).

    With `keep_outputs`, the result also holds every step's named outputs (gradients of a
    program compiled without an optimizer, for instance) and the initial parameters.

    `checkpoints` writes sharded checkpoints and resumes from one (`CheckpointOptions`): a
    resumed run continues at the checkpoint's step + 1 with its parameters, optimizer states and
    data position, up to `steps` in all. `log_append` appends to `log` instead of rewriting it.

    `trace` (a path, the same on every rank) records every rank's events and writes them, on
    rank 0, as one Chrome / Perfetto trace (`hspmd.runtime.trace`). `progress_bar` shows rank
    0's steps as a live bar instead of one line each (`hspmd.runtime.progress`).

    A bundle of several strategies (`Manifest.variants`, docs/switching.md) starts under the
    first and switches at step boundaries: every `switch_every` steps to the next (cycling), or
    where the script's `strategy_for(batch, config)` names another, or, given `strategy_order`,
    step k under strategy `strategy_order[k - 1]`; the state moves in memory
    (`hspmd.runtime.switch`). A bundle with strategies on fewer ranks lets a rank leave
    gracefully (SIGTERM, or `leave_at` = (rank, step) for tests; `hspmd.runtime.launcher.leave`).

    `peer` (`hspmd.runtime.launcher.peer`): keep in-memory copies of the state for an elastic restart, start
    from such copies, and write the restart's `--log` line. `standby` (a standby rank,
    `hspmd.runtime.launcher.standby`): called once the program is built, it returns where to start from.
    """
    manifest = read_manifest(bundle)
    world_rank = comm.rank  # the launcher's numbering (idle ranks aside, the working ranks get their own)
    if comm.size != (manifest.world_size or manifest.num_devices):
        raise RunError(
            f"the bundle was compiled for {manifest.world_size or manifest.num_devices} devices (strategy "
            f"'{manifest.strategy}') but the run has {comm.size} ranks"
        )
    if manifest.ranks is not None:  # the strategy leaves some ranks idle: they run nothing
        if comm.rank not in manifest.ranks:
            return RunResult(idle=True)
        idle = idle_ranks(manifest.ranks, comm.size)
        comm = RankSubset(comm, manifest.ranks)  # the working ranks' own numbering, 0..K-1
        if comm.rank == 0 and not quiet:
            print(f"rank{'s' if len(idle) > 1 else ''} {','.join(map(str, idle))} idle: the strategy runs on "
                  f"rank{'s' if comm.size > 1 else ''} {','.join(map(str, manifest.ranks))}", flush=True)
    places = rank_places(comm, device)
    # ranks on several nodes (hosts, or simulated: ranks_per_node): all-reduces across them in two tiers
    comm = node_aware(comm, [p.host for p in places] if places else None, ranks_per_node)
    cuda_graph = cuda_graph and trace is None  # traced steps run call by call: nothing is captured
    # a standby rank (hspmd.runtime.launcher.standby) says nothing of its plan: it may never train
    program = load_rank_program(bundle, manifest, comm, kernels, quiet or standby is not None, device, cuda_graph,
                                places)
    plan, gather = program.plan, program.gather
    programs, switcher = switching_programs(bundle, manifest, program, comm, kernels, switch_every, device, cuda_graph,
                                            places)
    full = [i for i, p in enumerate(programs) if len(p.devices) == comm.size]  # the others: for leaving ranks
    choose = strategy_chooser(manifest, full, switch_every, strategy_order)
    leave = (LeaveSignal(comm.rank, leave_at or parse_leave(os.environ.get("HSPMD_LEAVE")))
             if len(full) < len(programs) else None)

    tracer = Tracer.agreed(comm) if trace else None  # every rank, or none
    config = manifest.config
    steps = int(config.get("steps", 10) if steps is None else steps)
    if steps < 1:  # every rank finds it alike: rank 0 says it
        raise (AgreedRunError if comm.rank == 0 else QuietRunError)(
            f"steps={steps}: a run trains at least 1 step (--steps, or the script's config 'steps')")
    seed = int(config.get("seed", 0))
    state = plan.initial_state(seed)
    ck, peer = checkpoints or CheckpointOptions(), peer or PeerOptions()
    if standby is not None:  # ready: wait here for where this attempt starts from
        orders = standby()
        ck = replace(ck, resume=orders.get("resume"))
        peer = replace(peer, directory=orders.get("peer_dir"), restore=orders.get("peer_restore"),
                       restart=orders.get("restart_record"))
        log_append = bool(orders.get("log_append", log_append))
    beat = Heartbeat(peer.heartbeat, world_rank) if peer.heartbeat else None  # hspmd.runtime.launcher.heartbeat
    done = 0  # steps already trained (by the run a checkpoint comes from)
    peer_position: dict | None = None  # what the peer copies recorded beside the state (hspmd.runtime.launcher.peer)
    try:  # what every rank finds alike: rank 0 says it
        where = resolve_checkpoint(ck.resume) if ck.resume else None
        saved = read_checkpoint_manifest(where) if where else None
        writer = None
        if ck.directory:
            _write_pid(ck.directory, comm.rank)
            writer = CheckpointWriter(ck.directory, comm.rank, comm.size, layer_leaves(plan.params),
                                      RunInfo(manifest.strategy, manifest.num_devices, manifest.script, config, seed),
                                      ck.keep, comm, tracer)
    except (CheckpointError, OSError) as err:
        raise (AgreedRunError if comm.rank == 0 else QuietRunError)(str(err)) from None
    try:  # the ranks agree before loading (reader._agree); the one that found a fault says it
        if peer.restore:  # a restart from the peer copies in host memory (hspmd.runtime.launcher.peer)
            state, done, peer_position = restore_from_peers(peer.restore, plan.params, comm)
            if comm.rank == 0 and not quiet:
                print(f"resumed from the peer copies of step {done} (in host memory)", flush=True)
        elif where and saved:
            state = stacked(load_state(where, saved, layer_leaves(plan.params), comm.rank, comm), plan.params)
            done = saved.step
            if comm.rank == 0 and not quiet:
                print(f"resumed from {where} (step {saved.step}, saved under '{saved.strategy}')", flush=True)
        elif ck.init_from or manifest.weights:  # a file given, or the imported module's weights
            start = ck.init_from or os.path.join(bundle, manifest.weights)
            state = stacked(load_global_file(start, layer_leaves(plan.params), comm.rank, comm,
                                             per_layer(state)), plan.params)
    except CheckpointElsewhere as err:
        raise QuietRunError(str(err)) from None
    except CheckpointError as err:
        raise AgreedRunError(str(err)) from None
    except PeerRestoreError as err:
        raise (QuietRunError if err.elsewhere else RunError)(str(err)) from None
    try:
        copies = start_copies(peer, comm, plan.params, manifest.strategy) if len(programs) == 1 else None
    except PeerCopyError as err:
        raise (QuietRunError if err.elsewhere else RunError)(str(err)) from None
    try:  # the data: this rank's rows of each batch, at the checkpoint's data position (runtime/data/feed.py)
        feed = open_feed(load_script_module(manifest.script), config, comm.rank,
                         plan if len(programs) == 1 else None, staging=_staging(plan, device, config))
        verify_data(feed, comm)
        # the loader's position saved with the checkpoint, or with the peer copies (their stamp's "data")
        feed.restore(saved.data if saved else (peer_position or {}).get("data"), done)
    except DataElsewhere as err:
        raise QuietRunError(str(err)) from None
    except DataError as err:
        raise RunError(str(err)) from None
    if len(programs) > 1 and (writer is not None or where or ck.init_from):
        raise AgreedRunError("checkpoints (--checkpoint-dir, --resume, --init-from) and several strategies "
                             "(graph switching) do not go together yet")
    current, pinned = 0, False  # pinned: after a rank left, the run stays on the strategy without it
    result = RunResult()
    if keep_outputs:
        result.initial_params = gather(state)
    log_file = open(log, "a" if log_append else "w") if log and comm.rank == 0 else None
    result.first_step = done + 1
    every = ck.every or steps
    progress = Progress(steps, done, progress_bar) if comm.rank == 0 and not quiet else None

    def next_batch(step: int):
        try:
            return feed.next(step)
        except StopIteration:
            raise RunError(f"the script's batches ran out after {step - 1} steps") from None
        except DataError as err:
            raise RunError(f"step {step}: {err}") from None

    def step_batch(step: int, batch, plan) -> tuple[dict, dict]:
        """Return (the step's scalar inputs, this rank's piece of the step's global batch)."""
        scalars = step_inputs(step, config, {leaf.name: leaf.global_shape for leaf in plan.inputs})
        try:  # an epoch's last batch may be short: padded rows count for nothing (data/batching.py)
            return scalars, batch.local(plan, scalars)
        except (BatchError, DataError) as err:
            raise RunError(f"step {step}: {err}") from None

    # a GPU plan on its own (no switching, no leaving) uploads the next batch during a step
    overlap = len(programs) == 1 and leave is None and getattr(plan, "uploads_ahead", False)
    ahead = None  # (step, items, scalars, local batch) of the next step, made during this one
    try:
        for step in range(done + 1, steps + 1):
            fault_point(comm.rank, step)
            gone = leave.agree(step, programs[current].devices, comm) if leave is not None else set()
            if gone:  # at this step boundary: to the strategy without them; they hand over and stop
                target = leave_target([p.devices for p in programs], programs[current].devices, gone)
                state, stats = switcher.switch(state, current, target)
                result.switches.append((step, current, target, stats))
                result.left.append((step, sorted(gone)))
                current, pinned = target, True
                if comm.rank in gone:
                    break
                plan, gather = programs[current].plan, programs[current].gather
            if tracer is not None:
                tracer.step, step_start = step, tracer.clock()
            switched = None
            waited = time.perf_counter()
            if ahead is not None and ahead[0] == step:  # made and uploaded during the last step
                _, items, scalars, local = ahead
            else:
                batch = next_batch(step)
                items = batch.items
                chosen = current if pinned else choose(step, batch)
                if chosen != current:
                    state, switched = switcher.switch(state, current, chosen)
                    result.switches.append((step, current, chosen, switched))
                    current = chosen
                    plan, gather = programs[current].plan, programs[current].gather
                scalars, local = step_batch(step, batch, plan)
            ahead, waited = None, time.perf_counter() - waited
            # the data position after this step's batch: read now, before the next batch is made
            # during the step (`make_next`), for a checkpoint or peer copy of this step
            position = feed.state_dict()
            if "lr" in scalars:
                result.lrs.append(float(scalars["lr"]))
            scale = _loss_scale(state) if log_file and comm.rank == 0 else None
            start = time.perf_counter()
            if overlap and step < steps:
                def make_next(step=step + 1):  # the host makes the next batch while the GPU runs this step
                    nonlocal ahead
                    batch = next_batch(step)
                    scalars, local = step_batch(step, batch, plan)
                    ahead = (step, batch.items, scalars, local)
                    return local

                outputs = plan.run(state, local, tracer, ahead=make_next)
            else:
                outputs = plan.run(state, local, tracer)
            elapsed = time.perf_counter() - start
            result.step_s.append(elapsed)
            loss = float(outputs["loss"]) if "loss" in outputs else float("nan")
            result.losses.append(loss)
            if keep_outputs:  # per layer, as the parameters are named (a stacked gradient: each layer's)
                result.outputs.append(per_layer(outputs))
            copy_s = None
            if copies is not None and copies.due(step):  # before the log says the step is done
                copy_s = time.perf_counter()
                copies.after_step(step, state, {"data_position": step, "data": position})
                copy_s = time.perf_counter() - copy_s
            if comm.rank == 0:
                if progress is not None:
                    progress.step(step, loss, elapsed, items)
                if log_file:
                    if peer.restart is not None and step == done + 1:  # beside the first step after a restart
                        log_file.write(restart_line(peer.restart) + "\n")
                    record = {"step": step, "loss": loss, "time_s": elapsed, "data_s": waited, "ranks": comm.size}
                    if copy_s is not None:  # the training thread's part of the peer copies
                        record["copy_s"] = copy_s
                    if "lr" in scalars:
                        record["lr"] = result.lrs[-1]
                    if scale is not None:  # dynamic loss scaling: the scale this step's loss was multiplied by
                        record["loss_scale"] = scale
                    if len(programs) > 1:
                        record["strategy"] = current
                    if switched is not None:
                        record.update(switch_s=switched.seconds, switch_bytes=switched.bytes_moved)
                    if result.left and result.left[-1][0] == step:
                        stats = result.switches[-1][3]
                        record.update(left=result.left[-1][1], switch_s=stats.seconds, switch_bytes=stats.bytes_moved)
                    log_file.write(json.dumps(record) + "\n")
                    log_file.flush()
            if writer is not None and (step % every == 0 or step == steps):
                writer.save(step, per_layer(state), step, result.lrs[-1] if "lr" in scalars else None,
                            data=position)
            if tracer is not None:
                tracer.complete("train_step", "step", step_start, tracer.clock(), args={"loss": loss})
        if copies is not None:
            copies.close()
        if writer is not None:
            with traced(tracer, "checkpoint.wait", "checkpoint"):
                writer.close()
            result.checkpoint_stall_s = writer.stall_s
    except CheckpointError as err:
        raise RunError(str(err)) from None
    finally:
        if beat is not None:  # training is over, on this rank: its end is near, not a silence
            beat.stop()
        feed.close()
        if progress is not None:
            progress.close()
        if log_file:
            log_file.close()
    left = any(comm.rank in ranks for _, ranks in result.left)
    result.params = None if left else gather(state)
    if checkpoint and comm.rank == 0 and result.params is not None:
        with traced(tracer, "checkpoint.save", "checkpoint", path=checkpoint):
            save_checkpoint(checkpoint, result.params, steps)
    if tracer is not None:
        events = tracer.gather(comm)
        if events is not None:
            try:
                write_trace(trace, events)
            except OSError as err:
                raise RunError(f"--trace {trace}: {err.strerror or err}") from None
    return result


def _staging(plan, device: str, config: dict):
    """Return how a made batch goes into the device's host buffers (page-locked memory that a GPU
    plan uploads from directly), or None on the CPU."""
    if device != "cuda" or getattr(plan, "device", None) is None:
        return None
    from hspmd.runtime.cuda.staging import HostStaging

    section = config.get("data") if isinstance(config.get("data"), dict) else {}
    return HostStaging(plan.device, int(section.get("prefetch", 2) or 0))


@dataclass
class RankProgram:
    """One strategy's step program as this rank runs it: its plan, how to gather its parameters on
    rank 0, and the module it came from."""

    plan: Plan | None  # None: this rank has no part in the strategy (it ran on fewer ranks)
    gather: object  # state -> global parameters on rank 0 (None elsewhere)
    module: object
    devices: tuple[int, ...] = ()  # the ranks the strategy runs on


def rank_places(comm: Communicator, device: str) -> list | None:
    """Return where every rank runs (`comm.select.RankPlace`: its kind, host and GPU), gathered
    from each rank's own (`device`: its kind), over several ranks; None for one rank."""
    if comm.size == 1:
        return None
    from hspmd.runtime.comm.select import gather_places
    from hspmd.runtime.cuda.select import rank_place

    return gather_places(comm, rank_place(device, comm.rank))


def load_rank_program(bundle: str, manifest, comm: Communicator, kernels: str, quiet: bool, device: str = "cpu",
                      cuda_graph: bool = True, places: list | None = None) -> RankProgram:
    """Return the program of `bundle` that `comm.rank` runs, with its plan built (on the rank's
    GPU for `device` "cuda", its collectives through NCCL where `places` puts their groups on
    distinct GPUs)."""
    entry = manifest.group_for(comm.rank)
    if device == "cuda":
        return _load_device_program(bundle, manifest, entry, comm, quiet, cuda_graph, places)
    path = os.path.join(bundle, entry.program)
    kernel_path = os.path.join(bundle, entry.kernels) if entry.kernels is not None else None
    with _quiet_unless(comm.rank == 0):  # a fallback is said once for the run, by rank 0
        group_module = select_program(  # only the level that runs is parsed
            lambda: _group_program(path, comm.rank, verify=True),
            (lambda: _group_program(kernel_path, comm.rank)) if kernel_path is not None else None, kernels)
    fn = next((op for op in group_module.body.block.ops if getattr(op, "sym_name", None) is not None
               and op.sym_name.data == "train_step"), None)
    if fn is None:
        raise RunError(f"{path}: the group's module has no @train_step function")
    with _quiet_unless(comm.rank == 0):
        plan = build_plan(fn, comm.rank, comm)  # type: ignore[arg-type]
    if comm.rank == 0 and not quiet:
        print(f"plan: peak {plan.peak_bytes / 2**20:.1f} MiB per step on rank 0 (buffers {plan.buffer_bytes / 2**20:.1f} "
              f"MiB, reused by liveness), {len(plan.buckets)} all-reduce buckets, "
              f"{sum(1 for o in group_module.walk() if o.name == 'kernel.fused')} fused kernels", flush=True)
    return RankProgram(plan, _gatherer(bundle, manifest, group_module, plan, comm), group_module,
                       tuple(sorted(d for g in manifest.groups for d in g.devices)))


def _gatherer(bundle: str, manifest, group_module, plan, comm: Communicator):
    """Return the function bringing the global parameters to rank 0 from a state of `plan`
    (every stage's, where the rank runs a pipeline stage: it holds only its own)."""
    if STAGE_ATTR in group_module.attributes:
        stage_params = _stage_parameters(bundle, manifest)
        return lambda state: gather_stage_parameters(stage_params, state, comm)
    return lambda state: gather_parameters(plan, state, comm)


def switching_programs(bundle: str, manifest, first: RankProgram, comm: Communicator, kernels: str,
                       switch_every: int | None, device: str = "cpu", cuda_graph: bool = True,
                       places: list | None = None) -> tuple[list[RankProgram], Switcher | None]:
    """Return the programs of every strategy of `bundle` (the first one given; a sub-bundle named
    twice is loaded once; on the rank's GPU for `device` "cuda": each strategy's plan with an
    arena of its own) and the switcher between them (None for a bundle of one strategy)."""
    if switch_every is not None and switch_every < 1:
        raise RunError("--switch-every must be at least 1")
    if not manifest.variants:
        return [first], None
    loaded = {".": first}
    for sub in manifest.variants:
        if sub not in loaded:
            where = os.path.join(bundle, sub)
            variant = read_manifest(where)
            devices = tuple(sorted(d for g in variant.groups for d in g.devices))
            if not set(devices) <= set(range(manifest.num_devices)):
                raise RunError(f"{where}: runs on devices {list(devices)}, the run has {manifest.num_devices}")
            loaded[sub] = (load_rank_program(where, variant, comm, kernels, quiet=True, device=device,
                                             cuda_graph=cuda_graph, places=places) if comm.rank in devices
                           else RankProgram(None, None, None, devices))
    dirs = [".", *manifest.variants]
    holdings = {sub: bundle_holdings(os.path.join(bundle, sub)) for sub in loaded}
    params = [loaded[d].plan.params if loaded[d].plan is not None else [] for d in dirs]
    return [loaded[d] for d in dirs], Switcher([holdings[d] for d in dirs], comm, params)


def strategy_chooser(manifest, full: list[int], switch_every: int | None, order: list[int] | None = None):
    """Return `(step, batch) -> index` of the strategy a step runs under: `order[step - 1]` when
    given; with `switch_every` K, the next of `full` (the strategies on every rank) every K steps;
    else the script's `strategy_for(batch, config)` when it has one and the bundle holds several
    strategies; else 0."""
    count = len(full)
    if order is not None:
        if any(not 0 <= i < count for i in order):
            raise RunError(f"strategy order {order}: the run has strategies 0..{count - 1}")
        return lambda step, batch: order[step - 1] if step <= len(order) else 0
    if count == 1:
        return lambda step, batch: 0
    if switch_every is not None:
        return lambda step, batch: full[((step - 1) // switch_every) % count]
    pick = getattr(load_script_module(manifest.script), "strategy_for", None)
    if pick is None:
        return lambda step, batch: 0

    def choose(step: int, batch) -> int:
        index = pick(batch.full() if hasattr(batch, "full") else batch, manifest.config)  # a feed's batch, or a dict
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < count:
            raise RunError(f"step {step}: the script's strategy_for returned {index!r}; the run has strategies "
                           f"0..{count - 1}")
        return int(index)

    return choose


def _load_device_program(bundle: str, manifest, entry, comm: Communicator, quiet: bool,
                         cuda_graph: bool, places: list | None = None) -> RankProgram:
    """Return the rank's GPU program with its plan built on the rank's device (NCCL between
    the GPUs of groups that `places` puts on distinct GPUs, `comm.select.choose_transport`)."""
    from hspmd.runtime.cuda.device import DeviceError
    from hspmd.runtime.cuda.plan import DevicePlanError, build_device_plan
    from hspmd.runtime.cuda.select import local_rank, open_device

    if entry.device is None:
        raise RunError(f"{bundle}: the bundle holds no GPU program (compile it for a GPU run: hspmd run --device cuda)")
    path = os.path.join(bundle, entry.device)
    group_module = _group_program(path, comm.rank)
    fn = next((op for op in group_module.body.block.ops if getattr(op, "sym_name", None) is not None
               and op.sym_name.data == "train_step"), None)
    if fn is None:
        raise RunError(f"{path}: the group's module has no @train_step function")
    try:
        gpu = open_device(local_rank(comm.rank))
        # the script's `tf32` (checked when it was compiled): float32 products on TF32 tensor cores
        use_tf32 = str(manifest.config.get("tf32", False)).lower() == "true"
        nccl = transport = None
        if places is not None and getattr(gpu, "stream", None) is not None:  # a GPU (the emulated one has no NCCL)
            from hspmd.runtime.comm.nccl import NcclCommunicator
            from hspmd.runtime.comm.select import choose_transport

            nccl, transport = NcclCommunicator(comm, stream=gpu.stream.ptr), (lambda g: choose_transport(g, places))
        plan = build_device_plan(fn, comm.rank, gpu, cuda_graph=cuda_graph, tf32=use_tf32, communicator=comm,
                                 nccl=nccl, transport=transport)
    except (DeviceError, DevicePlanError, CommError) as err:
        raise RunError(str(err)) from None
    if comm.rank == 0 and not quiet:
        print(f"plan: on {gpu.name}, {plan.peak_bytes / 2**20:.1f} MiB of device memory per rank (allocated once: "
              f"parameters, optimizer states, inputs and buffers {plan.buffer_bytes / 2**20:.1f} MiB reused by "
              f"liveness), {sum(1 for o in group_module.walk() if o.name == 'kernel.fused')} kernels, "
              f"{len(plan.calls)} calls a step{plan.replay_text() if cuda_graph else ''}"
              f"{', float32 products on TF32 tensor cores' if use_tf32 else ''}", flush=True)
    return RankProgram(plan, _gatherer(bundle, manifest, group_module, plan, comm), group_module,
                       tuple(sorted(d for g in manifest.groups for d in g.devices)))


def _group_program(path: str, rank: int, verify: bool = False):
    """Return the group module of the program in `path` that `rank` runs (the physical level
    verified with `verify`)."""
    module = parse_module(open(path).read(), path)
    if verify:
        verify_physical(module)
    (_, group_module), *_ = [g for g in physical_groups(module) if rank in g[0]]
    return group_module


def _stage_parameters(bundle: str, manifest) -> list[Leaf]:
    """Return every pipeline stage's parameters (global shape, layout over the stage's devices)
    from the bundle's programs; a name held by several stages (`opt.step`) comes from the first."""
    out: dict[str, Leaf] = {}
    for entry in manifest.groups:
        path = os.path.join(bundle, entry.program)
        module = parse_module(open(path).read(), path)
        for devices, group in physical_groups(module):
            for o in group.walk():
                if isinstance(o, graph.ParameterOp) and o.tensor_name.data not in out:
                    typ = o.properties["global_type"]
                    out[o.tensor_name.data] = Leaf(o.tensor_name.data, 0, typ.get_shape(), layout_of(typ),
                                                   dtype_name(o.result.type))
    return list(out.values())


def gather_stage_parameters(stages: list[Leaf], state: dict[str, np.ndarray],
                            comm: Communicator) -> dict[str, np.ndarray] | None:
    """Return every stage's parameters on rank 0 (None elsewhere), assembled from their pieces."""
    return gather_parameters(Plan(comm.rank, params=stages), state, comm)


def worker_device(text: str, rank: int) -> str:
    """Return "cpu" or "cuda", the device `rank` runs on, from the `--device` that `hspmd run`
    resolved (one kind for every rank, or one per rank: `cuda,cuda,cpu`)."""
    from hspmd.runtime.cuda.device import DeviceError
    from hspmd.runtime.cuda.select import rank_device

    try:
        device = rank_device(text, rank)
    except DeviceError as err:
        raise SystemExit(f"python -m hspmd.runtime.worker: error: {err}") from None
    if device not in ("cpu", "cuda"):
        raise SystemExit(f"python -m hspmd.runtime.worker: error: --device {text}: rank {rank} gets '{device}', "
                         "not cpu or cuda")
    return device


def main(argv: list[str] | None = None, comm: Communicator | None = None) -> int:
    """Entry point of one rank (an MPI process unless `comm` is given); returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m hspmd.runtime.worker")
    parser.add_argument("bundle")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--log")
    parser.add_argument("--log-append", action="store_true")
    parser.add_argument("--checkpoint")
    parser.add_argument("--kernels", choices=BACKENDS, default="cpu")
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--checkpoint-every", type=int)
    parser.add_argument("--keep", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--init-from")
    parser.add_argument("--trace")
    parser.add_argument("--progress", choices=("bar", "lines"), default="lines")
    parser.add_argument("--switch-every", type=int)
    parser.add_argument("--cpu-bind", help="one core per rank, e.g. 0,0,1: rank r runs on core LIST[r]")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, or one of them per rank (cuda,cuda,cpu)")
    parser.add_argument("--cuda-graph", choices=("on", "off"), default="on")
    parser.add_argument("--peer-dir", help="keep in-memory peer copies, their index here (hspmd.runtime.launcher.peer)")
    parser.add_argument("--peer-every", type=int, help="a peer copy after every K-th step (default 1)")
    parser.add_argument("--peer-restore", help="start from this recovery of the peer copies")
    parser.add_argument("--restart-record", help="the restart's facts (JSON), for the --log line beside the first step")
    parser.add_argument("--ranks-per-node", type=int, help="simulate nodes of K ranks (hspmd.runtime.comm.nodes)")
    parser.add_argument("--heartbeat", metavar="DIR", help="beat in DIR for --silent-after (hspmd.runtime.launcher.heartbeat)")
    parser.add_argument("--standby", metavar="ORDERS", help="build the plan, then wait for ORDERS (hspmd.runtime.launcher.standby)")
    args = parser.parse_args(argv)
    if comm is None:
        from hspmd.runtime.comm.mpi import MPICommunicator

        comm = MPICommunicator()
    if args.cpu_bind:  # checked by `hspmd run` before launching
        from hspmd.runtime.profiler import bind_cpu, parse_cpu_bind

        bind_cpu(parse_cpu_bind(args.cpu_bind, comm.size)[comm.rank])
    checkpoints = CheckpointOptions(args.checkpoint_dir, args.checkpoint_every, args.keep, args.resume, args.init_from)
    peer = PeerOptions.from_args(args.peer_dir, args.peer_every, args.peer_restore, args.restart_record,
                                 args.heartbeat)
    standby = None
    if args.standby:
        from hspmd.runtime.launcher.standby import wait_for_orders

        standby = lambda: wait_for_orders(args.standby)  # noqa: E731
    try:
        train(args.bundle, comm, args.steps, args.log, args.checkpoint, kernels=args.kernels,
              checkpoints=checkpoints, log_append=args.log_append, trace=args.trace,
              progress_bar=args.progress == "bar", switch_every=args.switch_every,
              device=worker_device(args.device, comm.rank),
              cuda_graph=args.cuda_graph == "on", peer=peer, standby=standby, ranks_per_node=args.ranks_per_node)
    except StandbyDismissed:  # a standby rank the run did not need
        return 0
    except QuietRunError:  # every rank knows; the one that found it has said why
        return 1
    except AgreedRunError as err:
        print(f"hspmd run: error: {err}", file=sys.stderr, flush=True)
        return 1
    except (RunError, BundleError, PlanError, DevicePlanError, IRTextError, LevelError, SwitchError, LeaveError) as err:
        print(f"hspmd run (rank {comm.rank}): error: {err}", file=sys.stderr, flush=True)
        if comm.size > 1:  # the others may wait in a collective: end the whole job
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
