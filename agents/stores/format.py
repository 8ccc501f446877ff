"""The object format shared by every store and tier: a small header, then the payload.

Layout (little endian)::

    magic  b"KVPF"        4 bytes
    version               u8   (FORMAT_VERSION)
    checksum algorithm    u8   (1 = xxh64, 2 = xxh3-64)
    key length            u16
    payload length        u64
    part size             u32  (bytes per checksummed part; the last part may be shorter)
    part count            u32
    key                   utf-8
    part digests          u64 x part count
    header digest         u64  (xxh64 of every header byte before it)
    payload

Each part of the payload has its own digest so that parts fetched in parallel (Valkey
stripes, S3 ranges) are verified by the thread that received them, while the bytes are still
in cache, and so that no single thread has to hash the whole object in order. The header
digest covers the key, the length and the part digests, so a flipped byte anywhere is caught.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

import xxhash

from kvprefetch.agents.stores.errors import CorruptObjectError, StoreConfigError

MAGIC: Final = b"KVPF"
FORMAT_VERSION: Final = 1
ALGO_XXH64: Final = 1
ALGO_XXH3_64: Final = 2
#: xxh3-64 by default: the same family as xxh64, several times faster on long inputs.
DEFAULT_ALGO: Final = ALGO_XXH3_64
MAX_KEY_BYTES: Final = 1024

_PREFIX = struct.Struct("<4sBBHQII")
PREFIX_BYTES: Final = _PREFIX.size  # 24
_U64 = struct.Struct("<Q")


def _digest(algo: int, data: bytes | bytearray | memoryview) -> int:
    if algo == ALGO_XXH3_64:
        return int(xxhash.xxh3_64_intdigest(data))
    if algo == ALGO_XXH64:
        return int(xxhash.xxh64_intdigest(data))
    raise CorruptObjectError(f"unknown checksum algorithm {algo}")


def part_digest(data: bytes | bytearray | memoryview, algo: int = DEFAULT_ALGO) -> int:
    """The digest of one part, as :func:`make_header` computes it (for writers that hash
    each part while they send it and build the header afterwards)."""
    return _digest(algo, data)


def part_count(payload_bytes: int, part_bytes: int) -> int:
    """How many parts a payload of ``payload_bytes`` has (0 for an empty one)."""
    if part_bytes <= 0:
        raise StoreConfigError(f"part_bytes must be positive, got {part_bytes}")
    return -(-payload_bytes // part_bytes)


def validate_key(key: str) -> bytes:
    """Return the key's utf-8 bytes; raise :class:`StoreConfigError` for an unusable key."""
    if not isinstance(key, str) or not key:
        raise StoreConfigError(f"a key must be a non-empty string, got {key!r}")
    raw = key.encode("utf-8")
    if len(raw) > MAX_KEY_BYTES:
        raise StoreConfigError(f"key of {len(raw)} bytes exceeds {MAX_KEY_BYTES} bytes")
    return raw


@dataclass(frozen=True, slots=True)
class ObjectHeader:
    """The decoded header of one object."""

    key: str
    payload_bytes: int
    part_bytes: int
    digests: tuple[int, ...]
    algo: int = DEFAULT_ALGO

    @property
    def parts(self) -> int:
        return len(self.digests)

    @property
    def header_bytes(self) -> int:
        return PREFIX_BYTES + len(self.key.encode("utf-8")) + 8 * len(self.digests) + 8

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + self.payload_bytes

    def part_range(self, index: int) -> tuple[int, int]:
        """Payload offsets ``[start, end)`` of part ``index``."""
        start = index * self.part_bytes
        return start, min(start + self.part_bytes, self.payload_bytes)

    def verify_part(self, index: int, data: bytes | bytearray | memoryview) -> None:
        """Raise :class:`CorruptObjectError` unless ``data`` is part ``index``, intact."""
        start, end = self.part_range(index)
        if len(data) != end - start:
            raise CorruptObjectError(
                f"{self.key!r}: part {index} has {len(data)} bytes, expected {end - start}"
            )
        if _digest(self.algo, data) != self.digests[index]:
            raise CorruptObjectError(f"{self.key!r}: checksum mismatch in part {index}")

    def verify_payload(self, payload: bytes | bytearray | memoryview) -> None:
        view = memoryview(payload)
        if len(view) != self.payload_bytes:
            raise CorruptObjectError(
                f"{self.key!r}: payload has {len(view)} bytes, expected {self.payload_bytes}"
            )
        for i in range(self.parts):
            start, end = self.part_range(i)
            self.verify_part(i, view[start:end])

    def encode(self) -> bytes:
        raw_key = self.key.encode("utf-8")
        body = b"".join(
            [
                _PREFIX.pack(
                    MAGIC, FORMAT_VERSION, self.algo, len(raw_key), self.payload_bytes,
                    self.part_bytes, len(self.digests),
                ),
                raw_key,
                struct.pack(f"<{len(self.digests)}Q", *self.digests),
            ]
        )
        return body + _U64.pack(xxhash.xxh64_intdigest(body))


def make_header(
    key: str,
    payload: bytes | bytearray | memoryview,
    part_bytes: int,
    algo: int = DEFAULT_ALGO,
) -> ObjectHeader:
    """Compute the header (and the part digests) of ``payload`` stored under ``key``."""
    validate_key(key)
    if part_bytes <= 0:
        raise StoreConfigError(f"part_bytes must be positive, got {part_bytes}")
    view = memoryview(payload).cast("B")
    n = len(view)
    digests = tuple(
        _digest(algo, view[start : min(start + part_bytes, n)]) for start in range(0, n, part_bytes)
    )
    return ObjectHeader(key=key, payload_bytes=n, part_bytes=part_bytes, digests=digests, algo=algo)


def header_length(prefix: bytes | bytearray | memoryview) -> int:
    """Total header length announced by the first :data:`PREFIX_BYTES` bytes of an object."""
    if len(prefix) < PREFIX_BYTES:
        raise CorruptObjectError(f"object shorter than its {PREFIX_BYTES}-byte header prefix")
    magic, version, _algo, key_len, _n, _part, parts = _PREFIX.unpack_from(prefix, 0)
    if magic != MAGIC:
        raise CorruptObjectError(f"bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise CorruptObjectError(f"unsupported format version {version}")
    return int(PREFIX_BYTES + key_len + 8 * parts + 8)


def decode_header(
    data: bytes | bytearray | memoryview, expected_key: str | None = None
) -> ObjectHeader:
    """Parse and verify the header at the start of ``data``.

    Raises :class:`CorruptObjectError` for a bad magic, version, digest, part layout, or a key
    other than ``expected_key``.
    """
    view = memoryview(data).cast("B")
    length = header_length(view)
    if len(view) < length:
        raise CorruptObjectError(f"object of {len(view)} bytes is shorter than its header")
    _magic, _version, algo, key_len, payload_bytes, part_bytes, parts = _PREFIX.unpack_from(view)
    (stored,) = _U64.unpack_from(view, length - 8)
    if xxhash.xxh64_intdigest(view[: length - 8]) != stored:
        raise CorruptObjectError("header checksum mismatch")
    try:
        key = bytes(view[PREFIX_BYTES : PREFIX_BYTES + key_len]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptObjectError("key is not utf-8") from exc
    if expected_key is not None and key != expected_key:
        raise CorruptObjectError(f"object holds key {key!r}, expected {expected_key!r}")
    expected_parts = -(-payload_bytes // part_bytes) if part_bytes else -1
    if expected_parts != parts:
        raise CorruptObjectError(f"{key!r}: {parts} parts do not cover {payload_bytes} bytes")
    digests = struct.unpack_from(f"<{parts}Q", view, PREFIX_BYTES + key_len)
    return ObjectHeader(
        key=key, payload_bytes=payload_bytes, part_bytes=part_bytes, digests=digests, algo=algo
    )


def encode_object(
    key: str, payload: bytes | bytearray | memoryview, part_bytes: int
) -> tuple[ObjectHeader, bytes]:
    """The header for ``payload`` and its encoded bytes (the payload follows it unchanged)."""
    header = make_header(key, payload, part_bytes)
    return header, header.encode()


def decode_object(
    data: bytes | bytearray | memoryview, expected_key: str | None = None
) -> tuple[ObjectHeader, memoryview]:
    """Verify a whole encoded object and return its header and a view of its payload."""
    view = memoryview(data).cast("B")
    header = decode_header(view, expected_key)
    payload = view[header.header_bytes :]
    header.verify_payload(payload)
    return header, payload
