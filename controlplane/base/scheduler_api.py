"""The calls each node makes on the scheduler, as a typed Protocol: the seam between the
per-node parts (prefetch agents, engines and engine emulators) and the scheduler, in the
bottom layer so that both sides may import it.

Implementations: the live ``SchedulerService`` and its Ray actor
(:mod:`kvprefetch.controlplane.live`; their full API,
:class:`~kvprefetch.controlplane.live.protocol.SchedulerAPI`, extends this one). Callers:
the Ray entry points of the agents and engines (:mod:`kvprefetch.agents.ray_entry`), which
name and type their actor calls by this Protocol's methods, and in-process tests.

Calls take and answer the records of :mod:`kvprefetch.controlplane.base.wire`. Every method
may be called from any thread. Refusals are the typed errors of
:mod:`kvprefetch.controlplane.base.errors` (``InvalidRequestError`` for a node outside the
fleet, ``UnknownSessionError``, ``WrongShardError`` for a session another shard owns).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvprefetch.controlplane.base.wire import (
    AgentHello,
    AgentStatus,
    EngineReport,
    GpuStartPlan,
    HbmReport,
    TierEvictions,
    TransferReport,
)


@runtime_checkable
class NodeAPI(Protocol):
    """The calls of each node's engine and prefetch agent on the scheduler (on a sharded
    scheduler: on the shard that owns the session, or that issued the order, or on every
    shard, as each method says)."""

    # ------------------------------------------------------------------ engine calls
    def gpu_start(self, node: int, tenant: str, session_id: str,
                  reused_tokens: int) -> GpuStartPlan:
        """The engine of ``node``: its GPU picks the request up. Once per request, before
        ``use_local``, on the session's shard; the answer names the transfer the engine
        must wait for, if any."""
        ...

    def use_local(self, node: int, tenant: str, session_id: str, reused_tokens: int,
                  done: TransferReport | None = None) -> int:
        """The engine of ``node`` is about to read its local tier: the usable tokens there.
        Once per request, after ``gpu_start`` (and after waiting for its transfer, whose
        report ``done`` may carry: applying it is idempotent, see ``report_transfer``)."""
        ...

    def engine_report(self, report: EngineReport) -> None:
        """The engine of ``report.node``: what it did for one request (its HBM contents,
        local hits). Once per request; idempotent for the books (it overwrites the node's
        HBM mirror), not for the metrics (counted again)."""
        ...

    # ------------------------------------------------------------------ agent calls
    def agent_hello(self, hello: AgentHello) -> None:
        """The prefetch agent of ``hello.node`` (re)started, or was asked to greet again:
        orders sent to an older incarnation are failed and the node's books reconciled
        with its inventory. Once per agent start (and when the scheduler restarts), to
        every shard; idempotent for one incarnation."""
        ...

    def node_status(self, status: AgentStatus) -> None:
        """The prefetch agent of ``status.node`` reports its tier's capacity and occupancy
        (every ``AgentConfig.status_interval_s``, to every shard): the shard's quota of
        the node's tier follows the reported capacity. Idempotent."""
        ...

    def tier_evicted(self, evictions: TierEvictions) -> None:
        """The prefetch agent of ``evictions.node``: its tier evicted chunks of these
        sessions by its own order, to fit a write; their books entries on the node go.
        To the shards that own the sessions; idempotent."""
        ...

    def hbm_changed(self, report: HbmReport) -> None:
        """The prefetch agent of ``report.node``: its engine's HBM prefix cache changed (as
        the engine's KV events tell): the node's HBM mirror follows. To the shards that own
        the sessions (a ``full`` listing to every shard); idempotent."""
        ...

    def report_transfer(self, report: TransferReport) -> None:
        """A prefetch agent finished (or gave up) an order. Once per order, to the shard
        that issued it; idempotent per ``order_id`` (the engine may deliver the same report
        through ``use_local``)."""
        ...
