"""Engine profiles (:mod:`kvprefetch.controlplane.core.engines`): every policy runs on the
profile's mechanisms and on none the profile lacks; demote-on-evict and asynchronous loads
as the simulator models them; ``reactive`` and ``perfect``, predictive's yardsticks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvprefetch.controlplane.base.config import GIB, fleet_from_dict
from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.base.types import Trace, TraceRequest, TraceSession
from kvprefetch.controlplane.core.engines import (
    ENGINES,
    EngineProfile,
    Mechanism,
    engine_profile,
    on_engine,
)
from kvprefetch.controlplane.core.policies import (
    POLICIES,
    SIM_POLICIES,
    EvictionKind,
    LoadStart,
    PolicySpec,
)
from kvprefetch.controlplane.sim import SimOptions, Simulation, run_policies
from kvprefetch.controlplane.sim.hints import HintConfig, plan_hints
from kvprefetch.controlplane.traces.synthetic import load_synthetic
from kvprefetch.predictors.registry import load as load_predictor

# One node, 4 GiB of HBM and 4 GiB of DRAM: 32k tokens each of the 8B model's KV.
FLEET = fleet_from_dict({"nodes": 1, "node": {"hbm_kv_bytes": 4 * GIB,
                                              "dram_tier_bytes": 4 * GIB}})
#: An engine that offers nothing: write-through, the GPU waits for every load.
BARE = EngineProfile("bare", "offers no mechanism")


@pytest.mark.parametrize("engine", list(ENGINES.values()), ids=lambda e: e.name)
@pytest.mark.parametrize("policy", list(SIM_POLICIES.values()), ids=lambda p: p.name)
def test_a_policy_uses_no_mechanism_its_profile_lacks_and_every_one_it_offers(
        policy: PolicySpec, engine: EngineProfile) -> None:
    run = on_engine(policy, engine)
    assert run.engine == engine.name
    assert run.demote_on_evict == (policy.dram_tier and engine.offers(Mechanism.DEMOTE_ON_EVICT))
    assert run.async_load == (policy.remote and engine.offers(Mechanism.ASYNC_LOAD))
    if run.suffix_eviction:
        assert engine.offers(Mechanism.TRIMS)
    if run.eviction is EvictionKind.PREDICTED_USE:
        assert engine.offers(Mechanism.DRAM_RANKING) and run.forecasts
    if run.evict_advice:
        assert engine.offers(Mechanism.EVICT_ADVICE) and run.prefetch
    if run.load_start is LoadStart.ON_ARRIVAL:
        assert engine.offers(Mechanism.QUEUED_LOAD)
    # HBM ranking is no profile's: only a peer's own engine change keeps one.
    assert run.hbm_retention == policy.hbm_retention
    assert on_engine(run, engine) == run  # idempotent


def test_every_offered_mechanism_cites_the_engine_api_that_carries_it_out() -> None:
    for engine in ENGINES.values():
        for mechanism, api in engine.mechanisms.items():
            assert isinstance(mechanism, Mechanism) and len(api) > 20, (engine.name, mechanism)
        assert [row[0] for row in engine.table()] == [m.value for m in Mechanism]
    with pytest.raises(ConfigError, match="known: vllm-lmcache"):
        engine_profile("vllm")


def _session(sid: str, start_s: float, gap_s: float, tokens: int = 20_000) -> TraceSession:
    """Two turns: ``tokens``, then 500 more after ``gap_s`` of silence."""
    first = TraceRequest(sid, 0, 0.0, tokens, 100, 0, None, "end_turn", 1.0)
    second = TraceRequest(sid, 1, 0.0, tokens + 600, 100, tokens + 100, gap_s, "end_turn", 1.0)
    return TraceSession(sid, start_s, (first, second))


def _two_sessions(policy: PolicySpec, engine: str) -> Simulation:
    """a, then b while a is silent: each context fills most of a tier, so b's evicts a's
    from HBM, and from DRAM too unless DRAM is written only on HBM eviction."""
    trace = Trace("demote", (_session("a", 0.0, 100.0), _session("b", 10.0, 300.0)), "test")
    sim = Simulation(trace, FLEET, policy, load_predictor("last-gap"), engine=engine)
    sim.run()
    return sim


def test_demote_on_evict_keeps_what_hbm_evicted_in_dram() -> None:
    through = _two_sessions(POLICIES["ondemand"], "vllm-lmcache")
    lazy = _two_sessions(POLICIES["ondemand"], "vllm-lmcache-lazy")
    # Write-through: b's copy displaced a's in DRAM too, so a's next turn loads it from the
    # remote store. Lazy offload: HBM dropped a for b and a went down to DRAM, read there.
    assert through.out.remote_bytes >= 20_100 * FLEET.model.kv_bytes_per_token
    assert lazy.out.remote_bytes == 0
    ttft = {name: next(r.ttft_s for r in sim.out.records if (r.session_id, r.turn) == ("a", 1))
            for name, sim in (("through", through), ("lazy", lazy))}
    assert ttft["lazy"] < ttft["through"]


def test_asynchronous_loads_let_the_gpu_serve_the_next_request() -> None:
    """a's second turn loads 20k tokens from the remote store; c arrives just after it with
    nothing to reuse. Blocking, c waits behind a's load; asynchronous, c runs meanwhile."""
    first = _two_sessions(POLICIES["ondemand"], "vllm-lmcache")
    a_back_s = next(r.arrival_s for r in first.out.records if (r.session_id, r.turn) == ("a", 1))
    c = TraceSession("c", a_back_s + 0.01,
                     (TraceRequest("c", 0, 0.0, 200, 10, 0, None, "end_turn", 1.0),))
    trace = Trace("async", (_session("a", 0.0, 100.0), _session("b", 10.0, 300.0), c), "test")

    def ttft_of_c(engine: EngineProfile) -> float:
        sim = Simulation(trace, FLEET, POLICIES["ondemand"], load_predictor("last-gap"),
                         engine=engine)
        sim.run()
        return next(r.ttft_s for r in sim.out.records if r.session_id == "c")

    blocking, asynchronous = ttft_of_c(BARE), ttft_of_c(engine_profile("vllm-lmcache"))
    assert asynchronous < blocking - 0.05


def _records(sim: Simulation) -> list[tuple[object, ...]]:
    return [(r.session_id, r.turn, r.node, r.start_s, r.first_token_s, r.reused_local_tokens)
            for r in sim.out.records]


@pytest.mark.parametrize("engine", ["vllm-lmcache", "local"])
def test_reactive_is_predictive_with_its_forecasts_off_and_reads_no_forecast(
        engine: str) -> None:
    trace = load_synthetic("synthetic:agentic:40", seed=3)
    fleet = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                                  "dram_tier_bytes": 8 * GIB}})

    def run(policy: PolicySpec, predictor: str, hinted: bool = False) -> Simulation:
        hints = (plan_hints(trace, HintConfig(seed=0)) if hinted else ())
        sim = Simulation(trace, fleet, policy, load_predictor(predictor, trace=trace),
                         engine=engine, hints=hints)
        sim.run()
        return sim

    reactive = run(POLICIES["reactive"], "default")
    off = run(replace(POLICIES["predictive"], forecasts=False), "default")
    assert _records(off) == _records(reactive)
    assert off.core.stats == reactive.core.stats
    # Forecast-blind: another predictor, or hints, change none of its decisions.
    assert _records(run(POLICIES["reactive"], "last-gap", hinted=True)) == _records(reactive)
    assert reactive.out.prefetched_bytes == 0
    assert _records(run(POLICIES["predictive"], "default")) != _records(reactive) or (
        engine == "vllm-lmcache")


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_perfect_is_no_worse_than_reactive_and_predictive_on_small_random_traces(
        engine: str, seed: int) -> None:
    trace = load_synthetic("synthetic:random:30", seed=seed)
    fleet = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                                  "dram_tier_bytes": 8 * GIB}})
    policies = tuple(POLICIES[n] for n in ("reactive", "predictive", "perfect"))
    report = run_policies(trace, fleet, policies, SimOptions(engine=engine))
    mean = {n: p.returning.ttft_mean_s for n, p in report.policies.items()}
    ys = report.yardstick
    assert ys is not None
    ahead = [n for n in ("reactive", "predictive") if mean[n] < mean["perfect"]]
    if not ahead:
        assert ys.forecast_gap_closure is not None and ys.forecast_gap_closure <= 1.0
    else:
        # Ranking DRAM by true next use (Belady's rule) is optimal for one cache of equal
        # entries with no queue; with sessions of unequal size, prefetches sharing the
        # node's link with demand loads and a GPU queue, recency can win a cell by a hair.
        # The tables then give no closure and say why.
        assert ys.forecast_gap_closure is None
        assert ys.no_closure is not None and ys.no_closure.startswith("perfect is not ahead")
        assert all(n in ys.no_closure for n in ahead)
        assert mean["perfect"] <= min(mean[n] for n in ahead) * 1.02  # by a hair


def test_sim_help_lists_every_profile_and_a_bad_name_is_refused() -> None:
    import argparse

    from kvprefetch.controlplane.cli import sim as sim_cli

    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    text = "".join(parser.format_help().split())  # argparse wraps at spaces and hyphens
    for engine in ENGINES.values():
        assert "".join(f"{engine.name}: {engine.summary}".split()) in text
    assert parser.parse_args([]).engine == "vllm-lmcache"
    with pytest.raises(SystemExit):
        parser.parse_args(["--engine", "vllm"])
