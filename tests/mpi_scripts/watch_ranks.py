"""A stand-in for the worker in tests of `hspmd.runtime.launcher.watch`: a few steps of all-reduces, and
one way of ending chosen on the command line.

    mpiexec -n 3 python watch_ranks.py STATUS_DIR MODE

Each rank writes `STATUS_DIR/rank-<r>.pid` ("<host> <pid>"), as the worker does, then runs 6
steps. MODE: `ok` (all finish), `kill` (rank 1 SIGKILLs itself at step 3), `abort` (rank 0 calls
MPI_Abort(1) at step 3, as the worker does on an error), `exit` (every rank exits with code 3 at
step 3, as the worker does on an error all ranks agree on), `stubborn` (rank 1 ignores SIGTERM,
then rank 0 SIGKILLs itself at step 3: rank 1 must be killed).
"""

import os
import signal
import socket
import sys
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.rank
status_dir, mode = sys.argv[1], sys.argv[2]
os.makedirs(status_dir, exist_ok=True)
with open(os.path.join(status_dir, f"rank-{rank}.pid"), "w") as f:
    f.write(f"{socket.gethostname()} {os.getpid()}\n")
if mode == "stubborn" and rank == 1:
    signal.signal(signal.SIGTERM, lambda *_: None)
for step in range(1, 7):
    if step == 3:
        if mode == "kill" and rank == 1 or mode == "stubborn" and rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "abort" and rank == 0:
            comm.Abort(1)
        if mode == "exit":
            sys.exit(3)
    comm.allreduce(step)
    time.sleep(0.05)
