"""Running passes with the user watching: IR printed before or after passes, pass timings, and
the user's own passes checked.

A `PassManager` is handed to the compiler (`compile_script(..., passes=manager)`) or to
`hspmd-opt`; it applies each pass (`apply`) and around it:

- prints the module after every pass (`print_after_all`), after the passes named in
  `print_after`, or before those in `print_before`: to `DUMP/passes/NN-NAME.mlir`
  (`NN-before-NAME.mlir` for a print before; NN counts the prints of the run from 01) when it has
  a `dump_dir`, else to its `out` stream under MLIR's `// -----// IR Dump After NAME //----- //`;
- with `timing`, records each pass's wall time and the op count of the module before and after
  (`timing_table()`: pass, level, time, share of the total, ops before and after);
- for a pass named in `user_names` (the user's own, `--load-pass`): verifies the IR after it
  (every operand defined in the module, the ops' verifiers), and when the pass raises or leaves the
  IR broken, writes the IR before and after it to files and raises `UserPassError`, one line
  naming the pass and the failing op (`hspmd-opt` reports a pass that raises as a bug of that
  pass instead: `user_raises_are_errors=False`).

The edits to the pipeline (`PipelineEdits`) travel with it: `pipeline(default)` applies them.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TextIO

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation
from xdsl.passes import ModulePass
from xdsl.utils.exceptions import DiagnosticException, VerifyException

from hspmd.transforms.pass_pipeline import Pipeline, PipelineEdits, PipelineTextError
from hspmd.transforms.util import PassError

__all__ = ["PassManager", "TimingRow", "UserPassError", "UserPassSource", "ir_problem"]


class UserPassError(PassError):
    """A user's pass raised, or left IR that does not verify: one line naming the pass, the failing
    op and the files holding the IR before and after it (a user's error, exit code 1)."""


@dataclass(frozen=True)
class UserPassSource:
    """Where user passes came from: a file or module given to `--load-pass`, the SHA-256 of its
    text, and the passes it defines."""

    source: str
    sha256: str
    passes: tuple[str, ...]


@dataclass(frozen=True)
class TimingRow:
    """One pass run: its name, level (and group), wall seconds, op counts before and after."""

    name: str
    level: str
    seconds: float
    ops_before: int
    ops_after: int


def _where(op: Operation) -> str:
    """Return ` in @FUNC` for an op inside a function, else ''."""
    parent = op.parent_op()
    while parent is not None and not isinstance(parent, func.FuncOp):
        parent = parent.parent_op()
    return f" in @{parent.sym_name.data}" if isinstance(parent, func.FuncOp) else ""


def ir_problem(module: ModuleOp) -> str | None:
    """Return what is wrong with `module` in one line (an operand defined nowhere in it, or the
    first line of the verifier's complaint), or None when it verifies."""
    defined = set()
    for op in module.walk():
        defined.update(op.results)
        for region in op.regions:
            for block in region.blocks:
                defined.update(block.args)
    for op in module.walk():
        for i, value in enumerate(op.operands):
            if value not in defined:
                owner = value.owner
                what = f"a result of '{owner.name}'" if isinstance(owner, Operation) else "a block argument"
                return (f"'{op.name}'{_where(op)} reads (operand {i}) {what}, which is no longer in the module")
    try:
        module.verify()
    except (VerifyException, DiagnosticException) as err:
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        return lines[0] if lines else type(err).__name__
    return None


def _count_ops(module: ModuleOp) -> int:
    return sum(1 for _ in module.walk()) - 1  # the module itself is not an op of the program


def _text(module: ModuleOp) -> str:
    from hspmd.dialects.context import module_text

    try:
        return module_text(module)
    except Exception as err:  # noqa: BLE001 - broken IR may not print; say so in the file
        return f"// the IR could not be printed: {type(err).__name__}: {err}\n"


@dataclass
class PassManager:
    """Applies passes as the user asked to watch them (see the module docstring)."""

    edits: PipelineEdits = field(default_factory=PipelineEdits)
    print_after_all: bool = False
    print_after: frozenset[str] = frozenset()
    print_before: frozenset[str] = frozenset()
    dump_dir: str | None = None
    out: TextIO | None = None
    timing: bool = False
    sources: tuple[UserPassSource, ...] = ()
    #: whether a user pass that raises is a UserPassError (the compiler's view: the user's code
    #: failed); `hspmd-opt` says False and reports it as a bug of that pass, as it does any pass's
    user_raises_are_errors: bool = True
    rows: list[TimingRow] = field(default_factory=list)
    #: the user passes that have run (their names, in order): a later failure is theirs to look at
    user_ran: list[str] = field(default_factory=list)
    _prints: int = 0

    @property
    def user_names(self) -> frozenset[str]:
        """Return the names of the user's passes."""
        return frozenset(self.edits.user_passes)

    def quiet(self) -> PassManager:
        """Return a manager with the same edits that prints and times nothing (for a second compile
        made only to compare with the first)."""
        return PassManager(edits=self.edits, sources=self.sources)

    def pipeline(self, default: Pipeline) -> Pipeline:
        """Return `default` with the user's edits applied; PipelineTextError where an edit, or a pass
        named to print before or after, does not fit it. A compile starts here: the user passes a
        previous compile ran are forgotten (`blame` looks at this compile's)."""
        self.user_ran.clear()
        pipeline = self.edits.apply(default) if self.edits else default
        self.check_names(pipeline.names())
        return pipeline

    def check_names(self, names: Iterable[str]) -> None:
        """Raise PipelineTextError naming a pass of `print_after` or `print_before` not in `names`."""
        names = list(dict.fromkeys(names))
        for flag, asked in (("--print-ir-after", self.print_after), ("--print-ir-before", self.print_before)):
            missing = sorted(set(asked) - set(names))
            if missing:
                raise PipelineTextError(f"{flag} {','.join(missing)}: the pipeline has no pass "
                                        f"{', '.join(repr(m) for m in missing)} (its passes: {', '.join(names)})")

    def record(self) -> dict | None:
        """Return what a bundle records of the user's passes (None without any edit): the user passes
        that ran, the flags that placed them, and per loaded file or module its SHA-256 and passes."""
        if not self.edits:
            return None
        placed = [ins.flag() for ins in self.edits.insertions]
        placed += [f"--pipeline {level}: {text}" for level, text in self.edits.replace.items()]
        return {"ran": list(dict.fromkeys(self.user_ran)), "placed": placed,
                "sources": [{"source": s.source, "sha256": s.sha256, "passes": list(s.passes)} for s in self.sources]}

    # ------------------------------------------------------------------ running

    def apply(self, p: ModulePass, ctx: Context, module: ModuleOp, level: str = "") -> None:
        """Apply pass `p` to `module` (of `level`, e.g. `physical` or `kernel.group0`), printing,
        timing and checking as asked."""
        if p.name in self.print_before:
            self._print(module, p.name, level, before=True)
        ops_before = _count_ops(module) if self.timing else 0
        user = p.name in self.user_names
        snapshot = module.clone() if user else None
        start = time.perf_counter()
        try:
            p.apply(ctx, module)
        except Exception as err:
            if not user or not self.user_raises_are_errors:
                raise
            lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
            raise self._failure(p.name, f"raised {type(err).__name__}" + (f": {lines[0]}" if lines else ""),
                                snapshot, module) from None
        seconds = time.perf_counter() - start
        if user:
            self.user_ran.append(p.name)
            problem = ir_problem(module)
            if problem is not None:
                raise self._failure(p.name, f"broke the IR: {problem}", snapshot, module)
        if self.timing:
            self.rows.append(TimingRow(p.name, level, seconds, ops_before, _count_ops(module)))
        if self.print_after_all or p.name in self.print_after:
            self._print(module, p.name, level, before=False)

    def blame(self, pass_name: str, message: str, ir_path: str | None) -> UserPassError | None:
        """Return the error of hspmd's pass `pass_name` failing (`message`) on IR a user pass changed
        before it (None when no user pass has run): the user's to look at first, not a bug report."""
        if not self.user_ran:
            return None
        where = f"; the IR given to it is in {ir_path}" if ir_path else ""
        ran = ", ".join(dict.fromkeys(self.user_ran))
        return UserPassError(f"{pass_name} failed on IR that your pass {ran} changed: {message}{where} "
                             f"(without {ran}, does it compile?)")

    # ------------------------------------------------------------------ output

    def _dir(self) -> str:
        path = os.path.join(self.dump_dir, "passes") if self.dump_dir else tempfile.mkdtemp(prefix="hspmd-user-pass-")
        os.makedirs(path, exist_ok=True)
        return path

    def _failure(self, name: str, what: str, before: ModuleOp | None, after: ModuleOp) -> UserPassError:
        """Return the UserPassError of user pass `name` (`what` went wrong), the IR before and after
        it written beside the dumps (or into a new temporary directory)."""
        directory = self._dir()
        paths = []
        for tag, module in (("before", before), ("after", after)):
            path = os.path.join(directory, f"{tag}-{name}.mlir")
            with open(path, "w") as f:
                f.write(f"// the IR {tag} your pass {name}, which {what[:300]}\n")
                f.write(_text(module) if module is not None else "// (not kept)\n")
            paths.append(path)
        return UserPassError(f"your pass {name} {what} (IR before it: {paths[0]}, after it: {paths[1]})")

    def _print(self, module: ModuleOp, name: str, level: str, before: bool) -> None:
        self._prints += 1
        when = "Before" if before else "After"
        header = f"// -----// IR Dump {when} {name}{f' ({level})' if level else ''} //----- //\n"
        if self.dump_dir is None:
            stream = self.out or sys.stdout
            stream.write(header + _text(module))
            stream.flush()
            return
        group = level.partition(".")[2]
        stem = f"{self._prints:02d}-{'before-' if before else ''}{name}{'.' + group if group else ''}"
        with open(os.path.join(self._dir(), stem + ".mlir"), "w") as f:
            f.write(header + _text(module))

    def timing_table(self) -> str:
        """Return the `--pass-timing` table: one row per pass run (its level where it has one), then the total."""
        total = sum(r.seconds for r in self.rows)
        levels = any(r.level for r in self.rows)
        rows = [("pass", *(("level",) if levels else ()), "wall ms", "share", "ops before", "ops after")]
        rows += [(r.name, *((r.level,) if levels else ()), f"{r.seconds * 1e3:.1f}",
                  f"{100 * r.seconds / (total or 1e-12):.1f}%", str(r.ops_before), str(r.ops_after)) for r in self.rows]
        rows.append(("total", *(("",) if levels else ()), f"{total * 1e3:.1f}", "100.0%", "", ""))
        left = 2 if levels else 1  # the text columns, left-aligned; the numbers right-aligned
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                 for r in rows]
        return "pass timing (wall time of each pass; ops counted in the module before and after it)\n" + \
            "\n".join(lines) + "\n"
