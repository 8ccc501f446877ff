"""One real vLLM + LMCache + kvprefetch agent round trip on a GPU node (run by gpu_check.sh).

1. Starts Valkey and S3 on loopback (embedded), a node-local ``lmcache server`` whose L2 is
   kvprefetch's adapter over them, and ``vllm serve MODEL`` with the LMCache MP connector.
2. Cold request: a prompt of ``--prompt-tokens`` token ids, one output token (its latency
   is the TTFT). LMCache stores the KV in L1 and writes it through to L2; the gateway glue
   stores the token ids next to it (what an ``lmcache-mp`` agent warms from).
3. Without prefetch: vLLM's prefix cache is reset and LMCache's L1 cleared, so the request
   finds its KV in L2 only, and LMCache loads it on arrival.
4. With prefetch: the same reset, then the node's prefetch agent (backend ``lmcache-mp``)
   executes a transfer order for the session, warming L1 through ``POST /cache/prefetches``;
   then the request.

Prints the three TTFTs and LMCache's lookup counters (tokens found in L1 vs loaded from L2)
for each request, writes them as JSON with ``--json``, and exits 1 unless the warmed request
found its whole prefix in L1 (no L2 load on its path).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

log = logging.getLogger("gpu_check")
TENANT, SESSION = "gpu-check", "session-1"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help="a small model vLLM can load offline (a local path or a cached name)")
    p.add_argument("--prompt-tokens", type=int, default=8292,
                   help="prompt length (default 8292: 32 whole chunks of 256 and a tail)")
    p.add_argument("--chunk-size", type=int, default=256, help="LMCache chunk size (256)")
    p.add_argument("--l1-size-gb", type=float, default=8.0)
    p.add_argument("--vllm-port", type=int, default=8100)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--vllm-start-timeout-s", type=float, default=900.0)
    p.add_argument("--json", dest="json_out", help="write the figures here as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    import httpx

    from agents.agent import AgentConfig, PrefetchAgent, RemoteStoreConfig
    from agents.embedded import EmbeddedS3, EmbeddedValkey
    from agents.lmcache.backend import LMCacheBackendConfig
    from agents.lmcache.l2_adapter import plugin_adapter_json
    from agents.lmcache.server import LMCacheServer
    from agents.lmcache.tokens import put_session_tokens
    from agents.lmcache.warm import LMCacheWarmClient
    from controlplane.base.keys import position_keys
    from controlplane.base.wire import TransferOrder

    rng = random.Random(0)
    # Ids every current tokenizer has (vocabularies are >= 32k); one output token each.
    prompt = [rng.randrange(1000, 30000) for _ in range(args.prompt_tokens)]
    with contextlib.ExitStack() as stack:
        valkey = stack.enter_context(EmbeddedValkey())
        s3 = stack.enter_context(EmbeddedS3())
        remote = RemoteStoreConfig(valkey=valkey.store_config(), s3=s3.store_config())
        server = stack.enter_context(LMCacheServer(
            l2_adapter=plugin_adapter_json(valkey=remote.valkey, s3=remote.s3),
            chunk_size=args.chunk_size, l1_size_gb=args.l1_size_gb, transfer_mode="auto"))
        vllm_url = f"http://127.0.0.1:{args.vllm_port}"
        stack.enter_context(_vllm(args, server))
        _wait_http(f"{vllm_url}/health", args.vllm_start_timeout_s)
        warm = stack.enter_context(LMCacheWarmClient(server.http_url))
        http = stack.enter_context(httpx.Client(timeout=600.0))

        def request() -> float:
            started = time.perf_counter()
            r = http.post(f"{vllm_url}/v1/completions", json={
                "model": args.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0})
            r.raise_for_status()
            return time.perf_counter() - started

        def measured(label: str) -> dict[str, Any]:
            before = warm.lookup_hits(args.model)
            ttft = request()
            time.sleep(1.0)  # LMCache updates its counters off the request path
            after = warm.lookup_hits(args.model)
            row = {"ttft_s": round(ttft, 4),
                   "l1_tokens": after.l1_tokens - before.l1_tokens,
                   "l2_tokens": after.l2_tokens - before.l2_tokens}
            log.info("%s: %s", label, row)
            return row

        def cold_caches() -> None:
            http.post(f"{vllm_url}/reset_prefix_cache").raise_for_status()
            warm.clear_l1()

        results: dict[str, Any] = {"model": args.model, "prompt_tokens": len(prompt)}
        results["cold"] = measured("cold")
        _wait_l2(warm)
        store = remote.build()
        store.start()
        try:
            put_session_tokens(store, TENANT, SESSION, prompt)  # the gateway glue's part
        finally:
            store.close()
        cold_caches()
        results["no_prefetch"] = measured("no prefetch (L2 load on arrival)")
        cold_caches()
        agent = stack.enter_context(PrefetchAgent(AgentConfig(
            node=0, backend="lmcache-mp", remote=remote,
            lmcache=LMCacheBackendConfig(http_url=server.http_url, model_name=args.model,
                                         chunk_size=args.chunk_size))))
        keys = tuple(position_keys(TENANT, SESSION, len(prompt), args.chunk_size))
        order = TransferOrder(1, f"{TENANT}/{SESSION}", 0, keys, len(prompt), 0, True,
                              time.time() + 60)
        agent.execute(order)
        report = agent.wait(order.order_id, 120.0)
        results["warm"] = {"complete": bool(report and report.complete),
                           "chunks_warmed": report.keys_moved if report else 0,
                           "ttlb_s": round(report.ttlb_wall_s, 4) if report else None}
        log.info("warm: %s", results["warm"])
        results["prefetch"] = measured("after prefetch")
    # vLLM computes at least the prompt's last token itself, so its lookup may stop one
    # chunk short of the prompt's whole chunks.
    full = (len(prompt) // args.chunk_size - 1) * args.chunk_size
    after = results["prefetch"]
    hit = after["l1_tokens"] >= max(full, 1) and after["l2_tokens"] == 0
    results["warmed_request_hit_l1"] = hit
    print(f"\n{'request':<14} {'TTFT s':>8} {'L1 tokens':>10} {'L2 tokens':>10}")
    for name in ("cold", "no_prefetch", "prefetch"):
        r = results[name]
        print(f"{name:<14} {r['ttft_s']:>8.3f} {r['l1_tokens']:>10} {r['l2_tokens']:>10}")
    print(f"warm: {results['warm']}; warmed request hit L1: {hit}")
    if args.json_out:
        from controlplane.base.atomic import write_json_atomic

        write_json_atomic(args.json_out, results)
    return 0 if hit else 1


@contextlib.contextmanager
def _vllm(args: argparse.Namespace, server: Any) -> Any:
    transfer = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{server.host}",
                                              "lmcache.mp.port": server.port}}
    cmd = ["vllm", "serve", args.model, "--port", str(args.vllm_port),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--max-model-len", str(args.max_model_len),
           "--kv-transfer-config", json.dumps(transfer)]
    # /reset_prefix_cache is a development endpoint of vLLM's server.
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    log.info("starting: %s", " ".join(cmd))
    proc = subprocess.Popen(cmd, env=env)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_http(url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        time.sleep(2.0)
    raise SystemExit(f"{url} did not answer within {timeout_s:g} s")


def _wait_l2(warm: Any, timeout_s: float = 60.0) -> None:
    """Until LMCache's write-through to L2 has drained (the KV is durable there)."""
    deadline = time.monotonic() + timeout_s
    while warm.l2_write_backlog() and time.monotonic() < deadline:
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
