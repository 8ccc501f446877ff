"""The kvprefetch HiCache storage backend through SGLang's own loader, over real Valkey and
S3 on loopback: SGLang's ``StorageBackendFactory`` with the dynamic config builds it, and
set / exists / batch_exists / batch_get (into host pages) return the stored bytes, byte for
byte; the node-local tier is read first; checksums catch damaged objects.

The zero-copy v1 calls run against a page-first host pool double
(:class:`kvprefetch.agents.sglang.host_pool.PageFirstHostPool`, the same methods and page geometry
as SGLang's ``MHATokenToKVPoolHost``): SGLang's real host pool cannot be built on CPU without
torchvision, which its config package imports.
SGLang is imported directly (see test_sglang_keys.py for the rule on a missing SGLang).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from sglang_guard import sglang_missing

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvprefetch.agents.sglang.backend import (
        KvPrefetchHiCacheStorage,
        SGLangStorageConfig,
        dynamic_extra_config,
    )
except ImportError as exc:  # pragma: no cover - the environment decides
    sglang_missing(exc)

from kvprefetch.agents.agent import RemoteStoreConfig
from kvprefetch.agents.sglang.host_pool import PageFirstHostPool
from kvprefetch.agents.sglang.keys import page_hashes
from kvprefetch.agents.stores.local import LocalTier, LocalTierConfig
from kvprefetch.agents.stores.tiered import TieredStoreConfig

pytestmark = pytest.mark.servers

LAYERS, HEADS, HEAD_DIM, PAGE = 4, 2, 16, 8


def host_pool(pages: int) -> PageFirstHostPool:
    return PageFirstHostPool(pages, PAGE, LAYERS * HEADS * HEAD_DIM)


def storage_config(extra: dict[str, object], tp_rank: int = 0) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=f"test/model-{uuid.uuid4().hex[:6]}", extra_config=extra)


@pytest.fixture
def remote(valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str
           ) -> RemoteStoreConfig:
    return RemoteStoreConfig(
        valkey=valkey_server.store_config(key_prefix=f"kvp:{key_prefix}", part_bytes=4096),
        s3=s3_server.store_config(key_prefix=f"kvp/{key_prefix}", part_bytes=4096),
        tiered=TieredStoreConfig(write_mode="write-through"))


@pytest.fixture
def local_config(dram_dir: Path) -> LocalTierConfig:
    return LocalTierConfig(path=str(dram_dir), capacity_bytes=64 << 20, part_bytes=4096)


@pytest.fixture
def backend(remote: RemoteStoreConfig, local_config: LocalTierConfig
            ) -> Iterator[KvPrefetchHiCacheStorage]:
    extra = dynamic_extra_config(SGLangStorageConfig(local=local_config, remote=remote))
    extra = json.loads(json.dumps(extra))  # what SGLang parses from its command line
    built = StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)
    assert isinstance(built, KvPrefetchHiCacheStorage)
    yield built
    built.close()


def pages(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2 * PAGE * LAYERS * HEADS * HEAD_DIM, generator=g
                        ).to(torch.bfloat16) for _ in range(n)]


def keys_for(n: int, seed: int) -> list[str]:
    return page_hashes([seed * 100_000 + i for i in range(n * PAGE)], PAGE)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_sglangs_loader_builds_it_and_a_round_trip_returns_the_bytes(
        backend: KvPrefetchHiCacheStorage) -> None:
    keys, values = keys_for(5, 1), pages(5, 1)
    assert backend.batch_exists(keys) == 0 and not backend.exists(keys[0])
    assert backend.set(keys[0], values[0])
    assert backend.batch_set(keys[1:3], values[1:3])
    assert backend.exists(keys[2]) and not backend.exists(keys[3])
    assert backend.batch_exists(keys) == 3  # consecutive from the first
    assert backend.batch_exists([keys[0], keys[3], keys[1]]) == 1
    dest = [torch.zeros_like(v) for v in values]
    got = backend.batch_get(keys, dest)
    assert [g is not None for g in got] == [True, True, True, False, False]
    for i in range(3):
        assert as_bytes(dest[i]) == as_bytes(values[i])
    assert not dest[3].any()
    one = torch.zeros_like(values[1])
    assert backend.get(keys[1], one) is one and as_bytes(one) == as_bytes(values[1])
    stats = backend.counters()
    assert stats["remote_hits"] == 4 and stats["local_hits"] == 0
    # SGLang's metrics hook wants its own StorageMetrics or None, never our dict
    assert backend.get_stats() is None


def test_pages_only_in_s3_are_served_and_objects_are_named_per_rank(
        backend: KvPrefetchHiCacheStorage, remote: RemoteStoreConfig) -> None:
    keys, values = keys_for(2, 2), pages(2, 2)
    assert backend.batch_set(keys, values)
    hot = remote.model_copy().valkey
    assert hot is not None
    from kvprefetch.agents.stores.valkey.store import ValkeyStore
    with ValkeyStore(hot) as valkey:  # drop Valkey's copies: S3 alone must serve
        names = [backend.scheme.object_name(k) for k in keys]
        assert all(r.ok for r in valkey.delete(names))
        assert all(n.startswith("sglang/") and n.endswith("_0_2") for n in names)
    dest = [torch.zeros_like(v) for v in values]
    assert all(g is not None for g in backend.batch_get(keys, dest))
    assert [as_bytes(d) for d in dest] == [as_bytes(v) for v in values]
    # Another TP rank names its shard differently: it does not see rank 0's pages.
    other = KvPrefetchHiCacheStorage(replace(backend.storage_config, tp_rank=1))
    try:
        assert other.scheme.suffix.endswith("_1_2")
        assert other.batch_exists(keys) == 0
    finally:
        other.close()


def test_local_tier_is_read_first_and_a_damaged_local_copy_falls_back(
        backend: KvPrefetchHiCacheStorage, local_config: LocalTierConfig) -> None:
    keys, values = keys_for(4, 3), pages(4, 3)
    names = [backend.scheme.object_name(k) for k in keys]
    with LocalTier(local_config) as tier:  # what the agent's warm leaves on the node
        assert all(r.ok for r in tier.put([(n, as_bytes(v)) for n, v in
                                           zip(names[:3], values[:3], strict=True)]))
        assert backend.batch_exists(keys) == 3  # no remote object at all
        dest = [torch.zeros_like(v) for v in values[:3]]
        assert all(g is not None for g in backend.batch_get(keys[:3], dest))
        assert [as_bytes(d) for d in dest] == [as_bytes(v) for v in values[:3]]
        assert backend.counters()["local_hits"] == 3
        # Flip one payload byte of a local file: the checksum refuses it; the remote
        # copy (written now) is served instead, intact.
        assert backend.set(keys[0], values[0])
        path = tier.path_of(names[0])
        raw = bytearray(path.read_bytes())
        raw[-5] ^= 0xFF
        path.write_bytes(bytes(raw))
        out = torch.zeros_like(values[0])
        assert backend.get(keys[0], out) is out
        assert as_bytes(out) == as_bytes(values[0])
        # A damaged local copy with no remote copy is a miss, never wrong bytes.
        path = tier.path_of(names[1])
        raw = bytearray(path.read_bytes())
        raw[-5] ^= 0xFF
        path.write_bytes(bytes(raw))
        assert backend.get(keys[1], torch.zeros_like(values[1])) is None


def test_zero_copy_v1_calls_land_in_the_host_pool(backend: KvPrefetchHiCacheStorage
                                                  ) -> None:
    pool = host_pool(8)
    g = torch.Generator().manual_seed(4)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g))
    backend.register_mem_pool_host(pool)  # type: ignore[arg-type]
    keys = keys_for(3, 4)
    src = torch.arange(0, 3 * PAGE)  # pages 0-2
    assert backend.batch_set_v1(keys, src) == [True, True, True]
    # Each object is the page's flat data page (K rows then V rows), as batch_set writes.
    flat = torch.zeros_like(pool.get_data_page(0))
    assert backend.get(keys[1], flat) is flat
    assert as_bytes(flat) == as_bytes(pool.get_data_page(PAGE))
    dst = torch.arange(4 * PAGE, 7 * PAGE)  # pages 4-6, different contents
    assert backend.batch_get_v1(keys + keys_for(1, 99), torch.arange(4 * PAGE, 8 * PAGE)
                                ) == [True, True, True, False]
    for i in range(3):
        assert as_bytes(pool.get_data_page(int(dst[i * PAGE]))) == \
            as_bytes(pool.get_data_page(i * PAGE))


def test_v1_reads_from_the_local_tier_land_in_the_pool_and_damage_falls_back(
        backend: KvPrefetchHiCacheStorage, local_config: LocalTierConfig) -> None:
    pool = host_pool(16)
    backend.register_mem_pool_host(pool)  # type: ignore[arg-type]
    keys, values = keys_for(9, 5), pages(9, 5)
    names = [backend.scheme.object_name(k) for k in keys]
    assert backend.batch_set(keys[:1], values[:1])  # a remote copy of page 0 only
    with LocalTier(local_config) as tier:  # the agent's warm: every page, flat
        assert all(r.ok for r in tier.put([(n, as_bytes(v)) for n, v in
                                           zip(names, values, strict=True)]))
        for i in (0, 4):  # damage pages 0 and 4 in the tier
            path = tier.path_of(names[i])
            raw = bytearray(path.read_bytes())
            raw[-(len(as_bytes(values[i])) // 2) - 1] ^= 0x10  # the K/V border
            path.write_bytes(bytes(raw))
        # Read on several threads into pages 7..15, each page as its K and V regions.
        got = backend.batch_get_v1(keys, torch.arange(7 * PAGE, 16 * PAGE))
    assert got == [True, True, True, True, False, True, True, True, True]
    for i in range(9):
        if i != 4:
            assert as_bytes(pool.get_data_page((7 + i) * PAGE)) == as_bytes(values[i]), i
    stats = backend.counters()
    assert stats["local_hits"] == 7 and stats["local_bad"] == 2
    assert stats["remote_hits"] == 1 and stats["misses"] == 1
