"""A communicator that hands every call to another one: the base of wrappers that change a few."""

from __future__ import annotations

import numpy as np

from hspmd.runtime.comm.base import Communicator, Group, Request

__all__ = ["Forwarding"]


class Forwarding(Communicator):
    """Every call goes to `inner` as it is; subclasses override what they change."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    def all_reduce(self, buf: np.ndarray, group: Group, out: np.ndarray | None = None) -> np.ndarray:
        return self.inner.all_reduce(buf, group, out)

    def iall_reduce(self, buf: np.ndarray, group: Group, out: np.ndarray | None = None) -> Request:
        return self.inner.iall_reduce(buf, group, out)

    def all_gather(self, buf: np.ndarray, group: Group, axis: int, out: np.ndarray | None = None,
                   **kwargs) -> np.ndarray:
        return self.inner.all_gather(buf, group, axis, out, **kwargs)

    def iall_gather(self, buf: np.ndarray, group: Group, axis: int, out: np.ndarray | None = None) -> Request:
        return self.inner.iall_gather(buf, group, axis, out)

    def reduce_scatter(self, buf: np.ndarray, group: Group, axis: int, out: np.ndarray | None = None) -> np.ndarray:
        return self.inner.reduce_scatter(buf, group, axis, out)

    def broadcast(self, buf: np.ndarray, group: Group, root: int, out: np.ndarray | None = None) -> np.ndarray:
        return self.inner.broadcast(buf, group, root, out)

    def all_to_all(self, buf: np.ndarray, group: Group, split_axis: int, concat_axis: int,
                   out: np.ndarray | None = None) -> np.ndarray:
        return self.inner.all_to_all(buf, group, split_axis, concat_axis, out)

    def send(self, buf: np.ndarray, dest: int, tag: int = 0) -> None:
        self.inner.send(buf, dest, tag)

    def isend(self, buf: np.ndarray, dest: int, tag: int = 0) -> Request:
        return self.inner.isend(buf, dest, tag)

    def recv(self, out: np.ndarray, source: int, tag: int = 0) -> np.ndarray:
        return self.inner.recv(out, source, tag)

    def irecv(self, out: np.ndarray, source: int, tag: int = 0) -> Request:
        return self.inner.irecv(out, source, tag)

    def sendrecv(self, buf: np.ndarray, dest: int, out: np.ndarray, source: int, sendtag: int = 0,
                 recvtag: int = 0) -> np.ndarray:
        return self.inner.sendrecv(buf, dest, out, source, sendtag, recvtag)

    def barrier(self) -> None:
        self.inner.barrier()

    def close(self) -> None:
        self.inner.close()
