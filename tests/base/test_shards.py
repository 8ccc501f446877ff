"""Scheduler shards, the shared parts: the consistent-hash ring (owners stable, spread even,
~1/N moved when a shard is added), shard epochs (disjoint per shard, growing), and the
split of the nodes' reports between the shards that own their sessions."""

from __future__ import annotations

from collections import Counter

import pytest

from kvprefetch.controlplane.base.shards import ShardRing, shard_epoch

SESSIONS = [(f"t{i % 3}", f"session-{i}") for i in range(20_000)]


def test_one_shard_owns_everything() -> None:
    ring = ShardRing(1)
    assert {ring.owner(t, s) for t, s in SESSIONS[:100]} == {0}


def test_owners_are_stable_and_spread_evenly() -> None:
    ring, again = ShardRing(4), ShardRing(4)
    owners = [ring.owner(t, s) for t, s in SESSIONS]
    assert owners == [again.owner(t, s) for t, s in SESSIONS]  # any client computes the same
    counts = Counter(owners)
    assert set(counts) == {0, 1, 2, 3}
    assert max(counts.values()) / (len(SESSIONS) / 4) < 1.3  # POINTS_PER_SHARD's bound


def test_adding_a_shard_moves_about_one_in_n_sessions() -> None:
    for n in (1, 2, 4, 8):
        before, after = ShardRing(n), ShardRing(n + 1)
        moved = [(t, s) for t, s in SESSIONS if before.owner(t, s) != after.owner(t, s)]
        share = len(moved) / len(SESSIONS)
        assert 0.5 / (n + 1) < share < 1.5 / (n + 1), (n, share)
        # Only to the new shard: no session moves between old shards.
        assert all(after.owner(t, s) == n for t, s in moved)


def test_tenant_is_part_of_the_key() -> None:
    ring = ShardRing(8)
    assert len({ring.owner(f"tenant-{k}", "same-id") for k in range(64)}) > 1


def test_shard_epochs_are_disjoint_and_grow() -> None:
    for shards in (1, 2, 3, 4):
        for shard in range(shards):
            e = shard_epoch(1000, shard, shards)
            assert e >= 1000 and e % shards == shard and e - 1000 < shards
            assert shard_epoch(e + 1, shard, shards) == e + shards
    with pytest.raises(ValueError):
        shard_epoch(5, 2, 2)
    with pytest.raises(ValueError):
        ShardRing(0)


def test_an_engine_report_goes_to_its_owner_and_drop_notices_to_the_others() -> None:
    from kvprefetch.controlplane.base.shards import split_engine_report
    from kvprefetch.controlplane.base.wire import EngineReport

    ring = ShardRing(4)
    served = "t0/session-1"
    dropped = tuple(f"t1/session-{i}" for i in range(40))
    report = EngineReport(served, 2, 5000, 1000, 4000, dropped, 7, 9)
    parts = split_engine_report(report, ring)
    owner = ring.owner("t0", "session-1")
    assert parts[owner].session_id == served and parts[owner].context_tokens == 5000
    assert parts[owner].kv_written_bytes == 7  # counters travel once, with the owner
    seen: list[str] = []
    for shard, part in parts.items():
        assert part.node == 2
        assert all(ring.owner(*sid.split("/", 1)) == shard for sid in part.hbm_evicted)
        if shard != owner:
            assert part.session_id == "" and part.local_tokens == part.reused_tokens == 0
        seen.extend(part.hbm_evicted)
    assert sorted(seen) == sorted(dropped)
    assert split_engine_report(report, ShardRing(1)) == {0: report}


def test_a_tier_eviction_report_goes_to_the_owners_of_its_sessions() -> None:
    from kvprefetch.controlplane.base.keys import hash_keys, position_key_session, position_keys
    from kvprefetch.controlplane.base.shards import split_tier_evictions
    from kvprefetch.controlplane.base.wire import TierEvictions

    # A chunk key named by position names its session (ids with '/' escaped); one named
    # by content does not.
    for sid in ("s1", "a/b", "h", "100%"):
        for key in position_keys("acme", sid, 3 * 256 + 7, 256):
            assert position_key_session(key) == ("acme", sid)
    assert position_key_session(hash_keys("acme", ["ab" * 32])[0]) is None
    assert position_key_session("acme/s1/x") is None
    assert position_key_session("no-slash") is None
    ring = ShardRing(4)
    sids = [f"t/s{i}" for i in range(40)]
    parts = split_tier_evictions(TierEvictions(3, "inc", tuple(sids)), ring)
    assert sorted(s for p in parts.values() for s in p.sessions) == sorted(sids)
    for shard, part in parts.items():
        assert (part.node, part.incarnation) == (3, "inc")
        assert all(ring.owner("t", s.split("/")[1]) == shard for s in part.sessions)
    assert len(parts) == 4
