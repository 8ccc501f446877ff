"""Request ids across scheduler shards: each id is claimed at the one shard it hashes to.

A route's ``request_id`` names one route of one session
(:mod:`~kvprefetch.controlplane.live.routes.ledger`).
With several shards, a session's routes are remembered by the shard that owns the session,
so the same id sent for two sessions owned by two shards would meet no common ledger.
:class:`~kvprefetch.controlplane.live.sharded.ShardedTransport` therefore claims the id first
at the shard the id hashes to (:func:`request_id_shard`), then routes at the session's shard:

* an id not claimed, or claimed by the same session, is claimed (again) and routed;
* an id claimed by another session is refused (409) while that claim is younger than
  :data:`CLAIM_HOLD_S` (its route may be on its way) or while the holder's shard still
  remembers the id for its session (``SchedulerService.remembers_route``);
  otherwise the holder's route is forgotten (its request ended) and the claim passes to
  the new session, as one shard's ledger would let it.

Claims are the shard's memory only (not journalled): a shard restarted forgets its claims,
and an id reused for another session within a route's lifetime across that restart is not
refused. At most ``per_tenant`` claims are kept per tenant, the least recently used
forgotten first. Pure: no I/O; the clock is the caller's; not thread-safe (the service's
lock guards it).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

#: Seconds a claim holds against other sessions without asking its holder's shard: longer
#: than a route takes to reach its shard.
CLAIM_HOLD_S = 10.0


def request_id_shard(tenant: str, request_id: str, shards: int) -> int:
    """The shard whose claims hold ``request_id`` of ``tenant``."""
    if shards == 1:
        return 0
    h = hashlib.blake2b(f"{tenant}\x00{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") % shards


@dataclass(frozen=True, slots=True)
class ClaimHolder:
    """The session that holds a claimed id (its id within its tenant), and whether the
    claim is younger than :data:`CLAIM_HOLD_S`."""

    session_id: str
    young: bool


class RequestIdClaims:
    """The claims of one shard (see the module docstring)."""

    def __init__(self, per_tenant: int) -> None:
        if per_tenant < 1:
            raise ValueError("per_tenant must be >= 1")
        self.per_tenant = per_tenant
        self._by_tenant: dict[str, OrderedDict[str, tuple[str, float]]] = {}

    def __len__(self) -> int:
        return sum(len(c) for c in self._by_tenant.values())

    def claim(self, tenant: str, request_id: str, session_id: str, now_s: float,
              replacing: str | None = None) -> ClaimHolder | None:
        """Claim ``request_id`` for ``session_id``: None when claimed, else its holder
        (another session; nothing changed). ``replacing``: the holder the caller found
        forgotten by its shard; the claim passes over only while it is still that one's."""
        claims = self._by_tenant.setdefault(tenant, OrderedDict())
        held = claims.get(request_id)
        if held is not None and held[0] != session_id and held[0] != replacing:
            claims.move_to_end(request_id)
            return ClaimHolder(held[0], now_s - held[1] < CLAIM_HOLD_S)
        claims[request_id] = (session_id, now_s)
        claims.move_to_end(request_id)
        while len(claims) > self.per_tenant:
            claims.popitem(last=False)
        return None
