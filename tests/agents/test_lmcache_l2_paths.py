"""The L2 adapter's critical paths against real Valkey and S3 on loopback:
lookups answered from the adapter's index (no round trip per key, never S3), a stale index
that falls back on load, write-back stores acknowledged at Valkey speed with a bounded,
journaled upload backlog (back-pressure, restart), and LMCache's conventions."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from test_lmcache_adapter import (
    WAIT_S,
    GatedStore,
    content,
    keys,
    load,
    lookup,
    memory_objects,
    params,
    store,
)

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
from kvprefetch.agents.lmcache.l2.adapter import KvPrefetchL2Adapter
from kvprefetch.agents.stores.write_back import journal_backlog

pytestmark = pytest.mark.servers
KIB = 1024
#: Uploads never start on their own in these tests (they wait for a quiet minute).
HOLD_UPLOADS = {"quiet_s": 60.0, "max_defer_s": 60.0}


class CountingClient:
    """Counts the round trips made through a valkey-py client: each command called on it
    and each pipeline executed (however many commands the pipeline holds)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.round_trips = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name == "pipeline":
            def pipeline(*args: Any, **kwargs: Any) -> Any:
                pipe = attr(*args, **kwargs)
                execute = pipe.execute

                def counted(*a: Any, **kw: Any) -> Any:
                    self.round_trips += 1
                    return execute(*a, **kw)

                pipe.execute = counted
                return pipe
            return pipeline
        if not callable(attr):
            return attr

        def command(*args: Any, **kwargs: Any) -> Any:
            self.round_trips += 1
            return attr(*args, **kwargs)

        return command


@pytest.fixture
def s3_calls() -> Iterator[list[str]]:
    yield []


def count_s3_calls(adapter: KvPrefetchL2Adapter, calls: list[str]) -> None:
    assert adapter._stores.s3 is not None
    adapter._stores.s3.client.meta.events.register(
        "before-call.s3.*", lambda model, **_: calls.append(model.name))


def wait_until(predicate: Any, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


# -- lookups ----------------------------------------------------------------------------------


def test_lookup_answers_from_the_index_in_at_most_one_round_trip(
        valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str,
        s3_calls: list[str]) -> None:
    a = KvPrefetchL2Adapter(params(valkey_server, s3_server, key_prefix,
                                   index_reconcile_s=0, write_back=HOLD_UPLOADS))
    try:
        wait_until(lambda: a._stores.index.stats().reconciles >= 1)  # the start-up listing
        stored = keys(8)
        assert store(a, stored, memory_objects([3 * KIB] * 8)).is_successful()
        assert a._stores.valkey is not None
        counting = CountingClient(a._stores.valkey._conn._client)
        a._stores.valkey._conn._client = counting
        count_s3_calls(a, s3_calls)
        # Stored here: answered from memory, no round trip at all.
        assert lookup(a, stored) == [True] * 8
        assert counting.round_trips == 0
        # 32 keys the index does not know: one pipelined round trip for the whole task.
        assert lookup(a, keys(32, start=100)) == [False] * 32
        assert counting.round_trips == 1
        # Mixed: the unknown ones only, again one round trip.
        assert lookup(a, stored[:2] + keys(2, start=200)) == [True, True, False, False]
        assert counting.round_trips == 2
        assert s3_calls == []  # never S3 on the lookup path
        a._stores.valkey._conn._client = counting.inner
        a.submit_unlock(stored + stored + stored[:2])
    finally:
        a.close()


def test_lookup_finds_objects_only_s3_holds_through_the_listing(
        valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str) -> None:
    """Another process's objects that Valkey no longer holds: known once the index is
    reconciled with the S3 listing (lookups still never ask S3)."""
    writer = KvPrefetchL2Adapter(params(valkey_server, s3_server, key_prefix,
                                        tiered={"write_mode": "write-through"}))
    ks, objs = keys(3), memory_objects([5 * KIB] * 3)
    try:
        assert store(writer, ks, objs).is_successful()
        assert writer._stores.valkey is not None
        writer._stores.valkey.delete([writer.name_of(k) for k in ks])  # evicted from Valkey
    finally:
        writer.close()
    reader = KvPrefetchL2Adapter(params(valkey_server, s3_server, key_prefix,
                                        index_reconcile_s=0))
    try:
        wait_until(lambda: reader._stores.index.stats().reconciles >= 1)
        assert lookup(reader, ks) == [True] * 3
        dest = memory_objects([5 * KIB] * 3, b"\0")
        assert load(reader, ks, dest) == [True] * 3
        assert [content(d) for d in dest] == [content(o) for o in objs]
        reader.submit_unlock(ks)
    finally:
        reader.close()


def test_lookup_index_off_asks_every_tier_on_each_lookup(
        valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str,
        s3_calls: list[str]) -> None:
    """``lookup_index: false``: another writer's objects that only S3 holds are found at
    once (no reconciliation needed), at the price of S3 on the lookup path."""
    writer = KvPrefetchL2Adapter(params(valkey_server, s3_server, key_prefix,
                                        tiered={"write_mode": "write-through"}))
    reader = KvPrefetchL2Adapter(params(valkey_server, s3_server, key_prefix,
                                        index_reconcile_s=0, lookup_index=False))
    ks, objs = keys(3), memory_objects([5 * KIB] * 3)
    try:
        wait_until(lambda: reader._stores.index.stats().reconciles >= 1)  # before the writer's put
        assert store(writer, ks, objs).is_successful()
        assert writer._stores.valkey is not None
        writer._stores.valkey.delete([writer.name_of(k) for k in ks[:2]])  # evicted from Valkey
        count_s3_calls(reader, s3_calls)
        assert lookup(reader, ks + keys(1, start=50)) == [True, True, True, False]
        assert s3_calls.count("HeadObject") == 3  # the two Valkey lacks, and the unknown one
        reader.submit_unlock(ks)
    finally:
        writer.close()
        reader.close()


def test_a_stale_present_index_falls_back_on_load(
        valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str) -> None:
    a = KvPrefetchL2Adapter(params(valkey_server, s3_server, key_prefix, index_reconcile_s=0))
    try:
        ks, objs = keys(2), memory_objects([300 * KIB, 7 * KIB])
        assert store(a, ks, objs).is_successful()
        assert a.drain_uploads(WAIT_S)
        assert a._stores.valkey is not None
        names = [a.name_of(k) for k in ks]
        a._stores.valkey.delete(names[:1])  # key 0: gone from Valkey, still in S3
        a.store.delete(names[1:])  # key 1: gone from both tiers, behind the adapter's back
        assert lookup(a, ks) == [True, True]  # the index still says both are there
        dest = memory_objects([300 * KIB, 7 * KIB], b"\0")
        assert load(a, ks, dest) == [True, False]  # key 0 from S3; key 1 a clean miss
        assert content(dest[0]) == content(objs[0])
        assert a._stores.index.stats().stale_present == 1
        assert lookup(a, ks) == [True, False]  # the stale entry is gone
        a.submit_unlock(ks + ks[:1])
    finally:
        a.close()


# -- write-back -------------------------------------------------------------------------------


def s3_has(s3_server: EmbeddedS3, a: KvPrefetchL2Adapter, ks: list[Any]) -> list[bool]:
    assert a._stores.s3 is not None
    return [r.ok for r in a._stores.s3.exists([a.name_of(k) for k in ks])]


def read_from_s3_alone(s3_server: EmbeddedS3, key_prefix: str, ks: list[Any],
                       sizes: list[int]) -> list[bytes]:
    s3_only = KvPrefetchL2Adapter(params(None, s3_server, key_prefix))
    try:
        dest = memory_objects(sizes, b"\0")
        assert load(s3_only, ks, dest) == [True] * len(ks)
        return [content(d) for d in dest]
    finally:
        s3_only.close()


def test_write_back_acks_before_s3_has_it_then_drains(
        valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str) -> None:
    a = KvPrefetchL2Adapter(params(valkey_server, s3_server, key_prefix))
    assert a._stores.uploads is not None
    gate = GatedStore(a._stores.uploads.cold)
    a._stores.uploads.cold = gate  # S3 uploads wait at the gate
    sizes = [600 * KIB, 3 * KIB, 256 * KIB]
    ks, objs = keys(3), memory_objects(sizes)
    expected = [content(o) for o in objs]
    try:
        assert store(a, ks, objs).is_successful()  # acknowledged with S3 still empty
        for o in objs:  # LMCache may reuse the memory once the task completed
            o.raw_data.fill_(0)
        assert s3_has(s3_server, a, ks) == [False] * 3
        time.sleep(0.1)
        stats = a.write_back_stats()
        assert stats.pending_keys == 3 and stats.pending_bytes == sum(sizes)
        assert stats.oldest_pending_age_s >= 0.1
        status = a.report_status()["write_back"]
        assert status["pending_bytes"] == sum(sizes)
        gate.gate.set()
        assert a.drain_uploads(WAIT_S)
        stats = a.write_back_stats()
        assert stats.pending_keys == 0 and stats.oldest_pending_age_s == 0
        assert stats.uploaded_keys == 3 and stats.uploaded_bytes == sum(sizes)
        assert s3_has(s3_server, a, ks) == [True] * 3
    finally:
        gate.gate.set()
        a.close()
    assert read_from_s3_alone(s3_server, key_prefix, ks, sizes) == expected


def test_write_through_stays_an_option(
        valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str) -> None:
    a = KvPrefetchL2Adapter(params(valkey_server, s3_server, key_prefix,
                                   tiered={"write_mode": "write-through"}))
    try:
        assert a.write_back_stats() is None
        ks = keys(2)
        assert store(a, ks, memory_objects([5 * KIB] * 2)).is_successful()
        assert s3_has(s3_server, a, ks) == [True, True]  # S3 had it before the ack
    finally:
        a.close()


def test_back_pressure_when_the_backlog_is_full(
        valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str) -> None:
    a = KvPrefetchL2Adapter(params(
        valkey_server, s3_server, key_prefix,
        write_back={"max_backlog_bytes": 512 * KIB, "full_wait_s": 1.0}))
    assert a._stores.uploads is not None
    gate = GatedStore(a._stores.uploads.cold)
    a._stores.uploads.cold = gate
    try:
        assert store(a, keys(1), memory_objects([400 * KIB])).is_successful()
        started = time.monotonic()
        refused = store(a, keys(1, start=1), memory_objects([200 * KIB]))
        assert not refused.is_successful()  # no room came within full_wait_s
        assert time.monotonic() - started >= 0.9
        stats = a.write_back_stats()
        assert stats.full_waits == 1 and stats.rejected_full == 1 and stats.pending_keys == 1
        # A store that waits goes through as soon as the backlog drains below the bound.
        threading.Timer(0.3, gate.gate.set).start()
        assert store(a, keys(1, start=2), memory_objects([200 * KIB])).is_successful()
        assert a.write_back_stats().full_waits == 2
        assert a.drain_uploads(WAIT_S)
    finally:
        gate.gate.set()
        a.close()


def test_a_restart_requeues_pending_uploads_and_counts_the_lost(
        valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str) -> None:
    p = params(valkey_server, s3_server, key_prefix,
               write_back={**HOLD_UPLOADS, "close_drain_s": 0})
    sizes = [300 * KIB, 9 * KIB, 40 * KIB]
    ks, objs = keys(3), memory_objects(sizes)
    expected = [content(o) for o in objs]
    first = KvPrefetchL2Adapter(p)
    try:
        assert store(first, ks, objs).is_successful()
        assert first._stores.uploads is not None
        journal = first._stores.uploads.journal
        assert s3_has(s3_server, first, ks) == [False] * 3
    finally:
        first.close()  # a crash, as far as S3 is concerned: nothing was uploaded
    import valkey as valkey_py

    raw = valkey_py.Valkey(host=valkey_server.host, port=valkey_server.port,
                           password=valkey_server.password)
    try:
        assert journal_backlog(raw, journal) == (3, sum(sizes))
        # Valkey loses one acknowledged object before anyone uploads it.
        raw.delete(f"kvp:h:{key_prefix}" + _name_tail(ks[2]))
        second = KvPrefetchL2Adapter(params(valkey_server, s3_server, key_prefix))
        try:
            stats = second.write_back_stats()
            assert stats.requeued_on_start == 3
            assert second.drain_uploads(WAIT_S)
            stats = second.write_back_stats()
            assert stats.uploaded_keys == 2 and stats.lost_keys == 1  # counted, not silent
        finally:
            second.close()
        assert journal_backlog(raw, journal) == (0, 0)
    finally:
        raw.close()
    assert read_from_s3_alone(s3_server, key_prefix, ks[:2], sizes[:2]) == expected[:2]


def _name_tail(key: Any) -> str:
    from kvprefetch.agents.lmcache.l2.adapter import object_key_name

    return object_key_name(key)


# -- LMCache's conventions --------------------------------------------------------------------


def test_length_mismatch_is_named_as_lmcache_expects(
        valkey_server: EmbeddedValkey, key_prefix: str) -> None:
    a = KvPrefetchL2Adapter(params(valkey_server, None, key_prefix))
    try:
        with pytest.raises(ValueError, match="length mismatch"):
            a.submit_store_task(keys(1), [])
        with pytest.raises(ValueError, match="length mismatch"):
            a.submit_load_task(keys(2), memory_objects([KIB]))
    finally:
        a.close()


def test_the_listener_hears_of_accesses_before_the_event_fd_fires(
        valkey_server: EmbeddedValkey, key_prefix: str) -> None:
    a = KvPrefetchL2Adapter(params(valkey_server, None, key_prefix))
    accessed: list[Any] = []
    seen_at_completion: list[int] = []

    class Listener:
        def on_l2_keys_stored(self, ks: Any, sizes: Any) -> None: ...
        def on_l2_keys_accessed(self, ks: Any) -> None:
            accessed.extend(ks)
        def on_l2_keys_deleted(self, ks: Any, sizes: Any) -> None: ...

    a.register_listener(Listener())  # type: ignore[arg-type]
    try:
        ks = keys(4)
        assert store(a, ks, memory_objects([KIB] * 4)).is_successful()
        for _ in range(20):
            accessed.clear()
            tid = a.submit_load_task(ks, memory_objects([KIB] * 4, b"\0"))
            while a.query_load_result(tid) is None:
                time.sleep(0.0005)
            seen_at_completion.append(len(accessed))
        assert seen_at_completion == [4] * 20
    finally:
        a.close()


def test_a_store_task_split_into_batches_stores_journals_and_uploads_every_key(
        valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str) -> None:
    """``store_batch_keys``: a task of 11 keys goes to Valkey as batches of 3 on several
    threads; every key is acknowledged, journaled, loads back and reaches S3 byte for byte."""
    a = KvPrefetchL2Adapter(params(valkey_server, s3_server, key_prefix, store_batch_keys=3,
                                   write_back=HOLD_UPLOADS))
    assert a._stores.valkey is not None and a._stores.uploads is not None
    threads: set[str] = set()
    real_put = a._stores.valkey.put

    def recording_put(items: Any, **kw: Any) -> Any:
        threads.add(threading.current_thread().name)
        assert len(items) <= 3
        return real_put(items, **kw)

    a._stores.valkey.put = recording_put  # type: ignore[method-assign]
    sizes = [300 * KIB, 5, 70 * KIB, 600 * KIB, 1, 256 * KIB, 3 * KIB, 1024 * KIB, 17,
             90 * KIB, 512 * KIB]
    ks, objs = keys(len(sizes)), memory_objects(sizes)
    expected = [content(o) for o in objs]
    try:
        result = store(a, ks, objs)
        assert result.is_successful() and result.bytes_transferred() == sum(sizes)
        assert len(threads) >= 2  # the batches ran side by side
        assert a.write_back_stats().pending_keys == len(sizes)  # each one journaled
        dest = memory_objects(sizes, b"\0")
        assert load(a, ks, dest) == [True] * len(sizes)
        assert [content(o) for o in dest] == expected
        assert a.drain_uploads(WAIT_S)
    finally:
        a.close()
    assert read_from_s3_alone(s3_server, key_prefix, ks, sizes) == expected
