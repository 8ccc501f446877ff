"""Synthetic traffic (``--trace synthetic:PROFILE``): seeded, shaped by its profile's laws,
placed like Claude Code, and clear errors for a bad name."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest

from kvprefetch.controlplane.base.errors import UnknownFormatError
from kvprefetch.controlplane.traces import ArrivalOptions, load_trace
from kvprefetch.controlplane.traces.synthetic import PROFILES, SyntheticProfile, synthetic_trace


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    a = load_trace("synthetic:agentic:40", seed=3)
    assert a == load_trace("synthetic:agentic:40", seed=3)
    assert a != load_trace("synthetic:agentic:40", seed=4)
    assert a.source_format == "synthetic" and a.name == "synthetic-agentic"
    assert len(a.sessions) == 40


def test_random_profile_is_a_new_regime_per_seed() -> None:
    means = {statistics.mean(len(s.requests) for s in
                             load_trace("synthetic:random:60", seed=s).sessions)
             for s in range(4)}
    assert len(means) == 4


def test_sessions_follow_their_profile() -> None:
    p = PROFILES["agentic"]
    assert p is not None
    trace = synthetic_trace(p, 400, seed=1)
    tool_gaps, human_gaps = [], []
    for s in trace.sessions:
        prev = None
        for r in s.requests:
            if prev is None:
                assert r.gap_s is None and r.reused_tokens == 0
            else:
                assert r.gap_s is not None and r.gap_s >= 0.0
                if r.reused_tokens:  # no compaction: the whole previous context is reused
                    assert r.reused_tokens == prev.context_tokens_after < r.input_tokens
                (tool_gaps if prev.stop_reason == "tool_use" else human_gaps).append(r.gap_s)
            prev = r
        assert s.requests[-1].stop_reason == "end_turn"
    share = len(tool_gaps) / (len(tool_gaps) + len(human_gaps))
    assert abs(share - p.tool_share) < 0.03
    assert 0.8 * p.tool_median_s < statistics.median(tool_gaps) < 1.25 * p.tool_median_s
    assert statistics.median(human_gaps) > 5 * statistics.median(tool_gaps)
    turns = statistics.mean(len(s.requests) for s in trace.sessions)
    assert 0.8 * p.turns_mean < turns < 1.2 * p.turns_mean


def test_clients_without_stop_reasons_keep_the_laws() -> None:
    with_stop = load_trace("synthetic:agentic:30", seed=2)
    without = load_trace("synthetic:agentic-nostop:30", seed=2)
    assert all(r.stop_reason is None for r in without.iter_requests())
    assert [replace(r, stop_reason=None) for r in with_stop.iter_requests()] == list(
        without.iter_requests())


def test_sessions_are_placed_by_the_arrival_process_and_load_scales_the_rate() -> None:
    one = load_trace("synthetic:chat:200", seed=0, arrivals=ArrivalOptions(load=1.0))
    two = load_trace("synthetic:chat:200", seed=0, arrivals=ArrivalOptions(load=2.0))
    assert [s.start_s for s in one.sessions] == sorted(s.start_s for s in one.sessions)
    assert two.sessions[-1].start_s == pytest.approx(one.sessions[-1].start_s / 2, rel=1e-9)
    assert load_trace("synthetic:chat", seed=0, limit_sessions=7).sessions.__len__() == 7


@pytest.mark.parametrize("spec, words", [
    ("synthetic:nope", "unknown synthetic profile 'nope'"),
    ("synthetic:chat:0", "positive integer, got '0'"),
    ("synthetic:chat:ten", "positive integer, got 'ten'"),
])
def test_bad_specs_say_what_is_wrong(spec: str, words: str) -> None:
    with pytest.raises(UnknownFormatError, match=words) as err:
        load_trace(spec)
    if "profile" in words:
        assert "agentic, agentic-nostop, chat, research, random" in str(err.value)


def test_profile_validation() -> None:
    p = PROFILES["chat"]
    assert p is not None
    with pytest.raises(ValueError, match="tool_share"):
        replace(p, tool_share=1.5)
    with pytest.raises(ValueError, match="turns_mean"):
        replace(p, turns_mean=0.5)
    with pytest.raises(ValueError, match="think_median_s"):
        SyntheticProfile(**{**{f: getattr(p, f) for f in p.__slots__}, "think_median_s": 0.0})
