"""The waste budget: predictive never wastes more prefetched bytes than requests read, beyond
a fixed credit (``planner.waste_allowance_gib``), on random small fleets with client hints of
any quality."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvprefetch.controlplane.base.config import GIB, FleetConfig, PlannerConfig, fleet_from_dict
from kvprefetch.controlplane.core.engines import (
    DEFAULT_ENGINE,
    ENGINES,
    EngineProfile,
    Mechanism,
)
from kvprefetch.controlplane.core.policies import POLICIES, PolicySpec
from kvprefetch.controlplane.sim.hints import HintConfig
from kvprefetch.controlplane.sim.runner import SimOptions, run_policies
from kvprefetch.controlplane.sim.simulator import clamp_to_window
from kvprefetch.controlplane.traces import ArrivalOptions, bundled_trace_path, load_trace

#: The ``local`` tier's ranking, trims and advice with a GPU that waits for every load.
BLOCKING_RANKED = EngineProfile("blocking-ranked", "local, loads held by the GPU", {
    m: api for m, api in ENGINES["local"].mechanisms.items()
    if m not in (Mechanism.ASYNC_LOAD, Mechanism.QUEUED_LOAD)})

#: The shipped allowance.
ALLOWANCE_GIB = PlannerConfig().waste_allowance_gib


def _fleet(nodes: int, dram_gib: int, allowance_gib: float = ALLOWANCE_GIB) -> FleetConfig:
    return fleet_from_dict({"nodes": nodes, "node": {"dram_tier_bytes": dram_gib * GIB},
                            "planner": {"waste_allowance_gib": allowance_gib,
                                        # the fixed credit: no refill over the replay
                                        "waste_window_s": 0.0}})


def _bytes(policy: PolicySpec, fleet: FleetConfig, load: float, seed: int, sigma: float,
           coverage: float, engine: EngineProfile | str = DEFAULT_ENGINE, *,
           abandon_share: float = 0.0) -> tuple[int, int, int]:
    """(wasted, used, prefetched) bytes of ``policy`` on 14 sessions of the bundled slice
    (``abandon_share``: of the typing hints, those no request follows)."""
    trace = clamp_to_window(
        load_trace(bundled_trace_path("claude-code"), limit_sessions=14,
                   arrivals=ArrivalOptions(session_rate_per_s=1 / 75, load=load), seed=seed),
        fleet.model.max_context_tokens)
    hints = HintConfig(coverage=coverage, seed=seed, tool_eta_sigma=sigma,
                       abandon_share=abandon_share)
    p = run_policies(trace, fleet, (policy,), SimOptions(seed=seed, hints=hints, engine=engine)
                     ).policies[policy.name]
    return p.wasted_bytes, p.prefetch_used_bytes, p.prefetched_bytes


@pytest.mark.slow  # 25 simulations of the bundled slice
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 3), st.sampled_from([8, 16, 32, 64]), st.sampled_from([0.5, 1.0, 2.0]),
       st.integers(0, 99), st.sampled_from([0.0, 0.5, 1.0, 2.0]), st.sampled_from([0.5, 1.0]))
def test_property_predictive_never_wastes_more_than_requests_read_beyond_the_allowance(
        nodes: int, dram_gib: int, load: float, seed: int, sigma: float, coverage: float,
) -> None:
    wasted, used, prefetched = _bytes(POLICIES["predictive"], _fleet(nodes, dram_gib), load,
                                      seed, sigma, coverage)
    assert wasted <= used + ALLOWANCE_GIB * GIB
    assert wasted + used <= prefetched  # the rest is still unread at the end


def test_without_the_budget_the_same_fleet_wastes_more_than_it_reads() -> None:
    """The property is not vacuous: with a 4 GiB allowance, a fleet where prefetch without
    the budget wastes more than requests read plus the allowance (every client hints, nine
    typing hints in ten lead nowhere, tool ETAs off by a factor e**2 at one sigma, a
    write-through tier ranked by predicted next use whose GPU waits for a load); with it,
    nothing past the credit."""
    fleet = _fleet(1, 32, allowance_gib=4.0)
    # Every forecast prefetches, displacing residents whatever its record against recency.
    fleet = fleet.model_copy(update={"planner": fleet.planner.model_copy(
        update={"prefetch_min_win_share": 0.0, "min_confidence": 0.0})})
    budgeted = POLICIES["predictive"]
    free = replace(budgeted, name="no-budget", waste_budget=False)
    wasted, used, _ = _bytes(free, fleet, 2.0, 9, 2.0, 1.0, BLOCKING_RANKED,
                             abandon_share=0.9)
    assert wasted > used + 4 * GIB
    wasted, used, _ = _bytes(budgeted, fleet, 2.0, 9, 2.0, 1.0, BLOCKING_RANKED,
                             abandon_share=0.9)
    assert wasted <= used + 4 * GIB
