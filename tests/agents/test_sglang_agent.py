"""The agent's ``sglang`` backend over real Valkey and S3: an order warms the node-local
tier with the session's SGLang page objects (every TP rank's), SGLang's HiCache backend then
serves them from that tier (no remote read), evict advice frees them, and the report is in
the order's own keys. SGLang is imported directly (see test_sglang_keys.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import replace

import pytest
from sglang_guard import sglang_missing

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from kvprefetch.agents.sglang.backend import KvPrefetchHiCacheStorage, SGLangStorageConfig
except ImportError as exc:  # pragma: no cover - the environment decides
    sglang_missing(exc)

from kvprefetch.agents.agent import AgentConfig, PrefetchAgent, RemoteStoreConfig
from kvprefetch.agents.backends.sglang.warmer import SGLangWarmConfig
from kvprefetch.agents.backends.tokens import put_session_tokens, synthetic_tokens
from kvprefetch.agents.sglang.keys import PageKeyScheme, page_hashes
from kvprefetch.agents.stores.local import LocalTierConfig
from kvprefetch.controlplane.base.keys import position_keys, tenant_cache_salt
from kvprefetch.controlplane.base.wire import TransferOrder

pytestmark = pytest.mark.servers

TENANT, PAGE, CHUNK, MODEL = "acme", 16, 64, "test/tiny"
PAGE_FLOATS = 2 * PAGE * 2 * 4 * 8  # K and V, page tokens, layers, heads, dim


def engines(remote: RemoteStoreConfig, dram: LocalTierConfig
            ) -> Iterator[list[KvPrefetchHiCacheStorage]]:
    base = HiCacheStorageConfig(
        tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=MODEL, extra_config={"kvprefetch": SGLangStorageConfig(
            local=dram, remote=remote).model_dump()})
    ranks = [KvPrefetchHiCacheStorage(replace(base, tp_rank=r)) for r in range(2)]
    yield ranks
    for r in ranks:
        r.close()


@pytest.fixture
def ranks(remote: RemoteStoreConfig, dram: LocalTierConfig
          ) -> Iterator[list[KvPrefetchHiCacheStorage]]:
    yield from engines(remote, dram)


@pytest.fixture
def agent(remote: RemoteStoreConfig, dram: LocalTierConfig) -> Iterator[PrefetchAgent]:
    config = AgentConfig(node=0, backend="sglang", dram=dram, remote=remote,
                         sglang=SGLangWarmConfig(model_name=MODEL, page_size=PAGE,
                                                 tp_size=2))
    with PrefetchAgent(config) as a:
        yield a


def test_config_needs_both_sections(remote: RemoteStoreConfig, dram: LocalTierConfig
                                    ) -> None:
    with pytest.raises(ValueError, match="backend 'sglang' needs"):
        AgentConfig(node=0, backend="sglang", dram=dram, remote=remote)


def test_an_order_warms_sglangs_pages_and_evict_frees_them(
        agent: PrefetchAgent, ranks: list[KvPrefetchHiCacheStorage]) -> None:
    session = f"s-{uuid.uuid4().hex[:6]}"
    tokens = synthetic_tokens(TENANT, session, 5 * PAGE + 3).tolist()  # 5 full pages
    # the tenant's requests carry its cache salt: SGLang names their pages under it
    hashes = page_hashes(tokens[: 5 * PAGE], PAGE, cache_salt=tenant_cache_salt(TENANT))
    g = torch.Generator().manual_seed(1)
    data = {r: [torch.randn(PAGE_FLOATS, generator=g) for _ in hashes] for r in range(2)}
    for r, rank in enumerate(ranks):  # what SGLang's write-back leaves in L3
        assert rank.batch_set(hashes, data[r])
    assert put_session_tokens(agent.store, TENANT, session, tokens)
    assert all(rank.batch_exists(hashes) == 5 for rank in ranks)
    assert ranks[0].counters()["local_hits"] == 0

    keys = tuple(position_keys(TENANT, session, len(tokens), CHUNK))
    order = TransferOrder(1, f"{TENANT}/{session}", 0, keys, len(tokens), 0, True,
                          time.time() + 60)
    agent.execute(order)
    report = agent.wait(1, timeout_s=30)
    assert report is not None and report.complete, report
    assert report.keys_moved == len(keys) and report.bytes_moved >= 10 * PAGE_FLOATS * 4
    names = [PageKeyScheme(MODEL, tp_rank=r, tp_size=2).object_name(h)
             for h in hashes for r in range(2)]
    assert sorted(agent.inventory()) == sorted(names)
    assert agent.has(names) == [True] * 10

    for r, rank in enumerate(ranks):  # served from the node's tier, byte for byte
        dest = [torch.zeros(PAGE_FLOATS) for _ in hashes]
        assert all(x is not None for x in rank.batch_get(hashes, dest))
        assert all(torch.equal(a, b) for a, b in zip(dest, data[r], strict=True))
        stats = rank.counters()
        assert stats["local_hits"] == 5 and stats["remote_hits"] == 0

    assert agent.evict(prefixes=[f"{TENANT}/{session}/"]) == 10
    assert agent.inventory() == ()
    assert ranks[0].local is not None and ranks[0].local.prefix_hits(
        [ranks[0].scheme.object_name(h) for h in hashes]) == 0
    assert ranks[0].batch_exists(hashes) == 5  # still in the remote store


def test_a_session_without_token_ids_is_reported_missed(agent: PrefetchAgent) -> None:
    session = f"s-{uuid.uuid4().hex[:6]}"
    keys = tuple(position_keys(TENANT, session, 3 * CHUNK, CHUNK))
    agent.execute(TransferOrder(2, f"{TENANT}/{session}", 0, keys, 3 * CHUNK, 0, True,
                                time.time() + 60))
    report = agent.wait(2, timeout_s=30)
    assert report is not None and not report.complete and report.keys_missed == len(keys)


def test_another_tenants_pages_for_the_same_tokens_are_never_warmed(
        agent: PrefetchAgent, ranks: list[KvPrefetchHiCacheStorage]) -> None:
    """The same token ids stored by another tenant (here: requests without a salt, the
    default tenant's) are not this tenant's KV: its order finds none of them."""
    session = f"s-{uuid.uuid4().hex[:6]}"
    tokens = synthetic_tokens(TENANT, session, 3 * PAGE).tolist()
    unsalted = page_hashes(tokens, PAGE)
    for rank in ranks:
        assert rank.batch_set(unsalted, [torch.zeros(PAGE_FLOATS) for _ in unsalted])
    assert put_session_tokens(agent.store, TENANT, session, tokens)
    keys = tuple(position_keys(TENANT, session, len(tokens), CHUNK))
    agent.execute(TransferOrder(3, f"{TENANT}/{session}", 0, keys, len(tokens), 0, True,
                                time.time() + 60))
    report = agent.wait(3, timeout_s=30)
    assert report is not None and not report.complete and report.keys_moved == 0, report
    assert report.keys_missed == len(keys)
    salted = page_hashes(tokens, PAGE, cache_salt=tenant_cache_salt(TENANT))
    local = ranks[0].local
    assert local is not None
    assert local.prefix_hits([ranks[0].scheme.object_name(h) for h in salted]) == 0
