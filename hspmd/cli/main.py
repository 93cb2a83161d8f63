"""`hspmd`: compile model scripts through the three IR levels and run them on N ranks.

    hspmd compile SCRIPT [--strategy TEXT] [--dump-dir DIR] [--level L] [--report] [--explain] [--set K=V ...]
    hspmd run -n N SCRIPT|BUNDLE [--strategy TEXT] [--steps K] [--log FILE] [--checkpoint FILE]
    hspmd opt FILE [-p PASSES] ...          (the same as hspmd-opt)

Errors a user can cause end in one message on stderr and exit code 1, never a traceback.
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
    from hspmd.runtime.launch import LaunchError
    from hspmd.runtime.plan import PlanError
    from hspmd.runtime.worker import RunError
    from hspmd.transforms.util import PassError

    return (
        ScriptError, StrategyError, TraceError, IRTextError, LayoutError, LayoutSyntaxError, LevelError,
        BundleError, LaunchError, PlanError, RunError, PassError, ShardingError, LarkError, OSError,
    )


def _add_script_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", help="strategy text, e.g. '[0,1]: dp=2' (default: data parallel over -n)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override an entry of the script's config")


def _load_and_compile(args, n: int):
    from hspmd.compiler import compile_script, default_strategy
    from hspmd.frontend.script import load_script, parse_overrides

    script = load_script(args.script, parse_overrides(args.set))
    strategy = args.strategy or default_strategy(n)
    return compile_script(script, strategy, n)


def cmd_compile(args) -> int:
    from hspmd.compiler import write_bundle
    from hspmd.ir.strategy import parse_strategy
    from hspmd.dialects.context import module_text

    if args.emit == "kernels" and not args.dump_dir:
        raise SystemExit("hspmd: error: --emit kernels needs --dump-dir")
    n = args.n or (parse_strategy(args.strategy).num_devices if args.strategy else 1)
    compiled = _load_and_compile(args, n)
    if args.dump_dir:
        write_bundle(compiled, args.dump_dir)
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
    if args.explain:
        from hspmd.codegen.report import explain_rows, format_explain

        from hspmd.compiler import annotate_with_provenance

        sys.stdout.write(format_explain(explain_rows(*annotate_with_provenance(compiled))))
    if not (args.dump_dir or args.report or args.explain):
        sys.stdout.write(module_text(getattr(compiled, args.level)))
    return 0


def cmd_run(args) -> int:
    from hspmd.compiler import write_bundle
    from hspmd.codegen.bundle import read_manifest
    from hspmd.runtime.launch import launch

    if os.path.isdir(args.script):
        if args.strategy or args.set:
            raise SystemExit("hspmd: error: a bundle is already compiled; --strategy and --set apply to scripts only")
        bundle = args.script
        manifest = read_manifest(bundle)
        if manifest.num_devices != args.n:
            from hspmd.runtime.worker import RunError

            raise RunError(
                f"bundle {bundle} was compiled for {manifest.num_devices} devices "
                f"(strategy '{manifest.strategy}') but -n is {args.n}"
            )
    else:
        compiled = _load_and_compile(args, args.n)
        bundle = args.dump_dir or tempfile.mkdtemp(prefix="hspmd-bundle-")
        write_bundle(compiled, bundle)
    if args.n == 1:  # one rank: no MPI needed
        from hspmd.runtime.comm.inprocess import InProcessCommunicator
        from hspmd.runtime.worker import train

        (comm,) = InProcessCommunicator.create_world(1)
        train(bundle, comm, args.steps, args.log, args.checkpoint, kernels=args.kernels)
        return 0
    worker = ["-m", "hspmd.runtime.worker", bundle]
    for flag, value in (("--steps", args.steps), ("--log", args.log), ("--checkpoint", args.checkpoint),
                        ("--kernels", args.kernels)):
        if value is not None:
            worker += [flag, str(value)]
    return launch(args.n, worker)


def cmd_opt(rest: list[str]) -> int:
    from hspmd.cli.opt import main as opt_main

    return opt_main(rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hspmd", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="compile a model script; print a level or write a bundle")
    c.add_argument("script")
    _add_script_options(c)
    c.add_argument("-n", type=int, help="number of devices (default: the strategy's)")
    c.add_argument("--dump-dir", help="write logical.mlir, annotated.mlir, physical_group*.mlir and a manifest")
    c.add_argument("--emit", choices=("kernels",),
                   help="with --dump-dir: also write the kernel level (kernel_group*.mlir, kernels/*.cu)")
    c.add_argument("--level", choices=("logical", "annotated", "physical"), default="physical",
                   help="level to print when no --dump-dir, --report or --explain is given")
    c.add_argument("--report", action="store_true",
                   help="print every collective of the physical program per device group, with bytes per rank per step")
    c.add_argument("--explain", action="store_true",
                   help="print each value of the annotated step with its layout and where that layout came from")
    c.set_defaults(func=cmd_compile)

    r = sub.add_parser("run", help="train a model script or a compiled bundle on N ranks")
    r.add_argument("-n", type=int, default=1, help="number of ranks (MPI processes)")
    r.add_argument("script", help="a model script (.py) or a bundle directory from 'hspmd compile --dump-dir'")
    _add_script_options(r)
    r.add_argument("--steps", type=int, help="training steps (default: the script's config)")
    r.add_argument("--log", help="write one JSON object per step to this file")
    r.add_argument("--checkpoint", help="write the final parameters to this .npz file")
    r.add_argument("--dump-dir", help="keep the compiled bundle in this directory")
    r.add_argument("--kernels", choices=("cpu", "numpy", "cuda"), default="cpu",
                   help="fused C++ kernels built from their CUDA source (cpu, the default), NumPy per op (numpy), "
                        "or CuPy (cuda); see docs/kernels.md")
    r.set_defaults(func=cmd_run)

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
    try:
        return args.func(args)
    except _user_errors() as err:
        print(f"hspmd: error: {describe(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
