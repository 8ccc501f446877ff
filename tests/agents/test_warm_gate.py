"""Warming yields to the engine, and a late order is dropped rather than served late.

Pure logic first (the engine's load parsed and cached, the gate's verdicts on a fake clock,
one test per ``warming`` knob), then the agent with a real Valkey and its local tier, the
engine stood in for by a local HTTP server that serves a Prometheus text page saying busy or
idle."""

from __future__ import annotations

import dataclasses
import http.server
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvprefetch.agents.agent import AgentConfig, PrefetchAgent, RemoteStoreConfig
from kvprefetch.agents.embedded import EmbeddedValkey
from kvprefetch.agents.stores.local import LocalTierConfig
from kvprefetch.agents.vllm.engine_load import (
    FAILED_READ_BACKOFF_S,
    EngineLoad,
    EngineLoadProbe,
    metrics_url_of,
    parse_engine_load,
)
from kvprefetch.agents.warm_gate import Verdict, WarmGate, WarmingConfig
from kvprefetch.controlplane.base.keys import payload
from kvprefetch.controlplane.base.wire import TransferOrder, TransferReport

KIB = 1 << 10


def _page(waiting: int, running: int) -> str:
    """vLLM's gauges as its Prometheus page writes them (two engines' label sets)."""
    return (
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 0.0\n'
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}.0\n'
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n"
        "# TYPE vllm:prompt_tokens_total counter\n"
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0\n')


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _order(order_id: int = 1, *, due_in: float | None = 5.0, prefetch: bool = True,
           key: str = "t/s/0") -> TransferOrder:
    return TransferOrder(order_id, key.rsplit("/", 1)[0], 0, (key,), 1, 1, prefetch, 0.0,
                         due_in_wall_s=due_in)


# -- the engine's load ---------------------------------------------------------------------


def test_the_load_sums_vllms_gauges_over_label_sets_and_an_unknown_page_is_idle() -> None:
    assert parse_engine_load(_page(3, 2)) == EngineLoad(3, 2, known=True)
    assert parse_engine_load("# TYPE other gauge\nother 4\n") == EngineLoad()
    assert metrics_url_of("http://10.0.0.7:8000/v1/") == "http://10.0.0.7:8000/metrics"
    assert metrics_url_of("http://h:8000") == "http://h:8000/metrics"
    assert metrics_url_of("") == ""


def test_the_probe_reads_at_most_once_per_poll_interval_and_backs_off_when_unreadable(
        ) -> None:
    clock, pages, reads = Clock(), [_page(1, 0)], []

    def fetch(url: str) -> str:
        reads.append(url)
        page = pages[0]
        if page == "down":
            raise ConnectionError("refused")
        return page

    probe = EngineLoadProbe("http://e/metrics", 0.2, fetch=fetch, clock=clock)
    assert probe.load().waiting == 1
    pages[0] = _page(0, 0)
    clock.now += 0.1
    assert probe.load().waiting == 1 and len(reads) == 1  # within the interval: cached
    clock.now += 0.15
    assert probe.load().waiting == 0 and len(reads) == 2
    pages[0] = "down"
    clock.now += 0.3
    assert probe.load() == EngineLoad() and probe.failed_reads == 1  # idle, not busy
    clock.now += FAILED_READ_BACKOFF_S / 2
    pages[0] = _page(5, 0)
    assert probe.load() == EngineLoad() and len(reads) == 3  # backing off
    clock.now += FAILED_READ_BACKOFF_S
    assert probe.load().waiting == 5 and len(reads) == 4


# -- the gate's verdicts, one knob at a time ------------------------------------------------


def _gate(load: EngineLoad, clock: Clock | None = None, **knobs: object
          ) -> tuple[WarmGate, list[int], list[int]]:
    started: list[int] = []
    dropped: list[int] = []
    gate = WarmGate(WarmingConfig(**knobs), lambda: load,  # type: ignore[arg-type]
                    lambda o: started.append(o.order_id), lambda o: dropped.append(o.order_id),
                    clock=clock or time.monotonic)
    gate.start()
    return gate, started, dropped


def test_defer_while_waiting_requests_holds_a_prefetch_while_requests_wait() -> None:
    waiting = EngineLoad(waiting=1, running=0, known=True)
    gate, _, _ = _gate(waiting)
    assert gate.offer(_order()) is Verdict.HELD
    assert gate.stats().deferred == gate.stats().held == 1
    gate.close()
    off, _, _ = _gate(waiting, defer_while_waiting_requests=0)
    assert off.offer(_order()) is Verdict.START
    off.close()
    two, _, _ = _gate(waiting, defer_while_waiting_requests=2)
    assert two.offer(_order()) is Verdict.START  # one waiting request is below the bar
    two.close()
    idle, _, _ = _gate(EngineLoad(known=True))
    assert idle.offer(_order()) is Verdict.START
    idle.close()


def test_defer_while_running_requests_holds_a_prefetch_while_requests_run() -> None:
    running = EngineLoad(waiting=0, running=1, known=True)
    default, _, _ = _gate(running)
    assert default.offer(_order()) is Verdict.START  # 0: running requests hold nothing
    default.close()
    gate, _, _ = _gate(running, defer_while_running_requests=1)
    assert gate.offer(_order()) is Verdict.HELD
    gate.close()


def test_a_demand_load_an_order_without_a_deadline_or_an_unknown_load_is_never_held() -> None:
    gate, _, _ = _gate(EngineLoad(waiting=9, running=9, known=True))
    assert gate.offer(_order(prefetch=False, due_in=-60.0)) is Verdict.START
    assert gate.offer(_order(2, due_in=None)) is Verdict.START
    gate.close()
    unknown, _, _ = _gate(EngineLoad(waiting=9, running=9, known=False))
    assert unknown.offer(_order()) is Verdict.START
    unknown.close()


def test_start_before_deadline_s_starts_a_warm_that_close_to_its_deadline_at_once() -> None:
    busy = EngineLoad(waiting=3, known=True)
    gate, _, _ = _gate(busy, start_before_deadline_s=2.0)
    assert gate.offer(_order(due_in=1.5)) is Verdict.START  # within 2 s of its deadline
    assert gate.offer(_order(2, due_in=5.0)) is Verdict.HELD
    gate.close()
    zero, _, _ = _gate(busy)
    assert zero.offer(_order(due_in=1.5)) is Verdict.HELD
    zero.close()


def test_late_grace_s_drops_an_order_past_its_deadline_and_grace() -> None:
    idle = EngineLoad(known=True)
    gate, _, _ = _gate(idle, late_grace_s=0.5)
    assert gate.offer(_order(due_in=-0.4)) is Verdict.START  # within the grace
    assert gate.offer(_order(2, due_in=-0.6)) is Verdict.LATE
    assert gate.stats().dropped_late == 1
    gate.close()
    never, _, _ = _gate(idle, late_grace_s=None)
    assert never.offer(_order(due_in=-60.0)) is Verdict.START
    never.close()
    with pytest.raises(ValidationError, match="late_grace_s"):
        WarmingConfig(late_grace_s=-1.0)


def test_a_held_order_starts_when_the_engine_goes_idle_or_its_deadline_comes() -> None:
    load = [EngineLoad(waiting=2, known=True)]
    started: list[int] = []
    gate = WarmGate(WarmingConfig(engine_poll_interval_ms=10), lambda: load[0],
                    lambda o: started.append(o.order_id), lambda o: None)
    gate.start()
    try:
        assert gate.offer(_order(1, due_in=30.0)) is Verdict.HELD
        assert gate.offer(_order(2, due_in=0.3)) is Verdict.HELD
        time.sleep(0.15)
        assert started == []  # busy, and both deadlines ahead
        time.sleep(0.35)
        assert started == [2]  # its deadline came: started, busy engine or not
        load[0] = EngineLoad(known=True)
        deadline = time.monotonic() + 2
        while started != [2, 1] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert started == [2, 1] and gate.stats().held == 0
    finally:
        gate.close()


def test_release_and_withdraw_take_a_held_order_back() -> None:
    gate, started, _ = _gate(EngineLoad(waiting=1, known=True))
    try:
        assert gate.offer(_order(1, key="t/a/0")) is Verdict.HELD
        assert gate.offer(_order(2, key="t/b/0")) is Verdict.HELD
        taken = gate.release(1)
        assert taken is not None and taken.order_id == 1 and gate.release(1) is None
        assert [o.order_id for o in gate.withdraw("t/b")] == [2]
        assert gate.stats().held == 0 and started == []
    finally:
        gate.close()


# -- through the agent, with a real valkey-server -------------------------------------------


class FakeEngine:
    """A local HTTP server serving a Prometheus page with vLLM's two load gauges."""

    def __init__(self) -> None:
        self.waiting = 0
        self.running = 0
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                body = _page(engine.waiting, engine.running).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def engine() -> Iterator[FakeEngine]:
    fake = FakeEngine()
    yield fake
    fake.close()


def _agent(tmp_path: Path, valkey: EmbeddedValkey, reports: list[TransferReport], *,
           engine_url: str = "", node: int = 0, **warming: object) -> PrefetchAgent:
    remote = RemoteStoreConfig(valkey=valkey.store_config(
        key_prefix=f"gate-{uuid.uuid4().hex[:8]}:", connect_timeout_s=0.5,
        socket_timeout_s=2.0))
    return PrefetchAgent(AgentConfig(
        node=node, remote=remote, engine_url=engine_url,
        warming=WarmingConfig(engine_poll_interval_ms=20, **warming),  # type: ignore[arg-type]
        dram=LocalTierConfig(path=str(tmp_path / f"dram-{uuid.uuid4().hex[:6]}"),
                             capacity_bytes=8 << 20)), reporter=reports.append)


def _until(check: object, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


@pytest.mark.servers
def test_the_agent_holds_a_warm_while_the_engine_has_requests_waiting(
        tmp_path: Path, valkey_server: EmbeddedValkey, engine: FakeEngine) -> None:
    """Busy engine: the prefetch is held (nothing lands) until the engine goes idle; the
    same order with ``defer_while_waiting_requests: 0`` lands at once."""
    reports: list[TransferReport] = []
    engine.waiting = 2
    with _agent(tmp_path, valkey_server, reports, engine_url=f"{engine.url}/v1") as agent:
        agent.store.put([("t/a/0", payload("t/a/0", 16 * KIB))])
        agent.execute(_order(1, due_in=30.0, key="t/a/0"))
        time.sleep(0.3)
        status = agent.status()
        assert status.orders_deferred == 1 and status.orders_in_flight == 1
        assert agent.inventory() == () and reports == []
        engine.waiting = 0
        assert _until(lambda: len(reports) == 1)
        assert reports[0].complete and agent.inventory() == ("t/a/0",)
        assert agent.status().orders_in_flight == 0
        agent.store.delete(["t/a/0"])

    engine.waiting = 2
    reports.clear()
    with _agent(tmp_path, valkey_server, reports, engine_url=engine.url,
                defer_while_waiting_requests=0) as agent:
        agent.store.put([("t/a/0", payload("t/a/0", 16 * KIB))])
        agent.execute(_order(1, due_in=30.0, key="t/a/0"))
        assert _until(lambda: len(reports) == 1)
        assert reports[0].complete and agent.status().orders_deferred == 0
        agent.store.delete(["t/a/0"])


@pytest.mark.servers
def test_engine_metrics_url_names_the_page_when_the_agent_has_no_engine_url(
        tmp_path: Path, valkey_server: EmbeddedValkey, engine: FakeEngine) -> None:
    reports: list[TransferReport] = []
    engine.waiting = 1
    with _agent(tmp_path, valkey_server, reports) as agent:  # no engine named: no yield
        agent.execute(_order(1, due_in=30.0, key="t/none/0"))
        assert _until(lambda: len(reports) == 1)
        assert agent.status().orders_deferred == 0
    reports.clear()
    with _agent(tmp_path, valkey_server, reports,
                engine_metrics_url=f"{engine.url}/metrics") as agent:
        agent.execute(_order(1, due_in=30.0, key="t/none/0"))
        time.sleep(0.2)
        assert agent.status().orders_deferred == 1 and reports == []


@pytest.mark.servers
def test_the_engine_waiting_on_a_held_order_starts_it_and_a_cancel_withdraws_one(
        tmp_path: Path, valkey_server: EmbeddedValkey, engine: FakeEngine) -> None:
    reports: list[TransferReport] = []
    engine.waiting = 3
    with _agent(tmp_path, valkey_server, reports, engine_url=engine.url) as agent:
        agent.store.put([("t/a/0", payload("t/a/0", 16 * KIB))])
        agent.execute(_order(1, due_in=30.0, key="t/a/0"))
        agent.execute(_order(2, due_in=30.0, key="t/b/0"))
        assert agent.status().orders_deferred == 2
        done = agent.wait(1, timeout_s=5)  # the request came: the engine waits on it
        assert done is not None and done.complete
        assert agent.cancel("t/b") == 1
        cancelled = agent.wait(2, timeout_s=1)
        assert cancelled is not None and cancelled.cancelled and cancelled.bytes_moved == 0
        assert agent.status().orders_in_flight == 0
        agent.store.delete(["t/a/0"])


@pytest.mark.servers
def test_an_order_past_its_deadline_and_grace_is_dropped_counted_and_reported_not_done(
        tmp_path: Path, valkey_server: EmbeddedValkey) -> None:
    reports: list[TransferReport] = []
    with _agent(tmp_path, valkey_server, reports, late_grace_s=0.5) as agent:
        agent.store.put([("t/a/0", payload("t/a/0", 16 * KIB))])
        agent.execute(_order(1, due_in=-1.0, key="t/a/0"))
        assert len(reports) == 1
        (dropped,) = reports
        assert not dropped.complete and dropped.cancelled and dropped.bytes_moved == 0
        assert dropped.keys_moved == dropped.keys_failed == 0 and "deadline" in dropped.error
        assert agent.inventory() == ()
        status = agent.status()
        assert status.orders_dropped_late == 1 and status.orders_failed == 0
        assert agent.wait(1, timeout_s=1) == dropped
        # Within the grace, or with a demand load, the order runs.
        agent.execute(_order(2, due_in=-0.2, key="t/a/0"))
        agent.execute(_order(3, due_in=-9.0, prefetch=False, key="t/a/0"))
        assert all(r is not None and r.complete
                   for r in (agent.wait(2, timeout_s=5), agent.wait(3, timeout_s=5)))
        agent.store.delete(["t/a/0"])
    reports.clear()
    with _agent(tmp_path, valkey_server, reports, late_grace_s=None) as agent:
        agent.store.put([("t/a/0", payload("t/a/0", 16 * KIB))])
        agent.execute(_order(1, due_in=-60.0, key="t/a/0"))
        report = agent.wait(1, timeout_s=5)
        assert report is not None and report.complete
        assert agent.status().orders_dropped_late == 0
        agent.store.delete(["t/a/0"])


# -- the scheduler's books of a dropped order -------------------------------------------------


@pytest.mark.servers
def test_the_scheduler_books_a_dropped_prefetch_as_not_done_and_nothing_local(
        tmp_path: Path, valkey_server: EmbeddedValkey) -> None:
    """The service sends each order its deadline as wall seconds from now (its clock's
    seconds divided by the time compression); the agent's report of a late order it dropped
    matches the order (not rejected), closes it as failed, books nothing local on the node
    and no prefetch bytes, and lets the session be planned again; the agent's status
    reaches the scheduler's metrics."""
    from kvptest.live_fleet import RecordingPort

    from kvprefetch.controlplane.base.config import fleet_from_dict
    from kvprefetch.controlplane.base.wire import AgentHello
    from kvprefetch.controlplane.live.config import ServiceConfig
    from kvprefetch.controlplane.live.metrics import PrometheusMetrics
    from kvprefetch.controlplane.live.service import SchedulerService

    fleet = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 << 30,
                                                  "dram_tier_bytes": 16 << 30}})
    ports = {0: RecordingPort(), 1: RecordingPort()}
    cfg = ServiceConfig(fleet=fleet, predictor="hinted", time_compression=100.0,
                        chunk_tokens=4096, initial_nodes=1)
    reports: list[TransferReport] = []
    metrics = PrometheusMetrics()
    with SchedulerService(cfg, agents=ports, metrics=metrics).start() as svc, \
            _agent(tmp_path, valkey_server, reports, node=1) as agent:
        svc.route({"tenant": "t", "session_id": "a", "input_tokens": 3 * 4096})
        svc.request_finished({"tenant": "t", "session_id": "a", "node": 0,
                              "input_tokens": 3 * 4096})
        svc.agent_hello(AgentHello(0, "agent-0", "gpu-0"))  # node 0's tier is empty
        svc.agent_hello(agent.hello())  # node 1's agent greets: the node joins, warmed
        (order,) = ports[1].orders
        assert order.prefetch and order.due_in_wall_s is not None
        now = svc.clock.now_s()
        assert order.due_in_wall_s == pytest.approx((order.deadline_s - now) / 100.0, abs=0.05)
        # The agent of node 1 gets it too late: past its deadline and the grace.
        agent.execute(dataclasses.replace(order, due_in_wall_s=-5.0))
        (dropped,) = reports
        assert dropped.cancelled and not dropped.complete
        svc.report_transfer(dropped)
        summary = svc.summary()
        assert svc.orders.by_id(order.order_id) is None  # closed
        assert svc.stats.orders_failed == 1 and svc.stats.orders_done == 0
        assert not svc.stats.reports_rejected and svc.stats.prefetch_bytes == 0
        assert svc.core.local_tokens(1, "t/a") == 0
        assert sum(summary["orders_in_flight"].values()) <= 1  # at most a fresh plan of it
        svc.node_status(agent.status())
        name = agent.node_name.encode()
        page = metrics.render()
        assert b'kvprefetch_agent_orders_dropped_late_total{node="' + name + b'"} 1.0' in page
        assert b'kvprefetch_agent_orders_deferred_total{node="' + name + b'"} 0.0' in page


def test_the_serve_configs_agent_warming_section_is_read_and_checked(tmp_path: Path) -> None:
    """``agent.warming`` in a serve config: the example's values are read; a bad value is a
    config error naming the file and the field."""
    import yaml

    from kvprefetch.controlplane.base.errors import ConfigError
    from kvprefetch.controlplane.cli.serve_config import load_serve_config

    root = Path(__file__).resolve().parents[2]
    example = load_serve_config(root / "examples" / "serve.yaml").agent.warming
    assert example.defer_while_waiting_requests == 1 and example.late_grace_s == 0.5
    path = tmp_path / "serve.yaml"
    base = {"stores": {"valkey": {"host": "127.0.0.1", "port": 6379}},
            "agent": {"tier_capacity_bytes": 1 << 26}}
    path.write_text(yaml.safe_dump({**base, "agent": {
        **base["agent"], "warming": {"late_grace_s": None, "defer_while_running_requests": 1}}}))
    read = load_serve_config(path).agent.warming
    assert read.late_grace_s is None and read.defer_while_running_requests == 1
    path.write_text(yaml.safe_dump({**base, "agent": {
        **base["agent"], "warming": {"engine_poll_interval_ms": 0}}}))
    with pytest.raises(ConfigError) as err:
        load_serve_config(path)
    assert str(path) in str(err.value)
    assert "agent.warming.engine_poll_interval_ms" in str(err.value)
