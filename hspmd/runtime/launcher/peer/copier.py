"""Each rank's side of the peer copies: after every K-th step, its pieces into host memory, and the
pieces no other rank holds to its buddy (`--redundancy peer[:K]`, docs/checkpoints.md).

At the end of step s (s a multiple of K) a rank

1. waits for the copies it started after step s-K (its send to its buddy, its wards' sends to it)
   and stamps the wards' slots with step s-K (they hold a complete copy now);
2. copies the pieces it keeps (`placement.kept_pieces`) into its own slot for s (a copy in host
   memory, on the training thread: the optimizer writes the state arrays in place at the next
   step), then stamps it;
3. starts sending its unreplicated pieces (the slot's first bytes) to its buddy and receiving
   its wards' into their slots for s. These transfers overlap step s+1.

So at any moment every rank's last stamped own slot and its buddy's last stamped copy are of
steps at most K apart, and a step c that both hold is found after any one rank is lost
(`recovery.plan_recovery`): at most one copy interval of steps is redone, with K = 1 one step.

The run's index (`rank-<r>.json` in the peer directory, on the checkpoint directory's file
system) says, once at the start, which pieces each slot file holds and on which host; the stamps
beside it say which step each slot holds.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Sequence

import numpy as np

from hspmd.codegen.schedule.model import Leaf
from hspmd.runtime.comm.base import Communicator, Request
from hspmd.runtime.launcher.peer.placement import KeptPiece, buddies, kept_pieces, wards
from hspmd.runtime.launcher.peer.slots import SLOTS, SlotFile, SlotLayout, remove_stamp, shm_directory, write_stamp
from hspmd.runtime.stacked import layer_leaves, per_layer

__all__ = ["HOSTS_VARIABLE", "PeerCopies", "PeerCopyError", "gather_hosts", "host_name"]

#: point-to-point tags of the peer copies (apart from a plan's own sends)
TAG_PIECES, TAG_LENGTH, TAG_COPY = 29101, 29102, 29103

#: a test switch: comma-separated host names, one per rank, standing in for the real ones
HOSTS_VARIABLE = "HSPMD_HOSTS"


class PeerCopyError(Exception):
    """A rank cannot make its peer copies (the message says why); `elsewhere`: another rank says why."""

    def __init__(self, message: str, elsewhere: bool = False) -> None:
        super().__init__(message)
        self.elsewhere = elsewhere


def host_name(rank: int) -> str:
    """Return the host `rank` runs on (`$HSPMD_HOSTS`' entry for it where that is set, for tests
    of several hosts on one machine)."""
    fake = os.environ.get(HOSTS_VARIABLE)
    if fake:
        names = fake.split(",")
        if rank < len(names):
            return names[rank]
    return socket.gethostname()


def gather_hosts(comm: Communicator, host: str) -> list[str]:
    """Return every rank's host name, in rank order (collective: one all-gather)."""
    record = np.zeros(256, np.uint8)
    text = host.encode()[:256]
    record[:len(text)] = np.frombuffer(text, np.uint8)
    if comm.size == 1:
        return [host]
    everyone = comm.all_gather(record[None, :], tuple(range(comm.size)), axis=0)
    return [bytes(row).rstrip(b"\0").decode() for row in everyone]


def _send_json(comm: Communicator, data, dest: int) -> list[Request]:
    raw = np.frombuffer(json.dumps(data).encode(), np.uint8)
    return [comm.isend(np.array([raw.size], np.int64), dest, TAG_LENGTH), comm.isend(raw, dest, TAG_PIECES)]


def _recv_json(comm: Communicator, source: int):
    size = comm.recv(np.zeros(1, np.int64), source, TAG_LENGTH)
    return json.loads(comm.recv(np.zeros(int(size[0]), np.uint8), source, TAG_PIECES).tobytes())


class PeerCopies:
    """This rank's peer copies (see the module docstring). Made by every rank of `comm` together."""

    def __init__(self, peer_dir: str, comm: Communicator, leaves: Sequence[Leaf], every: int = 1,
                 host: str | None = None, info: dict | None = None) -> None:
        """`peer_dir`: where the index and stamps go (the same directory for every rank); `leaves`:
        the state this rank holds (its plan's parameters, optimizer states among them); `info`:
        what the index records of the run besides (its strategy, for messages)."""
        self.peer_dir, self.comm, self.every = peer_dir, comm, max(1, int(every))
        rank = comm.rank
        self.hosts = gather_hosts(comm, host or host_name(rank))
        self.buddy = buddies(self.hosts)[rank]
        self.wards = wards(buddies(self.hosts), rank)
        self.pieces = kept_pieces(layer_leaves(leaves), rank, self.hosts)
        self.copied = [p for p in self.pieces if p.copied]
        shm = shm_directory(peer_dir)
        layout = SlotLayout.of(self.pieces)
        pending = _send_json(comm, [p.to_json() for p in self.copied], self.buddy) if comm.size > 1 else []
        theirs = {w: SlotLayout.of([KeptPiece.from_json(d) for d in _recv_json(comm, w)]) for w in self.wards}
        for req in pending:
            req.wait()
        problem = None
        self.own: list[SlotFile] = []
        self.copies: dict[int, list[SlotFile]] = {}
        try:  # every rank agrees before any goes on (a rank short of memory would leave the others waiting)
            self.own = [SlotFile(os.path.join(shm, f"rank-{rank}.own-{i}"), layout) for i in range(SLOTS)]
            for w, lay in theirs.items():
                self.copies[w] = [SlotFile(os.path.join(shm, f"rank-{rank}.copy-{w}-{i}"), lay) for i in range(SLOTS)]
        except OSError as err:
            need = SLOTS * (layout.nbytes + sum(lay.nbytes for lay in theirs.values()))
            problem = (f"--redundancy peer: rank {rank} cannot keep its copies ({need / 2**20:.1f} MiB) in {shm} on "
                       f"{self.hosts[rank]}: {err.strerror or err}")
        flags = np.array([problem is not None], np.int64)
        if comm.size > 1:
            flags = comm.all_reduce(flags, tuple(range(comm.size)))
        if problem is not None:
            raise PeerCopyError(problem)
        if int(flags[0]):
            raise PeerCopyError("another rank cannot keep its peer copies (it says why)", elsewhere=True)
        for i in range(SLOTS):
            remove_stamp(peer_dir, self._own_name(i))
            for w in self.wards:
                remove_stamp(peer_dir, self._copy_name(w, i))
        self._write_index(info or {})
        self._sends: list[Request] = []
        self._recvs: list[tuple[int, int, Request]] = []  # (ward, slot, request)
        self._in_flight: dict | None = None  # the stamp the transfers in flight complete
        #: bytes of host memory this rank's slots take (its own two and its wards' two each)
        self.host_bytes = sum(s.layout.nbytes for s in self.own) + sum(
            s.layout.nbytes for files in self.copies.values() for s in files)

    def _own_name(self, slot: int) -> str:
        return f"rank-{self.comm.rank}.own-{slot}"

    def _copy_name(self, ward: int, slot: int) -> str:
        return f"rank-{self.comm.rank}.copy-{ward}-{slot}"

    def _write_index(self, info: dict) -> None:
        """Write this rank's part of the index: its host, buddy, and the pieces of each slot file."""
        def files(slots: list[SlotFile]) -> dict:
            layout = slots[0].layout
            return {"files": [s.path for s in slots], "bytes": layout.nbytes,
                    "pieces": [{**p.to_json(), "offset": o} for p, o in zip(layout.pieces, layout.offsets)]}

        index = {"rank": self.comm.rank, "size": self.comm.size, "host": self.hosts[self.comm.rank],
                 "buddy": self.buddy, "every": self.every, "info": info, "own": files(self.own),
                 "copies": {str(w): files(slots) for w, slots in self.copies.items()}}
        os.makedirs(self.peer_dir, exist_ok=True)
        path = os.path.join(self.peer_dir, f"rank-{self.comm.rank}.json")
        with open(path + ".part", "w", encoding="utf-8") as f:
            f.write(json.dumps(index))
        os.replace(path + ".part", path)

    def due(self, step: int) -> bool:
        """Return whether step `step` ends with a copy."""
        return step % self.every == 0

    def after_step(self, step: int, state: dict[str, np.ndarray], position: dict | None = None) -> None:
        """Copy this rank's pieces of `state` (after step `step`) and start the buddy's copy; `position`:
        what else a resume needs (the data position, a sampler's state), recorded in the stamps."""
        if not self.due(step):
            return
        self._complete()
        slot = (step // self.every) % SLOTS
        stamp = {"step": step, **(position or {"data_position": step})}
        remove_stamp(self.peer_dir, self._own_name(slot))
        values = per_layer(state)
        for piece, view in zip(self.pieces, self.own[slot].views):
            np.copyto(view, np.asarray(values[piece.name]).reshape(view.shape))
        write_stamp(self.peer_dir, self._own_name(slot), stamp)
        if self.copied and self.comm.size > 1:
            self._sends.append(self.comm.isend(self.own[slot].copied_block(), self.buddy, TAG_COPY))
        for w, slots in self.copies.items():
            if slots[slot].layout.copied_bytes:
                remove_stamp(self.peer_dir, self._copy_name(w, slot))
                self._recvs.append((w, slot, self.comm.irecv(slots[slot].copied_block(), w, TAG_COPY)))
        self._in_flight = stamp

    def _complete(self) -> None:
        """Wait for the transfers in flight and stamp the wards' slots they filled."""
        for req in self._sends:
            req.wait()
        for w, slot, req in self._recvs:
            req.wait()
            write_stamp(self.peer_dir, self._copy_name(w, slot), self._in_flight or {})
        self._sends, self._recvs = [], []

    def close(self) -> None:
        """Wait for the transfers in flight (the run's last copy complete)."""
        self._complete()


def position_hook(sampler_state: Callable[[], dict | None] | None) -> Callable[[int], dict]:
    """Return `step -> what a resume needs besides the tensors`: the data position (batches drawn,
    one per step) and, where the run's data sampler gives one, its state (`sampler_state()`)."""
    def position(step: int) -> dict:
        out: dict = {"data_position": step}
        state = sampler_state() if sampler_state is not None else None
        if state is not None:
            out["sampler"] = state
        return out

    return position
