"""The displacement bets: the forecast's record against recency, per bucket."""

from __future__ import annotations

import math

import pytest

from kvprefetch.controlplane.core.bets import (
    EXPLORE_EVERY,
    LEAD_BINS,
    BetRecord,
    DisplacementBets,
    wilson_lower,
    wilson_upper,
)


def test_the_wilson_bound_needs_a_few_straight_wins_to_pass_one_half() -> None:
    assert wilson_lower(0, 0) == 0.0
    assert wilson_lower(2, 2) < 0.5 < wilson_lower(3, 3)
    # A forecast right 60% of the time passes one half only with enough bets.
    assert wilson_lower(6, 10) < 0.5 < wilson_lower(120, 200)
    assert wilson_lower(50, 100) < 0.5
    assert wilson_lower(10, 10) == pytest.approx(0.787, abs=1e-3)


def test_the_bucket_is_the_sharpness_and_the_forecast_lead_in_powers_of_two() -> None:
    bucket = DisplacementBets.bucket
    assert bucket(False, 100.0, 110.0, [115.0]) == (False, 0)  # 1.5x sooner
    assert bucket(True, 100.0, 110.0, [140.0, 190.0]) == (True, 2)  # the soonest victim: 4x
    assert bucket(False, 100.0, 101.0, [1e6]) == (False, LEAD_BINS)  # capped
    assert bucket(False, 100.0, 110.0, [math.inf]) == (False, LEAD_BINS)  # never back
    assert bucket(False, 100.0, 110.0, [50.0]) == (False, 0)  # a victim already due


def _bets() -> DisplacementBets:
    return DisplacementBets(min_win_share=0.5, horizon_s=100.0)


def test_the_first_arrival_settles_a_bet_and_a_won_record_allows_displacement() -> None:
    bets = _bets()
    b = (False, 3)
    assert not bets.allows(b)  # no record: fill free room only
    for i in range(3):
        bets.place(f"c{i}", [f"v{i}", f"w{i}"], b, float(i))
    assert bets.open_bets == 3
    for i in range(3):
        bets.arrived(f"c{i}", 10.0 + i)
        bets.arrived(f"v{i}", 11.0 + i)  # after its bet was settled: no effect
    assert bets.records[b] == BetRecord(wins=3, losses=0) and bets.open_bets == 0
    assert bets.allows(b) and not bets.allows((True, 3))
    # Victims first: losses, until the record no longer clears one half.
    for i in range(3):
        bets.place(f"d{i}", [f"x{i}"], b, 20.0)
        bets.arrived(f"x{i}", 21.0)
    assert bets.records[b] == BetRecord(wins=3, losses=3) and not bets.allows(b)


def test_a_bucket_with_few_bets_borrows_the_record_of_harder_ones() -> None:
    bets = _bets()
    # Sharp bets at leads 0 and 1 (the candidate due at most 4x sooner) won 3 of 3 each;
    # none at lead 2 yet: lead 2 borrows their 6 of 6, lead 1 its own and lead 0's.
    for lead in (0, 1):
        bets.records[(True, lead)] = BetRecord(wins=3)
    assert bets.allows((True, 2)) and bets.allows((True, 1))
    # Not from the other sharpness, and never from easier bets: lead 0 with one loss in
    # 3 does not pass, whatever lead 5 won.
    assert not bets.allows((False, 2))
    bets.records[(True, 0)] = BetRecord(wins=2, losses=1)
    bets.records[(True, 5)] = BetRecord(wins=50)
    assert not bets.allows((True, 0))
    # Pooled: 2 + 3 wins of 6 bets (lower bound about 0.42) do not clear one half either.
    assert not bets.allows((True, 2))
    bets.records[(True, 1)] = BetRecord(wins=12)
    assert bets.allows((True, 2))  # 14 of 15


def test_a_prefetch_evicted_unread_loses_its_bets_and_a_close_drops_them() -> None:
    bets = _bets()
    bets.place("c", ["v"], (True, 1), 0.0)
    bets.place("v", ["c"], (True, 1), 0.0)
    bets.wasted("c")  # only the bet where c is the candidate
    assert bets.records[(True, 1)] == BetRecord(wins=0, losses=1) and bets.open_bets == 1
    bets.forget("v")
    assert bets.open_bets == 0 and bets.records[(True, 1)].settled == 1


def test_bets_nobody_settles_expire_after_the_horizon() -> None:
    bets = _bets()
    bets.place("c", ["v"], (False, 0), 0.0)
    bets.place("d", ["w"], (False, 0), 50.0)
    bets.arrived("someone-else", 120.0)  # c's bet is past the 100 s horizon
    assert bets.open_bets == 1
    bets.arrived("c", 130.0)
    assert bets.records == {}
    bets.arrived("d", 140.0)
    assert bets.records[(False, 0)] == BetRecord(wins=1, losses=0)


def test_an_empty_victim_list_is_no_bet() -> None:
    bets = _bets()
    bets.place("c", [], (False, 0), 0.0)
    assert bets.open_bets == 0


def test_a_zero_win_share_lets_every_forecast_displace() -> None:
    assert DisplacementBets(min_win_share=0.0, horizon_s=1.0).allows((False, 0))


def test_prefetches_taken_and_left_unread_close_a_bucket_but_for_exploration() -> None:
    bets = _bets()
    b = (False, 2)
    for i in range(5):  # bets won: the bucket opens
        bets.place(f"c{i}", [f"v{i}"], b, 0.0)
        bets.arrived(f"c{i}", 1.0)
    assert bets.allows(b)
    # Prefetches taken in it: read ones keep it open, unread ones close it.
    for i in range(3):
        bets.took(f"p{i}", b)
        bets.read(f"p{i}")
    assert bets.taken[b] == BetRecord(wins=3, losses=0) and bets.allows(b)
    for i in range(12):
        bets.took(f"q{i}", b)
        bets.wasted(f"q{i}")
    assert bets.taken[b] == BetRecord(wins=3, losses=12)
    assert wilson_upper(3, 15) < 0.5
    allowed = [bets.allows(b) for _ in range(2 * EXPLORE_EVERY)]
    assert allowed.count(True) == 2  # one in EXPLORE_EVERY still starts
    bets.read("never-taken")  # nothing taken for it: no record
    assert sum(r.settled for r in bets.taken.values()) == 15


def test_the_upper_bound_is_one_minus_the_lower_bound_of_the_losses() -> None:
    assert wilson_upper(0, 0) == 1.0
    assert wilson_upper(3, 10) == pytest.approx(1 - wilson_lower(7, 10))
