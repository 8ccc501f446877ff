"""``gpu_check.sh MODEL --engine sglang``: one real SGLang HiCache + kvprefetch round trip.

1. Starts Valkey and S3 on loopback (embedded) and SGLang on the GPU through
   examples/sglang_node.sh: ``--enable-hierarchical-cache``, our L3 backend
   (``--hicache-storage-backend dynamic``) over a fresh node-local tier in /dev/shm,
   Valkey and S3, and a stats directory where each rank's backend publishes its counters
   (:mod:`kvprefetch.agents.sglang.stats`).
2. Cold request: ``POST /generate`` with ``--prompt-tokens`` token ids (``input_ids``), one
   output token, under the tenant's ``cache_salt``; its latency is the TTFT. HiCache writes
   the prompt's pages back through our backend to Valkey and S3; the check waits until
   every page the agent would warm is there, then stores the session's token ids (the
   gateway glue's part, what the ``sglang`` agent backend names the pages from).
3. Without prefetch: ``POST /flush_cache`` drops SGLang's GPU and host caches (its radix
   tree and host pool); the node-local tier is still empty (the agent has not run), so
   HiCache's prefetch on arrival reads every page from Valkey/S3.
4. With prefetch: flushed again, then the node's prefetch agent (backend ``sglang``) runs
   a transfer order for the session, copying its pages into the node-local tier; then the
   request, whose pages HiCache now reads from that tier.

Prints the three TTFTs, SGLang's own account (``meta_info.cached_tokens_details``: device,
host, storage tokens) and our backend's (pages from the local tier, Valkey, S3, missed)
for each request, writes them as JSON with ``--json``, and exits 1 unless the warmed
request's pages all came from the node-local tier.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, wherever it is

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

from kvprefetch.agents.agent import AgentConfig, RemoteStoreConfig
from kvprefetch.agents.backends.sglang.warmer import SGLangWarmConfig
from kvprefetch.agents.sglang.backend import SGLangStorageConfig, dynamic_extra_config
from kvprefetch.agents.sglang.keys import PageKeyScheme
from kvprefetch.agents.sglang.stats import BackendStats, read_stats
from kvprefetch.agents.stores.local import LocalTierConfig
from kvprefetch.controlplane.base.keys import tenant_cache_salt

log = logging.getLogger("gpu_check")
HERE = Path(__file__).resolve().parent
#: A clone's root (examples/ beside the package's folders), else None: kvprefetch is
#: the installed package.
CLONE = HERE.parent if (HERE.parent / "kvprefetch").is_dir() else None


def sglang_launch(args: argparse.Namespace, storage: SGLangStorageConfig
                  ) -> tuple[list[str], dict[str, str]]:
    """examples/sglang_node.sh with the check's storage config, and its environment."""
    env = {**os.environ,
           "PYTHON": sys.executable,
           # secrets in clear: SGLang gets them on its command line either way
           "STORAGE_CONFIG": json.dumps(dynamic_extra_config(storage)["kvprefetch"]),
           "PORT": str(args.port), "PAGE_SIZE": str(args.page_size), "TP": str(args.tp),
           # SGLang's ranks import our backend by module path (kvprefetch.agents.sglang.backend)
           "PYTHONPATH": os.pathsep.join(
               p for p in (str(CLONE) if CLONE else None, os.environ.get("PYTHONPATH")) if p)}
    cmd = [str(HERE / "sglang_node.sh"), args.model,
           "--mem-fraction-static", str(args.gpu_memory_utilization),
           "--context-length", str(args.max_model_len),
           "--hicache-size", str(args.hicache_size_gb),
           "--hicache-storage-prefetch-policy", args.prefetch_policy]
    return cmd, env


def node_agent_config(remote: RemoteStoreConfig, dram: LocalTierConfig, model_name: str,
                      page_size: int, tp_size: int) -> AgentConfig:
    """The node's agent with backend ``sglang`` over the tier the backend reads first;
    ``model_name`` as SGLang's storage config has it (read from the stats files)."""
    return AgentConfig(node=0, backend="sglang", dram=dram, remote=remote,
                       sglang=SGLangWarmConfig(model_name=model_name, page_size=page_size,
                                               tp_size=tp_size))


def page_names(prompt: Sequence[int], model_name: str, page_size: int, tp_size: int,
               tenant: str = TENANT) -> list[str]:
    """Every rank's objects for the prompt's full pages: what HiCache writes back and
    what the agent warms."""
    salt = tenant_cache_salt(tenant) or None
    return [name for rank in range(tp_size)
            for name in PageKeyScheme(model_name, tp_rank=rank, tp_size=tp_size)
            .object_names(list(prompt), page_size, cache_salt=salt)]


def served_from_node_tier(pages: Mapping[str, int], full_pages: int, ranks: int = 1
                          ) -> bool:
    """Whether a request's L3 reads (the growth of our counters over it) all came from the
    node-local tier: every full page of the prompt on every rank, but one per rank (the
    engine may compute the page holding the last prompt token itself), none from Valkey
    or S3, none missed or damaged."""
    return (pages["local_hits"] >= max(full_pages - 1, 1) * ranks
            and pages["remote_hits"] == 0 and pages["misses"] == 0
            and pages["local_bad"] == 0)


def wait_stored(remote: RemoteStoreConfig, names: Sequence[str], timeout_s: float
                ) -> int:
    """Until all of ``names`` are in the remote store (HiCache writes back off the request
    path); returns how many are."""
    store = remote.build()
    store.start()
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            present = sum(r.ok for r in store.exists(list(names)))
            if present == len(names) or time.monotonic() > deadline:
                return present
            time.sleep(0.5)
    finally:
        store.close()


def wait_ranks(stats_dir: str, ranks: int, timeout_s: float = 60.0) -> BackendStats:
    """Until every rank's backend has published (it does once it is built)."""
    deadline = time.monotonic() + timeout_s
    while (stats := read_stats(stats_dir)).ranks < ranks:
        if time.monotonic() > deadline:
            raise SystemExit(f"{stats.ranks} of {ranks} SGLang ranks built our backend "
                             f"within {timeout_s:g} s (see SGLang's log)")
        time.sleep(0.5)
    return stats


def run_sglang(args: argparse.Namespace) -> int:
    import httpx

    from kvprefetch.agents.agent import PrefetchAgent
    from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey

    prompt = synthetic_prompt(args.prompt_tokens)
    salt = tenant_cache_salt(TENANT)
    full_pages = len(prompt) // args.page_size
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    results: dict[str, Any] = {"engine": "sglang", "model": args.model,
                               "prompt_tokens": len(prompt), "page_size": args.page_size,
                               "tp": args.tp, "full_pages": full_pages}
    with contextlib.ExitStack() as stack:
        stats_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvp-stats-"))
        dram = LocalTierConfig(path=str(shm / f"kvp-gpu-check-{uuid.uuid4().hex[:8]}"),
                               capacity_bytes=int(args.dram_gb * (1 << 30)))
        stack.callback(_remove_tree, Path(dram.path))
        valkey = stack.enter_context(EmbeddedValkey())
        s3 = stack.enter_context(EmbeddedS3())
        remote = RemoteStoreConfig(valkey=valkey.store_config(), s3=s3.store_config())
        storage = SGLangStorageConfig(local=dram, remote=remote, stats_dir=stats_dir)
        url = f"http://127.0.0.1:{args.port}"
        proc = stack.enter_context(launched(*sglang_launch(args, storage)))
        wait_http(f"{url}/health", args.start_timeout_s, proc)
        model_name = wait_ranks(stats_dir, args.tp).model_names[0]
        results["storage_model_name"] = model_name  # agent.sglang.model_name in serve.yaml
        http = stack.enter_context(httpx.Client(timeout=600.0))

        def measured(label: str) -> dict[str, Any]:
            before = read_stats(stats_dir)
            started = time.perf_counter()
            # sglang/srt/managers/io_struct.py GenerateReqInput: input_ids, sampling_params,
            # cache_salt (the chain of its storage page hashes starts from it)
            r = http.post(f"{url}/generate", json={
                "input_ids": prompt, "cache_salt": salt,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
            ttft = time.perf_counter() - started
            r.raise_for_status()
            meta = r.json()["meta_info"]
            time.sleep(1.0)  # a prefetch cut short by the timeout policy finishes late
            pages = read_stats(stats_dir).since(before)
            # sglang/srt/managers/scheduler_components/output_streamer.py:
            # {"device", "host", "storage", "storage_backend"}, None when nothing was cached
            details = meta.get("cached_tokens_details") or {}
            row = {"ttft_s": round(ttft, 4), "cached_tokens": meta.get("cached_tokens", 0),
                   "device_tokens": details.get("device", 0),
                   "host_tokens": details.get("host", 0),
                   "storage_tokens": details.get("storage", 0), "pages": pages}
            log.info("%s: %s", label, row)
            return row

        def flush() -> None:
            # sglang/srt/entrypoints/http_server.py /flush_cache -> Scheduler.flush_cache:
            # resets the radix tree and the host pool; refused (400) while requests run.
            for _ in range(60):
                if http.post(f"{url}/flush_cache").status_code == 200:
                    return
                time.sleep(1.0)
            raise SystemExit("SGLang refused /flush_cache for 60 s")

        results["cold"] = measured("cold")
        names = page_names(prompt, model_name, args.page_size, args.tp)
        stored = wait_stored(remote, names, 120.0)
        results["pages_written_back"] = stored
        if stored < len(names):
            log.error("%d of %d pages reached Valkey/S3: SGLang wrote fewer, or names them "
                      "otherwise than the agent does (model %r, salt)", stored, len(names),
                      model_name)
        publish_session_tokens(remote, TENANT, SESSION, prompt)
        flush()
        results["no_prefetch"] = measured("no prefetch (L3 read on arrival)")
        flush()
        agent = stack.enter_context(PrefetchAgent(node_agent_config(
            remote, dram, model_name, args.page_size, args.tp)))
        results["warm"] = warm_session(
            agent, session_order(1, TENANT, SESSION, len(prompt), args.chunk_size))
        results["prefetch"] = measured("after prefetch")
    ok = served_from_node_tier(results["prefetch"]["pages"], full_pages, args.tp)
    results["warmed_request_from_node_tier"] = ok
    requests = ("cold", "no_prefetch", "prefetch")
    table = {n: {**results[n], **results[n]["pages"]} for n in requests}
    print_rows(table, requests,
               (("ttft_s", "TTFT s"), ("device_tokens", "GPU tok"), ("host_tokens", "host tok"),
                ("storage_tokens", "L3 tok"), ("local_hits", "local pg"),
                ("valkey_hits", "Valkey pg"), ("s3_hits", "S3 pg"), ("misses", "missed pg")))
    print(f"warm: {results['warm']}; pages written back {results['pages_written_back']} of "
          f"{full_pages * args.tp}; warmed request served from the node tier: {ok}")
    write_results(args.json_out, results)
    return 0 if ok else 1


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
