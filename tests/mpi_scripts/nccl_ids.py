"""Under mpiexec: every rank opens NCCL groups with a stand-in NCCL module that records the ids it
is given; the ids go over MPI (`MPICommunicator`), made by each group's first rank. Each rank
writes {group: (id, its NCCL rank)} to DIR/rank<r>.json."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fake_nccl import FakeNccl  # noqa: E402

from hspmd.runtime.comm.mpi import MPICommunicator  # noqa: E402
from hspmd.runtime.comm.nccl import NcclCommunicator  # noqa: E402


class Recording(FakeNccl):
    """Made communicators are recorded, not joined (the members are other processes)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank, self.made = rank, []

    def get_unique_id(self):
        return bytes((self.rank * 7 + i) % 256 for i in range(128))  # differs by maker (bytes, as CuPy 14's)

    def NcclCommunicator(self, ndev, commId, rank):
        if not isinstance(commId, bytes):
            raise TypeError(f"expected bytes, got {type(commId).__name__}")
        self.made.append((ndev, list(commId), rank))
        return self


host = MPICommunicator()
nccl = Recording(host.rank)
comm = NcclCommunicator(host, nccl=nccl)
n = host.size
groups = [tuple(range(n)), tuple(range(n - 1, -1, -1))] + [(a, b) for a in range(n) for b in range(a + 1, n)]
comm.open_groups(groups)
mine = sorted({g for g in groups if host.rank in g})
out = {str(list(g)): made for g, made in zip(mine, nccl.made)}
with open(os.path.join(sys.argv[1], f"rank{host.rank}.json"), "w") as f:
    json.dump(out, f)
host.close()
