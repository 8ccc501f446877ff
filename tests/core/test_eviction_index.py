"""IndexedTier: the same victims as a full sort of every resident's key, without computing
every key per decision."""

from __future__ import annotations

import random
from collections.abc import Sequence

from fleet_fakes import FakeFleet, finish_turn

from kvprefetch.controlplane.base.config import GIB, fleet_from_dict
from kvprefetch.controlplane.base.tiers import Tier
from kvprefetch.controlplane.core.policies import POLICIES
from kvprefetch.controlplane.core.scheduler import SchedulerCore
from kvprefetch.controlplane.core.tiers import (
    INF,
    IndexedLruEviction,
    IndexedTier,
    KeyBound,
    TierEntry,
)
from kvprefetch.predictors.registry import load


class _RisingKeys:
    """A bounded strategy over keys ``base + rate * t`` (``inf`` for some entries): rising
    in time, changed only through :meth:`set` (which the test follows with invalidate).
    Counts the exact keys it is asked for."""

    def __init__(self) -> None:
        self.params: dict[str, tuple[float, float]] = {}
        self.asked = 0

    def set(self, key: str, base: float, rate: float) -> None:
        self.params[key] = (base, rate)

    def key(self, key: str, t: float) -> float:
        base, rate = self.params[key]
        return base + rate * t

    def keys(self, entries: Sequence[TierEntry], now_s: float) -> list[float]:
        self.asked += len(entries)
        return [self.key(e.key, now_s) for e in entries]

    def bounds(self, entries: Sequence[TierEntry], now_s: float) -> list[KeyBound]:
        until = now_s + 5.0
        return [KeyBound(self.key(e.key, now_s), self.key(e.key, until), until)
                for e in entries]


def _names(victims: list[TierEntry] | None) -> list[str] | None:
    return None if victims is None else [e.key for e in victims]


def test_indexed_victims_equal_a_full_sort_under_random_churn() -> None:
    rng = random.Random(7)
    keys = _RisingKeys()
    tier = IndexedTier("t", 10_000, keys)
    t = 0.0
    decisions = evicting = 0
    for step in range(4000):
        t += rng.expovariate(2.0)
        op = rng.random()
        if op < 0.45:
            name = f"s{rng.randrange(400)}"
            # many ties: equal keys are ordered by name, as the full sort does
            keys.set(name, INF if rng.random() < 0.05 else float(rng.randrange(50)),
                     rng.choice([0.0, 0.5, 1.0]))
            size = rng.randrange(50, 400)
            old = tier.get(name)
            room = tier.victims_for(size - (old.nbytes if old else 0), t, exclude=name)
            if room is not None:
                for v in room:
                    tier.remove(v.key)
                tier.put(TierEntry(name, 1, size, t))
        elif op < 0.6 and len(tier):
            name = rng.choice(sorted(e.key for e in tier))
            keys.set(name, float(rng.randrange(50)), 0.2)  # the session's own event
            tier.invalidate(name)
        elif op < 0.7 and len(tier):
            entry = rng.choice(sorted(tier, key=lambda e: e.key))
            entry.pinned = 1 - entry.pinned
        elif op < 0.75 and len(tier):
            tier.remove(rng.choice(sorted(e.key for e in tier)))
        else:
            need = rng.randrange(1, 3000)
            exclude = rng.choice([None, f"s{rng.randrange(400)}"])
            min_key = rng.choice([-INF, float(rng.randrange(60))])
            ref = Tier.victims_for(tier, need, t, exclude=exclude, min_key=min_key)
            got = tier.victims_for(need, t, exclude=exclude, min_key=min_key)
            assert _names(got) == _names(ref), step
            decisions += 1
            evicting += need > tier.capacity_bytes - tier.used_bytes
    assert decisions > 500 and evicting > 300
    st = tier.index_stats
    assert st.bound_misses == 0
    assert st.rejected > 0  # some decisions were refused from the bounds alone
    # Far fewer exact keys than a full sort's, which asks every resident per decision.
    assert st.exact_keys < 0.1 * st.decisions * len(tier), (st, len(tier))


def test_a_decision_the_bounds_cannot_meet_is_refused_without_exact_keys() -> None:
    keys = _RisingKeys()
    tier = IndexedTier("t", 1_000, keys)
    for name, base, size in (("a", 10.0, 300), ("b", 20.0, 300), ("c", 1.0, 300)):
        keys.set(name, base, 1.0)
        tier.put(TierEntry(name, 1, size, 0.0))
    tier.victims_for(1, 0.0)  # binds every entry (bounds over [0, 5]: a 10-15, b 20-25)
    asked, exact = keys.asked, tier.index_stats.exact_keys
    # Above 16 only b's bound is: 300 bytes, not 400: refused, no exact key asked.
    assert tier.victims_for(500, 1.0, min_key=16.0) is None
    assert Tier.victims_for(tier, 500, 1.0, min_key=16.0) is None
    assert tier.index_stats.rejected == 1
    assert tier.index_stats.exact_keys == exact and keys.asked == asked + 3  # the sort's
    # Above 12: a's bound (15) and b's are, 600 bytes: decided from exact keys (a is 11).
    assert _names(tier.victims_for(500, 1.0, min_key=12.0)) is None
    assert tier.index_stats.exact_keys > exact and tier.index_stats.rejected == 1
    assert _names(tier.victims_for(500, 1.0, min_key=5.0)) == ["b", "a"]


def test_lower_bounds_settle_a_decision_without_exact_keys() -> None:
    # Keys only rise between events, so an entry's key when it was bound (or its last
    # exact key) bounds it from below: entries above the floor by that alone count
    # without an exact key; only those whose bounds straddle the floor are computed.
    keys = _RisingKeys()
    tier = IndexedTier("t", 1_200, keys)
    for name, base, size in (("a", 10.0, 300), ("b", 20.0, 300), ("c", 1.0, 300),
                             ("d", 7.0, 200)):
        keys.set(name, base, 1.0)
        tier.put(TierEntry(name, 1, size, 0.0))
    tier.victims_for(1, 0.0)  # binds: a in [10, 15], b in [20, 25], c in [1, 6], d in [7, 12]
    # 700 bytes above 9.5? Bounds: a, b and d may be (800). Lower bounds: a and b are (600);
    # d straddles 9.5, its exact key (8) is not: refused after one exact key, where
    # ranking the entries would have computed b's, a's and d's.
    exact = tier.index_stats.exact_keys
    assert tier.victims_for(800, 1.0, min_key=9.5) is None
    assert Tier.victims_for(tier, 800, 1.0, min_key=9.5) is None
    assert tier.index_stats.exact_keys - exact == 1
    assert tier.index_stats.rejected == 0  # decided by an exact key, not the bounds alone
    # A decision that can be met still takes its victims in the full sort's order.
    assert _names(tier.victims_for(500, 1.0, min_key=9.5)) == ["b", "a"]
    assert _names(Tier.victims_for(tier, 500, 1.0, min_key=9.5)) == ["b", "a"]


def test_lru_index_follows_uses_without_invalidation() -> None:
    tier = IndexedTier("t", 300, IndexedLruEviction())
    for i, name in enumerate("abc"):
        tier.put(TierEntry(name, 1, 100, last_use_s=float(i)))
    assert _names(tier.victims_for(100, 5.0)) == ["a"]
    entry = tier.get("a")
    assert entry is not None
    entry.last_use_s = 6.0  # used again: now the most recent
    assert _names(tier.victims_for(150, 7.0)) == ["b", "c"]
    assert _names(Tier.victims_for(tier, 150, 7.0)) == ["b", "c"]


def test_a_key_that_jumps_above_its_bound_is_caught_and_the_decision_retaken() -> None:
    keys = _RisingKeys()
    tier = IndexedTier("t", 300, keys)
    for name, base, rate in (("a", 10.0, 0.1), ("b", 8.0, 0.0), ("c", 30.0, 1.0)):
        keys.set(name, base, rate)
        tier.put(TierEntry(name, 1, 100, last_use_s=0.0))
    assert _names(tier.victims_for(100, 1.0)) == ["c"]
    # The predictor's shared law moved "a" and "c" without an event of their own: "a"
    # above its bound. Reached (its bound beats c's new key), the miss is seen and the
    # decision taken again from fresh bounds.
    keys.set("a", 25.0, 0.1)
    keys.set("c", 5.0, 1.0)
    assert _names(tier.victims_for(100, 2.0)) == ["a"]
    assert tier.index_stats.bound_misses == 1
    assert _names(tier.victims_for(100, 2.0)) == _names(Tier.victims_for(tier, 100, 2.0))


class _Counting:
    """A predictor wrapper that counts forecasts."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.name = "counting"
        self.forecasts = 0

    def observe(self, event: object) -> None:
        self.inner.observe(event)  # type: ignore[attr-defined]

    def forget(self, sid: str) -> None:
        self.inner.forget(sid)  # type: ignore[attr-defined]

    def forecast(self, sid: str, now_s: float) -> object:
        self.forecasts += 1
        return self.inner.forecast(sid, now_s)  # type: ignore[attr-defined]

    def forecast_many(self, sids: Sequence[str], now_s: float | Sequence[float]) -> list[object]:
        self.forecasts += len(sids)
        return self.inner.forecast_many(sids, now_s)  # type: ignore[attr-defined,no-any-return]


def test_write_through_cost_does_not_grow_with_the_residents() -> None:
    # 2,000 sessions of ~1k tokens on one node whose tier holds ~300 of them: every finish
    # past the first 300 evicts. A scan forecast every resident per finish (~300 each).
    fleet = fleet_from_dict({"nodes": 1, "node": {"dram_tier_bytes": 40 * GIB}})
    predictor = _Counting(load("default"))
    core = SchedulerCore(fleet, POLICIES["predictive"], predictor, FakeFleet())  # type: ignore[arg-type]
    rng = random.Random(3)
    t = 0.0
    for turn in range(2):
        for i in range(2000):
            t += 0.05
            finish_turn(core, f"s{i}", t, node=0, ctx=900 + rng.randrange(200),
                        stop="end_turn" if turn else "tool_use")
    finishes = 4000
    held = len(core.dram[0])
    assert held > 250
    st = core.eviction_index_stats()
    assert st.decisions > 3000
    # Planning asks a few forecasts per finish; eviction adds a few more, not ~300.
    assert predictor.forecasts < 6 * finishes, (predictor.forecasts, st)
