"""A demo's calibrated twin: the calibration from measured rates, the fleet it gives,
pairing requests by (seed, session, turn), seeded bootstrap intervals, and the fleet's
fixed cost per request in the simulator (pure logic: no servers)."""

from __future__ import annotations

import random
import statistics

import pytest

from kvprefetch.controlplane.base.config import GIB, fleet_from_dict
from kvprefetch.controlplane.base.types import Trace, TraceRequest, TraceSession
from kvprefetch.controlplane.core.policies import POLICIES
from kvprefetch.controlplane.harness.demo_report import SeedTrace
from kvprefetch.controlplane.harness.demo_twin import twin_rows, twin_section
from kvprefetch.controlplane.harness.twin_calibration import (
    Calibration,
    calibrate_emulated,
    calibrate_vllm,
    calibrated_fleet,
    fit_line,
)
from kvprefetch.controlplane.harness.twin_stats import bootstrap_paired, pair_rows
from kvprefetch.controlplane.sim.runner import run_policy

BPT = 128 * 1024  # Llama-3.1-8B's KV bytes per token


def _fleet() -> object:
    return fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 2 * GIB,
                                                 "dram_tier_bytes": 24 * GIB}})


# ------------------------------------------------------------------ calibration
def test_fit_line_recovers_a_known_line_and_clamps_negative_coefficients() -> None:
    xs = [1.0, 2.0, 3.0, 4.0]
    fit = fit_line(xs, [0.5 + 2.0 * x for x in xs])
    assert fit.intercept == pytest.approx(0.5) and fit.slope == pytest.approx(2.0)
    assert fit.points == 4
    down = fit_line(xs, [10.0 - x for x in xs])  # falling: no rate, the mean as fixed cost
    assert down.slope == 0.0 and down.intercept == pytest.approx(7.5)
    origin = fit_line(xs, [3.0 * x - 1.0 for x in xs])  # negative intercept: through 0
    assert origin.intercept == 0.0 and origin.slope == pytest.approx(
        sum(x * (3 * x - 1) for x in xs) / sum(x * x for x in xs))
    with pytest.raises(ValueError):
        fit_line([], [])


def _row(**kw: object) -> dict[str, object]:
    base: dict[str, object] = {"seed": 0, "session": "s", "turn": 1, "returning": True,
                               "ttft_s": 1.0, "error": "", "transfer_wall_s": 0.0,
                               "demand_bytes_moved": 0, "looked_up": False,
                               "lookup_wall_s": 0.0, "lookup_tokens": 0}
    base.update(kw)
    return base


def test_calibrate_emulated_fits_the_run_rates_on_the_service_clock() -> None:
    # Demand loads: wall wait = 0.01 s + real bytes / 1 MB/s; kv_scale 1/1000, 20x.
    loads = [_row(turn=i, demand_bytes_moved=n, transfer_wall_s=0.01 + n / 1e6)
             for i, n in enumerate((1000, 4000, 9000, 20000))]
    # Lookups: 2 us wall per token found; a failed request's row is left out.
    lookups = [_row(turn=10 + i, looked_up=True, lookup_tokens=t, lookup_wall_s=2e-6 * t)
               for i, t in enumerate((1000, 5000, 30000))]
    bad = _row(turn=99, demand_bytes_moved=10, transfer_wall_s=50.0, error="boom")
    cal, fits = calibrate_emulated(loads + lookups + [bad], compression=20.0,
                                   kv_scale=1e-3, kv_bytes_per_token=BPT,
                                   h2d_bytes_per_s=25e9)
    # service s per modelled byte: 20 / (1e6 B/s x 1000 modelled B per real B)
    assert cal.load_s_per_byte == pytest.approx(20 / 1e9)
    assert cal.load_latency_s == pytest.approx(0.2)
    assert cal.local_s_per_byte == pytest.approx(1 / 25e9 + 20 * 2e-6 / BPT)
    assert cal.prefill_s_per_token is None and cal.request_overhead_s is None
    assert fits["demand_load"]["points"] == 4 and fits["lookup"]["points"] == 3
    assert set(cal.sources) == {"load", "local"}


def test_calibrate_emulated_without_measurements_keeps_the_fleet() -> None:
    cal, fits = calibrate_emulated([_row()], compression=20.0, kv_scale=1e-3,
                                   kv_bytes_per_token=BPT, h2d_bytes_per_s=25e9)
    assert cal == Calibration() and fits == {}
    fleet = _fleet()
    assert calibrated_fleet(fleet, cal) == fleet


def test_calibrate_vllm_from_the_calibration_pass() -> None:
    pass_ = {"prompt_tokens": 1000, "ttft_cold_s": 0.060, "ttft_vllm_cached_s": 0.020,
             "ttft_l1_s": 0.030, "ttft_l2_s": 0.050}
    cal = calibrate_vllm(pass_, compression=10.0, kv_bytes_per_token=1024,
                         decode_s_per_token=0.05)
    assert cal.prefill_s_per_token == pytest.approx(0.040 * 10 / 1000)
    assert cal.local_s_per_byte == pytest.approx(0.010 * 10 / (1000 * 1024))
    assert cal.load_s_per_byte == pytest.approx(0.020 * 10 / (1000 * 1024))
    assert cal.request_overhead_s == pytest.approx(0.020 * 10 - 0.05)
    assert set(cal.sources) == {"prefill", "local", "load", "request_overhead"}


def test_calibrated_fleet_carries_each_rate_into_the_cost_model() -> None:
    fleet = _fleet()
    cal = Calibration(load_s_per_byte=1e-9, load_latency_s=0.3, local_s_per_byte=1e-10,
                      prefill_s_per_token=2e-4, request_overhead_s=0.07)
    twin = calibrated_fleet(fleet, cal)
    assert twin.remote.valkey_gbyte_s_per_node == pytest.approx(1.0)
    assert twin.remote.valkey_latency_s == 0.3
    assert min(twin.node.nic_bytes_per_s, 1e9) == pytest.approx(1e9)  # NIC not the cap
    assert twin.node.h2d_gbyte_s == pytest.approx(10.0)
    assert twin.prefill_s(2048, 0) == pytest.approx(2048 * 2e-4)
    assert twin.node.request_overhead_s == 0.07
    assert twin.model == fleet.model and twin.node.hbm_kv_bytes == fleet.node.hbm_kv_bytes


# ------------------------------------------------------------------ pairing and bootstrap
def test_pair_rows_pairs_by_seed_session_turn_and_skips_first_turns_and_errors() -> None:
    a = [_row(seed=0, session="x", turn=1, ttft_s=1.0),
         _row(seed=1, session="x", turn=1, ttft_s=2.0),
         _row(seed=0, session="x", turn=0, ttft_s=9.0, returning=False),
         _row(seed=0, session="y", turn=2, ttft_s=3.0, error="failed"),
         _row(seed=0, session="z", turn=1, ttft_s=4.0)]
    b = [_row(seed=1, session="x", turn=1, ttft_s=20.0),
         _row(seed=0, session="x", turn=1, ttft_s=10.0),
         _row(seed=0, session="x", turn=0, ttft_s=90.0, returning=False),
         _row(seed=0, session="y", turn=2, ttft_s=30.0)]
    assert pair_rows(a, b) == [(1.0, 10.0), (2.0, 20.0)]
    assert pair_rows(a, b, returning_only=False) == [(9.0, 90.0), (1.0, 10.0), (2.0, 20.0)]
    with pytest.raises(ValueError, match="twice"):
        pair_rows(a + a[:1], b)


def test_bootstrap_is_seeded_and_covers_a_known_difference() -> None:
    rng = random.Random(7)
    pairs = [(x, 0.8 * x + rng.gauss(0, 0.05)) for x in (rng.uniform(1, 3) for _ in range(400))]
    one = bootstrap_paired(pairs, resamples=2000, seed=3)
    assert one == bootstrap_paired(pairs, resamples=2000, seed=3)
    assert one != bootstrap_paired(pairs, resamples=2000, seed=4)
    diffs = [b - a for a, b in pairs]
    assert one.diff_s == pytest.approx(statistics.fmean(diffs))
    assert one.diff_ci95_s[0] < one.diff_s < one.diff_ci95_s[1]
    # The interval's half-width is about 1.96 standard errors of the mean difference.
    se = statistics.stdev(diffs) / len(diffs) ** 0.5
    assert (one.diff_ci95_s[1] - one.diff_ci95_s[0]) / 2 == pytest.approx(1.96 * se, rel=0.15)
    assert one.ratio_ci95[0] < 0.8 < one.ratio_ci95[1]
    assert one.ratio == pytest.approx(sum(b for _, b in pairs) / sum(a for a, _ in pairs))


def test_bootstrap_of_identical_pairs_is_a_point() -> None:
    s = bootstrap_paired([(2.0, 3.0)] * 5, resamples=50, seed=0)
    assert s.diff_ci95_s == (1.0, 1.0) and s.ratio_ci95 == (1.5, 1.5) and s.pairs == 5
    with pytest.raises(ValueError):
        bootstrap_paired([], resamples=10)


# ------------------------------------------------------------------ the twin in the simulator
def _one_session_trace() -> Trace:
    reqs = tuple(TraceRequest("s0", turn=i, offset_s=0.0, input_tokens=4000 * (i + 1),
                              output_tokens=100, reused_tokens=4000 * i,
                              gap_s=0.0 if i == 0 else 30.0)
                 for i in range(4))
    return Trace("t", (TraceSession("s0", 0.0, reqs),), "test")


def test_request_overhead_adds_to_every_ttft_in_the_simulator() -> None:
    fleet = _fleet()
    slow = calibrated_fleet(fleet, Calibration(request_overhead_s=0.25))
    trace = _one_session_trace()
    base = run_policy(trace, fleet, POLICIES["ondemand"], "default")
    more = run_policy(trace, slow, POLICIES["ondemand"], "default")
    assert len(base.records) == len(more.records) == 4
    for a, b in zip(sorted(base.records, key=lambda r: r.turn),
                    sorted(more.records, key=lambda r: r.turn), strict=True):
        assert b.ttft_s - a.ttft_s == pytest.approx(0.25)


def test_twin_section_pairs_live_rows_with_the_twin_and_checks_the_targets() -> None:
    fleet = _fleet()
    seeds = [SeedTrace(0, _one_session_trace(), ())]
    twin = {n: twin_rows(seeds, fleet, n, "default", False) for n in ("ondemand", "predictive")}
    # Live: the twin's own requests, 10% slower for ondemand; predictive as the twin's.
    report = {"policies": {
        "ondemand": {"per_request": [dict(r, ttft_s=r["ttft_s"] * 1.1)
                                     for r in twin["ondemand"]]},
        "predictive": {"per_request": twin["predictive"]}}}
    out = twin_section(report, seeds, fleet, Calibration(), predictor="default", hints=False)
    on, pr = out["policies"]["ondemand"], out["policies"]["predictive"]
    assert on["live_over_twin"] == pytest.approx(1.1, abs=1e-3) and on["within_tolerance"]
    assert pr["live_over_twin"] == pytest.approx(1.0) and pr["within_tolerance"]
    assert on["paired_twin_minus_live"]["pairs"] == 3  # the returning turns
    assert on["paired_twin_minus_live"]["diff_s"] < 0
    cmp = out["predictive_vs_ondemand"]
    assert cmp["live"]["ratio"] == pytest.approx(cmp["twin"]["ratio"] / 1.1, rel=1e-3)
    assert cmp["ratio_gap"] == pytest.approx(abs(cmp["live"]["ratio"] - cmp["twin"]["ratio"]),
                                             abs=1e-4)
    assert cmp["within_tolerance"] == (cmp["ratio_gap"] <= 0.05)
