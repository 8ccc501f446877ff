"""What one gateway call may carry: request-body size, list lengths, token-id range, and
the names it gives (the rules for session ids and tenant names:
:mod:`kvprefetch.controlplane.base.names`). Checked at every edge (the HTTP API before
parsing, the scheduler service before it touches any state), so that a call over a limit
is refused whole (422 naming the field, or 413 for the body) and never half-applied.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.errors import InvalidRequestError
from kvprefetch.controlplane.base.keys import chunk_hashes
from kvprefetch.controlplane.base.names import check_session_id, check_tenant_name, is_tenant_name

MIB = 1 << 20


class RequestLimits(BaseModel):
    """Limits on one gateway call (``http.limits`` in the serve config). The defaults
    admit a 1M-token context: 1,048,576 token ids (about 7 MiB of JSON for vocabularies
    below 10^6) within a 16 MiB body."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Largest HTTP request body (413 above it, before it is read whole).
    max_body_bytes: int = Field(16 * MIB, ge=4096, le=1 << 30)
    #: Longest ``token_ids`` list (one request's prompt).
    max_token_ids: int = Field(1 << 20, ge=1, le=10_000_000)
    #: Longest ``chunk_hashes`` list (a whole context's chunks).
    max_chunk_hashes: int = Field(1 << 14, ge=1, le=1_000_000)
    #: Largest token id (ids are 0..max_token_id; vocabularies are far below 2^31).
    max_token_id: int = Field((1 << 31) - 1, ge=1, le=(1 << 63) - 1)
    #: The HTTP edge (:mod:`kvprefetch.controlplane.live.http_edge`); the scheduler service
    #: ignores these. A body must arrive whole within ``body_read_timeout_s``, and after
    #: its first ``body_rate_grace_s`` at no less than ``min_body_rate_bytes_per_s`` on
    #: average (408 otherwise, the connection closed).
    body_read_timeout_s: float = Field(30.0, gt=0, le=3600)
    min_body_rate_bytes_per_s: int = Field(64 * 1024, ge=0)
    body_rate_grace_s: float = Field(1.0, ge=0, le=60)
    #: Connections the server holds (:mod:`kvprefetch.controlplane.live.http_conn`): past
    #: it a new connection takes the slot of the oldest idle one that has not passed the
    #: token check, or is answered 503 when every one is busy or has.
    max_connections: int = Field(1024, ge=1, le=1_000_000)
    #: The same, per client address (``max_connections`` where that is lower).
    max_connections_per_client: int = Field(256, ge=1, le=1_000_000)
    #: Connections admitted past ``max_connections`` for ``GET /healthz`` only.
    health_connections: int = Field(16, ge=0, le=10_000)
    #: A connection must deliver a call's headers within ``header_read_timeout_s`` of
    #: opening, and a kept-alive one its next call's within ``idle_timeout_s`` of the last
    #: answer; it is closed otherwise.
    header_read_timeout_s: float = Field(10.0, gt=0, le=3600)
    idle_timeout_s: float = Field(15.0, gt=0, le=3600)
    #: After a refusal sent before the body was read (with ``Connection: close``), the
    #: server reads and discards up to ``refusal_drain_bytes`` of the body for up to
    #: ``refusal_drain_timeout_s`` before closing, so that a client still sending reads
    #: the answer instead of a reset.
    refusal_drain_bytes: int = Field(16 * MIB, ge=0, le=1 << 32)
    refusal_drain_timeout_s: float = Field(5.0, ge=0, le=600)
    #: Calls per second each caller (a tenant's token; the admin, shared or no token each
    #: count as one caller) may make, as a token bucket of ``rate_limit_burst_calls``;
    #: past it a call is answered 429 with ``Retry-After``, unread. None: no limit.
    rate_limit_calls_per_s: float | None = Field(None, gt=0, le=1_000_000)
    #: The bucket's size (default: one second's calls, at least 1).
    rate_limit_burst_calls: int | None = Field(None, ge=1, le=10_000_000)
    #: Per-tenant rates (calls per second) that replace ``rate_limit_calls_per_s`` for
    #: those tenants' tokens.
    tenant_rate_limits_calls_per_s: dict[str, float] = Field(default_factory=dict)
    #: A body over ``large_body_bytes`` (or of unknown length) is large: each caller
    #: (a tenant's token; the admin, shared or no token each count as one caller) has at
    #: most ``max_large_bodies_per_caller`` of them read and validated at once, and waits
    #: up to ``body_read_timeout_s`` for a turn (429 after it).
    large_body_bytes: int = Field(64 * 1024, ge=1024)
    max_large_bodies_per_caller: int = Field(2, ge=1, le=1024)
    #: A caller's bodies that are refused (400, 408, 413, 422) are charged, in bytes, to
    #: a budget of ``refused_body_burst_bytes`` refilled at ``refused_body_bytes_per_s``;
    #: while it is spent the caller's large bodies are answered 429 (with
    #: ``Retry-After``) unread, so that they cannot take the edge's CPU from other
    #: callers. Valid bodies are never charged.
    refused_body_burst_bytes: int = Field(64 * MIB, ge=1024)
    refused_body_bytes_per_s: int = Field(1 * MIB, ge=1)
    #: Field errors a 422 lists (validation stops collecting after them).
    max_listed_errors: int = Field(20, ge=1, le=1000)
    #: Events one ``POST /v1/events`` batch carries at most (422 above it); its body is
    #: at most ``large_body_bytes`` (413 above it).
    max_batch_events: int = Field(256, ge=1, le=10_000)

    @model_validator(mode="after")
    def _fits(self) -> RequestLimits:
        # A token list at its limit must fit in a body: each id takes up to
        # digits(max_token_id) + 1 bytes of JSON.
        need = self.max_token_ids * (len(str(self.max_token_id)) + 1) + 4096
        if need > self.max_body_bytes:
            raise ValueError(f"max_body_bytes={self.max_body_bytes} cannot hold "
                             f"max_token_ids={self.max_token_ids} ids up to "
                             f"{self.max_token_id} ({need} bytes of JSON): raise it or "
                             "lower the others")
        for tenant, rate in self.tenant_rate_limits_calls_per_s.items():
            if not is_tenant_name(tenant):
                raise ValueError(f"tenant_rate_limits_calls_per_s: {tenant[:80]!r} is not a "
                                 "valid tenant name")
            if not 0 < rate <= 1_000_000:
                raise ValueError(f"tenant_rate_limits_calls_per_s.{tenant}: {rate} is not "
                                 "a rate in (0, 1000000] calls per second")
        return self

    def rate_limit_for(self, tenant: str | None) -> tuple[float, int] | None:
        """(calls per second, burst calls) of a caller (a tenant's token: ``tenant``),
        or None: no limit."""
        rate = self.tenant_rate_limits_calls_per_s.get(tenant or "",
                                                       self.rate_limit_calls_per_s)
        if rate is None:
            return None
        return rate, self.rate_limit_burst_calls or max(1, int(rate))


def max_hashes(limits: RequestLimits, chunk_tokens: int) -> int:
    """The longest ``chunk_hashes`` the scheduler takes: ``max_chunk_hashes``, and never
    fewer than the hashes of ``max_token_ids`` ids (which :func:`prehash` may send)."""
    return max(limits.max_chunk_hashes, -(-limits.max_token_ids // chunk_tokens))


def check_call(call: Any, limits: RequestLimits, chunk_tokens: int | None = None) -> None:
    """Refuse a gateway call over ``limits`` or with a bad name (InvalidRequestError
    naming the field). Cheap: one pass over the token ids at most. ``chunk_tokens``: the
    scheduler's, whose hash limit is :func:`max_hashes`."""
    check_tenant_name(call.tenant)
    check_session_id(call.session_id)
    parent = _field(call, "parent_id")
    if parent is not None:
        check_session_id(parent, "parent_id")
    token_ids = _field(call, "token_ids")
    if token_ids is not None:
        if len(token_ids) > limits.max_token_ids:
            raise InvalidRequestError(f"token_ids: {len(token_ids)} ids, more than the limit "
                                      f"of {limits.max_token_ids} (max_token_ids)")
        if token_ids and (min(token_ids) < 0 or max(token_ids) > limits.max_token_id):
            raise InvalidRequestError(f"token_ids: ids must be 0..{limits.max_token_id} "
                                      "(max_token_id)")
    hashes = _field(call, "chunk_hashes")
    most = limits.max_chunk_hashes if chunk_tokens is None else max_hashes(limits, chunk_tokens)
    if hashes is not None and len(hashes) > most:
        raise InvalidRequestError(f"chunk_hashes: {len(hashes)} hashes, more than the limit "
                                  f"of {most} (max_chunk_hashes)")


def _field(call: Any, name: str) -> Any:
    """``getattr(call, name, None)``; for a pydantic model without that field, without the
    AttributeError its ``__getattr__`` raises and formats (a few percent of a scheduler
    actor's time per event)."""
    fields = getattr(call, "__dict__", None)
    return fields.get(name) if fields is not None else getattr(call, name, None)


def prehash(call: api.RouteQuery | api.RequestStarted, chunk_tokens: int
            ) -> api.RouteQuery | api.RequestStarted:
    """The same call with its ``token_ids`` replaced by their chunk hashes (and
    ``input_tokens``): what the scheduler would compute, done by the caller, outside any
    lock and before the call crosses a process boundary (a few thousand hashes instead of
    a million ids). A call without token ids is returned as it is."""
    if call.token_ids is None:
        return call
    hashes = chunk_hashes(call.token_ids, chunk_tokens)
    request_id = _field(call, "request_id")  # a route's, kept: it makes the route idempotent
    return type(call).model_construct(
        tenant=call.tenant, session_id=call.session_id, input_tokens=len(call.token_ids),
        token_ids=None, chunk_hashes=hashes, reused_tokens=call.reused_tokens,
        parent_id=call.parent_id, **({} if request_id is None else {"request_id": request_id}))
