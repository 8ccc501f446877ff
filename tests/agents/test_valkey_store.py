from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvprefetch.agents.embedded import EmbeddedValkey, free_port
from kvprefetch.agents.stores.base import MemoryWriter
from kvprefetch.agents.stores.errors import (
    CorruptObjectError,
    ObjectNotFoundError,
    ObjectTooLargeError,
    StoreConfigError,
    StoreConnectionError,
)
from kvprefetch.agents.stores.format import ObjectHeader, make_header
from kvprefetch.agents.stores.local import LocalTier, LocalTierConfig
from kvprefetch.agents.stores.valkey.store import ValkeyStore

pytestmark = pytest.mark.servers
KIB = 1024


@pytest.fixture(params=[0, 2], ids=["parts-per-object", "parts-on-get-lanes"])
def store(valkey_server: EmbeddedValkey, key_prefix: str,
          request: pytest.FixtureRequest) -> Iterator[ValkeyStore]:
    """Every test on both read paths: object by object, each object's parts on pool lanes;
    and every part of a get on ``get_lanes`` connections, one thread each."""
    s = ValkeyStore(valkey_server.store_config(key_prefix=key_prefix, part_bytes=64 * KIB,
                                               max_object_bytes=4 << 20, connections=3,
                                               get_lanes=request.param))
    s.start()
    yield s
    names = list(s.client.scan_iter(match=f"{key_prefix}*"))
    if names:
        s.client.delete(*names)
    s.close()


def test_small_and_striped_round_trip(store: ValkeyStore) -> None:
    small, big = b"hello", os.urandom(300 * KIB + 7)
    assert all(r.ok for r in store.put([("s", small), ("b", big)]))
    got = store.get(["s", "b", "nope"])
    assert bytes(got[0].data or b"") == small and bytes(got[1].data or b"") == big
    assert got[2].miss and not got[2].ok
    header = got[1].header
    assert header is not None and header.parts == 5
    # Striping: one head plus five part keys, each at most a part long.
    names = store.physical_keys(header)
    assert len(names) == 6 and all(store.client.exists(n) for n in names)
    assert max(store.client.strlen(n) for n in names[1:]) == 64 * KIB
    assert [r.ok for r in store.exists(["s", "nope"])] == [True, False]
    assert [r.ok for r in store.delete(["b", "nope"])] == [True, False]
    assert not any(store.client.exists(n) for n in names)


def test_striped_read_into_a_local_tier(store: ValkeyStore, dram_dir: Path) -> None:
    tier = LocalTier(LocalTierConfig(path=str(dram_dir), capacity_bytes=8 << 20))
    tier.start()
    payload = os.urandom(1 << 20)
    store.put([("x", payload)])
    assert store.get(["x"], sink=tier)[0].ok
    assert bytes(tier.get(["x"])[0].data or b"") == payload


def test_ttl(store: ValkeyStore) -> None:
    store.put([("t", os.urandom(200 * KIB))], ttl_s=0.3)
    assert store.exists(["t"])[0].ok
    time.sleep(0.5)
    assert store.get(["t"])[0].miss


def test_flipped_byte_is_detected_deleted_and_counted(store: ValkeyStore) -> None:
    """Parts are immutable, so a checksum failure under an unchanged head is real damage:
    the object is dropped (compare-and-delete) and counted."""
    payload = os.urandom(200 * KIB)
    store.put([("c", payload)])
    name = store.part_key("c", 2)
    store.client.setrange(name, 100, bytes([store.client.getrange(name, 100, 100)[0] ^ 1]))
    r = store.get(["c"])[0]
    assert isinstance(r.error, CorruptObjectError) and r.miss
    assert not store.exists(["c"])[0].ok
    assert store.stats().corrupt == 1


def test_too_large_writes_nothing(store: ValkeyStore) -> None:
    with pytest.raises(ObjectTooLargeError):
        store.put([("ok", b"x"), ("huge", bytes(5 << 20))])
    assert not store.exists(["ok"])[0].ok


def test_wrong_endpoint_and_credentials(valkey_server: EmbeddedValkey) -> None:
    with pytest.raises(StoreConnectionError):
        ValkeyStore(valkey_server.store_config(port=free_port(), connect_timeout_s=0.5)).start()
    with EmbeddedValkey(password="sesame") as locked:
        with pytest.raises(StoreConfigError):
            ValkeyStore(locked.store_config(password="wrong")).start()
        good = ValkeyStore(locked.store_config(part_bytes=64 * KIB))
        good.start()
        payload = os.urandom(200 * KIB)
        good.put([("k", payload)])
        assert bytes(good.get(["k"])[0].data or b"") == payload  # direct reads AUTH too
        good.close()


@pytest.mark.parametrize("connections,get_lanes", [(1, 0), (3, 0), (1, 1), (3, 2), (3, 5)])
def test_lanes_fetch_every_part_and_a_lost_part_publishes_nothing(
    valkey_server: EmbeddedValkey, key_prefix: str, dram_dir: Path, connections: int,
    get_lanes: int,
) -> None:
    """Parts are fetched by the caller plus ``connections - 1`` pool lanes (or on
    ``get_lanes`` connections); a part gone mid-object makes a miss, drops the rest of the
    object and leaves the tier untouched."""
    s = ValkeyStore(valkey_server.store_config(key_prefix=key_prefix, part_bytes=64 * KIB,
                                               connections=connections, get_lanes=get_lanes))
    s.start()
    tier = LocalTier(LocalTierConfig(path=str(dram_dir), capacity_bytes=8 << 20))
    tier.start()
    try:
        payload = os.urandom(700 * KIB + 3)  # 11 parts
        assert s.put([("x", payload), ("y", payload)])[0].ok
        assert s.get(["x"], sink=tier)[0].ok
        assert bytes(tier.get(["x"])[0].data or b"") == payload
        s.client.delete(s.part_key("y", 6))
        r = s.get(["y"], sink=tier)[0]
        assert r.miss and type(r.error).__name__ == "ObjectNotFoundError"
        assert tier.keys() == ["x"] and r.header is not None
        assert tier.used_bytes == r.header.total_bytes  # only x's bytes: y left nothing
        assert not s.client.exists(s.head_key("y"))
    finally:
        s.close()
        tier.close()


class _OverwriteOnOpen:
    """A sink that lets a writer slip in between a reader's head read and its part reads:
    the first ``open`` overwrites the key with ``new`` (as another process would)."""

    def __init__(self, store: ValkeyStore, key: str, new: bytes, batch: bool) -> None:
        self.store, self.key, self.new, self.batch = store, key, new, batch
        self.opened = 0

    def open(self, header: ObjectHeader) -> MemoryWriter:
        self.opened += 1
        if self.opened == 1:  # a batch put takes the pipelined path
            extra = [("other", b"y")] if self.batch else []
            assert all(r.ok for r in self.store.put([(self.key, self.new), *extra]))
        return MemoryWriter(header)


@pytest.mark.parametrize("batch", [False, True])
def test_an_overwrite_under_a_reader_never_tears_or_deletes_the_new_version(
    store: ValkeyStore, batch: bool
) -> None:
    """The reader read version 1's head; version 2 is published (new parts under a new tag,
    then the head, then version 1's parts dropped) before the reader fetches parts. The
    reader finds version 1 gone, deletes nothing (the head is not the one it read) and reads
    version 2 whole: a part overwritten in place would fail the checksum and a drop would
    delete version 2."""
    v1, v2 = os.urandom(300 * KIB), os.urandom(200 * KIB + 9)
    store.put([("k", v1), ("other", b"x")] if batch else [("k", v1)])
    sink = _OverwriteOnOpen(store, "k", v2, batch)
    r = store.get(["k"], sink=sink)[0]
    assert r.ok and r.header is not None and r.header.payload_bytes == len(v2)
    # Version 1 missed cleanly (with get_lanes: on the lanes, then again on the checked
    # path), then version 2 read.
    assert sink.opened == (3 if store.config.get_lanes else 2)
    assert bytes(store.get(["k"])[0].data or b"") == v2
    assert store.stats().corrupt == 0
    # Only version 2 is left: its head and its 4 parts (version 1's 5 parts are gone).
    header = store.get(["k"])[0].header
    assert header is not None
    left = {n.decode() for n in store.client.scan_iter(match=f"{store.config.key_prefix}*")}
    left.discard(store.head_key("other"))
    assert left == set(store.physical_keys(header)) and len(left) == 1 + 4


def test_a_corrupt_part_of_a_replaced_version_leaves_the_new_one(store: ValkeyStore) -> None:
    """A checksum failure drops the object only if its head is still the one read (the
    compare-and-delete itself, called as a reader that read version 1 would call it)."""
    v1, v2 = os.urandom(300 * KIB), os.urandom(300 * KIB)
    store.put([("k", v1)])
    raw_v1 = store.client.get(store.head_key("k"))
    head_v1 = store._layout.parse_head("k", raw_v1)
    name = store.part_key("k", 1)
    store.client.setrange(name, 5, bytes([store.client.getrange(name, 5, 5)[0] ^ 1]))
    # A reader that read v1's head meets the corrupt part after v2 replaced it: v2 stays.
    assert store.put([("k", v2)])[0].ok
    err = CorruptObjectError("checksum mismatch in part 1")
    assert store._reads.drop_if_unchanged("k", raw_v1, head_v1, err) is False
    assert bytes(store.get(["k"])[0].data or b"") == v2
    # The same failure on the head that is still current drops it.
    raw_v2 = store.client.get(store.head_key("k"))
    head_v2 = store._layout.parse_head("k", raw_v2)
    assert store._reads.drop_if_unchanged("k", raw_v2, head_v2, err) is True
    assert not store.exists(["k"])[0].ok
    assert not any(store.client.exists(n) for n in store.physical_keys(head_v2.header,
                                                                      head_v2.tag))


def test_an_untagged_striped_head_is_a_miss_and_the_next_put_clears_it(
        store: ValkeyStore) -> None:
    """A striped head without a version tag (parts named ``p:<key>:<i>``) is a miss,
    left alone by readers; the next put replaces it and deletes its old parts."""
    payload = os.urandom(200 * KIB)
    header = make_header("o", payload, store.config.part_bytes)
    store.client.set(store.head_key("o"), header.encode())
    old_parts = [f"{store.config.key_prefix}p:o:{i}" for i in range(header.parts)]
    for i, name in enumerate(old_parts):
        store.client.set(name, payload[slice(*header.part_range(i))])
    r = store.get(["o"])[0]
    assert r.miss and isinstance(r.error, ObjectNotFoundError)
    assert "without a version tag" in str(r.error)
    assert store.client.exists(store.head_key("o")) and all(
        store.client.exists(n) for n in old_parts)
    assert store.put([("o", payload)])[0].ok
    assert bytes(store.get(["o"])[0].data or b"") == payload
    assert not any(store.client.exists(n) for n in old_parts)


def test_delete_takes_the_head_and_every_part(store: ValkeyStore) -> None:
    store.put([("d", os.urandom(300 * KIB)), ("e", b"small")])
    header = store.get(["d"])[0].header
    assert header is not None
    names = store.physical_keys(header)
    assert [r.ok for r in store.delete(["d", "e", "nope"])] == [True, True, False]
    assert not any(store.client.exists(n) for n in names)
    assert store.stats().deletes == 2


INLINE_SIZES = [0, 1, 5, 40 * KIB, 64 * KIB - 1, 64 * KIB]


@pytest.mark.parametrize("direct", [True, False])
def test_inline_objects_travel_on_every_lane_whole(
    valkey_server: EmbeddedValkey, key_prefix: str, dram_dir: Path, direct: bool
) -> None:
    """Objects of at most a part live in their head (header, then payload: one value, no
    part keys), written and read on the bulk lanes side by side with striped ones; the
    direct reader receives them straight into the sink (here a local tier's file)."""
    s = ValkeyStore(valkey_server.store_config(key_prefix=key_prefix, part_bytes=64 * KIB,
                                               connections=3, direct_reads=direct))
    s.start()
    try:
        payloads = {f"i{n}": os.urandom(n) for n in INLINE_SIZES}
        payloads["striped"] = os.urandom(150 * KIB)
        assert all(r.ok for r in s.put(list(payloads.items())))
        for name, payload in payloads.items():
            raw = s.client.get(s.head_key(name))
            if name != "striped":
                assert raw.endswith(payload) and len(raw) == make_header(
                    name, payload, 64 * KIB).header_bytes + len(payload)
        assert not list(s.client.scan_iter(match=f"{key_prefix}v:i*"))
        got = s.get([*payloads, "nope"])
        assert [bytes(r.data or b"") for r in got[:-1]] == list(payloads.values())
        assert got[-1].miss
        tier = LocalTier(LocalTierConfig(path=str(dram_dir), capacity_bytes=8 << 20))
        tier.start()
        assert all(r.ok for r in s.get(list(payloads), sink=tier))
        assert [bytes(r.data or b"") for r in tier.get(list(payloads))] == list(
            payloads.values())
        assert [bytes(s.get([name])[0].data or b"") for name in payloads] == list(
            payloads.values())  # one key: read on the calling thread
    finally:
        s.client.delete(*s.client.scan_iter(match=f"{key_prefix}*"))
        s.close()


def test_a_flipped_byte_in_an_inline_object_is_detected_deleted_and_counted(
        store: ValkeyStore) -> None:
    payload = os.urandom(40 * KIB)
    store.put([("c", payload), ("ok", payload)])
    name = store.head_key("c")
    store.client.setrange(name, 1000, bytes([store.client.getrange(name, 1000, 1000)[0] ^ 1]))
    r, ok = store.get(["c", "ok"])
    assert isinstance(r.error, CorruptObjectError) and r.miss
    assert bytes(ok.data or b"") == payload
    assert not store.exists(["c"])[0].ok
    assert store.stats().corrupt == 1


def test_each_overwrite_drops_the_parts_of_the_version_it_replaced(store: ValkeyStore) -> None:
    """``SET ... GET`` hands back the replaced head (read only as far as its header and
    tag, however much inline payload follows): striped -> inline -> striped -> inline
    leaves no part of an older version behind, and reads give the newest."""
    def parts() -> set[bytes]:
        return set(store.client.scan_iter(match=f"{store.config.key_prefix}v:*"))

    versions = [os.urandom(200 * KIB), os.urandom(64 * KIB), os.urandom(130 * KIB),
                os.urandom(10)]
    seen: list[set[bytes]] = []
    for payload in versions:
        assert store.put([("k", payload), ("other", b"x")])[0].ok
        assert bytes(store.get(["k"])[0].data or b"") == payload
        seen.append(parts())
    assert len(seen[0]) == 4 and not seen[1] and len(seen[2]) == 3 and not seen[3]
