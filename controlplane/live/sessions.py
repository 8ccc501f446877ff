"""The live service's session registry: who owns each session, what its client told us
about its context, and the names of its stored chunks.

Sessions are keyed by :class:`~controlplane.base.types.SessionKey`; the core and the
predictors know a session by the key's one string form (``key.wire``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from controlplane.base.errors import UnknownSessionError, WrongTenantError
from controlplane.base.keys import chunk_count, session_keys
from controlplane.base.types import SessionKey


@dataclass(slots=True)
class SessionInfo:
    """What the service knows of one live session."""

    key: SessionKey
    turns: int = 0
    in_flight: bool = False
    context_tokens: int = 0
    #: Content hashes of the context's chunks, when the client sent tokens or hashes.
    hashes: tuple[str, ...] | None = None
    arrival_s: float = 0.0
    #: A prefetch still arriving at the chosen node when the request was routed.
    await_prefetch_node: int | None = None
    #: Where the request in flight was routed and its estimated service time there.
    node: int | None = None
    est_service_s: float = 0.0

    @property
    def sid(self) -> str:
        """The session's name in the core, the predictors and the journal."""
        return self.key.wire


class SessionRegistry:
    """Live sessions by key, with tenancy: a session id belongs to the first tenant that
    used it until it is closed, and ``tenants`` (None = any) limits who may call."""

    def __init__(self, chunk_tokens: int, tenants: tuple[str, ...] | None = None) -> None:
        self.chunk_tokens = chunk_tokens
        self.tenants = tenants
        self._sessions: dict[SessionKey, SessionInfo] = {}
        self._owner: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[SessionInfo]:
        return iter(self._sessions.values())

    def check_tenant(self, key: SessionKey) -> None:
        """Raises WrongTenantError for a tenant not allowed or a session of another."""
        if self.tenants is not None and key.tenant not in self.tenants:
            raise WrongTenantError(f"tenant {key.tenant!r} is not allowed")
        owner = self._owner.get(key.session_id)
        if owner is not None and owner != key.tenant:
            raise WrongTenantError(f"session {key.session_id!r} belongs to another tenant")

    def get(self, key: SessionKey) -> SessionInfo | None:
        return self._sessions.get(key)

    def by_sid(self, sid: str) -> SessionInfo | None:
        """The session named ``sid`` in the core (``key.wire``), if it is live."""
        return self._sessions.get(SessionKey.parse(sid))

    def known(self, key: SessionKey) -> SessionInfo:
        """The live session, after the tenant check; UnknownSessionError if there is none."""
        self.check_tenant(key)
        info = self._sessions.get(key)
        if info is None:
            raise UnknownSessionError(
                f"unknown session {key.session_id!r} of tenant {key.tenant!r}")
        return info

    def open(self, key: SessionKey) -> SessionInfo:
        """The session, registered on first use (no tenant check: callers check first)."""
        info = self._sessions.get(key)
        if info is None:
            info = self._sessions[key] = SessionInfo(key)
            self._owner[key.session_id] = key.tenant
        return info

    def close(self, key: SessionKey) -> None:
        if self._sessions.pop(key, None) is not None:
            self._owner.pop(key.session_id, None)

    def keys_of(self, info: SessionInfo, tokens: int) -> list[str]:
        """Names of the stored chunks holding the first ``tokens`` tokens of the context."""
        return session_keys(info.key.tenant, info.key.session_id, tokens, self.chunk_tokens,
                            info.hashes)

    def load_keys(self, info: SessionInfo, tokens: int) -> list[str]:
        """The stored chunks that hold the first ``tokens`` tokens of the session's context:
        the leading chunks of its stored context (``context_tokens``), the last one possibly
        longer than needed. (Naming the first ``tokens`` tokens on their own would name a
        partial chunk that was never stored whenever ``tokens`` falls inside a chunk.)"""
        keys = self.keys_of(info, max(tokens, info.context_tokens))
        return keys[:chunk_count(tokens, self.chunk_tokens)]
