"""Trace loaders: hand-written fixtures per format, error reporting, arrival processes, the
bundled slice, and the shared real traces (skipped when ``../shared/traces`` is absent)."""

from __future__ import annotations

import gzip
import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvprefetch.controlplane.base.errors import TraceFormatError, UnknownFormatError
from kvprefetch.controlplane.base.types import (
    Trace,
    TraceSession,
)
from kvprefetch.controlplane.traces import (
    BUNDLED_TRACES,
    DEFAULT_SESSION_RATE_PER_S,
    FORMATS,
    ArrivalOptions,
    JournalWriter,
    bundled_trace_path,
    detect_format,
    load_mooncake,
    load_trace,
)
from kvprefetch.controlplane.traces.arrivals import assign_start_times, scale_clock
from kvprefetch.controlplane.traces.claude_code import common_prefix_length

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
SHARED_TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"


def by_id(trace: Trace) -> dict[str, TraceSession]:
    return {s.session_id: s for s in trace.sessions}


def assert_sorted(trace: Trace) -> None:
    keys = [(s.start_s, s.session_id) for s in trace.sessions]
    assert keys == sorted(keys)


# ---------------------------------------------------------------------------------------------
# claude-code
# ---------------------------------------------------------------------------------------------


def test_claude_code_fixture_maps_requests_and_subagents() -> None:
    trace = load_trace(FIXTURES / "claude-code", seed=7)
    assert trace.source_format == "claude-code"
    assert trace.block_tokens == 64
    assert_sorted(trace)
    sessions = by_id(trace)
    assert set(sessions) == {"trace_0001", "trace_0001/agent_001", "trace_0002"}

    parent = sessions["trace_0001"]
    assert parent.parent_id is None
    assert [r.turn for r in parent.requests] == [0, 1, 2, 3]  # the sub-agent entry is no request
    assert [r.offset_s for r in parent.requests] == [0.0, 5.0, 30.0, 40.0]
    # think_time when present, else t_i - t_{i-1} - api_time_{i-1} (previous *request*).
    assert [r.gap_s for r in parent.requests] == [None, 3.0, 23.5, 8.0]
    # common prefix blocks x 64, capped at previous in+out and at this request's in.
    assert [r.reused_tokens for r in parent.requests] == [0, 192, 128, 100]
    assert [r.stop_reason for r in parent.requests] == ["tool_use", "tool_use", "end_turn"] * 1 + [
        "end_turn"
    ]
    assert [r.api_time_s for r in parent.requests] == [2.0, 1.5, 2.0, None]
    assert parent.closed_loop

    child = sessions["trace_0001/agent_001"]
    assert child.parent_id == "trace_0001"
    assert child.start_s == pytest.approx(parent.start_s + 8.0)
    assert [r.gap_s for r in child.requests] == [None, 2.0]
    assert [r.reused_tokens for r in child.requests] == [0, 128]
    assert child.requests[1].stop_reason is None  # "" means unknown
    assert all(r.session_id == child.session_id for r in child.requests)


def test_claude_code_single_file_and_gzip(tmp_path: Path) -> None:
    source = FIXTURES / "claude-code" / "trace_0002.json"
    packed = tmp_path / "trace_0002.json.gz"
    packed.write_bytes(gzip.compress(source.read_bytes()))
    for path in (source, packed):
        trace = load_trace(path)
        assert [s.session_id for s in trace.sessions] == ["trace_0002"]
        assert trace.sessions[0].start_s == 0.0  # the first Poisson session starts at 0
        assert trace.requests == 2
        assert trace.name == "trace_0002"


def test_claude_code_limit_is_by_file_name_not_seed() -> None:
    path = bundled_trace_path("claude-code")
    chosen = {
        frozenset(s.session_id for s in load_trace(path, seed=seed, limit_sessions=5).sessions)
        for seed in (1, 2, 3)
    }
    assert len(chosen) == 1
    ids = next(iter(chosen))
    parents = sorted(i for i in ids if "/" not in i)
    assert parents == ["trace_0002", "trace_0004", "trace_0012", "trace_0014", "trace_0042"]
    assert "trace_0004/agent_001" in ids  # sub-agents come with their parent


def test_common_prefix_length() -> None:
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_length([1, 2, 3, 4], [1, 2]) == 2
    assert common_prefix_length([1, 2, 3, 4, 5], [1, 2, 3, 9, 5]) == 3
    assert common_prefix_length([7], [1]) == 0
    long = list(range(10_000))
    assert common_prefix_length(long, [*long[:6789], -1]) == 6789


# ---------------------------------------------------------------------------------------------
# mooncake
# ---------------------------------------------------------------------------------------------


def test_mooncake_shared_prefix_does_not_merge_users_but_a_conversation_merges() -> None:
    trace = load_trace(FIXTURES / "mooncake_sessions.jsonl")
    assert trace.source_format == "mooncake"
    assert trace.block_tokens == 512
    assert_sorted(trace)
    sessions = trace.sessions
    # Blocks [1, 2] are a system prompt that three users diverge from: never a link.
    assert [len(s.requests) for s in sessions] == [2, 1, 1]
    conversation, user_b, user_c = sessions
    assert conversation.start_s == 0.0
    assert [r.offset_s for r in conversation.requests] == [0.0, 5.0]
    assert [r.input_tokens for r in conversation.requests] == [1948, 2510]
    # The follow-up reuses the 3 full blocks of the first turn.
    assert [r.reused_tokens for r in conversation.requests] == [0, 3 * 512]
    assert all(r.gap_s is None for r in conversation.requests)  # open-loop
    assert (user_b.start_s, user_c.start_s) == (1.0, 1.5)
    assert user_b.requests[0].input_tokens == 1100
    assert user_c.requests[0].reused_tokens == 0


def test_mooncake_without_the_guard_users_would_merge() -> None:
    path = FIXTURES / "mooncake_sessions.jsonl"
    unguarded = load_mooncake(path, shared_prefix_fanout=100)
    assert sorted(len(s.requests) for s in unguarded.sessions) == [2, 2]


def test_mooncake_limit_by_start_time() -> None:
    trace = load_trace(FIXTURES / "mooncake_sessions.jsonl", limit_sessions=2)
    assert [s.start_s for s in trace.sessions] == [0.0, 1.0]


# ---------------------------------------------------------------------------------------------
# azure
# ---------------------------------------------------------------------------------------------


def test_azure_rows_are_single_request_sessions() -> None:
    trace = load_trace(FIXTURES / "azure.csv")
    assert trace.source_format == "azure"
    assert_sorted(trace)
    assert [s.session_id for s in trace.sessions] == ["r000000", "r000001", "r000002", "r000003"]
    starts = [s.start_s for s in trace.sessions]
    assert starts[:3] == pytest.approx([0.0, 4.314579, 4.314579], abs=1e-9)
    # Seven fractional digits, across midnight.
    assert starts[3] == pytest.approx(5 * 3600 + 44 * 60 + 13.3194101, abs=1e-9)
    first = trace.sessions[0].requests
    assert len(first) == 1
    assert (first[0].input_tokens, first[0].output_tokens, first[0].reused_tokens) == (374, 44, 0)


# ---------------------------------------------------------------------------------------------
# Errors and detection
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "line", "field"),
    [
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
         '{"timestamp": 5, "output_length": 1, "hash_ids": [1]}\n', 2, "input_length"),
        ('{"timestamp": 0, "input_length": 10, "output_length": -1, "hash_ids": [1]}\n',
         1, "output_length"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n\n'
         '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "x"}\n',
         3, "hash_ids"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
         '{"timestamp": "soon", "input_length": 10, "output_length": 1, "hash_ids": [1]}\n',
         2, "timestamp"),
        ('{"timestamp": 0, "input_length": 1.5, "output_length": 1, "hash_ids": [1]}\n',
         1, "input_length"),
    ],
)  # fmt: skip
def test_mooncake_malformed_line_names_file_line_field(
    tmp_path: Path, content: str, line: int, field: str
) -> None:
    path = tmp_path / "broken_trace.jsonl"
    path.write_text(content)
    with pytest.raises(TraceFormatError) as caught:
        load_trace(path, "mooncake")
    message = str(caught.value)
    assert f"broken_trace.jsonl:{line}" in message
    assert repr(field) in message
    assert (caught.value.line, caught.value.field) == (line, field)


def test_bad_json_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
    path.write_text(good + good + '{"timestamp": 1, "input_length": \n')
    with pytest.raises(TraceFormatError, match=r"broken\.jsonl:3.*invalid JSON"):
        load_trace(path)


def test_claude_code_bad_field_names_file_and_field(tmp_path: Path) -> None:
    document = json.loads((FIXTURES / "claude-code" / "trace_0001.json").read_text())
    document["requests"][2]["requests"][1]["in"] = -5
    path = tmp_path / "trace_0009.json"
    path.write_text(json.dumps(document, indent=1))
    with pytest.raises(TraceFormatError) as caught:
        load_trace(path)
    assert "trace_0009.json" in str(caught.value)
    assert caught.value.field == "requests[2].requests[1].in"
    assert "non-negative" in str(caught.value)

    path.write_text('{\n  "id": "x",\n  "requests": [\n    {"t": 0,,}\n  ]\n}\n')
    with pytest.raises(TraceFormatError, match=r"trace_0009\.json:4.*invalid JSON"):
        load_trace(path)


@pytest.mark.parametrize(
    ("row", "field"),
    [("2023-11-16 18:15:46.68,374,-44", "GeneratedTokens"),
     ("2023-11-16 18:15:46.68,many,44", "ContextTokens"),
     ("16/11/2023 18:15,374,44", "TIMESTAMP")],
)  # fmt: skip
def test_azure_malformed_row(tmp_path: Path, row: str, field: str) -> None:
    path = tmp_path / "az.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,1\n{row}\n")
    with pytest.raises(TraceFormatError) as caught:
        load_trace(path)
    assert "az.csv:3" in str(caught.value) and repr(field) in str(caught.value)


def test_unknown_formats_list_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(UnknownFormatError) as caught:
        load_trace(FIXTURES / "azure.csv", "parquet")
    assert all(name in str(caught.value) for name in FORMATS)

    odd = tmp_path / "trace.txt"
    odd.write_text("hello\n")
    other = tmp_path / "other.jsonl"
    other.write_text('{"prompt": "hi"}\n')
    for path in (odd, other):
        with pytest.raises(UnknownFormatError) as caught:
            load_trace(path)
        assert all(name in str(caught.value) for name in FORMATS)


def test_detect_format() -> None:
    assert detect_format(FIXTURES / "claude-code") == "claude-code"
    assert detect_format(FIXTURES / "claude-code" / "trace_0001.json") == "claude-code"
    assert detect_format(FIXTURES / "mooncake_sessions.jsonl") == "mooncake"
    assert detect_format(FIXTURES / "azure.csv") == "azure"


def test_missing_and_empty_traces(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no such file"):
        load_trace(tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TraceFormatError, match="no requests"):
        load_trace(empty, "mooncake")
    with pytest.raises(TraceFormatError, match="no Claude Code trace files"):
        load_trace(tmp_path)
    header_only = tmp_path / "empty.csv"
    header_only.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(TraceFormatError, match="no requests"):
        load_trace(header_only)
    journal = tmp_path / "j.jsonl"
    with JournalWriter(journal):
        pass
    with pytest.raises(TraceFormatError, match="no requests"):
        load_trace(journal)


# ---------------------------------------------------------------------------------------------
# Arrivals
# ---------------------------------------------------------------------------------------------


def test_arrival_options_validation() -> None:
    assert ArrivalOptions().session_rate_per_s == DEFAULT_SESSION_RATE_PER_S
    assert ArrivalOptions(concurrency=4).session_rate_per_s is None
    with pytest.raises(ValidationError):
        ArrivalOptions(session_rate_per_s=1.0, concurrency=2)
    with pytest.raises(ValidationError):
        ArrivalOptions(session_rate_per_s=-1.0)
    options = ArrivalOptions(session_rate_per_s=0.5, load=2.0)
    assert options.effective_rate_per_s == 1.0
    assert ArrivalOptions(concurrency=3, load=2.0).effective_concurrency == 6
    with pytest.raises(ValidationError):
        options.load = 3.0  # type: ignore[misc]


def test_arrivals_are_seeded_and_deterministic() -> None:
    path = bundled_trace_path("claude-code")

    def starts(seed: int, arrivals: ArrivalOptions | None = None) -> dict[str, float]:
        # Eight sessions (and their sub-agents) are enough to tell two seeds apart.
        trace = load_trace(path, seed=seed, arrivals=arrivals, limit_sessions=8)
        return {s.session_id: s.start_s for s in trace.sessions}

    assert starts(1) == starts(1)
    assert starts(1) != starts(2)
    slots = ArrivalOptions(concurrency=4)
    assert starts(5, slots) == starts(5, slots)
    assert starts(5, slots) != starts(6, slots)


def test_poisson_rate_and_load() -> None:
    durations = [100.0] * 4000
    starts = sorted(assign_start_times(durations, ArrivalOptions(session_rate_per_s=0.5), 3))
    assert starts[0] == 0.0
    assert starts[-1] / (len(starts) - 1) == pytest.approx(2.0, rel=0.1)
    doubled = sorted(
        assign_start_times(durations, ArrivalOptions(session_rate_per_s=0.5, load=2.0), 3)
    )
    assert doubled[-1] == pytest.approx(starts[-1] / 2, rel=0.1)


def test_load_runs_a_timestamped_trace_on_a_faster_clock() -> None:
    # Mooncake keeps its own timestamps: load 2 replays the same requests in half the time
    # (it used to be ignored, so a load sweep on such a trace changed nothing).
    path = FIXTURES / "mooncake_sessions.jsonl"
    base = load_trace(path, arrivals=ArrivalOptions(session_rate_per_s=0.5))
    fast = load_trace(path, arrivals=ArrivalOptions(session_rate_per_s=0.5, load=2.0))
    assert [s.session_id for s in fast.sessions] == [s.session_id for s in base.sessions]
    assert any(s.start_s > 0 for s in base.sessions)
    for b, f in zip(base.sessions, fast.sessions, strict=True):
        assert f.start_s == b.start_s / 2
        assert [r.offset_s for r in f.requests] == [r.offset_s / 2 for r in b.requests]
        assert [r.input_tokens for r in f.requests] == [r.input_tokens for r in b.requests]
    assert load_trace(path) == base  # no arrivals, or load 1: the trace's own clock
    # A closed-loop request keeps its gap (the client's think time), only its start moves.
    closed = replace(base, sessions=(replace(base.sessions[0], requests=tuple(
        replace(r, gap_s=3.0) for r in base.sessions[0].requests)),))
    (session,) = scale_clock(closed, 4.0).sessions
    assert session.start_s == base.sessions[0].start_s / 4
    assert session.requests == closed.sessions[0].requests
    with pytest.raises(ValueError, match="load must be > 0"):
        scale_clock(base, 0.0)


def _max_live(intervals: list[tuple[float, float]]) -> int:
    edges = sorted([(end, -1) for _, end in intervals] + [(start, 1) for start, _ in intervals])
    live = peak = 0
    for _, step in edges:  # ends sort before starts at the same instant
        live += step
        peak = max(peak, live)
    return peak


def test_concurrency_keeps_at_most_n_live_sessions() -> None:
    durations = [float(d) for d in range(1, 200)]
    starts = assign_start_times(durations, ArrivalOptions(concurrency=7), seed=11)
    intervals = [(s, s + d) for s, d in zip(starts, durations, strict=True)]
    assert _max_live(intervals) == 7

    trace = load_trace(bundled_trace_path(), arrivals=ArrivalOptions(concurrency=3), seed=2)
    ends: dict[str, float] = {}
    for session in trace.sessions:
        root = session.parent_id or session.session_id
        last = session.requests[-1]
        end = session.start_s + last.offset_s + (last.api_time_s or 0.0)
        ends[root] = max(ends.get(root, 0.0), end)
    roots = [s for s in trace.sessions if s.parent_id is None]
    assert _max_live([(s.start_s, ends[s.session_id]) for s in roots]) <= 3


# ---------------------------------------------------------------------------------------------
# Bundled slice
# ---------------------------------------------------------------------------------------------


def test_bundled_slice_loads_with_attribution() -> None:
    root = bundled_trace_path().parent
    assert (root / "ATTRIBUTION.md").is_file()
    assert (root / "claude-code" / "LICENSE").is_file()
    formats = {"claude-code": "claude-code", "mooncake": "mooncake"}
    for name in BUNDLED_TRACES:
        trace = load_trace(bundled_trace_path(name))
        assert trace.source_format == formats.get(name, "azure")
        assert trace.requests > 0
        assert_sorted(trace)
    claude = load_trace(bundled_trace_path("claude-code"))
    assert sum(1 for s in claude.sessions if s.parent_id is None) == 24
    assert any(s.parent_id is not None for s in claude.sessions)


# ---------------------------------------------------------------------------------------------
# Shared real traces
# ---------------------------------------------------------------------------------------------

needs_shared = pytest.mark.skipif(
    not SHARED_TRACES.is_dir(), reason=f"shared traces not found at {SHARED_TRACES}"
)


@pytest.fixture(scope="module")
def shared_claude_code() -> tuple[Trace, float]:
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"shared traces not found at {SHARED_TRACES}")
    began = time.perf_counter()
    trace = load_trace(SHARED_TRACES / "claude-code")
    return trace, time.perf_counter() - began


@needs_shared
@pytest.mark.slow
def test_shared_claude_code_shape(shared_claude_code: tuple[Trace, float]) -> None:
    trace, elapsed_s = shared_claude_code
    parents = [s for s in trace.sessions if s.parent_id is None]
    children = [s for s in trace.sessions if s.parent_id is not None]
    assert len(parents) == 360
    assert len(children) == 38
    # 24,146 entries in the files, of which 38 are sub-agent entries (not requests).
    assert trace.requests == 24_108
    reused = sum(r.reused_tokens for r in trace.iter_requests())
    total = sum(r.input_tokens for r in trace.iter_requests())
    assert reused / total == pytest.approx(0.96, abs=0.01)  # README: 96 % within-session
    assert all(s.closed_loop for s in parents if len(s.requests) > 1)
    assert elapsed_s < 60  # about 4 s on a 2-core machine; this only catches blow-ups


@needs_shared
@pytest.mark.slow
def test_shared_mooncake_and_azure() -> None:
    mooncake = load_trace(SHARED_TRACES / "mooncake" / "synthetic_trace.jsonl")
    assert mooncake.requests == 3993
    assert mooncake.sessions[0].start_s == 0.0
    multi = [s for s in mooncake.sessions if len(s.requests) > 1]
    assert 0 < len(multi) < len(mooncake.sessions) // 10
    conv = load_trace(SHARED_TRACES / "azure2023" / "AzureLLMInferenceTrace_conv.csv")
    code = load_trace(SHARED_TRACES / "azure2023" / "AzureLLMInferenceTrace_code.csv")
    assert (conv.requests, code.requests) == (19_366, 8_819)
    assert 3400 < conv.sessions[-1].start_s < 3600
