"""`hspmd`: compile model scripts through the three IR levels and run them on N ranks.

    hspmd compile SCRIPT [--strategy TEXT] [--dump-dir DIR] [--level L] [--report] [--explain] [--set K=V ...]
    hspmd compile SCRIPT [--strategy TEXT] --print-pipeline [--level L]
    hspmd compile|run ... [--load-pass F] [--pass-after NAME=PASS] [--print-ir-after-all] [--pass-timing]
    hspmd compile SCRIPT [--strategy TEXT] [-n N] --cost [--profile P]
    hspmd run -n N SCRIPT|BUNDLE [--strategy TEXT ...] [--switch-every K] [--steps K] [--log FILE] [--checkpoint FILE] [--trace FILE]
    hspmd plot LOG.jsonl [MORE.jsonl ...] [-o loss.png]
    hspmd plan SCRIPT -n N [--profile P] [--memory-per-rank SIZE] [--top K]
    hspmd checkpoint info|export D [--to FILE | --hf DIR]
    hspmd data prepare FILES... --tokenizer byte|bpe:VOCAB|PATH.json -o DIR;  hspmd data info DIR
    hspmd profile -n N [-o profile.json] [--cpu-bind LIST]
    hspmd opt FILE [-p PASSES] ...          (the same as hspmd-opt)
    hspmd reduce FILE --test CMD [-o OUT]   (shrink IR while CMD still fails on it)
    hspmd compare FILE [--strategy TEXT]    (N ranks against 1 device on an IR file)

Errors a user can cause end in one message on stderr and exit code 1, never a traceback. A pass
failing after the strategy checks is the compiler's bug: `hspmd: internal error in <pass>: ...`,
the file holding the IR it was given, a request to report it, exit code 3.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from lark.exceptions import LarkError

from hspmd.cli.errors import describe

def _user_errors() -> tuple[type[BaseException], ...]:
    """Return the exception classes that mean "the user's input is wrong"."""
    from hspmd.dialects.sharding import ShardingError
    from hspmd.frontend.script import ScriptError
    from hspmd.ir.strategy import StrategyError
    from hspmd.frontend.tracing import TraceError
    from hspmd.dialects.context import IRTextError
    from hspmd.ir.layout import LayoutError
    from hspmd.ir.layout_text import LayoutSyntaxError
    from hspmd.dialects.levels import LevelError
    from hspmd.codegen.bundle import BundleError
    from hspmd.runtime.launcher.launch import LaunchError
    from hspmd.runtime.plan import PlanError
    from hspmd.runtime.worker import RunError
    from hspmd.runtime.checkpoint.manifest import CheckpointError
    from hspmd.runtime.launcher.fault import FaultSpecError
    from hspmd.transforms.util import PassError
    from hspmd.planner import PlanError as PlannerError
    from hspmd.ir.device_profile import ProfileError
    from hspmd.runtime.profiler import ProfileRunError
    from hspmd.codegen.cost_model import CostError
    from hspmd.cli.plot import PlotError
    from hspmd.ir.switch_plan import SwitchError
    from hspmd.runtime.cuda.device import DeviceError
    from hspmd.data.errors import DataError
    from hspmd.cli.opt import LoadPassError

    return (
        ScriptError, StrategyError, TraceError, IRTextError, LayoutError, LayoutSyntaxError, LevelError,
        BundleError, LaunchError, PlanError, RunError, PassError, ShardingError, LarkError, OSError, CheckpointError,
        FaultSpecError, PlannerError, ProfileError, ProfileRunError, CostError, PlotError, SwitchError, DeviceError,
        DataError,
        LoadPassError,
    )


#: the exit code of a compiler bug (a user's error exits 1, a bad command line 2)
INTERNAL_ERROR_EXIT = 3


def report_internal_error(err) -> None:
    """Print an `InternalError` (a pass after the strategy checks failed) as a compiler bug: the pass,
    its message, where the IR it was given is, and a request to report it."""
    print(f"hspmd: {err}", file=sys.stderr)
    if err.ir_path:
        print(f"hspmd: the IR given to {err.pass_name} is in {err.ir_path}", file=sys.stderr)
    print("hspmd: this is a bug in hspmd, not in your model or strategy: please report it with the command "
          "you ran" + (" and that file" if err.ir_path else ""), file=sys.stderr)


def _add_script_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", action="append", dest="strategies", metavar="STRATEGY",
                   help="strategy text, e.g. '[0,1]: dp=2' (default: data parallel over -n); 'auto' plans one "
                        "(hspmd run); repeat it to compile several and switch between them (docs/switching.md)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override an entry of the script's config")


def _one_strategy(args) -> None:
    """Set `args.strategy` to the one `--strategy` given (None without one); several are for
    graph switching, which `--switch-every` (or a script's `strategy_for`) drives."""
    strategies = getattr(args, "strategies", None) or []
    args.strategy = strategies[0] if strategies else None
    if len(strategies) > 1 and "auto" in strategies:
        raise SystemExit("hspmd: error: --strategy auto plans one strategy; it cannot be one of several")
    bundle = os.path.isdir(getattr(args, "script", "") or "")
    if getattr(args, "switch_every", None) is not None and len(strategies) < 2 and not bundle:
        raise SystemExit("hspmd: error: --switch-every needs two or more --strategy")


def _load_and_compile(args, n: int):
    from hspmd.compiler import compile_script, compile_strategies, default_strategy
    from hspmd.frontend.script import load_script, parse_overrides

    script = load_script(args.script, parse_overrides(args.set))
    passes = getattr(args, "passes", None)
    if len(args.strategies or []) > 1:
        return compile_strategies(script, args.strategies, n, passes=passes)
    return compile_script(script, args.strategy or default_strategy(n), n, passes=passes)


def _memory_before_after(args, compiled, n: int) -> str:
    """Return the planned memory per rank of `compiled`, and where its strategy asks for ZeRO or
    recompute, of the same strategy without them (compiled again) above it."""
    from dataclasses import replace

    from hspmd.codegen.schedule.analysis import format_memory_rows, memory_rows
    from hspmd.ir.strategy import Strategy

    strategy = compiled.strategy.strategy
    text = format_memory_rows(memory_rows(compiled.physical), f"planned memory per rank under '{strategy}':")
    if not any(g.zero or g.recompute != "none" for g in strategy.groups):
        return text
    base = Strategy(tuple(replace(g, zero=0, recompute="none") for g in strategy.groups))
    from hspmd.compiler import compile_script

    before = compile_script(compiled.script, str(base), n, microbatches=compiled.strategy.microbatches,
                            pipeline_schedule=compiled.strategy.schedule,
                            passes=compiled.manager.quiet() if compiled.manager is not None else None)
    return format_memory_rows(memory_rows(before.physical), f"planned memory per rank before zero/recompute, "
                              f"under '{base}':") + text


def cmd_compile(args) -> int:
    from hspmd.compiler import write_bundle
    from hspmd.ir.strategy import parse_strategy
    from hspmd.dialects.context import module_text

    if args.emit == "kernels" and not args.dump_dir:
        raise SystemExit("hspmd: error: --emit kernels needs --dump-dir")
    _one_strategy(args)
    n = args.n or (parse_strategy(args.strategy).num_devices if args.strategy else 1)
    if args.print_pipeline:
        from hspmd.cli.pass_flags import print_pipeline

        return print_pipeline(args, n)
    from hspmd.cli.pass_flags import finish_passes, pass_manager

    args.passes = pass_manager(args, args.level)
    level = args.level or "physical"
    compiled = _load_and_compile(args, n)
    if isinstance(compiled, list):  # several strategies: a switching bundle, or each one's level
        if args.report or args.explain or args.cost or args.emit:
            raise SystemExit("hspmd: error: --report, --explain, --cost and --emit take one --strategy")
        if not args.dump_dir:
            for i, c in enumerate(compiled):
                sys.stdout.write(f"// strategy {i}: {c.strategy.strategy}\n{module_text(getattr(c, level))}")
            finish_passes(args.passes)
            return 0
    if args.dump_dir:
        write_bundle(compiled, args.dump_dir)  # groups saying device=cuda get their GPU programs
        files = sorted(os.listdir(args.dump_dir))
        print(f"wrote {', '.join(files)} to {args.dump_dir}")
    if args.emit == "kernels":
        from hspmd.codegen.dump import write_kernel_sources

        written = write_kernel_sources([m for _, m in compiled.kernel_groups()], args.dump_dir)
        levels = ", ".join(f"kernel_group{i}.mlir" for i in range(len(compiled.kernel_groups())))
        print(f"wrote {len(written)} kernels of {levels} in {os.path.join(args.dump_dir, 'kernels')}")
    if args.report:
        from hspmd.codegen.report import collective_report, format_report

        sys.stdout.write(format_report(collective_report(compiled.physical), compiled.physical))
        from hspmd.codegen.schedule.analysis import memory_report

        sys.stdout.write(memory_report(compiled.physical))
        sys.stdout.write(_memory_before_after(args, compiled, n))
    if args.explain:
        from hspmd.codegen.report import explain_rows, format_explain

        from hspmd.compiler import annotate_with_provenance

        sys.stdout.write(format_explain(explain_rows(*annotate_with_provenance(compiled))))
    if args.cost:
        sys.stdout.write(cost_text(compiled, n, args.profile))
    elif args.profile:
        raise SystemExit("hspmd: error: --profile needs --cost")
    if not (args.dump_dir or args.report or args.explain or args.cost):
        sys.stdout.write(module_text(getattr(compiled, level)))
    finish_passes(args.passes)
    return 0


def cost_text(compiled, n: int, profile_path: str | None) -> str:
    """Return `hspmd compile --cost`'s table: the predicted step of `compiled` on `n` ranks under the
    profile at `profile_path` (None: `DeviceProfile.default_cpu`, and the output says so)."""
    from hspmd.codegen.cost_model import estimate_cost
    from hspmd.ir.device_profile import DeviceProfile

    profile = DeviceProfile.default_cpu(n) if profile_path is None else DeviceProfile.load_for(profile_path, n)
    return estimate_cost(compiled.kernel_groups(), profile).format()


#: `hspmd run` options handed on to every rank (`hspmd.runtime.worker`), by their worker flag
WORKER_OPTIONS = ("steps", "log", "checkpoint", "kernels", "checkpoint_dir", "checkpoint_every", "keep", "resume",
                  "init_from", "cpu_bind", "trace", "progress", "switch_every", "device", "cuda_graph", "ranks_per_node")


def worker_arguments(args, bundle: str) -> list[str]:
    """Return the arguments of `python -m hspmd.runtime.worker` for `hspmd run`'s `args`."""
    out = ["-m", "hspmd.runtime.worker", bundle]
    for name in WORKER_OPTIONS:
        value = getattr(args, name, None)
        if value is not None:
            out += ["--" + name.replace("_", "-"), str(value)]
    return out


def check_run_options(args) -> None:
    """Raise SystemExit (an argparse-style message) for `hspmd run` options that do not go together."""
    if args.steps is not None and args.steps < 1:
        raise SystemExit(f"hspmd: error: --steps {args.steps}: a run trains at least 1 step")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise SystemExit("hspmd: error: --checkpoint-every must be at least 1")
    if args.keep is not None and args.keep < 1:
        raise SystemExit("hspmd: error: --keep must be at least 1")
    if (args.checkpoint_every is not None or args.keep is not None) and not args.checkpoint_dir:
        raise SystemExit("hspmd: error: --checkpoint-every and --keep need --checkpoint-dir")
    if args.resume and args.init_from:
        raise SystemExit("hspmd: error: --resume and --init-from exclude each other")
    if args.switch_every is not None and args.switch_every < 1:
        raise SystemExit("hspmd: error: --switch-every must be at least 1")
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        raise SystemExit("hspmd: error: --ranks-per-node must be at least 1")
    if len(getattr(args, "strategies", None) or []) > 1 and (args.elastic or args.checkpoint_dir or args.resume or args.init_from):
        raise SystemExit("hspmd: error: several --strategy (graph switching) do not go together with checkpoints "
                         "or --elastic yet")
    if args.elastic and not args.checkpoint_dir:
        raise SystemExit("hspmd: error: --elastic needs --checkpoint-dir (it resumes from there)")
    if (args.fallback_strategy or args.max_restarts != 3) and not args.elastic:
        raise SystemExit("hspmd: error: --fallback-strategy and --max-restarts need --elastic")
    if args.max_restarts < 0:
        raise SystemExit("hspmd: error: --max-restarts must be at least 0")
    from hspmd.cli.elastic import parse_redundancy

    args.redundancy = parse_redundancy(args.redundancy, args.elastic)  # K of --redundancy peer:K
    if args.cpu_bind and args.elastic:
        raise SystemExit("hspmd: error: --cpu-bind names a core per rank and cannot follow --elastic's restarts")
    if args.cpu_bind:
        from hspmd.runtime.profiler import parse_cpu_bind

        parse_cpu_bind(args.cpu_bind, args.n + (args.servers or 0))  # servers are ranks too
    if args.trace is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.trace))):
        raise SystemExit(f"hspmd: error: --trace {args.trace}: its directory does not exist")


def compile_for_run(args, n: int, strategy: str | None) -> str:
    """Return the bundle `hspmd run` runs on `n` ranks: `args.script` itself when it is a bundle
    directory, else the script compiled under `strategy` (default: data parallel over `n`)."""
    from hspmd.compiler import write_bundle
    from hspmd.codegen.bundle import read_manifest
    from hspmd.compiler import compile_script, default_strategy
    from hspmd.frontend.script import load_script, parse_overrides

    from hspmd.cli.pass_flags import finish_passes, pass_manager, say_user_passes

    if os.path.isdir(args.script):
        if strategy or args.set:
            raise SystemExit("hspmd: error: a bundle is already compiled; --strategy and --set apply to scripts only")
        if pass_manager(args) is not None:
            raise SystemExit("hspmd: error: a bundle is already compiled; --load-pass, --pass-after, --pass-before, "
                             "--pipeline and the IR printing flags apply to scripts only")
        manifest = read_manifest(args.script)
        if (manifest.world_size or manifest.num_devices) != n:
            from hspmd.runtime.worker import RunError

            raise RunError(
                f"bundle {args.script} was compiled for {manifest.world_size or manifest.num_devices} devices "
                f"(strategy '{manifest.strategy}') but -n is {n}"
            )
        say_user_passes(manifest.user_passes, f"bundle {args.script}")
        return args.script
    from hspmd.compiler import compile_working
    from hspmd.runtime.launcher.idle import mark_working_ranks

    script = load_script(args.script, parse_overrides(args.set))
    passes = pass_manager(args)
    ranks = tuple(range(n))  # the ranks that work; the others stay idle (hspmd.runtime.launcher.idle)
    if len(getattr(args, "strategies", None) or []) > 1:
        from hspmd.compiler import compile_strategies

        compiled = compile_strategies(script, args.strategies, n, passes=passes)
    elif strategy == "auto":
        from hspmd.cli.plan import auto_strategy

        compiled, ranks = auto_strategy(args, script, n, passes)
    elif strategy:
        compiled, ranks = compile_working(script, strategy, n, passes=passes)
    else:
        compiled = compile_script(script, default_strategy(n), n, passes=passes)
    # without --dump-dir, the bundle lives in the command's scratch directory, removed when it ends
    bundle = args.dump_dir or tempfile.mkdtemp(prefix="hspmd-bundle-", dir=getattr(args, "scratch", None))
    from hspmd.runtime.cuda.select import rank_device

    if strategy == "auto" and getattr(args, "device_asked", None) is not None:
        args.device = planned_devices(args, compiled, n, ranks)  # the plan's device= keys decide "auto" entries
    kinds = [rank_device(getattr(args, "device", "cpu"), r) for r in ranks]
    write_bundle(compiled, bundle, device=kinds)  # GPU programs for the groups of GPU ranks
    mark_working_ranks(bundle, ranks, n)
    finish_passes(passes)
    first = compiled[0] if isinstance(compiled, list) else compiled
    say_user_passes(first.user_passes, f"the program of {args.script}")
    return bundle


def run_device(args) -> str:
    """Return the workers' `--device` for `hspmd run`: "cpu", "cuda", or one kind per rank
    (`cuda,cuda,cpu`), from `--device` (one entry, or one per rank; `--kernels cuda` is a
    spelling of `--device cuda`) and the strategy groups' `device=` keys; DeviceError where the
    GPU run asked for cannot be."""
    from hspmd.runtime.cuda.device import DeviceError
    from hspmd.runtime.cuda.select import device_entries, devices_text, rank_devices

    asked = "cuda" if args.kernels == "cuda" else args.device
    args.device_asked = asked  # for --strategy auto, whose groups' device= keys the planner gives
    entries = device_entries(asked, args.n)
    if args.servers is not None:  # parameter servers: GPU workers where asked by name
        entries = ["cpu" if e == "auto" else e for e in entries]
    kinds = rank_devices(entries, strategy_device_keys(args))
    if "cuda" in kinds:
        if args.servers is not None and len(set(kinds)) > 1:
            raise DeviceError(f"--servers needs one device kind for every worker (got --device {devices_text(kinds)}); "
                              "the servers run on the host")
        if args.elastic and len(set(kinds)) > 1:  # a restart on fewer ranks: which kind was lost is not known
            raise DeviceError(f"--elastic needs one device kind for every rank (got --device {devices_text(kinds)}): "
                              "a restart on the ranks left would not know which kind each one is")
        if args.kernels == "cuda":
            args.kernels = "cpu"  # the CPU ranks' kernels (a GPU rank runs its GPU program)
    return devices_text(kinds)


def planned_devices(args, compiled, n: int, ranks: tuple[int, ...] | None = None) -> str:
    """Return the workers' `--device` for a `--strategy auto` run once the planner chose: the
    `--device` asked (`args.device_asked`) resolved against the chosen groups' `device=` keys
    (a profile of GPU and CPU ranks gives each group its kind). `ranks`: the run's rank of each
    device of `compiled` where the plan leaves ranks idle (they keep the kind asked)."""
    from hspmd.runtime.cuda.select import device_entries, devices_text, rank_devices

    ranks = tuple(range(n)) if ranks is None else ranks
    keys: list[str | None] = [None] * n
    for group in compiled.strategy.strategy.groups:
        for device in group.devices:
            keys[ranks[device]] = group.device
    kinds = rank_devices(device_entries(args.device_asked, n), keys)
    if "cuda" in kinds and args.kernels == "cuda":
        args.kernels = "cpu"
    return devices_text(kinds)


def strategy_device_keys(args) -> list[str | None]:
    """Return, per rank of `hspmd run`, the `device=` key of its group in the run's strategy
    (the bundle's where the script is a bundle); None where no group says one, or the strategy
    is not known yet (`auto`, the default)."""
    from hspmd.ir.strategy import StrategyError, parse_strategy

    text, ranks = args.strategy, None
    if os.path.isdir(args.script):
        from hspmd.codegen.bundle import BundleError, read_manifest

        try:
            manifest = read_manifest(args.script)
            text, ranks = manifest.strategy, manifest.ranks  # its devices are the run's ranks `ranks`
        except BundleError:
            text = None  # said by compile_for_run
    keys: list[str | None] = [None] * args.n
    if not text or text == "auto":
        return keys
    try:
        strategy = parse_strategy(text)
    except StrategyError:
        return keys  # said when the strategy is compiled
    for group in strategy.groups:
        for device in group.devices:
            rank = ranks[device] if ranks is not None and device < len(ranks) else device
            if rank < args.n:
                keys[rank] = group.device
    return keys


def cmd_run(args) -> int:
    from hspmd.runtime.cuda.device import DeviceError
    from hspmd.runtime.launcher.launch import launch

    from hspmd.runtime.launcher.outside import outside_job

    job = outside_job()  # a rank of a job srun / mpirun / mpiexec started (docs/clusters.md)
    if args.n is None:
        args.n = job.size if job is not None else 1
    _one_strategy(args)
    check_run_options(args)
    try:
        args.device = run_device(args)
    except DeviceError as err:
        print(f"hspmd: error: {err}", file=sys.stderr)
        return 2
    args.cuda_graph = "off" if args.no_cuda_graph else None
    # the ranks' output goes through mpiexec: whether it ends on a terminal is known only here
    args.progress = "bar" if sys.stdout.isatty() else None
    if args.resume:  # said before compiling: the newest complete checkpoint there, or an error
        from hspmd.runtime.checkpoint.manifest import resolve_checkpoint

        resolve_checkpoint(args.resume)
    if os.environ.get("HSPMD_FAULT"):  # said here, not by every rank at its first step
        from hspmd.runtime.launcher.fault import parse_faults

        parse_faults(os.environ["HSPMD_FAULT"])
    if args.init_from and not os.path.isfile(args.init_from):
        raise SystemExit(f"hspmd: error: --init-from {args.init_from}: no such file")
    if args.servers is not None or (args.strategy and "comm=" in args.strategy):
        from hspmd.cli.ps import run_parameter_servers, uses_servers

        if args.servers is not None or uses_servers(args.strategy):
            from hspmd.cli.pass_flags import pass_manager

            if pass_manager(args) is not None:
                raise SystemExit("hspmd: error: the pass flags (--load-pass, --pass-after, ...) do not go together "
                                 "with parameter servers yet")
            return run_parameter_servers(args)
    if job is not None:
        from hspmd.cli.outside import run_outside

        return run_outside(args, job, compile_for_run, worker_arguments)
    if args.elastic:
        from hspmd.cli.elastic import run_elastic

        return run_elastic(args, compile_for_run, worker_arguments)
    bundle = compile_for_run(args, args.n, args.strategy)
    if args.n == 1 and not (args.hosts or args.hostfile):  # one rank: no MPI needed
        from hspmd.runtime.comm.inprocess import InProcessCommunicator
        from hspmd.runtime.worker import main as worker_main

        return worker_main(worker_arguments(args, bundle)[2:], InProcessCommunicator.create_world(1)[0])
    cores = None
    if args.cpu_bind:
        from hspmd.runtime.profiler import parse_cpu_bind

        cores = parse_cpu_bind(args.cpu_bind, args.n)
    return launch(args.n, worker_arguments(args, bundle), hosts=args.hosts, hostfile=args.hostfile, cpu_bind=cores)


def cmd_checkpoint(args) -> int:
    from hspmd.runtime.checkpoint.tools import checkpoint_info, export_checkpoint, export_hugging_face

    if args.action == "info":
        sys.stdout.write(checkpoint_info(args.path, verify=not args.no_verify))
    elif args.hf:
        if args.to or args.optimizer:
            raise SystemExit("hspmd: error: checkpoint export --hf DIR writes a model directory: it takes "
                             "neither --to nor --optimizer")
        print(export_hugging_face(args.path, args.hf))
    else:
        if not args.to:
            raise SystemExit("hspmd: error: checkpoint export needs --to FILE.safetensors (or --hf DIR)")
        print(export_checkpoint(args.path, args.to, include_optimizer=args.optimizer))
    return 0


def cmd_plot(args) -> int:
    from hspmd.cli.plot import plot_logs

    print(plot_logs(args.logs, args.output))
    return 0


def cmd_opt(rest: list[str]) -> int:
    from hspmd.cli.opt import main as opt_main

    return opt_main(rest)


def build_parser() -> argparse.ArgumentParser:
    from hspmd.cli.pass_flags import add_pass_arguments

    parser = argparse.ArgumentParser(prog="hspmd", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="compile a model script; print a level or write a bundle")
    c.add_argument("script")
    _add_script_options(c)
    c.add_argument("-n", type=int, help="number of devices (default: the strategy's)")
    c.add_argument("--dump-dir", help="write logical.mlir, annotated.mlir, physical_group*.mlir and a manifest")
    c.add_argument("--emit", choices=("kernels",),
                   help="with --dump-dir: also write the kernel level (kernel_group*.mlir, kernels/*.cu)")
    c.add_argument("--level", choices=("logical", "annotated", "physical"),
                   help="level to print when no --dump-dir, --report or --explain is given (default: physical); "
                        "with --print-pipeline, the level whose passes to print")
    c.add_argument("--report", action="store_true",
                   help="print every collective of the physical program per device group, with bytes per rank per step")
    c.add_argument("--explain", action="store_true",
                   help="print each value of the annotated step with its layout and where that layout came from")
    c.add_argument("--cost", action="store_true",
                   help="print the predicted step time per rank (compute, communication, bubbles, peak memory)")
    c.add_argument("--profile", metavar="P",
                   help="with --cost: the device profile to use (from hspmd profile; default: a synthetic CPU profile)")
    add_pass_arguments(c, print_pipeline=True)
    c.set_defaults(func=cmd_compile)

    r = sub.add_parser("run", help="train a model script or a compiled bundle on N ranks")
    r.add_argument("-n", type=int, help="number of ranks (MPI processes; default 1, or inside a job srun, mpirun "
                                        "or mpiexec started, the job's ranks: docs/clusters.md)")
    r.add_argument("script", help="a model script (.py) or a bundle directory from 'hspmd compile --dump-dir'")
    _add_script_options(r)
    r.add_argument("--steps", type=int, help="training steps (default: the script's config)")
    r.add_argument("--log", help="write one JSON object per step to this file")
    r.add_argument("--checkpoint", help="write the final parameters to this .npz file")
    ck = r.add_argument_group("checkpoints (docs/checkpoints.md)")
    ck.add_argument("--checkpoint-dir", metavar="D",
                    help="write sharded checkpoints D/step-<k>/ (safetensors pieces and a manifest)")
    ck.add_argument("--checkpoint-every", type=int, metavar="K",
                    help="with --checkpoint-dir: a checkpoint every K steps (and always after the last step)")
    ck.add_argument("--keep", type=int, metavar="N", help="with --checkpoint-dir: keep only the newest N checkpoints")
    ck.add_argument("--resume", metavar="PATH",
                    help="continue from a checkpoint: D (its newest complete step) or D/step-<k>; any strategy")
    ck.add_argument("--init-from", metavar="FILE",
                    help="start from the global tensors of a .safetensors file (hspmd checkpoint export)")
    el = r.add_argument_group("elastic runs (docs/checkpoints.md)")
    el.add_argument("--elastic", action="store_true",
                    help="watch the ranks; when one dies, resume from the newest checkpoint on the ranks left")
    el.add_argument("--fallback-strategy", action="append", metavar="S", default=[],
                    help="with --elastic: a strategy to use when ranks are lost (repeat; the first that fits is used, "
                         "else data parallelism over what is left)")
    el.add_argument("--max-restarts", type=int, default=3, metavar="R", help="with --elastic: at most R restarts (3)")
    el.add_argument("--redundancy", metavar="peer[:K]",
                    help="with --elastic: every K steps (default 1) keep each rank's training state in host memory, "
                         "the pieces no other rank holds also on a buddy rank of another host; a lost rank then "
                         "costs at most 2K - 1 steps (one for K = 1), not all since the last checkpoint (docs/checkpoints.md)")
    el.add_argument("--hosts", help="passed to mpiexec: comma-separated host names")
    el.add_argument("--hostfile", help="passed to mpiexec: a file of host names")
    r.add_argument("--servers", type=int, metavar="K",
                   help="start K parameter-server ranks beside the -n workers (strategy comm=ps|hybrid)")
    r.add_argument("--slow-worker", metavar="R:SECONDS", help=argparse.SUPPRESS)
    r.add_argument("--slow-bursts", metavar="F:SEED", help=argparse.SUPPRESS)  # runtime/ps/bursts.py
    r.add_argument("--silent-after", type=float, metavar="S",
                   help="with --servers: count a worker silent for S seconds as lost (default 10); with "
                        "--elastic: kill a rank whose heartbeat stopped for S seconds and restart without it")
    r.add_argument("--seconds", type=float, metavar="S", help="with --servers: stop starting steps after S seconds")
    r.add_argument("--cpu-bind", metavar="LIST",
                   help="pin rank r to core LIST[r], e.g. 0,0,1 (ranks of unequal speed on one machine)")
    r.add_argument("--profile", metavar="P", help="with --strategy auto: the device profile to plan with (hspmd profile)")
    r.add_argument("--trace", metavar="FILE",
                   help="write every rank's kernels, collectives, waits, checkpoint writes and steps to FILE, "
                        "a Chrome/Perfetto trace (open it in ui.perfetto.dev)")
    r.add_argument("--switch-every", type=int, metavar="K",
                   help="with several --strategy: switch to the next one every K steps, moving parameters and "
                        "optimizer states in memory (docs/switching.md)")
    r.add_argument("--ranks-per-node", type=int, metavar="K",
                   help="treat every K ranks as one node (simulated nodes on one machine; default: the ranks' host "
                        "names): all-reduces over several nodes run in two tiers, inside each node, then once "
                        "across (docs/runtime.md)")
    r.add_argument("--dump-dir", help="keep the compiled bundle in this directory")
    r.add_argument("--device", default="auto", metavar="cpu|cuda|auto[,...]",
                   help="where the step runs: cuda (a GPU per rank, by local rank; ranks beyond the GPUs share "
                        "them: the whole step on the GPU, parameters there from the start; an error where there is "
                        "no usable GPU), cpu, or auto (the default: a strategy group's device= key, else cuda for "
                        "one rank where CuPy finds a GPU, else cpu); or one entry per rank, e.g. cuda,cuda,cpu "
                        "(GPU and CPU ranks in one job); see docs/gpu.md")
    r.add_argument("--no-cuda-graph", action="store_true",
                   help="with --device cuda: run each step call by call instead of replaying it as one CUDA graph")
    r.add_argument("--kernels", choices=("cpu", "numpy", "cuda"), default="cpu",
                   help="on the CPU: fused C++ kernels built from their CUDA source (cpu, the default) or NumPy per "
                        "op (numpy); cuda is a spelling of --device cuda (docs/kernels.md)")
    add_pass_arguments(r)
    r.set_defaults(func=cmd_run)

    k = sub.add_parser("checkpoint", help="inspect or export a sharded checkpoint (docs/checkpoints.md)")
    k.add_argument("action", choices=("info", "export"),
                   help="info: steps, tensors, strategy, sizes, checksums; export: one file of global tensors")
    k.add_argument("path", help="a checkpoint directory (its newest step) or one D/step-<k>")
    k.add_argument("--to", metavar="FILE", help="export: the .safetensors file to write (loads with safetensors.numpy.load_file)")
    k.add_argument("--hf", metavar="DIR", help="export: a Hugging Face model directory (config.json, "
                   "model.safetensors) that transformers' from_pretrained loads (docs/torch-import.md)")
    k.add_argument("--optimizer", action="store_true", help="export: include the optimizer states (opt.*)")
    k.add_argument("--no-verify", action="store_true", help="info: skip reading every piece to check its checksum")
    k.set_defaults(func=cmd_checkpoint)

    g = sub.add_parser("plot", help="draw the loss and throughput of one or more --log files")
    g.add_argument("logs", nargs="+", metavar="LOG", help="a JSON-lines log written by 'hspmd run --log'")
    g.add_argument("-o", "--output", default="loss.png", help="the image to write (default: loss.png)")
    g.set_defaults(func=cmd_plot)

    from hspmd.cli.data import add_data_parser
    from hspmd.cli.plan import add_plan_parser
    from hspmd.cli.profile import add_profile_parser

    add_profile_parser(sub)
    add_plan_parser(sub)
    add_data_parser(sub)

    from hspmd.cli.compare import add_compare_parser
    from hspmd.cli.reduce import add_reduce_parser

    add_reduce_parser(sub)
    add_compare_parser(sub)
    sub.add_parser("opt", help="hspmd-opt: run passes over an IR file (see hspmd-opt --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the `hspmd` command line; return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "opt":
        return cmd_opt(argv[1:])
    args = build_parser().parse_args(argv)
    if getattr(args, "n", None) is not None and args.n < 1:
        print("hspmd: error: -n must be at least 1", file=sys.stderr)
        return 1
    from hspmd.compiler import InternalError

    try:
        with tempfile.TemporaryDirectory(prefix="hspmd-") as args.scratch:  # bundles nobody asked to keep
            return args.func(args)
    except InternalError as err:
        report_internal_error(err)
        return INTERNAL_ERROR_EXIT
    except _user_errors() as err:
        print(f"hspmd: error: {describe(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
