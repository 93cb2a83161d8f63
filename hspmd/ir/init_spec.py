"""Parameter initialisers: the `init` text of `graph.parameter` and the values it makes.

The value of a parameter depends only on (seed, parameter name, spec, global shape), never on
how many ranks run or how the parameter is laid out: every rank makes the global value and
keeps its own piece, so a run on N ranks starts from the same numbers as a run on one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

KINDS = {"zeros": 0, "ones": 0, "full": 1, "normal": 1, "uniform": 2}


@dataclass(frozen=True)
class InitSpec:
    """A parsed initialiser: `kind` with its numeric `args` (`normal:0.02` -> normal, (0.02,))."""

    kind: str
    args: tuple[float, ...] = ()

    def __str__(self) -> str:
        return ":".join([self.kind, *(repr(a) for a in self.args)])


def parse_init_spec(text: str) -> InitSpec:
    """Return the InitSpec that `text` spells (`zeros`, `ones`, `full:VALUE`, `normal:STD`, `uniform:LO:HI`)."""
    kind, *raw = text.split(":")
    if kind not in KINDS:
        raise ValueError(f"unknown initialiser '{text}': expected one of zeros, ones, full:VALUE, normal:STD, uniform:LO:HI")
    if len(raw) != KINDS[kind]:
        raise ValueError(f"initialiser '{text}' takes {KINDS[kind]} number(s) after '{kind}'")
    try:
        args = tuple(float(a) for a in raw)
    except ValueError:
        raise ValueError(f"initialiser '{text}' has a part that is not a number") from None
    return InitSpec(kind, args)


def initial_value(spec: InitSpec | str, shape: tuple[int, ...], dtype, name: str, seed: int) -> np.ndarray:
    """Return the global initial value of parameter `name`, a function of its name and seed only.

    A stacked parameter (`blocks.[0:4].ln1.weight`, `hspmd.ir.stacked_names`) is its layers'
    values stacked, each made under its own name: the same numbers as the layers unstacked.
    """
    from hspmd.ir.stacked_names import is_stacked, layer_names

    if isinstance(spec, str):
        spec = parse_init_spec(spec)
    if is_stacked(name) and spec.kind not in ("zeros", "ones", "full"):
        names = layer_names(name)
        if not shape or shape[0] != len(names):
            raise ValueError(f"stacked parameter '{name}' holds {len(names)} layers but has shape {list(shape)}")
        return np.stack([initial_value(spec, tuple(shape[1:]), dtype, n, seed) for n in names])
    if spec.kind == "zeros":
        return np.zeros(shape, dtype)
    if spec.kind == "ones":
        return np.ones(shape, dtype)
    if spec.kind == "full":
        return np.full(shape, spec.args[0], dtype)
    key = int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little")
    rng = np.random.default_rng(key)
    if spec.kind == "normal":
        return rng.normal(0.0, spec.args[0], shape).astype(dtype)
    return rng.uniform(spec.args[0], spec.args[1], shape).astype(dtype)
