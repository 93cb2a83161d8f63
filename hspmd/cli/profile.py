"""`hspmd profile -n N [-o profile.json] [--cpu-bind LIST] [--device cpu|cuda[,...]]`: measure a device profile on N ranks.

Starts N ranks of `hspmd.runtime.profiler` under mpiexec (`hspmd.runtime.launcher.launch`), which
measure together and write the profile (`hspmd.ir.device_profile`); then prints its summary.
`--cpu-bind 0,0,1` pins rank r to core LIST[r] (each rank calls `os.sched_setaffinity` when it
starts), so ranks of unequal speed can be made on one machine; pinned ranks use one math
library thread each unless OMP_NUM_THREADS etc. say otherwise. `--device cuda` measures the
compute rates of each rank's GPU (an error where there is no usable GPU); one entry per rank
(`--device cuda,cpu`) measures GPU and CPU ranks in one profile, their kinds in its meta.
"""

from __future__ import annotations

import os
import sys

__all__ = ["add_profile_parser", "cmd_profile"]

#: the file `hspmd profile` writes and `hspmd compile --cost --profile` reads by default
DEFAULT_PROFILE = "profile.json"


def cmd_profile(args) -> int:
    """Run the profile on `args.n` ranks, write `args.output`, print its summary."""
    from hspmd.ir.device_profile import DeviceProfile
    from hspmd.runtime.launcher.launch import THREAD_VARIABLES, LaunchError, launch, usable_cores
    from hspmd.runtime.profiler import parse_cpu_bind

    from hspmd.runtime.cuda.device import DeviceError
    from hspmd.runtime.cuda.select import device_entries, devices_text, rank_devices

    if args.reps < 1 or args.seconds_per_point <= 0:
        raise SystemExit("hspmd: error: --reps must be at least 1 and --seconds-per-point positive")
    try:
        device = devices_text(rank_devices(device_entries(args.device, args.n), [None] * args.n))
    except DeviceError as err:
        print(f"hspmd: error: {err}", file=sys.stderr)
        return 2
    worker = ["-m", "hspmd.runtime.profiler", os.path.abspath(args.output), "--reps", str(args.reps),
              "--seconds-per-point", str(args.seconds_per_point), "--device", device]
    env = dict(os.environ)
    if args.cpu_bind:
        cores = parse_cpu_bind(args.cpu_bind, args.n)
        allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(usable_cores()))
        missing = sorted(set(cores) - allowed)
        if missing:
            raise SystemExit(f"hspmd: error: --cpu-bind names core {missing[0]}, but this process may use "
                             f"cores {sorted(allowed)}")
        worker += ["--cpu-bind", args.cpu_bind]
        for name in THREAD_VARIABLES:
            env.setdefault(name, "1")
    if os.path.exists(args.output):
        os.remove(args.output)  # never mistake an earlier run's file for this one's
    code = launch(args.n, worker, env=env, timeout=args.timeout, cpu_bind=cores if args.cpu_bind else None)
    if code != 0:
        raise LaunchError(f"the profile run failed (exit code {code}); {args.output} not written")
    profile = DeviceProfile.load(args.output)
    sys.stdout.write(profile.summary())
    print(f"wrote {args.output}")
    return 0


def add_profile_parser(sub) -> None:
    """Add the `profile` subcommand to the subparsers `sub`."""
    p = sub.add_parser("profile", help="measure each rank's compute rates and the links and collectives between "
                                       "ranks; write a device profile (docs/planning.md)")
    p.add_argument("-n", type=int, default=1, help="number of ranks (MPI processes)")
    p.add_argument("-o", "--output", default=DEFAULT_PROFILE, help=f"the profile to write ({DEFAULT_PROFILE})")
    p.add_argument("--cpu-bind", metavar="LIST", help="pin rank r to core LIST[r], e.g. 0,0,1")
    p.add_argument("--reps", type=int, default=5, help="repetitions of each message (best kept) and calls of each collective per timed window (5)")
    p.add_argument("--seconds-per-point", type=float, default=0.15,
                   help="seconds each compute rate is measured for (0.15)")
    p.add_argument("--timeout", type=float, default=300.0, help="kill the ranks after this many seconds (300)")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda|auto[,...]",
                   help="measure the compute rates of the CPU (the default) or of the rank's GPU (cuda; auto: "
                        "cuda where CuPy finds a GPU and there is one rank); or one entry per rank, e.g. cuda,cpu "
                        "(GPU and CPU ranks in one profile, which the planner keeps in groups of one kind)")
    p.set_defaults(func=cmd_profile)
