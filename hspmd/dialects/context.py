"""The xDSL context with every dialect hspmd speaks, and text I/O with located errors."""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import Builtin, ModuleOp
from xdsl.dialects.func import Func
from xdsl.ir import Dialect
from xdsl.parser import Parser
from xdsl.printer import Printer
from xdsl.utils.exceptions import DiagnosticException, ParseError, VerifyException


def hspmd_dialects() -> tuple[Dialect, ...]:
    """Return hspmd's own dialects: graph, optim, dist, comm, kernel and pipeline."""
    from hspmd.dialects.comm import Comm
    from hspmd.dialects.dist import Dist
    from hspmd.dialects.graph import Graph
    from hspmd.dialects.kernel import Kernel
    from hspmd.dialects.optim import Optim
    from hspmd.dialects.pipeline import Pipeline

    return (Graph, Optim, Dist, Comm, Kernel, Pipeline)


def make_context() -> Context:
    """Return a fresh Context with builtin, func and hspmd's dialects loaded."""
    ctx = Context()
    for dialect in (Builtin, Func, *hspmd_dialects()):
        ctx.load_dialect(dialect)
    return ctx


@dataclass
class IRTextError(Exception):
    """Malformed or invalid IR text: `FILE:LINE:COL: error: MESSAGE` plus the source line."""

    where: str
    message: str
    context: str = ""

    def __str__(self) -> str:
        text = f"{self.where}: error: {self.message}"
        return text + ("\n" + self.context if self.context else "")


def parse_module(text: str, name: str = "<input>", ctx: Context | None = None) -> ModuleOp:
    """Return the verified module that `text` spells; IRTextError with a location otherwise."""
    try:
        module = Parser(ctx or make_context(), text, name).parse_module()
    except ParseError as err:
        loc = err.span.get_location()
        lines = str(err).splitlines()
        context = "\n".join(line for line in lines[1:] if line.strip() != err.msg.strip())
        raise IRTextError(f"{loc.file}:{loc.line}:{loc.col}", err.msg, context) from None
    verify_located(module, name)
    return module


def verify_located(module: ModuleOp, name: str = "<input>") -> None:
    """Verify `module`; on failure raise IRTextError naming the failing op."""
    try:
        module.verify()
    except (VerifyException, DiagnosticException) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise IRTextError(name, first) from None


def module_text(module: ModuleOp) -> str:
    """Return `module` printed in xDSL's custom syntax, ending with a newline."""
    import io

    out = io.StringIO()
    Printer(stream=out).print_op(module)
    return out.getvalue().rstrip("\n") + "\n"
