"""The prefetch planner: deadline-driven transfers for idle sessions.

For an idle session whose KV is not in its predicted node's local tiers, the planner asks
for the session's next-arrival forecast, picks an arrival quantile as the deadline, and
starts the transfer so that it completes ``safety_margin_s`` before that deadline, allowing
for the estimated TTLB under the node's current link load. Orders carry a priority: the
expected GPU stall avoided per byte moved. Pure: a function of its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvprefetch.controlplane.base.config import PlannerConfig
from kvprefetch.controlplane.base.records import quick_init
from kvprefetch.controlplane.base.types import ArrivalForecast


@quick_init
@dataclass(frozen=True, slots=True)
class PrefetchOrder:
    """Warm ``tokens`` of ``session_id``'s KV on ``node`` between ``start_at_s`` and
    ``deadline_s``. Orders are idempotent per (session, node): a newer one replaces it.
    A ``queued`` order is the timed demand load of a request waiting in a node's queue."""

    session_id: str
    node: int
    tokens: int
    nbytes: int
    start_at_s: float
    deadline_s: float
    #: Expected stall seconds avoided per GiB moved; higher first.
    priority: float
    #: The predicted next use (for eviction): the forecast's median arrival.
    predicted_use_s: float
    #: Not a prefetch: the load of a request already queued on ``node``, timed to land
    #: before the GPU is expected to pick it up (``deadline_s``). See
    #: :mod:`kvprefetch.controlplane.core.loads`.
    queued: bool = False


@quick_init
@dataclass(frozen=True, slots=True)
class TransferEstimate:
    """How long a transfer of ``nbytes`` to a node would take if started now."""

    latency_s: float
    s_per_byte: float
    backlog_s: float

    def ttlb_s(self, nbytes: int) -> float:
        return self.backlog_s + self.latency_s + nbytes * self.s_per_byte


def predicted_use_s(forecast: ArrivalForecast | None, cfg: PlannerConfig, now_s: float) -> float:
    """The time an idle session is expected to be needed again (``inf`` if unlikely).

    Unless the forecast is certain or already conditioned on the session's silence, the
    estimate is never sooner than recency alone would say (a session idle for ``e`` seconds
    is next used around ``now + e``, the rule that makes LRU work on heavy-tailed gaps):
    a heuristic forecast may push a session back (its last response ended a turn, so the
    person will take minutes) but not pull an idle one ahead of what its silence suggests.
    A learned model's conditioned forecast already weighs that silence, and the floor
    would discard what it knows (a learned model loses returning TTFT with the floor;
    last-gap needs it). With an exact forecast (the
    oracle) this is Belady's rule.

    ``cfg.min_p_return`` (a prefetch gate) makes an unconditioned forecast unlikely to
    return soon "never used"; a conditioned one is ranked by its own median whatever its
    ``p_return``: gated, every session silent for more than a few seconds ties at
    ``inf`` and the tier falls back to recency among them, which serves returning
    sessions worse.
    """
    if forecast is None:
        return float("inf")
    if forecast.conditioned:
        return max(forecast.arrival_at(0.5), now_s)
    if forecast.p_return < cfg.min_p_return:
        return float("inf")
    use = max(forecast.arrival_at(0.5), now_s)
    if forecast.confidence < 1.0:
        use = max(use, now_s + (now_s - forecast.last_finish_s))
    return use


def plan_prefetch(
    forecast: ArrivalForecast | None,
    *,
    session_id: str,
    node: int,
    tokens: int,
    nbytes: int,
    now_s: float,
    transfer: TransferEstimate,
    cfg: PlannerConfig,
    safety_margin_s: float | None = None,
) -> PrefetchOrder | None:
    """One order for one session, or None when a prefetch is not worth it."""
    if (
        forecast is None
        or tokens <= 0
        or forecast.p_return < cfg.min_p_return
        or forecast.confidence < cfg.min_confidence
    ):
        return None
    margin = cfg.safety_margin_s if safety_margin_s is None else safety_margin_s
    deadline = forecast.arrival_at(cfg.arrival_quantile)
    ttlb = transfer.ttlb_s(nbytes)
    start_at = max(now_s, deadline - ttlb - margin)
    if start_at - now_s > cfg.max_lead_s:
        start_at = now_s + cfg.max_lead_s  # re-planned then, with a fresher forecast
    # Stall avoided if the session returns: the whole load would otherwise be on the
    # critical path. Weighted by the chance it returns at all.
    stall_avoided = forecast.p_return * (transfer.latency_s + nbytes * transfer.s_per_byte)
    priority = stall_avoided / max(1.0, nbytes / (1 << 30))
    return PrefetchOrder(
        session_id=session_id,
        node=node,
        tokens=tokens,
        nbytes=nbytes,
        start_at_s=start_at,
        deadline_s=deadline,
        priority=priority,
        predicted_use_s=forecast.arrival_at(0.5),
    )
