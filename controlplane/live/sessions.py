"""The live service's session registry: who owns each session, what its client told us
about its context, and the names of its stored chunks.

Sessions are keyed by :class:`~kvprefetch.controlplane.base.types.SessionKey`, (tenant, session id):
each tenant has its own id namespace, so one tenant can neither squat nor detect another's
ids (a session of another tenant is, to the caller, one that does not exist). The core and
the predictors know a session by the key's one string form (``key.wire``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from kvprefetch.controlplane.base.errors import UnknownSessionError, WrongTenantError
from kvprefetch.controlplane.base.keys import chunk_count, session_keys
from kvprefetch.controlplane.base.types import SessionKey
from kvprefetch.controlplane.live.tenants import TenantQuotaError


class SessionQuery(BaseModel):
    """Which session to describe (``POST /v1/session_state``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenant: str = "default"
    session_id: str


class SessionState(BaseModel):
    """What the scheduler holds for one live session of the caller's tenant."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    session_id: str
    #: Requests started so far.
    turns: int
    #: A request is running (started, not finished).
    in_flight: bool
    #: Tokens of the context after the last finished request.
    context_tokens: int
    #: Whether its chunks are keyed by content (the client sent token ids or hashes).
    keyed_by_content: bool


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


    def state(self) -> SessionState:
        return SessionState(session_id=self.key.session_id, turns=self.turns,
                            in_flight=self.in_flight, context_tokens=self.context_tokens,
                            keyed_by_content=self.hashes is not None)


class SessionRegistry:
    """Live sessions by (tenant, session id). ``tenants`` (None = any) limits who may
    call; ``quota(tenant)`` is how many live sessions a tenant may hold (enforced by
    :meth:`admit`, not by :meth:`open`: a journal replayed on restart re-opens what was
    admitted before)."""

    def __init__(self, chunk_tokens: int, tenants: tuple[str, ...] | None = None,
                 quota: Callable[[str], int] | None = None) -> None:
        self.chunk_tokens = chunk_tokens
        self.tenants = tenants
        self.quota = quota
        self._sessions: dict[SessionKey, SessionInfo] = {}
        #: Live sessions per tenant (a tenant with none has no entry: bounded by tenants
        #: with live sessions).
        self.per_tenant: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[SessionInfo]:
        return iter(self._sessions.values())

    def check_tenant(self, key: SessionKey) -> None:
        """Raises WrongTenantError for a tenant not allowed."""
        if self.tenants is not None and key.tenant not in self.tenants:
            raise WrongTenantError(f"tenant {key.tenant!r} is not allowed")

    def admit(self, key: SessionKey) -> None:
        """Before a gateway call opens ``key``: the tenant check, and TenantQuotaError when
        the session is new and its tenant holds its quota of live sessions already."""
        self.check_tenant(key)
        if key in self._sessions or self.quota is None:
            return
        quota = self.quota(key.tenant)
        if self.per_tenant[key.tenant] >= quota:
            raise TenantQuotaError(
                f"tenant {key.tenant!r} holds {self.per_tenant[key.tenant]} live sessions, "
                f"its quota (max_live_sessions {quota}): close sessions it no longer "
                "needs, or raise its quota")

    def get(self, key: SessionKey) -> SessionInfo | None:
        return self._sessions.get(key)

    def by_sid(self, sid: str) -> SessionInfo | None:
        """The session named ``sid`` in the core (``key.wire``), if it is live."""
        return self._sessions.get(SessionKey.parse(sid))

    def known(self, key: SessionKey) -> SessionInfo:
        """The live session, after the tenant check; UnknownSessionError if there is none
        (the same answer whether another tenant uses the id or no one does)."""
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
            self.per_tenant[key.tenant] += 1
        return info

    def close(self, key: SessionKey) -> None:
        if self._sessions.pop(key, None) is not None:
            self.per_tenant[key.tenant] -= 1
            if self.per_tenant[key.tenant] <= 0:
                del self.per_tenant[key.tenant]

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
