"""The peers' strategies in isolation: Continuum's TTL pin, MORI's idleness ranking, the
log-normal retention window, and the seams they plug into (inert for every other policy)."""

from __future__ import annotations

import math

import pytest

from kvprefetch.controlplane.base.config import default_fleet
from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.base.tiers import Tier, TierEntry
from kvprefetch.controlplane.base.types import EventKind, SessionEvent
from kvprefetch.controlplane.core.policies import (
    PEER_POLICIES,
    POLICIES,
    EvictionKind,
    parse_policies,
)
from kvprefetch.controlplane.core.retention_window import (
    SHIELD_TOP,
    LognormalRetention,
    RetentionConfig,
)
from kvprefetch.controlplane.core.scheduler import SchedulerCore
from kvprefetch.controlplane.core.view import IdleFleet
from kvprefetch.controlplane.sim.peers import FinishedTurn, make_hbm_retention
from kvprefetch.controlplane.sim.peers.continuum import ContinuumConfig, ContinuumTtl
from kvprefetch.controlplane.sim.peers.mori import MoriIdleness
from kvprefetch.predictors.registry import load as load_predictor

FLEET = default_fleet("8b", 1)
GIB = 1 << 30


def _turn(sid: str, stop: str | None = "tool_use", *, nbytes: int = GIB,
          reload_s: float = 1.0, queue_s: float = 0.0) -> FinishedTurn:
    return FinishedTurn(sid, stop, nbytes, reload_s, queue_s)


def _entry(sid: str, last_use_s: float) -> TierEntry:
    return TierEntry(sid, 1000, GIB, last_use_s)


def test_peers_are_simulator_policies_only() -> None:
    assert not set(PEER_POLICIES) & set(POLICIES)
    with pytest.raises(ConfigError):
        parse_policies("ondemand,mori")
    names = [p.name for p in parse_policies("ondemand,continuum-ttl,mori,ttl-lognormal",
                                            peers=True)]
    assert names == ["ondemand", "continuum-ttl", "mori", "ttl-lognormal"]
    # Every peer extends ondemand's flags: only its retention differs.
    od = POLICIES["ondemand"]
    for p in PEER_POLICIES.values():
        assert (p.dram_tier, p.remote, p.load_start, p.prefetch) == (
            od.dram_tier, od.remote, od.load_start, od.prefetch)
    with pytest.raises(ConfigError):
        make_hbm_retention("nope", FLEET)


def test_other_policies_run_none_of_the_peer_code() -> None:
    for name, policy in POLICIES.items():
        # The engine's LRU: no engine profile lets an outside component rank HBM.
        assert policy.hbm_retention is None, name
        assert policy.eviction is not EvictionKind.RETENTION_WINDOW
        core = SchedulerCore(FLEET, policy, load_predictor("default"), IdleFleet())
        assert core._books.retention is None


def test_continuum_pins_after_a_tool_call_until_the_ttl() -> None:
    c = ContinuumTtl(FLEET, ContinuumConfig(cold_ttl_s=5.0))
    tier = Tier("hbm", 3 * GIB, c.strategy)
    c.finished(_turn("tool"), 10.0)
    c.finished(_turn("human", "end_turn"), 11.0)
    tier.put(_entry("tool", 10.0))
    tier.put(_entry("human", 11.0))
    tier.put(_entry("older", 1.0))
    # While the pin holds the tool session goes last: only under pressure, once nothing
    # unpinned is left to make room with.
    assert [e.key for e in tier.victims_for(2 * GIB, 12.0) or []] == ["older", "human"]
    assert [e.key for e in tier.victims_for(3 * GIB, 12.0) or []] == ["older", "human", "tool"]
    (pinned,) = c.strategy.keys([tier.get("tool")], 12.0)  # type: ignore[list-item]
    assert pinned < -1e14 and c.pinned_until("tool") == 15.0
    # At expiry it ages as LRU would: older than "human", so before it.
    assert [e.key for e in tier.victims_for(3 * GIB, 15.5) or []] == ["older", "tool", "human"]
    # Its next arrival releases the pin at once and measures the tool's duration.
    c.finished(_turn("tool"), 20.0)
    c.arrived("tool", 21.5)
    assert list(c._durations) == [1.5]
    assert c.strategy.keys([tier.get("tool")], 21.6) == [-10.0]  # type: ignore[list-item]


def test_continuum_releases_pins_under_pressure_latest_program_first() -> None:
    c = ContinuumTtl(FLEET, ContinuumConfig(cold_ttl_s=50.0))
    tier = Tier("hbm", 3 * GIB, c.strategy)
    for i, sid in enumerate(("first", "second", "third")):
        c.finished(_turn(sid), float(i))
        tier.put(_entry(sid, float(i)))
    # Every resident is pinned: a new context gets room from the program pinned last.
    assert [e.key for e in tier.victims_for(GIB, 5.0, min_key=c.admit_key("new", 5.0))
            or []] == ["third"]
    assert [e.key for e in tier.victims_for(2 * GIB, 5.0) or []] == ["third", "second"]


def test_continuum_ttl_follows_the_tool_durations_and_the_reload_cost() -> None:
    c = ContinuumTtl(FLEET, ContinuumConfig(min_samples=4))
    t = 0.0
    for i in range(40):  # tools that take 2 s (90%) or 100 s (10%)
        c.finished(_turn("s"), t)
        t += 100.0 if i % 10 == 0 else 2.0
        c.arrived("s", t)
    assert sorted(set(c._durations)) == [2.0, 100.0]
    # Worth reloading: pin through the short tools, not the long ones.
    assert c.ttl_s(_turn("x", reload_s=1.0)) == 2.0
    # Reload nearly free (a small context, a fast copy): no pin.
    assert c.ttl_s(_turn("x", reload_s=1e-4)) == 0.0
    # A reload that costs more than holding the whole HBM through the long tools: keep it.
    assert c.ttl_s(_turn("x", reload_s=1e4)) == 100.0
    # The queueing delay eviction would add counts as the reload does.
    assert c.ttl_s(_turn("x", reload_s=0.0, queue_s=1.0)) == 2.0


def test_mori_ranks_by_idleness_and_admits_only_ahead_of_the_more_idle() -> None:
    m = MoriIdleness(FLEET)
    # busy: 10 s served, 1 s waiting per turn; idle: 1 s served, 30 s waiting.
    for sid, serve, wait in (("busy", 10.0, 1.0), ("idle", 1.0, 30.0)):
        t = 0.0
        for _ in range(4):
            m.arrived(sid, t)
            t += serve
            m.finished(_turn(sid), t)
            t += wait
    assert m.score("busy", 50.0) < m.score("idle", 50.0)
    assert 0.0 <= m.score("busy", 50.0) <= 1.0
    assert m.score("never-seen", 50.0) == 0.0
    tier = Tier("hbm", 2 * GIB, m)
    tier.put(_entry("busy", 40.0))
    tier.put(_entry("idle", 100.0))  # the more recent use, but the more idle session
    assert [e.key for e in tier.victims_for(GIB, 120.0) or []] == ["idle"]
    # A newcomer less idle than "idle" may displace it; one more idle than both may not.
    assert tier.victims_for(GIB, 120.0, min_key=m.admit_key("busy", 120.0)) is not None
    assert tier.victims_for(GIB, 120.0, min_key=1.0) is None


def _gap(r: LognormalRetention, sid: str, start_s: float, gap_s: float) -> float:
    r.observe(SessionEvent(kind=EventKind.REQUEST_FINISHED, session_id=sid, time_s=start_s))
    r.observe(SessionEvent(kind=EventKind.REQUEST_STARTED, session_id=sid,
                           time_s=start_s + gap_s))
    return start_s + gap_s + 1.0


def test_retention_window_is_a_lognormal_quantile_shifted_per_session() -> None:
    r = LognormalRetention(RetentionConfig(quantile=0.9, prior_gaps=2.0, min_samples=4),
                           tier_bytes=4 * GIB)
    assert r.window_s("fast") == RetentionConfig().cold_window_s
    t = 0.0
    for _ in range(10):
        t = _gap(r, "fast", t, 5.0)
        t = _gap(r, "slow", t, 500.0)
    # The fleet's law: log gaps +-2.3 around log(50); a session's mean moves toward its own.
    assert r.window_s("new") == pytest.approx(
        math.exp(math.log(50.0) + 1.2816 * r._m2 ** 0.5 / 19 ** 0.5), rel=1e-3)
    assert r.window_s("fast") < r.window_s("new") < r.window_s("slow")
    # Shields: with room for both, a fast session idle past its window ages by LRU and goes
    # before a slow one idle for longer but still shielded.
    r.observe(SessionEvent(kind=EventKind.REQUEST_FINISHED, session_id="fast", time_s=t), GIB)
    r.observe(SessionEvent(kind=EventKind.REQUEST_FINISHED, session_id="slow", time_s=t - 60),
              GIB)
    assert r.shielded_until("fast") < t + 200 < r.shielded_until("slow")
    fast, slow = r.keys([_entry("fast", t), _entry("slow", t - 60)], t + 200)
    assert fast == -t and slow < SHIELD_TOP < fast
    assert r.admit_key("new", t) == SHIELD_TOP
    bound = r.bounds([_entry("slow", t - 60)], t)[0]
    assert bound.upper == slow and bound.until_s == r.shielded_until("slow")


def test_retention_window_shields_only_within_its_byte_budget() -> None:
    """Half of a 4 GiB tier may be shielded: a third 1 GiB context finds the budget spent
    and ages by LRU, until a shield is released (its session returns)."""
    r = LognormalRetention(RetentionConfig(max_fraction=0.5), tier_bytes=4 * GIB)
    for i, sid in enumerate(("a", "b", "c")):
        r.observe(SessionEvent(kind=EventKind.REQUEST_FINISHED, session_id=sid,
                               time_s=float(i), node=0), GIB)
    assert r.shielded_until("a") > 10 and r.shielded_until("b") > 10
    assert r.shielded_until("c") == -math.inf
    assert r.keys([_entry("c", 2.0)], 10.0) == [-2.0]
    r.observe(SessionEvent(kind=EventKind.REQUEST_STARTED, session_id="a", time_s=5.0))
    r.observe(SessionEvent(kind=EventKind.REQUEST_FINISHED, session_id="c", time_s=6.0,
                           node=0), GIB)
    assert r.shielded_until("c") > 10 and r.shielded_until("a") == -math.inf


