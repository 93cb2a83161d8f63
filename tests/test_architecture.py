"""The package picture of docs/architecture.md holds: imports run one way, no import cycles, small passes.

Every `import hspmd...` in the package is read from the source with `ast` (module-level and
lazy imports inside functions alike), so an import that breaks the layering fails here, not in
review.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "hspmd"

#: what each part of the package may import (besides itself). The parts, top to bottom:
#: cli -> planner -> compiler -> frontend, transforms -> codegen -> dialects -> ir; the runtime sits below
#: the compiler and reads only the IR, the dialects and codegen's finished artifacts; `data` sits at
#: the bottom beside `ir` (it imports nothing of hspmd).
ALLOWED: dict[str, frozenset[str]] = {
    "api": frozenset({"frontend", "ir", "data"}),  # hspmd/__init__.py: the tracing API users import as `hs`
    "cli": frozenset({"planner", "compiler", "frontend", "transforms", "codegen", "runtime", "dialects", "ir", "data"}),
    "planner": frozenset({"compiler", "frontend", "transforms", "codegen", "dialects", "ir", "data"}),
    "compiler": frozenset({"frontend", "transforms", "codegen", "runtime", "dialects", "ir", "data"}),
    "frontend": frozenset({"dialects", "ir", "data"}),
    "transforms": frozenset({"codegen", "dialects", "ir"}),
    "runtime": frozenset({"codegen", "dialects", "ir", "data"}),
    "codegen": frozenset({"dialects", "ir"}),
    "dialects": frozenset({"ir"}),
    "ir": frozenset(),
    # hs.data: datasets, the sampler, the loader; read by the scripts (through the frontend), the
    # compiler (a first batch to trace) and the runtime (each rank's rows), so it sits at the bottom
    "data": frozenset(),
}

#: the line budgets of the passes (docs/architecture.md, "Size")
TRANSFORM_FILE_LINES = 650
TRANSFORM_FUNCTION_LINES = 120


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _part(module: str) -> str:
    """Return the part of the package picture that `module` belongs to."""
    parts = module.split(".")
    if len(parts) == 1:
        return "api"
    return parts[1]


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Return the hspmd modules that the file at `path` imports (a name imported from a package
    that is itself a module counts as that module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "hspmd")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "hspmd":
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
            out.update(subs or {node.module})
            if subs and len(subs) < len(node.names):
                out.add(node.module)
    return {m for m in out if m in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def test_every_part_of_the_package_is_in_the_table():
    assert {_part(m) for m in _modules()} <= ALLOWED.keys()


def test_imports_run_one_way():
    bad = sorted(f"{a} imports {b} ({_part(a)} -> {_part(b)})"
                 for a, bs in _graph().items() for b in bs
                 if _part(a) != _part(b) and _part(b) not in ALLOWED[_part(a)])
    assert not bad, "imports against docs/architecture.md:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Return the strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_files():
    graph = _graph()
    # a package's __init__ is imported by its every submodule on the way in; an edge from the
    # package to its own submodule is a re-export, not a dependency of the package's parts
    cycles = _cycles({a: {b for b in bs if not b.startswith(a + ".")} for a, bs in graph.items()})
    assert not cycles, f"import cycles: {cycles}"


def test_no_import_cycle_between_parts():
    parts: dict[str, set[str]] = {}
    for a, bs in _graph().items():
        parts.setdefault(_part(a), set()).update(_part(b) for b in bs if _part(b) != _part(a))
    assert not _cycles(parts), f"cycles between parts of the package: {_cycles(parts)}"


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("path", sorted((ROOT / "transforms").rglob("*.py")), ids=lambda p: p.name)
def test_passes_stay_small(path: Path):
    text = path.read_text()
    assert text.count("\n") <= TRANSFORM_FILE_LINES, f"{path.name}: {text.count(chr(10))} lines"
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > TRANSFORM_FUNCTION_LINES]
    assert not long, f"{path.name}: functions over {TRANSFORM_FUNCTION_LINES} lines: {long}"
