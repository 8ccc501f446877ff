"""``kvprefetch bench sglang``: HiCache ``batch_get`` throughput of our storage backend from
the warmed node-local tier (``kvprefetch-local``) and from Valkey (``kvprefetch-valkey``)
against SGLang's built-in file backend (``sglang-file``, ``HiCacheFile``), on the same
machine, the same pages and the same destination host pages, runs interleaved, every run's
bytes compared with what was stored.

Each backend's pages are written first (ours through the backend to Valkey and S3, then
into the local tier as the agent's warm leaves them; the file backend's through its own
``batch_set``). A run is one ``batch_get`` of ``batch_pages`` pages (SGLang's prefetch
batches are up to 128 pages) into preallocated flat host pages, as SGLang's generic
prefetch path does. The file backend reads through the page cache (files just written),
so it is measured at its best.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

from agents.agent import RemoteStoreConfig
from agents.embedded import EmbeddedS3, EmbeddedValkey
from agents.sglang.backend import KvPrefetchHiCacheStorage, SGLangStorageConfig
from agents.sglang.keys import page_hashes
from agents.stores.local import LocalTier, LocalTierConfig

MIB = 1 << 20
BACKENDS = ("kvprefetch-local", "kvprefetch-valkey", "sglang-file")


@dataclass(frozen=True, slots=True)
class SGLangBenchConfig:
    pages: int = 64
    page_mib: float = 2.0  # Llama-3.1-8B, bf16, 16-token pages: 2 MiB
    batch_pages: int = 64
    repeats: int = 5
    dram_dir: str = "/dev/shm"


def _storage_config(extra: dict[str, Any] | None) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="bench/model", extra_config=extra)


def _raw(t: torch.Tensor) -> memoryview:
    array: Any = t.view(torch.uint8).numpy()
    return memoryview(array)


def run_sglang_bench(config: SGLangBenchConfig) -> dict[str, Any]:
    elems = int(config.page_mib * MIB) // 2
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(elems, generator=g).to(torch.bfloat16) for _ in range(config.pages)]
    keys = page_hashes(list(range(config.pages * 16)), 16)
    batches = [keys[i : i + config.batch_pages] for i in range(0, len(keys), config.batch_pages)]
    dest = [torch.zeros(elems, dtype=torch.bfloat16) for _ in range(config.batch_pages)]
    results: dict[str, list[float]] = {name: [] for name in BACKENDS}
    verified = dict.fromkeys(BACKENDS, True)
    with EmbeddedValkey() as valkey, EmbeddedS3() as s3, \
            tempfile.TemporaryDirectory(dir=config.dram_dir) as dram, \
            tempfile.TemporaryDirectory() as files:
        remote = RemoteStoreConfig(valkey=valkey.store_config(), s3=s3.store_config())
        local_cfg = LocalTierConfig(path=dram, capacity_bytes=2 * config.pages *
                                    int(config.page_mib * MIB) + 64 * MIB)
        backends: dict[str, Any] = {
            "kvprefetch-local": KvPrefetchHiCacheStorage(_storage_config(
                {"kvprefetch": SGLangStorageConfig(local=local_cfg, remote=remote)
                 .model_dump()})),
            "kvprefetch-valkey": KvPrefetchHiCacheStorage(_storage_config(
                {"kvprefetch": SGLangStorageConfig(remote=remote).model_dump()})),
            "sglang-file": HiCacheFile(_storage_config({"file_storage_path": files})),
        }
        try:
            ours = backends["kvprefetch-valkey"]
            if not ours.batch_set(keys, values):
                raise RuntimeError("could not store the pages in Valkey and S3")
            with LocalTier(local_cfg) as tier:  # what the agent's warm leaves on the node
                tier.put([(ours.scheme.object_name(k), _raw(v)) for k, v in
                          zip(keys, values, strict=True)])
            if not backends["sglang-file"].batch_set(keys, values):
                raise RuntimeError("HiCacheFile could not store the pages")
            for _ in range(config.repeats):
                for name, backend in backends.items():  # interleaved
                    for start, batch in zip(range(0, len(keys), config.batch_pages), batches,
                                            strict=True):
                        out = dest[: len(batch)]
                        for d in out:
                            d.zero_()
                        t0 = time.perf_counter()
                        got = backend.batch_get(batch, out)
                        elapsed = time.perf_counter() - t0
                        ok = all(x is not None for x in got) and all(
                            torch.equal(d, values[start + i]) for i, d in enumerate(out))
                        verified[name] = verified[name] and ok
                        results[name].append(len(batch) * config.page_mib / elapsed)
            local_hits = backends["kvprefetch-local"].get_stats()["local_hits"]
        finally:
            backends["kvprefetch-local"].close()
            backends["kvprefetch-valkey"].close()
    return {
        "backends": {name: {"batch_get_mib_s": statistics.median(runs),
                            "best_mib_s": max(runs), "runs": len(runs),
                            "verified": verified[name]}
                     for name, runs in results.items()},
        "pages": config.pages, "page_bytes": int(config.page_mib * MIB),
        "batch_pages": config.batch_pages, "repeats": config.repeats,
        "local_hits": local_hits,
        "replay": None,  # not built yet (issue 13: pages served within SGLang's timeout)
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{result['pages']} pages x {result['page_bytes'] / MIB:g} MiB, batches of "
             f"{result['batch_pages']}, {result['repeats']} repeats (median / best MiB/s)"]
    for name, r in result["backends"].items():
        lines.append(f"  {name:<18} {r['batch_get_mib_s']:>9,.0f} {r['best_mib_s']:>9,.0f}"
                     f"  verified={r['verified']}")
    return "\n".join(lines)


def default_dram_dir() -> str:
    return "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()
