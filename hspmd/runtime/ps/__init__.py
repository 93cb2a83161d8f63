"""Parameter servers (Hetu v1's PS and Hybrid architectures, BSP/ASP/SSP, the HET cache).

A run of N workers and K servers is one MPI job of N + K ranks (`hspmd run -n N --servers K`):
ranks 0..N-1 are workers, N..N+K-1 servers; the workers' own collectives use a communicator of
the workers only. Workers run the step compiled for one device on their rows of each batch and
push gradients; servers hold the parameters by range (`hspmd.ir.ps_plan`), apply the optimizer
with the same update ops as a compiled step (`update.UpdateStep`) and answer pulls when the
consistency model admits them (`clocks.Clocks`). See docs/parameter-server.md.

    main.py     the entry point every rank of such a run starts (`python -m hspmd.runtime.ps.main`)
    worker.py   a worker's training loop: pull, compute, push (and under hybrid, all-reduce)
    server.py   a server's loop: pushes, pulls, clocks, updates
    clocks.py   per-worker clocks and the admission rule of BSP / SSP:S / ASP
    update.py   the optimizer's update step, run on whole parameters or on rows of a table
    cache.py    the HET cache: hot embedding rows kept on a worker with bounded staleness
    protocol.py the message tags and what each message carries, the workers' heartbeat
    faults.py   what a rank that dies means for the run (`hspmd run` decides with it)
    checkpoints.py  the servers' (and hybrid's worker 0's) sharded checkpoints, and resuming
"""
