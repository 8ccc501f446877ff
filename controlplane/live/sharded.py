"""The scheduler as ``N`` shards on Ray, seen by a client as one.

:class:`ShardedTransport` holds one :class:`~kvprefetch.controlplane.live.client.RayTransport` per
shard (each with its own event batcher) and sends every call about a session to the shard
that owns it (:class:`~kvprefetch.controlplane.base.shards.ShardRing`, computed here: one hop). An
engine's report goes to the served session's shard, and a drop notice to each other shard
whose sessions its HBM dropped (:func:`~kvprefetch.controlplane.base.shards.split_engine_report`);
a route with a ``request_id`` first claims the id at the shard the id hashes to, so that one
id names one session's route across all shards (:mod:`~kvprefetch.controlplane.live.routes.claims`);
an agent's hello goes to every shard (each keeps its own books of the node). A transfer
report goes to the shard that issued the order: each shard's epochs are congruent to its
number modulo the shard count, and every order id carries its epoch.

:func:`open_ray` is what :func:`~kvprefetch.controlplane.live.connect.connect` calls for a Ray
address: it asks shard 0 how many shards there are, and answers a plain ``RayTransport``
when there is one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.errors import (
    RequestIdConflictError,
    ServiceError,
    ServiceUnavailableError,
)
from kvprefetch.controlplane.base.shards import (
    ShardRing,
    split_engine_report,
    split_hbm_report,
    split_tier_evictions,
)
from kvprefetch.controlplane.base.wire import (
    AgentHello,
    AgentStatus,
    EngineReport,
    GpuStartPlan,
    HbmReport,
    TierEvictions,
    TransferReport,
    order_epoch,
)
from kvprefetch.controlplane.live.batching import EventBatcher, EventBatching
from kvprefetch.controlplane.live.client import RayTransport, with_timeout
from kvprefetch.controlplane.live.node_registry import NodeListing
from kvprefetch.controlplane.live.protocol import RemoteAPI, SchedulerAPI
from kvprefetch.controlplane.live.routes.claims import request_id_shard
from kvprefetch.controlplane.live.sessions import SessionQuery, SessionState


def open_ray(address: str, namespace: str, *, timeout_s: float,
             batching: EventBatching | None) -> RayTransport | ShardedTransport:
    """The transport to the scheduler in ``namespace``: one shard or all of them."""
    first = RayTransport(address, namespace, timeout_s=timeout_s, batching=batching)
    _, shards = first.shard_info()
    if shards == 1:
        return first
    rest = [RayTransport(address, namespace, timeout_s=timeout_s, batching=batching,
                         shard=i) for i in range(1, shards)]
    return ShardedTransport([first, *rest])


def merge_summaries(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One summary of several shards': numbers added, lists joined, dicts merged the same
    way key by key; anything else is shard 0's. ``per_shard`` keeps each one."""
    def merge(values: list[Any]) -> Any:
        first = values[0]
        if isinstance(first, bool) or not all(type(v) is type(first) for v in values):
            return first
        if isinstance(first, int | float):
            return sum(values)
        if isinstance(first, list):
            return [x for v in values for x in v]
        if isinstance(first, dict):
            keys = dict.fromkeys(k for v in values for k in v)
            return {k: merge([v[k] for v in values if k in v]) for k in keys}
        return first

    out = merge(list(parts))
    out.pop("shard", None)
    out["shards"] = len(parts)
    out["per_shard"] = list(parts)
    return dict(out)


class ShardedTransport:
    """:class:`~kvprefetch.controlplane.live.protocol.SchedulerAPI` over every shard (module doc).
    ``last_route_s[i]``: how long the last :meth:`route_many` (of this transport or a view
    of it) waited for shard ``i``'s answers (None: it had none of them)."""

    def __init__(self, transports: Sequence[RayTransport]) -> None:
        self.transports = list(transports)
        self.ring = ShardRing(len(self.transports))
        self.timeout_s = self.transports[0].timeout_s
        self.last_route_s: list[float | None] = [None] * len(self.transports)

    @property
    def batchers(self) -> list[EventBatcher]:
        return [t.batcher for t in self.transports if t.batcher is not None]

    def with_timeout(self, timeout_s: float) -> ShardedTransport:
        view = with_timeout(self, timeout_s)
        if view is not self:
            view.transports = [t.with_timeout(timeout_s) for t in self.transports]
        return view

    def close(self) -> None:
        for t in self.transports:
            t.close()

    def owner(self, tenant: str, session_id: str) -> RayTransport:
        return self.transports[self.ring.owner(tenant, session_id)]

    # ------------------------------------------------------------------ gateway calls
    def request_started(self, call: api.RequestStarted) -> api.Ack:
        return self.owner(call.tenant, call.session_id).request_started(call)

    def route(self, call: api.RouteQuery) -> api.RouteAnswer:
        self.claim(call)
        return self.owner(call.tenant, call.session_id).route(call)

    def claim(self, call: api.RouteQuery) -> None:
        """Claim ``call.request_id`` for its session at the id's shard; raises
        RequestIdConflictError (409, nothing applied) while another session's route holds
        it (:mod:`~kvprefetch.controlplane.live.routes.claims`). While the id's shard is
        down the route goes on unclaimed (its claims went with it, as in a restart)."""
        rid = call.request_id
        if rid is None:
            return
        claims = self.transports[request_id_shard(call.tenant, rid, len(self.transports))]
        try:
            holder = claims.claim_request_id(call.tenant, rid, call.session_id)
        except (ServiceUnavailableError, TimeoutError):
            # The id's shard is down or restarting: it has lost its claims as a restart
            # loses them; the route goes on, checked by its own shard's ledger only.
            return
        if holder is None:
            return
        # The holder's request ended and its shard forgot the id: the id passes over.
        forgotten = not holder.young and not self.owner(
            call.tenant, holder.session_id).remembers_route(call.tenant, rid, holder.session_id)
        if forgotten and claims.claim_request_id(call.tenant, rid, call.session_id,
                                                 replacing=holder.session_id) is None:
            return
        raise RequestIdConflictError(
            f"request id {rid!r} names a route of another session; nothing was applied: "
            "send the query with a new id")

    def route_many(self, calls: Sequence[api.RouteQuery]
                   ) -> list[api.RouteAnswer | ServiceError]:
        """Each shard's routes in one actor call, all shards at once; answers in order."""
        import ray

        groups: dict[int, list[int]] = {}
        answers: list[api.RouteAnswer | ServiceError | None] = [None] * len(calls)
        for i, call in enumerate(calls):
            try:
                self.claim(call)
            except RequestIdConflictError as exc:
                answers[i] = exc
                continue
            groups.setdefault(self.ring.owner(call.tenant, call.session_id), []).append(i)
        began = time.perf_counter()
        sent = {s: self.transports[s].send_routes([calls[i] for i in idx])
                for s, idx in groups.items()}
        # In place: views made by with_timeout share the list.
        self.last_route_s[:] = [None] * len(self.transports)
        waiting = {sent[s][0]: s for s in sent}
        while waiting:  # each shard's answers as they come, so one slow shard is its own
            ready, _ = ray.wait(list(waiting), num_returns=1,
                                timeout=max(0.0, self.timeout_s))
            if not ready:
                ready = list(waiting)  # past the deadline: each get raises its timeout
            for ref in ready:
                s = waiting.pop(ref)
                t = self.transports[s]
                try:
                    got = t.routes_answered(sent[s])
                except ServiceUnavailableError:  # restarting: retried until the deadline
                    got = t.route_many([calls[i] for i in groups[s]])
                self.last_route_s[s] = time.perf_counter() - began
                for i, answer in zip(groups[s], got, strict=True):
                    answers[i] = answer
        return [a for a in answers if a is not None]

    def cancel_route(self, call: api.RouteCancel) -> api.RouteCancelled:
        return self.owner(call.tenant, call.session_id).cancel_route(call)

    def request_finished(self, call: api.RequestFinished) -> api.Ack:
        return self.owner(call.tenant, call.session_id).request_finished(call)

    def hint(self, call: api.HintCall) -> api.Ack:
        return self.owner(call.tenant, call.session_id).hint(call)

    def session_closed(self, call: api.SessionClosed) -> api.Ack:
        return self.owner(call.tenant, call.session_id).session_closed(call)

    def session_state(self, call: SessionQuery) -> SessionState:
        return self.owner(call.tenant, call.session_id).session_state(call)

    # ------------------------------------------------------------------ engine calls
    def gpu_start(self, node: int, tenant: str, session_id: str,
                  reused_tokens: int) -> GpuStartPlan:
        return self.owner(tenant, session_id).gpu_start(node, tenant, session_id,
                                                        reused_tokens)

    def use_local(self, node: int, tenant: str, session_id: str, reused_tokens: int,
                  done: TransferReport | None = None) -> int:
        return self.owner(tenant, session_id).use_local(node, tenant, session_id,
                                                        reused_tokens, done)

    def engine_report(self, report: EngineReport) -> None:
        for shard, part in split_engine_report(report, self.ring).items():
            self.transports[shard].engine_report(part)

    # ------------------------------------------------------------------ agent calls
    def agent_hello(self, hello: AgentHello) -> None:
        for t in self.transports:
            t.agent_hello(hello)

    def node_status(self, status: AgentStatus) -> None:
        for t in self.transports:
            t.node_status(status)

    def tier_evicted(self, evictions: TierEvictions) -> None:
        for shard, part in split_tier_evictions(evictions, self.ring).items():
            self.transports[shard].tier_evicted(part)

    def nodes(self) -> NodeListing:
        """The node registry (every shard keeps the same: each gets every hello)."""
        return self.transports[0].nodes()

    def hbm_changed(self, report: HbmReport) -> None:
        for shard, part in split_hbm_report(report, self.ring).items():
            self.transports[shard].hbm_changed(part)

    def report_transfer(self, report: TransferReport) -> None:
        shard = order_epoch(report.order_id) % len(self.transports)
        self.transports[shard].report_transfer(report)

    # ------------------------------------------------------------------ introspection
    def summary(self) -> dict[str, Any]:
        return merge_summaries([t.summary() for t in self.transports])

    def sessions(self) -> int:
        return sum(t.sessions() for t in self.transports)

    def has_session(self, tenant: str, session_id: str) -> bool:
        return self.owner(tenant, session_id).has_session(tenant, session_id)


if TYPE_CHECKING:  # mypy checks the transport against the Protocols its callers rely on
    _SHARDED: type[SchedulerAPI] = ShardedTransport
    _SHARDED_REMOTE: type[RemoteAPI] = ShardedTransport
