"""The restarted ranks' side: their state of step c, assembled from the peer copies in host memory.

Each rank needs, of every tensor its new plan holds, the region its new layout gives it (any
strategy, any number of ranks: the same reshard-on-load as a disk checkpoint's). The pieces are
in slot files in the shared memory of the hosts that kept them (`recovery.Recovery` says which
host, file and offset). A rank reads what lies on its own host directly from the mapped file,
and only the overlap with its region; what lies on another host is read there by the lowest rank
of that host and sent to it (one request and one message per overlap, over the run's
communicator). The ranks then agree, with one all-reduce, that every rank has all it needs before
any of them goes on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from hspmd.codegen.schedule.model import Leaf
from hspmd.runtime.comm.base import Communicator
from hspmd.runtime.launcher.peer.copier import gather_hosts, host_name
from hspmd.runtime.launcher.peer.placement import region_of
from hspmd.runtime.launcher.peer.recovery import Recovery

__all__ = ["PeerRestoreError", "load_peer_state"]

TAG_ASK_LENGTH, TAG_ASK, TAG_PART = 29111, 29112, 29113


class PeerRestoreError(Exception):
    """The state could not be assembled from the peer copies (the message says what was missing);
    `elsewhere`: another rank found it, and says so."""

    def __init__(self, message: str, elsewhere: bool = False) -> None:
        super().__init__(message)
        self.elsewhere = elsewhere


def _overlap(a, b):
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(x0 < x1 for x0, x1 in out) or not out else None


def _read(piece: dict, dtype: str, inter) -> np.ndarray:
    """Return the `inter` region of `piece`, read from its slot file on this host."""
    region = [tuple(r) for r in piece["region"]]
    shape = tuple(b - a for a, b in region)
    data = np.memmap(piece["file"], dtype=dtype, mode="r", offset=int(piece["offset"]), shape=shape or (1,))
    data = data.reshape(shape)
    index = tuple(slice(a - p0, b - p0) for (a, b), (p0, _) in zip(inter, region))
    return np.array(data[index] if index else data, copy=True)


def load_peer_state(recovery: Recovery, leaves: Sequence[Leaf], comm: Communicator,
                    host: str | None = None) -> dict[str, np.ndarray]:
    """Return this rank's pieces of `leaves` (per layer, as checkpoints name them) at
    `recovery.step` (collective over `comm`; see the module docstring)."""
    hosts = gather_hosts(comm, host or host_name(comm.rank))
    here = hosts[comm.rank]
    first = {}
    for r, h in enumerate(hosts):
        first.setdefault(h, r)
    out: dict[str, np.ndarray] = {}
    asks: dict[int, list] = {}  # provider -> [(name, piece index, overlap)]
    places: dict[int, list] = {}  # provider -> [(name, destination index)] in the order asked
    problem = None
    try:
        for leaf in leaves:
            entry = recovery.tensors.get(leaf.name)
            if entry is None:
                raise PeerRestoreError(f"the peer copies of step {recovery.step} hold no '{leaf.name}'")
            if tuple(entry["shape"]) != tuple(leaf.global_shape) or np.dtype(entry["dtype"]) != np.dtype(leaf.dtype):
                raise PeerRestoreError(f"'{leaf.name}' is {entry['dtype']}{entry['shape']} in the peer copies, "
                                       f"{leaf.dtype}{list(leaf.global_shape)} in this program")
            want = region_of(leaf, comm.rank)
            value = out[leaf.name] = np.empty(tuple(b - a for a, b in want), dtype=leaf.dtype)
            filled = np.zeros(value.shape, dtype=bool)  # pieces may overlap (recovery.cover): each read once
            for i, piece in enumerate(entry["pieces"]):
                inter = _overlap(want, [tuple(r) for r in piece["region"]])
                if inter is None:
                    continue
                dst = tuple(slice(a - w0, b - w0) for (a, b), (w0, _) in zip(inter, want))
                if filled[dst].all():
                    continue
                filled[dst] = True
                if piece["host"] == here:
                    value[dst] = _read(piece, leaf.dtype, inter)
                elif piece["host"] in first:
                    p = first[piece["host"]]
                    asks.setdefault(p, []).append([leaf.name, i, [list(x) for x in inter]])
                    places.setdefault(p, []).append((leaf.name, dst))
                else:
                    raise PeerRestoreError(f"'{leaf.name}': its piece at {piece['region']} is on host "
                                           f"{piece['host']}, where no rank of the run is now")
            if not filled.all():
                raise PeerRestoreError(f"'{leaf.name}': the peer copies cover {int(filled.sum())} of the "
                                       f"{value.size} elements this rank needs")
    except PeerRestoreError as err:
        problem = str(err)
    if len(set(hosts)) > 1:
        _fetch(recovery, asks, places, out, comm)
    flags = np.array([0 if problem is None else 1], np.int64)
    if comm.size > 1:
        flags = comm.all_reduce(flags, tuple(range(comm.size)))
    if problem is not None:
        raise PeerRestoreError(problem)
    if int(flags[0]):
        raise PeerRestoreError("another rank could not assemble its state from the peer copies (it says why)", True)
    return out


def _fetch(recovery: Recovery, asks: dict, places: dict, out: dict, comm: Communicator) -> None:
    """Get the overlaps `asks` names from their providers, and serve the ones asked of this rank."""
    n, group = comm.size, tuple(range(comm.size))
    wanted = {p: np.frombuffer(json.dumps(a).encode(), np.uint8) for p, a in asks.items()}
    lengths = np.array([wanted[p].size if p in wanted else 0 for p in range(n)], np.int64)
    asked = comm.all_to_all(lengths, group, 0, 0)  # asked[q]: the length of q's request to this rank
    pending = [comm.isend(wanted[p], p, TAG_ASK) for p in sorted(wanted)]
    for q in range(n):
        if int(asked[q]):
            request = json.loads(comm.recv(np.zeros(int(asked[q]), np.uint8), q, TAG_ASK).tobytes())
            for name, i, inter in request:
                entry = recovery.tensors[name]
                pending.append(comm.isend(_read(entry["pieces"][i], entry["dtype"], [tuple(x) for x in inter]),
                                          q, TAG_PART))
    for p in sorted(places):
        for (name, dst), (_, _, inter) in zip(places[p], asks[p]):
            part = np.empty(tuple(b - a for a, b in inter), dtype=out[name].dtype)
            out[name][dst] = comm.recv(part, p, TAG_PART)
    for req in pending:
        req.wait()
