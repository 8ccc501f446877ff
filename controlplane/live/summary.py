"""The live service's summary: counters, rolling measurements and sizes, as one JSON
object for operators, the live demo and tests (``SchedulerService.summary``)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvprefetch.controlplane.core.quotas import TenantQuotaStats
from kvprefetch.controlplane.live.driver import LiveDriver


def driver_summary(driver: LiveDriver) -> dict[str, Any]:
    """The driver's counters and measurements as one JSON object (the service's
    ``summary``): read under the service's lock."""
    core, s, members = driver.core, driver.stats, driver.members
    return {
        "policy": driver.policy.name, "events": s.events, "routes": s.routes,
        "sessions": len(driver.registry), "orders_sent": s.orders_sent,
        "orders_done": s.orders_done, "orders_failed": s.orders_failed,
        "orders_lost": s.orders_lost, "orders_cancelled": s.orders_cancelled,
        "orders_in_flight": {driver.node_name(i): driver.orders.count(i)
                             for i in range(driver.config.fleet.nodes)},
        "prefetch_bytes": s.prefetch_bytes, "demand_bytes": s.demand_bytes,
        "prefetch_model_bytes": s.prefetch_model_bytes,
        "demand_model_bytes": s.demand_model_bytes,
        "prefetches": core.stats.prefetches,
        "prefetches_dropped": core.stats.prefetches_dropped,
        "prefetches_hidden_by_queue": core.stats.prefetches_hidden_by_queue,
        "wasted_bytes_modelled": core.stats.wasted_bytes,
        "prefetch_used_bytes_modelled": core.stats.prefetch_used_bytes,
        "prefetches_over_budget": core.stats.prefetches_over_budget,
        "warmup_bytes": core.stats.warmup_bytes,
        "bets_won": core.stats.bets_won, "bets_lost": core.stats.bets_lost,
        "ttlb_s": list(s.ttlb_s), "lateness_s": list(s.lateness_s),
        "plan_step_s": list(s.plan_step_s),
        "plan_steps": s.plan_steps,
        "eviction_index": asdict(core.eviction_index_stats()),
        "loop_errors": s.loop_errors, "sweeps": s.sweeps, "clock_s": driver.clock.now_s(),
        "epoch": driver.orders.epoch, "reports_rejected": dict(s.reports_rejected),
        "reports_duplicate": s.reports_duplicate,
        "journal_quarantined": s.journal_quarantined,
        "journal_compactions": s.journal_compactions,
        "journal_records_dropped": s.journal_records_dropped,
        "quota_refusals": s.quota_refusals,
        "finishes_without_node": s.finishes_without_node,
        "quota_changes": s.quota_changes,
        "tier_evictions": s.tier_evictions,
        "hbm_evictions": s.hbm_evictions, "hbm_resyncs": s.hbm_resyncs,
        "tier_quota_bytes": {driver.node_name(i): t.capacity_bytes
                             for i, t in enumerate(core.dram)},
        "live_sessions_per_tenant": dict(driver.registry.per_tenant),
        "tenant_shares": _tenant_shares(driver),
        "nodes_joined": members.nodes_joined, "nodes_lost": members.nodes_lost,
        "nodes_out": [driver.node_name(n) for n in sorted(members.out_nodes)],
        "sizes": {"sessions": len(driver.registry), "core_sessions": core.sessions(),
                  "timers": len(driver.timers), **driver.orders.sizes()},
    }

def _tenant_shares(driver: LiveDriver) -> dict[str, Any]:
    """Each tenant with a share: its quota, its bytes in each node's books and what its
    shares did (empty without quotas)."""
    shares = driver.core.shares
    if shares is None:
        return {}
    held = shares.tier_bytes(driver.core.dram)
    return {t: {**asdict(q), **asdict(shares.stats.get(t) or TenantQuotaStats()),
                "local_tier_bytes": {driver.node_name(n): held[(t, n)]
                                     for n in range(driver.config.fleet.nodes)}}
            for t, q in sorted(shares.quotas.items())}
