"""Scheduler incarnations: order ids carry the scheduler's epoch, so a
restarted scheduler's orders never collide with its predecessor's in the agents'
de-duplication or reports; a report is checked against its order before it is booked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kvptest.live_fleet import InProcessPort, RecordingPort, started_agents

from kvprefetch.agents.agent import PrefetchAgent
from kvprefetch.agents.embedded import EmbeddedValkey
from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.keys import payload
from kvprefetch.controlplane.base.types import SessionKey
from kvprefetch.controlplane.base.wire import TransferOrder, TransferReport, order_epoch
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.ports import AgentPort
from kvprefetch.controlplane.live.service import SchedulerService

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})
CONTEXT = 30_000


def _first_turn(svc: SchedulerService, tenant: str, sid: str) -> None:
    """One turn on node 0 that leaves a CONTEXT-token context behind."""
    c = connect(service=svc, tenant=tenant)
    c.route(sid, input_tokens=CONTEXT)
    c.request_finished(sid, node=0, input_tokens=CONTEXT, output_tokens=10,
                       context_tokens=CONTEXT)


@pytest.fixture
def agents(tmp_path: Path, valkey_server: EmbeddedValkey) -> Iterator[list[PrefetchAgent]]:
    fleet = started_agents(tmp_path, valkey_server, FLEET.nodes, prefix="epochs")
    yield fleet
    for agent in fleet:
        agent.close()


def _service(cfg: ServiceConfig, agents: list[PrefetchAgent]) -> SchedulerService:
    ports: dict[int, AgentPort] = {i: InProcessPort(a) for i, a in enumerate(agents)}
    svc = SchedulerService(cfg, agents=ports).start()
    for agent in agents:  # Ray restarts the scheduler; the agents live on
        agent.set_reporter(svc.report_transfer)
        svc.agent_hello(agent.hello())
    return svc


@pytest.mark.servers
def test_a_restarted_scheduler_never_books_its_predecessors_reports(
        tmp_path: Path, agents: list[PrefetchAgent]) -> None:
    """The restarted scheduler's first order (globex) must not share an id with its
    predecessor's (acme's): otherwise the agent drops it as already seen, the engine's wait
    returns acme's completion, and the scheduler books 30,000 tokens as local on a node
    that holds none of globex's chunks."""
    cfg = ServiceConfig(fleet=FLEET, policy="ondemand", predictor="last-gap",
                        journal_path=str(tmp_path / "journal.jsonl"), chunk_tokens=4096)
    svc = _service(cfg, agents)
    _first_turn(svc, "acme", "a")
    info = svc.registry.get(SessionKey("acme", "a"))
    assert info is not None
    acme_keys = svc.registry.keys_of(info, CONTEXT)
    assert all(r.ok for r in agents[1].store.put([(k, payload(k, 1024)) for k in acme_keys]))
    # The engine on node 1 picks acme's next request up: a demand load to node 1.
    plan = svc.gpu_start(1, "acme", "a", CONTEXT)
    assert plan.wait_order_id is not None
    acme_report = agents[1].wait(plan.wait_order_id, 10)
    assert acme_report is not None and acme_report.complete
    assert svc.use_local(1, "acme", "a", CONTEXT, done=acme_report) == CONTEXT
    first_epoch = svc.epoch
    svc.close()  # Ray restarts the scheduler; the agents keep their state

    again = _service(cfg, agents)
    try:
        assert again.epoch > first_epoch
        _first_turn(again, "globex", "g")  # globex's KV is nowhere in the remote store
        plan2 = again.gpu_start(1, "globex", "g", CONTEXT)
        assert plan2.wait_order_id is not None
        assert plan2.wait_order_id != plan.wait_order_id
        assert order_epoch(plan2.wait_order_id) == again.epoch
        report = agents[1].wait(plan2.wait_order_id, 10)
        # The agent ran globex's order (not dropped as seen) and reports globex's outcome.
        assert report is not None and report.session_id == "globex/g"
        assert not report.complete  # 0 chunks of globex in the store
        assert again.use_local(1, "globex", "g", CONTEXT, done=report) == 0
        assert again.core.local_tokens(1, "globex/g") == 0
        # The predecessor's report, delivered late, is dropped and counted, never booked.
        again.report_transfer(acme_report)
        assert again.core.local_tokens(1, "globex/g") == 0
        assert again.stats.reports_rejected["stale_epoch"] >= 1
        # Agents dropped the older incarnation's de-duplication state and reports.
        assert agents[1].wait(plan.wait_order_id, 0.01) is None
        # An order of the replaced scheduler that arrives late is refused and counted.
        agents[1].execute(TransferOrder(plan.wait_order_id, "acme/a", 1, tuple(acme_keys),
                                        CONTEXT, 1, False, 0.0))
        assert agents[1].status().stale_orders == 1
        assert agents[1].wait(plan.wait_order_id, 0.01) is None
    finally:
        again.close()


def _report(order: TransferOrder, **changes: object) -> TransferReport:
    fields: dict[str, object] = dict(
        order_id=order.order_id, session_id=order.session_id, node=order.node,
        prefetch=order.prefetch, complete=True, cancelled=False, bytes_moved=order.nbytes,
        keys_moved=len(order.keys), keys_present=0, keys_missed=0, keys_failed=0,
        ttlb_wall_s=0.01)
    fields.update(changes)
    return TransferReport(**fields)  # type: ignore[arg-type]


def test_a_report_that_does_not_match_its_order_is_counted_never_booked() -> None:
    recorder = RecordingPort()
    cfg = ServiceConfig(fleet=FLEET, policy="ondemand", predictor="last-gap")
    with SchedulerService(cfg, agents={1: recorder}) as svc:
        _first_turn(svc, "acme", "a")
        plan = svc.gpu_start(1, "acme", "a", CONTEXT)
        assert plan.wait_order_id is not None
        (order,) = recorder.orders
        assert order.order_id == plan.wait_order_id and order.epoch == svc.epoch
        wrong = [
            _report(order, session_id="globex/g"),          # another session
            _report(order, node=0),                         # another node
            _report(order, node=9),                         # no such node
            _report(order, prefetch=not order.prefetch),    # another kind of order
            _report(order, keys_moved=len(order.keys) + 3),  # more keys than it named
            _report(order, keys_digest="0" * 16),           # other keys
            _report(order, order_id=order.order_id + (1 << 32)),  # another epoch
        ]
        for bad in wrong:
            svc.report_transfer(bad)
        assert svc.stats.orders_done == svc.stats.orders_failed == 0
        assert svc.orders.by_id(order.order_id) is not None  # still waiting for its report
        rejected = svc.summary()["reports_rejected"]
        assert sum(rejected.values()) == len(wrong)
        assert set(rejected) >= {"session", "node", "kind", "keys", "stale_epoch"}
        # The order is still in flight, and its true report is booked once.
        svc.report_transfer(_report(order))
        svc.report_transfer(_report(order))  # a duplicate (engine and agent both report)
        assert svc.stats.orders_done == 1 and svc.stats.reports_duplicate == 1
        assert svc.orders.by_id(order.order_id) is None
        assert svc.use_local(1, "acme", "a", CONTEXT) == CONTEXT
