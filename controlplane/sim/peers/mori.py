"""``mori``: MORI's idleness-ranked placement of sessions' KV between HBM and DRAM.

Source: T. Xia et al., "Idleness is Relative: Exploiting Tool-Call Idle Windows for
Offloading in Agentic Systems with MORI", arXiv 2606.00866. Each program gets an idleness
score, the share of its recent time spent waiting (on tool calls or on its user) rather
than being served; all active programs are ranked by it, the busiest keep their KV in GPU
HBM and the most idle are placed in CPU DRAM, the boundary between the two follows the
tiers' capacities, and each tier admits a program only ahead of those it outranks.

What is modelled (over ``ondemand``'s flags, with the same router, cost model, links and
engine profile as every policy). The DRAM tier is the profile's: on a write-through
profile (``vllm-lmcache``) it holds every finished context, so placing a session "down" is
dropping its HBM copy; on a profile that demotes on eviction (``vllm-lmcache-lazy``,
``sglang-hicache``) a context reaches DRAM when HBM evicts it, so the two tiers hold a
partition as MORI's placement does:

* the score of a session at ``now`` over its last ``window`` turns: ``idle / (idle +
  busy)``, where ``busy`` is each turn's arrival-to-response-end time and ``idle`` the gaps
  between a response end and the next arrival, the gap under way counted up to ``now``
  (so a session's score rises while it waits);
* the ranking: the HBM tier evicts the most idle first (ties by name), so the least idle
  stay; the boundary is wherever the ranking fills the HBM's capacity;
* admission control: a finished session's context enters HBM only by displacing
  residents more idle than it; otherwise it stays in DRAM alone.

What is left out (MORI does it, the simulator does not): the migrations between rankings
(promoting a busy session's KV from DRAM into HBM before its next request, demoting in the
background); here a session moves up only when its next request reads it, at the same
host-link copy every policy pays. The DRAM tier keeps the profile's LRU below HBM (MORI's
own DRAM admission is not modelled).
A session never seen idle scores 0 (busiest).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvprefetch.controlplane.base.config import FleetConfig
from kvprefetch.controlplane.base.tiers import TierEntry
from kvprefetch.controlplane.sim.peers.hbm_retention import FinishedTurn

__all__ = ["MoriIdleness"]


@dataclass(slots=True)
class _Activity:
    """One session's recent turns: (busy seconds, idle seconds before the turn)."""

    turns: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=8))
    idle_sum: float = 0.0
    busy_sum: float = 0.0
    arrived_s: float | None = None
    gap_before_s: float = 0.0
    #: End of its last response while it waits (None while a request is in flight).
    idle_since_s: float | None = None


class MoriIdleness:
    """See the module docstring; an :class:`~.hbm_retention.HbmRetention`."""

    def __init__(self, fleet: FleetConfig, window: int = 8) -> None:
        self.window = window
        self._activity: dict[str, _Activity] = {}
        self.strategy = self

    def score(self, session_id: str, now_s: float) -> float:
        """Idleness in [0, 1] (module docstring)."""
        a = self._activity.get(session_id)
        if a is None:
            return 0.0
        idle = a.idle_sum + (max(0.0, now_s - a.idle_since_s)
                             if a.idle_since_s is not None else 0.0)
        total = idle + a.busy_sum
        return idle / total if total > 0.0 else 0.0

    def keys(self, entries: Sequence[TierEntry], now_s: float) -> list[float]:
        return [self.score(e.key, now_s) for e in entries]

    def arrived(self, session_id: str, now_s: float) -> None:
        a = self._activity.setdefault(session_id, _Activity(deque(maxlen=self.window)))
        a.gap_before_s = (max(0.0, now_s - a.idle_since_s)
                          if a.idle_since_s is not None else 0.0)
        a.idle_since_s = None
        a.arrived_s = now_s

    def finished(self, turn: FinishedTurn, now_s: float) -> None:
        a = self._activity.setdefault(turn.session_id, _Activity(deque(maxlen=self.window)))
        busy = max(0.0, now_s - a.arrived_s) if a.arrived_s is not None else 0.0
        if len(a.turns) == a.turns.maxlen:
            old_busy, old_idle = a.turns[0]
            a.busy_sum -= old_busy
            a.idle_sum -= old_idle
        a.turns.append((busy, a.gap_before_s))
        a.busy_sum += busy
        a.idle_sum += a.gap_before_s
        a.arrived_s = None
        a.idle_since_s = now_s

    def admit_key(self, session_id: str, now_s: float) -> float:
        return self.score(session_id, now_s)
