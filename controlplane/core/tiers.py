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

__all__ = ["INF", "DuelingEviction", "EvictionDuel", "EvictionStrategy", "LruEviction",
           "PredictedUseEviction", "Tier", "TierEntry"]


class PredictedUseEviction:
    """Furthest predicted next use first (Belady's rule when the predictor is exact).

    ``next_use`` maps sessions to their predicted next-use times (``inf`` = never), in one
    call for all candidates (a learned predictor answers a batch much faster).
    """

    def __init__(self, next_use: Callable[[Sequence[str], float], list[float]]) -> None:
        self._next_use = next_use

    def keys(self, entries: Sequence[TierEntry], now_s: float) -> list[float]:
        return self._next_use([e.key for e in entries], now_s)


class EvictionDuel:
    """Which of two eviction rules is doing better on the traffic at hand: predicted next
    use or recency (LRU), by *set dueling* (Qureshi et al., "Adaptive insertion policies
    for high performance caching", ISCA 2007) in the form ARC uses its ghost lists for.

    Whenever the two rules would pick different first victims, ``a`` (predicted use's)
    and ``b`` (LRU's), the pair is a duel; the one of the two sessions that returns first
    decides it: if ``a`` returns first, evicting it was the mistake and LRU wins the duel,
    and the other way round. ``score`` is an exponentially weighted mean of the outcomes
    (+1 predicted use, -1 LRU) with weight ``rate``; predicted use is followed while it is
    positive. It starts at 0, i.e. LRU, the rule of the baselines, until predicted use has
    shown it does better. At most ``max_pending`` duels wait for an outcome (oldest
    dropped). ``rate`` 0.1 (a memory of about ten duels) followed phases of the shared
    Claude Code set better than 0.02 and 0.005. Used by the experimental policy
    ``predictive-duel`` (README, "Prefetch: where it stands": fewer and smaller losses to
    LRU at light load than predicted use alone, smaller gains elsewhere)."""

    def __init__(self, *, rate: float = 0.1, max_pending: int = 10_000) -> None:
        self.rate = rate
        self.max_pending = max_pending
        self.score = 0.0
        self.decided = 0
        self._next_id = 0
        self._duels: dict[int, tuple[str, str]] = {}
        self._by_session: dict[str, set[int]] = {}

    @property
    def predicted_use_leads(self) -> bool:
        return self.score > 0.0

    def record(self, predicted_victim: str, lru_victim: str) -> None:
        """The two rules disagree on the first victim: a new duel."""
        if predicted_victim == lru_victim:
            return
        if len(self._duels) >= self.max_pending:
            oldest = next(iter(self._duels))
            self._forget(oldest)
        did = self._next_id
        self._next_id += 1
        self._duels[did] = (predicted_victim, lru_victim)
        for sid in (predicted_victim, lru_victim):
            self._by_session.setdefault(sid, set()).add(did)

    def returned(self, sid: str) -> None:
        """The session's next request arrived: decide every open duel it is in."""
        for did in sorted(self._by_session.pop(sid, ())):
            pair = self._forget(did)
            if pair is None:
                continue
            outcome = -1.0 if sid == pair[0] else 1.0
            self.score += self.rate * (outcome - self.score)
            self.decided += 1

    def _forget(self, did: int) -> tuple[str, str] | None:
        pair = self._duels.pop(did, None)
        if pair is not None:
            for sid in pair:
                ids = self._by_session.get(sid)
                if ids is not None:
                    ids.discard(did)
                    if not ids:
                        del self._by_session[sid]
        return pair


class DuelingEviction:
    """Predicted next use or LRU, whichever :class:`EvictionDuel` says is doing better;
    every call records the duel between the two rules' first victims."""

    def __init__(self, predicted: PredictedUseEviction, duel: EvictionDuel) -> None:
        self._predicted = predicted
        self._lru = LruEviction()
        self.duel = duel

    def keys(self, entries: Sequence[TierEntry], now_s: float) -> list[float]:
        predicted = self._predicted.keys(entries, now_s)
        lru = self._lru.keys(entries, now_s)
        if entries:
            # The first victim as Tier.victims_for orders them: largest key, then name.
            first_p = min(range(len(entries)), key=lambda i: (-predicted[i], entries[i].key))
            first_l = min(range(len(entries)), key=lambda i: (-lru[i], entries[i].key))
            self.duel.record(entries[first_p].key, entries[first_l].key)
        return predicted if self.duel.predicted_use_leads else lru
