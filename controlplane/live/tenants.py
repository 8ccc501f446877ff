"""Who is calling: bearer tokens mapped to tenants, and the refusal of a tenant over its
session quota.

Three kinds of credentials (:class:`TenantAuth`):

* a **tenant token** belongs to exactly one tenant: every call made with it is that
  tenant's, whatever the body says (a body that names another tenant is refused with 403;
  leaving ``tenant`` out is the usual way). Sessions are keyed by (tenant, session id), so
  a tenant never sees, changes or learns of another tenant's sessions: an id of another
  tenant is simply an id this tenant has not used (404 where a session must exist);
* an **admin token** (operators) may act for any tenant, named in the body;
* the **shared token** (``http.bearer_token``): one token for every gateway, the tenant
  taken from the body. It authenticates the caller, not the tenant: any holder may act for
  any tenant; configs that need isolation give tenant tokens instead;
* a **metrics token** (``http.metrics_token``) reads ``/metrics`` and nothing else (the
  admin token reads it too); without one, ``/metrics`` is open.

Without any token configured every caller is anonymous and names its tenant in the body.
Where the body names the tenant (shared token, no auth), at most ``max_named_tenants``
distinct tenants are admitted per process; a call naming one more is refused
(:class:`TenantLimitError`, 403), so that one caller cannot grow the scheduler's
per-tenant state without bound.
Tokens are compared by their SHA-256 digests (one dictionary look-up, no comparison that
leaks a prefix) and never logged.
"""

from __future__ import annotations

import enum
import hashlib
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from kvprefetch.controlplane.base.errors import (
    ConfigError,
    ServiceError,
    UnauthorizedError,
    WrongTenantError,
)
from kvprefetch.controlplane.base.types import DEFAULT_TENANT

#: Shortest tenant, admin or metrics token accepted (the shared token is exempt).
MIN_TOKEN_CHARS = 16
#: Distinct tenants a shared-token (or unauthenticated) deployment admits by default.
DEFAULT_MAX_NAMED_TENANTS = 64


class TenantQuotaError(ServiceError):
    """The tenant holds as many live sessions as its quota allows (HTTP 429): close some,
    or raise its ``max_live_sessions``. Other tenants are not affected."""

    http_status = 429


class TenantLimitError(ServiceError):
    """The body names a new tenant, and the deployment, where bodies name their tenants,
    already admitted ``max_named_tenants`` of them (HTTP 403; the admitted ones are not
    affected). Give tenants their own tokens, or raise ``http.max_named_tenants``."""

    http_status = 403


class Role(enum.StrEnum):
    TENANT = "tenant"  # one tenant's token
    ADMIN = "admin"  # operators: any tenant
    SHARED = "shared"  # one token for every gateway: any tenant, from the body
    ANONYMOUS = "anonymous"  # no auth configured
    METRICS = "metrics"  # reads /metrics only


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller a token identifies: one tenant's, or one that names its tenant."""

    role: Role
    tenant: str | None = None

    def tenant_for(self, named: str | None) -> str:
        """The tenant this call acts for, given the tenant its body names (None: none).
        Raises WrongTenantError (403) when a tenant token's body names another tenant."""
        if self.role is Role.TENANT:
            assert self.tenant is not None
            if named is not None and named != self.tenant:
                raise WrongTenantError(f"the body names tenant {named!r}, but the token is "
                                       "another tenant's (leave tenant out: the token "
                                       "says whose call it is)")
            return self.tenant
        return named if named is not None else DEFAULT_TENANT


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TenantAuth:
    """Bearer tokens -> :class:`Principal`. ``tenants``: tenant name -> its token (a token
    maps to exactly one tenant); ``admin_token``: operators'; ``shared_token``: one token
    for every gateway; ``metrics_token``: reads ``/metrics`` only; ``max_named_tenants``:
    distinct tenants admitted where bodies name them (shared token, no auth). Raises
    ConfigError for an empty, short or repeated token (the message names the tenant,
    never the token). Thread-safe."""

    def __init__(self, tenants: Mapping[str, str] | None = None, *,
                 admin_token: str | None = None, shared_token: str | None = None,
                 metrics_token: str | None = None,
                 max_named_tenants: int = DEFAULT_MAX_NAMED_TENANTS) -> None:
        if max_named_tenants < 1:
            raise ConfigError("max_named_tenants: must be >= 1")
        self._by_digest: dict[bytes, Principal] = {}
        for tenant, token in (tenants or {}).items():
            self._add(token, Principal(Role.TENANT, tenant), f"tenant {tenant!r}")
        if admin_token is not None:
            self._add(admin_token, Principal(Role.ADMIN), "the admin")
        if shared_token is not None:
            if not shared_token.strip():
                raise ConfigError("http bearer_token: empty (give a token or None for no "
                                  "auth)")
            self._add(shared_token, Principal(Role.SHARED), "the shared bearer token",
                      min_chars=1)
        #: The credentials of the operations (``/v1``); the metrics token is not one.
        self._operations = dict(self._by_digest)
        if metrics_token is not None:
            self._add(metrics_token, Principal(Role.METRICS), "the metrics reader")
        self.tenants = tuple(tenants or ())
        self.max_named_tenants = max_named_tenants
        #: Tenants admitted where bodies name them; at most ``max_named_tenants``.
        self._named: set[str] = set()
        self._named_lock = threading.Lock()

    def _add(self, token: str, who: Principal, what: str, *,
             min_chars: int = MIN_TOKEN_CHARS) -> None:
        if len(token.strip()) < min_chars:
            raise ConfigError(f"the token of {what} is shorter than {min_chars} characters")
        digest = _digest(token)
        if digest in self._by_digest:
            raise ConfigError(f"the token of {what} is also another credential's: each "
                              "token must map to exactly one tenant")
        self._by_digest[digest] = who

    def __getstate__(self) -> dict[str, object]:
        """Pickled (to the scheduler actor that serves the API) as the tokens' digests
        and the tenants named so far; never a token, never the lock."""
        state = dict(self.__dict__)
        del state["_named_lock"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._named_lock = threading.Lock()

    @property
    def required(self) -> bool:
        """Whether calls must carry a token."""
        return bool(self._operations)

    @property
    def metrics_guarded(self) -> bool:
        """Whether ``/metrics`` needs the metrics (or the admin) token."""
        return any(p.role is Role.METRICS for p in self._by_digest.values())

    @property
    def isolated(self) -> bool:
        """Whether tenants have tokens of their own (else the body names the tenant)."""
        return bool(self.tenants)

    def authenticate(self, token: str | None) -> Principal:
        """The caller of an operation with ``token``; UnauthorizedError (401) for none or
        an unknown one (the metrics token is unknown here)."""
        if not self._operations:
            return Principal(Role.ANONYMOUS)
        if token is None:
            raise UnauthorizedError("missing bearer token (Authorization: Bearer <token>)")
        who = self._operations.get(_digest(token))
        if who is None:
            raise UnauthorizedError("wrong bearer token")
        return who

    def authorize_metrics(self, token: str | None) -> None:
        """Whether ``token`` may read ``/metrics``: any caller when no metrics token is
        configured, else the metrics or the admin token (UnauthorizedError, 401)."""
        if not self.metrics_guarded:
            return
        if token is None:
            raise UnauthorizedError("missing bearer token: /metrics needs the metrics or "
                                    "the admin token (Authorization: Bearer <token>)")
        who = self._by_digest.get(_digest(token))
        if who is None or who.role not in (Role.METRICS, Role.ADMIN):
            raise UnauthorizedError("wrong bearer token for /metrics (the metrics or the "
                                    "admin token)")

    def tenant_for(self, principal: Principal, named: str | None) -> str:
        """The tenant a call of ``principal`` acts for, given the tenant its body names
        (see :meth:`Principal.tenant_for`). Where the body names it (shared token, no
        auth), a tenant beyond the first ``max_named_tenants`` is refused with
        TenantLimitError (403)."""
        tenant = principal.tenant_for(named)
        if principal.role in (Role.SHARED, Role.ANONYMOUS) and tenant not in self._named:
            with self._named_lock:
                if tenant not in self._named:
                    if len(self._named) >= self.max_named_tenants:
                        raise TenantLimitError(
                            f"tenant {tenant!r}: this deployment already serves "
                            f"{self.max_named_tenants} tenants named by callers "
                            "(http.max_named_tenants); give tenants their own tokens")
                    self._named.add(tenant)
        return tenant

    def pseudonym_key(self) -> bytes:
        """The key of the tenants' pseudonyms on an open ``/metrics``: derived from the
        configured credentials (stable across restarts while they stay the same, and
        unknown to whoever holds none of them), random without any."""
        if not self._by_digest:
            return secrets.token_bytes(32)
        return hashlib.sha256(b"kvprefetch metrics pseudonyms\0"
                              + b"".join(sorted(self._by_digest))).digest()

    @property
    def named_tenants(self) -> int:
        """Distinct tenants admitted where bodies name them."""
        return len(self._named)
