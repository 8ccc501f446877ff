"""A real LMCache multiprocess server (``lmcache server``) on loopback, for one emulated node.

:class:`LMCacheServer` starts the server from the installed ``lmcache`` package with its
request port (ZMQ), its HTTP port and its Prometheus port all chosen free, waits until
``GET /status`` answers, and stops it (terminate, then kill). It is what the tests, the
benchmark and ``kvprefetch demo --backend lmcache-mp`` use; on a GPU node the same command
line is started by ``examples/gpu_check.sh`` next to vLLM.

The L2 adapter is given as LMCache's own JSON (``{"type": "valkey", ...}`` or our plugin,
see :func:`kvprefetch.agents.lmcache.l2.adapter.plugin_adapter_json`). Constructors do no I/O.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from kvprefetch.agents.embedded import ServerProcess, free_port
from kvprefetch.agents.stores.errors import StoreConfigError, StoreConnectionError

log = logging.getLogger(__name__)

TransferMode = Literal["lmcache_driven", "engine_driven", "auto"]


def find_lmcache() -> str:
    """The ``lmcache`` command next to this Python, else from PATH."""
    beside = Path(sys.executable).parent / "lmcache"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("lmcache")
    if found:
        return found
    raise StoreConfigError("the lmcache command was not found: pip install 'kvprefetch[lmcache]'")


class LMCacheServer(ServerProcess):
    """A private ``lmcache server`` on loopback."""

    _stop_timeout_s = 15.0

    def __init__(
        self,
        *,
        l2_adapter: dict[str, Any] | None = None,
        chunk_size: int = 256,
        l1_size_gb: float = 0.5,
        hash_algorithm: str = "blake3",
        transfer_mode: TransferMode = "auto",
        eviction_policy: str = "LRU",
        shm_name: str | None = "auto",
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        if chunk_size <= 0:
            raise StoreConfigError(f"chunk_size must be positive, got {chunk_size}")
        if l1_size_gb <= 0:
            raise StoreConfigError(f"l1_size_gb must be positive, got {l1_size_gb}")
        self.host = "127.0.0.1"
        self.port = 0
        self.http_port = 0
        self.prometheus_port = 0
        self.l2_adapter = l2_adapter
        self.chunk_size = chunk_size
        self.l1_size_gb = l1_size_gb
        self.hash_algorithm = hash_algorithm
        self.transfer_mode = transfer_mode
        self.eviction_policy = eviction_policy
        #: L1's shared-memory pool, which engine-driven clients map (without one their KV
        #: travels pickled in the ZMQ messages); "auto" = a name unique to this server.
        self.shm_name = f"kvp-{uuid.uuid4().hex[:12]}" if shm_name == "auto" else shm_name
        self._extra = extra_args
        self._env = env or {}
        self._timeout = start_timeout_s
        self._same_ports = False

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def log_path(self) -> Path | None:
        return self._dir / "lmcache.log" if self._dir else None

    def command(self) -> list[str]:
        """The command line (ports must have been chosen: ``start`` does that)."""
        args = [
            find_lmcache(), "server", "--host", self.host, "--port", str(self.port),
            "--http-host", self.host, "--http-port", str(self.http_port),
            "--prometheus-port", str(self.prometheus_port),
            "--chunk-size", str(self.chunk_size), "--l1-size-gb", str(self.l1_size_gb),
            "--eviction-policy", self.eviction_policy, "--hash-algorithm", self.hash_algorithm,
            "--supported-transfer-mode", self.transfer_mode,
        ]
        if self.shm_name:
            args += ["--shm-name", self.shm_name]
        if self.l2_adapter is not None:
            args += ["--l2-adapter", json.dumps(self.l2_adapter)]
        return args + list(self._extra)

    def start(self) -> LMCacheServer:
        """Start on free ports (or, from :meth:`restart`, on the ports it had)."""
        if self.running:
            return self
        if not self._same_ports:
            self.port, self.http_port, self.prometheus_port = (free_port(), free_port(),
                                                               free_port())
        self._same_ports = False
        self._dir = Path(tempfile.mkdtemp(prefix="kvp-lmcache-"))
        env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", **self._env}
        log_file = self.log_path
        assert log_file is not None
        with open(log_file, "wb") as out:
            self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, env=env, cwd=self._dir)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        log.info("lmcache server on %s:%d, HTTP %s (pid %d)", self.host, self.port,
                 self.http_url, self._proc.pid)
        return self

    def restart(self) -> LMCacheServer:
        """Stop the server and start a new one on the same ports, as a supervisor restarts
        a crashed server: its clients reconnect to the same endpoint and find an empty L1
        and a new KV-event incarnation."""
        self.stop()
        self._same_ports = True
        return self.start()

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise StoreConnectionError(
                    f"lmcache server exited with {self._proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.http_url}/status", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise StoreConnectionError(
            f"lmcache server did not answer {self.http_url}/status within {self._timeout} s: "
            f"{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        path = self.log_path
        if path is None or not path.is_file():
            return ""
        return path.read_text(errors="replace")[-chars:]

    def get_json(self, path: str) -> Any:
        """``GET`` one of the server's HTTP endpoints (``/status``, ``/config`` ...)."""
        import httpx

        response = httpx.get(f"{self.http_url}{path}", timeout=10.0)
        response.raise_for_status()
        return response.json()
