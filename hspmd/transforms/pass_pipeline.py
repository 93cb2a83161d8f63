"""The pass pipeline of a compile as text, and the edits a user makes to it.

`hspmd compile` runs its passes level by level (`hspmd.compiler.compile_pipeline` lists them):

    logical     the training step: [stack-layers], [recompute], autodiff, the optimizer
    annotated   apply-strategy{...}, apply-annotations, ..., insert-reshard, ...
    physical    specialize-groups, lower-reshard[, the pipeline passes][, coalesce-group-sums]
    kernel      fuse-kernels, on each device group's module
    device      device-kernels, flash-attention, multi-tensor: the GPU program of a group

A level's passes print as the text `hspmd-opt -p` reads (`lower-reshard`,
`apply-strategy{strategy="[0,1]: dp=2"}`); a whole pipeline prints one level per line,
`LEVEL: PASSES` (`//` starts a comment line). `parse_pipeline_text` reads either form back.

`PipelineEdits` is what a user asks of the pipeline on the command line: levels replaced
(`--pipeline`), passes inserted after or before a named pass (`--pass-after NAME=PASS{opts}`,
`--pass-before NAME=PASS`, in the order given: a later insertion may name an earlier one's pass),
and the passes loaded from their own files (`--load-pass`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from xdsl.passes import ModulePass, PassPipeline
from xdsl.utils.exceptions import ArgSpecParseError

from hspmd.transforms import get_all_passes
from hspmd.transforms.util import PassError

__all__ = ["LEVELS", "Insertion", "Pipeline", "PipelineEdits", "PipelineTextError", "parse_pipeline_text",
           "passes_text"]

#: the levels of a compile, in the order they run (kernel and device: once per device group's module)
LEVELS = ("logical", "annotated", "physical", "kernel", "device")

_LEVEL_LINE = re.compile(r"^\s*(" + "|".join(LEVELS) + r")\s*:(.*)$")


class PipelineTextError(PassError):
    """Pipeline text, a pass insertion or a replaced level that cannot be used: the message says
    which flag and why (a user's error)."""


def passes_text(passes: Iterable[ModulePass]) -> str:
    """Return `passes` as `hspmd-opt -p` text: `a,b{opt=1}` (options at their defaults left out)."""
    return ",".join(str(p.spec()) for p in passes)


@dataclass(frozen=True)
class Pipeline:
    """The passes of one compile, by level (`LEVELS`; a level with no passes is empty)."""

    levels: Mapping[str, tuple[ModulePass, ...]]

    def level(self, name: str) -> list[ModulePass]:
        """Return the passes of level `name` (a new list)."""
        return list(self.levels.get(name, ()))

    def names(self) -> list[str]:
        """Return every pass name of the pipeline, in order (with repeats)."""
        return [p.name for level in LEVELS for p in self.levels.get(level, ())]

    def text(self, level: str | None = None) -> str:
        """Return level `level`'s passes as `-p` text, or (None) every level as `LEVEL: PASSES` lines."""
        if level is not None:
            return passes_text(self.levels.get(level, ()))
        return "".join(f"{name}: {passes_text(self.levels.get(name, ()))}\n" for name in LEVELS)


def _build(spec: str, available: Mapping[str, Callable[[], type[ModulePass]]], what: str) -> list[ModulePass]:
    """Return the passes `-p` text `spec` names; PipelineTextError (naming `what`) for text that does
    not parse, a pass nobody registered, or an option the pass does not take."""
    try:
        return list(PassPipeline.parse_spec(dict(available), spec).passes)
    except ArgSpecParseError as err:
        raise PipelineTextError(f"{what}: '{spec}' does not parse as a pass list: {err.msg}") from None
    except ValueError as err:
        text = str(err)
        if text.startswith("Unrecognized passes"):
            text += f" (known: {', '.join(sorted(available))}; --load-pass loads your own)"
        raise PipelineTextError(f"{what}: {text}") from None
    except Exception as err:  # noqa: BLE001 - an option the pass's dataclass refuses
        raise PipelineTextError(f"{what}: {type(err).__name__}: {err}") from None


def parse_pipeline_text(text: str, available: Mapping[str, Callable[[], type[ModulePass]]] | None = None,
                        level: str | None = None, what: str = "--pipeline") -> dict[str, list[ModulePass]]:
    """Return {level: passes} that pipeline `text` gives: `LEVEL: PASSES` lines (the levels not
    named are left out), or a bare pass list, which is level `level` (PipelineTextError without one)."""
    available = {**get_all_passes(), **(available or {})}
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(("//", "#"))]
    levelled = [_LEVEL_LINE.match(ln) for ln in lines]
    if any(levelled):
        out: dict[str, list[ModulePass]] = {}
        for ln, m in zip(lines, levelled):
            if m is None:
                raise PipelineTextError(f"{what}: line '{ln.strip()}' names no level; write it as LEVEL: PASSES "
                                        f"(a level is one of {', '.join(LEVELS)})")
            if m.group(1) in out:
                raise PipelineTextError(f"{what}: level {m.group(1)} is given twice")
            out[m.group(1)] = _build(m.group(2).strip(), available, f"{what} ({m.group(1)})")
        return out
    if level is None:
        raise PipelineTextError(f"{what}: a bare pass list needs a level; write LEVEL: PASSES lines "
                                f"(a level is one of {', '.join(LEVELS)})")
    return {level: _build(",".join(ln.strip() for ln in lines), available, what)}


@dataclass(frozen=True)
class Insertion:
    """`--pass-after ANCHOR=SPEC` (`after`) or `--pass-before ANCHOR=SPEC`: the passes of `SPEC`
    inserted after (before) every pass named `ANCHOR`."""

    anchor: str
    spec: str
    after: bool = True

    @classmethod
    def parse(cls, text: str, after: bool = True) -> Insertion:
        """Return the insertion `NAME=PASS[{options}]` says; PipelineTextError where it is not that."""
        anchor, sep, spec = text.partition("=")
        if not sep or not anchor.strip() or not spec.strip() or "{" in anchor:
            flag = "--pass-after" if after else "--pass-before"
            raise PipelineTextError(f"{flag} {text}: expected NAME=PASS[{{options}}], e.g. "
                                    f"{flag} lower-reshard=my-pass")
        return cls(anchor.strip(), spec.strip(), after)

    def flag(self) -> str:
        """Return the command-line flag that asked for it."""
        return f"--pass-{'after' if self.after else 'before'} {self.anchor}={self.spec}"


@dataclass(frozen=True)
class PipelineEdits:
    """What a user changes in a compile's pipeline (see the module docstring).

    `user_passes`: {name: pass class} loaded from the user's files; `replace`: {level: `-p`
    text} replacing that level; `insertions`, applied in order.
    """

    user_passes: Mapping[str, type[ModulePass]] = field(default_factory=dict)
    replace: Mapping[str, str] = field(default_factory=dict)
    insertions: tuple[Insertion, ...] = ()

    def available(self) -> dict[str, Callable[[], type[ModulePass]]]:
        """Return {name: loader} of every pass a pipeline may name: hspmd's and the user's."""
        return {**get_all_passes(), **{name: (lambda c=cls: c) for name, cls in self.user_passes.items()}}

    def __bool__(self) -> bool:
        return bool(self.user_passes or self.replace or self.insertions)

    def apply(self, pipeline: Pipeline) -> Pipeline:
        """Return `pipeline` with the levels replaced and the passes inserted; PipelineTextError
        for text that does not parse or an insertion whose pass the pipeline does not have."""
        available = self.available()
        levels = {name: tuple(pipeline.levels.get(name, ())) for name in LEVELS}
        for level, text in self.replace.items():
            levels[level] = tuple(_build(text, available, f"--pipeline ({level})"))
        for ins in self.insertions:
            new = tuple(_build(ins.spec, available, ins.flag()))
            hit = False
            for level, passes in levels.items():
                out: list[ModulePass] = []
                for p in passes:
                    here = p.name == ins.anchor
                    out.extend(new if here and not ins.after else ())
                    out.append(p)
                    out.extend(new if here and ins.after else ())
                    hit = hit or here
                levels[level] = tuple(out)
            if not hit:
                names = list(dict.fromkeys(p.name for lv in LEVELS for p in levels[lv]))
                raise PipelineTextError(f"{ins.flag()}: the pipeline has no pass '{ins.anchor}' (its passes: "
                                        f"{', '.join(names)}; 'hspmd compile SCRIPT --print-pipeline' lists them)")
        return Pipeline(levels)
