"""Numbers no call carries, against a real server in a process of its own
(tests/live/edge_server.py): an integer of thousands of digits in any numeric field is
refused with 422 naming the field (no 500, nothing logged), is charged to the caller's
refused-body budget (its large bodies then wait for their 429), and a flood of them leaves
the server's memory where it was."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_http_edge import ACME, GLOBEX, MIB, SERVER, Served  # noqa: E402

pytestmark = pytest.mark.servers

HUGE = "9" * 5000  # past the 4,300 digits Python decodes as an int


@contextmanager
def serve_logged(log: Path, **limits: Any) -> Iterator[Served]:
    """edge_server.py with its stderr (uvicorn's and the app's log) in ``log``."""
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, str(SERVER), json.dumps(limits)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                text=True, cwd=SERVER.parent)
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


#: (operation, body with a huge number, the field a 422 names)
CASES = [
    ("route", f'{{"session_id": "s", "input_tokens": {HUGE}}}', "input_tokens"),
    ("route", f'{{"session_id": "s", "token_ids": [1, 2, {HUGE}]}}', "token_ids"),
    ("route", f'{{"session_id": "s", "input_tokens": 3, "reused_tokens": {HUGE}}}',
     "reused_tokens"),
    ("request_started", f'{{"session_id": "s", "input_tokens": -{HUGE}}}', "input_tokens"),
    ("request_finished", f'{{"session_id": "s", "node": {HUGE}, "input_tokens": 1}}', "node"),
    ("request_finished", f'{{"session_id": "s", "node": 0, "input_tokens": 1, '
                         f'"output_tokens": {HUGE}.5e3}}', "output_tokens"),
    ("hint", f'{{"session_id": "s", "hint": {{"kind": "user_typing", "eta_s": {HUGE}}}}}',
     "eta_s"),
]


def test_huge_numbers_are_refused_with_422_charged_and_not_logged(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with serve_logged(log, refused_body_burst_bytes=64 * 1024,
                      refused_body_bytes_per_s=1) as srv, httpx.Client(timeout=10) as client:
        answers = [(client.post(f"{srv.url}/v1/{op}", headers=ACME, content=body), field)
                   for op, body, field in CASES]
        # acme's refused small bodies spent its budget: its large bodies now wait
        spent = 0
        while spent < 64 * 1024:
            refused = client.post(f"{srv.url}/v1/route", headers=ACME, content=CASES[0][1])
            assert refused.status_code == 422, refused.text
            spent += len(CASES[0][1])
        large = json.dumps({"session_id": "s", "token_ids": list(range(20_000))})
        held = client.post(f"{srv.url}/v1/route", headers=ACME, content=large)
        other = client.post(f"{srv.url}/v1/route", headers=GLOBEX, content=large)
    for resp, field in answers:
        assert resp.status_code == 422, resp.text
        assert resp.json()["errors"][0]["loc"] == field, resp.text
    assert held.status_code == 429 and int(held.headers["retry-after"]) >= 1, held.text
    assert other.status_code == 200, other.text
    logged = log.read_text()
    assert "Traceback" not in logged and "Exception" not in logged, logged[-2000:]


def test_a_flood_of_huge_numbers_leaves_memory_at_its_baseline(tmp_path: Path) -> None:
    """Two clients send 15 MiB bodies of 5,000-digit integers for 8 s; the server's RSS
    after the flood is within 64 MiB of its RSS before."""
    item = HUGE.encode()
    body = b'{"session_id": "s", "token_ids": [' + b",".join(
        [item] * (15 * MIB // (len(item) + 1))) + b"]}"
    statuses: list[int] = []

    def flood(url: str, until: float) -> None:
        with httpx.Client(timeout=30) as c:
            while time.monotonic() < until:
                try:
                    statuses.append(c.post(f"{url}/v1/route", headers=ACME,
                                           content=body).status_code)
                except httpx.TransportError:
                    statuses.append(0)

    with serve_logged(tmp_path / "server.log") as srv:
        httpx.get(f"{srv.url}/healthz", timeout=10)
        before = srv.rss_mib()
        until = time.monotonic() + 8
        threads = [threading.Thread(target=flood, args=(srv.url, until)) for _ in range(2)]
        for t in threads:
            t.start()
        peak = before
        while any(t.is_alive() for t in threads):
            peak = max(peak, srv.rss_mib())
            time.sleep(0.1)
        for t in threads:
            t.join()
        time.sleep(1.0)
        after = srv.rss_mib()
    counts = {s: statuses.count(s) for s in sorted(set(statuses))}
    print(f"{len(statuses)} bodies of 15 MiB of 5,000-digit integers: {counts}; server RSS "
          f"{before:.0f} MiB before, peak {peak:.0f}, {after:.0f} after")
    assert set(counts) <= {422, 429} and counts.get(422, 0) >= 2, counts
    assert after - before < 64, (before, peak, after)
