"""What starts, watches and restarts ranks.

- `launch`: mpiexec found and run, each rank's share of the cores;
- `outside`: a rank of a job another launcher (srun, mpirun, mpiexec) started;
- `watch`, `rank_guard`: the elastic launcher's watch over its ranks and how each one ended;
- `fault`: faults injected for tests and benchmarks (`HSPMD_FAULT`);
- `heartbeat`: each rank's beats, for `--silent-after`;
- `standby`: the ranks of the next attempt, started ahead;
- `leave`: a rank leaving the run on SIGTERM;
- `idle`: ranks a strategy does not name, and the communicator of those it does;
- `peer/`: in-memory peer copies of the training state (`--redundancy peer[:K]`).
"""
