"""What a parameter-server run needs to know besides its programs (docs/parameter-server.md).

A `PSPlan` says how many workers and servers a run has, how they communicate (`comm`:
"ps" or "hybrid"), the consistency model (`bound`: 0 for BSP, S for SSP:S, None for ASP),
the HET cache's size per worker, which parameters go through the servers and to which server,
and which of those are embedding tables looked up by an input of ids (only the rows a batch
touches are pulled and pushed). It is pure data: the compiler writes it as JSON into the
bundle, the runtime reads it.

Parameters are given to servers by range: in program order, cut into K contiguous runs whose
bytes are as even as a greedy cut makes them (`assign_by_bytes`), as ps-lite cuts its key
range into one range per server.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

__all__ = ["PSPlan", "PSPlanError", "assign_by_bytes", "PLAN_FILE"]

#: the file of a bundle that holds its `PSPlan`
PLAN_FILE = "ps.json"


class PSPlanError(ValueError):
    """A parameter-server plan that cannot be made or read."""


def assign_by_bytes(sizes: list[tuple[str, int]], servers: int) -> dict[str, int]:
    """Return {name: server} cutting `sizes` (name, bytes), in order, into `servers` contiguous ranges.

    Each cut closes a range once it holds at least its fair part of what is left, so the ranges'
    bytes are as even as contiguous ranges of these sizes allow a greedy cut; every server gets
    a parameter while there are parameters to give.

    >>> assign_by_bytes([("a", 4), ("b", 4), ("c", 8)], 2)
    {'a': 0, 'b': 0, 'c': 1}
    """
    if servers < 1:
        raise PSPlanError(f"a parameter-server run needs at least one server, not {servers}")
    out: dict[str, int] = {}
    left = sum(b for _, b in sizes)
    server, held = 0, 0
    for i, (name, nbytes) in enumerate(sizes):
        out[name] = server
        held += nbytes
        remaining_servers = servers - server - 1
        remaining_params = len(sizes) - i - 1
        fair = left / (servers - server)
        if remaining_servers and remaining_params and (held >= fair or remaining_params <= remaining_servers):
            left -= held
            server, held = server + 1, 0
    return out


@dataclass(frozen=True)
class PSPlan:
    """A parameter-server run: workers, servers, comm mode, consistency, cache and parameter homes."""

    workers: int
    servers: int
    comm: str  # "ps" or "hybrid"
    consistency: str  # "bsp", "asp" or "ssp:S"
    bound: int | None  # steps a worker may run ahead of the slowest (None: no bound)
    cache_rows: int = 0
    cache_bound: int = 0  # steps a cached row is used after its pull
    #: parameter -> the server that holds it (the parameters that go through servers)
    homes: dict[str, int] = field(default_factory=dict)
    #: embedding table -> the input of ids it is looked up by (rows pulled and pushed sparsely)
    tables: dict[str, str] = field(default_factory=dict)
    #: the global batch rows (each worker's program takes rows / workers of them)
    batch_rows: int = 0

    def on_server(self, server: int) -> list[str]:
        """Return the parameters server `server` (0-based among servers) holds, in order."""
        return [name for name, s in self.homes.items() if s == server]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_json(text: str) -> "PSPlan":
        try:
            data = json.loads(text)
            return PSPlan(**data)
        except (ValueError, TypeError) as err:
            raise PSPlanError(f"not a parameter-server plan: {err}") from None


#: the file of a parameter-server bundle that holds server k's update step
SERVER_UPDATE_FILE = "server{k}_update.mlir"
#: the file of a hybrid bundle that holds the workers' update step of the dense parameters
DENSE_UPDATE_FILE = "dense_update.mlir"
