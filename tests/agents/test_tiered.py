from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.embedded import EmbeddedS3, EmbeddedValkey
from agents.stores.errors import StoreUnavailableError
from agents.stores.local import LocalTier, LocalTierConfig
from agents.stores.s3_store import S3Store
from agents.stores.tiered import TieredStore, TieredStoreConfig
from agents.stores.valkey_store import ValkeyStore
from agents.transfer import TransferConfig, TransferEngine

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
        assert store.put([("k2", b"v")])[0].ok  # degraded write: Valkey only
        private_valkey.kill()
        t0 = time.monotonic()
        r = store.get(["k"])
        assert isinstance(r[0].error, StoreUnavailableError) and r[0].miss
        assert time.monotonic() - t0 < 5
    finally:
        store.close()
        s3.stop()
