"""Per-caller call rates against a real server in a process of its own
(tests/live/edge_server.py): a tenant past its rate is answered 429 with ``Retry-After``,
the number of its calls served follows the token bucket, and its flood leaves another
tenant's route latency within 2x of its quiet value."""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_http_edge import ACME, GLOBEX, _p99, _route, serve  # noqa: E402

pytestmark = pytest.mark.servers

ROUNDS, SAMPLES = 5, 200
ACME_RATE, BURST = 50, 20


def _flood(url: str, k: int, attacking: Any, stop: Any, results: Any) -> None:
    """acme's client: small valid routes back to back while ``attacking`` is set, until
    ``stop``; puts (status counts, seconds attacked, Retry-After values seen) on
    ``results``."""
    os.nice(19)
    counts: dict[int, int] = {}
    retry_after: set[str] = set()
    attacked_s = 0.0
    with httpx.Client(timeout=30) as client:
        i = 0
        while not stop.is_set():
            if not attacking.wait(0.1):
                continue
            t0 = time.perf_counter()
            while attacking.is_set() and not stop.is_set():
                try:
                    resp = client.post(f"{url}/v1/route", headers=ACME,
                                       content=f'{{"session_id": "f{k}-{i}", '
                                               f'"input_tokens": 100}}')
                    status = resp.status_code
                    if status == 429:
                        retry_after.add(resp.headers.get("retry-after", ""))
                except httpx.TransportError:
                    status = 0
                counts[status] = counts.get(status, 0) + 1
                i += 1
            attacked_s += time.perf_counter() - t0
    results.put((counts, attacked_s, retry_after))


def test_a_tenant_flooding_past_its_rate_leaves_another_tenants_latency() -> None:
    """acme (rate 50 calls/s, burst 20) floods from three processes while globex (no
    limit) routes: quiet and flooded phases alternate in rounds, the medians of the rounds'
    p99s are compared; acme's calls served stay within its bucket and the rest get 429
    with ``Retry-After``."""
    fork = multiprocessing.get_context("fork")
    attacking, stop = fork.Event(), fork.Event()
    results: Any = fork.Queue()
    quiet, flooded = [], []
    with serve(tenant_rate_limits_calls_per_s={"acme": ACME_RATE},
               rate_limit_burst_calls=BURST) as srv, httpx.Client(timeout=30) as client:
        floods = [fork.Process(target=_flood, args=(srv.url, k, attacking, stop, results))
                  for k in range(3)]
        for p in floods:
            p.start()
        try:
            for i in range(50):
                _route(srv.url, client, GLOBEX, i)
            for r in range(ROUNDS):
                time.sleep(0.2)
                quiet.append(_p99([_route(srv.url, client, GLOBEX, 1000 * r + i)
                                   for i in range(SAMPLES)]))
                attacking.set()
                time.sleep(0.2)
                flooded.append(_p99([_route(srv.url, client, GLOBEX, 100_000 * (r + 1) + i)
                                     for i in range(SAMPLES)]))
                attacking.clear()
        finally:
            stop.set()
            attacking.set()
            out = [results.get(timeout=60) for _ in floods]
            for p in floods:
                p.join(timeout=30)
    counts: dict[int, int] = {}
    for c, _, _ in out:
        for status, n in c.items():
            counts[status] = counts.get(status, 0) + n
    attacked_s = max(s for _, s, _ in out)
    retry_after = set().union(*(r for _, _, r in out))
    base, under = statistics.median(quiet), statistics.median(flooded)
    print(f"globex route p99 {base * 1e3:.1f} ms quiet, {under * 1e3:.1f} ms while acme "
          f"flooded ({counts} in {attacked_s:.1f} s, {sum(counts.values()) / attacked_s:.0f} "
          f"calls/s); rounds quiet {[round(q * 1e3, 1) for q in quiet]} ms, flooded "
          f"{[round(f * 1e3, 1) for f in flooded]} ms")
    assert set(counts) <= {200, 429}, counts
    # the bucket: its burst once per round (refilled while quiet), then its rate
    assert counts.get(200, 0) <= ROUNDS * BURST + ACME_RATE * attacked_s * 1.2 + 10, counts
    assert counts.get(429, 0) > counts.get(200, 0), counts
    assert retry_after == {"1"}, retry_after
    assert under <= 2 * base + 0.002, (quiet, flooded)


def test_a_tenants_rate_replaces_the_default_and_the_bucket_refills() -> None:
    with serve(rate_limit_calls_per_s=1000, tenant_rate_limits_calls_per_s={"acme": 2},
               rate_limit_burst_calls=3) as srv, httpx.Client(timeout=10) as client:
        def call(headers: dict[str, str], i: int) -> int:
            return client.post(f"{srv.url}/v1/route", headers=headers,
                               content=f'{{"session_id": "r{i}", "input_tokens": 1}}'
                               ).status_code

        acme = [call(ACME, i) for i in range(5)]
        globex = [call(GLOBEX, i) for i in range(3)]
        time.sleep(1.1)  # two calls' worth refilled at 2 calls/s
        refilled = [call(ACME, 10 + i) for i in range(3)]
    assert acme == [200, 200, 200, 429, 429], acme
    assert globex == [200, 200, 200], globex
    assert refilled == [200, 200, 429], refilled
