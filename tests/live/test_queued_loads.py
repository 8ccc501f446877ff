"""Live: the load of a request waiting behind a long queue starts on the control loop's
timer a few TTLBs before its estimated GPU start, and the engine then waits for that order
(in process, no servers: the agent is a recording port; the wall clock is the test's)."""

from __future__ import annotations

import time

from kvptest.live_fleet import RecordingPort

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.wire import AgentHello, TransferOrder
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.service import SchedulerService

GIB = 1 << 30
CHUNK = 4096
FLEET = fleet_from_dict({"nodes": 1, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})


def test_a_request_behind_a_long_queue_gets_its_load_before_the_gpu_picks_it_up() -> None:
    wall = [1000.0]
    port = RecordingPort()
    cfg = ServiceConfig(fleet=FLEET, chunk_tokens=CHUNK, loop_interval_s=0.005)
    with SchedulerService(cfg, agents={0: port}, wall=lambda: wall[0]).start() as svc:
        svc.route({"tenant": "t", "session_id": "s0", "input_tokens": 8 * CHUNK})
        svc.request_finished({"tenant": "t", "session_id": "s0", "node": 0,
                              "input_tokens": 8 * CHUNK})
        svc.agent_hello(AgentHello(0, "agent-0", "gpu-0"))  # its tier is empty: s0 is remote
        for i in range(4):  # four long prefills queue on the node's GPU, none started
            svc.route({"tenant": "t", "session_id": f"f{i}", "input_tokens": 100_000})
        wait = svc.driver.fleet.queue_wait_s(0, svc.clock.now_s())
        assert wait > 5.0
        svc.route({"tenant": "t", "session_id": "s0", "input_tokens": 8 * CHUNK + 500,
                   "reused_tokens": 8 * CHUNK})
        time.sleep(0.05)
        assert not [o for o in port.orders if o.session_id == "t/s0"]  # not at arrival
        wall[0] += wait - 0.5  # within 3 TTLBs of its estimated GPU start
        deadline = time.monotonic() + 5.0
        mine: list[TransferOrder] = []
        while not mine and time.monotonic() < deadline:
            time.sleep(0.01)
            mine = [o for o in port.orders if o.session_id == "t/s0"]
        (order,) = mine
        assert not order.prefetch and order.node == 0
        plan = svc.gpu_start(0, "t", "s0", 8 * CHUNK)
        assert plan.wait_order_id == order.order_id  # the engine waits for that one
        assert not plan.dispatched
