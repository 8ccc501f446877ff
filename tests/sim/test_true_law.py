"""The ``true-law`` bound: forecasts from a synthetic profile's own gap laws agree with the
gaps its generator draws, and the policy runs only where such laws exist."""

from __future__ import annotations

import bisect

import pytest

from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.base.types import EventKind, SessionEvent
from kvprefetch.controlplane.core.policies import SIM_POLICIES, parse_policies
from kvprefetch.controlplane.sim.true_law import TrueLawPredictor, true_law_predictor
from kvprefetch.controlplane.traces import bundled_trace_path
from kvprefetch.controlplane.traces.loader import load_trace
from kvprefetch.controlplane.traces.synthetic import PROFILES, synthetic_trace


def _finished(model: TrueLawPredictor, sid: str, t: float, stop: str | None) -> None:
    model.observe(SessionEvent(EventKind.REQUEST_STARTED, sid, t - 1.0, input_tokens=10))
    model.observe(SessionEvent(EventKind.REQUEST_FINISHED, sid, t, input_tokens=10,
                               stop_reason=stop))


@pytest.mark.parametrize("name", ["agentic", "research", "chat"])
def test_each_law_is_the_law_of_the_gaps_the_generator_draws(name: str) -> None:
    profile = PROFILES[name]
    assert profile is not None
    trace = synthetic_trace(profile, 600, seed=3)
    model = TrueLawPredictor(profile)
    for stop in ("tool_use", "end_turn"):
        gaps = sorted(r.gap_s for s in trace.sessions
                      for prev, r in zip(s.requests, s.requests[1:], strict=False)
                      if prev.stop_reason == stop and r.gap_s is not None)
        ends = sum(1 for s in trace.sessions if s.requests[-1].stop_reason == stop)
        if len(gaps) < 200:
            continue
        law = model.laws[stop]
        # P(no further request) is the law's floor: the share of such stops that end
        # their session.
        assert 1.0 - law.at(1e9) == pytest.approx(len(gaps) / (len(gaps) + ends), abs=0.03)
        returning = 1.0 - law.at(1e9)
        for g in (5.0, 30.0, 120.0, 600.0, 3600.0):
            drawn = bisect.bisect_right(gaps, g) / len(gaps)
            assert (1.0 - law.at(g)) / returning == pytest.approx(drawn, abs=0.03), (stop, g)


def test_a_forecast_reads_the_stop_reasons_law_conditioned_on_the_silence() -> None:
    profile = PROFILES["agentic"]
    assert profile is not None
    model = TrueLawPredictor(profile)
    _finished(model, "tool", 100.0, "tool_use")
    _finished(model, "human", 100.0, "end_turn")
    _finished(model, "unknown", 100.0, None)
    tool = model.forecast("tool", 100.0)
    assert tool is not None and tool.conditioned
    assert tool.gap_at(0.5) == pytest.approx(profile.tool_median_s, rel=0.02)
    human = model.forecast("human", 100.0)
    unknown = model.forecast("unknown", 100.0)
    assert human is not None and unknown is not None
    assert tool.p_return > unknown.p_return > human.p_return  # within the next 60 s
    # Silence moves the law on: a tool silent for a minute is later than the tool's median.
    late = model.forecast("tool", 160.0)
    assert late is not None and late.gap_at(0.5) > 60.0
    model.observe(SessionEvent(EventKind.REQUEST_STARTED, "tool", 170.0, input_tokens=10))
    assert model.forecast("tool", 170.0) is None  # in flight: not idle


def test_the_policy_needs_a_named_synthetic_profile() -> None:
    (policy,) = parse_policies("true-law", peers=True)
    assert policy is SIM_POLICIES["true-law"] and not policy.reads_hints
    assert true_law_predictor(load_trace("synthetic:chat:5")).name == "true-law"
    for trace in (load_trace(bundled_trace_path("claude-code"), limit_sessions=2),
                  load_trace("synthetic:random:5")):
        with pytest.raises(ConfigError, match="synthetic profile's own laws"):
            true_law_predictor(trace)
    with pytest.raises(ConfigError, match="unknown policy"):
        parse_policies("true-law")  # the live service's policies: not one of them


def test_sim_runs_the_bound_beside_the_policies_it_bounds(capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    from kvprefetch.controlplane.cli import main

    assert main(["sim", "--trace", "synthetic:agentic:40", "--nodes", "1",
                 "--policies", "reactive,true-law,predictive,perfect", "--no-progress"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.split() and line.split()[0] in ("reactive", "true-law", "perfect")}
    assert set(rows) == {"reactive", "true-law", "perfect"}
    assert rows["true-law"][1] == rows["reactive"][1]  # the same returning requests
