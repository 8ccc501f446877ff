from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvprefetch.agents.stores.errors import ObjectTooLargeError, TierFullError
from kvprefetch.agents.stores.eviction import PredictedNextUsePolicy
from kvprefetch.agents.stores.local import LocalTier, LocalTierConfig

KIB = 1024


def tier(path: Path, capacity: int, **kw: object) -> LocalTier:
    t = LocalTier(LocalTierConfig(path=str(path), capacity_bytes=capacity, part_bytes=4 * KIB,
                                  **kw))
    t.start()
    return t


@pytest.mark.parametrize("kind", ["dram", "disk"])
def test_round_trip_and_delete(tmp_path: Path, kind: str) -> None:
    t = tier(tmp_path / kind, 1 << 20, kind=kind)
    payload = os.urandom(10 * KIB)
    assert t.put([("a", payload)])[0].ok
    got = t.get(["a", "b"])
    assert bytes(got[0].data or b"") == payload
    assert got[1].miss
    assert t.exists(["a", "b"])[0].ok and not t.exists(["b"])[0].ok
    assert t.delete(["a"])[0].ok
    assert t.used_bytes == 0


def test_lru_eviction_and_capacity(tmp_path: Path) -> None:
    t = tier(tmp_path, 50 * KIB)
    for k in "abcd":
        t.put([(k, os.urandom(10 * KIB))])
    t.get(["a"])  # a is now the most recently used
    t.put([("e", os.urandom(10 * KIB))])  # needs room: evicts b (least recent)
    assert set(t.keys()) == {"a", "c", "d", "e"}
    assert t.used_bytes <= 50 * KIB
    assert t.stats().evictions == 1


def test_predicted_next_use_evicts_furthest(tmp_path: Path) -> None:
    policy = PredictedNextUsePolicy()
    t = LocalTier(LocalTierConfig(path=str(tmp_path), capacity_bytes=40 * KIB,
                                  part_bytes=4 * KIB), policy=policy)
    t.start()
    for k in "abc":
        t.put([(k, os.urandom(10 * KIB))])
    now = time.monotonic()
    policy.advise({"a": now + 5, "b": now + 500, "c": now + 50})
    t.put([("d", os.urandom(10 * KIB))])
    # The furthest next use goes first, though it is not the least recent.
    assert sorted(t.keys()) == ["a", "c", "d"]


def test_a_clean_close_gives_a_dram_tiers_memory_back(tmp_path: Path) -> None:
    t = tier(tmp_path / "t", 100 * KIB, remove_on_close=True)
    t.put([(k, os.urandom(10 * KIB)) for k in "abcd"])
    assert len(list((tmp_path / "t").iterdir())) >= 4
    t.close()
    assert not (tmp_path / "t").exists()
    # A folder that holds files of others keeps them, and itself.
    t = tier(tmp_path / "shared", 100 * KIB, remove_on_close=True)
    t.put([("a", os.urandom(10 * KIB))])
    (tmp_path / "shared" / "notes.txt").write_text("not the tier's")
    t.close()
    assert [p.name for p in (tmp_path / "shared").iterdir()] == ["notes.txt"]


def test_restart_with_a_smaller_capacity_keeps_what_fits(tmp_path: Path) -> None:
    # The process that held the tier died, or a tier that keeps its files closed.
    t = tier(tmp_path, 100 * KIB)
    payloads = {k: os.urandom(10 * KIB) for k in "abcd"}
    t.put(list(payloads.items()))
    t.close()
    small = tier(tmp_path, 25 * KIB)
    kept = small.keys()
    assert len(kept) == 2 and small.used_bytes <= 25 * KIB
    for k in kept:
        assert bytes(small.get([k])[0].data or b"") == payloads[k]
    on_disk = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert on_disk <= 25 * KIB  # evicted files are gone or kept as spares within capacity


def test_full_tier_and_too_large_are_typed_and_write_nothing(tmp_path: Path) -> None:
    t = tier(tmp_path, 20 * KIB, max_object_bytes=15 * KIB)
    with pytest.raises(ObjectTooLargeError):
        t.put([("big", os.urandom(16 * KIB))])
    t2 = tier(tmp_path / "small", 8 * KIB)
    result = t2.put([("x", os.urandom(10 * KIB))])[0]
    assert isinstance(result.error, TierFullError)
    assert t2.keys() == [] and t2.used_bytes == 0
    assert not [p for p in (tmp_path / "small").iterdir() if not p.name.startswith(".spare")]


def test_corrupt_file_is_a_counted_miss_and_deleted(tmp_path: Path) -> None:
    t = tier(tmp_path, 1 << 20, recycle_files=False)
    t.put([("a", os.urandom(10 * KIB))])
    path = t.path_of("a")
    blob = bytearray(path.read_bytes())
    blob[-100] ^= 0xFF
    path.write_bytes(blob)
    r = t.get(["a"])[0]
    assert r.miss and type(r.error).__name__ == "CorruptObjectError"
    assert not path.exists() and t.stats().corrupt == 1


def test_abort_publishes_nothing(tmp_path: Path) -> None:
    from kvprefetch.agents.stores.format import make_header

    t = tier(tmp_path, 1 << 20)
    payload = os.urandom(12 * KIB)
    writer = t.open(make_header("a", payload, 4 * KIB))
    writer.write_at(0, payload[:5000])
    assert not t.exists(["a"])[0].ok
    writer.abort()
    assert not t.exists(["a"])[0].ok and t.used_bytes == 0


def test_killed_writer_leaves_no_visible_object(tmp_path: Path) -> None:
    """A process killed mid-write: nothing partial is visible, and restart cleans up."""
    root = tmp_path / "tier"
    script = textwrap.dedent(f"""
        import os, sys, time
        from kvprefetch.agents.stores.local import LocalTier, LocalTierConfig
        from kvprefetch.agents.stores.format import make_header
        t = LocalTier(LocalTierConfig(path={str(root)!r}, capacity_bytes=1 << 24))
        t.start()
        t.put([("done", b"x" * 1000)])
        payload = os.urandom(1 << 20)
        w = t.open(make_header("partial", payload, 1 << 16))
        w.write_at(0, payload[: 1 << 19])
        print("writing", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            cwd=Path(__file__).resolve().parents[2])
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    t = tier(root, 1 << 24)
    assert t.keys() == ["done"]
    assert not t.exists(["partial"])[0].ok
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_recycled_files_keep_their_mapping_and_free_it_when_unlinked(tmp_path: Path) -> None:
    """Writes into recycled files reuse the file's mapping (no map/unmap per object); a
    mapping never outlives its file, and recycled writes hold the right bytes."""
    from kvprefetch.agents.stores.format import make_header

    t = tier(tmp_path, 100 * KIB, prewarm_bytes=40 * KIB, prewarm_file_bytes=20 * KIB)
    assert len(t.files.maps) == 2  # the prewarmed files are mapped once, at start

    def write(key: str, payload: bytes) -> None:
        writer = t.open(make_header(key, payload, 4 * KIB))
        view = writer.target(0, len(payload))
        assert view is not None
        view[:] = payload
        view.release()
        writer.written(0, len(payload))
        writer.commit()

    def inodes() -> set[int]:
        return {p.stat().st_ino for p in tmp_path.iterdir()}

    for round_ in range(4):
        payloads = {f"k{round_}-{i}": os.urandom(12 * KIB + i) for i in range(5)}
        for key, payload in payloads.items():
            write(key, payload)  # 5 x ~12 KiB in a 100 KiB tier: evicts and recycles
        for key in set(t.keys()) & set(payloads):
            assert bytes(t.get([key])[0].data or b"") == payloads[key]
        assert set(t.files.maps) <= inodes()  # no mapping of an unlinked file
        assert t.used_bytes <= 100 * KIB
    mapped = len(t.files.maps)
    assert mapped >= 2
    t.delete(t.keys())
    assert set(t.files.maps) <= inodes()
    t.close()
    assert not t.files.maps


def test_aborted_write_into_a_recycled_file_publishes_nothing(tmp_path: Path) -> None:
    from kvprefetch.agents.stores.format import make_header

    t = tier(tmp_path, 1 << 20, prewarm_bytes=64 * KIB, prewarm_file_bytes=32 * KIB)
    good = os.urandom(20 * KIB)
    t.put([("a", good)])
    t.delete(["a"])
    payload = os.urandom(20 * KIB)
    writer = t.open(make_header("a", payload, 4 * KIB))
    view = writer.target(0, 10 * KIB)
    assert view is not None
    view[:] = payload[: 10 * KIB]
    view.release()
    writer.abort()
    assert not t.exists(["a"])[0].ok and t.used_bytes == 0
    assert set(t.files.maps) <= {p.stat().st_ino for p in tmp_path.iterdir()}
