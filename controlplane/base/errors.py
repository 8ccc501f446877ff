"""The one exception hierarchy of kvprefetch.

Every error a user can provoke (a bad trace, a bad config, an unknown plugin) and every
dependency failure at the edges (valkey, botocore, ray) is raised as a subclass of
:class:`KvPrefetchError`, so callers can catch one type and still tell causes apart.
"""

from __future__ import annotations

from pathlib import Path


class KvPrefetchError(Exception):
    """Base class of every error raised by kvprefetch."""


class ConfigError(KvPrefetchError):
    """A fleet or service configuration is invalid; the message names the field."""


class TraceFormatError(KvPrefetchError):
    """A trace file cannot be read; the message names the file, the line and the field."""

    def __init__(
        self,
        message: str,
        *,
        path: str | Path | None = None,
        line: int | None = None,
        field: str | None = None,
    ) -> None:
        self.path = str(path) if path is not None else None
        self.line = line
        self.field = field
        where = []
        if self.path is not None:
            where.append(self.path if line is None else f"{self.path}:{line}")
        if field is not None:
            where.append(f"field {field!r}")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {message}" if prefix else message)


class UnknownFormatError(KvPrefetchError):
    """A trace format name or file could not be matched; the message lists known formats."""


class PluginError(KvPrefetchError):
    """A pluggable part (predictor, policy) could not be found or loaded."""


class PredictorError(KvPrefetchError):
    """A predictor cannot be trained, loaded or used (too little data, bad artifact...)."""


class ServiceError(KvPrefetchError):
    """A call to the live scheduler service was refused; the message says why."""

    #: The HTTP status the API answers with.
    http_status: int = 400


class InvalidRequestError(ServiceError):
    """A call's arguments fail validation (a negative token count, a bad session id...)."""

    http_status = 422


class MalformedHintError(InvalidRequestError):
    """A hint is not one of the known kinds, or its ETA is not a sane duration."""


class UnauthorizedError(ServiceError):
    """The HTTP API wants a bearer token and the call carried none, or a wrong one."""

    http_status = 401


class UnknownSessionError(ServiceError):
    """The session was never started (or was closed and forgotten)."""

    http_status = 404


class WrongTenantError(ServiceError):
    """The session belongs to another tenant, or the tenant is not allowed."""

    http_status = 403


class WrongShardError(ServiceError):
    """The session belongs to another scheduler shard (the caller's shard count is not the
    deployment's); nothing was changed."""

    http_status = 421


class RequestIdConflictError(ServiceError):
    """A route's ``request_id`` names another route of the tenant: one for another session
    or with another body, or one that was cancelled. Nothing was applied; send the query
    with a new id."""

    http_status = 409


class ServiceUnavailableError(ServiceError):
    """The scheduler cannot be reached (not deployed, restarting, timed out)."""

    http_status = 503


class JournalUnavailableError(ServiceError):
    """The scheduler's journal cannot be written (a full disk, a file-size limit): the call
    was refused before it changed anything and nothing of it was recorded, so it may be
    sent again. The message is short; the path and the OS error go to the scheduler's log."""

    http_status = 503
