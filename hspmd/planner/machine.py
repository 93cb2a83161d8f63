"""What the planner knows of the devices: compute rates per rank and the time of a collective.

`Machine` holds, per rank, a small table of matmul rates by matmul size (FLOPs of one call,
FLOP/s) read by linear interpolation in log(FLOPs), and an elementwise rate (bytes written
per second); per pair of ranks a latency and a bandwidth. A collective over a group costs what
the ring algorithm costs on the group's slowest link (latency per round, bytes over the
bandwidth), with the bytes a rank sends as `hspmd compile --report` counts them.

`Machine.uniform(n)` assumes every rank alike (the planner's default without a profile);
`Machine.from_profile(profile)` reads a measured `DeviceProfile` (`hspmd profile`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Machine"]

#: a rank's matmul rates when nothing was measured: (FLOPs of one call, FLOP/s); small matmuls
#: run below the large-shape rate (measured on a 2-core machine's NumPy, rounded)
DEFAULT_MATMUL = ((1e5, 2e9), (1e7, 2e10), (1e9, 6e10))
#: elementwise bytes written per second, link latency (s) and bandwidth (bytes/s) by default
DEFAULT_ELEMENTWISE = 2e9
DEFAULT_LATENCY = 2e-5
DEFAULT_BANDWIDTH = 2e9


@dataclass(frozen=True)
class Machine:
    """Rates of `n` ranks (see the module docstring)."""

    matmul: tuple[tuple[tuple[float, float], ...], ...]  # per rank: ((FLOPs per call, FLOP/s), ...)
    elementwise: tuple[float, ...]  # per rank: bytes written per second
    latency: tuple[tuple[float, ...], ...]  # [a][b]: seconds
    bandwidth: tuple[tuple[float, ...], ...]  # [a][b]: bytes per second
    measured: bool = False  # from a profile, or assumed
    op_overhead: float = 2e-5  # seconds a kernel costs whatever its size (dispatch, launch)

    @property
    def n(self) -> int:
        return len(self.elementwise)

    @staticmethod
    def uniform(n: int, speed: tuple[float, ...] | None = None) -> Machine:
        """Return `n` ranks alike (or with relative compute `speed`s), this machine's defaults."""
        speed = tuple(speed) if speed is not None else (1.0,) * n
        return Machine(tuple(tuple((f, r * s) for f, r in DEFAULT_MATMUL) for s in speed),
                       tuple(DEFAULT_ELEMENTWISE * s for s in speed),
                       tuple((DEFAULT_LATENCY,) * n for _ in range(n)),
                       tuple((DEFAULT_BANDWIDTH,) * n for _ in range(n)))

    def matmul_rate(self, rank: int, flops_per_call: float) -> float:
        """Return rank's FLOP/s on matmuls of `flops_per_call` FLOPs each."""
        table = self.matmul[rank]
        x = math.log(max(flops_per_call, 1.0))
        pts = [(math.log(f), r) for f, r in table]
        if x <= pts[0][0]:
            return pts[0][1]
        for (x0, r0), (x1, r1) in zip(pts, pts[1:]):
            if x <= x1:
                return r0 + (r1 - r0) * (x - x0) / (x1 - x0)
        return pts[-1][1]

    def link(self, group: tuple[int, ...]) -> tuple[float, float]:
        """Return (latency, bandwidth) of the slowest link between neighbours of `group`'s ring."""
        if len(group) < 2:
            return 0.0, math.inf
        pairs = list(zip(group, group[1:] + group[:1]))
        return (max(self.latency[a][b] for a, b in pairs), min(self.bandwidth[a][b] for a, b in pairs))

    def collective(self, kind: str, group: tuple[int, ...], nbytes: float, calls: int = 1) -> float:
        """Return the seconds of `calls` collectives `kind` over `group`, each on a buffer of
        `nbytes` per rank (all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send)."""
        n = len(group)
        if n < 2 or nbytes <= 0:
            return 0.0
        alpha, beta = self.link(group)
        if kind == "all_reduce":
            rounds, sent = 2 * (n - 1), 2 * (n - 1) / n * nbytes
        elif kind in ("all_gather", "reduce_scatter", "all_to_all"):
            rounds, sent = n - 1, (n - 1) / n * nbytes
        elif kind in ("broadcast", "send"):
            rounds, sent = (n - 1 if kind == "broadcast" else 1), nbytes
        else:
            raise ValueError(f"unknown collective {kind!r}")
        return calls * (rounds * alpha) + calls * sent / beta

    def speeds(self, flops_per_call: float) -> tuple[float, ...]:
        """Return every rank's matmul rate at `flops_per_call`."""
        return tuple(self.matmul_rate(r, flops_per_call) for r in range(self.n))
