"""`hspmd-opt`: parse IR, run a pass pipeline, print — with mlir-opt/xdsl-opt habits.

    hspmd-opt FILE [-p pass1,pass2{opt=v}] [--print-between-passes] [-o OUT]
    hspmd-opt FILE --load-pass my_passes.py -p my-pass
    hspmd-opt FILE -p PASSES [--print-ir-after-all | --print-ir-after A,B | --print-ir-before A,B]
                   [--dump-dir D] [--pass-timing]

Built on xDSL's `xDSLOptMain`: hspmd's dialects and passes are added to xDSL's own (cse,
dce, canonicalize, ...). `--load-pass` loads every `ModulePass` subclass defined in a Python
file or an importable module, under the pass's `name`. Errors are one located message (exit code
1). A pass failing on an exception that no pass raises for bad input (not a PassError, nor a
verifier's) is a bug in that pass: `hspmd-opt: internal error in <pass>: ...`, the IR it was given
written to a file whose path is printed, a request to report it, exit code 3.

The flags that watch the passes are `hspmd compile`'s (`hspmd.transforms.pass_manager`): the IR
after every pass, or after/before the passes named, to `D/passes/NN-NAME.mlir` or stdout; a table
of the passes' wall times and op counts on stderr. A pass loaded with `--load-pass` is checked as
in `hspmd compile`: the IR verified after it, one line naming it and the failing op otherwise.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Sequence

from xdsl.passes import ModulePass
from xdsl.utils.exceptions import ArgSpecParseError, ParseError
from xdsl.xdsl_opt_main import xDSLOptMain

from hspmd.cli.errors import describe


class LoadPassError(Exception):
    """A `--load-pass` file or module could not be loaded or defines no pass."""


def load_user_passes(source: str) -> dict[str, type[ModulePass]]:
    """Return {name: pass class} for every ModulePass defined in a Python file or module."""
    if source.endswith(".py") or os.sep in source:
        if not os.path.isfile(source):
            raise LoadPassError(f"--load-pass {source}: no such file")
        spec = importlib.util.spec_from_file_location(f"hspmd_user_passes_{abs(hash(source))}", source)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # user code
            raise LoadPassError(f"--load-pass {source}: {type(err).__name__}: {err}") from None
    else:
        try:
            module = importlib.import_module(source)
        except ImportError as err:
            raise LoadPassError(f"--load-pass {source}: {err}") from None
    found = {
        cls.name: cls
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, ModulePass) and cls is not ModulePass and cls.__module__ == module.__name__
        and isinstance(getattr(cls, "name", None), str)
    }
    if not found:
        raise LoadPassError(f"--load-pass {source}: defines no ModulePass subclass with a 'name'")
    return found


class OptInternalError(Exception):
    """A pass of hspmd-opt failed on an exception no pass raises for bad input: a bug in that pass."""

    def __init__(self, pass_name: str, cause: BaseException, ir_path: str | None) -> None:
        self.pass_name, self.cause, self.ir_path = pass_name, cause, ir_path
        text = (str(cause).strip().splitlines() or [""])[0]
        super().__init__(f"internal error in {pass_name}: {type(cause).__name__}" + (f": {text}" if text else ""))


def _input_errors() -> tuple[type[BaseException], ...]:
    """Return the exceptions a pass raises when its input IR is not what it takes (the user's input)."""
    from xdsl.utils.exceptions import DiagnosticException, VerifyException

    from hspmd.dialects.levels import LevelError
    from hspmd.dialects.sharding import ShardingError
    from hspmd.ir.layout import LayoutError
    from hspmd.ir.strategy import StrategyError
    from hspmd.transforms.util import PassError

    return PassError, ShardingError, LayoutError, StrategyError, LevelError, VerifyException, DiagnosticException


def _write_input(name: str, start, passes: list[ModulePass], ctx) -> str | None:
    """Return the path of a new file holding the input of pass `name`: `start` with `passes` applied."""
    import tempfile

    from hspmd.dialects.context import module_text

    try:
        module = start.clone()
        for p in passes:
            p.apply(ctx, module)
        path = os.path.join(tempfile.mkdtemp(prefix="hspmd-internal-"), f"before-{name}.mlir")
        with open(path, "w") as f:
            f.write(module_text(module))
        return path
    except Exception:  # noqa: BLE001 - the report of a bug must not hide it behind another
        return None


class HspmdOptMain(xDSLOptMain):
    """xDSLOptMain with hspmd's dialects and passes, plus passes loaded by the user."""

    def __init__(self, args: Sequence[str] | None, user_passes: dict[str, type[ModulePass]]):
        self._user_passes = user_passes
        super().__init__(description="hspmd IR optimizer driver", args=args)
        self.manager = self._pass_manager()

    def _pass_manager(self):
        """Return the PassManager that applies the pipeline's passes: the user's checked, printing and
        timing as the flags ask."""
        from hspmd.transforms.pass_manager import PassManager
        from hspmd.transforms.pass_pipeline import PipelineEdits

        names = [n for n in (self.args.print_ir_after or "").split(",") if n.strip()]
        before = [n for n in (self.args.print_ir_before or "").split(",") if n.strip()]
        manager = PassManager(edits=PipelineEdits(self._user_passes), print_after_all=self.args.print_ir_after_all,
                              print_after=frozenset(n.strip() for n in names),
                              print_before=frozenset(n.strip() for n in before), dump_dir=self.args.dump_dir,
                              timing=self.args.pass_timing, user_raises_are_errors=False)
        manager.check_names(p.name for p in self.pipeline.passes)
        return manager

    def register_all_dialects(self) -> None:
        super().register_all_dialects()
        from hspmd.dialects.context import hspmd_dialects

        for dialect in hspmd_dialects():
            if dialect.name not in self.ctx.registered_dialect_names:
                self.ctx.register_dialect(dialect.name, lambda d=dialect: d)

    def register_all_passes(self) -> None:
        super().register_all_passes()
        from hspmd.transforms import get_all_passes

        for name, loader in get_all_passes().items():
            self.register_pass(name, loader)
        for name, cls in self._user_passes.items():
            self.register_pass(name, lambda c=cls: c)

    def apply_passes(self, prog) -> None:
        """Apply the pipeline's passes in order, as xDSL does; a pass that fails with an exception no
        pass raises for bad input (a PassError, a verifier's) is a bug in that pass: `OptInternalError`
        with the IR it was given (the passes before it run again on a copy of the input)."""
        passes, callback = list(self.pipeline.passes), self.pipeline.callback
        start = prog.clone()
        if callback is not None:
            callback(None, prog, passes[0] if passes else None)
        for i, p in enumerate(passes):
            try:
                self.manager.apply(p, self.ctx, prog)
            except _input_errors():
                raise
            except Exception as err:
                raise OptInternalError(p.name, err, _write_input(p.name, start, passes[:i], self.ctx)) from err
            if callback is not None:
                callback(p, prog, passes[i + 1] if i + 1 < len(passes) else None)

    def output_resulting_program(self, prog) -> str:
        """Return the program as `hspmd compile` writes it, so dumps print back unchanged."""
        if self.args.target != "mlir":
            return super().output_resulting_program(prog)
        from hspmd.dialects.context import module_text

        return module_text(prog)

    def register_all_arguments(self, arg_parser) -> None:
        super().register_all_arguments(arg_parser)
        arg_parser.add_argument(
            "--load-pass",
            action="append",
            default=[],
            metavar="FILE_OR_MODULE",
            help="load ModulePass subclasses from a Python file or module (repeatable)",
        )
        arg_parser.add_argument("--print-ir-after-all", action="store_true",
                                help="print the module after every pass: D/passes/NN-NAME.mlir with --dump-dir, "
                                     "else stdout")
        arg_parser.add_argument("--print-ir-after", metavar="NAME,...", help="print the module after the passes named")
        arg_parser.add_argument("--print-ir-before", metavar="NAME,...",
                                help="print the module before the passes named")
        arg_parser.add_argument("--dump-dir", metavar="D", help="where --print-ir-* write their files (D/passes/)")
        arg_parser.add_argument("--pass-timing", action="store_true",
                                help="print each pass's wall time, share and op counts before and after (stderr)")


def _pre_scan_load_pass(argv: list[str]) -> list[str]:
    sources = []
    for i, arg in enumerate(argv):
        if arg == "--load-pass" and i + 1 < len(argv):
            sources.append(argv[i + 1])
        elif arg.startswith("--load-pass="):
            sources.append(arg.split("=", 1)[1])
    return sources


def main(argv: list[str] | None = None) -> int:
    """Run hspmd-opt; return the exit code (1 on any user error, with one message; 3 on a pass's bug)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        user = {}
        for source in _pre_scan_load_pass(argv):
            user.update(load_user_passes(source))
        tool = HspmdOptMain(argv, user)
        tool.run()
        if tool.manager.timing:
            sys.stderr.write(tool.manager.timing_table())
    except LoadPassError as err:
        print(f"hspmd-opt: error: {err}", file=sys.stderr)
        return 1
    except ParseError as err:
        loc = err.span.get_location()
        context = "\n".join(line for line in str(err).splitlines()[1:] if line.strip() != err.msg.strip())
        print(f"{loc.file}:{loc.line}:{loc.col}: error: {err.msg}\n{context}", file=sys.stderr)
        return 1
    except ArgSpecParseError as err:
        print(f"hspmd-opt: error: {err}", file=sys.stderr)
        return 1
    except OptInternalError as err:  # a bug in a pass, not in the input
        print(f"hspmd-opt: {err}", file=sys.stderr)
        if err.ir_path:
            print(f"hspmd-opt: the IR given to {err.pass_name} is in {err.ir_path}", file=sys.stderr)
        print(f"hspmd-opt: this is a bug in the pass {err.pass_name}, not in the input IR: please report it with "
              "the command you ran" + (" and that file" if err.ir_path else ""), file=sys.stderr)
        return 3
    except Exception as err:  # verifier, pass or I/O errors: one message, no traceback
        print(f"hspmd-opt: error: {describe(err)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
