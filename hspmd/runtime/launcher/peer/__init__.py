"""In-memory peer copies of the training state (`hspmd run --elastic --redundancy peer[:K]`).

Every K steps each rank keeps its pieces of the parameters and optimizer states in its host's
memory and sends the pieces no other rank holds to a buddy rank on another host, overlapping the
next step; after a rank is lost, the restarted ranks take the state from those copies instead of
from the last disk checkpoint, so at most 2K - 1 steps are redone (one copy interval, and the
copy still in flight; with K = 1, one step) (docs/checkpoints.md, "What survives
what").

- `placement`: who keeps which region, and whose buddy each rank is (pure functions of the layouts);
- `slots`: the host-memory files the copies live in, and their stamps;
- `copier`: a rank's side during training;
- `recovery`: the launcher's side after a loss (the newest step every region survives at);
- `restore`: the restarted ranks' side (their state, resharded, from the copies);
- `session`: what the worker calls.
"""
