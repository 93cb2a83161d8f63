"""Which transport each communicator group of a run uses: NCCL, host-staged MPI, or plain MPI.

A rank's place is its kind of device ("cpu" or "cuda"), its host and, on a GPU rank, the GPU it
takes: its local rank modulo the GPUs it sees, named as `CUDA_VISIBLE_DEVICES` names them (a
physical index or a UUID; the CUDA ordinal where the variable is unset), so that ranks which
see different subsets still compare their GPUs rightly. More ranks than GPUs share them.

Per group (a tuple of global ranks, as the communicators take them):

* ``"nccl"``: every member is a GPU rank, on a GPU no other member holds (`nccl.py`);
* ``"staged"``: some member is a GPU rank, but members share a GPU (NCCL refuses two ranks on
  one device) or the group mixes GPU and CPU ranks: device arrays go through (pinned) host
  buffers and the NumPy `Communicator` (MPI);
* ``"mpi"``: every member is a CPU rank: the NumPy `Communicator` as it is.

Pure functions of the places (and of the environment, read where said), so that the choice is
tested without a GPU; `gather_places` collects every rank's place over the host communicator.

>>> places = [RankPlace("cuda", "h", "0"), RankPlace("cuda", "h", "1"), RankPlace("cuda", "h", "0"),
...           RankPlace("cpu", "h")]
>>> [choose_transport(g, places) for g in [(0, 1), (0, 2), (1, 3), (3,)]]
['nccl', 'staged', 'staged', 'mpi']
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .base import CommError, Communicator

__all__ = ["RankPlace", "TRANSPORTS", "choose_transport", "gather_places", "gpu_of", "place_of_rank",
           "transports", "visible_gpus"]

#: the transports, from the fastest where it applies
TRANSPORTS = ("nccl", "staged", "mpi")
KINDS = ("cpu", "cuda")


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs: its kind of device, its host, and its GPU (None on a CPU rank)."""

    kind: str
    host: str = ""
    gpu: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise CommError(f"a rank's device is cpu or cuda, not '{self.kind}'")
        if (self.kind == "cuda") != (self.gpu is not None):
            raise CommError(f"a {self.kind} rank {'needs' if self.kind == 'cuda' else 'has no'} GPU")


def visible_gpus(count: int, env: Mapping[str, str] | None = None) -> list[str]:
    """Return the GPUs a process sees, in the order of their CUDA ordinals, as
    `CUDA_VISIBLE_DEVICES` names them; where it is unset, the ordinals 0..count-1.

    As CUDA reads the variable: entries up to the first one that is not an index or a UUID
    (`GPU-...`, `MIG-...`) count, a repeated one ends the list, and no more than `count` (the
    GPUs CUDA reports) are seen.

    >>> visible_gpus(2, {"CUDA_VISIBLE_DEVICES": "3,1"}), visible_gpus(2, {})
    (['3', '1'], ['0', '1'])
    """
    env = os.environ if env is None else env
    text = env.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return [str(i) for i in range(count)]
    out: list[str] = []
    for entry in (e.strip() for e in text.split(",")):
        ok = entry.isdigit() or entry.startswith(("GPU-", "MIG-"))
        if not ok or entry in out:
            break
        out.append(str(int(entry)) if entry.isdigit() else entry)
    return out[:count]


def gpu_of(local_rank: int, visible: Sequence[str]) -> tuple[int, str]:
    """Return (CUDA ordinal, name) of the GPU a rank of `local_rank` takes among `visible`:
    local rank modulo the GPUs seen, so that ranks beyond the GPUs share them.

    >>> [gpu_of(r, ["2", "3"]) for r in range(3)]
    [(0, '2'), (1, '3'), (0, '2')]
    """
    if not visible:
        raise CommError("a GPU rank sees no GPU (CUDA_VISIBLE_DEVICES hides them all, or there is none)")
    ordinal = int(local_rank) % len(visible)
    return ordinal, visible[ordinal]


def place_of_rank(kind: str, local_rank: int, gpu_count: int, env: Mapping[str, str] | None = None,
                  host: str | None = None) -> RankPlace:
    """Return the place of a rank of `kind` with `local_rank` on a host of `gpu_count` GPUs
    (as CUDA counts them, after `CUDA_VISIBLE_DEVICES`; `env` default: this process's)."""
    host = socket.gethostname() if host is None else host
    if kind == "cpu":
        return RankPlace("cpu", host)
    return RankPlace(kind, host, gpu_of(local_rank, visible_gpus(gpu_count, env))[1])


def choose_transport(group: Iterable[int], places: Sequence[RankPlace]) -> str:
    """Return "nccl", "staged" or "mpi" for the global ranks of `group` (see the module docstring)."""
    members = [places[r] for r in group]
    kinds = {p.kind for p in members}
    if kinds == {"cpu"}:
        return "mpi"
    if kinds == {"cuda"}:
        gpus = [(p.host, p.gpu) for p in members]
        if len(set(gpus)) == len(gpus):
            return "nccl"
    return "staged"


def transports(groups: Iterable[Sequence[int]], places: Sequence[RankPlace]) -> dict[tuple[int, ...], str]:
    """Return the transport of each group (as a tuple of global ranks)."""
    return {tuple(int(r) for r in g): choose_transport(g, places) for g in groups}


def gather_places(comm: Communicator, place: RankPlace) -> list[RankPlace]:
    """Return every rank's place, in rank order, from each rank's own `place` (collective over
    the world of `comm`: one all-gather of fixed-size records)."""
    record = np.zeros(256, np.uint8)
    text = f"{place.kind}\n{place.host}\n{'' if place.gpu is None else place.gpu}".encode()
    if len(text) > record.size:
        raise CommError(f"a rank's place does not fit {record.size} bytes: {text[:60]!r}...")
    record[:len(text)] = np.frombuffer(text, np.uint8)
    everyone = comm.all_gather(record[None, :], tuple(range(comm.size)), axis=0)
    out = []
    for row in everyone:
        kind, host, gpu = bytes(row).rstrip(b"\0").decode().split("\n")
        out.append(RankPlace(kind, host, gpu or None))
    return out
