"""The scheduling core's prefetch counters (:class:`CoreStats`), cumulative per core.

Updated by the core's collaborators as they decide (every prefetch started, dropped, read
or wasted); read by the simulator's report, the live service's metrics and the waste
budget (:mod:`kvprefetch.controlplane.core.budgets`). Bytes are KV bytes on the wire.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import TypeVar

from kvprefetch.controlplane.core.tiers import IndexStats

__all__ = ["CoreStats", "summed"]


@dataclass(slots=True)
class CoreStats:
    prefetches: int = 0
    prefetches_dropped: int = 0
    #: Prefetches not started because the node's queue would hide the load they save.
    prefetches_hidden_by_queue: int = 0
    #: Prefetched bytes evicted or overwritten before any request read them.
    wasted_bytes: int = 0
    #: Prefetched bytes a request read.
    prefetch_used_bytes: int = 0
    #: Bytes of every prefetch order started (what the waste budget bounds).
    prefetch_exposed_bytes: int = 0
    #: Prefetches not started because the waste budget was spent.
    prefetches_over_budget: int = 0
    #: Bytes of the warm-ups of empty nodes started (free room only: outside the budget,
    #: which they widen by as much).
    warmup_bytes: int = 0
    #: Displacement bets settled (:mod:`kvprefetch.controlplane.core.bets`): the session
    #: a prefetch would bring came back before the residents it would displace ...
    bets_won: int = 0
    #: ... or one of them came first, or the prefetch was evicted unread.
    bets_lost: int = 0


_Counters = TypeVar("_Counters", CoreStats, IndexStats)


def summed(cls: type[_Counters], parts: Iterable[_Counters]) -> _Counters:
    """Counters of several cores (or tiers) added field by field."""
    total = cls()
    for part in parts:
        for f in fields(cls):
            setattr(total, f.name, getattr(total, f.name) + getattr(part, f.name))
    return total
