"""SchedulerService + client in process: typed errors, tenants, journal, resume, load."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.errors import (
    ConfigError,
    InvalidRequestError,
    KvPrefetchError,
    MalformedHintError,
    UnknownSessionError,
    WrongTenantError,
)
from kvprefetch.controlplane.base.types import EventKind, SessionKey
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.service import SchedulerService
from kvprefetch.controlplane.live.tenants import TenantQuotaError
from kvprefetch.controlplane.traces import load_trace, read_journal_events

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 16 * GIB}})


def _service(tmp_path: Path | None = None, **kw: object) -> SchedulerService:
    journal = str(tmp_path / "journal.jsonl") if tmp_path is not None else None
    cfg = ServiceConfig(fleet=FLEET, journal_path=journal, **kw)  # type: ignore[arg-type]
    return SchedulerService(cfg).start()


def _turn(client, sid: str, tokens: int, reused: int, out: int = 100, **kw: object) -> int:
    ans = client.route(sid, input_tokens=tokens, reused_tokens=reused, **kw)
    assert ans.node is not None
    client.request_finished(sid, node=ans.node, input_tokens=tokens, output_tokens=out, **kw)
    return ans.node


def test_typed_errors_and_the_service_keeps_running() -> None:
    with _service(tenants=("acme", "globex")) as svc:
        c = connect(service=svc, tenant="acme")
        _turn(c, "s1", 1000, 0)
        # the service refuses an event of a session it does not hold; the client drops it
        with pytest.raises(UnknownSessionError):
            svc.hint({"tenant": "acme", "session_id": "nope", "hint": {"kind": "user_typing"}})
        assert c.hint("nope", "user_typing") == api.Ack(accepted=False)
        assert c.request_finished("nope", node=0, input_tokens=1) == api.Ack(accepted=False)
        assert c.dropped == 2
        with pytest.raises(MalformedHintError):
            c.hint("s1", "dancing")
        with pytest.raises(MalformedHintError):
            c.hint("s1", "tool_running", eta_s=-3)
        with pytest.raises(MalformedHintError):
            c.hint("s1", {"kind": "session_closed", "eta_s": 1.0})
        # acme's s1 is not globex's
        assert c.hint("s1", "user_typing", tenant="globex") == api.Ack(accepted=False)
        with pytest.raises(WrongTenantError):
            c.route("s2", input_tokens=10, tenant="initech")  # not an allowed tenant
        with pytest.raises(InvalidRequestError):
            c.route("s3", input_tokens=-5)
        with pytest.raises(InvalidRequestError):
            c.route("s3")  # no size
        with pytest.raises(InvalidRequestError):
            c.request_finished("s1", node=7, input_tokens=10)  # no such node
        assert all(issubclass(e, KvPrefetchError) for e in (
            UnknownSessionError, MalformedHintError, WrongTenantError, InvalidRequestError))
        # still serving after all that
        assert c.hint("s1", api.Hint(kind="tool_running", eta_s=2.0)).accepted
        assert _turn(c, "s1", 1200, 1100) in (0, 1)
        assert svc.stats.loop_errors == 0


def test_bad_config_is_a_typed_error() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        ServiceConfig(fleet=FLEET, policy="magic")
    with pytest.raises(ValueError, match="node_names"):
        ServiceConfig(fleet=FLEET, node_names=("a",))
    with pytest.raises(ValueError, match="oracle"):
        ServiceConfig(fleet=FLEET, policy="perfect")
    with pytest.raises(KvPrefetchError, match="unknown predictor"):
        SchedulerService(ServiceConfig(fleet=FLEET, predictor="nope")).start()
    svc = SchedulerService(ServiceConfig(fleet=FLEET))
    with pytest.raises(ConfigError, match="not started"):
        _ = svc.core


def test_token_ids_and_chunk_hashes_key_by_content() -> None:
    with _service(chunk_tokens=4) as svc:
        c = connect(service=svc, tenant="t")
        c.route("a", token_ids=list(range(10)))
        info = svc.registry.get(SessionKey("t", "a"))
        assert info is not None and info.hashes is not None and len(info.hashes) == 3
        keys = svc.registry.keys_of(info, 10)
        assert keys[0].startswith("t/h/")
        c.route("b", input_tokens=8, chunk_hashes=["h1", "h2"])
        info_b = svc.registry.get(SessionKey("t", "b"))
        assert info_b is not None and svc.registry.keys_of(info_b, 8) == ["t/h/h1", "t/h/h2"]
        with pytest.raises(InvalidRequestError):
            c.route("c", token_ids=[1, 2], chunk_hashes=["x"])


def test_journal_replays_in_sim_and_resume_keeps_sessions(tmp_path: Path) -> None:
    svc = _service(tmp_path, time_compression=1000.0)
    c = connect(service=svc, tenant="acme")
    for turn in range(3):
        for sid in ("a", "b"):
            _turn(c, sid, 2000 * (turn + 1), 2000 * turn + 100 * turn)
            time.sleep(0.002)
    c.hint("a", "tool_running", eta_s=5)
    svc.close()  # as if the actor died after its last event: the journal has it all
    events = list(read_journal_events(tmp_path / "journal.jsonl"))
    assert sum(e.kind is EventKind.REQUEST_STARTED for e in events) == 6
    assert any(e.kind is EventKind.HINT for e in events)
    trace = load_trace(tmp_path / "journal.jsonl")  # what `kvprefetch sim --trace` reads
    assert len(trace.sessions) == 2 and trace.requests == 6

    again = _service(tmp_path, time_compression=1000.0)
    try:
        assert again.has_session("acme", "a") and again.has_session("acme", "b")
        assert again.clock.now_s() >= events[-1].time_s
        c2 = connect(service=again, tenant="acme")
        assert c2.hint("b", "user_typing").accepted  # known: no UnknownSessionError
        assert c2.hint("a", "user_typing", tenant="other") == api.Ack(accepted=False)
        assert _turn(c2, "a", 8000, 6300) in (0, 1)
    finally:
        again.close()
    assert sum(1 for _ in read_journal_events(tmp_path / "journal.jsonl")) == len(events) + 3


def test_session_closed_frees_state() -> None:
    with _service() as svc:
        c = connect(service=svc)
        _turn(c, "x", 100, 0)
        assert c.session_closed("x").accepted
        assert not svc.has_session("default", "x")
        assert c.hint("x", "user_typing") == api.Ack(accepted=False)


def test_a_session_closed_hint_closes_the_session_as_session_closed_does(
        tmp_path: Path) -> None:
    """The hint frees the session and its tenant's live-session slot, and is journalled as
    the close: a restarted service does not bring the session back."""
    with _service(tmp_path, tenants=("acme",), max_live_sessions_per_tenant=1) as svc:
        c = connect(service=svc, tenant="acme")
        _turn(c, "s1", 1000, 0)
        with pytest.raises(TenantQuotaError):
            c.route("s2", input_tokens=10)  # s1 holds the tenant's one slot
        assert c.hint("s1", api.Hint(kind="session_closed")).accepted
        assert not svc.has_session("acme", "s1") and svc.core.sessions() == 0
        assert svc.summary()["live_sessions_per_tenant"].get("acme", 0) == 0
        with pytest.raises(UnknownSessionError):
            c.session_state("s1")
        # closed: a second close finds nothing
        assert c.session_closed("s1") == api.Ack(accepted=False)
        _turn(c, "s2", 1000, 0)  # the slot is free
    kinds = [e.kind for e in read_journal_events(tmp_path / "journal.jsonl")
             if e.session_id == "acme/s1"]
    assert kinds[-1] is EventKind.SESSION_CLOSED and EventKind.HINT not in kinds
    with _service(tmp_path, tenants=("acme",), max_live_sessions_per_tenant=1) as again:
        assert not again.has_session("acme", "s1") and again.has_session("acme", "s2")


def test_a_finish_on_no_node_books_nothing_and_leaves_the_request_in_flight(
        tmp_path: Path) -> None:
    """A route that gave no advice leaves the caller no node to name (the README passes
    ``answer.node`` as it came): that finish is acknowledged with ``accepted`` False and
    recorded nowhere (no node's books, no journal record); the session's next finish on a
    node records its context."""
    with _service(tmp_path) as svc:
        c = connect(service=svc, tenant="acme")
        sid = "acme/s1"
        first = _turn(c, "s1", 1000, 0, out=100)
        books = [svc.core.dram_tokens(n, sid) for n in range(FLEET.nodes)]
        assert books[first] == 1100  # a finish on a node is booked there
        journal = tmp_path / "journal.jsonl"
        records = sum(1 for _ in read_journal_events(journal))

        assert c.route("s1", input_tokens=1500, reused_tokens=1100).node is not None
        ack = c.request_finished("s1", node=None, input_tokens=1500, output_tokens=200,
                                 stop_reason="tool_calls")
        assert ack == api.Ack(accepted=False, timed_out=False)
        assert [svc.core.dram_tokens(n, sid) for n in range(FLEET.nodes)] == books
        state = c.session_state("s1")
        assert state.in_flight and state.context_tokens == 1100 and state.turns == 2
        assert sum(1 for _ in read_journal_events(journal)) == records + 1  # the start only
        assert svc.summary()["finishes_without_node"] == 1
        # as any event of an unknown session: dropped
        assert c.request_finished("new", node=None, input_tokens=10) == api.Ack(accepted=False)
        assert not svc.has_session("acme", "new") and svc.summary()["events"] == 3

        again = c.route("s1", input_tokens=1800, reused_tokens=1700)  # routed again
        assert again.node is not None
        assert c.request_finished("s1", node=again.node, input_tokens=1800,
                                  output_tokens=50).accepted
        state = c.session_state("s1")
        assert not state.in_flight and state.context_tokens == 1850 and state.turns == 2
        assert svc.core.dram_tokens(again.node, sid) == 1850
        assert svc.stats.loop_errors == 0


@pytest.mark.slow
def test_client_under_load_loses_no_event(tmp_path: Path) -> None:
    """10,000 sessions, 100,000 events through the Python client (in-process transport:
    the scheduler service itself, without Ray, which this 2-core machine cannot drive at
    this rate)."""
    sessions, turns = 10_000, 5  # route (= request_started) + request_finished per turn
    with _service(tmp_path) as svc:
        c = connect(service=svc, tenant="load")
        lat: list[float] = []
        start = time.perf_counter()
        for turn in range(turns):
            for i in range(sessions):
                sid = f"s{i}"
                t0 = time.perf_counter()
                ans = c.route(sid, input_tokens=1000 * (turn + 1), reused_tokens=1000 * turn)
                t1 = time.perf_counter()
                c.request_finished(sid, node=ans.node or 0, input_tokens=1000 * (turn + 1),
                                   output_tokens=10)
                t2 = time.perf_counter()
                lat += [t1 - t0, t2 - t1]
        wall = time.perf_counter() - start
        events = svc.stats.events
    lat.sort()
    p99 = lat[int(0.99 * len(lat))]
    print(f"\nload: {events} events in {wall:.1f} s = {events / wall:,.0f} events/s; "
          f"p99 call latency {p99 * 1e3:.2f} ms")
    assert events == sessions * turns * 2 == 100_000
    journaled = sum(1 for _ in read_journal_events(tmp_path / "journal.jsonl"))
    assert journaled == events
    assert c.timeouts == 0


def test_the_control_loop_re_plans_idle_sessions_every_sweep_interval(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle sessions whose KV left their node are re-planned on a timer (their forecasts
    move as their silence grows), every ``planner.sweep_interval_s`` of service time, as
    in the simulator."""
    wall = [1000.0]
    svc = SchedulerService(ServiceConfig(fleet=FLEET, loop_interval_s=0.005),
                           wall=lambda: wall[0])
    swept: list[float] = []
    with svc.start():
        core = svc.driver.core
        real = core.sweep

        def sweep(now_s: float):  # type: ignore[no-untyped-def]
            swept.append(now_s)
            return real(now_s)

        monkeypatch.setattr(core, "sweep", sweep)
        for _ in range(45):  # 45 service seconds, one at a time, a few loop ticks each
            wall[0] += 1.0
            time.sleep(0.03)
        assert svc.summary()["sweeps"] == len(swept)
    interval = FLEET.planner.sweep_interval_s
    assert 4 <= len(swept) <= 5, swept
    assert all(b - a >= interval for a, b in itertools.pairwise(swept)), swept


def test_a_batch_holds_the_lock_once_and_sends_every_call_s_messages_after_it() -> None:
    with _service() as svc:
        sent: list[tuple[bool, bool]] = []  # (lock held by this thread, inside the batch)
        real_send = svc.fanout.send

        def send(box):  # type: ignore[no-untyped-def]
            sent.append((svc._lock._is_owned(), svc._batched is not None))
            real_send(box)

        svc.fanout.send = send  # type: ignore[method-assign]
        with svc.batch():
            svc.route(api.RouteQuery(session_id="b1", input_tokens=1000))
            with pytest.raises(UnknownSessionError):  # fails alone
                svc.request_finished(api.RequestFinished(session_id="nope", node=0,
                                                         input_tokens=1))
            with svc.batch():  # nested: one batch
                svc.request_finished(api.RequestFinished(session_id="b1", node=0,
                                                         input_tokens=1000))
            assert sent == []  # nothing sent while the batch holds the lock
        assert sent == [(False, False), (False, False)]
        assert svc.registry.get(SessionKey("default", "b1")) is not None
        svc.route(api.RouteQuery(session_id="b1", input_tokens=1100))  # outside: sent at once
        assert len(sent) == 3
