"""A reader of the node-local DRAM tier that the agent writes (no SGLang, no torch).

The agent's :class:`~agents.stores.local.LocalTier` and SGLang's storage backend live in
different processes, so the backend does not open the tier (its ``start`` would drop the
agent's in-flight writes, and its index is per process). Objects are published by atomic
rename, one file per key at :meth:`LocalTier.path_of`, so a reader that opens the file by
name sees a whole, checksummed object or nothing. ``exists`` is one ``stat`` per key.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from agents.stores.base import PayloadSink, PayloadWriter
from agents.stores.errors import CorruptObjectError, StoreError
from agents.stores.format import PREFIX_BYTES, decode_header, header_length
from agents.stores.local import LocalTier, LocalTierConfig


class NodeTierReader:
    """Reads published objects of a node-local tier directory. Thread-safe (no state)."""

    def __init__(self, config: LocalTierConfig) -> None:
        self.config = config
        self._names = LocalTier(config, name="sglang-view")  # no I/O: only path_of

    def path_of(self, key: str) -> Path:
        return self._names.path_of(key)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [os.path.exists(self.path_of(k)) for k in keys]

    def prefix_hits(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are in the tier."""
        for i, key in enumerate(keys):
            if not os.path.exists(self.path_of(key)):
                return i
        return len(keys)

    def read(self, key: str, sink: PayloadSink) -> bool:
        """Read and verify one object into a writer of ``sink``; False on a miss or any
        failure (the writer is aborted; a corrupt file is left for the agent's tier)."""
        try:
            fd = os.open(self.path_of(key), os.O_RDONLY)
        except FileNotFoundError:
            return False
        writer: PayloadWriter | None = None
        try:
            with os.fdopen(fd, "rb", buffering=0) as f:
                prefix = f.read(PREFIX_BYTES)
                head = prefix + f.read(header_length(prefix) - PREFIX_BYTES)
                header = decode_header(head, expected_key=key)
                writer = sink.open(header)
                scratch: bytearray | None = None
                for i in range(header.parts):
                    start, end = header.part_range(i)
                    part = writer.target(start, end - start)
                    direct = part is not None
                    if part is None:
                        if scratch is None:
                            scratch = bytearray(min(header.part_bytes, header.payload_bytes))
                        part = memoryview(scratch)[: end - start]
                    if f.readinto(part) != end - start:
                        raise CorruptObjectError(f"{key!r}: truncated in part {i}")
                    header.verify_part(i, part)
                    if direct:
                        writer.written(start, end - start)
                    else:
                        writer.write_at(start, part)
                writer.commit()
            return True
        except (StoreError, OSError):
            if writer is not None:
                writer.abort()
            return False
