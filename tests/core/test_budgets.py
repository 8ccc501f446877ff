"""The waste budget's credit: earned by prefetched bytes read, spent by bytes exposed, and
an allowance that refills every ``planner.waste_window_s``."""

from __future__ import annotations

from kvprefetch.controlplane.base.config import GIB, PlannerConfig
from kvprefetch.controlplane.core.budgets import Budgets
from kvprefetch.controlplane.core.policies import POLICIES
from kvprefetch.controlplane.core.stats import CoreStats


def _budgets(window_s: float) -> tuple[Budgets, CoreStats]:
    stats = CoreStats()
    planner = PlannerConfig(waste_allowance_gib=4.0, waste_per_used_byte=1.0,
                            waste_window_s=window_s)
    return Budgets(POLICIES["predictive"], planner, stats, None), stats


def test_a_spent_allowance_refills_with_time() -> None:
    budgets, stats = _budgets(window_s=600.0)
    assert budgets.within_waste_budget(4 * GIB, 100.0)  # the window counts from here
    stats.prefetch_exposed_bytes = 4 * GIB  # all of it evicted unread
    assert not budgets.within_waste_budget(1 * GIB, 100.0)
    assert not budgets.within_waste_budget(1 * GIB, 249.0)
    assert budgets.within_waste_budget(1 * GIB, 250.0)  # a quarter window: 1 GiB more
    assert budgets.within_waste_budget(4 * GIB, 700.0)
    assert not budgets.within_waste_budget(4 * GIB + 1, 700.0)
    assert stats.prefetches_over_budget == 3


def test_read_prefetches_earn_credit_and_a_window_of_zero_never_refills() -> None:
    budgets, stats = _budgets(window_s=0.0)
    assert budgets.within_waste_budget(4 * GIB, 0.0)
    stats.prefetch_exposed_bytes = 4 * GIB
    assert not budgets.within_waste_budget(1, 1e9)
    stats.prefetch_used_bytes = 1 * GIB  # read: 2 GiB of credit (r = 1)
    assert budgets.within_waste_budget(2 * GIB, 1e9)
    assert not budgets.within_waste_budget(2 * GIB + 1, 1e9)
