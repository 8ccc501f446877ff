"""The restart matrix: the scheduler restarted at each interesting point of an
order's life while its agents live on (Ray's normal recovery), in process with real agents
and Valkey. Every case must end with consistent books:

* no order lost or counted twice: of the orders this incarnation sent, every one is done,
  failed, cancelled or still in flight (``sent == done + failed + cancelled + in flight``);
  none of another epoch is in its book, and no report of the predecessor is booked;
* no tokens booked that the node does not hold: every session the books say is local on a
  node has the keys of those tokens in that node's tier;
* the session's next turn is served from the node's tier with what the books promised.

The points: an order issued but not yet handed to the agent, a transfer in flight, a report
sent but not acknowledged, a session closed with its transfer in flight, and a hint whose
prefetch is armed but not yet fired.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kvptest.live_fleet import session_home, started_agents

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

pytestmark = pytest.mark.servers

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})
CONTEXT = 20_000
CHUNK = 4096


class GatedPort:
    """An agent port that holds orders until :meth:`release` (an order issued, not yet
    started on the node) and forwards everything else."""

    def __init__(self, agent: PrefetchAgent) -> None:
        self.agent = agent
        self.held: list[TransferOrder] = []
        self.gate = False

    def execute(self, order: TransferOrder) -> None:
        if self.gate:
            self.held.append(order)
        else:
            self.agent.execute(order)

    def cancel(self, session_id: str, order_id: int) -> None:
        self.agent.cancel(session_id, order_id)

    def evict(self, prefixes: tuple[str, ...], keys: tuple[str, ...]) -> None:
        self.agent.evict(prefixes, keys)

    def release(self) -> None:
        held, self.held = self.held, []
        for order in held:
            self.agent.execute(order)


@dataclass
class Fleet:
    cfg: ServiceConfig
    agents: list[PrefetchAgent]
    ports: list[GatedPort]
    svc: SchedulerService
    #: Reports the agents sent while no scheduler listened (the one they were for died).
    unacknowledged: list[TransferReport] = field(default_factory=list)

    def start(self) -> SchedulerService:
        ports: dict[int, AgentPort] = dict(enumerate(self.ports))
        self.svc = SchedulerService(self.cfg, agents=ports).start()
        for agent in self.agents:
            agent.set_reporter(self.svc.report_transfer)
            self.svc.agent_hello(agent.hello())
        return self.svc

    def deafen(self) -> None:
        """From now on the agents' reports reach no scheduler (they are kept in
        :attr:`unacknowledged`) until the next one starts."""
        for agent in self.agents:
            agent.set_reporter(self.unacknowledged.append)

    def crash(self) -> None:
        """The scheduler dies: the agents' reports go nowhere until the next one starts."""
        self.deafen()
        self.svc.close()

    def turn(self, sid: str, *, node: int = 0, tenant: str = "acme") -> None:
        """A turn served on ``node`` leaving a CONTEXT-token context, its chunks in the
        remote store (written through)."""
        c = connect(service=self.svc, tenant=tenant)
        c.route(sid, input_tokens=CONTEXT)
        c.request_finished(sid, node=node, input_tokens=CONTEXT, output_tokens=10,
                           context_tokens=CONTEXT)
        info = self.svc.registry.get(SessionKey(tenant, sid))
        assert info is not None
        keys = self.svc.registry.keys_of(info, CONTEXT)
        assert all(r.ok for r in self.agents[0].store.put(
            [(k, payload(k, 1024)) for k in keys]))


@pytest.fixture
def fleet(tmp_path: Path, valkey_server: EmbeddedValkey) -> Iterator[Fleet]:
    agents = started_agents(tmp_path, valkey_server, FLEET.nodes, prefix="matrix")
    cfg = ServiceConfig(fleet=FLEET, policy="ondemand", predictor="last-gap",
                        journal_path=str(tmp_path / "journal.jsonl"), chunk_tokens=CHUNK,
                        time_compression=100.0)
    f = Fleet(cfg, agents, [GatedPort(a) for a in agents], None)  # type: ignore[arg-type]
    f.start()
    yield f
    f.svc.close()
    for agent in agents:
        agent.close()


def _settle(f: Fleet, until: Callable[[], bool] | None = None, timeout_s: float = 5.0
            ) -> None:
    """Wait for ``until`` to come true, or (without it) for the agents to finish what they
    run and the scheduler to have no order in flight."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if until is not None:
            if until():
                return
        elif not any(a.status().orders_in_flight for a in f.agents) and all(
                f.svc.orders.count(n) == 0 for n in range(FLEET.nodes)):
            return
        time.sleep(0.02)


def check_books(f: Fleet) -> None:
    """The invariants of the module docstring."""
    svc = f.svc
    s = svc.stats
    in_flight = sum(svc.orders.count(n) for n in range(FLEET.nodes))
    assert s.orders_sent == s.orders_done + s.orders_failed + s.orders_cancelled + in_flight
    for node in range(FLEET.nodes):
        for inflight in svc.orders.in_flight(node):
            assert order_epoch(inflight.order.order_id) == svc.epoch
        held = set(f.agents[node].inventory())
        for info in svc.registry:
            tokens = svc.core.local_tokens(node, info.sid)
            if tokens:
                keys = svc.registry.keys_of(info, tokens)
                missing = [k for k in keys if k not in held]
                assert not missing, (f"{info.sid}: {tokens} tokens booked on node {node}, "
                                     f"{len(missing)} of its {len(keys)} chunks not there")


def _next_turn_on(f: Fleet, sid: str, node: int) -> int:
    """The session's next request runs on ``node``: the engine waits for the order it is
    told of and reads its tier; returns the usable tokens the scheduler booked."""
    svc = f.svc
    plan = svc.gpu_start(node, "acme", sid, CONTEXT)
    done = f.agents[node].wait(plan.wait_order_id, 10) if plan.wait_order_id else None
    usable = svc.use_local(node, "acme", sid, CONTEXT, done=done)
    held = set(f.agents[node].inventory())
    info = svc.registry.get(SessionKey("acme", sid))
    assert info is not None
    assert all(k in held for k in svc.registry.keys_of(info, usable))
    return usable


def _demand(f: Fleet, sid: str) -> int:
    """The session's next request on node 1 (its KV is on node 0): a demand load there.
    Returns the order id."""
    plan = f.svc.gpu_start(1, "acme", sid, CONTEXT)
    assert plan.wait_order_id is not None
    return plan.wait_order_id


def test_restart_with_an_order_issued_but_not_started(fleet: Fleet) -> None:
    fleet.turn("s")
    fleet.ports[1].gate = True
    old = _demand(fleet, "s")
    assert [o.order_id for o in fleet.ports[1].held] == [old]
    fleet.crash()
    fleet.ports[1].gate = False
    svc = fleet.start()
    fleet.ports[1].release()  # the order reaches the node after its scheduler died
    _settle(fleet)
    # The agent saw the new epoch at hello? Then it refused the order (stale_orders);
    # otherwise it ran it and the report was rejected: either way, nothing booked.
    assert svc.stats.orders_done == 0
    check_books(fleet)
    assert svc.core.local_tokens(1, "acme/s") == 0  # nothing of the old order was booked
    assert _next_turn_on(fleet, "s", 1) == CONTEXT
    check_books(fleet)


def test_restart_with_a_transfer_in_flight(fleet: Fleet) -> None:
    fleet.turn("s")
    fleet.deafen()  # the scheduler dies before the agent reports, however fast it is
    old = _demand(fleet, "s")
    fleet.crash()
    report = fleet.agents[1].wait(old, 10)
    assert report is not None and report.complete
    svc = fleet.start()
    for late in fleet.unacknowledged:  # the agent's report, redelivered late
        svc.report_transfer(late)
    assert svc.stats.reports_rejected.get("stale_epoch", 0) >= 1
    assert svc.stats.orders_done == 0
    check_books(fleet)
    assert _next_turn_on(fleet, "s", 1) == CONTEXT
    check_books(fleet)


def test_restart_after_a_report_sent_but_not_acknowledged(fleet: Fleet) -> None:
    fleet.turn("s")
    old = _demand(fleet, "s")
    report = fleet.agents[1].wait(old, 10)
    assert report is not None and report.complete
    # The old scheduler booked it, then died before the engine read: the books of the
    # new one come from the journal and the agents' hello, never from that report.
    fleet.svc.report_transfer(report)
    fleet.crash()
    svc = fleet.start()
    svc.report_transfer(report)  # the engine's copy of the report, sent again
    assert svc.stats.reports_rejected.get("stale_epoch", 0) == 1
    assert svc.stats.orders_done == 0
    check_books(fleet)
    assert _next_turn_on(fleet, "s", 1) == CONTEXT
    check_books(fleet)


def test_restart_after_a_session_closed_with_its_transfer_in_flight(fleet: Fleet) -> None:
    fleet.turn("s")
    fleet.turn("other")
    fleet.ports[1].gate = True
    _demand(fleet, "s")
    connect(service=fleet.svc, tenant="acme").session_closed("s")
    assert fleet.svc.stats.orders_cancelled == 1
    fleet.crash()
    fleet.ports[1].gate = False
    svc = fleet.start()
    fleet.ports[1].release()
    _settle(fleet)
    for late in fleet.unacknowledged:
        svc.report_transfer(late)
    assert not svc.has_session("acme", "s") and session_home(svc.core, "acme/s") is None
    assert svc.core.local_tokens(1, "acme/s") == 0
    check_books(fleet)
    assert _next_turn_on(fleet, "other", 1) == CONTEXT
    check_books(fleet)


def _hint_then_crash(fleet: Fleet, tmp_path: Path) -> SchedulerService:
    """Under the predictive policy: a session whose KV its node lost (the agent's hello
    says so) is hinted back; its prefetch is armed, not fired, when the scheduler dies."""
    fleet.svc.close()
    fleet.cfg = fleet.cfg.model_copy(update={
        "policy": "predictive", "journal_path": str(tmp_path / "hinted.jsonl")})
    svc = fleet.start()
    fleet.turn("s")
    for agent in fleet.agents:  # the node lost its tier (as after a node restart)
        agent.evict(("acme/",), ())
    svc.agent_hello(fleet.agents[0].hello())
    assert svc.core.local_tokens(0, "acme/s") == 0
    connect(service=svc, tenant="acme").hint("s", "tool_running", eta_s=60.0)
    assert svc.driver.timers or svc.stats.orders_sent  # armed (or fired at once)
    fleet.crash()
    return fleet.start()


def test_restart_with_a_hint_pending(tmp_path: Path, fleet: Fleet) -> None:
    svc = _hint_then_crash(fleet, tmp_path)
    _settle(fleet)
    check_books(fleet)
    home = session_home(svc.core, "acme/s")
    assert home == 0
    # Served from the node's tier with what the books promise (a demand load if the
    # prefetch did not happen).
    assert _next_turn_on(fleet, "s", home) == CONTEXT
    check_books(fleet)


def test_a_pending_hint_is_prefetched_after_the_restart(tmp_path: Path,
                                                         fleet: Fleet) -> None:
    svc = _hint_then_crash(fleet, tmp_path)
    _settle(fleet, lambda: svc.core.local_tokens(0, "acme/s") > 0, timeout_s=3.0)
    assert svc.core.local_tokens(0, "acme/s") == CONTEXT
