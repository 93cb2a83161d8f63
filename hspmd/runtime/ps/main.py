"""The entry point of every rank of a parameter-server run (what `hspmd run --servers K` starts).

`python -m hspmd.runtime.ps.main BUNDLE [--steps K] [--log FILE] [--kernels B] [--slow R:SECONDS]`
under `mpiexec -n N+K`: ranks 0..N-1 train as workers (`worker.train_worker`), ranks N..N+K-1
serve (`server.Server`). The world is split into the workers' communicator (their all-reduces)
and the servers'; `--slow R:SECONDS` sleeps worker R that long each step (a straggler, for tests
and benchmarks), `--slow-bursts F:SEED` slows every worker F times in bursts of 1-2 steps, about a
third of its steps, each from its own seeded schedule (`bursts.py`: SSP's case).

Faults (docs/parameter-server.md): `hspmd run` starts every rank under a guard with
`mpiexec -disable-auto-cleanup`, so a rank that dies leaves the others running. A worker beats
to every server from a thread (`protocol.Heartbeat`, every `--silent` / 5 seconds), so a server
tells a lost worker from a slow one. A rank that ends on an error said here ends with exit code
1 (no MPI_Abort: `hspmd run` stops the other ranks). A rank of a run that lost a worker ends
without MPI_Finalize, which would wait for the lost rank forever.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from hspmd.codegen.bundle import BundleError, read_manifest
from hspmd.ir.ps_plan import DENSE_UPDATE_FILE, PLAN_FILE, SERVER_UPDATE_FILE, PSPlan, PSPlanError
from hspmd.runtime.checkpoint.manifest import CheckpointError
from hspmd.runtime.ps.server import WorkerLost
from hspmd.runtime.ps.worker import PSRunError


def _end_now(code: int) -> None:
    """End this rank with `code` at once, without MPI_Finalize (which waits for every rank)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _scalars(config: dict, names: set[str]):
    """Return step -> the update's step inputs ("lr" from the schedule)."""
    from hspmd.runtime.worker import step_inputs

    return lambda step: step_inputs(step, config, names)


def _resume(path: str, update, holder: int, comm):
    """Return (tensors of `update` from checkpoint `path`, its step); ({}, step) without `update`."""
    from hspmd.runtime.checkpoint.manifest import read_manifest as read_checkpoint, resolve_checkpoint
    from hspmd.runtime.ps.checkpoints import resume

    if update is None or not update.leaves:
        return {}, read_checkpoint(resolve_checkpoint(path)).step
    return resume(path, update, holder, comm)


def _checkpoints(args, writer: int, plan: PSPlan, update, manifest, steps: int, seed: int, resumed):
    """Return writer `writer`'s `PSCheckpoints` of this run (servers 0..K-1, then hybrid's worker 0)."""
    from hspmd.runtime.checkpoint.writer import RunInfo
    from hspmd.runtime.ps.checkpoints import PSCheckpoints

    dense = os.path.join(args.bundle, DENSE_UPDATE_FILE)
    writers = plan.servers + (1 if plan.comm == "hybrid" and os.path.exists(dense) else 0)
    info = RunInfo(manifest.strategy, manifest.num_devices, manifest.script, manifest.config, seed)
    return PSCheckpoints(args.checkpoint_dir, writer, writers, update, info, args.checkpoint_every, steps, args.keep,
                         resumed[1] if resumed else 0)


def main(argv: list[str] | None = None) -> int:
    """Run this MPI rank as a worker or a server; return the exit code."""
    parser = argparse.ArgumentParser(prog="python -m hspmd.runtime.ps.main")
    parser.add_argument("bundle")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--log")
    parser.add_argument("--kernels", default="cpu")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the workers' steps run")
    parser.add_argument("--slow", help="R:SECONDS: worker R sleeps that long each step")
    parser.add_argument("--slow-bursts", help="F:SEED: every worker slowed F times in bursts of 1-2 steps (bursts.py)")
    parser.add_argument("--cpu-bind", help="one core per rank (workers, then servers), e.g. 0,1,0")
    parser.add_argument("--silent", type=float, default=10.0,
                        help="seconds of silence after which a server counts a worker as gone (a worker "
                             "waits twice as long for a server)")
    parser.add_argument("--seconds", type=float, help="stop starting steps after this much wall time")
    parser.add_argument("--checkpoint-dir", help="write sharded checkpoints here (the servers' tensors)")
    parser.add_argument("--checkpoint-every", type=int)
    parser.add_argument("--keep", type=int)
    parser.add_argument("--resume", help="start from this checkpoint (a directory's newest, or D/step-<k>)")
    args = parser.parse_args(argv)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    # Hydra under -disable-auto-cleanup signals SIGUSR1 to the ranks when one ends; its default
    # action would end a survivor too
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        plan = PSPlan.from_json(open(os.path.join(args.bundle, PLAN_FILE)).read())
        manifest = read_manifest(args.bundle)
    except (OSError, PSPlanError, BundleError) as err:
        print(f"hspmd run (rank {rank}): error: {err}", file=sys.stderr, flush=True)
        world.Abort(1)
        return 1
    if world.Get_size() != plan.workers + plan.servers:
        if rank == 0:
            print(f"hspmd run: error: the bundle is for {plan.workers} workers and {plan.servers} servers, "
                  f"the run has {world.Get_size()} ranks", file=sys.stderr, flush=True)
        return 1
    if args.cpu_bind:  # checked by `hspmd run` before launching
        from hspmd.runtime.profiler import bind_cpu, parse_cpu_bind

        bind_cpu(parse_cpu_bind(args.cpu_bind, world.Get_size())[rank])
    is_worker = rank < plan.workers
    role = world.Split(0 if is_worker else 1, rank)
    heartbeat = None
    try:
        from hspmd.runtime.comm.mpi import MPICommunicator
        from hspmd.runtime.ps.update import UpdateStep

        config = manifest.config
        steps = int(config.get("steps", 10) if args.steps is None else args.steps)
        seed = int(config.get("seed", 0))
        if is_worker:
            from hspmd.runtime.ps.protocol import Heartbeat
            from hspmd.runtime.ps.worker import train_worker

            servers = list(range(plan.workers, plan.workers + plan.servers))
            heartbeat = Heartbeat(world, servers, args.silent / 5).start()
            slow = 0.0
            if args.slow:
                who, seconds = args.slow.split(":")
                slow = float(seconds) if int(who) == rank else 0.0
            workers = MPICommunicator(role)
            dense_path = os.path.join(args.bundle, DENSE_UPDATE_FILE)
            dense = UpdateStep(open(dense_path).read(), dense_path) if os.path.exists(dense_path) else None
            resumed = checkpoints = None
            if args.resume:
                resumed = _resume(args.resume, dense, rank, workers)
            if args.checkpoint_dir and dense is not None and rank == 0:
                checkpoints = _checkpoints(args, plan.servers, plan, dense, manifest, steps, seed, resumed)
            bursts = None
            if args.slow_bursts:  # checked by `hspmd run` before launching
                from hspmd.runtime.ps.bursts import BurstSchedule, parse_bursts

                factor, burst_seed = parse_bursts(args.slow_bursts)
                bursts = BurstSchedule(factor, burst_seed, rank)
            _, lost = train_worker(args.bundle, rank, plan, world, workers, steps, args.log,
                                   args.kernels, slow=slow, seconds=args.seconds, silent_s=2 * args.silent,
                                   heartbeat=heartbeat, checkpoints=checkpoints, resumed=resumed, bursts=bursts,
                                   device=args.device)
        else:
            from hspmd.runtime.ps.server import Server

            k = rank - plan.workers
            path = os.path.join(args.bundle, SERVER_UPDATE_FILE.format(k=k))
            update = UpdateStep(open(path).read(), path, set(plan.tables))
            resumed = _resume(args.resume, update, k, MPICommunicator(role)) if args.resume else None
            checkpoints = (_checkpoints(args, k, plan, update, manifest, steps, seed, resumed)
                           if args.checkpoint_dir else None)
            lost = Server(k, plan, update, seed, _scalars(config, update.scalars), args.silent,
                          rank, checkpoints, resumed).serve(world)
    except (PSRunError, WorkerLost, CheckpointError) as err:
        what = "worker" if is_worker else "server"
        print(f"hspmd run ({what} rank {rank}): error: {err}", file=sys.stderr, flush=True)
        _end_now(1)
    except Exception as err:  # one message, then end the whole job: the other ranks wait on this one
        what = "worker" if is_worker else "server"
        print(f"hspmd run ({what} rank {rank}): error: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        world.Abort(1)
        return 1
    finally:
        if heartbeat is not None:
            heartbeat.stop()
    if lost:
        _end_now(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
