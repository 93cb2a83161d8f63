"""Batch chains run by slices of their batch: causal attention's products and softmax.

Attention runs, per layer, a chain of steps over the same leading batch dim: the qkv bias add,
the scores `q @ k^T` (a batch of small products), the masked softmax (a row kernel), `p @ v`; in
the backward six such steps. Run one after the other, each step streams its whole batch through
the caches: GPT-tiny's scores are 4 MB a layer, and the chain's products ran at 2.2 ms a layer
alone but 5-6 ms in a training step, after the large products had filled the caches with their
own operands. The schedule marks such chains (`hspmd.codegen.schedule.chains`, which also
keeps their values' buffers alive to the chain's end); `tile_chains` replaces each by one step,
a `Chain`, that hands the whole chain to C++ (`native/chain.cpp`): one thread runs every member
on entries `lo:hi` of the batch, the next slice goes to the next free thread, so that a slice's
scores and probabilities stay in one core's caches between the members that write and read
them.

Every entry is computed by the same code on the same operands as in one call (the C++ small
products' kernel, the fused kernels' own row launches), so the values are the same bits.

Before it runs, a `Chain` computes the view steps between its members on whole arrays (views
of results not yet written) and checks that no member writes memory that another entry of a
member reads or writes (once per layout of its arrays: the buffers never move). Where that
check fails, a view step copied (a reshape of a non-contiguous value), or a member cannot be
described to C++ (no native library, an operand not laid out as the kernel needs), the chain
runs one step after the other on whole arrays, as without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.lib.array_utils import byte_bounds

from hspmd.codegen.schedule.model import Schedule

#: a slice holds about this many bytes of the members' operands and results (the caches of a
#: core): GPT-tiny's attention runs one of its 16 sequences (4 heads) at a time
CHUNK_BYTES = 1 << 20


@dataclass
class _Member:
    """One computing step of a chain: `fn(*args, out=out)` on whole arrays; `fn.chain_desc` (a
    batch of small products, `small_matmul`; a fused kernel, `kernel_exec`) describes it to
    `native/chain.cpp`."""

    fn: Callable
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    out: np.ndarray | tuple[np.ndarray, ...]
    describe: Callable | None


@dataclass
class _View:
    fn: Callable
    ins: tuple[int, ...]
    outs: tuple[int, ...]


def _bounds(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return the byte ranges [lo, hi) of each entry of `a`'s leading dim."""
    lo, hi = byte_bounds(a[0])
    starts = np.arange(a.shape[0], dtype=np.int64) * a.strides[0]
    return lo + starts, hi + starts


def crossing(write: np.ndarray, other: np.ndarray) -> bool:
    """Return whether entry i of `write` may share memory with entry j != i of `other` (arrays
    of one leading extent), or `other` of another leading extent may share memory with it."""
    if not np.may_share_memory(write, other):
        return False
    if write.shape[:1] != other.shape[:1]:
        return True
    wl, wh = _bounds(write)
    ol, oh = _bounds(other)
    meet = (wl[:, None] < oh[None, :]) & (ol[None, :] < wh[:, None])
    np.fill_diagonal(meet, False)
    return bool(meet.any())


class Chain:
    """The step that runs a chain's members by slices of their batch (see the module docstring)."""

    def __init__(self, parts: list, lead: int, ins: tuple[int, ...], outs: tuple[int, ...], per_entry: int,
                 run: Callable | None, threads: Callable[[], int]) -> None:
        self.parts, self.lead, self.ins, self.outs = parts, lead, ins, outs
        self.members = [p for p in parts if isinstance(p, _Member)]
        self.per_slice = max(1, min(lead, CHUNK_BYTES // max(per_entry, 1)))
        self._run, self._threads = run, threads
        self._key: tuple | None = None  # the layout of the values last read, and their description
        self._packed: np.ndarray | None = None
        #: whether the last run went by slices (False: the steps one after the other)
        self.last_run_sliced = False
        self.__name__ = "batch_chain"

    def _whole(self, env: dict) -> None:
        """Run the steps one after the other on whole arrays, as without the chain."""
        for p in self.parts:
            result = p.fn(*[env[s] for s in p.ins], **({"out": p.out} if isinstance(p, _Member) else {}))
            if len(p.outs) == 1:
                env[p.outs[0]] = result
            else:
                env.update(zip(p.outs, result))

    def _hazard_free(self, env: dict) -> bool:
        arrays = [([env[s] for s in m.ins if isinstance(env[s], np.ndarray) and env[s].ndim >= 1],
                   list(m.out) if isinstance(m.out, tuple) else [m.out]) for m in self.members]
        every = [a for reads, writes in arrays for a in (*reads, *writes)]
        return not any(crossing(w, x) for _, writes in arrays for w in writes for x in every)

    def _describe(self, env: dict) -> np.ndarray | None:
        """Return the chain for `native/chain.cpp`, or None where it must run whole (a member it
        cannot take, a hazard)."""
        desc: list[int] = []
        for m in self.members:
            d = m.describe(*[env[s] for s in m.ins], out=m.out) if m.describe is not None else None
            if d is None:
                return None
            desc += d
        return np.array(desc, dtype=np.int64) if self._hazard_free(env) else None

    def __call__(self, *values):
        env = dict(zip(self.ins, values))
        for m in self.members:
            env.update(zip(m.outs, m.out if isinstance(m.out, tuple) else (m.out,)))
        views = True
        for p in self.parts:  # the views, of outer values or of results not yet written
            if isinstance(p, _View):
                result = p.fn(*[env[s] for s in p.ins])
                results = result if len(p.outs) > 1 else (result,)
                env.update(zip(p.outs, results))
                source = env[p.ins[0]]
                views = views and all(isinstance(r, np.ndarray) and isinstance(source, np.ndarray)
                                      and np.may_share_memory(r, source) for r in results)
        packed = None
        if self._run is not None and views:  # a view step that copied (a reshape): run whole
            # the results' buffers never move and the views follow from the values read, so the
            # description (pointers included) and the hazard check hold while those keep their layout
            key = tuple((v.__array_interface__["data"][0], v.shape, v.strides, v.dtype.str)
                        if isinstance(v, np.ndarray) and v.ndim > 0 else None for v in values)
            if None in key or key != self._key:
                packed = self._describe(env)
                self._key, self._packed = (key, packed) if None not in key else (None, None)
            else:
                packed = self._packed
        if packed is not None and self._run(self.lead, self.per_slice, packed.ctypes.data, packed.size,
                                            self._threads()) == 0:
            self.last_run_sliced = True
        else:
            self.last_run_sliced = False
            self._whole(env)
        return self._results(env)

    def _results(self, env: dict):
        return env[self.outs[0]] if len(self.outs) == 1 else tuple(env[s] for s in self.outs)


def tile_chains(plan_steps: list, labels: list, schedule: Schedule, kernels: Callable[[int], Callable | None],
                run: Callable | None, threads: Callable[[], int],
                label_of: Callable[["Chain", int, int], object]) -> int:
    """Replace each batch chain of `schedule` in `plan_steps` (the bound steps, index for index) by
    one `Chain` step at its first index and steps that only free slots after it; return how many.

    `kernels(i)` is step i's own kernel (a fused kernel's, with `chain_desc`); `run` is the
    native `hs_chain_run` (None: chains run on whole arrays); `threads()` how many threads a
    chain may use; `label_of` makes the chain's trace label."""
    types = schedule.slot_types
    n = 0
    for first, last in schedule.chains:
        members = [i for i in range(first, last + 1) if schedule.steps[i].op is not None
                   and schedule.steps[i].op.name in ("graph.matmul", "kernel.fused")]
        if any(not isinstance(plan_steps[i][3].get("out"), (np.ndarray, tuple)) for i in members):
            continue  # not written into preallocated results (allocate=False)
        lead = types[schedule.steps[first].outs[0]][0][0]
        parts: list = []
        made: set[int] = set()
        reads: list[int] = []
        per_entry = 0
        for i in range(first, last + 1):
            fn, ins, outs_i, kw, _ = plan_steps[i]
            for s in ins:
                if s not in made and s not in reads:
                    reads.append(s)
            made |= set(outs_i)
            if i in members:
                k = kernels(i) if schedule.steps[i].op.name == "kernel.fused" else fn
                parts.append(_Member(fn, ins, outs_i, kw["out"], getattr(k, "chain_desc", None)))
                per_entry += sum(int(np.prod(types[s][0][1:], dtype=np.int64)) * np.dtype(types[s][1]).itemsize
                                 for s in (*ins, *outs_i) if types[s] is not None and types[s][0][:1] == (lead,))
            else:
                parts.append(_View(fn, ins, outs_i))
        produced = tuple(s for p in parts for s in p.outs)
        chain = Chain(parts, lead, tuple(reads), produced, per_entry, run, threads)
        plan_steps[first] = (chain, chain.ins, produced, {}, plan_steps[first][4])
        labels[first] = label_of(chain, first, last)
        for i in range(first + 1, last + 1):
            plan_steps[i] = (_nothing, (), (), {}, plan_steps[i][4])
            labels[i] = None
        n += 1
    return n


def _nothing() -> None:
    return None
