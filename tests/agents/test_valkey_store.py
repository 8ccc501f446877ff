from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.embedded import EmbeddedValkey, free_port
from agents.stores.errors import (
    CorruptObjectError,
    ObjectTooLargeError,
    StoreConfigError,
    StoreConnectionError,
)
from agents.stores.local import LocalTier, LocalTierConfig
from agents.stores.valkey_store import ValkeyStore

pytestmark = pytest.mark.servers
KIB = 1024


@pytest.fixture
def store(valkey_server: EmbeddedValkey, key_prefix: str) -> Iterator[ValkeyStore]:
    s = ValkeyStore(valkey_server.store_config(key_prefix=key_prefix, part_bytes=64 * KIB,
                                               max_object_bytes=4 << 20, connections=3))
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


@pytest.mark.parametrize("connections", [1, 3])
def test_lanes_fetch_every_part_and_a_lost_part_publishes_nothing(
    valkey_server: EmbeddedValkey, key_prefix: str, dram_dir: Path, connections: int
) -> None:
    """Parts are fetched by the caller plus ``connections - 1`` pool lanes; a part gone
    mid-object makes a miss, drops the rest of the object and leaves the tier untouched."""
    s = ValkeyStore(valkey_server.store_config(key_prefix=key_prefix, part_bytes=64 * KIB,
                                               connections=connections))
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
