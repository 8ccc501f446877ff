"""The HTTP API on each event loop uvicorn runs it on: asyncio's, and uvloop's (``auto``
picks uvloop wherever it is installed, as vLLM's install brings it), whose transports
implement asyncio's transport methods without subclassing :class:`asyncio.Transport`. A real
server bound to a loopback address other than 127.0.0.1, as a head node's: calls with a
token are answered on kept-alive connections, and the connection gate's mechanisms hold on
that loop: the door's 503 over the per-client cap, the header deadline, and the lingering
close of a refusal sent before the body was read."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvptest.sockets import answer_head  # noqa: E402

from kvprefetch.controlplane.base.config import fleet_from_dict  # noqa: E402
from kvprefetch.controlplane.live.http_api import HttpServer, create_app  # noqa: E402
from kvprefetch.controlplane.live.limits import RequestLimits  # noqa: E402
from kvprefetch.controlplane.live.service import SchedulerService, ServiceConfig  # noqa: E402
from kvprefetch.controlplane.live.tenants import TenantAuth  # noqa: E402

pytestmark = pytest.mark.servers

GIB, MIB = 1 << 30, 1 << 20
HOST = "127.0.0.2"
TOKEN = "loop-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LIMITS = RequestLimits(max_connections_per_client=2, header_read_timeout_s=1.0)
LOOPS = ["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(
    importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed"))]


@pytest.fixture(params=LOOPS)
def server(request: pytest.FixtureRequest) -> Iterator[HttpServer]:
    fleet = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 2 * GIB,
                                                  "dram_tier_bytes": 16 * GIB}})
    svc = SchedulerService(ServiceConfig(fleet=fleet, limits=LIMITS)).start()
    try:
        app = create_app(svc, auth=TenantAuth({"default": TOKEN}), limits=LIMITS)
        with HttpServer(app, HOST, loop=request.param) as srv:
            yield srv
    finally:
        svc.close()



def _closed_within(sock: socket.socket, limit_s: float) -> float | None:
    """Seconds until the server closes ``sock`` (EOF or reset), or None past ``limit_s``."""
    t0 = time.monotonic()
    sock.settimeout(limit_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def _post_head(path: str, body_bytes: int, token: str = TOKEN) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {token}\r\nContent-Length: {body_bytes}\r\n\r\n").encode()


def test_hints_with_a_token_are_answered_on_kept_alive_connections(server: HttpServer) -> None:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=5) as client:
        routed = client.post("/v1/route", json={"session_id": "s1", "input_tokens": 2048})
        assert routed.status_code == 200, routed.text
        for kind, eta_s in (("tool_running", 600.0), ("tool_running", 2.0)):
            hint = client.post("/v1/hint", json={"session_id": "s1",
                                                 "hint": {"kind": kind, "eta_s": eta_s}})
            assert hint.status_code == 200 and hint.json()["accepted"], hint.text
        health = client.get("/healthz")
        assert health.status_code == 200, health.text
    assert server.gate.refused == server.gate.timed_out == server.gate.evicted == 0


def test_the_gate_refuses_times_out_and_lingers_on_this_loop(server: HttpServer) -> None:
    address = (HOST, server.port)
    body = json.dumps({"session_id": "s1", "input_tokens": 10}).encode()
    proven = []
    for _ in range(LIMITS.max_connections_per_client):
        sock = socket.create_connection(address, timeout=5)
        sock.sendall(_post_head("/v1/route", len(body)) + body)
        assert answer_head(sock).startswith(b"HTTP/1.1 200"), "a call with a token"
        proven.append(sock)
    # the client's cap is held by connections with a token: a newcomer gets 503 at the door
    with socket.create_connection(address, timeout=5) as door:
        answer = answer_head(door)
        assert answer.startswith(b"HTTP/1.1 503") and b"connection: close" in answer, answer
    assert server.gate.refused == 1
    for sock in proven:
        sock.close()
    time.sleep(0.2)  # the server sees both closes

    # a socket that sends no header is closed at the header deadline
    with socket.create_connection(address, timeout=5) as silent:
        took = _closed_within(silent, LIMITS.header_read_timeout_s + 4)
        assert took is not None and took >= LIMITS.header_read_timeout_s * 0.8, took
    assert server.gate.timed_out == 1

    # a wrong token's 401, sent before the body is read, reaches a client still sending it
    with socket.create_connection(address, timeout=5) as sending:
        sending.sendall(_post_head("/v1/hint", 2 * MIB, token="wrong-token-0123456789"))
        sent = 0
        try:
            while sent < 2 * MIB:
                sending.sendall(b" " * 65536)
                sent += 65536
        except OSError:
            pass  # the server stopped reading once its answer and FIN were out
        answer = answer_head(sending)
        assert answer.startswith(b"HTTP/1.1 401"), answer
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=5) as client:
        assert client.get("/healthz").status_code == 200  # the server still serves


@pytest.mark.parametrize("loop", LOOPS)
def test_the_server_runs_on_the_loop_it_is_given(loop: str) -> None:
    async def which_loop(scope: Any, receive: Any, send: Any) -> None:
        body = type(asyncio.get_running_loop()).__module__.encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    with HttpServer(which_loop, HOST, loop=loop) as srv:  # type: ignore[arg-type]
        answer = httpx.get(f"{srv.url}/", timeout=5)
    assert answer.status_code == 200 and answer.text.split(".")[0] == loop, answer.text
