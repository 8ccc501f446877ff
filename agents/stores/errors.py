"""The store exception hierarchy: every valkey, botocore and OS error is translated here.

Callers catch :class:`StoreError` (or :class:`~kvprefetch.controlplane.base.errors.KvPrefetchError`)
and tell causes apart by subclass. A *miss* (not found, corrupt, unavailable) is an answer, not a
failure: batched calls report it per key instead of raising.
"""

from __future__ import annotations

from kvprefetch.controlplane.base.errors import ConfigError, KvPrefetchError


class StoreError(KvPrefetchError):
    """Base class of every error raised by a token store, a local tier or the engine."""

    #: True when the engine should treat the key as a miss (recompute) rather than a fault.
    is_miss: bool = False


class StoreConfigError(StoreError, ConfigError):
    """A store is configured wrongly (bad endpoint, bad credentials, bad option)."""


class StoreConnectionError(StoreError):
    """The server could not be reached or the connection was lost mid-request."""

    is_miss = True


class StoreTimeoutError(StoreConnectionError):
    """The server did not answer within the configured timeout."""


class StoreUnavailableError(StoreConnectionError):
    """No tier of a tiered store could serve the request (all are down)."""


class ObjectNotFoundError(StoreError):
    """The key is not in the store (or expired)."""

    is_miss = True


class CorruptObjectError(StoreError):
    """The stored bytes fail verification (magic, version, key, length or checksum).

    The object has been deleted where it was found and counted; to callers it is a miss.
    """

    is_miss = True


class ObjectTooLargeError(StoreError):
    """The payload exceeds the store's ``max_object_bytes``; nothing was written."""


class TierFullError(StoreError):
    """A local tier cannot make room for an object (after eviction); nothing was written."""


class PutRefusedError(StoreError):
    """A tiered store refused a put: the value is not durable where every reader would
    find it. The value may have reached one tier; no reader ever reads a value older than
    the last acknowledged put of the key because of it. The subclass says why."""


class ColdTierDownError(PutRefusedError):
    """Write-through, ``cold_down="refuse"``: S3 did not take the put (down, or it
    failed)."""


class HotTierDownError(PutRefusedError):
    """Valkey could not be written: another process could go on reading Valkey's older
    copy of the key, so the put is not acknowledged even where S3 took it."""


class NotDurableError(PutRefusedError):
    """A value held in Valkey until S3 has it (write-back, or ``cold_down="pin"``) was not
    confirmed durable: Valkey's append-only file (and the replicas asked for) did not
    acknowledge it within ``pin_timeout_s`` (``WAITAOF``), or the hot tier cannot pin."""


class CancelledError(StoreError):
    """The operation was cancelled through its
    :class:`~kvprefetch.agents.stores.base.CancelToken`."""


__all__ = [
    "CancelledError",
    "ColdTierDownError",
    "CorruptObjectError",
    "HotTierDownError",
    "NotDurableError",
    "ObjectNotFoundError",
    "ObjectTooLargeError",
    "PutRefusedError",
    "StoreConfigError",
    "StoreConnectionError",
    "StoreError",
    "StoreTimeoutError",
    "StoreUnavailableError",
    "TierFullError",
]
