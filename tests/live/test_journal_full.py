"""A journal that fails closed: when the journal cannot be written (a full disk, a file-size
limit), a call that records an event answers 503 with a short message, changes nothing
(no session opened, no quota held) and is never replayed after a restart; ``/healthz``
says the journal is unwritable until space returns. The full disk is a file wrapper whose
writes fail with ENOSPC on demand (after a short write, as a real disk does), injected
through the writer's opener; one test lowers a real RLIMIT_FSIZE under a service running
in a child process."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvprefetch.controlplane.base.config import fleet_from_dict
from kvprefetch.controlplane.base.errors import JournalUnavailableError
from kvprefetch.controlplane.journal.live import LiveJournalScanner
from kvprefetch.controlplane.journal.writer import JournalFile, open_journal_file
from kvprefetch.controlplane.live.config import ServiceConfig
from kvprefetch.controlplane.live.connect import connect
from kvprefetch.controlplane.live.service import SchedulerService

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvprefetch.controlplane.live.http_api import HttpServer, create_app  # noqa: E402

GIB = 1 << 30
FLEET = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 8 * GIB}})


class FullDisk:
    """Opens the journal like the service does; while :attr:`full`, a write puts
    :attr:`partial_bytes` bytes down (a short write) and the next one fails with ENOSPC."""

    def __init__(self) -> None:
        self.full = False
        self.partial_bytes = 37
        self.refused = 0

    def __call__(self, path: Path) -> JournalFile:
        return _FullDiskFile(open_journal_file(path), self)


@dataclass
class _FullDiskFile:
    real: JournalFile
    disk: FullDisk
    _short: bool = False

    def write(self, data: bytes | memoryview, /) -> int | None:
        if not self.disk.full:
            return self.real.write(data)
        if not self._short and self.disk.partial_bytes and len(data) > 1:
            self._short = True
            return self.real.write(bytes(data)[: min(self.disk.partial_bytes, len(data) - 1)])
        self._short = False
        self.disk.refused += 1
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def truncate(self, size: int, /) -> int:
        return self.real.truncate(size)

    def fileno(self) -> int:
        return self.real.fileno()

    def close(self) -> None:
        self.real.close()


def _config(path: Path, **kw: Any) -> ServiceConfig:
    return ServiceConfig(fleet=FLEET, journal_path=str(path), **kw)


@dataclass
class Served:
    service: SchedulerService
    disk: FullDisk
    url: str
    journal: Path

    def post(self, op: str, **body: Any) -> Any:
        return httpx.post(f"{self.url}/v1/{op}", json={"tenant": "acme", **body}, timeout=5)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    disk = FullDisk()
    path = tmp_path / "journal.jsonl"
    svc = SchedulerService(_config(path, max_live_sessions_per_tenant=2),
                           journal_opener=disk).start()
    try:
        app = create_app(svc, bearer_token=None, health_check=svc.check_health)
        with HttpServer(app) as srv:
            yield Served(svc, disk, srv.url, path)
    finally:
        svc.close()


def _assert_short_503(resp: Any, journal: Path) -> None:
    assert resp.status_code == 503, resp.text
    body = resp.json()
    assert body["error"] == "JournalUnavailableError"
    assert "No space left on device" in body["detail"]
    for leak in ("Traceback", "File ", str(journal.parent), "pid", "/"):
        assert leak not in resp.text, (leak, resp.text)


def test_a_full_journal_answers_503_changes_nothing_and_is_never_replayed(
        served: Served) -> None:
    assert served.journal.stat().st_mode & 0o777 == 0o600
    assert served.post("route", session_id="kept", input_tokens=1000).status_code == 200
    assert served.post("request_finished", session_id="kept", node=0, input_tokens=1000,
                       output_tokens=20, context_tokens=1020).status_code == 200
    size = served.journal.stat().st_size
    sessions, per_tenant = served.service.sessions(), dict(served.service.registry.per_tenant)

    served.disk.full = True
    _assert_short_503(served.post("route", session_id="lost", input_tokens=500),
                      served.journal)
    _assert_short_503(served.post("request_started", session_id="lost2", input_tokens=5),
                      served.journal)
    _assert_short_503(served.post("route", session_id="kept", input_tokens=2000),
                      served.journal)
    _assert_short_503(served.post("hint", session_id="kept", hint={"kind": "user_typing"}),
                      served.journal)
    _assert_short_503(served.post("session_closed", session_id="kept"), served.journal)
    health = httpx.get(f"{served.url}/healthz", timeout=5)
    assert health.status_code == 503 and "journal" in health.json()["detail"]
    assert "/" not in health.json()["detail"]

    # Nothing changed: no session opened, no quota held, no turn counted, no bytes kept
    # (each failed write was cut away, the short write's bytes included).
    assert served.disk.refused >= 5
    assert served.service.sessions() == sessions
    assert dict(served.service.registry.per_tenant) == per_tenant
    assert not served.service.has_session("acme", "lost")
    kept = served.post("session_state", session_id="kept").json()
    assert kept["turns"] == 1 and not kept["in_flight"]
    assert served.service.stats.events == 2
    assert served.journal.stat().st_size == size

    # Space returns: health says so (a probe, no call needed) and calls go through; the
    # quota of two holds "kept" and one more: "lost" holds none.
    served.disk.full = False
    assert httpx.get(f"{served.url}/healthz", timeout=5).status_code == 200
    assert served.journal.stat().st_size == size  # the probe left nothing behind
    assert served.post("route", session_id="after", input_tokens=700).status_code == 200
    served.service.close()

    # The journal: numbers without a gap, a clean stop, nothing of the refused calls.
    scan = LiveJournalScanner(served.journal)
    sessions_seen = {event.session_id for _, event in scan}
    assert not scan.damaged and scan.lost() == [] and scan.stopped
    assert sessions_seen == {"acme/kept", "acme/after"}

    with SchedulerService(_config(served.journal)) as again:
        assert not again.has_session("acme", "lost") and not again.has_session("acme", "lost2")
        assert again.has_session("acme", "kept") and again.has_session("acme", "after")
        info = again.registry.by_sid("acme/kept")
        assert info is not None and info.turns == 1 and not info.in_flight


def test_a_write_that_cannot_be_cut_back_blocks_appends_until_it_can(
        tmp_path: Path) -> None:
    """A failed write whose bytes cannot be truncated away (yet) must not be buried under
    the next record: appending stays refused until the cut succeeds."""
    disk = FullDisk()
    path = tmp_path / "journal.jsonl"
    svc = SchedulerService(_config(path), journal_opener=disk).start()
    c = connect(service=svc, tenant="acme")
    c.route("a", input_tokens=100)
    size = path.stat().st_size
    journal = svc.journal.writer
    assert journal is not None
    real_truncate = _FullDiskFile.truncate
    _FullDiskFile.truncate = lambda self, n: (_ for _ in ()).throw(  # type: ignore[method-assign]
        OSError(errno.EIO, "I/O error"))
    try:
        disk.full = True
        with pytest.raises(JournalUnavailableError):
            c.route("b", input_tokens=100)
        disk.full = False
        assert path.stat().st_size == size + disk.partial_bytes  # the short write's bytes
        with pytest.raises(JournalUnavailableError):
            c.route("c", input_tokens=100)
        assert path.stat().st_size == size + disk.partial_bytes
    finally:
        _FullDiskFile.truncate = real_truncate  # type: ignore[method-assign]
    c.route("d", input_tokens=100)
    svc.close()
    scan = LiveJournalScanner(path)
    assert {e.session_id for _, e in scan} == {"acme/a", "acme/d"}
    assert not scan.damaged and scan.lost() == []


CHILD = textwrap.dedent("""
    import json, resource, signal, sys
    from kvprefetch.controlplane.base.config import fleet_from_dict
    from kvprefetch.controlplane.base.errors import JournalUnavailableError
    from kvprefetch.controlplane.live.connect import connect
    from kvprefetch.controlplane.live.config import ServiceConfig
    from kvprefetch.controlplane.live.service import SchedulerService
    from pathlib import Path

    path = Path(sys.argv[1])
    fleet = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 << 30,
                                                  "dram_tier_bytes": 8 << 30}})
    svc = SchedulerService(ServiceConfig(fleet=fleet, journal_path=str(path))).start()
    c = connect(service=svc, tenant="acme")
    ans = c.route("kept", input_tokens=1000)
    c.request_finished("kept", node=ans.node or 0, input_tokens=1000, context_tokens=1020)
    out = {"size": path.stat().st_size, "sessions": svc.sessions()}
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    # Room for part of a record: the write is short, then fails with EFBIG.
    resource.setrlimit(resource.RLIMIT_FSIZE, (out["size"] + 40, hard))
    refused = []
    for name, call in [("route", lambda: c.route("lost", input_tokens=500)),
                       ("finish", lambda: c.request_finished("kept", node=0,
                                                            input_tokens=1000)),
                       ("close", lambda: c.session_closed("kept"))]:
        try:
            call()
        except JournalUnavailableError as exc:
            refused.append([name, str(exc)])
    health = None
    try:
        svc.check_health()
    except JournalUnavailableError as exc:
        health = str(exc)
    out.update(refused=refused, health=health, size_full=path.stat().st_size,
               sessions_full=svc.sessions(), lost_known=svc.has_session("acme", "lost"))
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    svc.check_health()
    c.route("after", input_tokens=700)
    svc.close()
    print(json.dumps(out))
""")


def test_a_real_file_size_limit_fails_closed(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    done = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert [name for name, _ in out["refused"]] == ["route", "finish", "close"]
    for _, message in out["refused"]:
        assert "File too large" in message and "/" not in message
    assert out["health"] is not None and "journal" in out["health"]
    assert out["size_full"] == out["size"]  # the short writes were cut away
    assert out["sessions_full"] == out["sessions"] == 1 and not out["lost_known"]
    assert "cannot write" in done.stderr  # the details (path, errno) went to the log

    with SchedulerService(_config(path)) as again:
        assert not again.has_session("acme", "lost")
        assert again.has_session("acme", "kept") and again.has_session("acme", "after")
        info = again.registry.by_sid("acme/kept")
        assert info is not None and info.turns == 1 and not info.in_flight
