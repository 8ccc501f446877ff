"""Planned client hints for the simulator (kvprefetch.controlplane.sim.hints): pure logic, no
servers."""

from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from dataclasses import replace

import pytest

from kvprefetch.controlplane.base.config import GIB, LLAMA_8B, default_fleet, fleet_from_dict
from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.base.types import (
    ArrivalForecast,
    EventKind,
    HintKind,
    SessionEvent,
    Trace,
    TraceRequest,
    TraceSession,
)
from kvprefetch.controlplane.core.policies import POLICIES, parse_policies
from kvprefetch.controlplane.sim import PolicyRun, SimOptions, Simulation, run_policies, run_policy
from kvprefetch.controlplane.sim.hints import (
    HintConfig,
    HintCounts,
    PlannedHint,
    hints_by_turn,
    parse_hint_kinds,
    plan_hints,
    typed_tokens,
)
from kvprefetch.controlplane.sim.runner import hinted_predictor
from kvprefetch.controlplane.traces import bundled_trace_path, load_trace

TYPING, TOOL = HintKind.USER_TYPING, HintKind.TOOL_RUNNING
ONLY_TYPING, ONLY_TOOL = frozenset({TYPING}), frozenset({TOOL})
BOTH = frozenset({TYPING, TOOL})


def _session(sid: str, stops: list[str | None], gaps: list[float], *, parent: str | None = None,
             new_tokens: int = 130, output_tokens: int = 50) -> TraceSession:
    """A closed-loop session: request k >= 1 comes gaps[k-1] after response k-1 ends."""
    reqs: list[TraceRequest] = []
    for k, stop in enumerate(stops):
        # the reused prefix is the previous input (Claude Code's shape): the new input
        # carries the previous response and the typed text
        reused = reqs[-1].input_tokens if reqs else 0
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


def test_typed_text_excludes_only_the_part_of_the_response_the_prefix_misses() -> None:
    # A reused prefix that runs through the previous response (as the synthetic traces
    # write it): the new input is all typed text; one that stops at the previous input
    # (Claude Code's block hashes): the response is part of the new input.
    prev = TraceRequest("a", 0, 0.0, 1000, 400, stop_reason="end_turn")
    through = TraceRequest("a", 1, 0.0, 1700, 10, reused_tokens=1400, gap_s=5.0)
    at_input = TraceRequest("a", 1, 0.0, 1700, 10, reused_tokens=1000, gap_s=5.0)
    halfway = TraceRequest("a", 1, 0.0, 1700, 10, reused_tokens=1200, gap_s=5.0)
    assert typed_tokens(prev, through) == 300
    assert typed_tokens(prev, at_input) == 300
    assert typed_tokens(prev, halfway) == 300
    assert typed_tokens(prev, TraceRequest("a", 1, 0.0, 1100, 10, reused_tokens=1000)) == 0


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


# ------------------------------------------------------------------ hints in the simulator
class _Recorder:
    """A predictor that records what the core tells it (and forecasts like last-gap)."""

    name = "recorder"

    def __init__(self) -> None:
        from kvprefetch.predictors.heuristics import LastGapPredictor

        self.inner = LastGapPredictor()
        self.events: list[SessionEvent] = []

    def observe(self, event: SessionEvent) -> None:
        self.events.append(event)
        self.inner.observe(event)

    def forecast(self, session_id: str, now_s: float) -> ArrivalForecast | None:
        return self.inner.forecast(session_id, now_s)

    def forget(self, session_id: str) -> None:
        self.inner.forget(session_id)


def _replay(trace: Trace, hints: tuple[PlannedHint, ...] | list[PlannedHint],
            policy: str = "predictive") -> tuple[Simulation, _Recorder]:
    recorder = _Recorder()
    sim = Simulation(trace, fleet_from_dict({"nodes": 1}), POLICIES[policy], recorder,
                     hints=hints)
    sim.run()
    return sim, recorder


@pytest.mark.parametrize("policy", ["ondemand", "predictive"])
def test_simulation_sends_every_planned_hint_to_the_core_before_its_request(
        policy: str, bundled: Trace) -> None:
    cfg = HintConfig(abandon_share=0.2, seed=1)
    plan = plan_hints(bundled, cfg)
    counts = HintCounts.of(plan)
    assert counts.typing and counts.tool and counts.abandoned
    sim, rec = _replay(bundled, plan, policy)
    hint_events = [e for e in rec.events if e.kind is EventKind.HINT]
    assert len(hint_events) == len(plan) == counts.total
    assert sim.hints_sent == counts
    # The same hints, as the core saw them (abandoned ones look like any typing hint).
    sent = sorted((e.session_id, e.turn, e.hint, e.eta_s) for e in hint_events)
    assert sent == sorted((h.session_id, h.turn, h.kind, h.eta_s) for h in plan)
    # Each at its planned delay after the response before its request, never after the
    # request arrived.
    finished = {(e.session_id, e.turn + 1): e.time_s for e in rec.events
                if e.kind is EventKind.REQUEST_FINISHED}
    started = {(e.session_id, e.turn): i for i, e in enumerate(rec.events)
               if e.kind is EventKind.REQUEST_STARTED}
    by_key = hints_by_turn(plan)
    sessions = {s.session_id: s for s in bundled.sessions}
    for i, e in enumerate(rec.events):
        if e.kind is not EventKind.HINT:
            continue
        key = (e.session_id, e.turn)
        session = sessions[e.session_id]
        assert (e.tenant, e.parent_id) == (session.tenant, session.parent_id)
        assert any(e.time_s == pytest.approx(finished[key] + h.after_finish_s)
                   for h in by_key[key])
        if key in started:
            assert i < started[key]


def test_hint_due_at_the_arrival_comes_first_and_one_after_it_is_never_sent() -> None:
    # Nothing typed (new input = the previous response): the typing hint is due exactly
    # when the request arrives.
    trace = Trace("t", (_session("a", ["end_turn", "end_turn"], [30.0], new_tokens=0),), "test")
    plan = plan_hints(trace, HintConfig(kinds=ONLY_TYPING))
    assert [(h.turn, h.after_finish_s) for h in plan] == [(1, 30.0)]
    late = PlannedHint("a", 1, TOOL, 30.5, eta_s=1.0)
    sim, rec = _replay(trace, [*plan, late])
    kinds = [(e.kind, e.turn) for e in rec.events if e.turn == 1]
    assert kinds[0] == (EventKind.HINT, 1) and kinds[1] == (EventKind.REQUEST_STARTED, 1)
    assert sim.hints_sent == HintCounts(typing=1)
    assert [e.hint for e in rec.events if e.kind is EventKind.HINT] == [TYPING]


def test_coverage_zero_replays_exactly_like_no_hints(bundled: Trace) -> None:
    fleet = default_fleet("8b", 1)
    policies = parse_policies("ondemand,predictive,perfect")
    off = run_policies(bundled, fleet, policies, SimOptions(predictor="ewma"))
    zero = run_policies(bundled, fleet, policies,
                        SimOptions(predictor="ewma", hints=HintConfig(coverage=0.0)))
    assert zero.yardstick == off.yardstick
    for name, summary in off.policies.items():
        assert json.dumps(zero.policies[name].to_dict()) == json.dumps(summary.to_dict())
    assert off.meta.hints is None and "hints" not in off.meta.to_dict()
    assert zero.meta.hints is not None
    assert list(zero.meta.to_dict()) == [*off.meta.to_dict(), "hints"]  # only added
    assert (zero.meta.hints.sent_typing, zero.meta.hints.sent_tool,
            zero.meta.hints.sent_abandoned) == (0, 0, 0)


def test_hints_replay_deterministically_and_report_what_was_sent(bundled: Trace) -> None:
    fleet = default_fleet("8b", 1)
    policies = parse_policies("ondemand,predictive,perfect")
    cfg = HintConfig(coverage=0.5, abandon_share=0.1, tool_eta_sigma=0.3, seed=4)
    reports = []
    for workers in (1, 2):
        rep = run_policies(bundled, fleet, policies, SimOptions(hints=cfg, workers=workers))
        reports.append(replace(rep, meta=replace(rep.meta, wall_s=0.0)).to_json())
    assert reports[0] == reports[1]
    meta = json.loads(reports[0])["meta"]["hints"]
    counts = HintCounts.of(plan_hints(bundled, cfg))
    assert meta == {"kinds": ["user_typing", "tool_running"], "coverage": 0.5, "seed": 4,
                    "tool_eta_sigma": 0.3, "abandon_share": 0.1,
                    "sent_typing": counts.typing, "sent_tool": counts.tool,
                    "sent_abandoned": counts.abandoned}


def test_the_users_predictor_reads_hints_the_oracle_keeps_its_own() -> None:
    from kvprefetch.predictors.heuristics import EwmaPredictor
    from kvprefetch.predictors.hinted import HintedPredictor
    from kvprefetch.predictors.oracle import OraclePredictor

    ewma = EwmaPredictor()
    wrapped = hinted_predictor(POLICIES["predictive"], ewma)
    assert isinstance(wrapped, HintedPredictor) and wrapped.inner is ewma
    assert hinted_predictor(POLICIES["predictive"], wrapped) is wrapped
    oracle = OraclePredictor(Trace("empty", (), "test"))
    assert hinted_predictor(POLICIES["perfect"], oracle) is oracle


def _tool_session(sid: str, start_s: float, turns: list[tuple[int, int, float]]) -> TraceSession:
    """Closed-loop tool calls: (new tokens, output tokens, gap before the turn)."""
    reqs, ctx = [], 0
    for k, (new, out, gap) in enumerate(turns):
        reqs.append(TraceRequest(sid, k, 0.0, ctx + new, out, ctx, None if k == 0 else gap,
                                 "tool_use", 1.0))
        ctx += new + out
    return TraceSession(sid, start_s, tuple(reqs))


def test_an_exact_tool_hint_lets_the_prefetch_land_before_the_request() -> None:
    """One node with 4 GiB of HBM and of DRAM (32k tokens each). Session a's tool calls came
    back after 100 s, then after 60 s; meanwhile b's first turn (25k tokens) evicts a's 11k
    from both tiers, and b's second (55k, more than a tier holds) leaves the DRAM tier empty.
    Without hints last-gap has one gap of a (less confident than the planner's
    ``min_confidence`` here, so no prefetch): a's last turn
    loads its KV on demand. With an exact tool hint (ETA = the true 60 s) the predictor
    knows when a comes back: the prefetch lands before a's request, which is faster. The
    write-through hierarchy of vLLM + LMCache (under an exclusive one, b's turns demote a's
    context into DRAM and no prefetch is needed)."""
    a = _tool_session("a", 0.0, [(10_000, 100, 0.0), (1_000, 100, 100.0), (1_000, 50, 60.0)])
    b = _tool_session("b", 110.0, [(25_000, 100, 0.0), (30_000, 50, 2.0)])
    trace = Trace("tool-hint", (a, b), "test")
    fleet = fleet_from_dict({"nodes": 1, "node": {"hbm_kv_bytes": 4 * GIB,
                                                  "dram_tier_bytes": 4 * GIB},
                             "planner": {"min_confidence": 0.7}})
    plan = plan_hints(trace, HintConfig(kinds=ONLY_TOOL, tool_eta_sigma=0.0))
    assert [(h.session_id, h.turn, h.eta_s) for h in plan] == [("a", 1, 100.0), ("a", 2, 60.0),
                                                                 ("b", 1, 2.0)]

    def last_turn_of_a(hints: tuple[PlannedHint, ...] | None) -> tuple[float, PolicyRun]:
        run = run_policy(trace, fleet, POLICIES["predictive"], "last-gap", hints=hints,
                         engine="local")
        (rec,) = [r for r in run.records if (r.session_id, r.turn) == ("a", 2)]
        assert rec.reused_local_tokens == rec.reused_tokens == 11_200
        return rec.ttft_s, run

    without, run_off = last_turn_of_a(None)
    with_hints, run_on = last_turn_of_a(plan)
    assert run_off.prefetches == 0 and run_off.prefetched_bytes == 0
    assert run_on.prefetches == 1
    # b's write-through cut a back to a prefix (suffix eviction): only the rest moves.
    kept = 11_200 - run_on.prefetched_bytes // LLAMA_8B.kv_bytes_per_token
    assert 0 < kept < 11_200 and kept % 256 == 0
    assert run_on.wasted_bytes == 0
    assert run_on.lateness_s and max(run_on.lateness_s) < 0  # landed before a arrived
    # ... and the request no longer waits for them: most of their load time (Valkey's
    # 5 GB/s) is saved.
    assert with_hints < without - 0.8 * run_on.prefetched_bytes / 5e9
    oracle = run_policy(trace, fleet, POLICIES["perfect"], "last-gap", hints=plan)
    (best,) = [r.ttft_s for r in oracle.records if (r.session_id, r.turn) == ("a", 2)]
    assert with_hints == pytest.approx(best)
