"""One real engine + kvprefetch agent round trip on a GPU node (run by gpu_check.sh).

``--engine vllm`` (the default) is described here; ``--engine sglang`` (SGLang HiCache with
our L3 backend) in examples/gpu_check_sglang.py. The vLLM round trip:

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
import sys
import time
from pathlib import Path
from typing import Any

# The check's other files are the ones beside this script (a clone's examples/, or a
# `kvprefetch init` folder).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check_common import (  # after the path above
    SESSION,
    TENANT,
    launched,
    print_rows,
    publish_session_tokens,
    session_order,
    synthetic_prompt,
    wait_http,
    warm_session,
    write_results,
)

log = logging.getLogger("gpu_check")
#: Each engine's server port unless --port says otherwise.
DEFAULT_PORTS = {"vllm": 8100, "sglang": 30000}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help="a small model the engine can load offline (a local path or a "
                        "cached name)")
    p.add_argument("--engine", choices=("vllm", "sglang"), default="vllm",
                   help="vllm: vLLM + LMCache (default); sglang: SGLang HiCache with "
                        "kvprefetch as its L3 storage backend")
    p.add_argument("--prompt-tokens", type=int, default=8292,
                   help="prompt length (default 8292: 32 whole chunks of 256 and a tail)")
    p.add_argument("--chunk-size", type=int, default=256,
                   help="LMCache chunk size and the scheduler's chunk size (256)")
    p.add_argument("--port", "--vllm-port", dest="port", type=int,
                   help="the engine's port (vllm 8100, sglang 30000)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                   help="vLLM's --gpu-memory-utilization, SGLang's --mem-fraction-static")
    p.add_argument("--max-model-len", type=int, default=16384,
                   help="vLLM's --max-model-len, SGLang's --context-length")
    p.add_argument("--start-timeout-s", "--vllm-start-timeout-s", dest="start_timeout_s",
                   type=float, default=900.0)
    p.add_argument("--json", dest="json_out", help="write the figures here as JSON")
    g = p.add_argument_group("vllm")
    g.add_argument("--l1-size-gb", type=float, default=8.0, help="LMCache L1 (8)")
    g = p.add_argument_group("sglang")
    g.add_argument("--page-size", type=int, default=64, help="SGLang's --page-size (64)")
    g.add_argument("--tp", type=int, default=1, help="SGLang's --tp (1)")
    g.add_argument("--prefetch-policy", default="timeout",
                   choices=("best_effort", "wait_complete", "timeout"),
                   help="SGLang's --hicache-storage-prefetch-policy (timeout)")
    g.add_argument("--hicache-size-gb", type=int, default=16,
                   help="SGLang's --hicache-size, its host pool per rank (16; its default, "
                        "twice the GPU pool, can be 100+ GB to pin on a large GPU)")
    g.add_argument("--dram-gb", type=float, default=8.0,
                   help="the node-local tier the agent warms, in /dev/shm (8)")
    args = p.parse_args(argv)
    if args.port is None:
        args.port = DEFAULT_PORTS[args.engine]
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    if args.engine == "sglang":
        from gpu_check_sglang import run_sglang

        return run_sglang(args)
    return run_vllm(args)


def run_vllm(args: argparse.Namespace) -> int:
    import httpx

    from kvprefetch.agents.agent import AgentConfig, PrefetchAgent, RemoteStoreConfig
    from kvprefetch.agents.backends.lmcache.warmer import LMCacheBackendConfig
    from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
    from kvprefetch.agents.lmcache.l2.adapter import plugin_adapter_json
    from kvprefetch.agents.lmcache.server import LMCacheServer
    from kvprefetch.agents.lmcache.warm import LMCacheWarmClient

    prompt = synthetic_prompt(args.prompt_tokens)  # one output token each request
    with contextlib.ExitStack() as stack:
        valkey = stack.enter_context(EmbeddedValkey())
        s3 = stack.enter_context(EmbeddedS3())
        remote = RemoteStoreConfig(valkey=valkey.store_config(), s3=s3.store_config())
        server = stack.enter_context(LMCacheServer(
            l2_adapter=plugin_adapter_json(valkey=remote.valkey, s3=remote.s3),
            chunk_size=args.chunk_size, l1_size_gb=args.l1_size_gb, transfer_mode="auto"))
        vllm_url = f"http://127.0.0.1:{args.port}"
        proc = stack.enter_context(launched(*_vllm_command(args, server)))
        wait_http(f"{vllm_url}/health", args.start_timeout_s, proc)
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

        results: dict[str, Any] = {"engine": "vllm", "model": args.model,
                                   "prompt_tokens": len(prompt)}
        results["cold"] = measured("cold")
        _wait_l2(warm)
        publish_session_tokens(remote, TENANT, SESSION, prompt)
        cold_caches()
        results["no_prefetch"] = measured("no prefetch (L2 load on arrival)")
        cold_caches()
        agent = stack.enter_context(PrefetchAgent(AgentConfig(
            node=0, backend="lmcache-mp", remote=remote,
            lmcache=LMCacheBackendConfig(http_url=server.http_url, model_name=args.model,
                                         chunk_size=args.chunk_size))))
        results["warm"] = warm_session(
            agent, session_order(1, TENANT, SESSION, len(prompt), args.chunk_size))
        results["prefetch"] = measured("after prefetch")
    # vLLM computes at least the prompt's last token itself, so its lookup may stop one
    # chunk short of the prompt's whole chunks.
    full = (len(prompt) // args.chunk_size - 1) * args.chunk_size
    after = results["prefetch"]
    hit = after["l1_tokens"] >= max(full, 1) and after["l2_tokens"] == 0
    results["warmed_request_hit_l1"] = hit
    print_rows(results, ("cold", "no_prefetch", "prefetch"),
               (("ttft_s", "TTFT s"), ("l1_tokens", "L1 tokens"), ("l2_tokens", "L2 tokens")))
    print(f"warm: {results['warm']}; warmed request hit L1: {hit}")
    write_results(args.json_out, results)
    return 0 if hit else 1


def _vllm_command(args: argparse.Namespace, server: Any) -> tuple[list[str], dict[str, str]]:
    transfer = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{server.host}",
                                              "lmcache.mp.port": server.port}}
    cmd = ["vllm", "serve", args.model, "--port", str(args.port),
           "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--max-model-len", str(args.max_model_len),
           "--kv-transfer-config", json.dumps(transfer)]
    # /reset_prefix_cache is a development endpoint of vLLM's server.
    return cmd, {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}


def _wait_l2(warm: Any, timeout_s: float = 60.0) -> None:
    """Until LMCache's write-through to L2 has drained (the KV is durable there)."""
    deadline = time.monotonic() + timeout_s
    while warm.l2_write_backlog() and time.monotonic() < deadline:
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
