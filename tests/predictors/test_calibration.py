"""Calibration of P(return within h | silent for a) in kvprefetch.predictors.evaluate and the
eval-predictor CLI."""

from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kvprefetch.controlplane.base.types import (
    ArrivalForecast,
    EventKind,
    SessionEvent,
    Trace,
    TraceRequest,
    TraceSession,
)
from kvprefetch.predictors.evaluate import (
    CALIBRATION_HORIZONS_S,
    CALIBRATION_SILENCES_S,
    collect_forecasts,
    ece_key,
    evaluate,
    expected_calibration_error,
)

#: Per-response probability that the session never sends another request.
STOP = 0.1
RATES_PER_S = (1 / 5, 1 / 30, 1 / 200, 1 / 1000)


def _exponential_trace(sessions: int, seed: int = 0) -> tuple[Trace, dict[str, float]]:
    """Sessions whose gaps are Exp(rate) (one rate per session), each response the last with
    probability STOP."""
    rng = random.Random(seed)
    out, rates = [], {}
    for i in range(sessions):
        sid, rate = f"s{i}", RATES_PER_S[i % len(RATES_PER_S)]
        rates[sid] = rate
        reqs = [TraceRequest(sid, 0, 0.0, 100, 10, api_time_s=1.0)]
        while rng.random() >= STOP:
            reqs.append(TraceRequest(sid, len(reqs), 0.0, 100, 10, reused_tokens=50,
                                     gap_s=rng.expovariate(rate), api_time_s=1.0))
        out.append(TraceSession(sid, 0.0, tuple(reqs)))
    return Trace("exp", tuple(out), "test"), rates


@dataclass(frozen=True, slots=True)
class _ExponentialForecast(ArrivalForecast):
    """The exact law: never returns with probability ``stop``, else gap ~ Exp(rate)."""

    rate_per_s: float = 1.0
    stop: float = 0.0

    def p_within(self, h_s: float, now_s: float) -> float:
        a = max(0.0, now_s - self.last_finish_s)
        # P(returns | silent for a) = (1-stop) e^(-rate a) / (stop + (1-stop) e^(-rate a))
        odds_gone = self.stop / (1 - self.stop) * math.exp(min(700.0, self.rate_per_s * a))
        return (1 - math.exp(-self.rate_per_s * h_s)) / (1 + odds_gone)


class _KnownRate:
    """Knows each session's true rate; ``scale`` and ``stop`` let it lie."""

    name = "known-rate"

    def __init__(self, rates: dict[str, float], *, scale: float = 1.0, stop: float = STOP):
        self.rates, self.scale, self.stop = rates, scale, stop
        self.last_finish: dict[str, float | None] = {}
        self.times: dict[str, list[tuple[str, float]]] = defaultdict(list)

    def observe(self, event: SessionEvent) -> None:
        self.times[event.session_id].append(("observe", event.time_s))
        finished = event.kind is EventKind.REQUEST_FINISHED
        self.last_finish[event.session_id] = event.time_s if finished else None

    def forecast(self, session_id: str, now_s: float) -> ArrivalForecast | None:
        self.times[session_id].append(("forecast", now_s))
        last = self.last_finish.get(session_id)
        if last is None:
            return None
        rate = self.rates[session_id] * self.scale
        q = tuple(-math.log(1 - lv) / rate for lv in (0.1, 0.5, 0.9))
        return _ExponentialForecast(session_id, last, q, 1 - self.stop, math.inf, 1.0,
                                    rate_per_s=rate, stop=self.stop)

    def forget(self, session_id: str) -> None:
        self.last_finish.pop(session_id, None)


class _KnownRateBatched(_KnownRate):
    def __init__(self, rates: dict[str, float], **kwargs: float) -> None:
        super().__init__(rates, **kwargs)
        self.batches = 0

    def forecast_many(self, ids: list[str], nows: list[float]) -> list[ArrivalForecast | None]:
        self.batches += 1
        return [self.forecast(sid, now) for sid, now in zip(ids, nows, strict=True)]


@pytest.fixture(scope="module")
def exp_trace() -> tuple[Trace, dict[str, float]]:
    return _exponential_trace(800)


@pytest.fixture(scope="module")
def honest(exp_trace) -> dict:
    """The metrics of the predictor that knows each session's true law."""
    trace, rates = exp_trace
    return evaluate(_KnownRate(rates), trace)


def _cells(metrics: dict) -> list[dict]:
    cells: list[dict] = metrics["calibration"]["cells"]
    assert len(cells) == len(CALIBRATION_HORIZONS_S) * len(CALIBRATION_SILENCES_S)
    return cells


def test_calibrated_predictor_has_ece_near_zero(honest) -> None:
    metrics = honest
    for cell in _cells(metrics):
        assert cell["n"] > 700 and cell["missing"] == 0
        assert cell["ece"] < 0.04, cell
        assert abs(cell["mean_p"] - cell["observed"]) < 0.03
        assert metrics[ece_key(cell["h_s"], cell["a_s"])] == cell["ece"]


def test_miscalibrated_predictors_have_large_ece(exp_trace, honest) -> None:
    trace, rates = exp_trace
    keys = [ece_key(h, a) for h in CALIBRATION_HORIZONS_S for a in CALIBRATION_SILENCES_S]
    too_fast = evaluate(_KnownRate(rates, scale=10.0, stop=0.0), trace)
    too_slow = evaluate(_KnownRate(rates, scale=0.1), trace)
    assert all(too_fast[k] > 0.2 and too_fast[k] > 10 * honest[k] for k in keys)
    # Ten times too slow still says "no" within 10 s of a long silence, rightly; it is far off
    # on the long horizon.
    assert np.mean([too_slow[k] for k in keys]) > 0.15
    assert all(too_slow[ece_key(600, a)] > 0.25 for a in CALIBRATION_SILENCES_S)


def test_ignoring_that_sessions_end_shows_in_long_silences(exp_trace) -> None:
    trace, rates = exp_trace
    never_ends = evaluate(_KnownRate(rates, stop=0.0), trace)
    by_silence = [never_ends[ece_key(600, a)] for a in CALIBRATION_SILENCES_S]
    assert by_silence == sorted(by_silence) and by_silence[-1] > 0.25


def test_forecasts_see_exactly_the_events_up_to_their_time(exp_trace) -> None:
    trace, rates = exp_trace
    model = _KnownRate(rates)
    table = collect_forecasts(model, trace)
    for sid, log in model.times.items():
        times = [t for _, t in log]
        assert times == sorted(times), sid  # nothing observed late, nothing forecast early
    cal = table.calibration
    assert cal is not None
    gaps = table.gap_s
    for j, a in enumerate(cal.silences_s):
        assert (cal.silent[:, j] == (gaps >= a)).all()
        # a forecast for every still-silent idle period, none for the others
        assert (~np.isnan(cal.p[:, j, 0]) == cal.silent[:, j]).all()
        for k, h in enumerate(cal.horizons_s):
            assert (cal.arrived[:, j, k] == (gaps <= a + h)).all()
    assert not cal.arrived[np.isinf(gaps)].any()


def test_batched_and_single_forecasts_agree() -> None:
    trace, rates = _exponential_trace(60, seed=3)
    single = collect_forecasts(_KnownRate(rates), trace).calibration
    batched_model = _KnownRateBatched(rates)
    batched = collect_forecasts(batched_model, trace).calibration
    assert single is not None and batched is not None
    np.testing.assert_array_equal(single.p, batched.p)
    rounds = max(len(s.requests) for s in trace.sessions)
    # one batch per round at the response ends, one per later silence (a > 0) and round
    assert batched_model.batches <= rounds * len(CALIBRATION_SILENCES_S)


def test_calibrate_false_skips_it(exp_trace) -> None:
    trace, rates = exp_trace
    metrics = evaluate(_KnownRate(rates), trace, calibrate=False)
    assert "calibration" not in metrics and ece_key(60, 0) not in metrics


def test_expected_calibration_error_by_hand() -> None:
    p = np.array([0.05, 0.05, 0.95, 0.95, 1.0])
    y = np.array([0, 1, 1, 1, 1], dtype=bool)
    ece, bins = expected_calibration_error(p, y, bins=10)
    # bin 0: mean p 0.05 vs 0.5 (2 of 5); bin 9: mean p 0.97 vs 1.0 (3 of 5)
    assert ece == pytest.approx((2 * 0.45 + 3 * (1 - (0.95 + 0.95 + 1.0) / 3)) / 5)
    assert [b["n"] for b in bins] == [2, 0, 0, 0, 0, 0, 0, 0, 0, 3]
    assert math.isnan(bins[1]["mean_p"])
    assert math.isnan(expected_calibration_error(np.array([]), np.array([]))[0])


def test_eval_predictor_cli_reports_calibration(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from kvprefetch.controlplane.cli import main
    from kvprefetch.controlplane.traces import bundled_trace_path

    out, png = tmp_path / "eval.json", tmp_path / "plots" / "cal.png"
    assert main(["eval-predictor", "--trace", str(bundled_trace_path("claude-code")),
                 "--predictor", "last-gap", "--limit-sessions", "8", "--json", str(out),
                 "--calibration-plot", str(png), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "calibration: ECE of P(return within h | silent for a)" in printed
    assert "h=600s" in printed
    result = json.loads(out.read_text())["predictors"]
    for metrics in result.values():
        cal = metrics["calibration"]
        assert cal["horizons_s"] == list(CALIBRATION_HORIZONS_S)
        assert cal["silences_s"] == list(CALIBRATION_SILENCES_S)
        assert len(cal["cells"][0]["bins"]) == cal["bins"] == 10
        assert ece_key(60, 30) in metrics
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
