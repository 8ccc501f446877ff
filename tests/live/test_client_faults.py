"""The Python client against a scheduler that is dead, slow or flapping, as a property: the
real HTTP API of a real scheduler behind a TCP proxy (``kvptest.faulty_link``) that
hypothesis sets, call by call, to be up, gone (nothing listening, connections reset),
answering past the client's timeout, resetting the connection, or answering as a load
balancer or a wrong service does (502, 504, an HTML page). Every call a gateway or an
application makes on the request path, the README's pattern included, returns within its
timeout and raises nothing: a route answers no advice (``node`` None), an event
``Ack(accepted=False)``, each counted in ``Client.timeouts`` or ``Client.dropped``."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvptest.faulty_link import MODES, FaultyLink, Mode

from kvprefetch import Hint, connect
from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.live.client import Client
from kvprefetch.controlplane.live.http_api import HttpServer, create_app
from kvprefetch.controlplane.live.service import SchedulerService, ServiceConfig

pytestmark = pytest.mark.servers

GIB = 1 << 30
TOKEN = "t0ken-of-the-faults-test"
TIMEOUT_S = 0.75
#: What a call may take past its timeout on a loaded test machine (scheduling, not waiting).
SLACK_S = 0.75
#: How long the slow link holds an answer: well past the timeout.
SLOW_S = TIMEOUT_S + 0.5
SESSIONS = ("s1", "s2", "s3")
OPS = ("route", "request_started", "request_finished", "hint", "hint_session_closed",
       "session_closed", "route_async", "request_finished_async", "hint_async")
#: The calls that answer a route; the others are events.
ROUTES = {"route", "route_async"}

_T = TypeVar("_T")


@dataclass
class Rig:
    link: FaultyLink
    client: Client
    loop: asyncio.AbstractEventLoop
    #: The node of each session's last route answer, as the application keeps it.
    nodes: dict[str, int | None] = field(default_factory=dict)
    #: The client's warnings (why a call was degraded), for the failure messages.
    warnings: list[str] = field(default_factory=list)

    def warned(self) -> list[str]:
        return self.warnings[-3:]

    def run(self, coro: Awaitable[_T]) -> _T:
        """A coroutine on the rig's long-lived event loop (a gateway's)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    fleet = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 2 * GIB,
                                                  "dram_tier_bytes": 16 * GIB}})
    svc = SchedulerService(ServiceConfig(fleet=fleet, tenants=("acme",))).start()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="gateway-loop")
    thread.start()
    try:
        with HttpServer(create_app(svc, bearer_token=TOKEN)) as server, \
                FaultyLink(("127.0.0.1", server.port)) as link:
            client = connect(link.url, tenant="acme", token=TOKEN, timeout_s=TIMEOUT_S)
            rig = Rig(link, client, loop)
            # the scheduler's first calls are slower than its others (lazy imports, caches)
            client.route("warm-up", input_tokens=1000)
            rig.run(client.route_async("warm-up", input_tokens=1000))
            client.session_closed("warm-up")
            handler = logging.Handler(logging.WARNING)
            handler.emit = lambda record: rig.warnings.append(record.getMessage())  # type: ignore[method-assign]
            logging.getLogger("kvprefetch.controlplane.live.client").addHandler(handler)
            try:
                yield rig
            finally:
                rig.run(client.aclose())
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        svc.close()


def _call(rig: Rig, op: str, session: str) -> Any:
    """One call as an application or a gateway makes it; the route answer's node kept for
    the session's finish, None included (the README's pattern)."""
    client = rig.client
    calls: dict[str, Callable[[], Any]] = {
        "route": lambda: client.route(session, input_tokens=12_000),
        "route_async": lambda: rig.run(client.route_async(session, input_tokens=12_000)),
        "request_started": lambda: client.request_started(session, input_tokens=12_000),
        "request_finished": lambda: client.request_finished(
            session, node=rig.nodes.get(session), input_tokens=12_000, output_tokens=350,
            stop_reason="tool_calls"),
        "request_finished_async": lambda: rig.run(client.request_finished_async(
            session, node=rig.nodes.get(session), input_tokens=12_000, output_tokens=350,
            stop_reason="end_turn")),
        "hint": lambda: client.hint(session, Hint(kind="tool_running", eta_s=4.0)),
        "hint_async": lambda: rig.run(client.hint_async(session, "user_typing")),
        "hint_session_closed": lambda: client.hint(session, Hint(kind="session_closed")),
        "session_closed": lambda: client.session_closed(session),
    }
    answer = calls[op]()
    if op in ROUTES:
        rig.nodes[session] = answer.node
    return answer


def _check_degraded(op: str, mode: Mode, answer: Any) -> None:
    """What a call answers while the scheduler cannot answer it."""
    timed_out = mode == "slow"
    if op in ROUTES:
        assert isinstance(answer, api.RouteAnswer), (op, mode, answer)
        assert answer.node is None and answer.request_id, (op, mode, answer)
        assert answer.timed_out == timed_out, (op, mode, answer)
    else:
        assert answer == api.Ack(accepted=False, timed_out=timed_out), (op, mode, answer)


steps = st.lists(st.tuples(st.sampled_from(MODES), st.sampled_from(OPS),
                           st.sampled_from(SESSIONS)), min_size=1, max_size=10)


#: The calls that open a session at the scheduler, and those that close it.
OPENS = {"route", "route_async", "request_started"}
CLOSES = {"session_closed", "hint_session_closed"}
FINISHES = {"request_finished", "request_finished_async"}


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(steps=steps)
def test_no_call_on_the_request_path_raises_or_outwaits_its_timeout(
        rig: Rig, steps: list[tuple[Mode, str, str]]) -> None:
    """Each example starts from sessions the scheduler does not hold (fresh names); the
    test keeps which of them it holds: those a call reached (``up``, or ``slow``: the
    scheduler applies it, the answer comes too late) opened and did not close since."""
    run = f"{time.monotonic_ns()}-"
    timeouts, dropped = rig.client.timeouts, rig.client.dropped
    want_timeouts = want_dropped = 0
    held: set[str] = set()
    for mode, op, name in steps:
        session = run + name
        rig.link.set(mode, delay_s=SLOW_S)
        started = time.monotonic()
        answer = _call(rig, op, session)
        seconds = time.monotonic() - started
        assert seconds < TIMEOUT_S + SLACK_S, (op, mode, seconds)
        known = session in held
        if mode in ("up", "slow"):  # the scheduler applied it
            if op in OPENS:
                held.add(session)
            elif op in CLOSES:
                held.discard(session)
        if mode != "up":
            _check_degraded(op, mode, answer)
            want_timeouts += mode == "slow"
            want_dropped += op not in ROUTES
        elif op in ROUTES:
            assert answer.node in (0, 1) and not answer.timed_out, (op, answer, rig.warned())
        elif not known and op not in OPENS:
            # the session's opening call did not reach the scheduler: dropped, not raised
            assert answer == api.Ack(accepted=False), (op, answer)
            want_dropped += 1
        else:
            # a finish on no node (its route gave no advice) is taken and not recorded
            no_node = op in FINISHES and rig.nodes.get(session) is None
            assert answer == api.Ack(accepted=not no_node), (op, answer, rig.warned())
    assert rig.client.timeouts - timeouts == want_timeouts
    assert rig.client.dropped - dropped == want_dropped
    rig.link.set("up")


def test_the_readme_pattern_runs_through_a_flapping_scheduler(rig: Rig) -> None:
    """The README's session, the scheduler gone for the route and back for the rest: the
    finish carries the route's ``node`` None; the session never reached the scheduler, so
    its events are dropped (counted), and its next route is advised."""
    client = rig.client
    session = f"readme-{time.monotonic_ns()}"
    dropped = client.dropped
    rig.link.set("dead")
    answer = client.route(session, input_tokens=12_000)
    assert answer.node is None and not answer.timed_out
    rig.link.set("up")
    assert client.request_finished(session, node=answer.node, input_tokens=12_000,
                                   output_tokens=350, stop_reason="tool_calls") == api.Ack(
        accepted=False)
    assert client.hint(session, Hint(kind="tool_running", eta_s=4.0)) == api.Ack(
        accepted=False)
    assert client.session_closed(session) == api.Ack(accepted=False)
    assert client.dropped - dropped == 3
    again = client.route(session, input_tokens=13_000)
    assert again.node in (0, 1)
    assert client.hint(session, Hint(kind="tool_running", eta_s=4.0)).accepted
    assert client.session_closed(session).accepted
