from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvprefetch.agents.embedded import EmbeddedS3, free_port
from kvprefetch.agents.stores.errors import (
    CorruptObjectError,
    ObjectTooLargeError,
    StoreConfigError,
    StoreConnectionError,
)
from kvprefetch.agents.stores.local import LocalTier, LocalTierConfig
from kvprefetch.agents.stores.s3.store import ObjectChangedError, S3Store

pytestmark = pytest.mark.servers
KIB, MIB = 1024, 1 << 20


@pytest.fixture
def store(s3_server: EmbeddedS3, key_prefix: str) -> Iterator[S3Store]:
    s = S3Store(s3_server.store_config(key_prefix=key_prefix, part_bytes=256 * KIB,
                                       range_bytes=1 * MIB, max_object_bytes=32 * MIB,
                                       multipart_threshold_bytes=6 * MIB,
                                       multipart_part_bytes=5 * MIB, connections=6))
    s.start()
    yield s
    listed = s.client.list_objects_v2(Bucket=s.config.bucket, Prefix=key_prefix)
    for obj in listed.get("Contents", []):
        s.client.delete_object(Bucket=s.config.bucket, Key=obj["Key"])
    s.close()


def test_small_and_multipart_round_trip_with_ranged_reads(store: S3Store) -> None:
    small, big = b"tiny", os.urandom(13 * MIB + 5)  # three upload parts, 14 ranges
    assert all(r.ok for r in store.put([("s", small), ("b", big)]))
    got = store.get(["s", "b", "nope"])
    assert bytes(got[0].data or b"") == small and bytes(got[1].data or b"") == big
    assert got[2].miss
    assert [r.ok for r in store.exists(["b", "nope"])] == [True, False]
    assert [r.ok for r in store.delete(["b"])] == [True]
    assert store.get(["b"])[0].miss


def test_corrupt_object_is_a_quarantined_miss_and_never_deleted(store: S3Store) -> None:
    """A checksum failure is fetched once more, then answered as a miss and counted, and
    the object stays: it may be the only durable copy. A put replaces it."""
    store.put([("c", os.urandom(2 * MIB))])
    okey = store.object_key("c")
    blob = bytearray(store.client.get_object(Bucket=store.config.bucket, Key=okey)["Body"].read())
    blob[len(blob) // 2] ^= 1
    store.client.put_object(Bucket=store.config.bucket, Key=okey, Body=bytes(blob))
    gets: list[str] = []
    store.client.meta.events.register("provide-client-params.s3.GetObject",
                                      lambda params, **_: gets.append(params["Range"]))
    r = store.get(["c"])[0]
    assert isinstance(r.error, CorruptObjectError) and r.miss
    assert gets.count("bytes=0-1048575") == 2  # fetched again once before giving up
    assert store.exists(["c"])[0].ok and store.stats().corrupt == 1
    assert store.stats().deletes == 0 and store.quarantined() == ["c"]
    fresh = os.urandom(3 * MIB)
    store.put([("c", fresh)])
    assert bytes(store.get(["c"])[0].data or b"") == fresh


def test_ranges_of_one_read_are_pinned_to_one_version(store: S3Store) -> None:
    """An overwrite between the first range and the next ones: the later ranges answer 412
    (If-Match on the first range's ETag) and the read starts again on the new version, so
    it serves the new bytes whole; nothing is deleted and nothing counts as corrupt."""
    old, new = os.urandom(3 * MIB), os.urandom(3 * MIB + 100)
    store.put([("v", old)])
    sent: list[dict[str, object]] = []
    overwritten: list[bool] = []

    def on_get(params: dict[str, object], **_: object) -> None:
        sent.append(dict(params))
        if params["Range"] != "bytes=0-1048575" and not overwritten:
            overwritten.append(True)
            # The writer slips in after the first range was answered.
            S3Store.put(store, [("v", new)])

    store.client.meta.events.register("provide-client-params.s3.GetObject", on_get)
    r = store.get(["v"])[0]
    assert r.ok and bytes(r.data or b"") == new
    assert all(p.get("IfMatch") for p in sent if p["Range"] != "bytes=0-1048575")
    assert sum(p["Range"] == "bytes=0-1048575" for p in sent) == 2  # started again once
    assert store.stats().corrupt == 0 and store.stats().deletes == 0


def test_a_read_that_keeps_losing_the_race_is_a_clean_miss(store: S3Store) -> None:
    """An object overwritten under every attempt: after two restarts a miss (the
    'changed' kind), never a mix of versions, never a delete."""
    store.put([("w", os.urandom(3 * MIB))])

    def on_get(params: dict[str, object], **_: object) -> None:
        if params["Range"] != "bytes=0-1048575":
            S3Store.put(store, [("w", os.urandom(3 * MIB))])

    store.client.meta.events.register("provide-client-params.s3.GetObject", on_get)
    r = store.get(["w"])[0]
    assert isinstance(r.error, ObjectChangedError) and r.miss
    assert store.stats().corrupt == 0 and store.exists(["w"])[0].ok


def test_too_large(store: S3Store) -> None:
    with pytest.raises(ObjectTooLargeError):
        store.put([("huge", bytes(33 * MIB))])
    assert not store.exists(["huge"])[0].ok


def test_wrong_credentials_and_endpoint(s3_server: EmbeddedS3) -> None:
    with pytest.raises(StoreConfigError):
        S3Store(s3_server.store_config(secret_access_key="wrong")).start()
    with pytest.raises(StoreConfigError):
        S3Store(s3_server.store_config(bucket="no-such-bucket")).start()
    with pytest.raises(StoreConnectionError):
        S3Store(s3_server.store_config(endpoint_url=f"http://127.0.0.1:{free_port()}",
                                       connect_timeout_s=0.5, max_attempts=1)).start()


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize(
    ("part", "range_bytes", "size"),
    [
        (4 * KIB, 4 * KIB, 300 * KIB + 7),  # a header longer than the first range
        (256 * KIB, 700 * KIB + 5, 3 * MIB + 3),  # ranges not aligned to parts
        (256 * KIB, 8 * MIB, 3 * MIB),  # one GET for the whole object
        (256 * KIB, 1 * MIB, 0),
    ],
)
def test_streamed_and_direct_reads_into_a_local_tier(
    s3_server: EmbeddedS3, key_prefix: str, tmp_path: Path, direct: bool, part: int,
    range_bytes: int, size: int,
) -> None:
    """Bodies received straight into the tier (direct) or read and copied: the same bytes,
    corruption still caught, and pooled connections reused (not one per request)."""
    s = S3Store(s3_server.store_config(key_prefix=key_prefix, part_bytes=part,
                                       range_bytes=range_bytes, connections=3,
                                       direct_reads=direct))
    s.start()
    tier = LocalTier(LocalTierConfig(path=str(tmp_path / "dram"), capacity_bytes=64 * MIB))
    tier.start()
    try:
        payload = os.urandom(size)
        assert s.put([("k", payload)])[0].ok
        for _ in range(3):
            tier.delete(["k"])
            assert s.get(["k"], sink=tier)[0].ok
            assert bytes(tier.get(["k"])[0].data or b"") == payload
        assert bytes(s.get(["k"])[0].data or b"") == payload
        if size:
            okey = s.object_key("k")
            blob = bytearray(s.client.get_object(Bucket=s.config.bucket, Key=okey)["Body"].read())
            blob[-1] ^= 0xFF
            s.client.put_object(Bucket=s.config.bucket, Key=okey, Body=bytes(blob))
            tier.delete(["k"])
            r = s.get(["k"], sink=tier)[0]
            assert isinstance(r.error, CorruptObjectError)
            assert not tier.exists(["k"])[0].ok and s.exists(["k"])[0].ok  # kept in S3
    finally:
        s.close()
        tier.close()
