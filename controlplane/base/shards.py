"""Which scheduler shard owns a session: consistent hashing of (tenant, session id).

A fleet that outgrows one scheduler runs ``N`` shards (Ray actors, one
:class:`~kvprefetch.controlplane.live.service.SchedulerService` each); every session belongs
to exactly one of them, the one its key hashes to on a ring of ``POINTS_PER_SHARD`` points
per shard. Growing the ring from ``N`` to ``N + 1`` shards moves about ``1 / (N + 1)`` of
the sessions (those whose next point clockwise is now one of the new shard's), not all of
them as ``hash % N`` would. Every caller (the Python client, the HTTP front, the engines and agents)
computes the owner itself, so a call is one hop.

Shard epochs: each shard's incarnations take epochs congruent to its shard number modulo the
shard count (:func:`shard_epoch`), so order ids (which carry the epoch) never collide
between shards and an agent that serves every shard tells them apart.

Pure functions, no I/O.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib

from kvprefetch.controlplane.base.types import SessionKey
from kvprefetch.controlplane.base.wire import EngineReport, HbmReport, TierEvictions

#: Points on the ring per shard: enough that the largest shard of 4 owns at most 1.3 times
#: its even share of the sessions (tests/base/test_shards.py checks the spread).
POINTS_PER_SHARD = 128

#: The most shards one deployment may run (a fleet of 10,000 nodes needs tens).
MAX_SHARDS = 256


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(),
                          "big")


class ShardRing:
    """The owner of each (tenant, session id) among ``shards`` shards."""

    __slots__ = ("_owners", "_points", "shards")

    def __init__(self, shards: int) -> None:
        if not 1 <= shards <= MAX_SHARDS:
            raise ValueError(f"shards must be 1-{MAX_SHARDS}, got {shards}")
        self.shards = shards
        ring = sorted((_point(f"kvprefetch-shard-{s}-{p}"), s)
                      for s in range(shards) for p in range(POINTS_PER_SHARD))
        self._points = [p for p, _ in ring]
        self._owners = [s for _, s in ring]

    def owner(self, tenant: str, session_id: str) -> int:
        """The shard that owns the session (0 when there is one shard)."""
        if self.shards == 1:
            return 0
        i = bisect.bisect_right(self._points, _point(f"{tenant}\x00{session_id}"))
        return self._owners[i % len(self._owners)]


def shard_epoch(epoch: int, shard: int, shards: int) -> int:
    """The smallest epoch >= ``epoch`` that belongs to ``shard`` (congruent to it modulo
    ``shards``): shards' order ids never collide, and each shard's epochs still grow."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} is not one of {shards}")
    return epoch + (shard - epoch) % shards


def split_tier_evictions(evictions: TierEvictions, ring: ShardRing
                         ) -> dict[int, TierEvictions]:
    """Each shard's part of a tier's eviction report: the sessions it owns."""
    parts: dict[int, list[str]] = {}
    for sid in evictions.sessions:
        key = SessionKey.parse(sid)
        parts.setdefault(ring.owner(key.tenant, key.session_id), []).append(sid)
    return {shard: dataclasses.replace(evictions, sessions=tuple(sids))
            for shard, sids in parts.items()}


def split_hbm_report(report: HbmReport, ring: ShardRing) -> dict[int, HbmReport]:
    """Each shard's part of an HBM report: the sessions it owns; a ``full`` listing goes
    to every shard (each one's sessions not named hold nothing in HBM)."""
    parts: dict[int, list[tuple[str, int]]] = (
        {shard: [] for shard in range(ring.shards)} if report.full else {})
    for sid, tokens in report.sessions:
        key = SessionKey.parse(sid)
        parts.setdefault(ring.owner(key.tenant, key.session_id), []).append((sid, tokens))
    return {shard: dataclasses.replace(report, sessions=tuple(items))
            for shard, items in parts.items()}


def split_engine_report(report: EngineReport, ring: ShardRing) -> dict[int, EngineReport]:
    """What each shard needs of an engine's report: the shard that owns the served session
    gets it whole (its HBM evictions narrowed to that shard's sessions); every other shard
    whose sessions the engine's HBM dropped gets a drop notice naming only those (an empty
    ``session_id`` and no tokens). No shard hears of another's sessions, and the report's
    counters are counted once."""
    if ring.shards == 1:
        return {0: report}
    dropped: dict[int, list[str]] = {}
    for sid in report.hbm_evicted:
        key = SessionKey.parse(sid)
        dropped.setdefault(ring.owner(key.tenant, key.session_id), []).append(sid)
    key = SessionKey.parse(report.session_id)
    owner = ring.owner(key.tenant, key.session_id)
    out = {owner: dataclasses.replace(report, hbm_evicted=tuple(dropped.pop(owner, ())))}
    for shard, sids in dropped.items():
        out[shard] = EngineReport("", report.node, 0, 0, 0, tuple(sids))
    return out
