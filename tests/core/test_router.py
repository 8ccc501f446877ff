"""Routing a request home and demand-loading its KV, through SchedulerCore with a fake fleet
view, and how the router breaks ties (pure logic)."""

from __future__ import annotations

import hashlib
from collections import Counter

from fleet_fakes import FakeFleet, finish_turn, two_node_fleet

from kvprefetch.controlplane.base.config import RouterConfig, default_fleet
from kvprefetch.controlplane.base.types import EventKind, SessionEvent
from kvprefetch.controlplane.core.policies import POLICIES
from kvprefetch.controlplane.core.router import NodeNumbers, Router, RouteRequest, session_rank
from kvprefetch.controlplane.core.scheduler import SchedulerCore
from kvprefetch.controlplane.core.step import DEMAND_PRIORITY
from kvprefetch.predictors.registry import load


def test_demand_load_reserves_room_and_routes_home() -> None:
    core = SchedulerCore(two_node_fleet(), POLICIES["ondemand"], load("last-gap"), FakeFleet())  # type: ignore[arg-type]
    finish_turn(core, "a", 0.0, node=1, ctx=40_000)
    core.dram[1].clear()  # the node restarted: only the remote copy is left
    core.request_started(SessionEvent(EventKind.REQUEST_STARTED, "a", 30.0))
    routed = core.route_request("a", 41_000, 40_000, 30.0)
    node = routed.node
    assert node in (0, 1)
    assert routed.loads == ()  # ondemand loads when the GPU picks the request up
    ticket = core.gpu_start("a", node, 40_000, 30.0).demand_load()
    assert ticket is not None and not ticket.prefetch
    assert ticket.nbytes == 40_000 * core.bpt and ticket.priority == DEMAND_PRIORITY
    assert core.gpu_start("a", node, 40_000, 30.0).loads == ()  # already under way
    entry = core.dram[node].get("a")
    assert entry is not None and entry.pinned and entry.ready_at_s > 30.0
    core.transfer_done("a", node, 31.0, demand=True)
    assert core.use_local("a", node, 40_000, 31.0) == 40_000


def _idle(nodes: int) -> list[NodeNumbers]:
    """``nodes`` equal idle nodes that hold nothing of the session."""
    return [(n, 0.0, 0, 0, 0.0, 0.0) for n in range(nodes)]


def _new(sid: str) -> RouteRequest:
    return RouteRequest(sid, 2_000, 0, None, 0, 1e-9, 0.001)


def test_sessions_no_node_holds_spread_over_equal_nodes() -> None:
    router = Router(default_fleet("8b", 4))
    picked = Counter(router.decide(_new(f"s{i}"), _idle(4)).node for i in range(400))
    # Each node gets its share (100 expected), not all of them node 0.
    assert set(picked) == {0, 1, 2, 3}
    assert min(picked.values()) >= 60, picked


def test_a_tied_session_goes_where_it_went_before_in_every_process() -> None:
    router = Router(default_fleet("8b", 4))
    first = [router.decide(_new(f"s{i}"), _idle(4)).node for i in range(50)]
    again = [Router(default_fleet("8b", 4)).decide(_new(f"s{i}"), _idle(4)).node
             for i in range(50)]
    assert first == again
    # The order is a hash of the ids, not of Python's per-process string hash.
    digest = hashlib.blake2b(b"2:s1", digest_size=8).digest()
    assert session_rank("s1", 2) == int.from_bytes(digest, "big")


def test_tie_share_sets_how_close_estimates_tie() -> None:
    fleet = default_fleet("8b", 2)
    # A session whose own order puts node 1 first.
    sid = next(f"s{i}" for i in range(100) if session_rank(f"s{i}", 0) < session_rank(f"s{i}", 1))
    exact = Router(fleet.model_copy(update={"router": RouterConfig(tie_share=0.0)}))
    wide = Router(fleet.model_copy(update={"router": RouterConfig(tie_share=0.5)}))
    est = exact.estimates(_new(sid), _idle(1))[0]
    # Node 1's queue adds a fifth of the estimate: a tie within 50%, not an exact one.
    nodes: list[NodeNumbers] = [(0, 0.0, 0, 0, 0.0, 0.0), (1, 0.2 * est, 0, 0, 0.0, 0.0)]
    assert exact.decide(_new(sid), nodes).node == 0  # strictly lower
    assert wide.decide(_new(sid), nodes).node == 1  # tied: the session's order picks 1


def test_home_affinity_still_wins_a_tie() -> None:
    router = Router(default_fleet("8b", 4))
    for i in range(20):
        req = RouteRequest(f"s{i}", 2_000, 0, 3, 0, 1e-9, 0.001)
        assert router.decide(req, _idle(4)).node == 3


def test_tie_salt_gives_another_order_of_the_nodes() -> None:
    fleet = default_fleet("8b", 4)
    salted = fleet.model_copy(update={"router": RouterConfig(tie_salt="noise-1")})
    plain = [Router(fleet).decide(_new(f"s{i}"), _idle(4)).node for i in range(100)]
    other = [Router(salted).decide(_new(f"s{i}"), _idle(4)).node for i in range(100)]
    # Each order spreads the sessions; the salted one puts most of them elsewhere.
    assert len(set(other)) == 4
    assert sum(a != b for a, b in zip(plain, other, strict=True)) > 50
