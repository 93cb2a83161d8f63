"""A worker's training loop in a parameter-server run: pull, compute the gradient, push.

Each step, worker w of N takes rows [w B/N, (w+1) B/N) of the global batch (the rows data
parallelism would give it), pulls from the servers what its step reads (whole parameters; of a
table only the rows its ids touch, or, with the HET cache, only those its cache cannot give),
runs the gradient step compiled for one device, and pushes each served parameter's gradient
(of a table: the touched rows). Under `hybrid` the dense parameters' gradients and the loss are
summed over the workers by one all-reduce and each worker applies their update itself (the same
update step the servers run), as Hetu's Hybrid mode does. The logged loss is the mean over the
workers where the workers meet each step (BSP, or hybrid), else the worker's own rows' loss.

Rank 0 writes the `--log` lines: `step`, `loss`, `time_s`, `ranks`, `staleness` (the largest
over the servers, of how far the slowest worker was behind when the pull was answered),
`bytes` (what this worker pulled and pushed), where the step went (`wait_s` for the pull's
reply, `compute_s`, `push_s`, `meet_s` in the all-reduce that makes the workers meet) and, with
the cache, `cache_hit_rate`.

Under SSP and ASP with comm=ps (no cache) the pull of step t + 1 is sent before step t is
computed and a push stays in flight until the next one (`PSWorker.overlap`): the servers answer
while the worker computes, within the same staleness bound (docs/parameter-server.md).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from hspmd.codegen.bundle import read_manifest
from hspmd.ir.ps_plan import PSPlan
from hspmd.runtime.comm.base import Communicator
from hspmd.runtime.ps import protocol
from hspmd.runtime.ps.cache import RowCache
from hspmd.runtime.launcher.fault import fault_point
from hspmd.runtime.ps.update import GRAD_PREFIX, UpdateStep


class PSRunError(RuntimeError):
    """A parameter-server run cannot go on (a server is gone, a batch does not split)."""


def local_rows(batch: dict, worker: int, workers: int) -> dict:
    """Return worker `worker`'s rows of every array input of a global batch (scalars as they are)."""
    out = {}
    for name, value in batch.items():
        value = np.asarray(value)
        if value.ndim == 0:
            out[name] = value
            continue
        if value.shape[0] % workers:
            raise PSRunError(f"input '{name}' has {value.shape[0]} rows, which {workers} workers cannot split evenly")
        take = value.shape[0] // workers
        out[name] = value[worker * take:(worker + 1) * take]
    return out


class PSWorker:
    """Worker `rank` of a run under `plan`: `world` (mpi4py) reaches the servers, `workers` is
    the communicator of the workers only."""

    def __init__(self, rank: int, plan: PSPlan, world, workers: Communicator, dense: UpdateStep | None,
                 silent_s: float = 120.0) -> None:
        self.rank, self.plan, self.world, self.workers, self.dense = rank, plan, world, workers, dense
        self.silent_s = silent_s
        self.caches: dict[str, RowCache] = {}
        self.hits = self.lookups = 0
        self._rows: dict[int, dict[str, np.ndarray]] = {}  # step -> the table rows its batch touches
        self._pushes: list = []  # (server, request) of pushes in flight
        #: SSP and ASP under comm=ps without the HET cache: pull step t + 1 while computing step t,
        #: and leave a push in flight until the next one (docs/parameter-server.md, "Overlap")
        #: (`HSPMD_PS_OVERLAP=0` turns it off, for benchmarks/ps_consistency.py's comparison)
        self.overlap = (plan.comm == "ps" and plan.bound != 0 and not plan.cache_rows
                        and os.environ.get("HSPMD_PS_OVERLAP", "1") != "0")

    def pull(self, step: int, state: dict, batch: dict) -> tuple[int, int]:
        """Bring the served parameters this step reads into `state`; return (staleness, bytes)."""
        return self.receive(step, state, self.request(step, state, batch))

    def request(self, step: int, state: dict, batch: dict) -> tuple[dict, int]:
        """Ask the servers for what step `step` reads (of `batch`, this worker's rows); return what
        `receive` needs: (the requests, the bytes sent)."""
        requests: dict[int, dict] = {s: {} for s in range(self.plan.servers)}
        rows_of = self._rows.setdefault(step, {})
        for name, server in self.plan.homes.items():
            ids_input = self.plan.tables.get(name)
            if ids_input is None:
                requests[server][name] = None
                continue
            rows = np.unique(np.asarray(batch[ids_input]).ravel()).astype(np.int64)
            rows_of[name] = rows
            if self.plan.cache_rows:
                if name not in self.caches:
                    self.caches[name] = RowCache(self.plan.cache_rows, self.plan.cache_bound, state[name].shape,
                                                 state[name].dtype)
                missing = self.caches[name].missing(rows, step)
                self.hits += len(rows) - len(missing)
                self.lookups += len(rows)
                rows = missing
            requests[server][name] = rows
        moved = 0
        for server, request in requests.items():
            self._send((step, request), server, protocol.PULL)
            moved += protocol.message_bytes(request)
        return requests, moved

    def receive(self, step: int, state: dict, asked: tuple[dict, int]) -> tuple[int, int]:
        """Write the servers' replies to the requests `asked` of step `step` into `state`; return
        (staleness, bytes moved by request and replies)."""
        requests, moved = asked
        staleness = 0
        for server in requests:
            (_, values, server_staleness, _) = self._reply(server)
            staleness = max(staleness, server_staleness)
            moved += protocol.message_bytes(values)
            for name, value in values.items():
                rows = requests[server][name]
                if rows is None:
                    state[name] = np.array(value, copy=True)
                else:
                    state[name][rows] = value
                    if name in self.caches:
                        self.caches[name].store(rows, step)
        return staleness, moved

    def push(self, step: int, grads: dict) -> int:
        """Send the served parameters' gradients of `step` to their servers; return the bytes sent."""
        pushes: dict[int, dict] = {s: {} for s in range(self.plan.servers)}
        rows_of = self._rows.pop(step, {})
        for name, server in self.plan.homes.items():
            grad = grads[name]
            if name in rows_of:
                rows = rows_of[name]
                if name in self.caches:
                    pushes[server][name] = self.caches[name].accumulate(rows, grad[rows], step)
                else:
                    pushes[server][name] = (rows, grad[rows])
            else:
                pushes[server][name] = (None, grad)
        moved = 0
        self.finish_pushes()
        for server, push in pushes.items():
            self._pushes.append((server, self.world.isend((step, push), dest=self.plan.workers + server,
                                                          tag=protocol.PUSH)))
            moved += protocol.message_bytes(push)
        if not self.overlap:
            self.finish_pushes()
        return moved

    def finish_pushes(self) -> None:
        """Return once the servers have taken the pushes in flight (a server that takes nothing for
        `silent_s` is gone)."""
        start = time.monotonic()
        for server, request in self._pushes:
            while not request.Test():
                if time.monotonic() - start > self.silent_s:
                    raise self._gone(server)
                time.sleep(protocol.POLL_S)
        self._pushes = []

    def all_reduce_dense(self, step: int, state: dict, grads: dict, loss: float, scalars: dict,
                         stop: bool) -> tuple[float, bool]:
        """Sum the dense gradients, the loss and the wishes to stop over the workers, update the
        dense parameters; return the workers' mean loss and whether any worker stops now."""
        names = [] if self.dense is None else self.dense.params
        flat = np.concatenate([np.asarray(grads[n], np.float64).ravel() for n in names]
                              + [np.array([loss, float(stop)])])
        total = self.workers.all_reduce(flat, tuple(range(self.workers.size)))
        stop = bool(total[-1] > 0)
        total = total[:-1] / self.plan.workers
        if self.dense is not None:
            mean, at = {}, 0
            for n in names:
                g = grads[n]
                mean[n] = (None, total[at:at + g.size].reshape(g.shape).astype(g.dtype))
                at += g.size
            self.dense.apply(state, mean, scalars)
        return float(total[-1]), stop

    def final_parameters(self, state: dict) -> dict:
        """Return every parameter as the servers hold it now (whole tables too; not waiting for
        any clock), with this worker's own (dense, under hybrid) beside them."""
        out = dict(state)
        for server in range(self.plan.servers):
            request = {name: None for name, s in self.plan.homes.items() if s == server}
            self._send((0, request), server, protocol.PULL)
            _, values, _, clocks = self._reply(server)
            out.update(values)
            self.clocks = clocks
        return out

    def _send(self, payload, server: int, tag: int) -> None:
        """Send `payload` to server `server`; a server that does not take it in `silent_s` is gone."""
        try:
            protocol.send(self.world, payload, self.plan.workers + server, tag, self.silent_s)
        except protocol.Silence:
            raise self._gone(server) from None

    def _gone(self, server: int) -> PSRunError:
        return PSRunError(f"server {server} (rank {self.plan.workers + server}) has not answered for "
                          f"{self.silent_s:g} s: it is gone (or stuck); a run cannot go on without its "
                          "parameters (resume it from its last checkpoint, --checkpoint-dir)")

    def _reply(self, server: int, wanted: int = protocol.REPLY):
        """Return server `server`'s next message tagged `wanted`; a server silent for `silent_s` is
        an error (it is gone)."""
        from mpi4py import MPI

        try:
            while True:  # heartbeats: the server is alive, our pull waits on the clocks
                payload, _, tag = protocol.wait_for(self.world, self.plan.workers + server, MPI.ANY_TAG, self.silent_s)
                if tag == wanted:
                    break
        except protocol.Silence:
            raise self._gone(server) from None
        return payload

    def done(self) -> dict[int, int]:
        """Tell every server this worker has finished, with the cache's pending gradients, and wait
        for the servers to end; return the workers they lost ({worker: step lost at})."""
        last: dict[int, dict] = {s: {} for s in range(self.plan.servers)}
        for name, cache in self.caches.items():
            last[self.plan.homes[name]][name] = cache.flush()
        for server in range(self.plan.servers):
            self._send(last[server], server, protocol.DONE)
        lost: dict[int, int] = {}
        for server in range(self.plan.servers):
            lost.update(self._reply(server, protocol.END))
        return lost

    def hit_rate(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None


def _evaluate(script: str, params: dict, config: dict) -> dict:
    """Return the script's `evaluate(params, config)` (held-out metrics such as AUC), {} without one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hspmd_eval_" + os.path.basename(script).split(".")[0], script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.evaluate(params, config)) if hasattr(module, "evaluate") else {}


def train_worker(bundle: str, rank: int, plan: PSPlan, world, workers: Communicator, steps: int | None,
                 log: str | None, kernels: str = "cpu", quiet: bool = False, slow: float = 0.0,
                 seconds: float | None = None, silent_s: float = 120.0, heartbeat=None, checkpoints=None,
                 resumed: tuple[dict, int] | None = None, bursts=None,
                 device: str = "cpu") -> tuple[list[float], dict[int, int]]:
    """Run this worker's steps; return (its logged losses, the workers the servers lost). `slow` (seconds) is slept each step (a
    slowed worker, for tests and benchmarks); `bursts` (a `bursts.BurstSchedule`) slows this
    worker's own work in the steps it says (a bursty straggler); with `seconds` the worker stops starting steps once
    that much wall time has passed; `heartbeat` (a `protocol.Heartbeat`) is stopped before the
    servers are told this worker is done. Under hybrid, `checkpoints` (worker 0's
    `checkpoints.PSCheckpoints`) writes the dense parameters and states after each checkpoint
    step; `resumed` = (dense tensors, step) starts the run after that step. Rank 0 then
    evaluates the servers' parameters with the script's `evaluate` (if it has one) and logs the
    result as one more line, and the lost workers ({worker: step}) as another,
    `{"lost_workers": {"1": 5}}`. With `device` "cuda" the worker's step runs as the bundle's GPU
    program on the rank's GPU (`runtime/cuda/plan.py`): the worker's state stays on the host,
    where the pulls write it, and each step uploads it (a table whole, not only its pulled
    rows) and downloads the gradients it pushes."""
    from hspmd.runtime.comm.inprocess import InProcessCommunicator
    from hspmd.runtime.worker import RunError, _group_program, _load_device_program, load_batches, step_inputs
    from hspmd.runtime.kernel_exec import select_program
    from hspmd.runtime.plan import build_plan
    from hspmd.ir.ps_plan import DENSE_UPDATE_FILE

    manifest = read_manifest(bundle)
    entry = manifest.group_for(0)
    path = os.path.join(bundle, entry.program)
    kernel_path = os.path.join(bundle, entry.kernels) if entry.kernels is not None else None
    on_gpu = device == "cuda"
    if on_gpu:  # the worker's program has no collective: a world of its own
        program = _load_device_program(bundle, manifest, entry, InProcessCommunicator.create_world(1)[0],
                                       quiet or rank != 0, cuda_graph=True).plan
    else:
        module = select_program(lambda: _group_program(path, 0, verify=True),
                                (lambda: _group_program(kernel_path, 0)) if kernel_path else None, kernels)
        fn = next(op for op in module.body.block.ops if getattr(op, "sym_name", None) is not None
                  and op.sym_name.data == "train_step")
        program = build_plan(fn, 0, InProcessCommunicator.create_world(1)[0])
    dense_path = os.path.join(bundle, DENSE_UPDATE_FILE)
    dense = UpdateStep(open(dense_path).read(), dense_path) if os.path.exists(dense_path) else None
    config = manifest.config
    steps = int(config.get("steps", 10) if steps is None else steps)
    seed = int(config.get("seed", 0))
    state = program.initial_state(seed)
    if on_gpu:  # the pulls and the dense updates write the state on the host
        state = {name: np.asarray(value) for name, value in state.items()}
    if dense is not None:  # the dense optimizer states live on the workers under hybrid
        state.update({k: v for k, v in dense.initial_state(seed).items() if k not in state})
    names = {leaf.name: leaf.global_shape for leaf in program.inputs}
    update_inputs = dense.scalars if dense is not None else set()
    me = PSWorker(rank, plan, world, workers, dense, silent_s)
    done = 0
    if resumed is not None:
        tensors, done = resumed
        state.update(tensors)
    batches = load_batches(manifest.script, config)
    for _ in range(done):  # the data position: the batches the checkpointed steps consumed
        next(batches, None)
    log_file = open(log, "w") if log and rank == 0 else None
    meet = plan.comm == "hybrid" or plan.bound == 0
    losses = []
    began = time.perf_counter()
    step = 0
    ahead = None  # (rows, request) of a pull sent for the next step while computing this one
    try:
        for step in range(done + 1, steps + 1):
            fault_point(rank, step)
            start = time.perf_counter()
            if ahead is not None:
                mine, asked = ahead
                ahead = None
            else:
                batch = next(batches, None)
                if batch is None:
                    raise RunError(f"the script's batches ran out after {step - 1} steps")
                mine = local_rows(batch, rank, plan.workers)
                asked = me.request(step, state, mine)
            waiting = time.perf_counter()
            staleness, pulled = me.receive(step, state, asked)
            waited = time.perf_counter() - waiting
            if me.overlap and step < steps:  # the servers answer it while this step computes
                batch = next(batches, None)
                if batch is not None:
                    following = local_rows(batch, rank, plan.workers)
                    ahead = (following, me.request(step + 1, state, following))
            if slow:
                time.sleep(slow)
            computing = time.perf_counter()
            inputs = {**mine, **step_inputs(step, config, names)}
            outputs = program.run(dict(state) if on_gpu else state, program.local_batch(inputs))
            loss = float(outputs["loss"])
            grads = {k[len(GRAD_PREFIX):]: v for k, v in outputs.items() if k.startswith(GRAD_PREFIX)}
            if bursts is not None:  # its own work (all but the pull's wait) taken `factor` times as long
                time.sleep(bursts.extra_seconds(step, time.perf_counter() - start - waited))
            computed = time.perf_counter() - computing
            pushing = time.perf_counter()
            pushed = me.push(step, grads)
            meeting = time.perf_counter()
            # where the workers meet each step they stop together: any one's wish is everyone's
            stop = seconds is not None and time.perf_counter() - began > seconds
            if plan.comm == "hybrid":
                loss, stop = me.all_reduce_dense(step, state, grads, loss, step_inputs(step, config, update_inputs),
                                                 stop)
            elif meet:
                total = workers.all_reduce(np.array([loss, float(stop)]), tuple(range(workers.size)))
                loss, stop = float(total[0]) / plan.workers, bool(total[1] > 0)
            met = time.perf_counter() - meeting
            losses.append(loss)
            if checkpoints is not None and checkpoints.due(step) == step:
                lr = step_inputs(step, config, update_inputs).get("lr")
                checkpoints.save(step, state, None if lr is None else float(lr))
            elapsed = time.perf_counter() - start
            if rank == 0:
                record = {"step": step, "loss": loss, "time_s": elapsed, "ranks": plan.workers + plan.servers,
                          "staleness": staleness, "bytes": pulled + pushed, "wait_s": waited, "compute_s": computed,
                          "push_s": meeting - pushing, "meet_s": met}
                if me.hit_rate() is not None:
                    record["cache_hit_rate"] = me.hit_rate()
                if log_file:
                    log_file.write(json.dumps(record) + "\n")
                    log_file.flush()
                if not quiet:
                    print(f"step {step}/{steps}  loss {loss:.6g}  staleness {staleness}  {elapsed * 1e3:.1f} ms",
                          flush=True)
            if stop:
                break
        if ahead is not None:  # a pull sent ahead for a step not taken (--seconds): its reply is not used
            me.receive(step + 1, dict(state), ahead[1])
        me.finish_pushes()
        wall = time.perf_counter() - began
        final = me.final_parameters(state) if rank == 0 else None  # before DONE: the servers still serve
        if checkpoints is not None:
            checkpoints.close()
        if heartbeat is not None:
            heartbeat.stop()
        lost = me.done()
        if rank == 0 and lost and log_file:
            log_file.write(json.dumps({"step": step, "lost_workers": {str(w): s for w, s in sorted(lost.items())}})
                           + "\n")
        if rank == 0:
            metrics = _evaluate(manifest.script, final, config)
            if metrics:
                # every worker's pushed steps, as server 0 counted them (a worker gone is not waited for)
                samples = int(sum(me.clocks)) * (plan.batch_rows // plan.workers)
                record = {"step": step, **metrics, "wall_s": wall, "samples": samples,
                          "samples_per_s": samples / wall, "consistency": plan.consistency}
                if log_file:
                    log_file.write(json.dumps(record) + "\n")
                if not quiet:
                    print("eval: " + "  ".join(f"{k} {v:.4g}" for k, v in metrics.items()), flush=True)
    finally:
        if log_file:
            log_file.close()
    return losses, lost
