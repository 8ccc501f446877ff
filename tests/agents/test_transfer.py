from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from kvprefetch.agents.stores.local import LocalTier, LocalTierConfig
from kvprefetch.agents.transfer import TokenBucket, TransferConfig, TransferEngine, TransferProgress

MIB = 1 << 20


def make_tiers(tmp_path: Path, chunks: int, chunk_bytes: int) -> tuple[LocalTier, LocalTier,
                                                                        dict[str, bytes]]:
    src = LocalTier(LocalTierConfig(path=str(tmp_path / "src"), capacity_bytes=1 << 30,
                                    kind="disk", fsync="never", part_bytes=256 * 1024))
    dst = LocalTier(LocalTierConfig(path=str(tmp_path / "dst"), capacity_bytes=1 << 30))
    src.start()
    dst.start()
    data = {f"c{i:03d}": os.urandom(chunk_bytes) for i in range(chunks)}
    src.put(list(data.items()))
    return src, dst, data


def test_moves_verifies_and_reports(tmp_path: Path) -> None:
    src, dst, data = make_tiers(tmp_path, 8, MIB)
    seen: list[TransferProgress] = []
    with TransferEngine(src, dst, TransferConfig(concurrency=3)) as engine:
        result = engine.transfer([*data, "missing"], on_progress=seen.append)
    assert result.keys_moved == 8 and result.keys_missed == 1 and result.missed == ("missing",)
    assert result.bytes_moved == 8 * MIB and result.ttlb_s > 0 and result.throughput_mib_s > 0
    assert len(seen) == 9 and max(p.keys_done for p in seen) == 9
    for r in dst.get(list(data)):
        assert bytes(r.data or b"") == data[r.key]
    with TransferEngine(src, dst) as engine:  # everything is local now
        again = engine.transfer(list(data))
    assert again.keys_present == 8 and again.keys_moved == 0 and again.complete


def test_bandwidth_limit_is_honoured_within_10_percent(tmp_path: Path) -> None:
    src, dst, data = make_tiers(tmp_path, 12, MIB)
    cfg = TransferConfig(concurrency=4, bandwidth_limit_mib_s=8.0, burst_bytes=256 * 1024)
    with TransferEngine(src, dst, cfg) as engine:
        result = engine.transfer(list(data))
    assert result.complete
    assert abs(result.throughput_mib_s - 8.0) / 8.0 < 0.10, result.throughput_mib_s


def test_token_bucket_rate() -> None:
    bucket = TokenBucket(10 * MIB, MIB)
    t0 = time.monotonic()
    for _ in range(30):
        bucket.acquire(MIB // 2)
    elapsed = time.monotonic() - t0
    assert 1.3 < elapsed < 1.7  # 15 MiB - 1 MiB burst at 10 MiB/s = 1.4 s


def test_cancellation_stops_and_publishes_no_partial_chunk(tmp_path: Path) -> None:
    src, dst, data = make_tiers(tmp_path, 10, MIB)
    cfg = TransferConfig(concurrency=2, bandwidth_limit_mib_s=4.0, burst_bytes=64 * 1024)
    with TransferEngine(src, dst, cfg) as engine:
        handle = engine.submit(list(data))
        time.sleep(0.6)
        handle.cancel()
        result = handle.result(timeout_s=5)
    assert result.cancelled and 0 < result.keys_moved < 10
    present = [r.key for r in dst.exists(list(data)) if r.ok]
    assert len(present) == result.keys_moved
    for r in dst.get(present):  # every visible chunk is whole and verified
        assert bytes(r.data or b"") == data[r.key]
    assert not [p for p in (tmp_path / "dst").iterdir() if p.name.startswith(".tmp-")]


def test_priorities_overtake_queued_work(tmp_path: Path) -> None:
    src, dst, data = make_tiers(tmp_path, 12, MIB)
    keys = list(data)
    order: list[str] = []
    lock = threading.Lock()

    def record(p: TransferProgress) -> None:
        with lock:
            order.append(p.last_key)

    cfg = TransferConfig(concurrency=1, bandwidth_limit_mib_s=40.0, burst_bytes=64 * 1024)
    with TransferEngine(src, dst, cfg) as engine:
        low = engine.submit(keys[:10], priority=0, on_progress=record)
        time.sleep(0.05)
        high = engine.submit(keys[10:], priority=5, on_progress=record)
        high.result(10)
        low.result(10)
    assert order.index(keys[10]) < 4 and order.index(keys[11]) < 5
