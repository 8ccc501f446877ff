"""The exact survival curve on a forecast (SurvivalCurve) and the ``adaptive`` predictor with
its shipped ``default`` artifact. Hand-computed cases; synthetic traces of known law."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from kvprefetch.controlplane.base.errors import PluginError, PredictorError
from kvprefetch.controlplane.base.types import (
    ArrivalForecast,
    EventKind,
    SessionEvent,
    SurvivalCurve,
    Trace,
    TraceRequest,
    TraceSession,
)
from kvprefetch.predictors import registry
from kvprefetch.predictors.adaptive import (
    BUCKETS,
    DEFAULT_ARTIFACT,
    GRID_S,
    PRIOR_WEIGHT,
    AdaptivePredictor,
    bucket_of,
    segment_of,
)
from kvprefetch.predictors.evaluate import (
    CALIBRATION_HORIZONS_S,
    CALIBRATION_SILENCES_S,
    ece_key,
    evaluate,
)
from kvprefetch.predictors.features import replay_session
from kvprefetch.predictors.hinted import HintedPredictor

# ------------------------------------------------------------------ SurvivalCurve by hand
#: S: 1 at 0, 0.5 at 10 s, 0.2 at 30 s, 0.2 beyond (20% never return).
CURVE = SurvivalCurve.from_knots(((0, 1.0), (10, 0.5), (30, 0.2)))


def _fc(curve: SurvivalCurve | None = CURVE, last: float = 100.0) -> ArrivalForecast:
    return ArrivalForecast("s", last, (1.0, 10.0, 30.0), 0.8, 30.0, 0.5, survival=curve)


def test_curve_values_and_integral_by_hand() -> None:
    assert CURVE.at(0) == 1.0 and CURVE.at(-5) == 1.0
    assert CURVE.at(5) == pytest.approx(0.75)
    assert CURVE.at(20) == pytest.approx(0.35)
    assert CURVE.at(30) == CURVE.at(1e9) == CURVE.p_never == 0.2
    # trapezoids: 0..10 -> 7.5, 10..30 -> 7.0, then 0.2 per second
    assert CURVE.integral(10) == pytest.approx(7.5)
    assert CURVE.integral(20) == pytest.approx(7.5 + 10 * (0.5 + 0.35) / 2)
    assert CURVE.integral(40) == pytest.approx(14.5 + 2.0)
    assert CURVE.knots == ((0.0, 1.0), (10.0, 0.5), (30.0, 0.2))


def test_p_within_is_exactly_conditioned_on_the_silence() -> None:
    f = _fc()
    assert f.p_within(10, 100.0) == pytest.approx(0.5)
    assert f.p_within(1e6, 100.0) == pytest.approx(0.8)  # 20% never return
    # silent 10 s: S(20)/S(10) = 0.7, so 0.3 within the next 10 s
    assert f.p_within(10, 110.0) == pytest.approx(1 - 0.35 / 0.5)
    assert f.p_within(100, 110.0) == pytest.approx(1 - 0.2 / 0.5)
    # past the last knot only never-returning mass is left
    assert f.p_within(600, 140.0) == 0.0
    assert f.p_within(0.0, 100.0) == 0.0
    # a forecast asked before the last finish counts no silence
    assert f.p_within(10, 50.0) == pytest.approx(0.5)


def test_expected_wait_by_hand() -> None:
    f = _fc()
    # E[min(T, 10)] from the finish = integral of S over [0, 10]
    assert f.expected_wait_s(100.0, 10.0) == pytest.approx(7.5)
    # silent 10 s, horizon 20 s: integral of S over [10, 30] / S(10) = 7.0 / 0.5
    assert f.expected_wait_s(110.0, 20.0) == pytest.approx(14.0)
    # silent past the last knot: never comes, wait the whole horizon
    assert f.expected_wait_s(200.0, 50.0) == pytest.approx(50.0)
    assert f.expected_wait_s(100.0, 0.0) == 0.0


def test_arrival_quantile_after_by_hand() -> None:
    f = _fc()
    # given it returns (80%): median at S = 0.2 + 0.5 * 0.8 = 0.6 -> gap 8 s
    assert f.arrival_quantile_after(0.5, 100.0) == pytest.approx(108.0)
    # silent 10 s: returning mass left 0.3; median at S = 0.35 -> gap 20 s
    assert f.arrival_quantile_after(0.5, 110.0) == pytest.approx(120.0)
    assert f.arrival_quantile_after(0.0, 110.0) == pytest.approx(110.0)
    assert f.arrival_quantile_after(1.0, 110.0) == math.inf
    assert f.arrival_quantile_after(0.5, 140.0) == math.inf  # nothing left to return


def test_a_certain_return_is_due_once_past_its_support() -> None:
    f = _fc(SurvivalCurve.from_knots(((0, 1.0), (10, 0.0))))
    assert f.p_within(1.0, 120.0) == 1.0
    assert f.expected_wait_s(120.0, 30.0) == 0.0


def test_forecasts_without_a_curve_are_unchanged() -> None:
    plain = _fc(None)
    # the parametric law of the knots, as before (tests/core/test_value.py covers it)
    assert plain.survival is None
    assert plain.p_within(10, 100.0) != pytest.approx(0.5)
    oracle = ArrivalForecast("s", 0.0, (50.0,) * 3, 1.0, 100.0, 1.0)
    assert oracle.p_within(10.0, 40.0) == 1.0 and oracle.p_within(5.0, 40.0) == 0.0


@pytest.mark.parametrize("knots", [
    ((0, 1.0),),
    ((1, 1.0), (2, 0.5)),
    ((0, 0.9), (2, 0.5)),
    ((0, 1.0), (2, 0.5), (2, 0.4)),
    ((0, 1.0), (2, 0.5), (3, 0.6)),
    ((0, 1.0), (2, -0.1)),
])
def test_bad_curves_are_refused(knots) -> None:
    with pytest.raises(ValueError):
        SurvivalCurve.from_knots(knots)


# ------------------------------------------------------------------ the adaptive model
def _trace(sessions: int, seed: int = 0, *, tool_rate: float = 1 / 5, end_rate: float = 1 / 120,
           stop_p: float = 0.1, stops: bool = True) -> Trace:
    """Gaps after tool_use ~ Exp(tool_rate), after end_turn ~ Exp(end_rate) (whole seconds);
    each response is the session's last with probability ``stop_p``."""
    rng = random.Random(seed)
    out = []
    for i in range(sessions):
        sid = f"s{i:04d}"
        reqs: list[TraceRequest] = []
        stop = "tool_use"
        while True:
            gap = None
            if reqs:
                rate = tool_rate if stop == "tool_use" else end_rate
                gap = float(math.floor(rng.expovariate(rate)))
            stop = "end_turn" if rng.random() < 0.3 else "tool_use"
            reqs.append(TraceRequest(sid, len(reqs), 0.0, 100, 10, gap_s=gap,
                                     stop_reason=stop if stops else None, api_time_s=1.0))
            if len(reqs) > 1 and rng.random() < stop_p:
                break
        out.append(TraceSession(sid, float(i), tuple(reqs)))
    return Trace("synthetic", tuple(out), "test")


@pytest.fixture(scope="module")
def fitted() -> AdaptivePredictor:
    return AdaptivePredictor().fit(_trace(400))


def _idle(model: AdaptivePredictor, session: TraceSession, turns: int) -> float:
    events = list(replay_session(session))[: 2 * turns]
    for ev in events:
        model.observe(ev)
    return events[-1].time_s


def test_fit_tabulates_buckets_and_records_the_groups(fitted) -> None:
    info = fitted.train_info
    assert info["groups"] == 400 and len(info["train_groups"]) == 400
    assert info["bucket_counts"]["tool_use|short"] > 100
    assert set(fitted.table) == set(BUCKETS)
    # after a tool call: whole seconds of Exp(1/5), so gap <= 3 is X < 4; 10% never return
    curve = fitted.curve_of("tool_use|short")
    assert 1 - curve.at(3.0) == pytest.approx(0.9 * (1 - math.exp(-4 / 5)), abs=0.04)
    assert curve.p_never == pytest.approx(0.1, abs=0.03)
    assert 1 - fitted.curve_of("end_turn|long").at(120.0) < 0.7


def test_forecast_carries_the_bucket_curve_conditioned_on_silence(fitted) -> None:
    model = AdaptivePredictor.load(fitted.save(Path(__import__("tempfile").mkdtemp()) / "a.kvp"))
    session = _trace(1, seed=5).sessions[0]
    finish = _idle(model, session, 1)
    fc = model.forecast(session.session_id, finish + 7.0)
    assert fc is not None and fc.survival is not None and fc.conditioned
    curve = fc.survival
    assert fc.p_within(20.0, finish + 7.0) == pytest.approx(
        (curve.at(7.0) - curve.at(27.0)) / curve.at(7.0))
    assert fc.p_return == pytest.approx(fc.p_within(60.0, finish + 7.0))
    assert fc.horizon_s == pytest.approx(67.0)
    q = fc.gap_quantiles_s
    assert 7.0 <= q[0] <= q[1] <= q[2]
    assert fc.last_finish_s + q[1] == pytest.approx(fc.arrival_quantile_after(0.5, finish + 7.0))
    assert model.forecast("unknown", 0.0) is None
    model.observe(SessionEvent(EventKind.REQUEST_STARTED, session.session_id, finish + 9.0))
    assert model.forecast(session.session_id, finish + 10.0) is None  # in flight
    model.forget(session.session_id)
    model.forget(session.session_id)


def test_closed_session_is_forecast_never_to_return(fitted) -> None:
    model = AdaptivePredictor.load(fitted.save(Path(__import__("tempfile").mkdtemp()) / "a.kvp"))
    session = _trace(1, seed=6).sessions[0]
    finish = _idle(model, session, 1)
    model.observe(SessionEvent(EventKind.SESSION_CLOSED, session.session_id, finish + 1))
    fc = model.forecast(session.session_id, finish + 2)
    assert fc is not None and fc.p_return == 0.0 and fc.p_within(1e6, finish + 2) == 0.0


def test_online_adaptation_moves_the_forecast_toward_observed_gaps(fitted, tmp_path) -> None:
    model = AdaptivePredictor.load(fitted.save(tmp_path / "a.kvp"))
    bucket = "tool_use|short"
    before = model.curve_of(bucket).p_within(0.0, 10.0)
    # this deployment's tools take 300 s
    t = 0.0
    for k in range(3 * int(PRIOR_WEIGHT)):
        sid = f"d{k}"
        for turn, gap in enumerate((None, 2.0, 300.0)):
            t += gap or 0.0
            model.observe(SessionEvent(EventKind.REQUEST_STARTED, sid, t, turn=turn))
            t += 1.0
            model.observe(SessionEvent(EventKind.REQUEST_FINISHED, sid, t, turn=turn,
                                       stop_reason="tool_use"))
        model.forget(sid)
    after = model.curve_of(bucket)
    assert before > 0.7
    assert after.p_within(0.0, 10.0) < 0.3
    # the never share stays the shipped one (no closes seen): all returning mass is by 310 s
    assert (1 - after.at(310.0)) / (1 - after.p_never) > 0.95
    # the shipped table is untouched: a reset (or a fresh load) gives it back
    model.reset_adaptation()
    assert model.curve_of(bucket).p_within(0.0, 10.0) == pytest.approx(before)


def test_never_share_adapts_only_from_closes(fitted, tmp_path) -> None:
    model = AdaptivePredictor.load(fitted.save(tmp_path / "a.kvp"))
    bucket = "end_turn|short"
    shipped = model.curve_of(bucket).p_never
    t = 0.0
    for k in range(400):
        sid = f"c{k}"
        for turn, gap in enumerate((None, 2.0)):
            t += gap or 0.0
            model.observe(SessionEvent(EventKind.REQUEST_STARTED, sid, t, turn=turn))
            t += 1.0
            model.observe(SessionEvent(EventKind.REQUEST_FINISHED, sid, t, turn=turn,
                                       stop_reason="tool_use" if turn == 0 else "end_turn"))
        model.observe(SessionEvent(EventKind.SESSION_CLOSED, sid, t + 1.0))
    # 400 closes against the prior's 200 pseudo-observations (10% never): ~ (400 + 20) / 600
    assert model.curve_of(bucket).p_never > max(0.6, shipped + 0.3)


def test_synthetic_known_law_gives_small_ece_and_last_gap_does_not() -> None:
    train, test = _trace(600, seed=1), _trace(400, seed=2)
    model = AdaptivePredictor().fit(train)
    ours = evaluate(model, test)
    base = evaluate(registry.create("last-gap"), test)
    keys = [ece_key(h, a) for h in CALIBRATION_HORIZONS_S for a in CALIBRATION_SILENCES_S]
    cells = {(c["h_s"], c["a_s"]): c for c in ours["calibration"]["cells"]}
    for (h, a), cell in cells.items():
        if cell["n"] >= 300:
            assert cell["ece"] < 0.04, (h, a, cell["n"], cell["ece"])
    assert max(base[k] for k in keys) > 0.15
    assert sum(ours[k] for k in keys) < 0.5 * sum(base[k] for k in keys)


def test_traces_without_stop_reasons_use_the_unknown_bucket(fitted, tmp_path) -> None:
    model = AdaptivePredictor.load(fitted.save(tmp_path / "a.kvp"))
    session = _trace(1, seed=7, stops=False).sessions[0]
    finish = _idle(model, session, 2)
    fc = model.forecast(session.session_id, finish)
    assert fc is not None and fc.survival is model.curve_of(bucket_of("unknown", 0.0))
    assert 0.0 < fc.survival.p_never < 1.0


def test_segments_and_grid() -> None:
    assert GRID_S[0] == 0.0 and GRID_S[-1] == 86400.0
    assert segment_of(GRID_S, 0.0) == 0 and segment_of(GRID_S, 1.0) == 0
    assert segment_of(GRID_S, 1.5) == 1
    assert segment_of(GRID_S, 86400.0) == len(GRID_S) - 2
    assert segment_of(GRID_S, 86400.5) is None


def test_forecast_many_matches_single_and_is_cheap(fitted, tmp_path) -> None:
    import time

    model = AdaptivePredictor.load(fitted.save(tmp_path / "a.kvp"))
    trace = _trace(300, seed=9)
    ids, nows = [], []
    for s in trace.sessions:
        ids.append(s.session_id)
        nows.append(_idle(model, s, 2) + 5.0)
    many = model.forecast_many(ids, nows)
    assert many == [model.forecast(sid, now) for sid, now in zip(ids, nows, strict=True)]
    t0 = time.perf_counter()
    for _ in range(3):
        model.forecast_many(ids, nows)
    per_call = (time.perf_counter() - t0) / (3 * len(ids))
    assert per_call < 2e-4  # well under a millisecond (CI machines are slow and shared)


# ------------------------------------------------------------------ artifacts and registry
def test_save_load_round_trip(fitted, tmp_path) -> None:
    path = fitted.save(tmp_path / "a.kvp")
    loaded = registry.load(f"adaptive:{path}")
    assert isinstance(loaded, AdaptivePredictor)
    assert registry.load_artifact(path).name == "adaptive"
    assert loaded.table == fitted.table and loaded.train_info == fitted.train_info
    for b in BUCKETS:
        assert loaded.curve_of(b) == AdaptivePredictor.load(path).curve_of(b)


def test_untrained_adaptive_is_refused_at_start_up() -> None:
    with pytest.raises(PluginError, match="must be trained first"):
        registry.load("adaptive")
    with pytest.raises(PredictorError, match="not trained"):
        AdaptivePredictor().forecast("s", 0.0)


def test_bad_artifacts_give_clear_errors(fitted, tmp_path) -> None:
    import hashlib
    import json

    from kvprefetch.predictors.artifacts import MAGIC

    good = fitted.save(tmp_path / "a.kvp").read_bytes()
    n = int.from_bytes(good[len(MAGIC):len(MAGIC) + 8], "little")
    header = json.loads(good[len(MAGIC) + 8:len(MAGIC) + 8 + n])

    def rewrite(payload: bytes, name: str) -> Path:
        h = dict(header, payload_sha256=hashlib.sha256(payload).hexdigest(),
                 payload_bytes=len(payload))
        blob = json.dumps(h).encode()
        p = tmp_path / name
        p.write_bytes(MAGIC + len(blob).to_bytes(8, "little") + blob + payload)
        return p

    with pytest.raises(PredictorError, match="corrupt 'adaptive' payload"):
        AdaptivePredictor.load(rewrite(b"{not json", "bad.kvp"))
    with pytest.raises(PredictorError, match="payload version"):
        AdaptivePredictor.load(rewrite(json.dumps({"version": 99}).encode(), "v.kvp"))
    truncated = tmp_path / "t.kvp"
    truncated.write_bytes(good[:-10])
    with pytest.raises(PredictorError, match="checksum"):
        AdaptivePredictor.load(truncated)
    with pytest.raises(PredictorError, match="holds a 'adaptive' model"):
        registry.load(f"gbm:{fitted.save(tmp_path / 'x.kvp')}")


def test_too_small_a_trace_is_refused() -> None:
    with pytest.raises(PredictorError, match="too small"):
        AdaptivePredictor().fit(_trace(2, stop_p=1.0))


def test_shipped_default_loads_fitted_with_its_train_groups() -> None:
    assert DEFAULT_ARTIFACT.is_file()
    hinted = registry.load("default")
    assert isinstance(hinted, HintedPredictor) and hinted.fitted  # the shipped model, with hints
    model = hinted.inner
    assert isinstance(model, AdaptivePredictor) and model.fitted
    assert hinted.train_info == model.train_info
    info = model.train_info
    assert info["groups"] == len(info["train_groups"]) > 100
    assert info["gaps"] > 5000
    other = registry.load("default")
    assert other is not model  # a fresh instance each time: online state is not shared
    # it forecasts for a stop-reason-less session too
    session = _trace(1, stops=False).sessions[0]
    finish = _idle(model, session, 2)
    fc = model.forecast(session.session_id, finish)
    assert fc is not None and fc.survival is not None


@pytest.mark.slow  # loads the whole shared Claude Code set
def test_shipped_default_never_saw_the_held_out_half() -> None:
    """``kvprefetch sim --test-split 0.5`` (split seed 0) accepts it: no overlap."""
    from kvprefetch.controlplane.cli.sim import held_out

    traces = Path(__file__).resolve().parents[3] / "shared" / "traces" / "claude-code"
    if not traces.is_dir():
        pytest.skip("shared Claude Code traces not present")
    from kvprefetch.controlplane.traces import load_trace

    trace = load_trace(traces)
    test = held_out(trace, 0.5, 0, "default")
    groups = {s.parent_id or s.session_id for s in test.sessions}
    seen = set(registry.load("default").train_info["train_groups"])
    assert groups and not groups & seen
