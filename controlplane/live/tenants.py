"""Who is calling: bearer tokens mapped to tenants, and the refusal of a tenant over its
session quota.

Three kinds of credentials (:class:`TenantAuth`):

* a **tenant token** belongs to exactly one tenant: every call made with it is that
  tenant's, whatever the body says (a body that names another tenant is refused with 403;
  leaving ``tenant`` out is the usual way). Sessions are keyed by (tenant, session id), so
  a tenant never sees, changes or learns of another tenant's sessions: an id of another
  tenant is simply an id this tenant has not used (404 where a session must exist);
* an **admin token** (operators) may act for any tenant, named in the body;
* the **shared token** of older configs (``http.bearer_token``) keeps its old meaning:
  one token for every gateway, the tenant taken from the body. It authenticates the
  caller, not the tenant; configs that need isolation give tenant tokens instead.

Without any token configured every caller is anonymous and names its tenant in the body.
Tokens are compared by their SHA-256 digests (one dictionary look-up, no comparison that
leaks a prefix) and never logged.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from kvprefetch.controlplane.base.errors import (
    ConfigError,
    ServiceError,
    UnauthorizedError,
    WrongTenantError,
)
from kvprefetch.controlplane.base.types import DEFAULT_TENANT

#: Shortest tenant or admin token accepted (a shared token of older configs is exempt).
MIN_TOKEN_CHARS = 16


class TenantQuotaError(ServiceError):
    """The tenant holds as many live sessions as its quota allows (HTTP 429): close some,
    or raise its ``max_live_sessions``. Other tenants are not affected."""

    http_status = 429


class Role(enum.StrEnum):
    TENANT = "tenant"  # one tenant's token
    ADMIN = "admin"  # operators: any tenant
    SHARED = "shared"  # the one token of older configs: any tenant, from the body
    ANONYMOUS = "anonymous"  # no auth configured


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
    maps to exactly one tenant); ``admin_token``: operators'; ``shared_token``: the one
    token of older configs. Raises ConfigError for an empty, short or repeated token
    (the message names the tenant, never the token)."""

    def __init__(self, tenants: Mapping[str, str] | None = None, *,
                 admin_token: str | None = None, shared_token: str | None = None) -> None:
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
        self.tenants = tuple(tenants or ())

    def _add(self, token: str, who: Principal, what: str, *,
             min_chars: int = MIN_TOKEN_CHARS) -> None:
        if len(token.strip()) < min_chars:
            raise ConfigError(f"the token of {what} is shorter than {min_chars} characters")
        digest = _digest(token)
        if digest in self._by_digest:
            raise ConfigError(f"the token of {what} is also another credential's: each "
                              "token must map to exactly one tenant")
        self._by_digest[digest] = who

    @property
    def required(self) -> bool:
        """Whether calls must carry a token."""
        return bool(self._by_digest)

    @property
    def isolated(self) -> bool:
        """Whether tenants have tokens of their own (else the body names the tenant)."""
        return bool(self.tenants)

    def authenticate(self, token: str | None) -> Principal:
        """The caller of ``token``; UnauthorizedError (401) for none or an unknown one."""
        if not self._by_digest:
            return Principal(Role.ANONYMOUS)
        if token is None:
            raise UnauthorizedError("missing bearer token (Authorization: Bearer <token>)")
        who = self._by_digest.get(_digest(token))
        if who is None:
            raise UnauthorizedError("wrong bearer token")
        return who
