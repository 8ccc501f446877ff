"""The ``lmcache-mp`` warm path against a real ``lmcache server`` on CPU, with real Valkey
(LMCache's own valkey L2 adapter, and our L2 adapter plugin).

An emulated engine (:class:`LMCacheMPClient`) registers a KV layout through LMCache's
engine-driven context mode and stores/looks up/retrieves through its shared-memory pool; the
agent's side (:class:`LMCacheWarmClient`) warms through ``POST /cache/prefetches``. Where the
engine's lookups were served from is read from the server's own per-model counters, which
split every lookup into tokens L1 already held and tokens it had to load from L2.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvprefetch.agents.embedded import EmbeddedValkey
from kvprefetch.agents.lmcache.errors import (
    LMCacheConfigMismatchError,
    LMCacheError,
    LMCacheNoLayoutError,
    LMCacheTimeoutError,
)
from kvprefetch.agents.lmcache.l2.adapter import plugin_adapter_json
from kvprefetch.agents.lmcache.mp_client import KVLayout, LMCacheMPClient
from kvprefetch.agents.lmcache.server import LMCacheServer
from kvprefetch.agents.lmcache.warm import LMCacheWarmClient, LookupHits, object_keys

pytestmark = pytest.mark.servers

CHUNK = 256
LAYOUT = KVLayout()  # 2 KiB per token: 512 KiB per chunk
CHUNK_BYTES = LAYOUT.chunk_bytes(CHUNK)


def _l2_adapter(kind: str, valkey: EmbeddedValkey) -> dict[str, Any]:
    if kind == "lmcache-valkey":
        return {"type": "valkey", "startup_nodes": f"{valkey.host}:{valkey.port}"}
    prefix = f"kvp-{uuid.uuid4().hex[:6]}:"
    return plugin_adapter_json(valkey=valkey.store_config(key_prefix=prefix))


def _shm_name() -> str:
    return f"kvp_test_{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module", params=["lmcache-valkey", "kvprefetch-plugin"])
def server(request: pytest.FixtureRequest, valkey_server: EmbeddedValkey
           ) -> Iterator[LMCacheServer]:
    """One engine-driven server with an L1 shared-memory pool per L2 adapter kind."""
    with LMCacheServer(l2_adapter=_l2_adapter(request.param, valkey_server),
                       chunk_size=CHUNK, l1_size_gb=0.25, transfer_mode="engine_driven",
                       shm_name=_shm_name()) as srv:
        yield srv


@pytest.fixture
def warm(server: LMCacheServer) -> Iterator[LMCacheWarmClient]:
    with LMCacheWarmClient(server.http_url) as client:
        yield client


@pytest.fixture
def engine(server: LMCacheServer) -> Iterator[LMCacheMPClient]:
    """An emulated engine worker, registered under a model name of its own."""
    layout = KVLayout(model_name=f"kvp-model-{uuid.uuid4().hex[:8]}")
    with LMCacheMPClient(server.host, server.port, layout, chunk_size=CHUNK,
                         http_url=server.http_url) as client:
        yield client


def _tokens(n: int, seed: int | None = None) -> list[int]:
    rng = random.Random(seed if seed is not None else uuid.uuid4().int)
    return [rng.randrange(128_000) for _ in range(n)]


def _wait(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _flushed_to_l2(warm: LMCacheWarmClient) -> None:
    _wait(lambda: warm.l2_write_backlog() == 0, "the L2 write-through")


def _hits_after(warm: LMCacheWarmClient, model: str, before: LookupHits,
                lookups: int) -> LookupHits:
    """The lookup counters' change once ``lookups`` more lookups have been counted."""
    _wait(lambda: (warm.lookup_hits(model) - before).lookups >= lookups,
          f"{lookups} lookup(s) of {model} in /metrics")
    return warm.lookup_hits(model) - before


# -- (a) LMCache's rule: no warm prefetch before an engine registered a layout --------------


def test_warm_is_refused_until_an_engine_registers_its_layout(
        server: LMCacheServer, warm: LMCacheWarmClient) -> None:
    model = f"kvp-late-{uuid.uuid4().hex[:8]}"
    tokens = _tokens(2 * CHUNK)
    with pytest.raises(LMCacheNoLayoutError, match="no layout registered") as refused:
        warm.prefetch(model, 1, tokens)
    assert refused.value.model_name == model and refused.value.world_size == 1
    with pytest.raises(LMCacheNoLayoutError):
        warm.check_compatible(chunk_size=CHUNK, model_name=model, require_layout=True)

    layout = KVLayout(model_name=model)
    with LMCacheMPClient(server.host, server.port, layout, chunk_size=CHUNK) as engine:
        assert engine.transport == "shm"
        assert (model, 1) in warm.registered_layouts()
        result = warm.prefetch(model, 1, tokens)  # accepted now; nothing stored, so 0 found
        assert (result.chunks, result.found_keys, result.total_keys) == (2, 0, 2)
    # The layout goes with the last worker that registered it.
    with pytest.raises(LMCacheNoLayoutError):
        warm.submit_prefetch(model, 1, tokens)


# -- (b) the full warm path ---------------------------------------------------------------


def test_full_warm_path_turns_the_next_lookup_into_an_l1_hit(
        warm: LMCacheWarmClient, engine: LMCacheMPClient) -> None:
    model = engine.layout.model_name
    tokens = _tokens(8 * CHUNK + 17)  # 8 complete chunks; the tail is never stored
    kv = engine.make_kv(len(tokens), seed=7)

    stored = engine.store(tokens, kv)
    assert (stored.total_chunks, stored.new_chunks, stored.bytes) == (8, 8, 8 * CHUNK_BYTES)
    assert engine.store(tokens, kv).new_chunks == 0  # already cached: nothing rewritten
    _flushed_to_l2(warm)

    warm.clear_l1()
    usage = warm.l1_usage()
    assert (usage.used_bytes, usage.object_count) == (0, 0)

    result = warm.prefetch(model, 1, tokens, key_bytes=CHUNK_BYTES)
    assert result.complete and (result.chunks, result.found_keys, result.total_keys) == (8, 8, 8)
    assert result.found_chunks == 8 and result.bytes == 8 * CHUNK_BYTES
    assert 0 < result.ttlb_s < 5
    usage = warm.l1_usage()
    assert (usage.used_bytes, usage.object_count) == (8 * CHUNK_BYTES, 8)

    before = warm.lookup_hits(model)
    got = engine.retrieve(tokens)
    assert got.lookup.full_hit and got.hit_tokens == 8 * CHUNK
    assert got.kv is not None and torch.equal(got.kv, kv[:, :, : 8 * CHUNK])
    assert got.kv_bytes() == kv[:, :, : 8 * CHUNK].contiguous().view(torch.uint8).numpy().tobytes()
    hits = _hits_after(warm, model, before, 1)
    assert (hits.hit_tokens, hits.l1_tokens, hits.l2_tokens) == (8 * CHUNK, 8 * CHUNK, 0)

    # Without the warm, the same lookup is LMCache's on-demand path: served, but from L2.
    warm.clear_l1()
    before = warm.lookup_hits(model)
    got = engine.retrieve(tokens)
    assert got.kv is not None and torch.equal(got.kv, kv[:, :, : 8 * CHUNK])
    hits = _hits_after(warm, model, before, 1)
    assert (hits.l1_tokens, hits.l2_tokens) == (0, 8 * CHUNK)


def test_a_growing_session_stores_only_its_new_chunks(
        warm: LMCacheWarmClient, engine: LMCacheMPClient) -> None:
    """Turn after turn, the engine offers the whole context; a KV source called per chunk
    is asked only for the chunks the server lacks, and lookups leave no lock behind."""
    tokens = _tokens(5 * CHUNK)
    kv = engine.make_kv(len(tokens), seed=5)
    asked: list[int] = []

    def chunk(index: int) -> torch.Tensor:
        asked.append(index)
        return kv[:, :, index * CHUNK : (index + 1) * CHUNK]

    assert engine.store(tokens[: 3 * CHUNK], chunk).new_chunks == 3
    assert engine.store(tokens, chunk).new_chunks == 2
    assert asked == [0, 1, 2, 3, 4]
    first = warm.prefetch(engine.layout.model_name, 1, tokens)
    second = warm.prefetch(engine.layout.model_name, 1, tokens)
    assert first.complete and second.complete and second.found_keys == 5
    assert engine.lookup(tokens).full_hit
    got = engine.retrieve(tokens)
    assert got.kv is not None and torch.equal(got.kv, kv)
    _flushed_to_l2(warm)
    warm.clear_l1()  # nothing is still read-locked by the lookups above
    assert warm.l1_usage().object_count == 0


def test_a_tensor_parallel_engine_is_one_worker_per_rank(
        server: LMCacheServer, warm: LMCacheWarmClient) -> None:
    """Each rank stores its own shard under its own key; a warm asks for every rank's key
    of every chunk (keys = chunks x world size) and the engine's lookup hits only when all
    ranks' shards are there."""
    model = f"kvp-tp-{uuid.uuid4().hex[:8]}"
    ranks = [LMCacheMPClient(server.host, server.port,
                             KVLayout(model_name=model, world_size=2, rank=r),
                             chunk_size=CHUNK) for r in (0, 1)]
    with ranks[0], ranks[1]:
        tokens = _tokens(4 * CHUNK)
        shards = [w.make_kv(len(tokens), seed=w.layout.rank) for w in ranks]
        ranks[0].store(tokens, shards[0])
        assert ranks[0].lookup(tokens).hit_chunks == 0  # rank 1's shards are missing
        ranks[1].store(tokens, shards[1])
        _flushed_to_l2(warm)
        warm.clear_l1()
        result = warm.prefetch(model, 2, tokens)
        assert (result.chunks, result.found_keys, result.total_keys) == (4, 8, 8)
        assert result.keys_per_chunk == 2 and result.found_chunks == 4
        for worker, shard in zip(ranks, shards, strict=True):
            got = worker.retrieve(tokens)
            assert got.kv is not None and torch.equal(got.kv, shard)
        assert len(object_keys(tokens, model_name=model, world_size=2)) == 8
        _flushed_to_l2(warm)
        warm.clear_l1()  # every rank's lookup lock was released
        assert warm.l1_usage().object_count == 0


# -- (c) partial: only a prefix is stored ---------------------------------------------------


def test_a_partly_stored_session_warms_only_its_stored_prefix(
        warm: LMCacheWarmClient, engine: LMCacheMPClient) -> None:
    model = engine.layout.model_name
    tokens = _tokens(8 * CHUNK)
    kv = engine.make_kv(3 * CHUNK, seed=3)
    assert engine.store(tokens[: 3 * CHUNK], kv).total_chunks == 3
    _flushed_to_l2(warm)
    warm.clear_l1()

    result = warm.prefetch(model, 1, tokens)
    assert (result.chunks, result.found_keys, result.total_keys) == (8, 3, 8)
    assert result.found_chunks == 3 and not result.complete
    assert warm.l1_usage().object_count == 3

    got = engine.retrieve(tokens)
    assert (got.lookup.hit_chunks, got.lookup.total_chunks) == (3, 8)
    assert got.kv is not None and torch.equal(got.kv, kv)

    noop = warm.prefetch(model, 1, tokens[: CHUNK - 1])  # no complete chunk: nothing to do
    assert noop.request_id is None and noop.total_keys == 0


# -- (d) start-up checks ------------------------------------------------------------------


def test_mismatched_settings_are_reported_at_start_up(
        server: LMCacheServer, warm: LMCacheWarmClient, engine: LMCacheMPClient) -> None:
    settings = warm.check_compatible(chunk_size=CHUNK, hash_algorithm="blake3",
                                     model_name=engine.layout.model_name, world_size=1,
                                     require_layout=True)
    assert (settings.chunk_size, settings.supported_transfer_mode) == (CHUNK, "engine_driven")

    with pytest.raises(LMCacheConfigMismatchError, match=r"chunk_size=256.*chunk_size=128") as e:
        warm.check_compatible(chunk_size=128, hash_algorithm="blake3")
    assert (e.value.field, e.value.expected, e.value.actual) == ("chunk_size", 128, 256)
    with pytest.raises(LMCacheConfigMismatchError) as e:
        warm.check_compatible(chunk_size=CHUNK, hash_algorithm="sha256_cbor")
    assert (e.value.field, e.value.expected, e.value.actual) == (
        "hash_algorithm", "sha256_cbor", "blake3")
    with pytest.raises(LMCacheConfigMismatchError) as e:
        warm.check_compatible(model_name=engine.layout.model_name, world_size=2)
    assert (e.value.field, e.value.expected, e.value.actual) == ("world_size", 2, 1)
    with pytest.raises(LMCacheConfigMismatchError) as e:
        LMCacheMPClient(server.host, server.port, chunk_size=128).connect()
    assert (e.value.field, e.value.actual) == ("chunk_size", 256)

    # What the check prevents: keys named with another chunk size match nothing, silently.
    tokens = _tokens(2 * CHUNK)
    engine.store(tokens, engine.make_kv(len(tokens)))
    model = engine.layout.model_name
    _flushed_to_l2(warm)  # until then the store controller holds the objects locked
    wrong = warm.delete(object_keys(tokens, model_name=model, chunk_size=128), tier="l1")
    assert (wrong.deleted, wrong.ok) == (0, True)
    right = warm.delete(object_keys(tokens, model_name=model, chunk_size=CHUNK), tier="l1")
    assert right.deleted == 2


# -- (e) eviction advice ------------------------------------------------------------------


def test_eviction_advice_deletes_from_l1_or_everywhere(
        warm: LMCacheWarmClient, engine: LMCacheMPClient) -> None:
    model = engine.layout.model_name
    tokens = _tokens(4 * CHUNK)
    engine.store(tokens, engine.make_kv(len(tokens)))
    _flushed_to_l2(warm)
    keys = object_keys(tokens, model_name=model, chunk_size=CHUNK)
    assert len(keys) == 4

    used = warm.l1_usage().used_bytes
    demoted = warm.delete(keys, tier="l1")
    assert (demoted.deleted, demoted.skipped, demoted.ok) == (4, 0, True)
    assert warm.l1_usage().used_bytes == used - 4 * CHUNK_BYTES
    assert warm.prefetch(model, 1, tokens).found_keys == 4  # L2 still has it

    dropped = warm.delete(keys, tier="all")
    assert dropped.ok and dropped.deleted == 8  # 4 from L1 + a batch of 4 for L2
    assert warm.prefetch(model, 1, tokens).found_keys == 0
    assert engine.lookup(tokens).hit_chunks == 0

    engine.store(tokens, engine.make_kv(len(tokens)))
    _flushed_to_l2(warm)
    assert warm.l1_usage().used_bytes > 0
    warm.clear_l1()
    assert warm.l1_usage().used_bytes == 0


# -- the transports and the transfer-mode boundary ------------------------------------------


def test_the_pickle_transport_round_trips_without_shared_memory() -> None:
    """Without ``--shm-name`` the KV travels pickled inside the ZMQ messages; ``auto`` mode
    serves GPU (lmcache-driven) and CPU (engine-driven) engines side by side."""
    with LMCacheServer(chunk_size=CHUNK, l1_size_gb=0.1, transfer_mode="auto",
                       shm_name=None) as srv:
        layout = KVLayout(model_name="kvp-pickle", dtype="bfloat16", num_layers=2)
        with LMCacheMPClient(srv.host, srv.port, layout, http_url=srv.http_url) as engine:
            assert engine.transport == "pickle"
            tokens = _tokens(2 * CHUNK + 5)
            kv = engine.make_kv(len(tokens), seed=1)
            raw = kv[:, :, : 2 * CHUNK].contiguous().view(torch.uint8).numpy().tobytes()
            assert engine.store(tokens, raw).total_chunks == 2  # raw bytes are accepted too
            got = engine.retrieve(tokens)
            assert got.lookup.full_hit and got.kv_bytes() == raw
            with pytest.raises(ValueError, match="bytes"):
                engine.store(tokens, raw[:-2])


def test_a_gpu_only_server_refuses_cpu_engines() -> None:
    """The boundary on CPU: a server in ``lmcache_driven`` mode (vLLM's CUDA IPC path, the
    server's default) has no handler for the engine-driven registration and never answers
    it. With its HTTP URL the client says so at once; without, it times out naming why."""
    with LMCacheServer(chunk_size=CHUNK, l1_size_gb=0.1, transfer_mode="lmcache_driven") as srv:
        with pytest.raises(LMCacheConfigMismatchError) as e:
            LMCacheMPClient(srv.host, srv.port, http_url=srv.http_url).connect()
        assert (e.value.field, e.value.actual) == ("supported_transfer_mode", "lmcache_driven")
        client = LMCacheMPClient(srv.host, srv.port, timeout_s=1.5)
        with pytest.raises(LMCacheTimeoutError, match="engine_driven or auto") as t:
            client.connect()
        assert t.value.operation == "register_kv_cache_engine_driven_context"
        assert not client.connected
        with LMCacheWarmClient(srv.http_url) as warm, pytest.raises(LMCacheNoLayoutError):
            warm.prefetch("kvp-gpu-model", 1, _tokens(CHUNK))


def test_an_absent_server_is_a_typed_error() -> None:
    from kvprefetch.agents.embedded import free_port

    port = free_port()
    with pytest.raises(LMCacheError, match="no LMCache server answers"):
        LMCacheMPClient("127.0.0.1", port, timeout_s=0.5).connect()
    with LMCacheWarmClient(f"http://127.0.0.1:{port}", timeout_s=1.0) as warm, \
            pytest.raises(LMCacheError, match="failed"):
        warm.l1_usage()
