"""Four large sums in flight on every rank, polled in orders and at times that differ between ranks.

Under ``mpiexec -n 3 python polled_buckets.py`` each rank prints ``ok`` when every sum equals the
blocking all_reduce of its own buffers (tests/test_comm_nonblocking.py).
"""
from __future__ import annotations

import time

import numpy as np

from hspmd.runtime.comm.mpi import MPICommunicator

comm = MPICommunicator()
group = tuple(range(comm.size))
ok = True
for trial in range(20):
    xs = [np.random.default_rng([trial, j, comm.rank]).standard_normal(100000).astype(np.float32) for j in range(4)]
    requests = [comm.iall_reduce(x, group) for x in xs]
    for _ in range(200):
        for req in (requests[::-1] if comm.rank % 2 else requests):
            if req.test():
                req.wait()
        if comm.rank == 0:
            time.sleep(0.0005)
    sums = [req.wait() for req in requests]
    ok = ok and all(np.array_equal(s, comm.all_reduce(x, group)) for s, x in zip(sums, xs))
print("ok" if ok else "wrong", flush=True)
comm.close()
