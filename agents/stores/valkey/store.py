"""Valkey (or Redis) as the hot tier: striped values fetched in parallel over several
connections, pipelined batches, key prefix and TTL, standalone or cluster, TLS and AUTH.

Layout of one object under ``key`` (``P`` = ``key_prefix``)::

    P h:<key>                 the head: the encoded header, then either the whole payload
                              (an object of at most one part) or the 8-byte version tag of
                              a striped object
    P v:<key>:<tag>:<i>       payload part i (``part_bytes`` each) of the version ``tag``
                              (16 hex digits) when the object has several parts

Objects are immutable once published. A put draws a fresh random tag, writes the new
version's parts under it, then swaps the head (``SET ... GET``) and only then deletes the
parts of the head it replaced. A reader that read a head therefore either finds every part
of that version, or finds one gone (replaced and cleaned up, evicted, expired) and misses
cleanly; it never mixes two versions. A read that finds a part gone or a checksum failure
deletes nothing unless the head is still the very one it read (compare-and-delete in one
small Lua script); a newer version is never touched. A missing part whose head changed
under the reader is retried once with the new head. Explicit deletes take the head with
``GETDEL``, so exactly one caller cleans each version's parts.

Fill leases (read-through promotion that an overwrite always wins): a reader that missed
takes a *lease* on the key before it reads the durable tier: ``SET P h:<key> <marker> NX``,
the marker being :data:`LEASE_MAGIC` and a random token, which every reader answers as a
miss. Its fill publishes the copy only if the head still holds that very marker (a small Lua
script). Any put (the head swapped) or delete (``GETDEL``) since the lease replaced the
marker, and an expired or evicted marker is absent, so a fill never lands over, or after, a
newer version. The marker lives in the head key itself, so the check touches one key (one
cluster slot) and a put pays nothing for it.

Pending uploads (write-back over a durable tier): ``P w:<key>`` holds a random token while
a write-back upload of ``key`` has not reached the durable tier. A tiered store writes it
before the value and removes it (compare-and-delete on its token) once the upload landed;
a reader that misses the head looks for it before it reads the durable tier, which is then
behind. It carries no expiry: under a ``volatile-*`` eviction policy Valkey never evicts it,
and under ``allkeys-*`` it is among the newest keys while its upload runs.

Pinned values (the tiered store's writes that only Valkey holds until S3 has them): written
without expiry (:meth:`ValkeyStore.put_pinned`), confirmed durable with ``WAITAOF`` on the
connection that rewrites their pending upload records after them
(:meth:`ValkeyStore.confirm_durable`: the append-only file is one log, so its fsync up to the
record covers the values written before it), and given their TTL once S3 has them
(:meth:`ValkeyStore.unpin`, only while the key still holds that very version).

Parts of one object hash to different cluster slots on purpose: a large object is then
spread over every shard and read from all of them at once.

A striped head with no tag after its header (parts named ``P p:<key>:<i>``) reads as a
miss; the next put of the key replaces it and deletes those parts.

The store is a facade over its collaborators: :class:`ValkeyClient` (connections and
scripts, :mod:`~kvprefetch.agents.stores.valkey.client`), :class:`KeyLayout` (names and head
decoding), :class:`ValkeyReader` (the read path) and :class:`ValkeyWriter` (puts, leases,
fills, deletes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvprefetch.agents.stores.base import (
    Buffer,
    CancelToken,
    GetResult,
    KeyPool,
    OpResult,
    PayloadSink,
    StatsCounter,
    StoreLifecycle,
    check_cancel,
)
from kvprefetch.agents.stores.errors import (
    NotDurableError,
    ObjectNotFoundError,
    StoreError,
)
from kvprefetch.agents.stores.format import ObjectHeader, make_header
from kvprefetch.agents.stores.valkey.client import ValkeyClient
from kvprefetch.agents.stores.valkey.config import ValkeyStoreConfig, translate_valkey_errors
from kvprefetch.agents.stores.valkey.layout import (
    LEASE_MAGIC,
    LEASE_TOKEN_BYTES,
    TAG_BYTES,
    Head,
    KeyLayout,
    is_lease_marker,
)
from kvprefetch.agents.stores.valkey.reads import ValkeyReader
from kvprefetch.agents.stores.valkey.writes import ValkeyWriter


class ValkeyStore(StoreLifecycle):
    """The Valkey hot tier (see the module docstring for the key layout). Thread-safe; the
    constructor does no I/O, :meth:`start` connects."""

    def __init__(self, config: ValkeyStoreConfig, *, name: str = "valkey") -> None:
        self.config = config
        self.name = name
        self._stats = StatsCounter()
        self._conn = ValkeyClient(config, name)
        self._layout = KeyLayout(config.key_prefix, name)
        self._parts = KeyPool(config.connections, f"{name}-part")
        self._keys = KeyPool(max(2, config.connections // 2), f"{name}-key")
        self._reads = ValkeyReader(config, name, self._conn, self._layout,
                                   parts=self._parts, keys=self._keys)
        self._writes = ValkeyWriter(config, name, self._conn, self._layout, self._stats,
                                    parts=self._parts, keys=self._keys)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Connect and check the server answers (and that the credentials are right).

        Raises :class:`StoreConfigError` (bad credentials, bad TLS files) or
        :class:`StoreConnectionError` (nothing listening at the endpoint).
        """
        self._conn.start()

    def close(self) -> None:
        self._parts.close()
        self._keys.close()
        self._conn.close()

    @property
    def client(self) -> Any:
        """The valkey-py client (for tests and the benchmark's raw baseline)."""
        return self._conn.client

    # -- key layout --------------------------------------------------------------------------

    def head_key(self, key: str) -> str:
        return self._layout.head_key(key)

    def part_key(self, key: str, index: int, tag: str | None = None) -> str:
        """The Valkey key of part ``index`` of version ``tag`` of ``key``. Without ``tag``
        (tools, tests, the benchmark), the current head is read once to learn it; raises
        :class:`ObjectNotFoundError` when the key holds no striped object."""
        if tag is None:
            tag = self._current(key).tag
            if tag is None:
                raise ObjectNotFoundError(f"{key!r}: not a striped object in {self.name}")
        return self._layout.part_name(key, tag, index)

    def physical_keys(self, header: ObjectHeader, tag: str | None = None) -> list[str]:
        """Every Valkey key that holds part of the object (head first). Without ``tag`` the
        current head is read once; it must still be the version ``header`` describes."""
        keys = [self.head_key(header.key)]
        if header.parts > 1:
            if tag is None:
                current = self._current(header.key)
                if current.header != header or current.tag is None:
                    raise ObjectNotFoundError(f"{header.key!r}: replaced by another version")
                tag = current.tag
            keys += self._layout.parts_of_version(header, tag)
        return keys

    def _current(self, key: str) -> Head:
        with translate_valkey_errors("get"):
            raw = self.client.get(self.head_key(key))
        if raw is None:
            raise ObjectNotFoundError(f"{key!r} not in {self.name}")
        return self._layout.parse_head(key, raw)

    # -- ObjectStore -------------------------------------------------------------------------

    def exists(self, keys: Sequence[str], *, cancel: CancelToken | None = None) -> list[OpResult]:
        check_cancel(cancel)
        try:
            with translate_valkey_errors("exists"):
                pipe = self.client.pipeline(transaction=False)
                for k in keys:  # the first bytes: a fill lease's marker is no object
                    pipe.getrange(self.head_key(k), 0, len(LEASE_MAGIC) - 1)
                answers = pipe.execute()
        except StoreError as exc:
            return [OpResult(k, False, exc) for k in keys]
        return [OpResult(k, bool(a) and not is_lease_marker(a))
                for k, a in zip(keys, answers, strict=True)]

    def get(
        self,
        keys: Sequence[str],
        *,
        sink: PayloadSink | None = None,
        cancel: CancelToken | None = None,
    ) -> list[GetResult]:
        """Fetch ``keys``: heads in one pipelined round trip, then every part of the striped
        ones. With ``direct_reads``, an object held inline in its head is received straight
        into the sink; with ``get_lanes`` too, the parts of every striped object are read on
        that many connections (the calling thread takes the first), straight into the sink,
        and any object that goes wrong there (a part gone, damaged, a lane's connection
        lost) is read again alone by the checked path (which re-reads a replaced head and
        drops damage)."""
        return [self._stats.count_get(r) for r in self._reads.get(keys, sink=sink, cancel=cancel)]

    def put(
        self,
        items: Sequence[tuple[str, Buffer]],
        *,
        ttl_s: float | None = None,
        cancel: CancelToken | None = None,
    ) -> list[OpResult]:
        """Store each ``(key, payload)``; raises :class:`ObjectTooLargeError` before writing
        anything if any payload exceeds ``max_object_bytes``."""
        return self._writes.put(items, ttl_s=ttl_s, cancel=cancel)

    def put_pinned(self, items: Sequence[tuple[str, Buffer]], *,
                   cancel: CancelToken | None = None) -> list[OpResult]:
        """Store each ``(key, payload)`` without expiry (whatever ``ttl_s`` is configured):
        a value the durable tier does not hold yet. Under a ``volatile-*`` or
        ``noeviction`` policy Valkey never evicts it."""
        return self._writes.put(items, cancel=cancel, pinned=True)

    def confirm_durable(self, records: Sequence[tuple[str, bytes]], *, replicas: int,
                        timeout_s: float) -> None:
        """Confirm that everything written so far for ``records`` (``(key, token)`` of
        their pending upload records) is in Valkey's append-only file, fsynced, and in
        ``replicas`` replicas' too: the records are rewritten, then ``WAITAOF 1 replicas``
        on the same connection (one pipelined round trip). Raises
        :class:`NotDurableError` when Valkey keeps no append-only file or did not confirm
        within ``timeout_s``, :class:`StoreError` when Valkey fails."""
        if not records:
            return
        with translate_valkey_errors("confirm durability"):
            pipe = self.client.pipeline(transaction=False)
            for k, token in records:
                pipe.set(self._layout.pending_upload_key(k), token)
            pipe.execute_command("WAITAOF", 1, replicas, max(1, round(timeout_s * 1000)))
            answers = pipe.execute(raise_on_error=False)
        got = answers[-1]
        if isinstance(got, Exception):  # a refusal (no append-only file), not a lost link
            raise NotDurableError(f"{self.name}: Valkey cannot confirm durability: {got}")
        local, remote = int(got[0]), int(got[1])
        if local < 1 or remote < replicas:
            raise NotDurableError(
                f"{self.name}: Valkey confirmed {local} local and {remote} replica fsyncs "
                f"of {len(records)} pinned keys within {timeout_s} s (1 and {replicas} "
                "wanted)")

    def unpin(self, items: Sequence[tuple[str, Buffer]], *, ttl_s: float | None) -> int:
        """Give each key its TTL (``ttl_s``, else the configured one; nothing to do for
        none) where it still holds the version of ``payload`` that :meth:`put_pinned`
        wrote: its parts first, then its head, only while the head is unchanged. Returns
        how many heads got it. Raises :class:`StoreError` when Valkey fails."""
        px = self._conn.px(ttl_s)
        if px is None or not items:
            return 0
        done = 0
        with translate_valkey_errors("unpin"):
            pipe = self.client.pipeline(transaction=False)
            for key, _ in items:
                pipe.get(self.head_key(key))
            heads = pipe.execute()
            for (key, payload), raw in zip(items, heads, strict=True):
                if raw is None or is_lease_marker(raw):
                    continue
                try:
                    head = self._layout.parse_head(key, raw)
                except StoreError:
                    continue
                if head.header != make_header(key, payload, self.config.part_bytes):
                    continue  # another version: its writer sets its expiry
                parts = self._layout.parts_of(key, raw)
                if parts:
                    pipe = self.client.pipeline(transaction=False)
                    for name in parts:
                        pipe.pexpire(name, px)
                    pipe.execute()
                done += self._conn.expire_if_unchanged(self.head_key(key), raw, px)
        return done

    def repair(self, items: Sequence[tuple[str, Buffer]], *, ttl_s: float | None = None
               ) -> list[OpResult]:
        """Write good copies (from another tier) of objects found broken here, each only
        where the key holds nothing now (the broken head was dropped): a version written
        meanwhile is never replaced (``ok`` False then)."""
        return self._writes.repair(items, ttl_s=ttl_s)

    def lease(self, keys: Sequence[str], *, ttl_s: float) -> list[bytes | None]:
        """Take a fill lease on each key that holds nothing (one pipelined round trip):
        its marker, to pass to :meth:`fill`, or None (the key holds an object or another
        reader's lease, or Valkey failed). Called by a tiered store for the keys a read
        missed, before it reads them from the durable tier. The marker answers as a miss
        and expires after ``ttl_s``; a put or delete of the key replaces it."""
        return self._writes.lease(keys, ttl_s=ttl_s)

    def fill(self, items: Sequence[tuple[str, Buffer, bytes]], *, ttl_s: float | None = None
             ) -> list[OpResult]:
        """Publish copies read from the durable tier, ``(key, payload, lease marker)`` each,
        only where the key still holds that marker (see :meth:`lease`): ``ok`` False, and
        nothing left behind, when a put, a delete, an expiry or an eviction came first.
        Called from a tiered store's background threads; not idempotent (the lease is used
        up by a successful fill)."""
        return self._writes.fill(items, ttl_s=ttl_s)

    def delete(self, keys: Sequence[str], *, cancel: CancelToken | None = None) -> list[OpResult]:
        """Delete ``keys``: each head taken with ``GETDEL`` (one pipelined round trip), so
        that exactly one caller deletes the parts of the version it took."""
        return self._writes.delete(keys, cancel=cancel)

    # -- pending uploads (see the module docstring) ------------------------------------------

    def mark_pending_uploads(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Record that the durable tier's copies of the keys are about to fall behind (one
        pipelined round trip), ``(key, token)`` each: the caller's fresh token, to pass to
        :meth:`clear_pending_uploads` once the upload landed. Called by a write-back put
        before it writes the values; raises :class:`StoreError` when Valkey fails (the
        records may have landed all the same)."""
        with translate_valkey_errors("mark pending uploads"):
            pipe = self.client.pipeline(transaction=False)
            for k, token in items:
                pipe.set(self._layout.pending_upload_key(k), token)
            pipe.execute()

    def clear_pending_uploads(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Remove the records of uploads that landed, ``(key, token)`` each, only where the
        record still holds that token (a newer put's record stays). Idempotent; raises
        :class:`StoreError` when Valkey fails."""
        with translate_valkey_errors("clear pending uploads"):
            for k, token in items:
                self._conn.delete_if_unchanged(self._layout.pending_upload_key(k), token)

    def drop_pending_uploads(self, keys: Sequence[str]) -> None:
        """Remove the records of ``keys`` whatever they hold (the keys were deleted from
        both tiers). Raises :class:`StoreError` when Valkey fails."""
        self._conn.delete_names([self._layout.pending_upload_key(k) for k in keys])

    def pending_uploads(self, keys: Sequence[str]) -> set[str]:
        """Those of ``keys`` whose durable copy is behind (one pipelined round trip).
        Raises :class:`StoreError` when Valkey fails."""
        if not keys:
            return set()
        with translate_valkey_errors("read pending uploads"):
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._layout.pending_upload_key(k))
            found = pipe.execute()
        return {k for k, n in zip(keys, found, strict=True) if n}


__all__ = [
    "LEASE_MAGIC",
    "LEASE_TOKEN_BYTES",
    "TAG_BYTES",
    "ValkeyStore",
    "ValkeyStoreConfig",
    "translate_valkey_errors",
]
