"""The agent's ``lmcache-mp`` backend and the engine emulator's LMCache path, against a real
``lmcache server`` whose L2 is our adapter over real Valkey and S3.

The full warm path: the engine stores a session's KV through LMCache (and its token ids in
the remote store), LMCache writes it through to our adapter (listed by its own
``GET /cache/objects`` under the keys :mod:`kvprefetch.agents.lmcache.keys` computes), L1 is
cleared, the agent executes a transfer order by warming L1 from L2
through ``POST /cache/prefetches``, and the engine's next retrieve is served from L1 alone
(LMCache's own counters: L1 tokens, no L2 load).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from kvprefetch.agents.agent import AgentConfig, PrefetchAgent, RemoteStoreConfig
from kvprefetch.agents.backends.lmcache.warmer import LMCacheBackendConfig
from kvprefetch.agents.backends.tokens import synthetic_tokens
from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
from kvprefetch.agents.lmcache.engine_kv import LMCacheEngineConfig, LMCacheEngineKV
from kvprefetch.agents.lmcache.errors import LMCacheConfigMismatchError
from kvprefetch.agents.lmcache.keys import LMCacheKeySettings, chunk_hashes
from kvprefetch.agents.lmcache.l2.adapter import plugin_adapter_json
from kvprefetch.agents.lmcache.server import LMCacheServer
from kvprefetch.agents.lmcache.warm import LMCacheWarmClient, LookupHits
from kvprefetch.controlplane.base.keys import position_keys, session_prefix, tenant_cache_salt
from kvprefetch.controlplane.base.wire import TransferOrder

pytestmark = pytest.mark.servers

CHUNK = 256
TENANT = "acme"
#: The tenant's cache salt: the engine stores and reads its KV under it, the agent warms it.
SALT = tenant_cache_salt(TENANT)


@pytest.fixture(scope="module")
def remote(valkey_server: EmbeddedValkey, s3_server: EmbeddedS3) -> RemoteStoreConfig:
    run = uuid.uuid4().hex[:6]
    return RemoteStoreConfig(valkey=valkey_server.store_config(key_prefix=f"{run}:"),
                             s3=s3_server.store_config(key_prefix=f"{run}/"))


@pytest.fixture(scope="module")
def server(remote: RemoteStoreConfig) -> Iterator[LMCacheServer]:
    adapter = plugin_adapter_json(valkey=remote.valkey, s3=remote.s3)
    with LMCacheServer(l2_adapter=adapter, chunk_size=CHUNK, l1_size_gb=0.1,
                       transfer_mode="engine_driven") as srv:
        yield srv


@pytest.fixture(scope="module")
def engine(server: LMCacheServer, remote: RemoteStoreConfig) -> Iterator[LMCacheEngineKV]:
    store = remote.build()
    store.start()
    kv = LMCacheEngineKV(LMCacheEngineConfig(port=server.port, http_url=server.http_url,
                                             chunk_size=CHUNK, token_bytes=256), store)
    kv.start()
    yield kv
    kv.close()
    store.close()


@pytest.fixture(scope="module")
def agent(server: LMCacheServer, remote: RemoteStoreConfig,
          engine: LMCacheEngineKV) -> Iterator[PrefetchAgent]:
    cfg = AgentConfig(node=0, backend="lmcache-mp", remote=remote, lmcache=LMCacheBackendConfig(
        http_url=server.http_url, model_name=engine.config.model_name, chunk_size=CHUNK,
        chunk_bytes=engine.config.layout().chunk_bytes(CHUNK)))
    with PrefetchAgent(cfg) as a:
        yield a


@pytest.fixture(scope="module")
def warm(server: LMCacheServer) -> Iterator[LMCacheWarmClient]:
    with LMCacheWarmClient(server.http_url) as client:
        yield client


def _hits(warm: LMCacheWarmClient, model: str, before: LookupHits) -> LookupHits:
    """The lookup counters since ``before`` (LMCache updates them just after a lookup)."""
    deadline = time.monotonic() + 5.0
    while True:
        delta = warm.lookup_hits(model, SALT) - before
        if delta.lookups or time.monotonic() > deadline:
            return delta
        time.sleep(0.05)


def _order(oid: int, session: str, tokens: int) -> TransferOrder:
    keys = tuple(position_keys(TENANT, session, tokens, CHUNK))
    return TransferOrder(oid, f"{TENANT}/{session}", 0, keys, tokens, 0, True, time.time() + 60)


def test_agent_warms_l1_and_the_engine_hits_without_an_l2_load(
        server: LMCacheServer, engine: LMCacheEngineKV, agent: PrefetchAgent,
        warm: LMCacheWarmClient) -> None:
    session, ctx = f"s-{uuid.uuid4().hex[:6]}", 5 * CHUNK + 10
    assert engine.write(TENANT, session, ctx) == 5 * engine.config.layout().chunk_bytes(CHUNK)
    # LMCache writes the chunks through to our adapter: its own listing shows them, under
    # exactly the keys kvprefetch.agents.lmcache.keys computes from the session's token ids.
    # The write-through is asynchronous (its backlog can read 0 before the store is queued),
    # so the listing is polled until it holds every chunk or the deadline passes.
    model = engine.config.model_name
    tokens = synthetic_tokens(TENANT, session, ctx)
    expected = chunk_hashes(LMCacheKeySettings(model_name=model, chunk_size=CHUNK), tokens)
    assert len(expected) == 5
    deadline = time.monotonic() + 30
    while True:
        listed = server.get_json(f"/cache/objects?model_name={model}&page_size=5000")
        hashes = {e["key"]["chunk_hash_hex"] for e in listed["entries"]}
        if set(expected) <= hashes and not warm.l2_write_backlog():
            break
        assert time.monotonic() < deadline, (sorted(set(expected) - hashes),
                                             warm.l2_write_backlog())
        time.sleep(0.05)
    assert listed["adapter"] == "plugin"
    warm.clear_l1()
    assert warm.l1_usage().used_bytes == 0

    agent.execute(_order(1, session, ctx))
    report = agent.wait(1, 30.0)
    assert report is not None and report.complete, report
    # Five whole chunks warmed; LMCache never keys the partial tail (nothing to move).
    assert (report.keys_moved, report.keys_present, report.keys_missed) == (5, 1, 0)
    assert report.bytes_moved == 5 * engine.config.layout().chunk_bytes(CHUNK)
    assert warm.l1_usage().used_bytes > 0

    before = warm.lookup_hits(model, SALT)
    tokens, nbytes, _ = engine.read(TENANT, session, ctx, ctx)
    assert (tokens, nbytes) == (5 * CHUNK, 5 * CHUNK * 256)
    hits = _hits(warm, model, before)
    assert hits.l1_tokens == 5 * CHUNK and hits.l2_tokens == 0


def test_without_a_warm_the_engine_waits_for_an_l2_load(
        engine: LMCacheEngineKV, warm: LMCacheWarmClient) -> None:
    session, ctx = f"s-{uuid.uuid4().hex[:6]}", 3 * CHUNK
    engine.write(TENANT, session, ctx)
    deadline = time.monotonic() + 10
    while warm.l2_write_backlog() and time.monotonic() < deadline:
        time.sleep(0.05)
    warm.clear_l1()
    model = engine.config.model_name
    before = warm.lookup_hits(model, SALT)
    tokens, _, _ = engine.read(TENANT, session, ctx, ctx)
    assert tokens == 3 * CHUNK
    hits = _hits(warm, model, before)
    assert hits.l2_tokens == 3 * CHUNK and hits.l1_tokens == 0


def test_evict_advice_drops_the_session_from_l1(
        engine: LMCacheEngineKV, agent: PrefetchAgent, warm: LMCacheWarmClient) -> None:
    session = f"s-{uuid.uuid4().hex[:6]}"
    engine.write(TENANT, session, 4 * CHUNK)
    deadline = time.monotonic() + 10
    while warm.l2_write_backlog() and time.monotonic() < deadline:
        time.sleep(0.05)
    used = warm.l1_usage().used_bytes
    assert agent.evict([session_prefix(TENANT, session)]) == 4
    assert warm.l1_usage().used_bytes == used - 4 * engine.config.layout().chunk_bytes(CHUNK)


def test_an_order_for_a_session_without_token_ids_is_a_miss(agent: PrefetchAgent) -> None:
    agent.execute(_order(2, "never-stored", 2 * CHUNK))
    report = agent.wait(2, 30.0)
    assert report is not None and not report.complete
    assert report.keys_missed == 2 and report.keys_moved == 0
    assert "not in the remote store" in report.error


def test_mismatched_chunk_size_is_refused_at_start(server: LMCacheServer,
                                                    remote: RemoteStoreConfig) -> None:
    cfg = AgentConfig(node=0, backend="lmcache-mp", remote=remote, lmcache=LMCacheBackendConfig(
        http_url=server.http_url, model_name="kvp-emulated", chunk_size=128))
    with pytest.raises(LMCacheConfigMismatchError, match=r"chunk_size=256.*chunk_size=128"):
        PrefetchAgent(cfg).start()


def test_backend_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="backend 'lmcache-mp' needs 'lmcache'"):
        AgentConfig(node=0, backend="lmcache-mp", remote=RemoteStoreConfig())
    with pytest.raises(ValueError, match="backend 'local' needs 'dram'"):
        AgentConfig(node=0, remote=RemoteStoreConfig())
