"""`hspmd run` as one rank of a job an outside launcher started (docs/clusters.md).

    mpiexec -n 2 hspmd run -n 2 examples/mlp.py          # one job of 2 ranks, not two jobs
    srun hspmd run examples/gpt.py --strategy '[0-7]: dp=2 tp=4'
    mpirun --hostfile hosts -n 8 hspmd run examples/gpt.py

Every rank runs this: rank 0 compiles the script and hands the bundle to the others
(`hspmd.runtime.launcher.outside.share_bundle`), then every rank trains as that rank of the job. What
would be said once by `hspmd run` is said once, by rank 0; the other ranks end with the same
code, quietly.
"""

from __future__ import annotations

from collections.abc import Callable

from hspmd.runtime.launcher.launch import LaunchError
from hspmd.runtime.launcher.outside import OutsideJob

__all__ = ["check_outside_options", "run_outside"]


def check_outside_options(args, job: OutsideJob) -> str | None:
    """Return the one-line reason `hspmd run`'s `args` cannot run as a rank of `job`, None if they can."""
    if args.n != job.size:
        return (f"-n {args.n}, but this runs in a job of {job.size} rank{'s' if job.size != 1 else ''} that "
                f"{job.launcher} started: give -n {job.size} or leave -n out")
    if args.elastic:
        return (f"--elastic restarts ranks itself with MPICH's Hydra mpiexec; inside a job that {job.launcher} "
                "started it cannot (run 'hspmd run --elastic' outside the job, or let the launcher restart it)")
    if args.servers is not None:
        return ("--servers starts the parameter-server ranks itself; inside a job another launcher started, "
                "run hspmd run --servers outside it")
    if args.hosts or args.hostfile:
        return f"--hosts and --hostfile are mpiexec's; inside a job that {job.launcher} started, the launcher places the ranks"
    return None


def run_outside(args, job: OutsideJob, compile_for_run: Callable, worker_arguments: Callable) -> int:
    """Run `hspmd run`'s `args` as rank `job.rank` of `job`; return this rank's exit code.

    `compile_for_run` and `worker_arguments` are `hspmd.cli.main`'s (passed in, as to
    `hspmd.cli.elastic`). Errors found before training are raised on rank 0 (the CLI says them
    in one line) and end the other ranks with code 1, silently."""
    from hspmd.runtime.launcher.outside import BundleNotShared, prepare_rank_environment, share_bundle

    problem = check_outside_options(args, job)
    if problem is not None:
        if job.rank == 0:
            raise LaunchError(problem)
        return 1
    prepare_rank_environment(job)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.Get_size() != job.size:  # mpi4py's MPI is not the launcher's: each rank is alone
        if job.rank == 0:
            raise LaunchError(f"{job.launcher} started {job.size} ranks, but this MPI library "
                              f"({MPI.Get_library_version().splitlines()[0].strip()}) sees a job of "
                              f"{world.Get_size()}: mpi4py must use the launcher's MPI (docs/clusters.md)")
        return 1
    if world.Get_rank() == 0:
        try:
            bundle = compile_for_run(args, args.n, args.strategy)
        except BaseException as err:  # said by the CLI on this rank; the others only end
            share_bundle(world, None, f"{type(err).__name__}: {err}")
            raise
        share_bundle(world, bundle)
    else:
        try:
            bundle = share_bundle(world, None, directory=getattr(args, "scratch", None))
        except BundleNotShared:
            return 1
    from hspmd.runtime.comm.mpi import MPICommunicator
    from hspmd.runtime.worker import main as worker_main

    return worker_main(worker_arguments(args, bundle)[2:], MPICommunicator())
