"""LMCache's own L1 evictions reach the agent's reported evictions, against a real
``lmcache server`` (no L2: warms find what the engine stored in L1) and real Valkey (the
sessions' token ids).

The agent's ``lmcache-mp`` backend follows the server's KV events: a removal nobody asked
the agent for (``DELETE /cache/objects`` by someone else, L1's LRU past its watermark)
shows up in :meth:`PrefetchAgent.take_evictions` within about a second, for exactly the
sessions it warmed and from the first lost chunk on, as LMCache's own lookup sees it. A
gap in the events (a server restart; records trimmed from the log while the subscriber
lagged) withdraws every session the agent believed warm.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence

import pytest

from kvprefetch.agents.agent import AgentConfig, PrefetchAgent, RemoteStoreConfig
from kvprefetch.agents.backends.lmcache.warmer import KVEventsMode, LMCacheBackendConfig
from kvprefetch.agents.backends.tokens import synthetic_tokens
from kvprefetch.agents.embedded import EmbeddedValkey
from kvprefetch.agents.lmcache.engine_kv import LMCacheEngineConfig, LMCacheEngineKV
from kvprefetch.agents.lmcache.errors import LMCacheConfigMismatchError
from kvprefetch.agents.lmcache.keys import LMCacheKeySettings, chunk_hashes
from kvprefetch.agents.lmcache.kv_events import KVEventSubscriber, ResyncReason
from kvprefetch.agents.lmcache.mp_client import KVLayout, LMCacheMPClient
from kvprefetch.agents.lmcache.server import LMCacheServer
from kvprefetch.agents.lmcache.warm import LMCacheWarmClient, object_keys
from kvprefetch.controlplane.base.keys import position_keys, session_prefix, tenant_cache_salt
from kvprefetch.controlplane.base.wire import TransferOrder

pytestmark = pytest.mark.servers

CHUNK = 256
TENANT = "acme"
SALT = tenant_cache_salt(TENANT)
#: 64 KiB per chunk: a 10 MiB L1 holds 163 of them and evicts past 80 %.
TOKEN_BYTES = 256
L1_GB = 0.01
MODEL = "kvp-events"
_order_ids = itertools.count(1)


@pytest.fixture(scope="module")
def remote(valkey_server: EmbeddedValkey) -> RemoteStoreConfig:
    return RemoteStoreConfig(valkey=valkey_server.store_config(
        key_prefix=f"{uuid.uuid4().hex[:6]}:"))


def _server(*extra: str) -> LMCacheServer:
    return LMCacheServer(chunk_size=CHUNK, l1_size_gb=L1_GB, transfer_mode="engine_driven",
                         extra_args=extra)


def _engine(server: LMCacheServer, remote: RemoteStoreConfig) -> LMCacheEngineKV:
    store = remote.build()
    store.start()
    return LMCacheEngineKV(LMCacheEngineConfig(
        port=server.port, http_url=server.http_url, model_name=MODEL, chunk_size=CHUNK,
        token_bytes=TOKEN_BYTES), store).start()


def _agent(server: LMCacheServer, remote: RemoteStoreConfig,
           kv_events: KVEventsMode = "auto") -> PrefetchAgent:
    return PrefetchAgent(AgentConfig(
        node=0, backend="lmcache-mp", remote=remote, lmcache=LMCacheBackendConfig(
            http_url=server.http_url, model_name=MODEL, chunk_size=CHUNK,
            kv_events=kv_events, http_timeout_s=5.0)))


@pytest.fixture(scope="module")
def server() -> Iterator[LMCacheServer]:
    with _server() as srv:
        yield srv


@pytest.fixture(scope="module")
def engine(server: LMCacheServer, remote: RemoteStoreConfig) -> Iterator[LMCacheEngineKV]:
    kv = _engine(server, remote)
    yield kv
    kv.close()


@pytest.fixture(scope="module")
def agent(server: LMCacheServer, remote: RemoteStoreConfig,
          engine: LMCacheEngineKV) -> Iterator[PrefetchAgent]:
    with _agent(server, remote) as a:
        yield a


@pytest.fixture(scope="module")
def http(server: LMCacheServer) -> Iterator[LMCacheWarmClient]:
    with LMCacheWarmClient(server.http_url) as client:
        yield client


def _warmed(agent: PrefetchAgent, engine: LMCacheEngineKV, ctx: int,
            session: str | None = None) -> tuple[str, tuple[str, ...]]:
    """A session the engine stored and the agent then warmed: (its wire name, its keys)."""
    session = session or f"s-{uuid.uuid4().hex[:6]}"
    assert engine.write(TENANT, session, ctx) > 0
    oid = next(_order_ids)
    keys = tuple(position_keys(TENANT, session, ctx, CHUNK))
    agent.execute(TransferOrder(oid, f"{TENANT}/{session}", 0, keys, ctx, 0, True,
                                time.time() + 60))
    report = agent.wait(oid, 30.0)
    assert report is not None and report.complete, report
    assert all(agent.has(list(keys)))
    return f"{TENANT}/{session}", keys


def _reported(agent: PrefetchAgent, want: set[str], timeout_s: float) -> set[str]:
    """Every session the agent reports evicted until all of ``want`` are (or time out)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while not want <= seen and (left := deadline - time.monotonic()) > 0:
        evicted = agent.take_evictions(min(left, 0.2))
        if evicted is not None:
            seen.update(evicted.sessions)
    return seen


def _drain(agent: PrefetchAgent, quiet_s: float = 0.5) -> None:
    while agent.take_evictions(quiet_s) is not None:
        pass


def _object_keys(session: str, ctx: int) -> list[dict[str, object]]:
    return object_keys(synthetic_tokens(TENANT, session, ctx).tolist(), model_name=MODEL,
                       chunk_size=CHUNK, cache_salt=SALT)


# -- removals the agent did not ask for ------------------------------------------------------


def test_a_delete_by_someone_else_is_reported_within_a_second(
        agent: PrefetchAgent, engine: LMCacheEngineKV, http: LMCacheWarmClient) -> None:
    ctx = 4 * CHUNK + 10
    _, bystander_keys = _warmed(agent, engine, 3 * CHUNK)
    victim, keys = _warmed(agent, engine, ctx)
    _drain(agent)
    session = victim.split("/", 1)[1]
    started = time.monotonic()
    assert http.delete(_object_keys(session, ctx)[2:3], tier="l1").deleted == 1
    seen = _reported(agent, {victim}, 5.0)
    elapsed = time.monotonic() - started
    assert seen == {victim}, seen
    assert elapsed < 1.5, elapsed
    # From the first lost chunk on, as LMCache's lookup sees it; the tail goes with it.
    assert agent.has(list(keys)) == [True, True, False, False, False]
    assert set(agent.inventory()).isdisjoint(keys[2:])
    assert all(agent.has(list(bystander_keys)))
    got, _, _ = engine.read(TENANT, session, ctx, ctx)
    assert got == 2 * CHUNK
    stats = agent.kv_events()
    assert stats is not None and stats.state == "subscribed" and stats.removed_chunks >= 1
    assert stats.errors == 0, stats.last_error


def test_evict_advice_is_not_reported_back(agent: PrefetchAgent,
                                           engine: LMCacheEngineKV) -> None:
    """The scheduler's own advice is already in its books: LMCache's removal of those
    chunks names no session the agent still believes warm."""
    victim, keys = _warmed(agent, engine, 2 * CHUNK)
    _drain(agent)
    before = agent.kv_events()
    assert before is not None
    tenant, session = victim.split("/", 1)
    assert agent.evict([session_prefix(tenant, session)]) == 2
    assert _reported(agent, {victim}, 1.5) == set()
    after = agent.kv_events()
    assert after is not None and after.removed_chunks >= before.removed_chunks + 2
    assert not any(agent.has(list(keys)))


def test_l1_s_own_eviction_past_its_watermark_is_reported(
        agent: PrefetchAgent, engine: LMCacheEngineKV, http: LMCacheWarmClient) -> None:
    http.clear_l1()
    _drain(agent)
    assert agent.inventory() == ()
    victim, keys = _warmed(agent, engine, 4 * CHUNK)
    fill = f"fill-{uuid.uuid4().hex[:6]}"
    # 4 + 136 of L1's 163 chunks: past the 80 % watermark, so its LRU (run each second)
    # frees 20 %, the least recently used first: the victim.
    for i in range(34):
        engine.write(TENANT, f"{fill}-{i}", 4 * CHUNK)
    filled = time.monotonic()
    seen = _reported(agent, {victim}, 5.0)
    assert victim in seen, (seen, http.l1_usage())
    assert time.monotonic() - filled < 3.0  # the eviction loop's second, then the event
    # Only warmed sessions are the scheduler's business: the fills never were.
    assert seen == {victim}
    got, _, _ = engine.read(TENANT, victim.split("/", 1)[1], 4 * CHUNK, 4 * CHUNK)
    assert sum(agent.has(list(keys))) == got // CHUNK == 0


# -- gaps ------------------------------------------------------------------------------------


def test_a_server_restart_withdraws_every_warm_session_and_the_stream_resumes(
        remote: RemoteStoreConfig) -> None:
    with _server() as srv, _agent(srv, remote) as agent:
        engine = _engine(srv, remote)
        try:
            warm = {_warmed(agent, engine, 2 * CHUNK)[0] for _ in range(2)}
        finally:
            engine.close()
        srv.restart()  # same ports, empty L1, a new event-log incarnation
        assert _reported(agent, warm, 30.0) >= warm
        assert agent.inventory() == ()
        stats = agent.kv_events()
        assert stats is not None and stats.resyncs["server_restart"] == 1
        assert stats.reconnects >= 1
        # The subscription goes on with the new server.
        engine = _engine(srv, remote)
        try:
            session, _ = _warmed(agent, engine, 2 * CHUNK)
        finally:
            engine.close()
        with LMCacheWarmClient(srv.http_url) as http:
            http.delete(_object_keys(session.split("/", 1)[1], 2 * CHUNK), tier="l1")
        assert session in _reported(agent, {session}, 5.0)


class _SlowSink:
    """Blocks in its first ``removed`` until released, so that records pile up behind it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ResyncReason | list[bytes]]] = []
        self.first = threading.Event()
        self.release = threading.Event()
        self._lock = threading.Lock()

    def removed(self, chunk_hashes: Sequence[bytes]) -> None:
        with self._lock:
            self.calls.append(("removed", list(chunk_hashes)))
        if not self.first.is_set():
            self.first.set()
            self.release.wait(30.0)

    def resync(self, reason: ResyncReason) -> None:
        with self._lock:
            self.calls.append(("resync", reason))

    def wait_for(self, what: Callable[[list[tuple[str, ResyncReason | list[bytes]]]], bool]
                 ) -> bool:
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            with self._lock:
                if what(list(self.calls)):
                    return True
            time.sleep(0.02)
        return False


def _removed(calls: Sequence[tuple[str, ResyncReason | list[bytes]]]) -> list[bytes]:
    return [h for kind, got in calls if kind == "removed" and isinstance(got, list)
            for h in got]


def test_records_trimmed_while_the_subscriber_lagged_are_a_gap() -> None:
    """A two-record log: while the sink holds the first removal, LMCache streams one more
    batch and trims the rest; the next batch says ``lost``, and the sink resyncs before it
    gets the removals that are still in the log."""
    with _server("--kv-event-log-size", "2") as srv, LMCacheMPClient(
            srv.host, srv.port, KVLayout(model_name=MODEL), chunk_size=CHUNK,
            http_url=srv.http_url) as client, LMCacheWarmClient(srv.http_url) as http:
        sequences = [list(range(i * CHUNK, (i + 1) * CHUNK)) for i in range(6)]
        for tokens in sequences:
            client.store(tokens, client.make_kv(CHUNK))
        hashes = [bytes.fromhex(chunk_hashes(LMCacheKeySettings(
            model_name=MODEL, chunk_size=CHUNK), tokens)[0]) for tokens in sequences]
        sink = _SlowSink()
        events = KVEventSubscriber(f"tcp://{srv.host}:{srv.port}", MODEL, sink, timeout_s=5.0)
        assert events.start()
        try:
            def delete(i: int) -> None:
                keys = object_keys(sequences[i], model_name=MODEL, chunk_size=CHUNK)
                assert http.delete(keys, tier="l1").deleted == 1

            delete(0)
            assert sink.first.wait(5.0)
            for i in range(1, 6):  # one record each, a moment apart
                delete(i)
                time.sleep(0.2)
            sink.release.set()
            assert sink.wait_for(lambda calls: hashes[5] in _removed(calls))
            calls = list(sink.calls)
            assert ("resync", "events_lost") in calls, calls
            gap = calls.index(("resync", "events_lost"))
            assert hashes[5] in _removed(calls[gap:])
            # Some record was trimmed from the log before it was read.
            assert set(_removed(calls)) < set(hashes)
            stats = events.stats()
            assert stats.resyncs["events_lost"] == 1 and stats.state == "subscribed"
        finally:
            sink.release.set()
            events.close()
        assert events.stats().state == "closed"


# -- a server without the channel ------------------------------------------------------------


def test_a_server_without_kv_events_is_refused_or_warned_about(
        remote: RemoteStoreConfig, caplog: pytest.LogCaptureFixture) -> None:
    with _server("--kv-event-log-size", "0") as srv:
        with pytest.raises(LMCacheConfigMismatchError, match=r"kv_events\.enabled=False"):
            _agent(srv, remote, "required").start()
        with caplog.at_level(logging.WARNING), _agent(srv, remote) as agent:
            assert agent.kv_events() is None
        assert "publishes no KV events" in caplog.text
        with _agent(srv, remote, "off") as agent:
            assert agent.kv_events() is None
