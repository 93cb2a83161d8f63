"""Idle ranks: a run of N ranks whose strategy names only some of them.

`hspmd run -n N --strategy S` where S names a part of ranks 0..N-1 (the planner's choice where a
rank is so slow that the step is faster without it: `[0]: dp=1 device=cuda` beside a CPU rank
1) runs S on the ranks it names and leaves the others idle:

* the compiler sees S renumbered onto 0..K-1 in rank order (`working_strategy`;
  `hspmd.compiler.compile_working`), so the
  program, its checkpoints and its log are those of a K-rank run; the bundle's manifest keeps
  which ranks of the run work (`Manifest.ranks`, `Manifest.world_size`);
* each working rank talks to the others through `RankSubset`, a communicator over the working
  ranks only (rank i of it is the run's rank `ranks[i]`), so no collective ever waits for an
  idle rank, and the first working rank writes the log, the checkpoints and the result;
* an idle rank runs no step and no collective: it returns at once and its process exits
  cleanly (exit code 0) while the others train.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hspmd.ir.strategy import Strategy, StrategyError, StrategyGroup
from hspmd.runtime.comm.base import CommError, Communicator, Group, Request

__all__ = ["RankSubset", "idle_ranks", "mark_working_ranks", "working_strategy"]


def working_strategy(strategy: Strategy, n: int) -> tuple[Strategy, tuple[int, ...]]:
    """Return (`strategy` renumbered onto ranks 0..K-1 in rank order, the run's ranks it works on).

    The ranks are `range(n)` and `strategy` itself where it names every rank; StrategyError
    (one line) where it names a rank outside 0..n-1."""
    devices = strategy.devices
    if sorted(devices) == list(range(n)):
        return strategy, tuple(range(n))
    outside = sorted({d for d in devices if not 0 <= d < n})
    if outside:
        raise StrategyError(f"strategy '{strategy}' uses device{'s' if len(outside) > 1 else ''} "
                            f"{','.join(map(str, outside))} but the run has -n {n} (ranks 0-{n - 1}; a rank the "
                            "strategy does not name stays idle)")
    if len(set(devices)) != len(devices):
        strategy.check_devices(n)  # raises the usual one-line error
    ranks = tuple(sorted(devices))
    index = {r: i for i, r in enumerate(ranks)}
    groups = tuple(_renumbered(g, index) for g in strategy.groups)
    return Strategy(groups), ranks


def _renumbered(group: StrategyGroup, index: dict[int, int]) -> StrategyGroup:
    from dataclasses import replace

    return replace(group, devices=tuple(index[d] for d in group.devices))


def idle_ranks(ranks: Sequence[int], n: int) -> tuple[int, ...]:
    """Return the ranks of 0..n-1 that `ranks` leaves out."""
    return tuple(r for r in range(n) if r not in set(ranks))


class RankSubset(Communicator):
    """The communicator of the working ranks of a run (`ranks`, the run's rank of each, in order):
    rank i here is `ranks[i]` of `world`; groups, peers and roots are numbered here and mapped
    onto the world's ranks, so an idle rank of the world is never part of a collective."""

    def __init__(self, world: Communicator, ranks: Sequence[int]) -> None:
        self.world = world
        self.ranks = tuple(int(r) for r in ranks)
        if world.rank not in self.ranks:
            raise CommError(f"rank {world.rank} is not one of the working ranks {list(self.ranks)}")
        self._rank = self.ranks.index(world.rank)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self.ranks)

    def _group(self, group: Sequence[int]) -> Group:
        g = self.check_group(group)
        return tuple(self.ranks[r] for r in g)

    def _peer(self, peer: int) -> int:
        if not 0 <= int(peer) < len(self.ranks):
            raise CommError(f"peer {peer} is not a rank of the run's {len(self.ranks)} working ranks")
        return self.ranks[int(peer)]

    def all_reduce(self, buf: np.ndarray, group: Group, out: np.ndarray | None = None) -> np.ndarray:
        return self.world.all_reduce(buf, self._group(group), out)

    def iall_reduce(self, buf: np.ndarray, group: Group, out: np.ndarray | None = None) -> Request:
        return self.world.iall_reduce(buf, self._group(group), out)

    def all_gather(self, buf: np.ndarray, group: Group, axis: int, out: np.ndarray | None = None,
                   **kwargs) -> np.ndarray:
        return self.world.all_gather(buf, self._group(group), axis, out, **kwargs)

    def iall_gather(self, buf: np.ndarray, group: Group, axis: int, out: np.ndarray | None = None) -> Request:
        return self.world.iall_gather(buf, self._group(group), axis, out)

    def reduce_scatter(self, buf: np.ndarray, group: Group, axis: int, out: np.ndarray | None = None) -> np.ndarray:
        return self.world.reduce_scatter(buf, self._group(group), axis, out)

    def broadcast(self, buf: np.ndarray, group: Group, root: int, out: np.ndarray | None = None) -> np.ndarray:
        return self.world.broadcast(buf, self._group(group), self._peer(root), out)

    def all_to_all(self, buf: np.ndarray, group: Group, split_axis: int, concat_axis: int,
                   out: np.ndarray | None = None) -> np.ndarray:
        return self.world.all_to_all(buf, self._group(group), split_axis, concat_axis, out)

    def send(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        self.world.send(buf, self._peer(dest), tag)

    def isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Request:
        return self.world.isend(buf, self._peer(dest), tag)

    def recv(self, out: np.ndarray, source: int, tag: int = 0) -> np.ndarray:
        return self.world.recv(out, self._peer(source), tag)

    def sendrecv(self, buf: np.ndarray, dest: int, out: np.ndarray, source: int, sendtag: int = 0,
                 recvtag: int = 0) -> np.ndarray:
        return self.world.sendrecv(buf, self._peer(dest), out, self._peer(source), sendtag, recvtag)

    def barrier(self) -> None:
        """Return once every working rank has entered (one small all-reduce over them)."""
        if len(self.ranks) > 1:
            self.world.all_reduce(np.zeros(1, np.int32), self.ranks)

    def close(self) -> None:
        """Return nothing: the world communicator is its owner's to close."""



def mark_working_ranks(bundle: str, ranks: Sequence[int], n: int) -> None:
    """Record in `bundle`'s manifest that its program runs on the ranks `ranks` of a run of `n`
    (nothing where they are all of them): the others stay idle."""
    if tuple(ranks) == tuple(range(n)):
        return
    from hspmd.codegen.bundle import read_manifest, write_manifest

    manifest = read_manifest(bundle)
    if manifest.num_devices != len(ranks):
        raise ValueError(f"{bundle}: a program of {manifest.num_devices} devices cannot run on ranks {list(ranks)}")
    manifest.ranks, manifest.world_size = [int(r) for r in ranks], n
    write_manifest(bundle, manifest)
