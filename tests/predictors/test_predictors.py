"""Predictors: models, registry, artifacts, splits, evaluation (tiny synthetic traces)."""

from __future__ import annotations

import gzip
import json
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvprefetch.controlplane.base.config import default_fleet
from kvprefetch.controlplane.base.errors import PluginError, PredictorError
from kvprefetch.controlplane.base.types import (
    EventKind,
    HintKind,
    SessionEvent,
    Trace,
    TraceRequest,
    TraceSession,
)
from kvprefetch.predictors import registry
from kvprefetch.predictors.evaluate import benchmark, evaluate, roc_auc
from kvprefetch.predictors.features import (
    N_FEATURES,
    SEQUENCE_LENGTH,
    FeatureTracker,
    build_dataset,
    replay_session,
)
from kvprefetch.predictors.hinted import HintedPredictor
from kvprefetch.predictors.splits import split_trace

TRAINABLE = ["empirical", "survival", "gbm", "torch-seq"]
METRIC_KEYS = {"gaps", "mae_log_gap", "pinball_q10", "pinball_q50", "pinball_q90",
               "coverage_80", "auc_return_60s"}


def make_trace(n_sessions: int = 36, seed: int = 0, children: bool = True) -> Trace:
    """Tool calls come back in seconds, ends of turns in minutes; some sessions are slow."""
    rng = np.random.default_rng(seed)
    sessions = []
    for i in range(n_sessions):
        sid = f"s{i:03d}"
        slow = 3.0 if i % 4 == 0 else 1.0
        reqs = []
        offset = 0.0
        for turn in range(int(rng.integers(6, 24))):
            stop = "end_turn" if rng.random() < 0.2 else "tool_use"
            gap = None
            if turn:
                prev = reqs[-1].stop_reason
                gap = float(rng.lognormal(math.log(5 * slow if prev == "tool_use" else 200), 0.6))
            api = float(rng.uniform(1, 10))
            offset += (gap or 0.0) + api
            reqs.append(TraceRequest(sid, turn, offset, 1000 + 500 * turn,
                                     int(rng.integers(50, 900)), gap_s=gap, stop_reason=stop,
                                     api_time_s=api))
        sessions.append(TraceSession(sid, float(i * 30), tuple(reqs)))
        if children and i % 6 == 0:
            cid = f"{sid}/agent"
            kid = tuple(TraceRequest(cid, t, 5.0 * t, 800, 100, gap_s=(2.0 if t else None),
                                     stop_reason="tool_use", api_time_s=1.0) for t in range(4))
            sessions.append(TraceSession(cid, float(i * 30 + 5), kid, parent_id=sid))
    sessions.sort(key=lambda s: (s.start_s, s.session_id))
    return Trace("synthetic", tuple(sessions), "test")


@pytest.fixture(scope="module")
def trace() -> Trace:
    return make_trace()


@pytest.fixture(scope="module")
def trained(trace: Trace) -> dict[str, object]:
    out = {}
    for name in TRAINABLE:
        model = registry.create(name)
        model.fit(trace, seed=0)  # type: ignore[attr-defined]
        out[name] = model
    return out


def idle_sessions(model, trace: Trace) -> tuple[list[str], list[float]]:
    """Replay the first half of each session into ``model``; ids and last finish times."""
    ids, finishes = [], []
    for s in trace.sessions:
        events = list(replay_session(s))
        cut = 2 * max(1, len(s.requests) // 2)
        for ev in events[:cut]:
            model.observe(ev)
        ids.append(s.session_id)
        finishes.append(events[cut - 1].time_s)
    return ids, finishes


# -- models -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TRAINABLE)
def test_model_forecasts_are_monotone_and_probabilities_bounded(trained, trace, name):
    model = trained[name]
    ids, finishes = idle_sessions(model, trace)
    for delay in (0.0, 30.0, 5000.0):
        forecasts = model.forecast_many(ids, [f + delay for f in finishes])
        assert all(fc is not None for fc in forecasts)
        for fc in forecasts:
            q = fc.gap_quantiles_s
            assert len(q) == 3 and q[0] <= q[1] <= q[2] and q[0] >= 0
            assert all(math.isfinite(v) for v in q)
            assert 0.0 <= fc.p_return <= 1.0 and 0.0 <= fc.confidence <= 1.0
            assert q[0] >= delay - 1e-6  # conditional on silence so far
    single = model.forecast(ids[0], finishes[0])
    assert single == model.forecast_many(ids[:1], finishes[0])[0]
    assert model.forecast("unknown", 0.0) is None
    for sid in ids:
        model.forget(sid)
        model.forget(sid)  # idempotent


@pytest.mark.parametrize("name", TRAINABLE)
def test_cached_model_outputs_give_the_same_forecasts_later(trained, trace, name):
    """Model outputs are cached per session until its next event; conditioning on the
    time elapsed must still be the model's own, whatever was cached before."""
    model = trained[name]
    ids, finishes = idle_sessions(model, trace)
    try:
        model.forecast_many(ids, finishes)  # fills the cache at each response end
        later = [f + 45.0 for f in finishes]
        warm = model.forecast_many(ids, later)
        model.clear_cache()
        cold = model.forecast_many(ids, later)
        assert warm == cold
        if name == "survival":  # exact conditioning on its own survival curves
            rows = model._tracker.rows([model._tracker.ready(sid) for sid in ids])
            elapsed = np.array(later) - np.array(finishes)
            q, p, _, _ = model._condition(model.survival_curves(rows), elapsed)
            assert np.allclose([fc.gap_quantiles_s for fc in warm], q, rtol=1e-12)
            assert np.allclose([fc.p_return for fc in warm], p, rtol=1e-12)
    finally:
        for sid in ids:
            model.forget(sid)


@pytest.mark.parametrize("name", TRAINABLE)
def test_save_load_round_trip_gives_identical_forecasts(trained, trace, tmp_path, name):
    model = trained[name]
    path = model.save(tmp_path / f"{name}.kvp")
    loaded = registry.load(f"{name}:{path}")
    assert type(loaded) is type(model)
    assert registry.load_artifact(path).name == name
    ids, finishes = idle_sessions(model, trace)
    idle_sessions(loaded, trace)
    assert model.forecast_many(ids, finishes) == loaded.forecast_many(ids, finishes)


def test_learned_models_beat_the_last_gap_heuristic(trained, trace):
    split = split_trace(trace, "session", 0.3, seed=1)
    base = evaluate(registry.create("last-gap"), split.test)
    gbm = registry.create("gbm")
    gbm.fit(split.train, seed=0)  # type: ignore[attr-defined]
    m = evaluate(gbm, split.test)
    assert set(m) >= METRIC_KEYS and m["gaps"] == base["gaps"] > 0
    assert m["mean_pinball_log"] < base["mean_pinball_log"]
    assert m["auc_return_60s"] > 0.6


def test_training_is_deterministic(trace):
    a = registry.create("torch-seq").fit(trace, seed=3)  # type: ignore[attr-defined]
    b = registry.create("torch-seq").fit(trace, seed=3)  # type: ignore[attr-defined]
    ids, fin = idle_sessions(a, trace)
    idle_sessions(b, trace)
    assert a.forecast_many(ids, fin) == b.forecast_many(ids, fin)


def test_untrained_model_is_refused_by_load_but_created_for_training():
    with pytest.raises(PluginError, match="must be trained first"):
        registry.load("gbm")
    assert not registry.create("gbm").fitted  # type: ignore[attr-defined]


# -- features -----------------------------------------------------------------------------------


def test_live_features_equal_training_features(trace):
    ds = build_dataset(trace)
    seq, valid = ds.windows(SEQUENCE_LENGTH)
    tracker = FeatureTracker()
    i = 0
    for s in trace.sessions:
        for ev in replay_session(s):
            tracker.observe(ev)
            if ev.kind is EventKind.REQUEST_FINISHED:
                st = tracker.ready(s.session_id)
                assert st is not None and st.row == ds.x[i].tolist()
                hist = np.array(list(st.history))
                assert np.array_equal(seq[i][valid[i]], hist)
                i += 1
    assert i == len(ds) and ds.x.shape[1] == N_FEATURES
    # one "never returned" example per session, the rest are inter-request gaps
    assert (~ds.returned).sum() == len(trace.sessions)


def test_features_never_see_the_future(trace):
    """Changing a future gap must not change any row up to the response before it."""
    s = trace.sessions[0]
    k = len(s.requests) - 1
    last = TraceRequest(s.session_id, k, s.requests[k].offset_s, 1, 1, gap_s=9999.0,
                        stop_reason="end_turn", api_time_s=1.0)
    altered = (*s.requests[:k], last)
    a = build_dataset([s]).x[:k]
    b = build_dataset([TraceSession(s.session_id, s.start_s, altered)]).x[:k]
    assert np.array_equal(a, b)


# -- splits -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["session", "time"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_split_leaks_a_session(trace, kind, seed):
    split = split_trace(trace, kind, 0.3, seed)
    train = {s.session_id for s in split.train.sessions}
    test = {s.session_id for s in split.test.sessions}
    assert train and test and not train & test
    assert train | test == {s.session_id for s in trace.sessions}
    groups = lambda t: {s.parent_id or s.session_id for s in t.sessions}  # noqa: E731
    assert not groups(split.train) & groups(split.test)  # children stay with their parent
    if kind == "time":
        assert max(s.start_s for s in split.train.sessions if not s.parent_id) <= min(
            s.start_s for s in split.test.sessions if not s.parent_id)
    assert split_trace(trace, kind, 0.3, seed) == split


# -- bad input ------------------------------------------------------------------------------------


def test_too_small_trace_is_refused():
    tiny = make_trace(n_sessions=1, children=False)
    for name in TRAINABLE:
        with pytest.raises(PredictorError, match="too small to train"):
            registry.create(name).fit(tiny)  # type: ignore[attr-defined]


def _rewrite_header(path: Path, out: Path, **changes) -> Path:
    data = path.read_bytes()
    n = int.from_bytes(data[12:20], "little")
    header = json.loads(data[20 : 20 + n])
    header.update(changes)
    blob = json.dumps(header).encode()
    out.write_bytes(data[:12] + len(blob).to_bytes(8, "little") + blob + data[20 + n :])
    return out


def test_bad_artifacts_are_named(trained, tmp_path):
    good = trained["gbm"].save(tmp_path / "gbm.kvp")
    data = good.read_bytes()
    (tmp_path / "flip.kvp").write_bytes(data[:-10] + bytes(b ^ 0xFF for b in data[-10:]))
    (tmp_path / "cut.kvp").write_bytes(data[:15])
    (tmp_path / "junk.kvp").write_bytes(b"not a model")
    cases = {
        tmp_path / "flip.kvp": "corrupt: payload checksum",
        tmp_path / "cut.kvp": "corrupt: truncated",
        tmp_path / "junk.kvp": "bad magic",
        tmp_path / "missing.kvp": "cannot read",
        _rewrite_header(good, tmp_path / "v.kvp", format_version=99): "format version 99",
        _rewrite_header(good, tmp_path / "s.kvp", feature_schema_version=0): "feature schema",
        _rewrite_header(good, tmp_path / "f.kvp",
                        feature_names=["stop_tool_use", "made_up"]): "feature mismatch",
    }
    for path, message in cases.items():
        with pytest.raises(PredictorError, match=message) as err:
            registry.load(f"gbm:{path}")
        assert str(path) in str(err.value)
    with pytest.raises(PredictorError, match="holds a 'gbm' model, not 'survival'"):
        registry.load(f"survival:{good}")


def test_artifact_is_written_atomically(trained, tmp_path):
    path = trained["survival"].save(tmp_path / "sub" / "m.kvp")
    assert [p.name for p in path.parent.iterdir()] == ["m.kvp"]


# -- registry -------------------------------------------------------------------------------------


def test_registry_errors():
    with pytest.raises(PluginError, match=r"unknown predictor 'nope'.*known:.*gbm"):
        registry.load("nope")
    with pytest.raises(PluginError, match="cannot import module"):
        registry.load("no_such_module_xyz:Thing")
    with pytest.raises(PluginError, match="has no attribute"):
        registry.load("kvprefetch.predictors.heuristics:Missing")
    with pytest.raises(PluginError, match="does not implement the Predictor protocol"):
        registry.load("collections:OrderedDict")
    with pytest.raises(PluginError, match="takes no artifact"):
        registry.load("last-gap:file.kvp")


def test_example_user_predictor_loads_by_module_class(trace):
    model = registry.load("examples.custom_predictor:StopAwarePredictor")
    m = evaluate(model, trace)
    assert set(m) >= METRIC_KEYS and 0.0 <= m["coverage_80"] <= 1.0


def test_entry_point_plugin(tmp_path, monkeypatch):
    """A plugin installed as a distribution with a ``kvprefetch.predictors`` entry point."""
    (tmp_path / "kvp_test_plugin.py").write_text(textwrap.dedent("""
        from kvprefetch.predictors.heuristics import LastGapPredictor
        class Plugged(LastGapPredictor):
            name = "plugged"
    """))
    dist = tmp_path / "kvp_test_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvp-test-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[kvprefetch.predictors]\nplugged = kvp_test_plugin:Plugged\nbroken = kvp_nope:X\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "plugged" in registry.available()
    assert registry.load("plugged").name == "plugged"
    with pytest.raises(PluginError, match="entry point 'broken' failed to load"):
        registry.load("broken")


# -- hints --------------------------------------------------------------------------------------


def test_hinted_folds_in_hints(trained, trace):
    model = HintedPredictor(trained["empirical"])  # type: ignore[arg-type]
    ids, fin = idle_sessions(model, trace)
    sid, t = ids[0], fin[0]
    base = model.forecast(sid, t)
    assert base == trained["empirical"].forecast(sid, t) and base is not None
    assert not base.hinted
    model.observe(SessionEvent(EventKind.HINT, sid, t + 1, hint=HintKind.TOOL_RUNNING, eta_s=20))
    fc = model.forecast(sid, t + 1)
    assert fc is not None and fc.hinted  # the client's word, not the history's
    # The gap is log-normal around hint + ETA (21 s from the finish), conditioned on the
    # silence: its median stays at ~21 s (1 s of silence removes almost no mass).
    assert fc is not None and fc.conditioned and fc.gap_quantiles_s[1] == pytest.approx(21.0,
                                                                                        rel=1e-3)
    assert fc.p_return > 0.9
    # Past the ETA the session is due soon, and less so the longer it stays silent.
    silences = (30.0, 60.0, 240.0)
    due = [model.forecast(sid, t + a) for a in silences]
    assert all(f is not None for f in due)
    medians = [f.arrival_at(0.5) - (t + a)  # type: ignore[union-attr]
               for f, a in zip(due, silences, strict=True)]
    assert 0 < medians[0] < medians[1] < medians[2]
    assert due[0].p_return > due[2].p_return  # type: ignore[union-attr]
    # A far ETA still says the session comes back: p_return spans what is left of the
    # hint's law, not the wrapped model's 60 s horizon (a return within 60 s of a 600 s
    # ETA is unlikely; within the law, as likely as any hinted return).
    model.observe(SessionEvent(EventKind.HINT, sid, t + 1, hint=HintKind.TOOL_RUNNING,
                               eta_s=600))
    far = model.forecast(sid, t + 1)
    assert far is not None and far.p_return > 0.9 and far.horizon_s > 600.0
    assert far.arrival_at(0.1) - (t + 1) > 200.0  # and it is timed by the law's q10
    model.observe(SessionEvent(EventKind.HINT, sid, t + 2, hint=HintKind.USER_TYPING))
    fc = model.forecast(sid, t + 2)
    # Typing time is the message over the typing speed: minutes for a Claude Code prompt;
    # too vague to count as a sharp forecast (below planner.displace_min_confidence).
    assert fc is not None and fc.conditioned
    assert fc.gap_quantiles_s[0] <= fc.gap_quantiles_s[1] == pytest.approx(2 + 70, rel=0.03)
    assert fc.confidence < default_fleet("8b", 1).planner.displace_min_confidence
    model.observe(SessionEvent(EventKind.HINT, sid, t + 3, hint=HintKind.SESSION_CLOSED))
    assert model.forecast(sid, t + 3).p_return == 0.0  # type: ignore[union-attr]
    plain = registry.load("hinted")
    assert plain.name == "hinted"


def test_the_typing_law_is_learned_from_the_waits_the_traffic_shows():
    model = HintedPredictor(registry.load("last-gap"))

    def typed(sid: str, t: float, wait_s: float, *, eta_s: float | None = None) -> None:
        """sid finishes at t, its user starts typing 1 s later, and it sends wait_s on."""
        model.observe(SessionEvent(EventKind.REQUEST_STARTED, sid, t - 5.0, input_tokens=100))
        model.observe(SessionEvent(EventKind.REQUEST_FINISHED, sid, t, input_tokens=100))
        model.observe(SessionEvent(EventKind.HINT, sid, t + 1.0, hint=HintKind.USER_TYPING,
                                   eta_s=eta_s))
        if wait_s > 0:
            model.observe(SessionEvent(EventKind.REQUEST_STARTED, sid, t + 1.0 + wait_s,
                                       input_tokens=200))

    def typing_median(t: float) -> float:
        model.observe(SessionEvent(EventKind.REQUEST_FINISHED, "probe", t, input_tokens=100))
        model.observe(SessionEvent(EventKind.HINT, "probe", t, hint=HintKind.USER_TYPING))
        fc = model.forecast("probe", t)
        assert fc is not None and fc.hinted
        model.forget("probe")
        return fc.gap_at(0.5)

    # The prior until 32 waits are in: a typing spell of a Claude Code prompt (70 s).
    for i in range(31):
        typed(f"s{i}", 1000.0 * i, 200.0 + i)
    typed("eta", 40_000.0, 5.0, eta_s=5.0)  # a hint with an ETA is not a typing wait
    typed("gone", 41_000.0, 0.0)  # nor one no request follows
    assert model.typing.samples == 31
    assert typing_median(50_000.0) == pytest.approx(70.0, rel=0.03)
    # Then the law of the waits seen: their median (216 s), their spread (here the floor).
    typed("s31", 60_000.0, 231.0)
    assert model.typing.samples == 32
    assert typing_median(70_000.0) == pytest.approx(216.0, rel=0.03)
    median_s, sigma = model.typing.law()
    assert median_s == 216.0 and sigma == 0.1


# -- evaluation and timing ---------------------------------------------------------------------


def test_roc_auc():
    assert roc_auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])) == 0.75
    assert roc_auc(np.array([0, 1]), np.array([0.5, 0.5])) == 0.5
    assert math.isnan(roc_auc(np.array([1, 1]), np.array([0.1, 0.2])))


def test_forecast_cost(trained, trace):
    """Generous bounds (shared CI machines); the README reports measured figures."""
    heur = benchmark(registry.load("last-gap"), trace, sessions=2000, single_calls=500)
    assert heur["single_us"] < 1000
    surv = benchmark(trained["survival"], trace, sessions=2000,  # type: ignore[arg-type]
                     single_calls=200)
    assert surv["single_us"] < 5000
    gbm = benchmark(trained["gbm"], trace, sessions=10_000,  # type: ignore[arg-type]
                    single_calls=20)
    assert gbm["sessions"] == 10_000 and gbm["batch_ms"] < 2000


def _write_claude_code(folder: Path, trace: Trace) -> None:
    folder.mkdir()
    for k, s in enumerate(s for s in trace.sessions if not s.parent_id):
        t, reqs = 0.0, []
        for r in s.requests:
            t += r.gap_s or 0.0
            reqs.append({"t": t, "type": "n", "model": "m", "in": r.input_tokens,
                         "out": r.output_tokens, "hash_ids": [1, 2], "stop": r.stop_reason,
                         "api_time": r.api_time_s, "think_time": r.gap_s or 0.0})
            t += r.api_time_s or 0.0
        body = {"id": f"trace_{k:04d}", "block_size": 64, "requests": reqs}
        with gzip.open(folder / f"trace_{k:04d}.json.gz", "wt") as fh:
            json.dump(body, fh)


def test_train_and_eval_cli(trace, tmp_path):
    from kvprefetch.controlplane.cli import main

    folder = tmp_path / "cc"
    _write_claude_code(folder, trace)
    art = tmp_path / "gbm.kvp"
    assert main(["train", "--trace", str(folder), "--predictor", "gbm", "--out", str(art),
                 "--no-progress"]) == 0
    out = tmp_path / "eval.json"
    assert main(["eval-predictor", "--trace", str(folder), "--predictor", f"gbm:{art}",
                 "survival", "--json", str(out), "--no-progress"]) == 0
    result = json.loads(out.read_text())["predictors"]
    assert set(result) == {"last-gap", "empirical", f"gbm:{art}", "survival"}
    for metrics in result.values():
        assert set(metrics) >= METRIC_KEYS and isinstance(metrics["gaps"], int)
    assert main(["train", "--trace", str(folder), "--predictor", "last-gap", "--out",
                 str(tmp_path / "x.kvp"), "--no-progress"]) == 2
