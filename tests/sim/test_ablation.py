"""``kvprefetch sim --ablation``: predictive with one forecast-driven decision switched off
at a time, only the decisions the engine profile offers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvprefetch.controlplane.base.config import GIB, fleet_from_dict
from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.cli.sim import with_ablations
from kvprefetch.controlplane.core.engines import ENGINES, on_engine
from kvprefetch.controlplane.core.policies import POLICIES, parse_policies
from kvprefetch.controlplane.sim import Simulation
from kvprefetch.controlplane.sim.ablation import DECISIONS, ablations
from kvprefetch.controlplane.sim.hints import HintConfig, HintKind, plan_hints
from kvprefetch.controlplane.sim.runner import hinted_predictor, run_policy
from kvprefetch.controlplane.traces.synthetic import load_synthetic
from kvprefetch.predictors.hinted import HintedPredictor
from kvprefetch.predictors.registry import load as load_predictor

PREDICTIVE = POLICIES["predictive"]


@pytest.mark.parametrize("engine, hints, expected", [
    ("vllm-lmcache", False, ["prefetch", "advice"]),
    ("vllm-lmcache", True, ["prefetch", "advice", "hints"]),
    ("sglang-hicache", False, ["prefetch"]),
    ("local", False, ["dram", "prefetch"]),
])
def test_only_the_decisions_the_profile_offers_are_switched_off(
        engine: str, hints: bool, expected: list[str]) -> None:
    variants = ablations(PREDICTIVE, ENGINES[engine], hints=hints)
    assert [v.name for v in variants] == [f"predictive-no-{d}" for d in expected]
    for decision, variant in zip(expected, variants, strict=True):
        # Exactly the decision's own fields differ from predictive's.
        _, off = DECISIONS[decision]
        assert replace(variant, name="predictive", **{
            f: getattr(PREDICTIVE, f) for f in off}) == PREDICTIVE


def test_with_prefetch_off_predictive_runs_as_reactive_on_the_write_through_profile() -> None:
    """On vllm-lmcache the prefetch is the forecasts' one lever: without it (and the advice
    that makes its room) predictive makes reactive's every decision."""
    trace = load_synthetic("synthetic:agentic:40", seed=2)
    fleet = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 4 * GIB,
                                                  "dram_tier_bytes": 8 * GIB}})
    (no_prefetch,) = [v for v in ablations(PREDICTIVE, ENGINES["vllm-lmcache"], hints=False)
                      if v.name == "predictive-no-prefetch"]

    def records(policy: object) -> list[tuple[object, ...]]:
        sim = Simulation(trace, fleet, policy, load_predictor("default", trace=trace))  # type: ignore[arg-type]
        return [(r.session_id, r.turn, r.node, r.first_token_s) for r in sim.run().records]

    assert records(no_prefetch) == records(POLICIES["reactive"])
    assert on_engine(no_prefetch, ENGINES["vllm-lmcache"]).prefetch is False


def test_the_flag_puts_the_variants_after_predictive_and_needs_it() -> None:
    policies = with_ablations(parse_policies("ondemand,predictive,perfect"), "local",
                              hints=False)
    assert [p.name for p in policies] == ["ondemand", "predictive", "predictive-no-dram",
                                          "predictive-no-prefetch", "perfect"]
    with pytest.raises(ConfigError, match="--ablation needs predictive"):
        with_ablations(parse_policies("ondemand"), "local", hints=False)


def test_without_hints_the_default_predictor_reads_none_of_them() -> None:
    """The ``default`` predictor has the hint layer built in: the no-hints variant gets
    the model under it, so typing hints move predictive and not its no-hints variant."""
    trace = load_synthetic("synthetic:chat:60", seed=1)
    fleet = fleet_from_dict({"nodes": 2, "node": {"hbm_kv_bytes": 2 * GIB,
                                                  "dram_tier_bytes": 4 * GIB}})
    hints = plan_hints(trace, HintConfig(kinds=frozenset({HintKind.USER_TYPING})))
    assert hints
    (no_hints,) = [v for v in ablations(PREDICTIVE, ENGINES["vllm-lmcache"], hints=True)
                   if v.name == "predictive-no-hints"]

    def ttfts(policy: object, planned: object) -> list[float]:
        run = run_policy(trace, fleet, policy, "default", hints=planned)  # type: ignore[arg-type]
        return [r.first_token_s for r in run.records]

    assert not isinstance(hinted_predictor(no_hints, load_predictor("default")),
                          HintedPredictor)
    assert ttfts(no_hints, hints) == ttfts(PREDICTIVE, ())
    assert ttfts(PREDICTIVE, hints) != ttfts(no_hints, hints)
