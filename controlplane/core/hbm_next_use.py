"""Predicted-next-use retention of the HBM prefix cache (Belady's rule with the oracle).

The HBM tier ranks its residents by the scheduler core's predicted next use of each
session (:meth:`~kvprefetch.controlplane.core.scheduler.SchedulerCore.next_uses`, the same
keys as the DRAM books' predicted-use eviction): the furthest next use goes first, and a
finished context enters HBM only by displacing residents needed later than it. With the
oracle's predictor, whose forecasts are the trace's real next arrivals, this is Belady's
rule across both local tiers (the DRAM books already evict by it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvprefetch.controlplane.base.config import FleetConfig
from kvprefetch.controlplane.base.tiers import TierEntry
from kvprefetch.controlplane.core.hbm_retention import FinishedTurn

__all__ = ["NextUseHbm"]


class NextUseHbm:
    """See the module docstring; an :class:`~.hbm_retention.HbmRetention`."""

    def __init__(self, fleet: FleetConfig,
                 next_uses: Callable[[Sequence[str], float], list[float]]) -> None:
        self._next_uses = next_uses
        self.strategy = self

    def keys(self, entries: Sequence[TierEntry], now_s: float) -> list[float]:
        return self._next_uses([e.key for e in entries], now_s)

    def arrived(self, session_id: str, now_s: float) -> None:
        pass

    def finished(self, turn: FinishedTurn, now_s: float) -> None:
        pass

    def admit_key(self, session_id: str, now_s: float) -> float:
        return self._next_uses([session_id], now_s)[0]
