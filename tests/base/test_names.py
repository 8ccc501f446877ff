"""The rules for session ids and tenant names (:mod:`kvprefetch.controlplane.base.names`),
which the HTTP API, the service's limits and the journal's record checks share."""

from __future__ import annotations

import pytest

from kvprefetch.controlplane.base.errors import InvalidRequestError
from kvprefetch.controlplane.base.names import (
    TENANT_MAX_CHARS,
    check_session_id,
    check_tenant_name,
    is_tenant_name,
)


@pytest.mark.parametrize(("name", "ok"), [
    ("acme", True), ("a.b-c_d:e@f+g=h", True), ("x" * TENANT_MAX_CHARS, True),
    ("x" * (TENANT_MAX_CHARS + 1), False), ("", False), (".", False), ("..", False),
    ("a/b", False), ("a b", False),
])
def test_tenant_names(name: str, ok: bool) -> None:
    assert is_tenant_name(name) is ok
    if ok:
        check_tenant_name(name)
    else:
        with pytest.raises(InvalidRequestError, match=r"^tenants: .*not a valid tenant name"):
            check_tenant_name(name, "tenants")


@pytest.mark.parametrize(("sid", "ok"), [
    ("s1", True), ("parent/agent_002", True), ("a" * 256, True), ("a" * 257, False),
    ("a//b", False), ("a/../b", False), ("/a", False), ("a/", False),
])
def test_session_ids(sid: str, ok: bool) -> None:
    if ok:
        check_session_id(sid)
    else:
        with pytest.raises(InvalidRequestError, match=r"^parent_id: .*not a valid session id"):
            check_session_id(sid, "parent_id")

