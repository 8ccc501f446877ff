"""Ray runtimes for the tests, always torn down: a local one (one raylet, per-node custom
resources) and a real two-raylet cluster on this machine (127.0.0.2 and 127.0.0.3, with
token auth, which two raylets on one machine need; docs/architecture.md lists the setup).
Processes of the two-raylet cluster are found by the private temp dir given to
``ray start`` and ended by pid (never by name)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kvprefetch.agents.embedded import free_port

MIB = 1 << 20


def _ray_cli() -> str:
    return str(Path(sys.executable).parent / "ray")


def _pids_under(temp_dir: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if temp_dir in cmd and int(proc.name) != os.getpid():
            pids.append(int(proc.name))
    return pids


def _end(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.time() + 5
    while time.time() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def two_raylets(resources: tuple[dict[str, float], dict[str, float]]) -> Iterator[str]:
    """Start a head raylet on 127.0.0.2 and a worker raylet on 127.0.0.3; yield the
    address. Everything is stopped on exit."""
    temp = tempfile.mkdtemp(prefix="kvpray", dir="/tmp")
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
    port = free_port()
    common = ["--num-cpus=1", f"--object-store-memory={80 * MIB}", f"--memory={1 << 30}",
              "--disable-usage-stats"]
    head = [_ray_cli(), "start", "--head", "--node-ip-address=127.0.0.2", f"--port={port}",
            f"--temp-dir={temp}", "--include-dashboard=false",
            f"--resources={json.dumps(resources[0])}", *common]
    worker = [_ray_cli(), "start", f"--address=127.0.0.2:{port}", "--node-ip-address=127.0.0.3",
              f"--resources={json.dumps(resources[1])}", *common]
    try:
        subprocess.run(head, check=True, env=env, capture_output=True, timeout=120)
        subprocess.run(worker, check=True, env=env, capture_output=True, timeout=120)
        # The driver finds the token the raylets use (~/.ray/auth_token) and turns token
        # auth on by itself when RAY_AUTH_MODE is unset.
        yield f"127.0.0.2:{port}"
    finally:
        _end(_pids_under(temp))
        subprocess.run(["rm", "-rf", temp], check=False)
