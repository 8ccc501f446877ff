"""The node-local tier reader that SGLang's HiCache backend reads first (no SGLang needed):
objects the agent's tier published are read straight into the caller's memory, in pieces
that need not line up with the object's checksummed parts, on several threads, byte for
byte; a damaged, truncated or foreign file is never reported as served."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvprefetch.agents.sglang.node_tier import NodeTierReader, TierRead
from kvprefetch.agents.stores.local import LocalTier, LocalTierConfig

PART = 4096


@pytest.fixture
def config(dram_dir: Path) -> LocalTierConfig:
    return LocalTierConfig(path=str(dram_dir), capacity_bytes=64 << 20, part_bytes=PART)


def payloads(n: int, size: int) -> dict[str, bytes]:
    return {f"page-{i}": os.urandom(size) for i in range(n)}


def store(config: LocalTierConfig, objects: dict[str, bytes]) -> None:
    with LocalTier(config) as tier:
        assert all(r.ok for r in tier.put(list(objects.items())))


def split(size: int, cuts: list[int]) -> list[memoryview]:
    """Destination segments of these lengths (as a K region, then a V region...)."""
    out, last = [], 0
    for c in [*cuts, size]:
        out.append(memoryview(bytearray(c - last)))
        last = c
    return out


def test_reads_land_in_segments_that_straddle_parts_byte_for_byte(
        config: LocalTierConfig) -> None:
    size = 5 * PART + 123  # six parts, the last one short
    objects = payloads(3, size)
    store(config, objects)
    # Segment borders in the middle of parts, an empty segment, chunks smaller than parts.
    reader = NodeTierReader(config, chunk_bytes=4096)
    for cuts in ([], [PART + 7], [100, 100, 3 * PART + 1, size - 1]):
        for key, data in objects.items():
            dest = split(size, cuts)
            assert reader.read_into(key, dest) is TierRead.HIT
            assert b"".join(bytes(d) for d in dest) == data
    assert reader.read_into("page-absent", split(size, [])) is TierRead.MISS
    # A destination of another size (another model or layout) is refused, not filled.
    assert reader.read_into("page-0", split(size - 1, [])) is TierRead.BAD


def test_a_damaged_truncated_or_foreign_file_is_never_served(
        config: LocalTierConfig) -> None:
    size = 3 * PART
    objects = payloads(4, size)
    store(config, objects)
    reader = NodeTierReader(config)
    flipped = reader.path_of("page-0")  # one payload byte in the middle part
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) - size + PART + 17] ^= 0x01
    flipped.write_bytes(bytes(raw))
    truncated = reader.path_of("page-1")
    truncated.write_bytes(truncated.read_bytes()[:-1])
    # page-3's file at page-2's name: whole and checksummed, but the header's key differs.
    reader.path_of("page-3").replace(reader.path_of("page-2"))
    for key in ("page-0", "page-1", "page-2"):
        dest = split(size, [PART // 2])
        assert reader.read_into(key, dest) is TierRead.BAD, key
    assert reader.read_into("page-3", split(size, [])) is TierRead.MISS


def test_a_batch_on_several_threads_reads_every_page_and_flags_only_the_damaged_one(
        config: LocalTierConfig) -> None:
    size = 2 * PART + 512
    objects = payloads(23, size)
    store(config, objects)
    reader = NodeTierReader(config, read_threads=3)
    try:
        bad = reader.path_of("page-11")
        raw = bytearray(bad.read_bytes())
        raw[-1] ^= 0x80
        bad.write_bytes(bytes(raw))
        keys = [*objects, "page-absent"]
        dests = [split(size, [PART + 1]) for _ in keys]
        got = reader.read_batch(list(zip(keys, dests, strict=True)))
        assert got[11] is TierRead.BAD and got[-1] is TierRead.MISS
        for i, key in enumerate(keys[:-1]):
            if i != 11:
                assert got[i] is TierRead.HIT
                assert b"".join(bytes(d) for d in dests[i]) == objects[key]
        assert reader.prefix_hits(keys) == len(keys) - 1
        assert reader.exists(["page-0", "page-absent"]) == [True, False]
    finally:
        reader.close()


def test_the_reader_names_files_as_the_tier_does(config: LocalTierConfig) -> None:
    reader = NodeTierReader(config)
    with LocalTier(config) as tier:
        for key in ("a", "sglang/x_model_0_1", "k" * 300):
            assert Path(reader._path(key)) == tier.path_of(key) == reader.path_of(key)
