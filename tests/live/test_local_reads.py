"""Engines that do not tell the scheduler when they read the node's local tier (vLLM behind
the gateway): the cached prompt tokens they report after the fact (``local_tokens_read`` of
``request_finished``) count a landed prefetch as read, not wasted."""

from __future__ import annotations

import pytest
from kvptest.live_fleet import RecordingPort

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.tiers import TierEntry
from kvprefetch.controlplane.base.types import SessionKey
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.service import SchedulerService

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})
CONTEXT = 30_000


@pytest.mark.parametrize("reported", [CONTEXT, None])
def test_cached_tokens_reported_at_finish_mark_a_landed_prefetch_read(
        reported: int | None) -> None:
    cfg = ServiceConfig(fleet=FLEET, policy="predictive", predictor="last-gap")
    with SchedulerService(cfg, agents={0: RecordingPort(), 1: RecordingPort()}) as svc:
        c = connect(service=svc, tenant="acme")
        c.route("a", input_tokens=CONTEXT)
        c.request_finished("a", node=0, input_tokens=CONTEXT, context_tokens=CONTEXT)
        node = c.route("a", input_tokens=CONTEXT + 50).node
        # As if a prefetch had brought the context to that node before the request came.
        wire = SessionKey("acme", "a").wire
        tier = svc.core.dram[node]
        nbytes = CONTEXT * FLEET.model.kv_bytes_per_token
        tier.put(TierEntry(wire, CONTEXT, nbytes, 0.0, ready_at_s=0.0,
                           prefetch_unused_bytes=nbytes))
        c.request_finished("a", node=node, input_tokens=CONTEXT + 50,
                           context_tokens=CONTEXT + 60, local_tokens_read=reported)
        stats = svc.core.stats
        if reported:
            assert (stats.prefetch_used_bytes, stats.wasted_bytes) == (nbytes, 0)
        else:  # nobody said it was read: overwritten unread by the write-through
            assert (stats.prefetch_used_bytes, stats.wasted_bytes) == (0, nbytes)
