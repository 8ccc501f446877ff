"""What the GPU round trips share: examples/gpu_check.py (vLLM + LMCache) and
examples/gpu_check_sglang.py (SGLang HiCache). One session, one prompt of synthetic token
ids; the gateway glue's part (storing the session's token ids), the scheduler's part (one
transfer order for the session) and the agent's answer are the same for both engines.
"""

from __future__ import annotations

import contextlib
import logging
import random
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvprefetch.agents.agent import PrefetchAgent, RemoteStoreConfig
from kvprefetch.controlplane.base.wire import TransferOrder

log = logging.getLogger("gpu_check")
TENANT, SESSION = "gpu-check", "session-1"


def synthetic_prompt(n_tokens: int, seed: int = 0) -> list[int]:
    """Ids every current tokenizer has (vocabularies are >= 32k), reproducible."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n_tokens)]


def publish_session_tokens(remote: RemoteStoreConfig, tenant: str, session: str,
                           token_ids: Sequence[int]) -> None:
    """The gateway glue's part: the session's token ids next to its KV, which the
    ``lmcache-mp`` and ``sglang`` agent backends name the session's objects from."""
    from kvprefetch.agents.backends.tokens import put_session_tokens

    store = remote.build()
    store.start()
    try:
        if not put_session_tokens(store, tenant, session, token_ids):
            raise SystemExit(f"could not store the token ids of {tenant}/{session}")
    finally:
        store.close()


def session_order(order_id: int, tenant: str, session: str, n_tokens: int,
                  chunk_size: int, *, ttl_s: float = 60.0) -> TransferOrder:
    """The scheduler's part: a prefetch order for the session's whole context."""
    from kvprefetch.controlplane.base.keys import position_keys

    keys = tuple(position_keys(tenant, session, n_tokens, chunk_size))
    return TransferOrder(order_id, f"{tenant}/{session}", 0, keys, n_tokens, 0, True,
                         time.time() + ttl_s)


def warm_session(agent: PrefetchAgent, order: TransferOrder, timeout_s: float = 120.0
                 ) -> dict[str, Any]:
    """The node's agent runs the order; what its report says."""
    agent.execute(order)
    report = agent.wait(order.order_id, timeout_s)
    row = {"complete": bool(report and report.complete),
           "chunks_warmed": report.keys_moved if report else 0,
           "ttlb_s": round(report.ttlb_wall_s, 4) if report else None}
    log.info("warm: %s", row)
    return row


@contextlib.contextmanager
def launched(cmd: Sequence[str], env: Mapping[str, str] | None = None
             ) -> Iterator[subprocess.Popen[bytes]]:
    """An engine's server for the ``with`` block (terminated, then killed, after it)."""
    log.info("starting: %s", " ".join(cmd))
    proc = subprocess.Popen(list(cmd), env=dict(env) if env is not None else None)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None
              ) -> None:
    """Until ``url`` answers 200; gives up early when the server ``proc`` has exited."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}) before {url} answered")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        time.sleep(2.0)
    raise SystemExit(f"{url} did not answer within {timeout_s:g} s")


def print_rows(results: Mapping[str, Any], names: Sequence[str],
               columns: Sequence[tuple[str, str]]) -> None:
    """One line per request: ``columns`` are (field, heading); TTFT first."""
    print(f"\n{'request':<14} " + " ".join(f"{h:>11}" for _, h in columns))
    for name in names:
        r = results[name]
        cells = [f"{r[f]:>11.3f}" if isinstance(r[f], float) else f"{r[f]!s:>11}"
                 for f, _ in columns]
        print(f"{name:<14} " + " ".join(cells))


def write_results(path: str | Path | None, results: Mapping[str, Any]) -> None:
    if path:
        from kvprefetch.controlplane.base.atomic import write_json_atomic

        write_json_atomic(path, results)
