"""Planned client hints for the simulator (controlplane.sim.hints): pure logic, no servers."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from controlplane.base.errors import ConfigError
from controlplane.base.types import HintKind, Trace, TraceRequest, TraceSession
from controlplane.sim.hints import (
    HintConfig,
    PlannedHint,
    hints_by_turn,
    parse_hint_kinds,
    plan_hints,
    typed_tokens,
)
from controlplane.traces import bundled_trace_path, load_trace

TYPING, TOOL = HintKind.USER_TYPING, HintKind.TOOL_RUNNING
ONLY_TYPING, ONLY_TOOL = frozenset({TYPING}), frozenset({TOOL})
BOTH = frozenset({TYPING, TOOL})


def _session(sid: str, stops: list[str | None], gaps: list[float], *, parent: str | None = None,
             new_tokens: int = 130, output_tokens: int = 50) -> TraceSession:
    """A closed-loop session: request k >= 1 comes gaps[k-1] after response k-1 ends."""
    reqs = []
    for k, stop in enumerate(stops):
        reused = 0 if k == 0 else 1000 * k
        reqs.append(TraceRequest(sid, k, 0.0, reused + new_tokens + (output_tokens if k else 0),
                                 output_tokens, reused_tokens=reused,
                                 gap_s=None if k == 0 else gaps[k - 1], stop_reason=stop,
                                 api_time_s=1.0))
    return TraceSession(sid, 0.0, tuple(reqs), parent_id=parent)


def _synthetic(n: int = 40, seed: int = 1) -> Trace:
    rng = random.Random(seed)
    sessions = []
    for i in range(n):
        turns = rng.randint(1, 12)
        stops = [rng.choice(["tool_use", "tool_use", "end_turn", None]) for _ in range(turns)]
        gaps = [rng.lognormvariate(3.0, 1.5) for _ in range(turns - 1)]
        sessions.append(_session(f"s{i}", stops, gaps))
        if i % 5 == 0:
            sessions.append(_session(f"s{i}/agent", ["tool_use", "end_turn", "tool_use"],
                                     [3.0, 40.0], parent=f"s{i}"))
    return Trace("synthetic", tuple(sessions), "test")


@pytest.fixture(scope="module")
def bundled() -> Trace:
    return load_trace(bundled_trace_path("claude-code"), "auto", seed=0)


def _human_turns(trace: Trace) -> set[tuple[str, int]]:
    return {(s.session_id, r.turn) for s in trace.sessions if s.parent_id is None
            for p, r in itertools.pairwise(s.requests)
            if p.stop_reason != "tool_use" and r.gap_s is not None}


def _tool_turns(trace: Trace) -> set[tuple[str, int]]:
    return {(s.session_id, r.turn) for s in trace.sessions
            for p, r in itertools.pairwise(s.requests)
            if p.stop_reason == "tool_use" and r.gap_s is not None}


def _gap(trace: Trace) -> dict[tuple[str, int], float]:
    return {(s.session_id, r.turn): r.gap_s for s in trace.sessions for r in s.requests
            if r.gap_s is not None}


# ------------------------------------------------------------------ config
def test_config_validation_names_the_field() -> None:
    for kwargs, name in [({"coverage": 1.5}, "coverage"), ({"coverage": -0.1}, "coverage"),
                         ({"coverage": math.nan}, "coverage"),
                         ({"tool_eta_sigma": -1.0}, "tool_eta_sigma"),
                         ({"abandon_share": 1.0}, "abandon_share"),
                         ({"words_per_minute_mean": 0.0}, "words_per_minute_mean"),
                         ({"words_per_minute_sd": -1.0}, "words_per_minute_sd"),
                         ({"tokens_per_word": 0.0}, "tokens_per_word"),
                         ({"kinds": {HintKind.SESSION_CLOSED}}, "kinds")]:
        with pytest.raises(ConfigError, match=f"hints.{name}"):
            HintConfig(**kwargs)  # type: ignore[arg-type]
    assert HintConfig(kinds=[TOOL]).kinds == frozenset({TOOL})  # type: ignore[arg-type]


def test_parse_hint_kinds() -> None:
    assert parse_hint_kinds("typing,tool") == BOTH
    assert parse_hint_kinds(" tool ") == frozenset({TOOL})
    for bad in ("", "typing,closed", "TYPING"):
        with pytest.raises(ConfigError, match="typing, tool"):
            parse_hint_kinds(bad)


# ------------------------------------------------------------------ coverage
@pytest.mark.parametrize("trace_name", ["synthetic", "bundled"])
def test_coverage_zero_sends_nothing(trace_name: str, bundled: Trace) -> None:
    trace = _synthetic() if trace_name == "synthetic" else bundled
    assert plan_hints(trace, HintConfig(coverage=0.0, abandon_share=0.3)) == ()


@pytest.mark.parametrize("trace_name", ["synthetic", "bundled"])
def test_full_coverage_hints_every_tool_call_and_human_turn(trace_name: str,
                                                            bundled: Trace) -> None:
    trace = _synthetic() if trace_name == "synthetic" else bundled
    hints = plan_hints(trace, HintConfig(coverage=1.0))
    tool = [h for h in hints if h.kind is TOOL]
    typing = [h for h in hints if h.kind is TYPING]
    assert {(h.session_id, h.turn) for h in tool} == _tool_turns(trace)
    assert len(tool) == len(_tool_turns(trace))
    assert {(h.session_id, h.turn) for h in typing} == _human_turns(trace)
    assert len(typing) == len(_human_turns(trace))
    assert _tool_turns(trace) and _human_turns(trace)
    assert all(h.after_finish_s == 0.0 and h.eta_s is not None and h.eta_s >= 0 for h in tool)
    assert all(h.eta_s is None and not h.abandoned for h in typing)


def test_sub_agents_share_their_parents_coverage_and_never_type() -> None:
    trace = _synthetic(n=200)
    hints = plan_hints(trace, HintConfig(coverage=0.5, seed=3))
    hinted = {h.session_id for h in hints}
    can_hint = {h.session_id for h in plan_hints(trace, HintConfig(coverage=1.0))}
    pairs = [(s.session_id, s.parent_id) for s in trace.sessions
             if s.parent_id in can_hint and s.session_id in can_hint]
    assert len(pairs) > 20
    for child, parent in pairs:
        assert (child in hinted) == (parent in hinted)
    assert not [h for h in hints if h.kind is TYPING and "/" in h.session_id]
    roots = [s for s in trace.sessions if s.parent_id is None]
    share = sum(s.session_id in hinted for s in roots) / len(roots)
    assert 0.35 < share < 0.65


def test_more_coverage_only_adds_clients() -> None:
    trace = _synthetic(n=100)
    low = set(plan_hints(trace, HintConfig(coverage=0.3, seed=5)))
    high = set(plan_hints(trace, HintConfig(coverage=0.7, seed=5)))
    assert low < high


# ------------------------------------------------------------------ timing
@pytest.mark.parametrize("trace_name", ["synthetic", "bundled"])
def test_hints_fall_between_the_previous_response_end_and_the_request(
        trace_name: str, bundled: Trace) -> None:
    trace = _synthetic() if trace_name == "synthetic" else bundled
    gaps = _gap(trace)
    last_turn = {s.session_id: len(s.requests) for s in trace.sessions}
    cfg = HintConfig(abandon_share=0.2, words_per_minute_mean=5.0, words_per_minute_sd=1.0)
    hints = plan_hints(trace, cfg)
    assert hints
    for h in hints:
        assert h.after_finish_s >= 0.0  # never before the previous response ended
        if h.turn == last_turn[h.session_id]:
            assert h.abandoned
        else:
            assert h.after_finish_s <= gaps[(h.session_id, h.turn)]


def test_typing_hint_leads_the_request_by_the_typing_time() -> None:
    # New input = the previous 50 output tokens + 130 typed ones; 60 wpm * 1 token/word =
    # 1 token/s: the hint comes 130 s before the request, capped at the response end.
    trace = Trace("t", (_session("a", ["end_turn", "end_turn", "end_turn"], [200.0, 30.0]),),
                  "test")
    cfg = HintConfig(kinds=ONLY_TYPING, words_per_minute_mean=60.0, words_per_minute_sd=0.0,
                     tokens_per_word=1.0)
    hints = plan_hints(trace, cfg)
    assert [(h.turn, h.after_finish_s) for h in hints] == [(1, 70.0), (2, 0.0)]
    assert typed_tokens(trace.sessions[0].requests[0], trace.sessions[0].requests[1]) == 130


def test_first_turn_and_open_loop_requests_get_no_hints() -> None:
    open_loop = TraceSession("o", 0.0, tuple(
        TraceRequest("o", k, 10.0 * k, 100, 10, stop_reason="end_turn") for k in range(4)))
    one_turn = _session("one", ["tool_use"], [])
    trace = Trace("t", (open_loop, one_turn), "test")
    assert plan_hints(trace, HintConfig()) == ()


# ------------------------------------------------------------------ abandoned typing
def test_abandoned_typing_hints_have_the_configured_share_and_stay_quiet() -> None:
    trace = _synthetic(n=400, seed=2)
    cfg = HintConfig(kinds=ONLY_TYPING, abandon_share=0.25, abandon_quiet_s=120.0, seed=4)
    hints = plan_hints(trace, cfg)
    abandoned = [h for h in hints if h.abandoned]
    assert abs(len(abandoned) / len(hints) - 0.25) < 0.03
    real = {(h.session_id, h.turn): h.after_finish_s for h in hints if not h.abandoned}
    last_turn = {s.session_id: len(s.requests) for s in trace.sessions}
    for h in abandoned:
        if h.turn == last_turn[h.session_id]:
            assert h.after_finish_s <= 120.0
        else:  # the request of that gap comes later than the quiet span after the hint
            assert real[(h.session_id, h.turn)] - h.after_finish_s >= 120.0
    assert any(h.turn != last_turn[h.session_id] for h in abandoned)
    assert not [h for h in plan_hints(trace, HintConfig(kinds=ONLY_TYPING, seed=4))
                if h.abandoned]


# ------------------------------------------------------------------ tool ETA noise
def test_tool_eta_noise_has_median_one_and_the_configured_sigma() -> None:
    trace = _synthetic(n=1500, seed=7)
    gaps = _gap(trace)
    for sigma in (0.5, 1.0):
        hints = plan_hints(trace, HintConfig(kinds=ONLY_TOOL, tool_eta_sigma=sigma, seed=11))
        logs = [math.log(h.eta_s / gaps[(h.session_id, h.turn)]) for h in hints
                if h.eta_s and gaps[(h.session_id, h.turn)] > 0]
        assert len(logs) > 3000
        assert abs(statistics.median(logs)) < 0.05 * sigma + 0.01
        assert abs(statistics.pstdev(logs) - sigma) < 0.05 * sigma
    exact = plan_hints(trace, HintConfig(kinds=ONLY_TOOL, tool_eta_sigma=0.0))
    assert all(h.eta_s == gaps[(h.session_id, h.turn)] for h in exact)


# ------------------------------------------------------------------ determinism
def test_same_seed_same_hints_other_seed_other_hints(bundled: Trace) -> None:
    cfg = HintConfig(coverage=0.6, abandon_share=0.2, seed=9)
    first = plan_hints(bundled, cfg)
    assert first == plan_hints(bundled, cfg)
    assert first == plan_hints(bundled, HintConfig(coverage=0.6, abandon_share=0.2),
                               random.Random(9))
    assert first != plan_hints(bundled, HintConfig(coverage=0.6, abandon_share=0.2, seed=10))


def test_kinds_are_independent_streams() -> None:
    trace = _synthetic(n=60)
    both = set(plan_hints(trace, HintConfig(kinds=BOTH, abandon_share=0.1, seed=2)))
    typing = set(plan_hints(trace, HintConfig(kinds=ONLY_TYPING, abandon_share=0.1, seed=2)))
    tool = set(plan_hints(trace, HintConfig(kinds=ONLY_TOOL, abandon_share=0.1, seed=2)))
    assert both == typing | tool and typing and tool


def test_hints_by_turn_groups_in_emission_order() -> None:
    hints = [PlannedHint("a", 2, TYPING, 5.0), PlannedHint("a", 2, TYPING, 1.0, abandoned=True),
             PlannedHint("b", 1, TOOL, 0.0, eta_s=3.0)]
    grouped = hints_by_turn(hints)
    assert [h.after_finish_s for h in grouped[("a", 2)]] == [1.0, 5.0]
    assert grouped[("b", 1)] == (hints[2],)
