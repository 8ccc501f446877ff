"""The pure parts of ``kvprefetch demo --repeats``: the 95% interval over per-seed means,
the per-seed and paired summaries, pooling runs, the hinted predictor spec, the arrival
seed, and the replayer sending planned hints on the compressed clock (a recording client
and an instant engine; no servers, no Ray)."""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import pytest

from kvprefetch.agents.engine_emulator import ServeRequest, ServeResult
from kvprefetch.controlplane.base import api
from kvprefetch.controlplane.base.types import HintKind, Trace, TraceRequest, TraceSession
from kvprefetch.controlplane.cli import build_parser
from kvprefetch.controlplane.harness.demo import build_trace
from kvprefetch.controlplane.harness.demo_report import (
    SeedStat,
    mean_ci95,
    paired_difference,
    pooled_run,
    seed_summary,
    t975,
)
from kvprefetch.controlplane.harness.replay import Replayer
from kvprefetch.controlplane.sim.hints import PlannedHint
from kvprefetch.controlplane.sim.simulator import PolicyRun, RequestRecord


def test_t975_matches_the_table_and_the_normal_limit() -> None:
    assert t975(1) == pytest.approx(12.706205)
    assert t975(2) == pytest.approx(4.302653)
    assert t975(30) == pytest.approx(2.042272)
    assert t975(60) == pytest.approx(2.000298, abs=1e-4)
    assert t975(120) == pytest.approx(1.979930, abs=1e-4)
    assert t975(100_000) == pytest.approx(1.959964, abs=1e-4)
    with pytest.raises(ValueError):
        t975(0)


def test_mean_ci95_by_hand() -> None:
    # [1, 2, 3]: mean 2, sd 1, se 1/sqrt(3) = 0.577350; t(0.975, 2) = 4.302653
    lo, hi = mean_ci95([1.0, 2.0, 3.0]) or (0.0, 0.0)
    assert lo == pytest.approx(2 - 2.484138, abs=1e-6)
    assert hi == pytest.approx(2 + 2.484138, abs=1e-6)
    # [2, 4]: mean 3, sd sqrt(2), se 1; t(0.975, 1) = 12.706205
    assert mean_ci95([2.0, 4.0]) == pytest.approx((3 - 12.706205, 3 + 12.706205))
    assert mean_ci95([1.5, 1.5, 1.5]) == pytest.approx((1.5, 1.5))
    assert mean_ci95([2.0]) is None
    assert mean_ci95([]) is None


def test_seed_summary_lists_seeds_and_the_interval() -> None:
    stats = [SeedStat(7, 1.0, 2.0, 10), SeedStat(8, 2.0, 3.0, 12), SeedStat(9, 3.0, 4.5, 11)]
    out = seed_summary(stats)
    assert out["per_seed"] == [
        {"seed": 7, "ttft_mean_s": 1.0, "ttft_p90_s": 2.0, "requests": 10},
        {"seed": 8, "ttft_mean_s": 2.0, "ttft_p90_s": 3.0, "requests": 12},
        {"seed": 9, "ttft_mean_s": 3.0, "ttft_p90_s": 4.5, "requests": 11},
    ]
    assert out["ttft_mean_ci95_s"] == pytest.approx([-0.484138, 4.484138], abs=1e-6)
    one = seed_summary(stats[:1])
    assert one["ttft_mean_ci95_s"] is None and len(one["per_seed"]) == 1


def test_paired_difference_by_hand() -> None:
    base = [SeedStat(0, 2.0, 0.0), SeedStat(1, 3.0, 0.0), SeedStat(2, 2.5, 0.0)]
    other = [SeedStat(0, 1.5, 0.0), SeedStat(1, 2.9, 0.0), SeedStat(2, 2.6, 0.0)]
    # differences -0.5, -0.1, +0.1: mean -0.166667, sd 0.305505, se 0.176383, t 4.302653
    out = paired_difference(base, other)
    assert out is not None
    assert [d["ttft_mean_diff_s"] for d in out["per_seed"]] == pytest.approx([-0.5, -0.1, 0.1])
    assert out["ttft_mean_diff_s"] == pytest.approx(-0.166667, abs=1e-6)
    assert out["ttft_mean_diff_ci95_s"] == pytest.approx([-0.925581, 0.592247], abs=1e-5)
    assert paired_difference(base, [SeedStat(5, 1.0, 0.0)]) is None


def _record(sid: str, ttft_s: float) -> RequestRecord:
    return RequestRecord(sid, 1, 0, 0.0, 0.0, 0.0, ttft_s, True, 0.0, 100, 100)


def test_pooled_run_joins_records_and_sums_counts() -> None:
    a = PolicyRun("p", records=[_record("a", 1.0)], prefetched_bytes=10, wasted_bytes=1,
                  remote_bytes=20, prefetches=2, prefetches_dropped=1, ttlb_s=[0.5],
                  lateness_s=[-1.0], events=7)
    b = PolicyRun("p", records=[_record("a", 3.0), _record("b", 2.0)], prefetched_bytes=5,
                  remote_bytes=6, prefetches=1, prefetches_cancelled=3, ttlb_s=[0.7],
                  events=4)
    out = pooled_run("p", [a, b])
    assert [r.ttft_s for r in out.records] == [1.0, 3.0, 2.0]
    assert (out.prefetched_bytes, out.wasted_bytes, out.remote_bytes) == (15, 1, 26)
    assert (out.prefetches, out.prefetches_dropped, out.prefetches_cancelled) == (3, 1, 3)
    assert out.ttlb_s == [0.5, 0.7] and out.lateness_s == [-1.0] and out.events == 11
    assert a.records == [_record("a", 1.0)]  # the inputs are left alone


def test_the_demo_runs_the_predictor_a_deployment_gets_by_default() -> None:
    from kvprefetch.controlplane.live.config import ServiceConfig

    args = _demo_args()
    assert args.predictor == ServiceConfig.model_fields["predictor"].default == "default"


def _demo_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["demo", *flags])


def test_demo_defaults_and_flags() -> None:
    args = _demo_args()
    assert (args.repeats, args.hints, args.hint_coverage, args.seed) == (3, True, 1.0, 0)
    assert (args.sessions, args.turns, args.compression) == (12, 16, 20.0)
    args = _demo_args("--repeats", "5", "--no-hints", "--seed", "4")
    assert (args.repeats, args.hints, args.seed) == (5, False, 4)


def test_the_arrival_seed_drives_start_times() -> None:
    args = _demo_args("--sessions", "6", "--turns", "4")
    window = 131_072

    def starts(seed: int) -> list[tuple[str, float]]:
        return [(s.session_id, s.start_s) for s in build_trace(args, window, seed).sessions]

    assert starts(3) == starts(3)
    assert starts(3) != starts(4)
    assert all(len(s.requests) <= 4 for s in build_trace(args, window, 3).sessions)


def test_the_demo_replays_another_trace_when_told() -> None:
    args = _demo_args("--trace", "synthetic:research", "--sessions", "5", "--turns", "3",
                      "--max-gap-s", "30")
    trace = build_trace(args, 131_072, 2)
    assert trace.source_format == "synthetic" and len(trace.sessions) == 5
    assert all(s.session_id.startswith("syn-") and len(s.requests) <= 3
               for s in trace.sessions)
    assert all(r.gap_s is None or r.gap_s <= 30 for s in trace.sessions for r in s.requests)
    assert build_trace(_demo_args(), 131_072, 2).source_format == "claude-code"


# ---------------------------------------------------------------------------------------------
# The replayer sends the planned hints on the compressed clock.
# ---------------------------------------------------------------------------------------------


class _RecordingClient:
    """Stands in for kvprefetch.controlplane.live.client.Client: records each call with its time."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float, Any]] = []
        self._lock = threading.Lock()

    def _log(self, op: str, sid: str, what: Any = None) -> None:
        with self._lock:
            self.calls.append((op, sid, time.time(), what))

    def route(self, sid: str, **kw: Any) -> api.RouteAnswer:
        self._log("route", sid)
        return api.RouteAnswer(node=0)

    def request_finished(self, sid: str, **kw: Any) -> api.Ack:
        self._log("finished", sid)
        return api.Ack()

    def hint(self, sid: str, hint: api.Hint, **kw: Any) -> api.Ack:
        self._log("hint", sid, hint)
        return api.Ack()


def _serve(node: int, req: ServeRequest) -> ServeResult:
    now = time.time()
    return ServeResult(req.session_id, req.turn, node, req.arrival_wall_s, now, now, now, now,
                       req.reused_tokens, 0, 0, 0, 0, 0.0)


def test_replayer_sends_each_planned_hint_at_its_time_before_the_request() -> None:
    reqs = (TraceRequest("s", 0, 0.0, 100, 10, stop_reason="tool_use"),
            TraceRequest("s", 1, 0.0, 200, 10, reused_tokens=110, gap_s=4.0),
            TraceRequest("s", 2, 0.0, 300, 10, reused_tokens=210, gap_s=10.0))
    trace = Trace("t", (TraceSession("s", 0.0, reqs),), "test")
    hints = (PlannedHint("s", 1, HintKind.TOOL_RUNNING, 0.0, eta_s=3.5),
             PlannedHint("s", 2, HintKind.USER_TYPING, 4.0),
             PlannedHint("s", 2, HintKind.USER_TYPING, 10.0))  # at the request's instant
    client = _RecordingClient()
    compression = 20.0
    out = Replayer(trace, client, _serve, compression=compression, nodes=1,  # type: ignore[arg-type]
                   hints=hints).run()
    assert out.hints_sent == 3 and out.hints_failed == 0 and out.failed == 0
    ops = [(op, h.kind if h is not None else None) for op, _, _, h in client.calls]
    assert ops == [("route", None), ("finished", None), ("hint", "tool_running"),
                   ("route", None), ("finished", None), ("hint", "user_typing"),
                   ("hint", "user_typing"), ("route", None), ("finished", None)]
    t = [when for _, _, when, _ in client.calls]
    tool = client.calls[2][3]
    assert tool.eta_s == pytest.approx(3.5)
    # each hint after_finish_s / compression wall seconds after the response before it
    assert t[2] - t[1] == pytest.approx(0.0, abs=0.08)
    assert t[5] - t[4] == pytest.approx(4.0 / compression, abs=0.08)
    assert t[6] - t[4] == pytest.approx(10.0 / compression, abs=0.08)
    assert t[7] >= t[6]
