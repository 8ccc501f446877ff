"""The indexed sweep (kvprefetch.controlplane.core.sweep): the same decisions as forecasting every
due
session at every sweep, with forecasts only where the gate may pass."""

from __future__ import annotations

import heapq
import random
from typing import Any

import pytest

from kvprefetch.controlplane.base.config import GIB, fleet_from_dict
from kvprefetch.controlplane.base.types import EventKind, HintKind, SessionEvent
from kvprefetch.controlplane.core.policies import POLICIES
from kvprefetch.controlplane.core.scheduler import IdleFleet, SchedulerCore
from kvprefetch.controlplane.core.step import StepOutput
from kvprefetch.controlplane.core.sweep import IdleIndex
from kvprefetch.predictors.registry import load


class _Driver:
    """One core and its armed orders."""

    def __init__(self, fleet: Any, *, indexed: bool) -> None:
        self.core = SchedulerCore(fleet, POLICIES["predictive"], load("default"), IdleFleet(),
                                  indexed_sweep=indexed)
        self.armed: list[tuple[float, int, Any]] = []
        self.n = 0

    def arm(self, out: StepOutput) -> None:
        for order in out.orders:
            self.n += 1
            heapq.heappush(self.armed, (order.start_at_s, self.n, order))


def _run(fleet_cfg: dict[str, Any], seed: int, sessions: int, turns: int) -> tuple[int, int]:
    fleet = fleet_from_dict(fleet_cfg)
    full, fast = _Driver(fleet, indexed=False), _Driver(fleet, indexed=True)
    assert fast.core._prefetcher.idle is not None and full.core._prefetcher.idle is None
    rng = random.Random(seed)
    stops = ["tool_use", "end_turn", "max_tokens", "other", None]
    ctx = {f"s{i}": 0 for i in range(sessions)}
    t = 0.0
    next_sweep = 10.0
    orders = sweeps = 0

    def both(call: str, *args: Any, **kw: Any) -> StepOutput:
        a = getattr(full.core, call)(*args, **kw)
        b = getattr(fast.core, call)(*args, **kw)
        assert a == b, (call, args)
        full.arm(a)
        fast.arm(b)
        return a

    for _ in range(turns):
        t += rng.choice([0.2, 1.0, 3.0, 8.0, 30.0])
        while full.armed and full.armed[0][0] <= t:
            at, _, oa = heapq.heappop(full.armed)
            _, _, ob = heapq.heappop(fast.armed)
            a = full.core.start_prefetch(oa, at)
            b = fast.core.start_prefetch(ob, at)
            assert a == b
            full.arm(a)
            fast.arm(b)
            for ticket in a.loads:
                both("transfer_done", ticket.session_id, ticket.node, at, demand=False)
        while next_sweep <= t:
            out = both("sweep", next_sweep)
            orders += len(out.orders)
            sweeps += 1
            next_sweep += 10.0
        sid = f"s{rng.randrange(sessions)}"
        r = rng.random()
        if r < 0.03:
            both("close", SessionEvent(EventKind.SESSION_CLOSED, sid, t))
            ctx[sid] = 0
            continue
        if r < 0.12:  # hints: the default predictor's hinted sessions leave their groups
            kind, eta = rng.choice([(HintKind.SESSION_CLOSED, None),
                                    (HintKind.TOOL_RUNNING, rng.choice([2.0, 20.0, 120.0])),
                                    (HintKind.USER_TYPING, None)])
            both("hint", SessionEvent(EventKind.HINT, sid, t, hint=kind, eta_s=eta))
            continue
        inp = ctx[sid] + rng.randrange(500, 20_000)
        both("request_started", SessionEvent(EventKind.REQUEST_STARTED, sid, t,
                                             input_tokens=inp, reused_tokens=ctx[sid]))
        out = both("route_request", sid, inp, ctx[sid], t)
        node = out.node if out.node is not None else 0
        both("gpu_start", sid, node, ctx[sid], t)
        assert full.core.use_local(sid, node, ctx[sid], t) == fast.core.use_local(
            sid, node, ctx[sid], t)
        end = t + rng.choice([0.5, 2.0])
        done = both("request_finished", SessionEvent(
            EventKind.REQUEST_FINISHED, sid, end, input_tokens=inp, output_tokens=300,
            stop_reason=rng.choice(stops), node=node), inp + 300)
        for ticket in done.loads:
            both("transfer_done", ticket.session_id, ticket.node, end, demand=False)
        ctx[sid] = inp + 300
        t = end
    assert full.core.stats == fast.core.stats
    assert full.core.eviction_index_stats() == fast.core.eviction_index_stats()
    return orders, sweeps


@pytest.mark.parametrize("planner", [{}, {"min_confidence": 0.0},
                                     {"min_confidence": 0.3, "min_p_return": 0.1}])
def test_indexed_sweep_decides_as_the_full_sweep(planner: dict[str, float]) -> None:
    cfg = {"nodes": 2, "node": {"dram_tier_bytes": 40 * GIB}, "planner": planner}
    orders, sweeps = _run(cfg, seed=len(planner), sessions=60, turns=1500)
    assert sweeps > 100
    if planner:
        assert orders > 20  # the gate let orders through: the test saw them match


def test_idle_index_expires_exactly_at_the_horizon() -> None:
    idx = IdleIndex(10.0)
    for i in range(100):
        idx.put(f"s{i}", "g" if i % 3 else None, float(i))
    gone = idx.expire(150.0, 100.0)  # silent for more than 100 s: last finish < 50
    assert sorted(gone, key=lambda s: int(s[1:])) == [f"s{i}" for i in range(50)]
    assert len(idx) == 50
    assert sorted(idx.members_in("g", 150.0, [(0.0, 60.0)]), key=lambda s: int(s[1:])) == [
        f"s{i}" for i in range(80, 100) if i % 3]
