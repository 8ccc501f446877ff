"""Readers racing writers that overwrite the same keys: reads that never destroy.

Writers keep overwriting a few keys with different payloads (different sizes too, so the
number of Valkey stripes and S3 ranges changes between versions) while readers keep reading
them, for a few seconds per store, on the real embedded servers. Counted and asserted:

- torn reads served: a successful read whose bytes are not exactly one written version;
- corrupt answers: nothing is really corrupt here, so a checksum failure can only be a read
  that mixed two versions (a torn read caught by the checksums);
- valid objects deleted: every object written is valid, and nobody but the readers could
  delete one (writers only overwrite), so every delete of an object counts;
- after the race, every key must still read as one of its written versions, byte for byte.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
from kvprefetch.agents.stores.base import ObjectStore
from kvprefetch.agents.stores.errors import CorruptObjectError
from kvprefetch.agents.stores.s3.store import S3Store
from kvprefetch.agents.stores.valkey.store import ValkeyStore

pytestmark = pytest.mark.servers
KIB = 1024
RACE_S = 3.0
KEYS = ("a", "b", "c")
#: Sizes of each key's versions: 16 KiB parts make 6 to 13 Valkey stripes (and S3 ranges
#: of 64 KiB make 2 to 4 GETs), so a version change also changes the object's layout.
SIZES = (100 * KIB + 5, 200 * KIB + 1, 140 * KIB)


@dataclass
class RaceTally:
    reads: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    torn: int = 0
    writes: int = 0
    failed_writes: int = 0
    deletes: int = 0
    lost: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def line(self, store: str) -> str:
        return (f"{store}: {self.reads} reads ({self.hits} hits, {self.misses} misses), "
                f"{self.torn} torn reads served, {self.corrupt} corrupt answers, "
                f"{self.deletes} deletes of valid objects, {self.writes} writes "
                f"({self.failed_writes} failed), keys lost after the race: {self.lost}")


def _versions(seed: int) -> dict[str, list[bytes]]:
    rng = random.Random(seed)
    return {k: [rng.randbytes(n) for n in SIZES] for k in KEYS}


def _race(store: ObjectStore, versions: dict[str, list[bytes]], deletes: Any) -> RaceTally:
    """Two writers and three readers for :data:`RACE_S`; then every key is read once more.
    ``deletes()`` returns how many objects were deleted so far (counted at the server or
    the client edge)."""
    tally = RaceTally()
    valid = {k: set(vs) for k, vs in versions.items()}
    stop = threading.Event()
    errors: list[BaseException] = []

    for k, vs in versions.items():  # every key exists before the race starts
        assert store.put([(k, vs[0])])[0].ok

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            key = rng.choice(KEYS)
            ok = store.put([(key, rng.choice(versions[key]))])[0].ok
            with tally.lock:
                tally.writes += 1
                tally.failed_writes += not ok

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            for r in store.get(rng.sample(KEYS, 2)):
                torn = r.ok and bytes(r.data or b"") not in valid[r.key]
                with tally.lock:
                    tally.reads += 1
                    tally.hits += r.ok
                    tally.misses += not r.ok
                    tally.corrupt += isinstance(r.error, CorruptObjectError)
                    tally.torn += torn

    def guard(fn: Any, seed: int) -> None:
        try:
            fn(seed)
        except BaseException as exc:  # reported by the test, not lost in a thread
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=guard, args=(writer, s)) for s in (1, 2)]
    threads += [threading.Thread(target=guard, args=(reader, s)) for s in (3, 4, 5)]
    for t in threads:
        t.start()
    time.sleep(RACE_S)
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    tally.deletes = deletes()
    for r in store.get(list(KEYS)):
        if not (r.ok and bytes(r.data or b"") in valid[r.key]):
            tally.lost.append(r.key)
    return tally


def _check(tally: RaceTally, store: str) -> None:
    print(tally.line(store))
    assert tally.reads > 50 and tally.writes > 20, tally.line(store)  # it really raced
    assert tally.torn == 0, tally.line(store)
    assert tally.corrupt == 0, tally.line(store)
    assert tally.deletes == 0, tally.line(store)
    assert tally.lost == [], tally.line(store)


@pytest.fixture
def race_valkey() -> Iterator[EmbeddedValkey]:
    """A Valkey of this test's own, so that keyspace events can be switched on."""
    with EmbeddedValkey() as server:
        yield server


def test_valkey_readers_racing_writers_never_tear_or_delete(
    race_valkey: EmbeddedValkey, key_prefix: str
) -> None:
    store = ValkeyStore(race_valkey.store_config(key_prefix=key_prefix, part_bytes=16 * KIB,
                                                 connections=4))
    store.start()
    heads_deleted: list[bytes] = []
    head_prefix = store.head_key("").encode()
    # Every DEL (from a client or a script) of a head is a keyspace event; nobody but a
    # reader deletes during the race (writers overwrite heads with SET).
    store.client.config_set("notify-keyspace-events", "Eg")
    pubsub = store.client.pubsub(ignore_subscribe_messages=True)

    def on_del(message: dict[str, Any]) -> None:
        if bytes(message["data"]).startswith(head_prefix):
            heads_deleted.append(bytes(message["data"]))

    pubsub.subscribe(**{"__keyevent@0__:del": on_del})
    listener = pubsub.run_in_thread(sleep_time=0.01, daemon=True)
    try:
        tally = _race(store, _versions(15), lambda: (time.sleep(0.2), len(heads_deleted))[1])
    finally:
        listener.stop()
        listener.join(timeout=5)
        pubsub.close()
        store.close()
    _check(tally, "valkey")


def test_s3_readers_racing_writers_never_tear_or_delete(
    s3_server: EmbeddedS3, key_prefix: str
) -> None:
    store = S3Store(s3_server.store_config(key_prefix=key_prefix, part_bytes=16 * KIB,
                                           range_bytes=64 * KIB, connections=6))
    store.start()
    deleted: list[str] = []

    def on_delete(params: dict[str, Any], **_: Any) -> None:
        deleted.append(str(params.get("Key")))

    # Every DeleteObject this client sends, whoever in the store sends it.
    store.client.meta.events.register("before-call.s3.DeleteObject", on_delete)
    try:
        tally = _race(store, _versions(16), lambda: len(deleted))
    finally:
        listed = store.client.list_objects_v2(Bucket=store.config.bucket, Prefix=key_prefix)
        for obj in listed.get("Contents", []):
            store.client.delete_object(Bucket=store.config.bucket, Key=obj["Key"])
        store.close()
    _check(tally, "s3")
