"""Hot switching: move a rank's state from one compiled strategy's layouts to another's, in memory.

Every parameter and optimizer state (`opt.*`, the step counter `opt.step` among them) is a
leaf of the step program; what a rank holds of it under a strategy is its layout's region for
that rank (`Layout.slices`, as checkpoints read pieces back under another strategy). The
holdings of *every* rank come from the strategy's bundle (each group program's parameters), so
all ranks derive the same `SwitchPlan` (`hspmd.ir.switch_plan`) without talking; it is planned
once per ordered pair of strategies and cached. Each rank then sends, to each peer, one message
with every piece that peer lacks (bytes, any dtypes packed together) and copies what it already
holds. Nothing else needs moving: the learning rate and dropout's random numbers follow the step
number, which the run keeps across switches.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from hspmd.codegen.bundle import read_manifest
from hspmd.codegen.schedule.model import Leaf
from hspmd.dialects import graph
from hspmd.dialects.context import parse_module
from hspmd.dialects.dist import layout_of
from hspmd.dialects.levels import physical_groups
from hspmd.ir.layout import PARTIAL
from hspmd.ir.switch_plan import Region, SwitchError, SwitchPlan, plan_switch
from hspmd.ir.types import dtype_name
from hspmd.runtime.comm.base import Communicator
from hspmd.runtime.stacked import layer_leaves, per_layer, stacked

__all__ = ["SWITCH_TAG", "Holdings", "SwitchStats", "Switcher", "bundle_holdings", "switch_state"]

#: the message tag of switch transfers (one message per pair of ranks per switch); within the 32767
#: every MPI guarantees, apart from the trace's gather tags (32001, 32002)
SWITCH_TAG = 32011

#: rank -> tensor name -> the leaf that rank holds (its global shape, layout, dtype)
Holdings = dict[int, dict[str, Leaf]]


def bundle_holdings(bundle: str) -> Holdings:
    """Return what every rank holds of every parameter under the bundle's strategy, read from the
    parameters of each group's physical program (a pipeline stage holds only its own layers), per
    layer: a stacked parameter (`hspmd.runtime.stacked`) as each of its layers, so that strategies
    whose programs stack the layers otherwise (a pipeline's stages each hold a piece) meet."""
    manifest = read_manifest(bundle)
    out: Holdings = {}
    for entry in manifest.groups:
        path = os.path.join(bundle, entry.program)
        module = parse_module(open(path).read(), path)
        for _, group in physical_groups(module):
            for o in group.walk():
                if not isinstance(o, graph.ParameterOp):
                    continue
                typ = o.properties["global_type"]
                layout = layout_of(typ)
                leaf = Leaf(o.tensor_name.data, 0, tuple(typ.get_shape()), layout, dtype_name(o.result.type))
                if layout.hetero == PARTIAL or any(g.states.is_partial for g in layout.groups):
                    raise SwitchError(f"{path}: parameter '{leaf.name}' is laid out as partial sums ('{layout}'); "
                                      f"a switch moves whole pieces only")
                for d in layout.devices:
                    for layer in layer_leaves([leaf]):
                        out.setdefault(d, {})[layer.name] = layer
    return out


def _regions(holdings: Holdings) -> dict[int, dict[str, Region]]:
    return {r: {name: tuple((s.start, s.stop) for s in leaf.layout.slices(r, leaf.global_shape))
                for name, leaf in leaves.items()} for r, leaves in holdings.items()}


def _tensors(*sides: Holdings) -> dict[str, tuple[tuple[int, ...], int]]:
    out: dict[str, tuple[tuple[int, ...], int]] = {}
    for side in sides:
        for leaves in side.values():
            for name, leaf in leaves.items():
                fact = (tuple(leaf.global_shape), np.dtype(leaf.dtype).itemsize)
                if out.setdefault(name, fact) != fact:
                    raise SwitchError(f"tensor '{name}' is {list(out[name][0])} ({out[name][1]} bytes per element) "
                                      f"under one strategy and {list(fact[0])} ({fact[1]}) under another")
    return out


def _local(region: Region, holder: Region) -> tuple[slice, ...]:
    """Return `region` (global) as an index into the piece that covers `holder` (global)."""
    return tuple(slice(a - h0, b - h0) for (a, b), (h0, _) in zip(region, holder))


@dataclass(frozen=True)
class SwitchStats:
    """One switch as a rank saw it: seconds, and the plan's bytes moved and messages (all ranks)."""

    seconds: float
    bytes_moved: int
    messages: int


def switch_state(plan: SwitchPlan, state: dict[str, np.ndarray], before: dict[str, Leaf], after: dict[str, Leaf],
                 rank: int, comm: Communicator) -> dict[str, np.ndarray]:
    """Return this rank's state under `after` from its `state` under `before`, by `plan`.

    Sends go out first (non-blocking, one message per peer), then receives, one per peer.
    """
    def region(leaf: Leaf) -> Region:
        return tuple((s.start, s.stop) for s in leaf.layout.slices(rank, leaf.global_shape))

    held = {name: region(leaf) for name, leaf in before.items()}
    requests = []
    for dst, transfers in plan.sends(rank).items():
        parts = [np.ascontiguousarray(state[t.name][_local(t.region, held[t.name])]).view(np.uint8).ravel()
                 for t in transfers]
        requests.append(comm.isend(np.concatenate(parts), dst, SWITCH_TAG))
    wanted = {name: region(leaf) for name, leaf in after.items()}
    # a piece held alike before and after is kept as it is (no copy); the others are built
    out = {name: state[name] if held.get(name) == wanted[name] and state[name].dtype == np.dtype(leaf.dtype)
           else np.empty(leaf.layout.local_shape(rank, leaf.global_shape), leaf.dtype) for name, leaf in after.items()}
    for src, transfers in sorted(plan.receives(rank).items(), key=lambda kv: kv[0] != rank):
        if src == rank:
            for t in transfers:
                if out[t.name] is not state.get(t.name):
                    out[t.name][_local(t.region, wanted[t.name])] = state[t.name][_local(t.region, held[t.name])]
            continue
        sizes = [t.elements() * out[t.name].itemsize for t in transfers]
        buf = comm.recv(np.empty(sum(sizes), np.uint8), src, SWITCH_TAG)
        at = 0
        for t, n in zip(transfers, sizes):
            dst = out[t.name][_local(t.region, wanted[t.name])]
            dst[...] = buf[at:at + n].view(out[t.name].dtype).reshape(dst.shape)
            at += n
    for r in requests:
        r.wait()
    return out


class Switcher:
    """Switches one rank's state between the strategies of a run; plans once per pair (cached).

    `holdings[i]`: what every rank holds under strategy i (`bundle_holdings`, per layer);
    `params[i]`: this rank's parameters under strategy i as its program names them (stacked
    layers stacked; empty where the rank has no part in strategy i).
    """

    def __init__(self, holdings: list[Holdings], comm: Communicator, params: list[list[Leaf]] | None = None) -> None:
        self.holdings, self.comm = holdings, comm
        self.params = params if params is not None else [[] for _ in holdings]
        self._plans: dict[tuple[int, int], SwitchPlan] = {}

    def plan(self, a: int, b: int) -> SwitchPlan:
        """Return the plan from strategy `a` to strategy `b` (made on first use)."""
        if (a, b) not in self._plans:
            before, after = self.holdings[a], self.holdings[b]
            self._plans[a, b] = plan_switch(_regions(before), _regions(after), _tensors(before, after))
        return self._plans[a, b]

    def switch(self, state: dict[str, np.ndarray], a: int, b: int) -> tuple[dict[str, np.ndarray], SwitchStats]:
        """Return this rank's state moved from strategy `a`'s layouts to `b`'s, and the switch's stats
        (a GPU run's state, device arrays, is read to the host: `b`'s plan uploads what it is given)."""
        start = time.perf_counter()
        plan = self.plan(a, b)
        rank = self.comm.rank
        state = {k: v if isinstance(v, np.ndarray) else np.asarray(v) for k, v in state.items()}
        new = switch_state(plan, per_layer(state), self.holdings[a].get(rank, {}), self.holdings[b].get(rank, {}),
                           rank, self.comm)
        return stacked(new, self.params[b]), SwitchStats(time.perf_counter() - start, plan.bytes_moved(),
                                                         plan.messages())
