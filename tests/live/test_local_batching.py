"""The in-process batching transport the scheduler actor's own HTTP API calls
(controlplane/live/local_batching.py), in front of a real SchedulerService: events answer
at once and reach the service ahead of the next call, calls of one loop turn share a
batch, a busy service never blocks the event loop (the batch waits on a worker thread, a
call past its timeout answers TimeoutError), and a refused event is counted."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.config import default_fleet
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.local_batching import LocalBatchingTransport
from kvprefetch.controlplane.live.service import SchedulerService
from kvprefetch.controlplane.live.sessions import SessionQuery

TENANT = "default"


def _route(sid: str, tokens: int = 800) -> api.RouteQuery:
    return api.RouteQuery(tenant=TENANT, session_id=sid, input_tokens=tokens)


def _finish(sid: str, node: int, tokens: int = 800) -> api.RequestFinished:
    return api.RequestFinished(tenant=TENANT, session_id=sid, node=node,
                               input_tokens=tokens, output_tokens=100)


@pytest.fixture
def service() -> Iterator[SchedulerService]:
    with SchedulerService(ServiceConfig(fleet=default_fleet("8b", 2))).start() as svc:
        yield svc


def test_an_event_answers_at_once_and_reaches_the_service_before_the_next_route(
        service: SchedulerService) -> None:
    transport = LocalBatchingTransport(service, timeout_s=5)

    async def play() -> tuple[api.Ack, int]:
        first = await transport.acall("route", _route("s"))
        ack = await transport.acall("request_finished", _finish("s", first.node))
        await transport.acall("route", _route("s", 1100))
        state = await transport.acall("session_state",
                                      SessionQuery(tenant=TENANT, session_id="s"))
        return ack, state.turns

    ack, turns = asyncio.run(play())
    assert ack.accepted is True
    assert turns == 2  # the finish was applied before the second route
    assert transport.stats.events == 1 and transport.stats.refused == 0
    transport.close()


def test_calls_of_one_loop_turn_share_one_batch(service: SchedulerService) -> None:
    transport = LocalBatchingTransport(service, timeout_s=5)

    async def together() -> list[api.RouteAnswer]:
        return await asyncio.gather(*(transport.acall("route", _route(f"c-{i}"))
                                      for i in range(64)))

    answers = asyncio.run(together())
    assert all(a.node in (0, 1) for a in answers)
    assert transport.stats.calls == 64
    assert transport.stats.batches < 64  # gathered, not one lock hold each
    assert service.sessions() == 64
    transport.close()


def test_a_busy_service_does_not_block_the_loop_and_a_late_call_times_out(
        service: SchedulerService) -> None:
    transport = LocalBatchingTransport(service, timeout_s=0.2)
    held, release = threading.Event(), threading.Event()

    def stall() -> None:
        with service._lock:  # another thread busy in the service (the control loop's step)
            held.set()
            release.wait(5)

    staller = threading.Thread(target=stall)
    staller.start()
    assert held.wait(5)

    async def meanwhile() -> tuple[str, int, float]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        began = time.perf_counter()
        try:
            await transport.acall("route", _route("late"))
            outcome = "answered"
        except TimeoutError:
            outcome = "timed out"
        waited = time.perf_counter() - began
        ticker.cancel()
        return outcome, ticks, waited

    try:
        outcome, ticks, waited = asyncio.run(meanwhile())
    finally:
        release.set()
        staller.join()
    assert outcome == "timed out"
    assert waited < 1.0
    assert ticks >= 5  # the loop kept running while the service was busy
    assert transport.stats.in_place == 0  # the batch waited on a worker thread
    transport.close()


def test_a_refused_event_is_counted_and_the_rest_of_the_batch_applies(
        service: SchedulerService) -> None:
    transport = LocalBatchingTransport(service, timeout_s=5)

    async def play() -> api.RouteAnswer:
        # A finish of a session the scheduler does not know is refused in the batch.
        assert (await transport.acall("request_finished", _finish("nobody", 0))).accepted
        return await transport.acall("route", _route("after"))

    answer = asyncio.run(play())
    assert answer.node in (0, 1)
    assert transport.stats.refused == 1
    assert service.has_session(TENANT, "after")
    transport.close()


def test_events_past_the_queue_cap_wait_for_their_batch(
        service: SchedulerService, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the service is stuck, at most MAX_QUEUED_EVENTS events are taken at once;
    one more waits like a call (bounded memory) and answers TimeoutError past its
    timeout."""
    from kvprefetch.controlplane.live import local_batching

    monkeypatch.setattr(local_batching, "MAX_QUEUED_EVENTS", 3)
    transport = LocalBatchingTransport(service, timeout_s=0.2)
    held, release = threading.Event(), threading.Event()

    def stall() -> None:
        with service._lock:
            held.set()
            release.wait(5)

    staller = threading.Thread(target=stall)
    staller.start()
    assert held.wait(5)

    def started(sid: str) -> api.RequestStarted:
        return api.RequestStarted(tenant=TENANT, session_id=sid, input_tokens=100)

    async def play() -> tuple[list[bool], str]:
        acks = [(await transport.acall("request_started", started(f"e-{i}"))).accepted
                for i in range(3)]
        try:
            await transport.acall("request_started", started("e-3"))
            outcome = "answered"
        except TimeoutError:
            outcome = "timed out"
        release.set()
        await asyncio.sleep(0.3)  # the worker's batch lands
        return acks, outcome

    try:
        acks, outcome = asyncio.run(play())
    finally:
        release.set()
        staller.join()
    assert acks == [True, True, True] and outcome == "timed out"
    assert transport.stats.backpressure_waits == 1
    time.sleep(0.2)
    # The queued ones are applied once the service is free (the one that timed out may be
    # too, as a remote call that timed out may: it left with their batch).
    assert all(service.has_session(TENANT, f"e-{i}") for i in range(3))
    transport.close()


def test_a_batch_that_fails_fails_its_calls_at_once(
        service: SchedulerService, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure of the batch itself (here: sending its messages) is every call's answer,
    not a wait until the timeout; the next batch runs."""
    transport = LocalBatchingTransport(service, timeout_s=5)
    sent = service.fanout.send

    def broken(box: object) -> None:
        raise RuntimeError("the fanout is down")

    async def play() -> tuple[str, float, api.RouteAnswer]:
        monkeypatch.setattr(service.fanout, "send", broken)
        began = time.perf_counter()
        try:
            await transport.acall("route", _route("f"))
            outcome = "answered"
        except RuntimeError as exc:
            outcome = str(exc)
        waited = time.perf_counter() - began
        monkeypatch.setattr(service.fanout, "send", sent)
        return outcome, waited, await transport.acall("route", _route("g"))

    outcome, waited, after = asyncio.run(play())
    assert outcome == "the fanout is down" and waited < 1.0
    assert after.node in (0, 1)
    transport.close()
