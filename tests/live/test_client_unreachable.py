"""The README's session calls against a scheduler that does not answer: nothing listening
on its port, and a server that takes the connection and never answers. Every documented
call returns within its timeout and raises nothing, so the inference path goes on without
advice."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from kvprefetch import Hint, connect
from kvprefetch.controlplane.base import api

pytest.importorskip("httpx")  # the HTTP transport's

TIMEOUT_S = 0.3
#: A call that waits out its timeout returns well within this (connect, then read).
CALL_BOUND_S = 4 * TIMEOUT_S + 1.0

_T = TypeVar("_T")


@pytest.fixture
def refusing_url() -> Iterator[str]:
    """A loopback port that is bound and not listening: every connection is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def hanging_url() -> Iterator[str]:
    """A loopback server whose kernel completes every connection, and that never reads a
    request nor answers one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def _readme_session(url: str) -> list[tuple[str, object, float]]:
    """The README's calls for one session, each with its answer and its seconds; an
    exception from any of them fails the test."""
    done: list[tuple[str, object, float]] = []
    client = connect(url, tenant="acme", token="t0ken", timeout_s=TIMEOUT_S)

    def call(name: str, send: Callable[[], _T]) -> _T:
        started = time.monotonic()
        answer = send()
        done.append((name, answer, time.monotonic() - started))
        return answer

    with client:
        answer = call("route", lambda: client.route("s1", input_tokens=12_000))
        call("request_started", lambda: client.request_started("s1", input_tokens=12_000))
        # As the README has it: the node the route gave, None when it gave none.
        call("request_finished", lambda: client.request_finished(
            "s1", node=answer.node, input_tokens=12_000, output_tokens=350,
            stop_reason="tool_calls"))
        call("hint", lambda: client.hint("s1", Hint(kind="tool_running", eta_s=4.0)))
        call("hint session_closed", lambda: client.hint("s1", Hint(kind="session_closed")))
        call("session_closed", lambda: client.session_closed("s1"))
    return done


def test_nothing_listening_gives_no_advice_and_raises_nothing(refusing_url: str) -> None:
    done = _readme_session(refusing_url)
    assert [name for name, _, _ in done] == ["route", "request_started", "request_finished",
                                             "hint", "hint session_closed", "session_closed"]
    route = done[0][1]
    assert isinstance(route, api.RouteAnswer)
    assert route.node is None and not route.timed_out and route.request_id
    for name, answer, seconds in done[1:]:
        assert answer == api.Ack(accepted=False, timed_out=False), name
        assert seconds < CALL_BOUND_S, name


def test_a_server_that_hangs_past_the_timeout_gives_no_advice_and_raises_nothing(
        hanging_url: str) -> None:
    done = _readme_session(hanging_url)
    assert len(done) == 6
    route = done[0][1]
    assert isinstance(route, api.RouteAnswer)
    assert route.node is None and route.timed_out
    for name, answer, seconds in done[1:]:
        assert answer == api.Ack(accepted=False, timed_out=True), name
        # It waited for the answer (the timeout), and no longer than its bound.
        assert TIMEOUT_S * 0.9 <= seconds < CALL_BOUND_S, name
