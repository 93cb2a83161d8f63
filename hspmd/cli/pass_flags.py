"""The flags that edit and watch a compile's passes, on `hspmd compile`, `hspmd run` and `hspmd plan`.

    --load-pass FILE|MODULE          your own ModulePass classes (repeatable)
    --pass-after NAME=PASS[{opts}]   insert PASS after every pass NAME of the pipeline (repeatable)
    --pass-before NAME=PASS[{opts}]  ... before it
    --pipeline TEXT|@FILE            replace levels: `LEVEL: PASSES` lines, or a bare pass list for
                                     the level `--level` names (physical by default)
    --print-pipeline                 (compile) print the pipeline instead of compiling
    --print-ir-after-all, --print-ir-after NAME,..., --print-ir-before NAME,...
                                     the module after/before passes: DUMP/passes/NN-NAME.mlir with
                                     --dump-dir, else stdout
    --pass-timing                    a table of the passes' wall times and op counts (stderr)

`add_pass_arguments` registers them on a subcommand's parser; `pass_manager(args)` turns them
into the `PassManager` the compiler takes (None when none is given). docs/your-own-pass.md.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import sys

__all__ = ["add_pass_arguments", "pass_manager", "say_user_passes", "user_pass_source"]


def add_pass_arguments(parser: argparse.ArgumentParser, *, watch: bool = True, print_pipeline: bool = False) -> None:
    """Register the pass flags on `parser`: loading and placing passes always, printing and timing
    them with `watch`, `--print-pipeline` with `print_pipeline`."""
    g = parser.add_argument_group("passes: your own, and watching them run (docs/your-own-pass.md)")
    g.add_argument("--load-pass", action="append", default=[], metavar="FILE|MODULE",
                   help="load the ModulePass classes a Python file or module defines (repeatable)")
    # one list for both flags: the insertions apply in the order given (a later one may name an earlier one's pass)
    g.add_argument("--pass-after", action="append", dest="pass_insertions", type=lambda t: (True, t),
                   metavar="NAME=PASS[{OPTIONS}]",
                   help="run PASS after every pass NAME of the pipeline, e.g. lower-reshard=my-pass (repeatable)")
    g.add_argument("--pass-before", action="append", dest="pass_insertions", type=lambda t: (False, t),
                   metavar="NAME=PASS[{OPTIONS}]", help="run PASS before every pass NAME of the pipeline (repeatable)")
    g.add_argument("--pipeline", metavar="TEXT|@FILE",
                   help="replace the pipeline's levels: 'LEVEL: PASSES' lines (as --print-pipeline prints them), "
                        "or a bare pass list for the level --level names (physical by default)")
    if print_pipeline:
        g.add_argument("--print-pipeline", action="store_true",
                       help="print the passes compile and run use, per level, in hspmd-opt's -p syntax (with "
                            "--level: that level's alone), and stop")
    if watch:
        g.add_argument("--print-ir-after-all", action="store_true",
                       help="print the module after every pass: DUMP/passes/NN-NAME.mlir with --dump-dir, else stdout")
        g.add_argument("--print-ir-after", metavar="NAME,...", help="print the module after the passes named")
        g.add_argument("--print-ir-before", metavar="NAME,...", help="print the module before the passes named")
        g.add_argument("--pass-timing", action="store_true",
                       help="print each pass's wall time, share of the total and op counts before and after (stderr)")


def user_pass_source(source: str, passes) -> object:
    """Return the `UserPassSource` of `--load-pass SOURCE` (a file, or a module: its file), which
    defines `passes` ({name: class})."""
    from hspmd.transforms.pass_manager import UserPassSource

    path = source
    if not (source.endswith(".py") or os.sep in source):
        spec = importlib.util.find_spec(source)
        path = spec.origin if spec is not None and spec.origin else None
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest() if path and os.path.isfile(path) else "unknown"
    shown = os.path.abspath(source) if source.endswith(".py") or os.sep in source else source
    return UserPassSource(shown, digest, tuple(sorted(passes)))


def _names(text: str | None) -> frozenset[str]:
    return frozenset(n.strip() for n in (text or "").split(",") if n.strip())


def _pipeline_text(value: str) -> str:
    if not value.startswith("@"):
        return value
    from hspmd.transforms.pass_pipeline import PipelineTextError

    try:
        return open(value[1:]).read()
    except OSError as err:
        raise PipelineTextError(f"--pipeline {value}: {err.strerror}") from None


def pass_manager(args, level: str | None = None):
    """Return the `PassManager` the pass flags of `args` ask for, or None when none is given.
    `level`: the level a bare `--pipeline` pass list replaces (default physical)."""
    from hspmd.cli.opt import load_user_passes
    from hspmd.transforms.pass_manager import PassManager
    from hspmd.transforms.pass_pipeline import Insertion, PipelineEdits, parse_pipeline_text

    loads = getattr(args, "load_pass", None) or []
    placed = getattr(args, "pass_insertions", None) or []
    pipeline = getattr(args, "pipeline", None)
    printing = (getattr(args, "print_ir_after_all", False), getattr(args, "print_ir_after", None),
                getattr(args, "print_ir_before", None), getattr(args, "pass_timing", False))
    if not (loads or placed or pipeline or any(printing)):
        return None
    user, sources = {}, []
    for source in loads:
        found = load_user_passes(source)
        user.update(found)
        sources.append(user_pass_source(source, found))
    replace = {}
    if pipeline:
        edits = PipelineEdits(user)
        texts = parse_pipeline_text(_pipeline_text(pipeline), edits.available(), level or "physical")
        from hspmd.transforms.pass_pipeline import passes_text

        replace = {lv: passes_text(ps) for lv, ps in texts.items()}
    insertions = tuple(Insertion.parse(text, after) for after, text in placed)
    return PassManager(edits=PipelineEdits(user, replace, insertions), print_after_all=printing[0],
                       print_after=_names(printing[1]), print_before=_names(printing[2]),
                       dump_dir=getattr(args, "dump_dir", None), timing=printing[3], sources=tuple(sources))


def say_user_passes(record: dict | None, where: str, out=None) -> None:
    """Print, for `hspmd run`, that the program at `where` was compiled with the user's passes of
    `record` (a bundle's `user_passes`): which ran, placed how, from which files with their hashes
    (and whether a file has changed since)."""
    if not record:
        return
    out = out or sys.stderr
    files = []
    for entry in record.get("sources", []):
        source, digest = entry.get("source", "?"), entry.get("sha256", "")
        now = hashlib.sha256(open(source, "rb").read()).hexdigest() if os.path.isfile(source) else None
        changed = "" if now in (None, digest) else ", changed since"
        files.append(f"{source} (sha256 {digest[:12]}{changed})")
    ran = ", ".join(record.get("ran", [])) or "none"
    placed = f" placed by {'; '.join(record['placed'])}" if record.get("placed") else ""
    print(f"hspmd run: {where} was compiled with your passes: {ran}{placed}; from {', '.join(files) or '-'}", file=out)


def finish_passes(manager) -> None:
    """After a compile: print the pass timing table (stderr) where `--pass-timing` asked for it."""
    if manager is not None and manager.timing:
        sys.stderr.write(manager.timing_table())


def print_pipeline(args, n: int) -> int:
    """`hspmd compile SCRIPT --print-pipeline [--level L]`: print the passes a compile of the script
    under its strategy (strategies) runs, with the user's edits, and return 0."""
    from hspmd.compiler import default_strategy, script_pipelines
    from hspmd.frontend.script import load_script, parse_overrides

    script = load_script(args.script, parse_overrides(args.set))
    strategies = args.strategies or [default_strategy(n)]
    pipelines = script_pipelines(script, strategies, n, pass_manager(args, args.level))
    for i, pipeline in enumerate(pipelines):
        if args.level:
            print(pipeline.text(args.level))
            continue
        head = f"strategy {i}: " if len(pipelines) > 1 else ""
        print(f"// {head}the passes of 'hspmd compile {args.script}' under '{strategies[i]}', per level, as "
              f"hspmd-opt -p reads them\n// (kernel: on each device group's module; device: on the GPU program of "
              f"a group that runs on GPUs)")
        sys.stdout.write(pipeline.text())
    return 0
