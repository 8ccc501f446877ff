"""Errors of the LMCache integration, translated at this edge from ZMQ, HTTP and LMCache.

Every class is a :class:`~kvprefetch.agents.stores.errors.StoreError` (so a
:class:`~kvprefetch.controlplane.base.errors.KvPrefetchError`): the agent's loop can catch one type
and still tell a misconfigured node (:class:`LMCacheConfigMismatchError`, raised at start-up)
from a node whose engine has not registered yet (:class:`LMCacheNoLayoutError`) and from a
server that is down or slow (:class:`LMCacheUnavailableError`, :class:`LMCacheTimeoutError`).

The LMCache MP server answers a failing ZMQ handler with no reply at all, so on the engine
side a server-side error shows up as a timeout; :class:`LMCacheTimeoutError` names the
operation so the server log can be searched for it.
"""

from __future__ import annotations

from kvprefetch.agents.stores.errors import (
    StoreConfigError,
    StoreConnectionError,
    StoreError,
    StoreTimeoutError,
)


class LMCacheError(StoreError):
    """Base class of every error raised by the LMCache clients."""


class LMCacheConfigMismatchError(LMCacheError, StoreConfigError):
    """Our side and the LMCache server disagree on a setting that makes keys (or the
    transfer path) incompatible; detected at start-up instead of missing silently.

    ``field`` is the server's name for the setting (``chunk_size``, ``hash_algorithm``,
    ``supported_transfer_mode``, ``world_size`` ...), ``expected`` our value and ``actual``
    the server's.
    """

    def __init__(self, field: str, expected: object, actual: object, *, where: str = "",
                 hint: str = "") -> None:
        self.field = field
        self.expected = expected
        self.actual = actual
        server = f"the LMCache server at {where}" if where else "the LMCache server"
        message = f"{server} has {field}={actual!r} but we expect {field}={expected!r}"
        super().__init__(f"{message}; {hint}" if hint else message)


class LMCacheNoLayoutError(LMCacheError):
    """The server has no KV layout registered for ``(model_name, world_size)``: no engine
    on this node has registered its KV cache yet, so LMCache cannot size a warm prefetch
    (``POST /cache/prefetches`` answers 503). Retry once the engine is up."""

    def __init__(self, message: str, *, model_name: str = "", world_size: int = 0) -> None:
        self.model_name = model_name
        self.world_size = world_size
        super().__init__(message)


class LMCacheUnavailableError(LMCacheError, StoreConnectionError):
    """The server cannot be reached, is not initialised, or refused for another reason
    (an HTTP 503 other than "no layout registered")."""


class LMCacheTimeoutError(LMCacheError, StoreTimeoutError):
    """A request got no answer in time. On ZMQ this is also how a server-side handler
    failure looks (the server sends no reply): see the server log for ``operation``."""

    def __init__(self, message: str, *, operation: str = "") -> None:
        self.operation = operation
        super().__init__(message)


class LMCacheRequestError(LMCacheError):
    """The server rejected a request as malformed or unknown (HTTP 400, 404, 422)."""

    def __init__(self, message: str, *, status_code: int = 0) -> None:
        self.status_code = status_code
        super().__init__(message)


class LMCacheTransferError(LMCacheError):
    """A store or retrieve through the engine-driven path did not complete (the server
    reported a partial store, or lost data the lookup had locked)."""


__all__ = [
    "LMCacheConfigMismatchError",
    "LMCacheError",
    "LMCacheNoLayoutError",
    "LMCacheRequestError",
    "LMCacheTimeoutError",
    "LMCacheTransferError",
    "LMCacheUnavailableError",
]
