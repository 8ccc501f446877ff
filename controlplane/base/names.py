"""The rules for the names a caller gives: session ids and tenant names, which every edge
(the HTTP API, the scheduler service, the journal's record checks) applies alike.

Session ids: 1-256 characters of ``A-Z a-z 0-9 . _ : @ + = - /``; ``/`` separates parts
(Claude Code sub-agents: ``parent/agent_002``), and no part may be empty, ``.`` or ``..``
(such ids would name no object in S3, or another session's). Tenant names follow the same
rules without ``/`` and at most 64 characters.
"""

from __future__ import annotations

import re

from kvprefetch.controlplane.base.errors import InvalidRequestError

_PLAIN = "A-Za-z0-9_:@+="  # the allowed characters other than '.', '-' and '/'
#: One part of a name: any allowed characters, but not "." or "..".
_PART = rf"(?:[{_PLAIN}-][{_PLAIN}.-]*|\.[{_PLAIN}-][{_PLAIN}.-]*|\.\.[{_PLAIN}.-]+)"
#: A session id (JSON-schema / Rust-regex compatible: no look-arounds).
SESSION_ID_PATTERN = rf"^{_PART}(?:/{_PART})*$"
SESSION_ID_MAX_CHARS = 256
#: A tenant name.
TENANT_PATTERN = rf"^{_PART}$"
TENANT_MAX_CHARS = 64
_SESSION_ID = re.compile(SESSION_ID_PATTERN)
_TENANT = re.compile(TENANT_PATTERN)


def is_tenant_name(tenant: str) -> bool:
    """Whether ``tenant`` follows the rules for tenant names."""
    return len(tenant) <= TENANT_MAX_CHARS and _TENANT.match(tenant) is not None


def check_session_id(session_id: str, field: str = "session_id") -> None:
    """InvalidRequestError naming ``field`` unless ``session_id`` follows the rules."""
    if len(session_id) > SESSION_ID_MAX_CHARS or not _SESSION_ID.match(session_id):
        raise InvalidRequestError(
            f"{field}: {session_id[:80]!r} is not a valid session id (1-{SESSION_ID_MAX_CHARS} "
            "characters of A-Z a-z 0-9 . _ : @ + = - and '/' between parts; no part empty, "
            "'.' or '..')")


def check_tenant_name(tenant: str, field: str = "tenant") -> None:
    """InvalidRequestError naming ``field`` unless ``tenant`` follows the rules."""
    if not is_tenant_name(tenant):
        raise InvalidRequestError(
            f"{field}: {tenant[:80]!r} is not a valid tenant name (1-{TENANT_MAX_CHARS} "
            "characters of A-Z a-z 0-9 . _ : @ + = -; not '.' or '..')")
