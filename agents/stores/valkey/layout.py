"""The Valkey store's key layout: the names of an object's head and parts, and how a head
is read (see :mod:`kvprefetch.agents.stores.valkey.store` for the layout itself). Pure: no
I/O."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvprefetch.agents.stores.errors import CorruptObjectError, ObjectNotFoundError
from kvprefetch.agents.stores.format import ObjectHeader, decode_header

#: Bytes of the version tag that follows a striped object's header in its head.
TAG_BYTES = 8

#: The first bytes of a fill lease's marker in a head (never the start of an object).
LEASE_MAGIC = b"KVPL"
#: Random bytes after :data:`LEASE_MAGIC` in a marker: tells one reader's lease from another's.
LEASE_TOKEN_BYTES = 16


def new_lease_marker() -> bytes:
    """A fresh fill lease's marker: :data:`LEASE_MAGIC` and a random token."""
    return LEASE_MAGIC + os.urandom(LEASE_TOKEN_BYTES)


def is_lease_marker(raw: bytes) -> bool:
    """Whether a head value is a fill lease's marker (which every reader answers as a miss)."""
    return raw[: len(LEASE_MAGIC)] == LEASE_MAGIC


def new_tag() -> bytes:
    """A fresh version tag for the parts of a striped object."""
    return os.urandom(TAG_BYTES)


@dataclass(frozen=True, slots=True)
class Head:
    """One head as read: its raw value (what compare-and-delete compares), its header, and
    the version tag of a striped object's parts (None when the payload is in the head)."""

    raw: bytes
    header: ObjectHeader
    tag: str | None


class KeyLayout:
    """Valkey key names under one ``key_prefix``, and the decoding of heads; ``store`` names
    the store in error messages."""

    def __init__(self, prefix: str, store: str) -> None:
        self.prefix = prefix
        self.store = store

    def head_key(self, key: str) -> str:
        return f"{self.prefix}h:{key}"

    def pending_upload_key(self, key: str) -> str:
        """The record that a write-back upload of ``key`` has not reached the durable tier
        yet (see :meth:`ValkeyStore.mark_pending_uploads`)."""
        return f"{self.prefix}w:{key}"

    def part_name(self, key: str, tag: str, index: int) -> str:
        """Part ``index`` of the version ``tag`` (16 hex digits) of ``key``."""
        return f"{self.prefix}v:{key}:{tag}:{index}"

    def untagged_part_name(self, key: str, index: int) -> str:
        """A part of a striped object written without a version tag (only ever deleted)."""
        return f"{self.prefix}p:{key}:{index}"

    def parse_head(self, key: str, raw: bytes) -> Head:
        """Decode a head. Raises :class:`CorruptObjectError` for a damaged one and
        :class:`ObjectNotFoundError` for a striped head without a version tag and for a fill
        lease's marker."""
        if is_lease_marker(raw):
            raise ObjectNotFoundError(f"{key!r}: not in {self.store} (a fill is pending)")
        header = decode_header(raw, expected_key=key)
        rest = len(raw) - header.header_bytes
        if header.parts <= 1:
            return Head(raw, header, None)
        if rest == TAG_BYTES:
            return Head(raw, header, raw[header.header_bytes :].hex())
        if rest == 0:
            raise ObjectNotFoundError(f"{key!r}: a striped head without a version tag")
        raise CorruptObjectError(f"{key!r}: striped head carries {rest} bytes after its header")

    def parts_of(self, key: str, raw: bytes | None) -> list[str]:
        """The part keys of the object whose head value is ``raw`` (nothing for a head that
        is gone, damaged or holds its payload itself)."""
        if raw is None:
            return []
        try:
            header = decode_header(raw, expected_key=key)
        except CorruptObjectError:
            return []
        rest = len(raw) - header.header_bytes
        if header.parts <= 1:
            return []
        if rest == TAG_BYTES:
            tag = raw[header.header_bytes :].hex()
            return [self.part_name(key, tag, i) for i in range(header.parts)]
        if rest == 0:
            return [self.untagged_part_name(key, i) for i in range(header.parts)]
        return []

    def parts_of_version(self, header: ObjectHeader, tag: str | None) -> list[str]:
        """Every part key of the version ``tag`` of ``header``'s object (none without a tag)."""
        if tag is None:
            return []
        return [self.part_name(header.key, tag, i) for i in range(header.parts)]
