"""A closed session leaves no armed order behind: the service's timer heap holds only the
orders of live sessions, whatever was armed (or re-armed) before the close."""

from __future__ import annotations

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.service import SchedulerService, ServiceConfig

GIB = 1 << 30
#: A tier that holds two of the sessions' contexts per node: the rest are evicted, and
#: their hinted returns arm prefetches.
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 1 * GIB,
                                              "dram_tier_bytes": 2 * GIB}})
SESSIONS = 120
CONTEXT = 8000


def test_closing_sessions_drops_their_armed_prefetches() -> None:
    with SchedulerService(ServiceConfig(fleet=FLEET, policy="predictive")).start() as svc:
        c = connect(service=svc, tenant="acme")
        for i in range(SESSIONS):
            node = c.route(f"s{i}", input_tokens=CONTEXT).node
            c.request_finished(f"s{i}", node=node, input_tokens=CONTEXT, output_tokens=10,
                               context_tokens=CONTEXT)
        for eta_s in (30.0, 20.0):  # the second hint re-arms: the first order is stale
            for i in range(SESSIONS):
                c.hint(f"s{i}", "tool_running", eta_s=eta_s)
        armed = svc.summary()["sizes"]["timers"]
        assert armed >= SESSIONS, armed  # fresh and superseded orders, none due yet
        for i in range(0, SESSIONS, 2):
            c.session_closed(f"s{i}")
        half = svc.summary()["sizes"]
        assert half["sessions"] == SESSIONS // 2
        assert all(int(order.session_id.rsplit("s", 1)[1]) % 2 == 1
                   for _, _, order in svc.driver.timers)
        assert 0 < half["timers"] < armed
        for i in range(1, SESSIONS, 2):
            c.session_closed(f"s{i}")
        sizes = svc.summary()["sizes"]
        assert sizes["sessions"] == sizes["core_sessions"] == 0
        assert sizes["timers"] == 0, sizes
