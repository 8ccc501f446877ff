"""A tiered store's write-back uploads and the pending upload records they clear.

:class:`WriteBackUploads` holds, per key, the newest payload a write-back put left for S3
and runs one upload task per key (on the store's background threads), which uploads
whatever is newest when it starts and again while newer puts arrive, so that S3 never ends
on an older version; S3's copy of the key is marked stale in the store's
:class:`~kvprefetch.agents.stores.freshness.StaleCopies` until the newest upload lands.

An upload that fails (S3 down) keeps its entry and is tried again once S3 is up
(:meth:`WriteBackUploads.retry_uploads`); meanwhile the value stays pinned in Valkey.

Pending upload records (:class:`PendingUploadStore`, in Valkey) are cleared by the task
whose upload makes them true no longer, each only while it still holds the token its put
wrote, and the value is then given its TTL (:class:`PinningStore`); a clear or an unpin
that Valkey refuses is retried once Valkey answers again
(:meth:`WriteBackUploads.retry_clears`).

Who calls what: the :class:`~kvprefetch.agents.stores.tiered.TieredStore` calls
:meth:`~WriteBackUploads.queue` after a write-back put reached Valkey,
:meth:`~WriteBackUploads.hand_off` before a put goes straight to S3,
:meth:`~WriteBackUploads.release` for the records a put made that no upload of its own
will clear, :meth:`~WriteBackUploads.forget` on delete,
:meth:`~WriteBackUploads.retry_clears` whenever Valkey is up and
:meth:`~WriteBackUploads.retry_uploads` whenever S3 is. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol, runtime_checkable

from kvprefetch.agents.stores.base import Buffer, CancelToken, ObjectStore, OpResult
from kvprefetch.agents.stores.errors import StoreError, StoreUnavailableError
from kvprefetch.agents.stores.freshness import StaleCopies

log = logging.getLogger(__name__)

@runtime_checkable
class PendingUploadStore(Protocol):
    """A hot tier that records which keys' cold copies a write-back upload has yet to
    bring up to date, where every process sharing the tier sees it.

    Called by :class:`TieredStore`: ``mark_pending_uploads`` once per write-back put,
    before the values are written, with a fresh token per key; ``clear_pending_uploads``
    once per upload that landed, or per record that a failed put may have left
    (idempotent; it removes only the records holding the tokens given);
    ``drop_pending_uploads`` after a delete reached both tiers; ``pending_uploads`` once per
    read whose keys missed the hot tier, before the cold tier is read. Each raises
    :class:`StoreError` when the tier fails.
    """

    def mark_pending_uploads(self, items: Sequence[tuple[str, bytes]]) -> None: ...

    def clear_pending_uploads(self, items: Sequence[tuple[str, bytes]]) -> None: ...

    def drop_pending_uploads(self, keys: Sequence[str]) -> None: ...

    def pending_uploads(self, keys: Sequence[str]) -> set[str]: ...


@runtime_checkable
class PinningStore(PendingUploadStore, Protocol):
    """A hot tier that holds values without expiry, durably, until the cold tier has them.

    Called by :class:`TieredStore` for a write that only the hot tier takes (write-back,
    or write-through with ``cold_down="pin"``): ``put_pinned`` once per such put, after its
    pending upload records are marked; ``confirm_durable`` right after it, with those
    records (raises :class:`NotDurableError` when the tier cannot confirm); ``unpin`` once
    the upload landed and the records are cleared (idempotent; it touches only the version
    of the payload given).
    """

    def put_pinned(self, items: Sequence[tuple[str, Buffer]], *,
                   cancel: CancelToken | None = None) -> list[OpResult]: ...

    def confirm_durable(self, records: Sequence[tuple[str, bytes]], *, replicas: int,
                        timeout_s: float) -> None: ...

    def unpin(self, items: Sequence[tuple[str, Buffer]], *, ttl_s: float | None) -> int: ...


#: A key's newest payload not yet in S3: the generation of its stale mark, the payload,
#: and the tokens of the pending upload records to clear once it landed.
Entry = tuple[int, Buffer, tuple[bytes, ...]]


class WriteBackUploads:
    """The write-back uploads of one tiered store (module docstring): ``hot`` keeps the
    pending upload records when it is a :class:`PendingUploadStore`; ``run`` submits a task
    to the store's background threads; ``cold_up`` says whether S3 is up; ``observe``
    reports a tier's errors to the store's circuit breaker."""

    def __init__(self, name: str, hot: ObjectStore, cold: ObjectStore, stale: StaleCopies,
                 *, run: Callable[[Callable[[], None]], None], cold_up: Callable[[], bool],
                 observe: Callable[[ObjectStore, Sequence[StoreError | None]], None],
                 hot_ttl_s: float | None = None) -> None:
        self.name = name
        self._hot_ttl_s = hot_ttl_s
        self._hot = hot
        self._cold = cold
        self._stale = stale
        self._run = run
        self._cold_up = cold_up
        self._observe = observe
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        #: Keys whose upload task runs (one per key).
        self._running: set[str] = set()
        #: Records to clear once Valkey answers again, by key.
        self._uncleared: dict[str, set[bytes]] = {}
        #: Values S3 has that are still pinned in Valkey (their unpin failed), by key.
        self._unpins: dict[str, Buffer] = {}
        #: Keys whose upload failed: their entry waits for S3 to be up again.
        self._waiting: set[str] = set()

    def queue(self, items: Sequence[tuple[str, Buffer]], tokens: dict[str, bytes]) -> None:
        """Write-back puts that reached Valkey: upload each key's payload (the newest wins)
        and then clear the record its put made (``tokens``: each key's)."""
        if not items:
            return
        self._stale.mark("cold", [k for k, _ in items])
        gen = self._stale.generation()
        start = []
        with self._lock:
            for key, payload in items:
                self._entries[key] = (gen, payload, (tokens[key],) if key in tokens else ())
                if key not in self._running:
                    self._running.add(key)
                    start.append(key)
        for key in start:
            self._run(partial(self._upload, key))

    def hand_off(self, items: Sequence[tuple[str, Buffer]]) -> set[str]:
        """A put that goes straight to S3 (Valkey down) while an upload of some of its keys
        is queued or running: that upload could land after it, with the older value.
        Those keys' tasks take the new payload, so whatever order the two land in, S3 ends
        on it; S3's copy stays marked stale until the task is done. Returns the keys
        handed off."""
        with self._lock:
            keys = [k for k, _ in items if k in self._entries or k in self._running]
        if not keys:
            return set()
        self._stale.mark("cold", keys)  # before the entries: the task clears up to theirs
        gen = self._stale.generation()
        handed = set()
        with self._lock:
            for key, payload in items:
                if key in self._entries or key in self._running:  # else it landed before
                    prior = self._entries.get(key)
                    self._entries[key] = (gen, payload, prior[2] if prior else ())
                    handed.add(key)
        return handed

    def release(self, tokens: dict[str, bytes]) -> None:
        """Records a put made (or may have made) that no upload of its own will clear: a
        key whose task runs hands its token to that task (cleared once S3 has the newest
        value); the others are cleared now."""
        clear = []
        with self._lock:
            for key, token in tokens.items():
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries[key] = (*entry[:2], (*entry[2], token))
                else:
                    clear.append((key, token))
        for key, token in clear:
            self._clear(key, (token,))

    def forget(self, keys: Sequence[str]) -> None:
        """The keys were deleted: their queued payloads are not uploaded (a running upload
        that lands deletes what it wrote)."""
        with self._lock:
            for k in keys:
                self._entries.pop(k, None)
                self._waiting.discard(k)
                self._unpins.pop(k, None)

    def retry_uploads(self) -> None:
        """Start again the uploads that failed (called while S3 is up)."""
        if not self._waiting:
            return
        with self._lock:
            start = [k for k in self._waiting if k not in self._running and k in self._entries]
            self._waiting.clear()
            self._running.update(start)
        for key in start:
            self._run(partial(self._upload, key))

    @property
    def uploads_waiting(self) -> int:
        """Keys whose upload failed and waits for S3 (their values pinned in Valkey)."""
        return len(self._waiting)

    def retry_clears(self) -> None:
        """Clear the records whose clear Valkey refused (called while Valkey is up)."""
        if not (self._uncleared or self._unpins):
            return
        with self._lock:
            records, self._uncleared = self._uncleared, {}
            unpins, self._unpins = self._unpins, {}
        for key, tokens in records.items():
            self._clear(key, tuple(tokens), unpins.pop(key, None))
        for key, payload in unpins.items():
            self._unpin(key, payload)

    @property
    def clears_pending(self) -> bool:
        return bool(self._uncleared or self._unpins)  # a dict's truth is atomic (GIL)

    def _upload(self, key: str) -> None:
        while True:
            with self._lock:
                entry = self._entries.get(key)
                if entry is None:  # deleted meanwhile
                    self._running.discard(key)
                    return
            gen, payload, tokens = entry
            res = self._cold.put([(key, payload)]) if self._cold_up() else [
                OpResult(key, False, StoreUnavailableError("cold tier down"))]
            self._observe(self._cold, [r.error for r in res])
            with self._lock:
                newest = self._entries.get(key)
                if newest is not None and newest[0] != gen:
                    continue  # a newer put arrived meanwhile: upload it too
                self._running.discard(key)
                if res[0].ok or newest is None:
                    self._entries.pop(key, None)
                else:  # kept, pinned in Valkey, until S3 takes it
                    self._waiting.add(key)
            if newest is None and res[0].ok:  # deleted while uploading: not resurrected
                self._cold.delete([key])
            elif res[0].ok:
                self._stale.clear("cold", [key], gen)
                self._clear(key, tokens, payload)
            elif newest is not None:  # S3 keeps an older version: reads that miss Valkey miss
                log.warning("%s: upload of %r failed; retried once S3 is up: %s",
                            self.name, key, res[0].error)
            return

    def _clear(self, key: str, tokens: tuple[bytes, ...], payload: Buffer | None = None
               ) -> None:
        """Remove the key's records holding ``tokens``, then give the value S3 now has
        (``payload``) its TTL in Valkey; when Valkey fails, again once it answers
        (meanwhile other processes' reads of the key miss Valkey's copy or find it
        pinned)."""
        hot = self._hot
        if tokens and isinstance(hot, PendingUploadStore):
            try:
                hot.clear_pending_uploads([(key, t) for t in tokens])
            except StoreError as exc:
                self._observe(hot, [exc])
                with self._lock:
                    self._uncleared.setdefault(key, set()).update(tokens)
                    if payload is not None:
                        self._unpins[key] = payload
                log.warning("%s: pending upload record of %r not cleared yet: %s", self.name,
                            key, exc)
                return
        if payload is not None:
            self._unpin(key, payload)

    def _unpin(self, key: str, payload: Buffer) -> None:
        hot = self._hot
        if not isinstance(hot, PinningStore):
            return
        try:
            hot.unpin([(key, payload)], ttl_s=self._hot_ttl_s)
        except StoreError as exc:
            self._observe(hot, [exc])
            with self._lock:
                self._unpins[key] = payload


__all__ = ["PendingUploadStore", "PinningStore", "WriteBackUploads"]
