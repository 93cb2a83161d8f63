"""The host memory of in-memory peer copies (`--redundancy peer`), per rank of a strategy group.

A rank keeps, twice (the copy being written and the last complete one), the pieces of the state
it keeps and its ward's pieces that no other rank holds (`hspmd.runtime.launcher.peer.placement`): a piece
held by one rank (a zero, tp, pp or ep shard) is kept by it and copied to its buddy; a piece
replicated over dp is kept by two of its dp holders and copied nowhere. With u the bytes a rank
holds alone and r those replicated over dp > 1, a rank keeps u + 2 r / dp and receives its
ward's u, in two slots each:

    copies per rank = 2 (2 u + 2 r / dp)

Parameters are replicated over dp unless zero=3 shards them, optimizer states unless zero
shards them; under dp = 1 everything is held alone.
"""

from __future__ import annotations

from hspmd.planner.cost import GroupConfig
from hspmd.planner.facts import ModelFacts

__all__ = ["SLOTS", "copies_bytes"]

#: the copies of every slot (`hspmd.runtime.launcher.peer.slots.SLOTS`)
SLOTS = 2


def copies_bytes(facts: ModelFacts, config: GroupConfig) -> float:
    """Return the bytes of host memory the peer copies take per rank of a group run as `config`."""
    shard = config.tp * config.pp
    params, states = facts.param_bytes / shard, facts.state_bytes / shard
    dp = config.dp
    if dp == 1:
        alone, replicated = params + states, 0.0
    else:
        alone = (params / dp if config.zero == 3 else 0.0) + (states / dp if config.zero else 0.0)
        replicated = (0.0 if config.zero == 3 else params) + (0.0 if config.zero else states)
    return SLOTS * (2 * alone + 2 * replicated / dp)
