"""The engine's HBM prefix cache on every node, as the simulator models it.

Each node's HBM is a :class:`~kvprefetch.controlplane.core.tiers.Tier`: LRU (the engine's
own), or ranked by the policy's HBM retention
(:mod:`kvprefetch.controlplane.sim.peers.hbm_retention`, a peer's own). Whatever leaves HBM,
or a finished context HBM does not take, is reported to the scheduling core
(``SchedulerCore.hbm_evicted``), as the engine's KV events report it live: under
demote-on-evict (``PolicySpec.demote_on_evict``: lazy offload, write-back) it is demoted to
the node's DRAM tier, and an idle session whose KV left the node is planned again. The copy
over the host link is not charged, as the write-through's copy at a response end is not: a
demotion moves at most the bytes a write-through would, and an engine that demotes ahead of
need (a free-block watermark) does it off the requests' path.
"""

from __future__ import annotations

from collections.abc import Callable

from kvprefetch.controlplane.base.config import FleetConfig
from kvprefetch.controlplane.core.policies import PolicySpec
from kvprefetch.controlplane.core.scheduler import SchedulerCore
from kvprefetch.controlplane.core.step import StepOutput
from kvprefetch.controlplane.core.tiers import LruEviction, Tier, TierEntry

from .peers.hbm_retention import FinishedTurn, HbmRetention
from .peers.registry import make_hbm_retention
from .remote import RemoteStore
from .sharded_core import ShardedCore

__all__ = ["EngineHbm"]

INF = float("inf")


class EngineHbm:
    """Every node's HBM tier, its retention and the demotions out of it (module doc).
    ``carry`` carries out what the core decides on a demotion; ``queue_wait_s`` is the
    node's prefill queue wait (what a retention policy prices a reload against)."""

    def __init__(self, fleet: FleetConfig, policy: PolicySpec,
                 core: SchedulerCore | ShardedCore, remote: RemoteStore,
                 carry: Callable[[StepOutput], None],
                 queue_wait_s: Callable[[int, float], float]) -> None:
        self._fleet = fleet
        self._policy = policy
        self._core = core
        self._remote = remote
        self._carry = carry
        self._queue_wait_s = queue_wait_s
        self._bpt = fleet.model.kv_bytes_per_token
        self._h2d_s_per_byte = 1.0 / (fleet.node.h2d_gbyte_s * 1e9)
        #: The engine's HBM retention under this policy; None: LRU.
        self.retention: HbmRetention | None = (
            make_hbm_retention(policy.hbm_retention, fleet)
            if policy.hbm_retention else None)
        self.tiers = [Tier(f"hbm{i}", fleet.node.hbm_kv_bytes,
                           self.retention.strategy if self.retention else LruEviction())
                      for i in range(fleet.nodes)]

    @property
    def takes_finished_first(self) -> bool:
        """Whether HBM takes a finished context before the core hears of the finish: under
        LRU HBM and demote-on-evict (the core then skips the write-through of what HBM
        holds); a retention policy's reload cost sees the write-through, so after it."""
        return self.retention is None or self._policy.demote_on_evict

    def put(self, node: int, session_id: str, tokens: int, pinned: int, now_s: float,
            min_key: float = -INF) -> None:
        """Put the session's ``tokens`` in the node's HBM, evicting what its ranking puts
        after them (only residents keyed above ``min_key``)."""
        tier = self.tiers[node]
        nbytes = tokens * self._bpt
        tier.remove(session_id)
        victims = tier.victims_for(nbytes, now_s, exclude=session_id, min_key=min_key)
        if victims is None:  # does not fit beside pinned contexts: it is not cached here
            if not pinned:
                self._report_evicted(node, session_id, tokens, now_s)
            return
        for v in victims:
            tier.remove(v.session_id)
        tier.put(TierEntry(session_id, tokens, nbytes, now_s, pinned=pinned))
        for v in victims:
            self._report_evicted(node, v.session_id, v.tokens, now_s)

    def keep_finished(self, node: int, session_id: str, ctx: int, stop_reason: str | None,
                      now_s: float) -> None:
        """A response ended: its ``ctx`` tokens into the node's HBM, as the retention
        admits them."""
        retention = self.retention
        if retention is None:
            self.put(node, session_id, ctx, 0, now_s)
            return
        retention.finished(FinishedTurn(session_id, stop_reason, ctx * self._bpt,
                                        self._reload_s(node, session_id, ctx),
                                        self._queue_wait_s(node, now_s)), now_s)
        self.put(node, session_id, ctx, 0, now_s,
                 min_key=retention.admit_key(session_id, now_s))

    def _report_evicted(self, node: int, session_id: str, tokens: int, now_s: float) -> None:
        self._carry(self._core.hbm_evicted(session_id, node, tokens, now_s))

    def _reload_s(self, node: int, sid: str, ctx: int) -> float:
        """What the session's next request would wait to bring ``ctx`` tokens back were
        HBM to drop them now: the DRAM copy, else the remote load, else the prefill."""
        if self._core.dram_tokens(node, sid) >= ctx:
            return ctx * self._bpt * self._h2d_s_per_byte
        if self._policy.remote:
            s_per_byte, latency, _ = self._remote.source(sid)
            return latency + ctx * self._bpt * (s_per_byte + self._h2d_s_per_byte)
        return self._fleet.prefill_s(ctx, 0)
