"""The value rule (issue 11): the forecast's distribution (p_within, expected_wait_s,
arrival_quantile_after), density, plan_node and should_cancel. Pure logic, hand-computed
figures.

Most cases use knots at u = log1p(gap) = 1, 2, 3, so the CDF given return is 0.1 u below
the first knot, 0.1 + 0.4 (u - 1) and 0.5 + 0.4 (u - 2) between them, and
1 - 0.1 * 5 ** -(u - 3) beyond (the tail keeps the log-slope of the q50 -> q90 segment).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprefetch.controlplane.base.types import ArrivalForecast
from kvprefetch.controlplane.core.value import (
    Candidate,
    NodePlan,
    Resident,
    ValueConfig,
    density,
    eviction_order,
    plan_node,
    saved_s,
    should_cancel,
)

E = math.e


def gap(u: float) -> float:
    """The gap whose log1p is ``u``."""
    return math.expm1(u)


KNOTS = (gap(1.0), gap(2.0), gap(3.0))


def fc(
    p_return: float = 1.0,
    horizon_s: float = 1e9,
    *,
    knots: tuple[float, ...] = KNOTS,
    last_finish_s: float = 0.0,
    conditioned: bool = False,
    confidence: float = 0.5,
) -> ArrivalForecast:
    return ArrivalForecast("s", last_finish_s, knots, p_return, horizon_s, confidence,
                           conditioned=conditioned)


def oracle(arrival_s: float, *, last_finish_s: float = 0.0) -> ArrivalForecast:
    g = arrival_s - last_finish_s
    return ArrivalForecast("s", last_finish_s, (g, g, g), 1.0, 1e12, 1.0)


# -------------------------------------------------------------------------------- p_within
def test_p_within_follows_the_knots_from_the_last_finish() -> None:
    f = fc()
    assert f.p_within(gap(0.5), 0.0) == pytest.approx(0.05)  # below q10: 0.1 u
    assert f.p_within(gap(1.5), 0.0) == pytest.approx(0.3)
    assert f.p_within(gap(2.0), 0.0) == pytest.approx(0.5)
    assert f.p_within(gap(4.0), 0.0) == pytest.approx(1 - 0.1 / 5)  # Pareto tail
    assert f.p_within(0.0, 0.0) == 0.0


def test_p_within_conditions_on_silence() -> None:
    f = fc()
    # Silent until q50 (survival 0.5): P(arrival by q90 | silent) = 0.4 / 0.5.
    assert f.p_within(gap(3.0) - gap(2.0), gap(2.0)) == pytest.approx(0.8)
    # Heavy tail: the longer the silence, the lower the next minute's chance.
    minute = [f.p_within(60.0, now) for now in (gap(3.0), 1e3, 1e4, 1e5)]
    assert minute == sorted(minute, reverse=True)


def test_p_return_below_one_is_the_chance_within_the_horizon() -> None:
    # F(horizon = q90) = 0.9, so p_return 0.45 means a 0.5 chance of ever returning.
    f = fc(p_return=0.45, horizon_s=gap(3.0))
    assert f.p_within(gap(3.0), 0.0) == pytest.approx(0.45)
    assert f.p_within(1e15, 0.0) == pytest.approx(0.5)
    # Silent until q50: alive = 1 - 0.5 * 0.5; returns by q90 with 0.5 * 0.4 / 0.75.
    assert f.p_within(gap(3.0) - gap(2.0), gap(2.0)) == pytest.approx(0.2 / 0.75)


def test_conditioned_forecast_is_not_conditioned_twice() -> None:
    knots = (gap(2.0), gap(3.0), gap(4.0))
    now = gap(1.0)
    plain = fc(knots=knots)
    cond = fc(knots=knots, conditioned=True)
    # Unconditioned: mass 0.1 * 1/2 already passed in (0, now]; renormalised.
    assert plain.p_within(gap(1.5) - now, now) == pytest.approx((0.075 - 0.05) / 0.95)
    # Conditioned (a learned forecast made at now): its lower tail runs from the silence to
    # q10, so a quarter of the way in u from now to q10 carries 0.1 / 2.
    assert cond.p_within(gap(1.5) - now, now) == pytest.approx(0.05)
    assert cond.p_within(gap(3.0) - now, now) == pytest.approx(0.5)


def test_conditioned_p_return_is_the_chance_within_the_next_horizon() -> None:
    # A learned forecast at silence gap(1): horizon_s (from the last finish) = q50, where
    # the conditioned CDF is 0.5; p_return = P(return by then | silent so far).
    now = gap(1.0)
    f = fc(p_return=0.4, horizon_s=gap(3.0), knots=(gap(2.0), gap(3.0), gap(4.0)),
           conditioned=True)
    assert f.p_within(gap(3.0) - now, now) == pytest.approx(0.4)
    assert f.p_within(1e15, now) == pytest.approx(0.8)


def test_stale_conditioned_forecast_is_conditioned_past_its_first_knot() -> None:
    knots = (gap(2.0), gap(3.0), gap(4.0))
    f = fc(knots=knots, conditioned=True)
    now = gap(2.5)  # survival 0.7 on the q10 -> q50 segment
    assert f.p_within(gap(3.0) - now, now) == pytest.approx(0.2 / 0.7)


def test_oracle_is_a_step() -> None:
    f = oracle(100.0)
    assert f.p_within(50.0, 40.0) == 0.0
    assert f.p_within(60.0, 40.0) == 1.0
    assert f.p_within(1.0, 99.5) == 1.0
    assert f.p_within(1.0, 120.0) == 1.0  # due already: arriving now
    never = ArrivalForecast("s", 0.0, (1e12,) * 3, 0.0, 1e12, 1.0)
    assert never.p_within(1e9, 10.0) == 0.0
    assert never.expected_wait_s(10.0, 300.0) == 300.0


# ------------------------------------------------------------------------- expected wait
def test_expected_wait_integrates_the_survival() -> None:
    h = gap(1.0)  # e - 1: survival 1 - 0.1 log1p(g) on [0, h]
    # integral of 1 - 0.1 log1p(g) over [0, e - 1] = (e - 1) - 0.1 * (e * 1 - (e - 1))
    assert fc().expected_wait_s(0.0, h) == pytest.approx(E - 1.1)
    # Half the sessions never return: wait = H - 0.5 * integral of F = (e - 1) - 0.05.
    assert fc(p_return=0.45, horizon_s=gap(3.0)).expected_wait_s(0.0, h) == pytest.approx(
        E - 1.05
    )
    assert fc().expected_wait_s(0.0, 0.0) == 0.0


def test_expected_wait_in_the_tail_after_silence() -> None:
    # Silent until q90: survival relative to now is ((1 + g) / e**3) ** -ln 5.
    r = math.log(5.0)
    now = gap(3.0)
    h = E**3 * (E - 1.0)  # (1 + now + h) / (1 + now) = e
    want = E**3 / (1.0 - r) * (E ** (1.0 - r) - 1.0)
    assert fc().expected_wait_s(now, h) == pytest.approx(want)


def test_expected_wait_of_the_oracle() -> None:
    f = oracle(100.0)
    assert f.expected_wait_s(40.0, 300.0) == pytest.approx(60.0)
    assert f.expected_wait_s(40.0, 30.0) == pytest.approx(30.0)


# ----------------------------------------------------------------------- quantile after
def test_arrival_quantile_after_silence() -> None:
    f = fc(p_return=0.45, horizon_s=gap(3.0), last_finish_s=10.0)
    assert f.arrival_quantile_after(0.5, 10.0) == pytest.approx(10.0 + gap(2.0))
    now = 10.0 + gap(2.0)  # survival 0.5
    # 0.6 of the remaining mass: survival 0.2, on the q50 -> q90 segment at u = 2.75.
    assert f.arrival_quantile_after(0.6, now) == pytest.approx(10.0 + gap(2.75))
    # 0.9: survival 0.05, in the tail: u = 3 + ln 2 / ln 5.
    assert f.arrival_quantile_after(0.9, now) == pytest.approx(
        10.0 + gap(3.0 + math.log(2.0) / math.log(5.0))
    )
    assert f.arrival_quantile_after(0.0, now) == pytest.approx(now)
    assert f.arrival_quantile_after(1.0, now) == math.inf


def test_arrival_quantile_after_of_the_oracle() -> None:
    assert oracle(100.0).arrival_quantile_after(0.1, 30.0) == 100.0
    assert oracle(100.0).arrival_quantile_after(0.1, 130.0) == 130.0


# -------------------------------------------------------------------------------- value
def test_saved_s() -> None:
    assert saved_s(10**9, load_first_byte_s=0.01, load_s_per_byte=1e-10) == pytest.approx(0.11)
    assert saved_s(10**9, load_first_byte_s=0.01, load_s_per_byte=1e-10,
                   recompute_s=0.05) == pytest.approx(0.05)
    assert saved_s(10**9, load_first_byte_s=0.01, load_s_per_byte=1e-10, recompute_s=2.0,
                   has_remote_copy=False) == 2.0
    assert saved_s(0, load_first_byte_s=0.01, load_s_per_byte=1e-10) == 0.0
    with pytest.raises(ValueError):
        saved_s(1, load_first_byte_s=0.0, load_s_per_byte=0.0, has_remote_copy=False)


def test_density_by_hand() -> None:
    # Oracle due in 100 s, 2 s saved, 1 GB: 2 / (1e9 * 100).
    assert density(oracle(100.0), 0.0, 600.0, 2.0, 10**9) == pytest.approx(2e-11)
    assert density(oracle(700.0), 0.0, 600.0, 2.0, 10**9) == 0.0  # beyond the horizon
    # Half ever return; within e - 1 s: p = 0.5 * 0.1, wait = e - 1.05.
    f = fc(p_return=0.45, horizon_s=gap(3.0))
    assert density(f, 0.0, gap(1.0), 3.0, 1000) == pytest.approx(0.05 * 3.0 / (1000 * (E - 1.05)))
    assert density(None, 0.0, 600.0, 2.0, 10**9) == 0.0
    # Due now: the wait is floored, the density finite.
    assert density(oracle(5.0), 5.0, 600.0, 1.0, 10, min_wait_s=0.5) == pytest.approx(0.2)


def test_long_silence_is_worth_less_per_byte() -> None:
    f = fc()
    ds = [density(f, now, 600.0, 1.0, 1000) for now in (gap(3.0), 1e3, 1e4, 1e5)]
    assert ds == sorted(ds, reverse=True) and ds[-1] < ds[0] / 10


@settings(max_examples=200, deadline=None)
@given(
    now=st.floats(0.0, 1e4),
    ahead=st.lists(st.one_of(st.floats(0.0, 2e3), st.just(math.inf)), min_size=2, max_size=30),
)
def test_oracle_density_order_is_belady(now: float, ahead: list[float]) -> None:
    """Equal sizes, equal worth: evicting lowest density first = furthest next use first."""
    residents = []
    for k, a in enumerate(ahead):
        if math.isinf(a):
            f = ArrivalForecast(f"s{k}", 0.0, (1e12,) * 3, 0.0, 1e12, 1.0)
        else:
            f = oracle(now + a)
        residents.append(Resident.from_forecast(
            f"s{k}", f, nbytes=1000, saved_s=1.0, now_s=now, cfg=ValueConfig(horizon_s=600.0)
        ))
    next_use = {f"s{k}": now + a for k, a in enumerate(ahead)}
    by_density = [next_use[r.session_id] for r in eviction_order(residents)]
    assert by_density == sorted(next_use.values(), reverse=True)


# ---------------------------------------------------------------------------- plan_node
NO_COST = ValueConfig(transfer_cost_s_per_byte=0.0, safety_margin_s=0.0)


def cand(sid: str, nbytes: int, d: float, *, wait: float = 10.0, ttlb: float = 1.0,
         land_by: float = 100.0) -> Candidate:
    return Candidate(sid, nbytes, d, wait, ttlb, land_by)


def test_free_space_first() -> None:
    residents = [Resident("r1", 30, 1.0), Resident("r2", 30, 2.0)]
    plan = plan_node(residents, [cand("c", 40, 0.5)], capacity_bytes=100, used_bytes=60,
                     now_s=0.0, cfg=NO_COST)
    assert [p.session_id for p in plan.prefetches] == ["c"]
    assert plan.evictions == () and plan.prefetches[0].evicts == ()


def test_low_density_resident_displaced_by_a_better_candidate() -> None:
    residents = [Resident("low", 50, 1.0), Resident("high", 50, 10.0)]
    plan = plan_node(residents, [cand("c", 50, 5.0)], capacity_bytes=100, used_bytes=100,
                     now_s=0.0, cfg=NO_COST)
    (p,) = plan.prefetches
    assert p.evicts == ("low",) and plan.evictions == ("low",)
    # Not better than the lowest resident: nothing moves.
    worse = plan_node(residents, [cand("c", 50, 0.9)], capacity_bytes=100, used_bytes=100,
                      now_s=0.0, cfg=NO_COST)
    assert worse == NodePlan.empty()


def test_whole_displaced_entries_are_charged() -> None:
    # 10 free bytes short: the 100-byte resident goes whole, and its value counts whole.
    residents = [Resident("big", 100, 1.0)]

    def plan(d: float) -> NodePlan:
        return plan_node(residents, [cand("c", 10, d)], capacity_bytes=100, used_bytes=100,
                         now_s=0.0, cfg=NO_COST)

    assert plan(9.0) == NodePlan.empty()  # 10 x 9 < 100 x 1
    assert plan(11.0).evictions == ("big",)


def test_transfer_cost_must_be_beaten() -> None:
    residents = [Resident("r", 50, 1.0)]
    # density 1.5 vs resident 1.0; cost 6 per byte over a 10 s wait = 0.6 per byte-second.
    cfg = ValueConfig(transfer_cost_s_per_byte=6.0)
    plan = plan_node(residents, [cand("c", 50, 1.5)], capacity_bytes=50, used_bytes=50,
                     now_s=0.0, cfg=cfg)
    assert plan == NodePlan.empty()
    cheaper = ValueConfig(transfer_cost_s_per_byte=4.0)
    plan = plan_node(residents, [cand("c", 50, 1.5)], capacity_bytes=50, used_bytes=50,
                     now_s=0.0, cfg=cheaper)
    assert plan.evictions == ("r",)
    # Even free space does not admit a transfer that costs more than it saves.
    plan = plan_node([], [cand("c", 50, 0.5)], capacity_bytes=100, used_bytes=0, now_s=0.0,
                     cfg=cfg)
    assert plan == NodePlan.empty()


def test_pinned_residents_are_never_evicted() -> None:
    residents = [Resident("pinned", 50, 0.0, pinned=True), Resident("r", 50, 1.0)]
    plan = plan_node(residents, [cand("c", 50, 5.0)], capacity_bytes=100, used_bytes=100,
                     now_s=0.0, cfg=NO_COST)
    assert plan.evictions == ("r",)
    plan = plan_node(residents, [cand("c", 100, 50.0)], capacity_bytes=100, used_bytes=100,
                     now_s=0.0, cfg=NO_COST)
    assert plan == NodePlan.empty()


def test_over_capacity_sheds_lowest_density_first() -> None:
    residents = [Resident("a", 30, 3.0), Resident("b", 30, 1.0), Resident("c", 30, 2.0),
                 Resident("p", 30, 0.0, pinned=True)]
    plan = plan_node(residents, [], capacity_bytes=70, used_bytes=120, now_s=0.0, cfg=NO_COST)
    assert plan.evictions == ("b", "c")


def test_best_candidates_first() -> None:
    plan = plan_node([], [cand("a", 60, 1.0), cand("b", 60, 3.0), cand("c", 40, 2.0)],
                     capacity_bytes=100, used_bytes=0, now_s=0.0, cfg=NO_COST)
    assert [p.session_id for p in plan.prefetches] == ["b", "c"]


def test_prefetch_timing() -> None:
    cfg = ValueConfig(transfer_cost_s_per_byte=0.0, safety_margin_s=0.5, max_lead_s=60.0)
    cands = [
        cand("jit", 10, 1.0, ttlb=2.0, land_by=30.0),  # start 30 - 2 - 0.5
        cand("late", 10, 1.0, ttlb=2.0, land_by=11.0),  # cannot land by 11 - 0.5: start now
        cand("far", 10, 1.0, ttlb=2.0, land_by=500.0),  # capped at now + max_lead
    ]
    plan = plan_node([], cands, capacity_bytes=100, used_bytes=0, now_s=10.0, cfg=cfg)
    by_id = {p.session_id: p for p in plan.prefetches}
    assert by_id["jit"].start_at_s == pytest.approx(27.5) and by_id["jit"].on_time
    assert by_id["late"].start_at_s == 10.0 and not by_id["late"].on_time
    assert by_id["far"].start_at_s == 70.0


def test_candidate_from_forecast_lands_before_an_early_quantile() -> None:
    cfg = ValueConfig(transfer_cost_s_per_byte=0.0, safety_margin_s=0.5)
    c = Candidate.from_forecast("s", oracle(100.0), nbytes=10**9, saved_s=1.0, ttlb_s=2.0,
                                now_s=40.0, cfg=cfg)
    assert c.land_by_s == 100.0 and c.start_at_s(40.0, cfg) == pytest.approx(97.5)
    assert c.density == pytest.approx(1.0 / (10**9 * 60.0))
    # A transfer that would land after the oracle's arrival saves nothing.
    late = Candidate.from_forecast("s", oracle(41.0), nbytes=10**9, saved_s=1.0, ttlb_s=2.0,
                                   now_s=40.0, cfg=cfg)
    assert late.density == 0.0
    # Arrivals before the transfer could land do not count: p = F(q90) - F(q10) = 0.8.
    f = fc()
    c = Candidate.from_forecast("s", f, nbytes=1000, saved_s=1.0, ttlb_s=gap(1.0),
                                now_s=0.0, cfg=ValueConfig(horizon_s=gap(3.0)))
    assert c.density == pytest.approx(0.8 / (1000 * f.expected_wait_s(0.0, gap(3.0))))
    assert c.land_by_s == pytest.approx(gap(1.0))
    none = Candidate.from_forecast("s", None, nbytes=1000, saved_s=1.0, ttlb_s=1.0, now_s=0.0,
                                   cfg=cfg)
    assert none.density == 0.0 and none.net_density(cfg) <= 0.0


def test_oracle_admission_is_belady() -> None:
    """A candidate displaces a resident iff it is needed sooner (no transfer cost)."""
    now = 0.0
    resident = Resident.from_forecast("r", oracle(50.0), nbytes=100, saved_s=1.0, now_s=now,
                                      cfg=NO_COST)
    for arrival, admitted in ((30.0, True), (80.0, False)):
        c = Candidate.from_forecast("c", oracle(arrival), nbytes=100, saved_s=1.0, ttlb_s=1.0,
                                    now_s=now, cfg=NO_COST)
        plan = plan_node([resident], [c], capacity_bytes=100, used_bytes=100, now_s=now,
                         cfg=NO_COST)
        assert bool(plan.prefetches) is admitted


@settings(max_examples=300, deadline=None)
@given(
    residents=st.lists(
        st.tuples(st.integers(1, 400), st.floats(0.0, 10.0), st.booleans()), max_size=12
    ),
    candidates=st.lists(st.tuples(st.integers(0, 400), st.floats(0.0, 10.0)), max_size=12),
    capacity=st.integers(0, 2000),
    reserved=st.integers(0, 500),
    cost=st.floats(0.0, 5.0),
)
def test_plan_node_never_exceeds_capacity(
    residents: list[tuple[int, float, bool]],
    candidates: list[tuple[int, float]],
    capacity: int,
    reserved: int,
    cost: float,
) -> None:
    rs = [Resident(f"r{k}", n, d, pinned=p) for k, (n, d, p) in enumerate(residents)]
    cs = [cand(f"c{k}", n, d) for k, (n, d) in enumerate(candidates)]
    used = sum(r.nbytes for r in rs) + reserved
    cfg = ValueConfig(transfer_cost_s_per_byte=cost)
    plan = plan_node(rs, cs, capacity_bytes=capacity, used_bytes=used, now_s=0.0, cfg=cfg)
    size = {r.session_id: r.nbytes for r in rs}
    pinned = {r.session_id for r in rs if r.pinned}
    assert len(set(plan.evictions)) == len(plan.evictions)
    assert not pinned & set(plan.evictions)
    after = used - sum(size[s] for s in plan.evictions) + sum(p.nbytes for p in plan.prefetches)
    fixed = reserved + sum(size[s] for s in pinned)
    if plan.prefetches or fixed <= capacity:
        assert after <= capacity
    else:  # cannot fit even with every unpinned resident gone: all of them go, nothing comes
        assert set(plan.evictions) == set(size) - pinned
    assert all(p.start_at_s >= 0.0 for p in plan.prefetches)
    assert sum(len(p.evicts) for p in plan.prefetches) <= len(plan.evictions)


# ------------------------------------------------------------------------- should_cancel
def test_should_cancel() -> None:
    cfg = ValueConfig(transfer_cost_s_per_byte=1.0, cancel_slack=0.1)
    # Still better than what it displaces: keep.
    assert not should_cancel(2.0, 1.0, remaining_fraction=0.5, expected_wait_s=10.0, cfg=cfg)
    # Fell just below (within the slack): keep; well below: cancel.
    assert not should_cancel(0.95, 1.0, remaining_fraction=1e-9, expected_wait_s=10.0, cfg=cfg)
    assert not should_cancel(1.0, 1.0, remaining_fraction=0.1, expected_wait_s=10.0, cfg=cfg)
    assert should_cancel(0.8, 1.0, remaining_fraction=0.5, expected_wait_s=10.0, cfg=cfg)
    # The remaining transfer cost counts: 1.2 - 1.0 * 1.0 / 1 s < 0.9.
    assert should_cancel(1.2, 1.0, remaining_fraction=1.0, expected_wait_s=1.0, cfg=cfg)
    # The session closed: nothing left to gain while bytes remain to move.
    assert should_cancel(0.0, 0.0, remaining_fraction=0.5, cfg=cfg)
    assert not should_cancel(0.0, 0.0, remaining_fraction=0.0, cfg=cfg)
    # Free space and still some value: keep.
    assert not should_cancel(0.5, 0.0, remaining_fraction=0.5, expected_wait_s=10.0, cfg=cfg)


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        ValueConfig(horizon_s=0.0)
    with pytest.raises(ValueError):
        ValueConfig(landing_level=1.0)
    with pytest.raises(ValueError):
        ValueConfig(transfer_cost_s_per_byte=-1.0)
