"""The route memory by request id, as pure logic: per-tenant LRU bounds, digests of a
route's body, the conflicts a memo refuses, and replay from journal records."""

from __future__ import annotations

import os

import pytest

from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.errors import InvalidRequestError, RequestIdConflictError
from kvprefetch.controlplane.live.client import RequestIds
from kvprefetch.controlplane.live.routes.ledger import RouteLedger, RouteMemo, route_digest


def _memo(sid: str = "t/s", digest: str = "d", turn: int = 0) -> RouteMemo:
    return RouteMemo(sid, digest, turn, 1.0, api.RouteAnswer(node=1, node_name="node-1",
                                                             request_id="r"))


def test_each_tenant_keeps_its_most_recently_used_ids() -> None:
    ledger = RouteLedger(per_tenant=2)
    for rid in ("a", "b"):
        ledger.put("t", rid, _memo())
    ledger.put("u", "a", _memo("u/s"))
    assert ledger.get("t", "a") is not None  # now the most recently used of t
    ledger.put("t", "c", _memo())
    assert ledger.get("t", "b") is None and ledger.get("t", "a") is not None
    assert sorted(ledger) == [("t", "a"), ("t", "c"), ("u", "a")]
    assert len(ledger) == 3 and ledger.forgotten == 1
    with pytest.raises(ValueError):
        RouteLedger(per_tenant=0)


def test_a_memo_refuses_another_session_or_body() -> None:
    memo = _memo()
    memo.check("r", "t/s", "d")
    memo.check("r", "t/s", None)  # a cancel names the session only
    with pytest.raises(RequestIdConflictError, match="another session"):
        memo.check("r", "t/other", "d")
    with pytest.raises(RequestIdConflictError, match="another body"):
        memo.check("r", "t/s", "e")


def test_the_digest_is_the_body_without_tenant_or_id() -> None:
    base = api.RouteQuery(tenant="t", session_id="s", input_tokens=10, request_id="a")
    same = api.RouteQuery(tenant="u", session_id="s", input_tokens=10, request_id="b")
    assert route_digest(base) == route_digest(same) and len(route_digest(base)) == 32
    others = [api.RouteQuery(session_id="s", input_tokens=11),
              api.RouteQuery(session_id="s2", input_tokens=10),
              api.RouteQuery(session_id="s", input_tokens=10, reused_tokens=5),
              api.RouteQuery(session_id="s", input_tokens=10, reused_tokens=0),
              api.RouteQuery(session_id="s", input_tokens=10, parent_id="p"),
              api.RouteQuery(session_id="s", input_tokens=1, chunk_hashes=["h"]),
              api.RouteQuery(session_id="s", input_tokens=1, chunk_hashes=["h", "i"]),
              api.RouteQuery(session_id="s", input_tokens=1, chunk_hashes=["hi"]),
              api.RouteQuery(session_id="s", token_ids=[1]),
              api.RouteQuery(session_id="s", token_ids=[2]),
              api.RouteQuery(session_id="s", token_ids=[1 << 70])]
    digests = {route_digest(q) for q in [base, *others]}
    assert len(digests) == len(others) + 1  # every body its own digest


def test_a_record_replays_as_the_memo_it_stands_for() -> None:
    memo = _memo(turn=3)
    ledger = RouteLedger(per_tenant=4)
    ledger.replay(memo.record("t", "r", 9.0))
    back = ledger.get("t", "r")
    assert back is not None and back.journalled
    assert (back.session_id, back.digest, back.turn, back.arrival_s, back.answer) == (
        memo.session_id, memo.digest, memo.turn, memo.arrival_s, memo.answer)
    memo.cancelled = True
    ledger.replay(memo.record("t", "r", 9.5))  # the later record wins
    assert ledger.get("t", "r").cancelled  # type: ignore[union-attr]


def test_an_ended_request_forgets_its_routes_but_cancelled_ones() -> None:
    ledger = RouteLedger(per_tenant=8)
    ledger.put("t", "a", _memo("t/s"))
    ledger.put("t", "b", _memo("t/s"))  # a second id for the same request in flight
    ledger.put("t", "c", _memo("t/other"))
    gone = _memo("t/s")
    gone.cancelled = True
    ledger.put("t", "x", gone)
    ledger.finish("t", "t/s")
    assert sorted(ledger) == [("t", "c"), ("t", "x")]
    ledger.finish("t", "t/s")  # nothing left of it: a no-op
    ledger.finish("u", "u/s")
    ledger.finish("t", "t/other")
    assert sorted(ledger) == [("t", "x")]


def test_an_id_reused_by_another_session_is_not_forgotten_by_the_first() -> None:
    ledger = RouteLedger(per_tenant=1)
    ledger.put("t", "a", _memo("t/s"))
    ledger.put("t", "b", _memo("t/s2"))  # forgets a past the bound; t/s still lists it
    ledger.put("t", "a", _memo("t/s3"))  # a again, for another session: forgets b
    ledger.finish("t", "t/s")
    assert sorted(ledger) == [("t", "a")] and ledger.forgotten == 2


@pytest.mark.parametrize("rid", ["", "x" * 65, "a b", "a/b"])
def test_request_ids_are_validated(rid: str) -> None:
    with pytest.raises(InvalidRequestError, match="request_id"):
        api.parse(api.RouteQuery, {"session_id": "s", "input_tokens": 1, "request_id": rid})
    with pytest.raises(InvalidRequestError, match="request_id"):
        api.parse(api.RouteCancel, {"session_id": "s", "request_id": rid})


def test_a_clients_request_ids_are_distinct_also_in_a_forked_child() -> None:
    ids = RequestIds()
    mine = [ids() for _ in range(3)]
    assert len(set(mine)) == 3 and all(len(r) == 32 and int(r, 16) >= 0 for r in mine)
    assert RequestIds()() not in mine  # another client: another random half
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the ids its parent makes next must not be its own
        os.write(write, ids().encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    assert len(child) == 32 and child != ids() and child[:16] != mine[0][:16]


def test_a_sessions_list_of_ids_stays_within_what_is_remembered() -> None:
    ledger = RouteLedger(per_tenant=4)
    for i in range(100):  # fresh ids for one request that never ends
        ledger.put("t", f"r{i}", _memo("t/s"))
    assert len(ledger) == 4 and len(ledger._by_session["t/s"]) <= 17
