"""SchedulerCore's session book-keeping, with a fake fleet view (pure logic)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from fleet_fakes import FakeFleet, finish_turn, session_home, two_node_fleet

from kvprefetch.controlplane.base.config import GIB, fleet_from_dict
from kvprefetch.controlplane.base.types import ArrivalForecast, EventKind, HintKind, SessionEvent
from kvprefetch.controlplane.core.bets import LEAD_BINS, BetRecord
from kvprefetch.controlplane.core.policies import POLICIES
from kvprefetch.controlplane.core.scheduler import SchedulerCore
from kvprefetch.controlplane.core.step import QUEUED_PRIORITY, StepOutput
from kvprefetch.predictors.registry import load


def test_forget_drops_session_and_predictor_state() -> None:
    core = SchedulerCore(two_node_fleet(), POLICIES["predictive"], load("last-gap"), FakeFleet())  # type: ignore[arg-type]
    finish_turn(core, "a", 0.0, node=1, ctx=1000)
    assert session_home(core, "a") == 1
    assert core.predictor.forecast("a", 5.0) is not None
    closed = SessionEvent(EventKind.SESSION_CLOSED, "a", 5.0)
    core.close(closed)
    assert core.close(closed) == StepOutput.empty()  # idempotent
    assert session_home(core, "a") is None
    assert core.predictor.forecast("a", 5.0) is None


def test_the_step_output_carries_the_planners_priority_and_reports_only_real_evictions(
) -> None:
    whole = replace(POLICIES["perfect"], suffix_eviction=False)
    core = SchedulerCore(two_node_fleet(), whole, load("last-gap"), FakeFleet())  # type: ignore[arg-type]
    # Writing the same session through twice replaces its entry: not an eviction.
    finish_turn(core, "a", 0.0, node=0, ctx=40_000)
    assert finish_turn(core, "a", 10.0, node=0, ctx=40_100).evictions == ()
    finish_turn(core, "b", 20.0, node=0, ctx=40_000)
    out = finish_turn(core, "c", 30.0, node=0, ctx=40_000)
    (gone,) = out.evictions
    assert core.dram[0].get(gone.session_id) is None and gone.node == 0
    # A prefetch load keeps the priority its order was planned with (room made first).
    for entry in list(core.dram[0]):
        core.dram[0].remove(entry.session_id)
    (order,) = core.transfer_failed(gone.session_id, 0, 40.0).orders
    out = core.start_prefetch(order, order.start_at_s)
    while out.orders:  # its forecast moved later: follow the re-plans
        order = out.orders[0]
        out = core.start_prefetch(order, order.start_at_s)
    (ticket,) = out.loads
    assert ticket.prefetch and ticket.priority == order.priority > 0


def test_suffix_eviction_cuts_the_victim_back_to_the_whole_chunks_of_its_prefix_that_fit(
) -> None:
    # The DRAM tier (10 GiB) holds two 40k-token sessions (4.88 GiB each) and 1,920 tokens
    # more; a third needs a victim's room less that.
    room = 10 * GIB // (128 << 10)  # 81,920 tokens
    for name, cut in (("predictive", True), ("ondemand", False)):
        core = SchedulerCore(two_node_fleet(), POLICIES[name], load("last-gap"), FakeFleet())  # type: ignore[arg-type]
        finish_turn(core, "a", 0.0, node=0, ctx=40_000)
        finish_turn(core, "b", 20.0, node=0, ctx=40_000)
        out = finish_turn(core, "c", 30.0, node=0, ctx=40_000)
        tier = core.dram[0]
        assert tier.used_bytes <= tier.capacity_bytes
        if not cut:  # the LMCache-modelled baseline drops the whole victim
            assert [e.session_id for e in out.evictions] == ["a"] and out.trims == ()
            continue
        (trim,) = out.trims
        keep = (room - 3 * 40_000 + 40_000) // 256 * 256  # 1,792: whole chunks only
        assert out.evictions == () and trim.node == 0 and trim.keep_tokens == keep
        victim = tier.get(trim.session_id)
        assert victim is not None and victim.tokens == keep
        assert victim.nbytes == keep * core.bpt
        assert core.local_tokens(0, trim.session_id) == keep
        # A returning request finds the prefix local: its demand load moves only the rest.
        sid = trim.session_id
        core.request_started(SessionEvent(EventKind.REQUEST_STARTED, sid, 40.0,
                                          input_tokens=40_500))
        routed = core.route_request(sid, 40_500, 40_000, 40.0)
        started = core.gpu_start(sid, routed.node, 40_000, 40.5)
        load_ticket = routed.demand_load() or started.demand_load()  # the one load
        assert len(routed.loads) + len(started.loads) == 1 and load_ticket is not None
        assert routed.node == 0 and load_ticket.nbytes == (40_000 - keep) * core.bpt


class _QueuedFleet(FakeFleet):
    """Idle links; every node's GPU queue holds ``wait_s`` seconds of work."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s

    def queue_wait_s(self, node: int, now_s: float) -> float:
        return self.wait_s


def _evicted_session_routed(wait_s: float, min_wait_fraction: float = 0.0
                            ) -> tuple[SchedulerCore, StepOutput]:
    """s0 finishes on node 0, its agent then reports it no longer holds it, and it returns
    at 10 s: the core and the output of its routing (``min_wait_fraction``:
    ``planner.arrival_load_min_wait_fraction``)."""
    fleet = two_node_fleet()
    fleet = fleet.model_copy(update={"planner": fleet.planner.model_copy(
        update={"arrival_load_min_wait_fraction": min_wait_fraction})})
    core = SchedulerCore(fleet, POLICIES["predictive"], load("last-gap"),
                         _QueuedFleet(wait_s))
    finish_turn(core, "s0", 0.0, 0, 40_000)
    core.reconcile(0, lambda sid, tokens: sid != "s0", 5.0)
    assert core.dram[0].get("s0") is None
    core.request_started(SessionEvent(EventKind.REQUEST_STARTED, "s0", 10.0,
                                      input_tokens=41_000, reused_tokens=40_000))
    routed = core.route_request("s0", 41_000, 40_000, 10.0)
    assert routed.node == 0
    return core, routed


def _evicted_session_returns(wait_s: float, min_wait_fraction: float = 0.0
                             ) -> tuple[StepOutput, StepOutput]:
    """The outputs of s0's routing (:func:`_evicted_session_routed`) and of its GPU start
    after the queue wait, with no timer firing in between."""
    core, routed = _evicted_session_routed(wait_s, min_wait_fraction)
    return routed, core.gpu_start("s0", 0, 40_000, 10.0 + wait_s)


def test_predictive_loads_during_any_queue_wait_unless_told_to_wait_for_a_longer_one(
) -> None:
    # The load: 40k tokens x 128 KiB at 5 GB/s + 0.5 ms = 1.0491 s to last byte. By default
    # (arrival_load_min_wait_fraction 0) it starts at arrival behind any queue, at the
    # priority of a load whose request still waits, due at the estimated GPU start.
    for wait in (0.1, 0.6):
        routed, started = _evicted_session_returns(wait)
        ticket = routed.demand_load()
        assert ticket is not None and not ticket.prefetch
        assert ticket.priority == QUEUED_PRIORITY and ticket.deadline_s == 10.0 + wait
        assert started.demand_load() is None  # already under way: not loaded twice
    # No queue: loaded when the GPU picks it up (now), as an engine that fetches on its own
    # would, so not twice.
    routed, started = _evicted_session_returns(0.0)
    assert routed.demand_load() is None and started.demand_load() is not None
    # 0.5 puts the line at a 0.5246 s queue wait: a shorter one loads at GPU start.
    routed, started = _evicted_session_returns(0.6, 0.5)
    assert routed.demand_load() is not None
    assert started.demand_load() is None
    routed, started = _evicted_session_returns(0.5, 0.5)
    assert routed.demand_load() is None
    assert started.demand_load() is not None


def test_a_node_that_restarts_empty_is_warmed_with_its_sessions_within_its_free_room() -> None:
    # Node 0's tier holds two 40k-token sessions; three idle sessions call it home: it is
    # warmed before any prefetch is planned. No waste allowance and nothing prefetched
    # read yet: the waste budget would refuse any prefetch, and does not hold a warm-up
    # back (free room only).
    fleet = fleet_from_dict({"nodes": 2, "node": {"dram_tier_bytes": 10 * GIB},
                             "planner": {"waste_allowance_gib": 0}})
    core = SchedulerCore(fleet, POLICIES["predictive"], load("last-gap"), FakeFleet())
    for i, t in enumerate((0.0, 2.0, 4.0)):
        finish_turn(core, f"s{i}", t, 0, 40_000)
    finish_turn(core, "x", 6.0, 1, 40_000)  # another node's session: not node 0's to warm
    out = core.clear_local(100.0)
    warm = {ticket.session_id for ticket in out.loads if ticket.node == 0}
    assert len(warm) == 2 and warm <= {"s0", "s1", "s2"}
    # What did not fit is planned: an order, no warm-up.
    assert {o.session_id for o in out.orders} == {"s0", "s1", "s2"} - warm
    assert all(ticket.prefetch and ticket.priority < 100.0 for ticket in out.loads)
    assert core.dram[0].used_bytes <= core.dram[0].capacity_bytes
    assert not any(e.session_id == "x" for e in core.dram[0])
    warmed = sum(ticket.nbytes for ticket in out.loads)
    assert core.stats.warmup_bytes == warmed and core.stats.prefetches_over_budget == 0
    # The credit grows by what was warmed, not more: a prefetch beyond it is refused.
    budgets = core._budgets
    assert budgets.within_waste_budget(0, 0.0) and not budgets.within_waste_budget(1, 0.0)


def test_behind_a_long_queue_predictive_loads_a_few_ttlbs_before_the_gpu_start() -> None:
    # 5 s of queue is beyond arrival_load_max_wait_fraction (3) x 1.0491 s: the load is
    # armed to start 3 TTLBs before the estimated GPU start (15 s), not at arrival.
    core, routed = _evicted_session_routed(5.0)
    assert routed.loads == ()
    (order,) = routed.orders
    assert order.queued and order.node == 0 and order.tokens == 40_000
    assert order.start_at_s == pytest.approx(15.0 - 3 * 1.0491, abs=1e-3)
    assert order.deadline_s == pytest.approx(15.0)
    started = core.start_prefetch(order, order.start_at_s)
    ticket = started.demand_load()
    assert ticket is not None and not ticket.prefetch and ticket.deadline_s == order.deadline_s
    assert core.gpu_start("s0", 0, 40_000, 15.0).loads == ()  # under way: not loaded twice
    # The GPU picks the request up before the timer: it loads then, and the timer is void.
    core, routed = _evicted_session_routed(5.0)
    (order,) = routed.orders
    assert core.gpu_start("s0", 0, 40_000, 11.0).demand_load() is not None
    assert core.start_prefetch(order, order.start_at_s).loads == ()


def _queued_behind(wait_a_s: float, start_a_s: float
                   ) -> tuple[SchedulerCore, StepOutput, StepOutput]:
    """Request "ahead" (a new session whose own order of the nodes puts node 0 first) is
    routed to node 0 at 9 s with ``wait_a_s`` of queue ahead, then s0 (its KV gone from
    node 0) at 10 s with 7 s (expected on the GPU at 17 s, its load armed 3 TTLBs before:
    13.85 s); "ahead" reaches the GPU at ``start_a_s``. The core, s0's routing and the GPU
    start of "ahead"."""
    fleet = _QueuedFleet(wait_a_s)
    core = SchedulerCore(two_node_fleet(), POLICIES["predictive"], load("last-gap"), fleet)
    finish_turn(core, "s0", 0.0, 0, 40_000)
    core.reconcile(0, lambda sid, tokens: sid != "s0", 5.0)
    core.request_started(SessionEvent(EventKind.REQUEST_STARTED, "ahead", 9.0,
                                      input_tokens=500))
    assert core.route_request("ahead", 500, 0, 9.0).node == 0
    fleet.wait_s = 7.0
    core.request_started(SessionEvent(EventKind.REQUEST_STARTED, "s0", 10.0,
                                      input_tokens=41_000, reused_tokens=40_000))
    routed = core.route_request("s0", 41_000, 40_000, 10.0)
    (order,) = routed.orders
    assert order.queued and order.start_at_s == pytest.approx(17.0 - 3 * 1.0491, abs=1e-3)
    return core, routed, core.gpu_start("ahead", 0, 0, start_a_s)


def test_a_queue_that_runs_ahead_of_its_estimates_starts_the_timed_loads_behind_sooner(
) -> None:
    # "ahead" starts 3 s before its estimate (15 s): s0 is now expected at 14 s, its load due
    # at 10.85 s: started at once.
    _, _, started = _queued_behind(6.0, 12.0)
    assert started.demand_load("ahead") is None
    ticket = started.demand_load("s0")
    assert ticket is not None and ticket.deadline_s == pytest.approx(14.0)
    # "ahead" starts 1 s before its estimate (13.5 s): s0's load moves 1 s earlier, to 12.85 s
    # (more than a tenth of its 3.1 s lead): re-armed.
    _, routed, started = _queued_behind(4.5, 12.5)
    (moved,) = started.orders
    assert moved.queued and started.loads == ()
    assert moved.start_at_s == pytest.approx(routed.orders[0].start_at_s - 1.0)
    assert moved.deadline_s == pytest.approx(16.0)


def test_a_queue_that_falls_behind_its_estimates_starts_the_timed_loads_behind_later() -> None:
    # "ahead" starts 1 s after its estimate (11 s): when s0's timer fires, its load is re-armed
    # 1 s later.
    core, routed, started = _queued_behind(2.0, 12.0)
    assert started.orders == () and started.loads == ()
    (order,) = routed.orders
    rearmed = core.start_prefetch(order, order.start_at_s)
    (later,) = rearmed.orders
    assert rearmed.loads == () and later.start_at_s == pytest.approx(order.start_at_s + 1.0)
    assert core.start_prefetch(order, later.start_at_s).loads == ()  # the old one is void
    ticket = core.start_prefetch(later, later.start_at_s).demand_load("s0")
    assert ticket is not None and ticket.deadline_s == pytest.approx(18.0)


def test_a_node_that_joins_is_routed_to_and_warmed_with_sessions_local_nowhere() -> None:
    fleet = fleet_from_dict({"nodes": 2, "node": {"dram_tier_bytes": 10 * GIB}})
    core = SchedulerCore(fleet, POLICIES["predictive"], load("last-gap"), FakeFleet())
    core.node_left(1, 0.0)
    for i, t in enumerate((0.0, 2.0)):
        finish_turn(core, f"s{i}", t, 0, 40_000)
    # Not in the fleet: never routed to, whatever its load.
    core.request_started(SessionEvent(EventKind.REQUEST_STARTED, "new", 3.0, input_tokens=10))
    assert core.route_request("new", 10, 0, 3.0).node == 0
    core.reconcile(0, lambda sid, tokens: sid != "s0", 5.0)  # s0's KV left node 0
    out = core.node_joined(1, 10.0)
    assert [(t.session_id, t.node, t.prefetch) for t in out.loads] == [("s0", 1, True)]
    assert session_home(core, "s0") == 1 and session_home(core, "s1") == 0
    core.request_started(SessionEvent(EventKind.REQUEST_STARTED, "s0", 20.0,
                                      input_tokens=41_000, reused_tokens=40_000))
    assert core.route_request("s0", 41_000, 40_000, 20.0).node == 1


class _SetForecasts:
    """A predictor whose forecasts the test sets: sid -> (gap quantiles, confidence), from
    the session's last finish, conditioned on the silence (as the learned models' are)."""

    name = "set"

    def __init__(self) -> None:
        self.laws: dict[str, tuple[tuple[float, float, float], float]] = {}
        self.finish: dict[str, float] = {}
        #: Sessions whose forecast is a client's hint (``ArrivalForecast.hinted``).
        self.hinted: set[str] = set()

    def observe(self, event: SessionEvent) -> None:
        if event.kind is EventKind.REQUEST_FINISHED:
            self.finish[event.session_id] = event.time_s

    def forget(self, session_id: str) -> None:
        self.laws.pop(session_id, None)

    def forecast(self, session_id: str, now_s: float) -> ArrivalForecast | None:
        if session_id not in self.laws or session_id not in self.finish:
            return None
        q, confidence = self.laws[session_id]
        return ArrivalForecast(session_id, self.finish[session_id], q, 0.95, 3600.0,
                               confidence, conditioned=True,
                               hinted=session_id in self.hinted)


@pytest.mark.parametrize("hinted", [False, True])
def test_an_order_on_a_hint_starts_when_planned_and_one_from_history_follows_its_forecast(
        hinted: bool) -> None:
    # c's KV leaves node 0 at 5 s; its forecast says q10 at 31 s: an order is armed for it.
    # When the order's time comes, the forecast (conditioned on c's silence) says 46 s.
    pred = _SetForecasts()
    if hinted:
        pred.hinted.add("c")
    core = SchedulerCore(two_node_fleet(), POLICIES["predictive"], pred, FakeFleet())  # type: ignore[arg-type]
    for bucket in itertools.product((False, True), range(LEAD_BINS + 1)):
        core._prefetcher.bets.records[bucket] = BetRecord(wins=20)
    pred.laws["c"] = ((30.0, 40.0, 60.0), 0.5)
    finish_turn(core, "c", 0.0, node=0, ctx=40_000)
    (order,) = core.reconcile(0, lambda sid, tokens: sid != "c", 5.0).orders
    assert order.deadline_s == 31.0 and 5.0 < order.start_at_s < 31.0
    pred.laws["c"] = ((45.0, 55.0, 80.0), 0.5)
    out = core.start_prefetch(order, order.start_at_s)
    if hinted:  # the hint said c is coming: its silence since changes nothing the plan knew
        assert [(t.session_id, t.prefetch) for t in out.loads] == [("c", True)]
        assert out.orders == ()
    else:  # a forecast from history that moved later: the order waits for it
        (later,) = out.orders
        assert out.loads == () and later.deadline_s == 46.0


def _hinted_prefetch_over(b_gap_s: float, confidence: float, *,
                          waste_allowance_gib: float = 32.0, record: BetRecord | None = None,
                          view: FakeFleet | None = None) -> tuple[StepOutput, SchedulerCore]:
    """c is evicted from node 0 (full with a and b), then a hint makes its forecast
    (arrival q10 / q50 / q90 at 26 / 31 / 61 s; q75 at 49.75 s, linear between the knots)
    with ``confidence``; a is next used at 40 s, b ``b_gap_s`` after its finish at 21 s.
    Every bucket of the forecasts' bets starts with ``record`` (default: 20 won, 0 lost);
    ``view``: the fleet's queues and links (default idle). The output of starting c's
    prefetch."""
    pred = _SetForecasts()
    policy = replace(POLICIES["predictive"], suffix_eviction=False)
    fleet = two_node_fleet()
    fleet = fleet.model_copy(update={"planner": fleet.planner.model_copy(  # type: ignore[attr-defined]
        update={"waste_allowance_gib": waste_allowance_gib})})
    core = SchedulerCore(fleet, policy, pred, view or FakeFleet())  # type: ignore[arg-type]
    pred.laws["c"] = ((1e4, 2e4, 3e4), 0.5)
    pred.laws["a"] = ((29.0, 29.0, 29.0), 0.5)
    pred.laws["b"] = ((b_gap_s,) * 3, 0.5)
    finish_turn(core, "c", 0.0, node=0, ctx=40_000)
    finish_turn(core, "a", 10.0, node=0, ctx=40_000)
    finish_turn(core, "b", 20.0, node=0, ctx=40_000)
    assert core.dram[0].get("c") is None and core.remote_tokens("c") == 40_000
    pred.laws["c"] = ((25.0, 30.0, 60.0), confidence)
    bets = core._prefetcher.bets
    for bucket in itertools.product((False, True), range(LEAD_BINS + 1)):
        won = BetRecord(wins=20) if record is None else replace(record)
        bets.records[bucket] = won
    (order,) = core.hint(SessionEvent(EventKind.HINT, "c", 22.0, hint=HintKind.TOOL_RUNNING,
                                      eta_s=30.0)).orders
    assert order.deadline_s == 26.0 and 22.0 < order.start_at_s < 26.0
    return core.start_prefetch(order, order.start_at_s), core


def test_a_sharp_prefetch_displaces_only_residents_due_after_a_late_quantile_of_its_arrival(
) -> None:
    # b is due at 521 s, after c's q75 (49.75 s): c's prefetch evicts b (a, due at 40 s,
    # between c's median and q75, stays).
    out, core = _hinted_prefetch_over(500.0, 0.9)
    (ticket,) = out.loads
    assert ticket.session_id == "c" and ticket.prefetch
    assert [e.session_id for e in out.evictions] == ["b"] and core.dram[0].get("a") is not None
    # b due at 45 s: after c's median but not after its q75: nothing is displaced.
    out, core = _hinted_prefetch_over(24.0, 0.9)
    assert out.loads == () and out.evictions == () and core.stats.prefetches_dropped == 1
    # A forecast whose bets against recency were lost as often as won only fills free
    # room, whatever the residents' keys.
    out, core = _hinted_prefetch_over(500.0, 0.9, record=BetRecord(wins=20, losses=20))
    assert out.loads == () and out.evictions == () and core.dram[0].get("b") is not None


def test_no_prefetch_starts_where_the_queue_would_hide_the_load_it_saves() -> None:
    # c's 4.88 GiB come from a 5 GB/s store in about 1.05 s: behind a 2 s queue its
    # request's own load would be done when the GPU picks it up; behind 0.5 s it would not.
    out, core = _hinted_prefetch_over(500.0, 0.9, view=_QueuedFleet(2.0))
    assert out.loads == () and out.evictions == ()
    assert core.stats.prefetches_hidden_by_queue == 1 and core.dram[0].get("b") is not None
    out, core = _hinted_prefetch_over(500.0, 0.9, view=_QueuedFleet(0.5))
    assert [t.session_id for t in out.loads] == ["c"]
    assert core.stats.prefetches_hidden_by_queue == 0


def test_a_prefetch_that_would_displace_places_a_bet_that_the_first_arrival_settles() -> None:
    # No record yet: c's prefetch fills free room only (there is none), and its bet that
    # c comes back before b is open.
    out, core = _hinted_prefetch_over(500.0, 0.9, record=BetRecord())
    bets = core._prefetcher.bets
    assert out.loads == () and bets.open_bets == 1
    # c arrives first: the bet is won, in the bucket of a sharp forecast due far sooner
    # than b.
    core.request_started(SessionEvent(EventKind.REQUEST_STARTED, "c", 31.0,
                                      input_tokens=40_000))
    assert bets.open_bets == 0
    assert {k: (r.wins, r.losses) for k, r in bets.records.items() if r.settled} == {
        (True, LEAD_BINS): (1, 0)}
    # b arriving first loses the bet instead.
    out, core = _hinted_prefetch_over(500.0, 0.9, record=BetRecord())
    core.request_started(SessionEvent(EventKind.REQUEST_STARTED, "b", 30.0,
                                      input_tokens=40_000))
    records = core._prefetcher.bets.records
    assert [(r.wins, r.losses) for r in records.values() if r.settled] == [(0, 1)]


def test_the_waste_budget_starts_a_prefetch_only_if_its_loss_would_stay_within_the_credit(
) -> None:
    # c's prefetch brings 40,000 tokens x 128 KiB = 4.88 GiB; nothing prefetched was read
    # yet, so it may start only with an allowance of at least that (exposed + new <=
    # 2 x used + allowance).
    c_bytes = 40_000 * (128 << 10)
    out, core = _hinted_prefetch_over(500.0, 0.9, waste_allowance_gib=4.8)
    assert out.loads == () and core.stats.prefetches_over_budget == 1
    assert core.dram[0].get("b") is not None  # nothing displaced for it either
    out, core = _hinted_prefetch_over(500.0, 0.9, waste_allowance_gib=4.9)
    (ticket,) = out.loads
    assert core.stats.prefetch_exposed_bytes == ticket.nbytes == c_bytes
    # Read by c's request: used, not wasted.
    core.transfer_done("c", 0, 25.0, demand=False)
    core.request_started(SessionEvent(EventKind.REQUEST_STARTED, "c", 30.0,
                                      input_tokens=41_000, reused_tokens=40_000))
    assert core.use_local("c", 0, 40_000, 30.0) == 40_000
    assert (core.stats.prefetch_used_bytes, core.stats.wasted_bytes) == (c_bytes, 0)
    # The same prefetch lost before any request read it (the node restarts): all wasted.
    out, core = _hinted_prefetch_over(500.0, 0.9, waste_allowance_gib=4.9)
    core.transfer_done("c", 0, 25.0, demand=False)
    core.clear_local(26.0)
    assert (core.stats.prefetch_used_bytes, core.stats.wasted_bytes) == (0, c_bytes)


def test_a_warmed_session_the_tier_evicts_before_its_request_counts_as_wasted() -> None:
    """The node's engine evicts warmed KV by its own order (LMCache's L1 past its
    watermark, reported through the agent): the unread prefetched bytes are wasted; an
    entry a request has read is not."""
    fleet = fleet_from_dict({"nodes": 2, "node": {"dram_tier_bytes": 10 * GIB}})
    core = SchedulerCore(fleet, POLICIES["predictive"], load("last-gap"), FakeFleet())
    for i, t in enumerate((0.0, 2.0)):
        finish_turn(core, f"s{i}", t, 0, 40_000)
    warm = [t for t in core.clear_local(100.0).loads if t.node == 0]
    assert {t.session_id for t in warm} == {"s0", "s1"}
    for ticket in warm:
        core.transfer_done(ticket.session_id, 0, 101.0, demand=False)
    core.use_local("s1", 0, 40_000, 102.0)  # s1's request read its warmed KV
    before = core.stats.wasted_bytes
    core.forget_local(0, {"s0", "s1"}, 103.0)
    s0 = next(t for t in warm if t.session_id == "s0")
    assert core.stats.wasted_bytes - before == s0.nbytes
    assert core.dram_tokens(0, "s0") == core.dram_tokens(0, "s1") == 0


class _HbmFleet(FakeFleet):  # type: ignore[misc,valid-type]
    """Idle nodes whose HBM holds what :attr:`hbm` says."""

    def __init__(self) -> None:
        self.hbm: dict[tuple[int, str], int] = {}

    def hbm_tokens(self, node: int, session_id: str) -> int:
        return self.hbm.get((node, session_id), 0)


def test_an_idle_session_whose_kv_leaves_hbm_is_planned_again() -> None:
    # c's context is in node 0's HBM only (its DRAM books dropped it); while HBM holds it
    # nothing is planned; once the engine reports it evicted, a prefetch is.
    pred = _SetForecasts()
    view = _HbmFleet()
    core = SchedulerCore(two_node_fleet(), POLICIES["predictive"], pred, view)  # type: ignore[arg-type]
    pred.laws["c"] = ((30.0, 40.0, 60.0), 0.5)
    view.hbm[(0, "c")] = 40_000
    out = finish_turn(core, "c", 0.0, node=0, ctx=40_000)
    if core.dram[0].get("c") is not None:
        core._books.drop(0, "c")
    assert core.local_tokens(0, "c") == 40_000 and not out.orders
    del view.hbm[(0, "c")]
    (order,) = core.hbm_evicted("c", 0, 40_000, 5.0).orders
    assert order.session_id == "c" and order.node == 0 and order.tokens == 40_000
    # Under reactive (no prefetch) the same report plans nothing.
    view.hbm[(0, "d")] = 40_000
    react = SchedulerCore(two_node_fleet(), POLICIES["reactive"], pred, view)  # type: ignore[arg-type]
    pred.laws["d"] = ((30.0, 40.0, 60.0), 0.5)
    finish_turn(react, "d", 0.0, node=0, ctx=40_000)
    del view.hbm[(0, "d")]
    assert not react.hbm_evicted("d", 0, 40_000, 5.0).orders
