"""The final parameters: the global value of every parameter in one `.npz` file, written atomically.

Each rank holds pieces; `gather_parameters` brings one copy of every distinct piece to rank 0,
which assembles the global arrays with the layout algebra. The file is written to a temporary
name and renamed, so a crash never leaves a half-written checkpoint.
"""

from __future__ import annotations

import os

import numpy as np

from hspmd.runtime.comm.base import Communicator
from hspmd.runtime.plan import Plan
from hspmd.runtime.stacked import per_layer


def gather_parameters(plan: Plan, state: dict[str, np.ndarray], comm: Communicator) -> dict[str, np.ndarray] | None:
    """Return the global parameters on rank 0 (None on other ranks), per layer where the program
    stacks layers (`hspmd.runtime.stacked`)."""
    out: dict[str, np.ndarray] = {}
    for tag, p in enumerate(plan.params):
        owners: dict[tuple, int] = {}
        for device in p.layout.devices:
            key = tuple((s.start, s.stop) for s in p.layout.slices(device, p.global_shape))
            owners.setdefault(key, device)
        if comm.rank == 0:
            full = np.empty(p.global_shape, p.dtype)
            for key, device in owners.items():
                region = tuple(slice(a, b) for a, b in key)
                piece = state[p.name] if device == 0 else comm.recv(np.empty(full[region].shape, p.dtype), device, tag)
                full[region] = piece
            out[p.name] = full
        elif comm.rank in owners.values():
            comm.send(state[p.name].copy(), 0, tag)
    return per_layer(out) if comm.rank == 0 else None


def save_checkpoint(path: str, params: dict[str, np.ndarray], step: int) -> None:
    """Write `params` (and the step) to `path` atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}.npz"
    np.savez(tmp, **{f"param/{k}": v for k, v in params.items()}, step=np.array(step))
    os.replace(tmp, path)


def load_checkpoint(path: str) -> tuple[dict[str, np.ndarray], int]:
    """Return (parameters, step) from a checkpoint file."""
    with np.load(path) as data:
        params = {k[len("param/") :]: data[k] for k in data.files if k.startswith("param/")}
        return params, int(data["step"])
