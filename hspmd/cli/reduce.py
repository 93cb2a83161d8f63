"""`hspmd reduce FILE --test CMD`: the smallest program on which a test still fails.

    hspmd reduce step.mlir --test 'hspmd compare {} --strategy "[0,1]: tp=2"; test $? = 4'
    hspmd reduce annotated.mlir --test 'hspmd-opt {} -p specialize-groups,lower-reshard; test $? = 3' -o small.mlir

As `mlir-reduce` and C-Reduce do, it takes an IR file and an "interesting" test: a shell command
that exits 0 while the bug is still there (`{}` in it is replaced by the candidate file's path,
else the path is appended). It shrinks the program step by step, keeping every candidate valid
IR (the verifier and the level's verifier pass; an invalid candidate is never tested) and each
step that the test still finds interesting (`hspmd.transforms.reduce_steps`):

- annotated IR: the strategy made smaller (a device group dropped, fewer pipeline stages, tp,
  dp or ep cut, ZeRO, recompute and sp off, one micro-batch): the program's layouts stripped and
  annotated again under it;
- calls of layer functions inlined (all, then one at a time);
- ops dropped, in halves, then quarters, ... then one by one (delta debugging): a dropped op's
  results are replaced by an operand of the same type or a constant, and what then feeds
  nothing goes with it;
- tensor dims halved across the program (a batch, a width).

It runs until no step helps (or `--max-tests`), writing the smallest failing file to `-o`
(default FILE's name with `.reduced.mlir`) after each step it takes, so an interrupted run keeps
its best. It works on logical, annotated and physical IR.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ReduceResult", "add_reduce_parser", "command_test", "reduce_ir"]


class _Budget(Exception):
    """The reducer has run the tests it was allowed."""


@dataclass
class ReduceResult:
    """What a reduction made: the smallest interesting module and its text, op counts, tests run."""

    module: object
    text: str
    ops_before: int
    ops_after: int
    tests: int
    seconds: float


def _valid(module, level: str) -> bool:
    """Return whether `module` verifies, at its level too."""
    from hspmd.dialects.levels import verify_annotated, verify_logical, verify_physical
    from hspmd.transforms.pass_manager import ir_problem

    if ir_problem(module) is not None:
        return False
    try:
        {"logical": verify_logical, "annotated": verify_annotated, "physical": verify_physical}[level](module)
    except Exception:  # noqa: BLE001 - any complaint of a level verifier: not a valid candidate
        return False
    return True


class _Reducer:
    def __init__(self, module, interesting: Callable[[object, str], bool], log: Callable[[str], None],
                 max_tests: int | None, save: Callable[[str], None] | None):
        from hspmd.dialects.context import module_text
        from hspmd.transforms.reduce_steps import level_of

        self.best, self.text = module, module_text(module)
        self.level = level_of(module)
        self.interesting, self.log, self.max_tests, self.save = interesting, log, max_tests, save
        self.tests = 0

    def attempt(self, candidate, what: str, smaller: bool = True) -> bool:
        """Test `candidate` (None: none made) where it is valid, new and `smaller`; keep it if interesting."""
        from hspmd.dialects.context import module_text
        from hspmd.transforms.reduce_steps import count_ops

        if candidate is None or not smaller or not _valid(candidate, self.level):
            return False
        text = module_text(candidate)
        if text == self.text:
            return False
        if self.max_tests is not None and self.tests >= self.max_tests:
            raise _Budget
        self.tests += 1
        if not self.interesting(candidate, text):
            return False
        self.best, self.text = candidate, text
        if self.save is not None:
            self.save(text)
        self.log(f"  {count_ops(candidate)} ops: {what}")
        return True

    def strategies(self) -> bool:
        """Annotated IR: take the first smaller strategy the test still fails under; repeat."""
        from hspmd.compiler import annotate
        from hspmd.dialects.dist import module_strategies
        from hspmd.transforms.reduce_steps import smaller_strategies
        from hspmd.transforms.strip_layouts import strip_layouts

        improved, again = False, True
        while again:
            again = False
            record = module_strategies(self.best)[0]
            for smaller in smaller_strategies(record):
                try:
                    candidate = annotate(strip_layouts(self.best.clone()), smaller)
                except Exception:  # noqa: BLE001 - a strategy the program does not take: not a candidate
                    continue
                if self.attempt(candidate, f"strategy '{smaller.strategy}'"
                                f"{f' microbatches={smaller.microbatches}' if smaller.microbatches > 1 else ''}"):
                    improved = again = True
                    break
        return improved

    def calls(self) -> bool:
        """Inline the calls of layer functions: all at once, else one at a time."""
        from xdsl.dialects import func

        from hspmd.transforms.reduce_steps import inline_calls

        def count() -> int:
            return sum(1 for op in self.best.walk() if isinstance(op, func.CallOp))

        if not count():
            return False
        if self.attempt(_or_none(inline_calls, self.best, None), "inlined every call"):
            return True
        improved, i = False, 0
        while i < count():
            if self.attempt(_or_none(inline_calls, self.best, [i]), "inlined a call"):
                improved = True
                continue
            i += 1
        return improved

    def ops(self) -> bool:
        """Drop ops in chunks, halving the chunk down to one op (delta debugging)."""
        from hspmd.transforms.reduce_steps import count_ops, drop_ops, droppable_ops

        improved = False
        size = max(1, len(droppable_ops(self.best)) // 2)
        while True:
            i = 0
            while i < len(droppable_ops(self.best)):
                picks = list(range(i, min(i + size, len(droppable_ops(self.best)))))
                try:
                    candidate = drop_ops(self.best, picks)
                except Exception:  # noqa: BLE001 - nothing can stand for a result: not a candidate
                    candidate = None
                smaller = candidate is not None and count_ops(candidate) < count_ops(self.best)
                if self.attempt(candidate, f"dropped {len(picks)} op{'s' if len(picks) > 1 else ''}", smaller):
                    improved = True
                    continue  # position i now holds other ops
                i += size
            if size == 1:
                return improved
            size //= 2

    def shapes(self) -> bool:
        """Halve each tensor dim size across the program while the test still fails."""
        from hspmd.dialects.context import parse_module
        from hspmd.transforms.reduce_steps import shrink_dim, tensor_dims

        improved = False
        for size in sorted(tensor_dims(self.text), reverse=True):
            while size > 1:
                to = size // 2
                try:
                    candidate = parse_module(shrink_dim(self.text, size, to))
                except Exception:  # noqa: BLE001 - text that no longer parses: not a candidate
                    break
                if not self.attempt(candidate, f"dims of {size} made {to}"):
                    break
                improved, size = True, to
        return improved

    def run(self) -> None:
        while True:
            progress = self.strategies() if self.level == "annotated" else False
            progress = self.calls() or progress
            progress = self.ops() or progress
            progress = self.shapes() or progress
            if not progress:
                return


def _or_none(step, *args):
    """Return `step(*args)`, or None where it cannot be made."""
    try:
        return step(*args)
    except Exception:  # noqa: BLE001 - a candidate that cannot be made is not one
        return None


def reduce_ir(module, interesting: Callable[[object, str], bool], log: Callable[[str], None] | None = None,
              max_tests: int | None = None, save: Callable[[str], None] | None = None) -> ReduceResult:
    """Return the smallest program the reducer finds from `module` (see the module docstring) on
    which `interesting(module, text)` still holds (it must hold on `module` itself: ValueError
    otherwise). `save(text)` hears each smaller program as it is found; at most `max_tests` tests."""
    from hspmd.dialects.context import module_text
    from hspmd.transforms.reduce_steps import count_ops

    start = time.perf_counter()
    log = log or (lambda line: None)
    if not interesting(module, module_text(module)):
        raise ValueError("the test does not find the input interesting (it must exit 0 on the input itself)")
    reducer = _Reducer(module, interesting, log, max_tests, save)
    try:
        reducer.run()
    except _Budget:
        log(f"  stopped after --max-tests {max_tests} tests")
    return ReduceResult(reducer.best, reducer.text, count_ops(module), count_ops(reducer.best), reducer.tests + 1,
                        time.perf_counter() - start)


def command_test(command: str, name: str, timeout: float) -> Callable[[object, str], bool]:
    """Return the test that writes a candidate's text to a file called `name` in a new directory and
    runs shell `command` on it (`{}` replaced by its path, else the path appended): interesting
    when it exits 0 within `timeout` seconds."""
    directory = tempfile.mkdtemp(prefix="hspmd-reduce-")
    path = os.path.join(directory, name)
    line = command.replace("{}", shlex.quote(path)) if "{}" in command else f"{command} {shlex.quote(path)}"

    def interesting(module, text: str) -> bool:
        with open(path, "w") as f:
            f.write(text)
        try:
            done = subprocess.run(line, shell=True, cwd=directory, timeout=timeout, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    return interesting


def cmd_reduce(args) -> int:
    from hspmd.dialects.context import parse_module
    from hspmd.transforms.reduce_steps import count_ops, level_of

    module = parse_module(open(args.file).read(), args.file)
    out = args.output or (os.path.splitext(args.file)[0] + ".reduced.mlir")
    test = command_test(args.test, os.path.basename(args.file), args.timeout)
    print(f"hspmd reduce: {args.file}: {count_ops(module)} ops of {level_of(module)} IR", flush=True)

    def save(text: str) -> None:
        with open(out, "w") as f:
            f.write(text)

    try:
        result = reduce_ir(module, test, lambda line: print(line, flush=True), args.max_tests, save)
    except ValueError as err:
        print(f"hspmd: error: reduce {args.file}: {err}: '{args.test}'", file=sys.stderr)
        return 1
    save(result.text)
    print(f"hspmd reduce: {result.ops_before} ops -> {result.ops_after} ops in {result.tests} tests "
          f"({result.seconds:.0f} s); wrote {out}")
    return 0


def add_reduce_parser(sub) -> None:
    """Add the `reduce` subcommand to `hspmd`'s subparsers."""
    p = sub.add_parser("reduce", help="shrink an IR file while a test still fails on it (as mlir-reduce)",
                       description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="e.g. hspmd reduce step.mlir --test 'hspmd compare {} --strategy \"[0,1]: tp=2\"; "
                              "test $? = 4' (docs/your-own-pass.md)")
    p.add_argument("file", help="an IR file: logical, annotated or physical")
    p.add_argument("--test", required=True, metavar="CMD",
                   help="a shell command that exits 0 while the bug is still there; {} is the candidate file")
    p.add_argument("-o", "--output", metavar="OUT", help="the smallest failing file (default: FILE.reduced.mlir)")
    p.add_argument("--timeout", type=float, default=600, metavar="S",
                   help="a test running longer than S seconds counts as not interesting (600)")
    p.add_argument("--max-tests", type=int, metavar="K", help="stop after K tests")
    p.set_defaults(func=cmd_reduce)
