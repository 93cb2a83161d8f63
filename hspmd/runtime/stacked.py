"""Stacked parameters at the runtime's edges: what users and files see is per layer.

A program whose layers are stacked (`stack-layers`, `graph.scan`) holds one array per stacked
parameter, `blocks.[0:48].attn.proj.weight` of shape [48, ...]; its slice i is layer
`blocks.i.attn.proj.weight`. Checkpoints, `--init-from` files, `--checkpoint` files and the
parameters a run returns name every layer's tensor on its own, so they are the same whether a
program stacks its layers or not, and move between the two (resume a stacked run unstacked, with
pipelines, and back).

    >>> per_layer({"blocks.[0:2].b": np.array([[1.0], [2.0]]), "head": np.array([3.0])})["blocks.1.b"]
    array([2.])
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from hspmd.codegen.schedule.model import Leaf
from hspmd.ir.stacked_names import is_stacked, layer_names


def per_layer(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Return `values` with each stacked entry replaced by one entry per layer (views of its slices)."""
    out: dict[str, np.ndarray] = {}
    for name, value in values.items():
        if is_stacked(name):
            out.update(zip(layer_names(name), value))
        else:
            out[name] = value
    return out


def layer_leaves(leaves: Iterable[Leaf]) -> list[Leaf]:
    """Return `leaves` with each stacked leaf replaced by one leaf per layer (its layout without the
    stacking dim; a stacked leaf's layout never splits that dim)."""
    out: list[Leaf] = []
    for leaf in leaves:
        if not is_stacked(leaf.name):
            out.append(leaf)
            continue
        layout, shape = leaf.layout.shift_dims(-1), leaf.global_shape[1:]
        out.extend(Leaf(n, leaf.slot, shape, layout, leaf.dtype, leaf.init) for n in layer_names(leaf.name))
    return out


def stacked(values: dict[str, np.ndarray], leaves: Iterable[Leaf]) -> dict[str, np.ndarray]:
    """Return per-layer `values` (a rank's pieces, as `layer_leaves` names them) with the layers of
    each stacked leaf stacked into one array again; other entries as they are."""
    out = dict(values)
    for leaf in leaves:
        if is_stacked(leaf.name):
            out[leaf.name] = np.stack([out.pop(n) for n in layer_names(leaf.name)])
    return out
