"""The scheduler core's tiers: the shared tier vocabulary plus predicted-use eviction.

The core keeps a :class:`Tier` of every node's DRAM tier: in the simulator it *is* the
tier; in the live service it mirrors what the agents report. Entries are keyed by session
id (``TierEntry(session_id, tokens, nbytes, last_use_s, ...)``). The entry record, the
strategy contract, LRU and ``Tier`` live in :mod:`controlplane.base.tiers` (the engine
emulator and the agents use them too); only the strategy that asks the core's forecasts
lives here. Same convention: the **largest** key is evicted first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from controlplane.base.tiers import INF, EvictionStrategy, LruEviction, Tier, TierEntry

__all__ = ["INF", "EvictionStrategy", "LruEviction", "PredictedUseEviction", "Tier",
           "TierEntry"]


class PredictedUseEviction:
    """Furthest predicted next use first (Belady's rule when the predictor is exact).

    ``next_use`` maps sessions to their predicted next-use times (``inf`` = never), in one
    call for all candidates (a learned predictor answers a batch much faster).
    """

    def __init__(self, next_use: Callable[[Sequence[str], float], list[float]]) -> None:
        self._next_use = next_use

    def keys(self, entries: Sequence[TierEntry], now_s: float) -> list[float]:
        return self._next_use([e.key for e in entries], now_s)
