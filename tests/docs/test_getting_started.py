"""The getting-started page run as a newcomer runs it: its code blocks in order, as
written, in an empty folder, with nothing but this package and its extras (the embedded
Valkey and S3 of ``kvprefetch serve --embedded``, a local Ray runtime): ``init``, the
token, ``serve --check``, ``serve`` until ready, and the Python client's calls to it; then
the hints guide's blocks against that server (the client's calls, the same over curl).
Blocks that install packages or run for minutes carry their reason on the page."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from pages import blocks, script

pytest.importorskip("ray")
pytest.importorskip("valkey")

pytestmark = pytest.mark.servers
PAGE = "getting-started.md"
HINTS = "guides/hints.md"
HTTP_PORT = 8000


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pids_under(fragment: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            with contextlib.suppress(OSError):
                if fragment in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(proc.name))
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _stop(pid: int, timeout_s: float = 60.0) -> None:
    """SIGTERM, as Ctrl-C would stop it; SIGKILL if it is still up after ``timeout_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_every_block_is_run_or_says_why_not() -> None:
    page = blocks(PAGE)
    run = [b for b in page if b.skip is None]
    assert all(b.lang in ("bash", "python") for b in run)
    assert all(b.skip for b in page if b.skip is not None)  # a reason, not an empty mark
    text = "".join(b.code for b in run)
    assert "kvprefetch serve --config kvp/serve.yaml --embedded\n" in text
    assert "KVPREFETCH_API_TOKEN" in text and "connect(" in text


def test_the_page_runs_as_written(tmp_path: Path) -> None:
    page = blocks(PAGE) + blocks(HINTS)
    work = tmp_path / "newcomer"
    work.mkdir()
    # curl reads ~/.curlrc: each call's HTTP status after its body, the commands as written
    (work / ".curlrc").write_text('write-out = "\\n%{http_code}\\n"\n')
    text = script(page, work)
    if not _port_free(HTTP_PORT):  # a shared machine: the page's port is another's
        from kvprefetch.agents.embedded import free_port

        port = free_port()
        text = text.replace("kvprefetch init kvp", "kvprefetch init kvp && sed -i "
                            f"'s/^  port: {HTTP_PORT}/  port: {port}/' kvp/serve.yaml")
        for f in work.glob("block-*.py"):
            f.write_text(f.read_text().replace(f":{HTTP_PORT}", f":{port}"))
    ray_tmp = tempfile.mkdtemp(prefix="kvpg", dir="/tmp")  # short: Ray's socket paths
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0", "HOME": str(work)}
    env.pop("KVPREFETCH_API_TOKEN", None)
    (work / "page.sh").write_text(text)
    try:
        done = subprocess.run(["bash", "page.sh"], cwd=work, capture_output=True, text=True,
                              timeout=600, env=env)
    finally:
        pid_file = work / "serve.pid"
        if pid_file.exists():
            _stop(int(pid_file.read_text()))
        leftovers = _pids_under(ray_tmp)
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    serve_log = (work / "serve.log").read_text() if (work / "serve.log").exists() else ""
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:], serve_log[-3000:])
    out = done.stdout
    assert "files written" in out  # init
    assert out.count("kvprefetch serve --check: ok ") == 5, out
    assert "run on node 0 " in out and "finish accepted: True" in out and "closed: True" in out
    statuses = [line for line in out.splitlines() if re.fullmatch(r"\d{3}", line)]
    calls = sum(line.lstrip().startswith("curl ") for b in blocks(HINTS) if not b.skip
                for line in b.code.splitlines())
    assert calls >= 6 and statuses == ["200"] * calls, out  # every curl call of the hints guide
    assert "kvprefetch serve: ready, 1 agents" in serve_log
    assert "kvprefetch serve stopped" in serve_log, serve_log[-3000:]
    assert (work / "kvp" / "journal.jsonl").stat().st_size > 0
    assert not Path("/dev/shm/kvprefetch-0").exists()  # the embedded tier goes with serve
    assert not leftovers, f"processes left running after serve stopped: {leftovers}"
