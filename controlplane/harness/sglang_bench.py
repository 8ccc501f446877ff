"""``kvprefetch bench sglang``: HiCache L3 read throughput of our storage backend from the
warmed node-local tier (``kvprefetch-local``) and from Valkey (``kvprefetch-valkey``)
against SGLang's built-in file backend (``sglang-file``, ``HiCacheFile``), on the same
machine, the same pages and the same destination memory, runs interleaved (the order
alternating between repeats), every run's bytes compared with what was stored; then,
unless disabled, the replay of HiCache's page reads on the bundled trace's returning
requests with and without the agent's warming
(:mod:`kvprefetch.controlplane.harness.sglang_replay`), against the same servers.

Two measurements per backend, each timed per batch of ``batch_pages`` pages (SGLang's
prefetch batches are up to 128 pages):

* ``backends``: one ``batch_get`` into preallocated flat host pages: the storage call
  alone, the same call for every backend.
* ``host_pool``: the pages land in a page-first host pool the way SGLang 0.5.23's cache
  controller lands them from each backend: ``_page_get_zero_copy`` (``batch_get_v1`` into
  the pool) for a dynamic backend with ``interface_v1`` (ours), ``_generic_page_get`` (a
  fresh flat page per key, ``batch_get``, then ``set_from_flat_data_page``) for
  ``HiCacheFile``. Both functions are reproduced here (SGLang's controller module cannot be
  imported without a GPU build).

Each backend's pages are written first (ours through the backend to Valkey and S3, then
into the local tier as the agent's warm leaves them; the file backend's through its own
``batch_set``). The file backend reads through the page cache (files just written), so it
is measured at its best. ``sglang-file`` keeps its files in the same DRAM directory as our
tier (``dram_dir``, tmpfs), so both read the same medium; ``sglang-file-tmpdir`` keeps them
in the system temp directory, as its default ``/tmp/hicache`` does: on a disk filesystem
that is the page cache, which can be faster to read than tmpfs (a plain ``read`` of 2 MiB
files: ~1.7x on the ext4 of the machine this was written on). Ours reads a batch's pages
on ``read_threads`` threads (``local_read_threads``), copying and verifying each page's
checksums; ``HiCacheFile`` reads on the calling thread and verifies nothing. Torch runs
on one thread during the bench (see :func:`run_sglang_bench`).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    HiCacheStorage,
    HiCacheStorageConfig,
)

from kvprefetch.agents.agent import RemoteStoreConfig
from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
from kvprefetch.agents.sglang.backend import KvPrefetchHiCacheStorage, SGLangStorageConfig
from kvprefetch.agents.sglang.host_pool import PageFirstHostPool
from kvprefetch.agents.sglang.keys import page_hashes
from kvprefetch.agents.stores.local import LocalTier, LocalTierConfig
from kvprefetch.controlplane.harness.sglang_replay import ReplayConfig, run_replay

MIB = 1 << 20
PAGE_TOKENS = 16
BACKENDS = ("kvprefetch-local", "kvprefetch-valkey", "sglang-file", "sglang-file-tmpdir")
#: Backends that SGLang's controller reads with ``batch_get_v1`` (``interface_v1``).
_ZERO_COPY = ("kvprefetch-local", "kvprefetch-valkey")


@dataclass(frozen=True, slots=True)
class SGLangBenchConfig:
    pages: int = 64
    page_mib: float = 2.0  # Llama-3.1-8B, bf16, 16-token pages: 2 MiB
    batch_pages: int = 64
    repeats: int = 5
    read_threads: int = 4  # the backend's local_read_threads
    dram_dir: str = "/dev/shm"
    replay: ReplayConfig | None = None  # None: no replay


def _storage_config(extra: dict[str, Any] | None) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="bench/model", extra_config=extra)


def _raw(t: torch.Tensor) -> memoryview:
    array: Any = t.view(torch.uint8).numpy()
    return memoryview(array)


def generic_page_get(backend: HiCacheStorage, pool: PageFirstHostPool, hashes: list[str],
                     host_indices: torch.Tensor) -> int:
    """SGLang 0.5.23's ``HiCacheController._generic_page_get``: pages that landed, from the
    first."""
    dummy = [pool.get_dummy_flat_data_page() for _ in hashes]
    page_data = backend.batch_get(hashes, dummy)
    count = 0
    for i in range(len(hashes)):
        if page_data[i] is None:
            break
        pool.set_from_flat_data_page(int(host_indices[i * pool.page_size]), page_data[i])
        count += 1
    return count


def zero_copy_page_get(backend: HiCacheStorage, pool: PageFirstHostPool, hashes: list[str],
                       host_indices: torch.Tensor) -> int:
    """SGLang 0.5.23's ``HiCacheController._page_get_zero_copy``."""
    results = backend.batch_get_v1(hashes, host_indices)
    return next((i for i, ok in enumerate(results) if not ok), len(results))


def _ratio_median(a: list[float], b: list[float]) -> float:
    """Each run of one backend has its neighbour runs of the others: the median of their
    ratios is what load from other processes disturbs least."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _figures(results: dict[str, list[float]], verified: dict[str, bool], key: str
             ) -> dict[str, Any]:
    return {name: {key: statistics.median(runs), "best_mib_s": max(runs), "runs": len(runs),
                   "verified": verified[name]} for name, runs in results.items()}


def run_sglang_bench(config: SGLangBenchConfig) -> dict[str, Any]:
    # Torch's own copies (SGLang's set_from_flat_data_page, fresh flat pages) on one thread:
    # OpenMP threads that spin for cores other processes hold make them tens of times
    # slower, which would be measured against the file backend, not for it.
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(config)
    finally:
        torch.set_num_threads(torch_threads)


def _run(config: SGLangBenchConfig) -> dict[str, Any]:
    page_bytes = int(config.page_mib * MIB)
    elems = page_bytes // 2
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(elems, generator=g).to(torch.bfloat16) for _ in range(config.pages)]
    keys = page_hashes(list(range(config.pages * PAGE_TOKENS)), PAGE_TOKENS)
    batches = [keys[i : i + config.batch_pages] for i in range(0, len(keys), config.batch_pages)]
    dest = [torch.zeros(elems, dtype=torch.bfloat16) for _ in range(config.batch_pages)]
    pool = PageFirstHostPool(config.batch_pages, PAGE_TOKENS, elems // (2 * PAGE_TOKENS))
    indices = torch.arange(0, config.batch_pages * PAGE_TOKENS)
    results: dict[str, dict[str, list[float]]] = {
        mode: {name: [] for name in BACKENDS} for mode in ("batch_get", "host_pool")}
    verified = {mode: dict.fromkeys(BACKENDS, True) for mode in results}
    with EmbeddedValkey() as valkey, EmbeddedS3() as s3, \
            tempfile.TemporaryDirectory(dir=config.dram_dir) as dram, \
            tempfile.TemporaryDirectory(dir=config.dram_dir) as files, \
            tempfile.TemporaryDirectory() as tmpdir_files:
        remote = RemoteStoreConfig(valkey=valkey.store_config(), s3=s3.store_config())
        local_cfg = LocalTierConfig(path=dram, capacity_bytes=2 * config.pages * page_bytes
                                    + 64 * MIB)
        backends: dict[str, Any] = {
            "kvprefetch-local": KvPrefetchHiCacheStorage(_storage_config(
                {"kvprefetch": SGLangStorageConfig(
                    local=local_cfg, remote=remote, local_read_threads=config.read_threads)
                 .model_dump()})),
            "kvprefetch-valkey": KvPrefetchHiCacheStorage(_storage_config(
                {"kvprefetch": SGLangStorageConfig(remote=remote).model_dump()})),
            "sglang-file": HiCacheFile(_storage_config({"file_storage_path": files})),
            "sglang-file-tmpdir": HiCacheFile(_storage_config(
                {"file_storage_path": tmpdir_files})),
        }
        for name in _ZERO_COPY:
            backends[name].register_mem_pool_host(pool)
        try:
            ours = backends["kvprefetch-valkey"]
            if not ours.batch_set(keys, values):
                raise RuntimeError("could not store the pages in Valkey and S3")
            with LocalTier(local_cfg) as tier:  # what the agent's warm leaves on the node
                tier.put([(ours.scheme.object_name(k), _raw(v)) for k, v in
                          zip(keys, values, strict=True)])
            for name in ("sglang-file", "sglang-file-tmpdir"):
                if not backends[name].batch_set(keys, values):
                    raise RuntimeError("HiCacheFile could not store the pages")

            def batch_get(name: str, start: int, batch: list[str]) -> bool:
                out = dest[: len(batch)]
                for d in out:
                    d.zero_()
                t0 = time.perf_counter()
                got = backends[name].batch_get(batch, out)
                results["batch_get"][name].append(
                    len(batch) * config.page_mib / (time.perf_counter() - t0))
                return all(x is not None for x in got) and all(
                    torch.equal(d, values[start + i]) for i, d in enumerate(out))

            def host_pool(name: str, start: int, batch: list[str]) -> bool:
                pool.kv_buffer.zero_()
                page_get = zero_copy_page_get if name in _ZERO_COPY else generic_page_get
                t0 = time.perf_counter()
                landed = page_get(backends[name], pool, batch, indices[: len(batch)
                                                                        * PAGE_TOKENS])
                results["host_pool"][name].append(
                    len(batch) * config.page_mib / (time.perf_counter() - t0))
                return landed == len(batch) and all(
                    torch.equal(pool.get_data_page(i * PAGE_TOKENS), values[start + i])
                    for i in range(len(batch)))

            runs: list[tuple[str, str, Callable[[str, int, list[str]], bool]]] = [
                (mode, name, fn) for mode, fn in (("batch_get", batch_get),
                                                  ("host_pool", host_pool))
                for name in BACKENDS]
            for repeat in range(config.repeats):
                for mode, name, fn in runs if repeat % 2 == 0 else runs[::-1]:
                    for start, batch in zip(range(0, len(keys), config.batch_pages), batches,
                                            strict=True):
                        ok = fn(name, start, batch)
                        verified[mode][name] = verified[mode][name] and ok
            local_hits = backends["kvprefetch-local"].counters()["local_hits"]
        finally:
            backends["kvprefetch-local"].close()
            backends["kvprefetch-valkey"].close()
        replay = run_replay(config.replay, valkey, s3) if config.replay is not None else None
    get, land = results["batch_get"], results["host_pool"]
    return {
        "backends": _figures(get, verified["batch_get"], "batch_get_mib_s"),
        "host_pool": _figures(land, verified["host_pool"], "prefetch_mib_s"),
        "ratios": {
            "batch_get_local_vs_file": _ratio_median(get["kvprefetch-local"],
                                                     get["sglang-file"]),
            "batch_get_local_vs_file_tmpdir": _ratio_median(get["kvprefetch-local"],
                                                            get["sglang-file-tmpdir"]),
            "host_pool_local_vs_file": _ratio_median(land["kvprefetch-local"],
                                                     land["sglang-file"]),
            "host_pool_local_vs_file_tmpdir": _ratio_median(land["kvprefetch-local"],
                                                            land["sglang-file-tmpdir"]),
        },
        "pages": config.pages, "page_bytes": page_bytes,
        "batch_pages": config.batch_pages, "repeats": config.repeats,
        "read_threads": config.read_threads, "local_hits": local_hits,
        "dram_dir": config.dram_dir, "tmpdir": tempfile.gettempdir(),
        "replay": replay,
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{result['pages']} pages x {result['page_bytes'] / MIB:g} MiB, batches of "
             f"{result['batch_pages']}, {result['repeats']} repeats, median / best MiB/s",
             f"  {'':<20} {'batch_get':>19}   {'into the host pool':>19}"]
    for name in BACKENDS:
        a, b = result["backends"][name], result["host_pool"][name]
        lines.append(
            f"  {name:<20} {a['batch_get_mib_s']:>9,.0f} {a['best_mib_s']:>9,.0f}"
            f"   {b['prefetch_mib_s']:>9,.0f} {b['best_mib_s']:>9,.0f}"
            f"  verified={a['verified'] and b['verified']}")
    r = result["ratios"]
    lines.append(
        "  kvprefetch-local / sglang-file, median of run pairs: batch_get "
        f"{r['batch_get_local_vs_file']:.2f}x, into the host pool "
        f"{r['host_pool_local_vs_file']:.2f}x (sglang-file-tmpdir: "
        f"{r['batch_get_local_vs_file_tmpdir']:.2f}x, {r['host_pool_local_vs_file_tmpdir']:.2f}x)")
    replay = result.get("replay")
    if replay:
        c = replay["config"]
        lines.append(
            f"replay: {replay['pages']:,} pages of {len(replay['requests'])} returning "
            f"requests ({', '.join(c['sessions'])}), time x{c['time_scale']:g}; in time: "
            f"warmed {replay['warmed_in_time_share']:.3f} (local tier "
            f"{replay['warmed_local_share']:.3f}), unwarmed "
            f"{replay['unwarmed_in_time_share']:.3f}; warms within the pause "
            f"{replay['warms_within_gap_share']:.2f}; verified={replay['verified']}")
    return "\n".join(lines)


def default_dram_dir() -> str:
    return "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()
