"""`hspmd run -n N --servers K`: a parameter-server run (docs/parameter-server.md).

The strategy names one group of N data-parallel workers with `comm=ps` or `comm=hybrid`; the
run is one `mpiexec` of N + K ranks (`hspmd.runtime.ps.main`): workers 0..N-1, servers N..N+K-1,
each under a guard (`hspmd.runtime.launcher.watch`), so that a worker that dies under ASP or
SSP leaves the others running; what a death means is `hspmd.runtime.ps.faults`.
"""

from __future__ import annotations

import os
import sys
import tempfile


def uses_servers(strategy: str | None) -> bool:
    """Return whether `strategy` (text, or None) asks for parameter servers."""
    if not strategy or strategy == "auto":
        return False
    from hspmd.ir.strategy import parse_strategy

    return any(g.comm != "allreduce" for g in parse_strategy(strategy).groups)


def run_parameter_servers(args) -> int:
    """Compile `args.script` for a parameter-server run and launch it; return the exit code."""
    from hspmd.compiler import compile_ps, write_ps_bundle
    from hspmd.frontend.script import load_script, parse_overrides
    from hspmd.ir.strategy import StrategyError, parse_strategy
    from hspmd.ir.ps_plan import PLAN_FILE, PSPlan
    from hspmd.runtime.ps import faults
    from hspmd.runtime.launcher.watch import start_watched, watch_started

    if not args.strategy or not uses_servers(args.strategy):
        raise SystemExit("hspmd: error: --servers needs a strategy with comm=ps or comm=hybrid, "
                         "e.g. --strategy '[0,1]: dp=2 comm=ps consistency=bsp'")
    if not args.servers or args.servers < 1:
        raise StrategyError(f"strategy '{parse_strategy(args.strategy)}' uses parameter servers: "
                            "give their number with --servers K (K >= 1)")
    if os.path.isdir(args.script):
        raise SystemExit("hspmd: error: a parameter-server run compiles its script; give the .py, not a bundle")
    if len(getattr(args, "strategies", None) or []) > 1 or getattr(args, "switch_every", None):
        raise SystemExit("hspmd: error: a parameter-server run takes one --strategy (graph switching "
                         "is not supported with --servers yet)")
    for flag in ("checkpoint", "init_from", "elastic", "trace"):
        if getattr(args, flag, None):
            raise SystemExit(f"hspmd: error: --{flag.replace('_', '-')} is not supported with --servers yet")
    parse_strategy(args.strategy).check_devices(args.n)
    if getattr(args, "resume", None):  # said once here, not by every rank
        from hspmd.runtime.checkpoint.manifest import CheckpointError, read_manifest, resolve_checkpoint

        try:
            read_manifest(resolve_checkpoint(args.resume))
        except CheckpointError as err:
            raise SystemExit(f"hspmd: error: {err}") from None
    script = load_script(args.script, parse_overrides(args.set))
    compiled = compile_ps(script, args.strategy, args.servers)
    bundle = args.dump_dir or tempfile.mkdtemp(prefix="hspmd-ps-bundle-", dir=getattr(args, "scratch", None))
    on_gpu = getattr(args, "device", "cpu") == "cuda"  # every worker (hspmd.cli.main.run_device); servers on the host
    write_ps_bundle(compiled, bundle, device=on_gpu)
    argv = ["-m", "hspmd.runtime.ps.main", bundle, "--kernels", args.kernels, "--device", "cuda" if on_gpu else "cpu"]
    for name in ("steps", "log"):
        if getattr(args, name, None) is not None:
            argv += ["--" + name, str(getattr(args, name))]
    if args.cpu_bind:
        from hspmd.runtime.profiler import parse_cpu_bind

        parse_cpu_bind(args.cpu_bind, args.n + args.servers)
        argv += ["--cpu-bind", args.cpu_bind]
    for name in ("checkpoint_dir", "checkpoint_every", "keep", "resume"):
        if getattr(args, name, None) is not None:
            argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if getattr(args, "seconds", None):
        argv += ["--seconds", str(args.seconds)]
    if getattr(args, "slow_worker", None):
        argv += ["--slow", args.slow_worker]
    if getattr(args, "slow_bursts", None):
        from hspmd.runtime.ps.bursts import parse_bursts

        try:
            parse_bursts(args.slow_bursts)
        except ValueError as err:
            raise SystemExit(f"hspmd: error: {err}") from None
        argv += ["--slow-bursts", args.slow_bursts]
    if getattr(args, "silent_after", None):
        argv += ["--silent", str(args.silent_after)]
    plan = PSPlan.from_json(open(os.path.join(bundle, PLAN_FILE)).read())
    status_dir = os.path.join(bundle, "ranks")
    proc = start_watched(args.n + args.servers, argv, status_dir, hosts=args.hosts, hostfile=args.hostfile)
    run = watch_started(proc, status_dir, stop_if=lambda end: faults.stops_the_run(plan, end))
    code, message = faults.outcome(plan, run)
    if message:
        print(f"hspmd run: error: {message}", file=sys.stderr, flush=True)
    return code
