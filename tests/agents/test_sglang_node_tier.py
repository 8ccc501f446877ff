"""The node-local tier reader that SGLang's HiCache backend reads first (no SGLang needed):
objects the agent's tier published are read straight into the caller's memory, in pieces
that need not line up with the object's checksummed parts, on several threads, byte for
byte, one read per chunk that the kernel copies line-aligned whatever the header's length
and the destination's address; a damaged, truncated or foreign file is never reported as
served."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from kvprefetch.agents.sglang import node_tier
from kvprefetch.agents.sglang.node_tier import (
    LINE_BYTES,
    NodeTierReader,
    TierRead,
    short_moves_fast,
)
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


def at_offset(size: int, skew: int, cuts: list[int]) -> list[memoryview]:
    """Destination segments of one buffer that starts ``skew`` bytes past a line."""
    backing = (ctypes.c_char * (size + 2 * LINE_BYTES))()
    start = (-ctypes.addressof(backing)) % LINE_BYTES + skew
    whole = memoryview(backing).cast("B")[start : start + size]
    out, last = [], 0
    for c in [*cuts, size]:
        out.append(whole[last:c])
        last = c
    return out


def test_chunks_are_read_line_aligned_once_each_whatever_the_header_and_address(
        config: LocalTierConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    size = 5 * PART + 123
    # Keys of 64 lengths: headers whose lengths take every value modulo a line.
    objects = {"k" * n: os.urandom(size) for n in range(1, LINE_BYTES + 1)}
    store(config, objects)
    reads: list[tuple[int, int]] = []  # (bytes, file offset - address modulo a line)
    preadv = os.preadv

    def recording(fd: int, buffers: list[memoryview], offset: int) -> int:
        [buffer] = buffers
        address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        reads.append((len(buffer), (offset - address) % LINE_BYTES))
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(node_tier.os, "preadv", recording)
    reader = NodeTierReader(config, chunk_bytes=4096, realign=True)
    cuts = [PART + 7, 3 * PART + 1]  # three segments, two borders inside parts
    chunks = 8  # 4096-byte chunks cut at the part and segment borders
    for i, (key, data) in enumerate(objects.items()):
        dest = at_offset(size, i % LINE_BYTES, cuts)
        reads.clear()
        assert reader.read_into(key, dest) is TierRead.HIT, key
        assert b"".join(bytes(d) for d in dest) == data
        # Every chunk but the pieces under two lines (7, 1 and 123 bytes) is read aligned;
        # at most one short read ends each segment.
        assert all(skew == 0 for n, skew in reads if n > 2 * LINE_BYTES), reads
        assert len(reads) <= chunks + len(dest)
        assert sum(n for n, _ in reads) == size
    # The same bytes without the move: every chunk read in place, once.
    plain = NodeTierReader(config, chunk_bytes=4096, realign=False)
    key, data = next(iter(objects.items()))
    reads.clear()
    dest = at_offset(size, 5, cuts)
    assert plain.read_into(key, dest) is TierRead.HIT
    assert b"".join(bytes(d) for d in dest) == data and len(reads) == chunks


def test_a_flipped_byte_in_a_moved_chunk_or_its_tail_is_never_served(
        config: LocalTierConfig) -> None:
    size = 3 * PART
    objects = payloads(3, size)
    store(config, objects)
    reader = NodeTierReader(config, chunk_bytes=4096, realign=True)
    # A byte in the middle of a moved chunk, and the last byte of the payload (a tail read).
    for key, at in (("page-0", PART + 17), ("page-1", size - 1)):
        path = reader.path_of(key)
        raw = bytearray(path.read_bytes())
        raw[len(raw) - size + at] ^= 0x01
        path.write_bytes(bytes(raw))
        assert reader.read_into(key, at_offset(size, 3, [])) is TierRead.BAD, key
    dest = at_offset(size, 3, [])
    assert reader.read_into("page-2", dest) is TierRead.HIT
    assert bytes(dest[0]) == objects["page-2"]


@pytest.mark.parametrize(("libc", "flags", "fast"), [
    ("glibc 2.36", ["fpu", "erms", "fsrm"], True),
    ("glibc 2.33", ["fsrm"], True),
    ("glibc 2.32", ["fsrm"], False),  # before glibc avoids rep movsb for short moves
    ("glibc 2.39", ["erms"], False),  # no FSRM: rep movsb for them
    ("musl 1.2.4", ["fsrm"], False),
    ("glibc x.y", ["fsrm"], False),
    (None, ["fsrm"], False),
])
def test_moves_into_place_only_where_a_short_move_is_a_vector_loop(
        libc: str | None, flags: list[str], fast: bool) -> None:
    assert short_moves_fast(libc, flags) is fast
