from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvprefetch.agents.embedded import EmbeddedS3, EmbeddedValkey
from kvprefetch.agents.stores.base import MemoryWriter
from kvprefetch.agents.stores.errors import (
    ColdTierDownError,
    CorruptObjectError,
    StoreUnavailableError,
)
from kvprefetch.agents.stores.format import ObjectHeader
from kvprefetch.agents.stores.local import LocalTier, LocalTierConfig
from kvprefetch.agents.stores.s3.store import S3Store
from kvprefetch.agents.stores.tiered import TieredStore, TieredStoreConfig
from kvprefetch.agents.stores.valkey.store import ValkeyStore
from kvprefetch.agents.transfer import TransferConfig, TransferEngine

pytestmark = pytest.mark.servers
KIB = 1024


def make(valkey: EmbeddedValkey, s3: EmbeddedS3, prefix: str,
         **cfg: object) -> TieredStore:
    hot = ValkeyStore(valkey.store_config(key_prefix=prefix, part_bytes=64 * KIB,
                                          connect_timeout_s=0.3, socket_timeout_s=1.0))
    cold = S3Store(s3.store_config(key_prefix=prefix, part_bytes=64 * KIB, range_bytes=256 * KIB,
                                   connect_timeout_s=0.3, read_timeout_s=2.0, max_attempts=1))
    return TieredStore(hot, cold, TieredStoreConfig(**cfg))  # type: ignore[arg-type]


@pytest.fixture
def private_valkey() -> Iterator[EmbeddedValkey]:
    with EmbeddedValkey() as server:
        yield server


def test_read_through_promotes_and_write_modes(
    valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str
) -> None:
    store = make(valkey_server, s3_server, key_prefix, hot_ttl_s=30.0)
    store.start()
    try:
        payload = os.urandom(300 * KIB)
        store.cold.put([("k", payload)])  # only in S3
        r = store.get(["k"])[0]
        assert r.ok and r.source == "s3" and bytes(r.data or b"") == payload
        store.flush()
        assert store.hot.exists(["k"])[0].ok and store.stats().promotions == 1
        assert store.get(["k"])[0].source == "valkey"
        assert 0 < store.hot.client.pttl(store.hot.head_key("k")) <= 30_000  # type: ignore[attr-defined]
        store.put([("w", b"through")])
        assert store.hot.exists(["w"])[0].ok and store.cold.exists(["w"])[0].ok
        store.delete(["k", "w"])
    finally:
        store.close()
    back = make(valkey_server, s3_server, key_prefix, write_mode="write-back")
    back.start()
    try:
        back.put([("b", b"later")])
        back.flush()
        assert back.cold.exists(["b"])[0].ok
        back.delete(["b"])
    finally:
        back.close()


def test_valkey_stopped_mid_run_falls_back_to_s3(
    private_valkey: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str, dram_dir: Path
) -> None:
    store = make(private_valkey, s3_server, key_prefix, promote=False)
    store.start()
    data = {f"c{i}": os.urandom(200 * KIB) for i in range(6)}
    assert all(r.ok for r in store.put(list(data.items())))
    tier = LocalTier(LocalTierConfig(path=str(dram_dir), capacity_bytes=16 << 20))
    tier.start()
    keys = list(data)
    moved: list[str] = []

    def on_progress(p: object) -> None:
        moved.append(p.last_key)  # type: ignore[attr-defined]
        if len(moved) == 2:
            private_valkey.kill()  # the hot tier dies mid-transfer

    with TransferEngine(store, tier, TransferConfig(concurrency=1)) as engine:
        t0 = time.monotonic()
        result = engine.transfer(keys, on_progress=on_progress, timeout_s=30)
    assert result.complete and time.monotonic() - t0 < 10
    for r in tier.get(keys):
        assert bytes(r.data or b"") == data[r.key]
    assert not store.tier_up("hot")
    store.cold.delete(keys)
    store.close()


def test_s3_down_serves_from_valkey_and_both_down_is_a_quick_miss(
    private_valkey: EmbeddedValkey, key_prefix: str
) -> None:
    s3 = EmbeddedS3().start()
    store = make(private_valkey, s3, key_prefix, promote=False)
    store.start()
    try:
        store.put([("k", os.urandom(100 * KIB))])
        s3.stop()
        r = store.get(["k", "absent"])
        assert r[0].ok and r[0].source == "valkey"
        assert r[1].miss
        refused = store.put([("k2", b"v")])[0]  # acknowledged only where S3 has it
        assert not refused.ok and isinstance(refused.error, ColdTierDownError)
        private_valkey.kill()
        t0 = time.monotonic()
        r = store.get(["k"])
        assert isinstance(r[0].error, StoreUnavailableError) and r[0].miss
        assert time.monotonic() - t0 < 5
    finally:
        store.close()
        s3.stop()


def _flip_s3_byte(cold: S3Store, key: str) -> None:
    okey = cold.object_key(key)
    blob = bytearray(cold.client.get_object(Bucket=cold.config.bucket, Key=okey)["Body"].read())
    blob[-3] ^= 0x40
    cold.client.put_object(Bucket=cold.config.bucket, Key=okey, Body=bytes(blob))


@pytest.mark.parametrize("to_tier", [False, True])
def test_a_corrupt_valkey_copy_is_repaired_from_s3(
    valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str, dram_dir: Path,
    to_tier: bool,
) -> None:
    """Promotion off: still, a Valkey copy that fails its checksum is served from S3 and
    written back into Valkey (only where the broken head was dropped)."""
    store = make(valkey_server, s3_server, key_prefix, promote=False)
    store.start()
    tier = LocalTier(LocalTierConfig(path=str(dram_dir), capacity_bytes=8 << 20))
    tier.start()
    try:
        payload = os.urandom(300 * KIB)
        assert store.put([("k", payload), ("ok", b"fine")])[0].ok
        hot = store.hot
        assert isinstance(hot, ValkeyStore)
        name = hot.part_key("k", 3)
        hot.client.setrange(name, 7, bytes([hot.client.getrange(name, 7, 7)[0] ^ 1]))
        r = store.get(["k", "ok"], sink=tier if to_tier else None)
        assert r[0].ok and r[0].source == "s3" and r[1].source == "valkey"
        got = tier.get(["k"])[0].data if to_tier else r[0].data
        assert bytes(got or b"") == payload
        store.flush()
        assert store.repairs() == {"hot": 1, "cold": 0}
        again = hot.get(["k"])[0]
        assert again.ok and bytes(again.data or b"") == payload
    finally:
        tier.close()
        store.delete(["k", "ok"])
        store.close()


class _ValkeyWritesMeanwhile:
    """A sink whose first ``open`` (S3's header has just arrived) lets another node put the
    key into Valkey; the S3 copy then fails its checksum."""

    def __init__(self, hot: ValkeyStore, key: str, payload: bytes) -> None:
        self.hot, self.key, self.payload = hot, key, payload
        self.opened = 0

    def open(self, header: ObjectHeader) -> MemoryWriter:
        self.opened += 1
        if self.opened == 1:
            assert self.hot.put([(self.key, self.payload)])[0].ok
        return MemoryWriter(header)


def test_a_corrupt_s3_copy_is_kept_then_repaired_from_valkey(
    valkey_server: EmbeddedValkey, s3_server: EmbeddedS3, key_prefix: str
) -> None:
    """S3's copy fails verification (twice): it is quarantined, not deleted; Valkey, read
    once more, now serves the key, and S3 is rewritten from it (If-Match on the broken
    version's ETag)."""
    store = make(valkey_server, s3_server, key_prefix, promote=False)
    store.start()
    try:
        hot, cold = store.hot, store.cold
        assert isinstance(hot, ValkeyStore) and isinstance(cold, S3Store)
        payload = os.urandom(300 * KIB)
        assert cold.put([("k", payload)])[0].ok  # S3 only
        _flip_s3_byte(cold, "k")
        r = store.get(["k"], sink=_ValkeyWritesMeanwhile(hot, "k", payload))[0]
        assert r.ok and r.source == "valkey"
        store.flush()
        assert store.repairs() == {"hot": 0, "cold": 1} and cold.quarantined() == []
        fixed = cold.get(["k"])[0]
        assert fixed.ok and bytes(fixed.data or b"") == payload
        assert cold.stats().deletes == 0
    finally:
        store.delete(["k"])
        store.close()


def test_a_quarantined_s3_copy_is_not_repaired_over_a_newer_version(
    s3_server: EmbeddedS3, key_prefix: str
) -> None:
    """The repair replaces only the version that failed: one written since stays."""
    cold = S3Store(s3_server.store_config(key_prefix=key_prefix, part_bytes=64 * KIB))
    cold.start()
    try:
        cold.put([("k", os.urandom(200 * KIB))])
        _flip_s3_byte(cold, "k")
        assert isinstance(cold.get(["k"])[0].error, CorruptObjectError)
        assert cold.quarantined() == ["k"]
        newer = os.urandom(100 * KIB)
        cold.put([("k", newer)])
        r = cold.repair([("k", os.urandom(200 * KIB))])[0]
        assert not r.ok and cold.quarantined() == []
        assert bytes(cold.get(["k"])[0].data or b"") == newer
    finally:
        cold.delete(["k"])
        cold.close()
