"""The HTTP edge against a real server in a process of its own (tests/live/edge_server.py):
bad bodies are refused in bounded time and memory with a bounded list of errors, another
tenant's calls keep their latency while they arrive, a call without a token is refused
before its body is read, slow uploads are cut off, and connections over the cap are
refused. Memory is the server process's resident set (/proc/PID/status)."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from edge_server import TOKENS  # noqa: E402
from kvptest.sockets import answer_head  # noqa: E402

from kvprefetch.controlplane.live.http_edge import RefusalBudget  # noqa: E402

MIB = 1 << 20
ACME = {"Authorization": f"Bearer {TOKENS['acme']}", "Content-Type": "application/json"}
GLOBEX = {"Authorization": f"Bearer {TOKENS['globex']}", "Content-Type": "application/json"}
SERVER = Path(__file__).with_name("edge_server.py")


class Served:
    def __init__(self, proc: subprocess.Popen[str], url: str) -> None:
        self.proc, self.url = proc, url
        host, port = url.removeprefix("http://").split(":")
        self.address = (host, int(port))

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")


@contextmanager
def serve(**limits: Any) -> Iterator[Served]:
    proc = subprocess.Popen([sys.executable, str(SERVER), json.dumps(limits)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=SERVER.parent)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("URL "), line
        yield Served(proc, line.split()[1])
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bad_tokens(target_bytes: int, item: bytes = b"1.5") -> bytes:
    head, tail = b'{"session_id": "s", "token_ids": [', b"]}"
    n = (target_bytes - len(head) - len(tail)) // (len(item) + 1)
    return head + b",".join([item] * n) + tail


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve() as srv:
        yield srv


def _route(url: str, client: Any, headers: dict[str, str], i: int) -> float:
    t0 = time.perf_counter()
    resp = client.post(f"{url}/v1/route", headers=headers,
                       content=json.dumps({"session_id": f"g{i}", "input_tokens": 100}))
    assert resp.status_code == 200, resp.text
    return time.perf_counter() - t0


def _p99(samples: list[float]) -> float:
    samples = sorted(samples)
    return samples[min(len(samples) - 1, int(len(samples) * 0.99))]


@pytest.mark.servers
def test_a_16_mib_body_of_invalid_items_is_refused_fast_in_bounded_memory(
        served: Served) -> None:
    with httpx.Client(timeout=30) as client:
        client.post(f"{served.url}/v1/route", headers=ACME,
                    content=b'{"session_id": "warm", "input_tokens": 1}')
        before = served.rss_mib()
        cases = [bad_tokens(16 * MIB - 1024),  # 4M items: more than any call holds
                 bad_tokens(2 * MIB),  # 524,288 items: validated, the first 20 listed
                 b'{"session_id": "s", "token_ids": [' + b"2147483647," * ((1 << 20) - 1)
                 + b"1.5]}"]  # 11 MiB: the last of 1M ids is bad
        for body in cases:
            t0 = time.perf_counter()
            resp = client.post(f"{served.url}/v1/route", headers=ACME, content=body)
            took = time.perf_counter() - t0
            assert resp.status_code == 422, resp.text[:300]
            data = resp.json()
            assert 1 <= len(data["errors"]) <= 20 and len(resp.content) < 8192, data
            # the 11 MiB body costs what a valid call of 1M ids costs: read whole
            assert took < (1.0 if body is not cases[2] else 10.0), (len(body), took)
            print(f"{len(body) / MIB:.1f} MiB: 422 in {took * 1e3:.0f} ms, "
                  f"{len(data['errors'])} errors, {data['detail'][:120]}")
        after = served.rss_mib()
    print(f"server RSS {before:.0f} -> {after:.0f} MiB")
    assert after - before < 64, (before, after)
    assert [e["loc"] for e in data["errors"]] == [f"token_ids.{(1 << 20) - 1}"]
    second = client_errors(served, cases[1])
    assert [e["loc"] for e in second["errors"]] == [f"token_ids.{i}" for i in range(20)]
    assert "and more" in second["detail"]


def client_errors(served: Served, body: bytes) -> Any:
    return httpx.post(f"{served.url}/v1/route", headers=ACME, content=body, timeout=30).json()


@pytest.mark.servers
def test_a_large_valid_body_is_served(served: Served) -> None:
    ids = list(range(1 << 20))
    resp = httpx.post(f"{served.url}/v1/route", headers=GLOBEX, timeout=30,
                      content=json.dumps({"session_id": "big", "token_ids": ids}))
    assert resp.status_code == 200, resp.text[:300]
    bad = json.dumps({"session_id": "big", "token_ids": [*ids[:200_000], 1 << 40, True]})
    resp = httpx.post(f"{served.url}/v1/route", headers=GLOBEX, content=bad, timeout=30)
    assert resp.status_code == 422
    assert [e["loc"] for e in resp.json()["errors"]] == ["token_ids.200000", "token_ids.200001"]


@pytest.mark.servers
def test_another_tenants_route_latency_holds_while_bad_bodies_arrive() -> None:
    """globex's route p99 while acme sends bad bodies as fast as three clients can, against
    its p99 with acme quiet, side by side: quiet and attacked phases alternate in rounds on
    one server, and the medians of the rounds' p99s are compared (a load spike from
    elsewhere on the host moves one round, not the median). acme's clients run in
    processes of their own at the lowest CPU priority, as other hosts would: in this
    process they would hold its interpreter lock against globex's client, and at equal
    priority the CPU they spend sending would be taken from the server (on loopback the
    sender's CPU carries most of the transfer). The attacked phases begin once acme's
    refusal budget is spent (its first ``refused_body_burst_bytes`` of bad bodies are read
    and refused with their errors; later ones mostly wait for their 429)."""
    bodies = [bad_tokens(16 * MIB - 1024), bad_tokens(2 * MIB),
              bad_tokens(4 * MIB, b"[]"), b'{"session_id": "s", "token_ids": ["' + b"x" * 8 * MIB
              + b'"]}']
    fork = multiprocessing.get_context("fork")
    attacking, engaged, stop = fork.Event(), fork.Event(), fork.Event()
    results: Any = fork.Queue()
    with serve() as srv, httpx.Client(timeout=30) as client:
        senders = [fork.Process(target=_send_bad, args=(srv.url, bodies, k, attacking, engaged,
                                                        stop, results), daemon=True)
                   for k in range(3)]
        for p in senders:
            p.start()
        try:
            for i in range(50):
                _route(srv.url, client, GLOBEX, i)
            attacking.set()
            engaged.wait(10)  # acme's budget is spent (asserted below by its 429s)
            attacking.clear()
            quiet_p99, attacked_p99 = [], []
            for r in range(ROUNDS):
                time.sleep(0.2)  # acme's bodies in flight are answered
                quiet_p99.append(_p99([_route(srv.url, client, GLOBEX, i)
                                       for i in range(SAMPLES)]))
                attacking.set()
                time.sleep(0.2)
                attacked_p99.append(_p99([_route(srv.url, client, GLOBEX, 10_000 * r + i)
                                          for i in range(SAMPLES)]))
                attacking.clear()
            # acme's small calls are served meanwhile; its large ones wait for their turn
            small = client.post(f"{srv.url}/v1/route", headers=ACME,
                                content=b'{"session_id": "s", "input_tokens": 1}')
            large = client.post(f"{srv.url}/v1/route", headers=ACME,
                                content=json.dumps({"session_id": "s",
                                                    "token_ids": list(range(20_000))}))
        finally:
            stop.set()
            attacking.set()
            counts = [results.get(timeout=60) for _ in senders]
            for p in senders:
                p.join(timeout=30)
    sent = sum(n for n, _ in counts)
    statuses = set().union(*(s for _, s in counts))
    base, under = statistics.median(quiet_p99), statistics.median(attacked_p99)
    rounds = ", ".join(f"{q * 1e3:.1f}/{a * 1e3:.1f}"
                       for q, a in zip(quiet_p99, attacked_p99, strict=True))
    print(f"globex route p99 {base * 1e3:.1f} ms quiet, {under * 1e3:.1f} ms while acme sent "
          f"{sent} bad bodies ({sorted(statuses)}); rounds quiet/attacked (ms): {rounds}")
    assert small.status_code == 200, small.text
    assert large.status_code == 429 and int(large.headers["retry-after"]) >= 1, large.text
    assert {422, 429} <= statuses <= {422, 429, 0} and sent >= 20, (sent, statuses)
    # Within 2x, or 10 ms: a quiet route takes about 2 ms here, and on a 2-core host the
    # attackers' processes share the cores with the server, so the p99 moves by a few
    # scheduler time slices whatever the server does (an unprotected server's p99 grows
    # tens of times).
    assert under <= max(2 * base, base + 0.010), (quiet_p99, attacked_p99)


ROUNDS, SAMPLES = 5, 200


def _send_bad(url: str, bodies: list[bytes], k: int, attacking: Any, engaged: Any,
              stop: Any, results: Any) -> None:
    """acme's client: sends ``bodies`` in turn while ``attacking`` is set, until ``stop``;
    sets ``engaged`` at a 429 and puts (bodies sent, statuses) on ``results`` at the end
    (status 0: the server closed the connection before it took the body)."""
    os.nice(19)
    sent, statuses = 0, set()
    with httpx.Client(timeout=30) as bad:
        while not stop.is_set():
            if not attacking.wait(0.1):
                continue
            try:
                status = bad.post(f"{url}/v1/route", headers=ACME,
                                  content=bodies[(k + sent) % len(bodies)]).status_code
            except httpx.TransportError:
                status = 0
            statuses.add(status)
            sent += 1
            if status == 429:
                engaged.set()
            time.sleep(0.05)  # each client: up to ~20 bad bodies a second
    results.put((sent, statuses))


def test_a_refusal_budget_holds_a_caller_back_until_it_has_refilled() -> None:
    budget = RefusalBudget(burst_bytes=10, bytes_per_s=2, now=0.0)
    assert budget.wait_s(0.0) == 0
    budget.charge(16, 0.0)  # 6 bytes in debt: back above 0 after 3 s
    assert budget.wait_s(0.0) == pytest.approx(3.5)
    assert budget.wait_s(3.0) > 0 and budget.wait_s(3.6) == 0
    budget.charge(1, 100.0)  # refilled to the burst, not past it
    assert budget.wait_s(100.0) == 0
    budget.charge(9, 100.0)
    assert budget.wait_s(100.0) == pytest.approx(0.5)


@pytest.mark.servers
def test_without_a_token_the_body_is_not_read(served: Served) -> None:
    before = served.rss_mib()
    with socket.create_connection(served.address, timeout=5) as sock:
        # 16 MiB declared, none of it sent: the answer cannot have waited for the body
        sock.sendall(b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: " + str(16 * MIB).encode() + b"\r\n\r\n")
        t0 = time.perf_counter()
        answer = answer_head(sock)
        took = time.perf_counter() - t0
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert took < 0.5
    body = b"{}," * (16 * MIB // 3 - 10)
    t0 = time.perf_counter()
    try:
        status = httpx.post(f"{served.url}/v1/route", content=b"[" + body + b"{}]",
                            headers={"Content-Type": "application/json"}, timeout=10).status_code
    except httpx.TransportError:  # the server closed before taking the rest of the body
        status = 401
    took = time.perf_counter() - t0
    after = served.rss_mib()
    print(f"16 MiB without a token: {status} in {took * 1e3:.0f} ms, server RSS "
          f"{before:.0f} -> {after:.0f} MiB")
    assert status == 401 and took < 1.0 and after - before < 16



@pytest.mark.servers
def test_a_slow_upload_is_cut_off_and_connections_over_the_cap_are_refused() -> None:
    with serve(body_read_timeout_s=3, min_body_rate_bytes_per_s=1024, body_rate_grace_s=1,
               max_connections=4) as srv:
        head = (b"POST /v1/route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + TOKENS["acme"].encode()
                + b"\r\nContent-Length: 100000\r\n\r\n")
        slow = socket.create_connection(srv.address, timeout=10)
        slow.sendall(head + b'{"session_id": "s", "token_ids": [')
        t0 = time.perf_counter()
        answer = b""
        slow.settimeout(0.3)
        while time.perf_counter() - t0 < 8:  # a few bytes a second: below 1 KiB/s
            try:
                slow.sendall(b"1, ")
            except OSError:
                break
            try:
                chunk = slow.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            answer += chunk
        took = time.perf_counter() - t0
        slow.close()
        print(f"slow upload cut off after {took:.1f} s: {answer[:40]!r}")
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert 0.9 < took < 2.5, took

        # connections holding bodies in progress, more than the cap: calls are refused
        holders = []
        for _ in range(6):
            s = socket.create_connection(srv.address, timeout=5)
            s.sendall(head + b'{"session_id": "s", ')
            holders.append(s)
            time.sleep(0.05)
        refused = httpx.post(f"{srv.url}/v1/route", headers=ACME, timeout=5,
                             content=b'{"session_id": "s", "input_tokens": 1}')
        assert refused.status_code == 503, refused.text
        early = []
        for s in holders:
            s.settimeout(0.5)
            try:
                early.append(s.recv(4096))
            except TimeoutError:
                early.append(b"")
            s.close()
        assert sum(a.startswith(b"HTTP/1.1 503") for a in early) >= 2, early
        time.sleep(0.3)
        ok = httpx.post(f"{srv.url}/v1/route", headers=ACME, timeout=5,
                        content=b'{"session_id": "s", "input_tokens": 1}')
        assert ok.status_code == 200, ok.text
