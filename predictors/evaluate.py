"""Scoring predictors on a trace, through the public protocol only.

Every session of the trace is replayed as events
(:func:`~kvprefetch.predictors.features.replay_session`)
into the predictor; right after each response ends the predictor is asked for its forecast
(``forecast_many`` when it has one: sessions are advanced in lockstep, one response each per
round, so one batched call serves a round). The forecast is compared with what happened: the
next request's gap, or "never returned" after a session's last response.

Metrics (per predictor):

* ``gaps``: inter-request gaps scored (responses followed by a request).
* ``mae_log_gap``: mean |log1p(q50) - log1p(gap)|.
* ``pinball_q10/q50/q90``: mean pinball loss of each quantile, in seconds;
  ``pinball_log_q*`` the same on log1p(seconds) (robust to the heavy tail); ``mean_pinball``
  and ``mean_pinball_log`` their averages over the three levels.
* ``coverage_80``: share of gaps inside [q10, q90].
* ``auc_return_60s``: ROC AUC of P(return within 60 s) (from
  :func:`~kvprefetch.predictors.distribution.prob_return_within`) over every response, the
  never-returned last responses included.
* ``calibration``: how well P(return within ``h`` | silent for ``a``) matches the outcomes,
  for ``h`` in :data:`CALIBRATION_HORIZONS_S` and ``a`` in :data:`CALIBRATION_SILENCES_S`
  (see :func:`calibration`); ``ece_h{h}_a{a}`` the expected calibration error of each cell.

Calibration replay: each idle period (a response end followed by the session's next request,
or by none) is looked at again ``a`` seconds after the response ended, if the session has not
sent its next request before then (``gap >= a``; ``a = 0`` takes every idle period). The
predictor is asked ``forecast(session, last_finish + a)``; it has then seen exactly the
session's events up to that time, since the replay carries no hints and the next event is
that next request. Its ``p_within(h, last_finish + a)`` is compared with the outcome "the next
request came within ``h`` of that time" (``gap <= a + h``; never for a session that did not
return).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvprefetch.controlplane.base.types import FORECAST_LEVELS, ArrivalForecast, SessionEvent, Trace
from kvprefetch.predictors.base import Predictor
from kvprefetch.predictors.distribution import prob_return_within
from kvprefetch.predictors.features import replay_session

RETURN_WITHIN_S = 60.0

#: Horizons ``h`` (seconds) of the calibration of P(return within h | silent for a).
CALIBRATION_HORIZONS_S: tuple[float, ...] = (10.0, 60.0, 600.0)
#: Silences ``a`` (seconds since the response ended) at which the forecast is asked for.
CALIBRATION_SILENCES_S: tuple[float, ...] = (0.0, 30.0, 120.0, 600.0)
#: Equal-width probability bins of the expected calibration error.
CALIBRATION_BINS = 10


@dataclass(frozen=True)
class CalibrationTable:
    """One row per response (as in :class:`ForecastTable`), one column per silence ``a``,
    one slice per horizon ``h``: the forecast probability and the outcome."""

    horizons_s: tuple[float, ...]
    silences_s: tuple[float, ...]
    #: (n, A): the session was still silent ``a`` seconds after the response ended.
    silent: np.ndarray
    #: (n, A, H): ``p_within(h, last_finish + a)``; NaN where not silent or no forecast.
    p: np.ndarray
    #: (n, A, H): the next request came within ``h`` of ``last_finish + a``.
    arrived: np.ndarray


@dataclass(frozen=True)
class ForecastTable:
    """One row per response: the forecast made at its end and the gap that followed."""

    quantiles_s: np.ndarray  # (n, 3); NaN where the predictor gave no forecast
    p_within: np.ndarray  # (n,) P(return within RETURN_WITHIN_S)
    gap_s: np.ndarray  # (n,) inf = never returned
    seconds: float  # wall time spent in observe/forecast at the response ends
    calibration: CalibrationTable | None = None


def collect_forecasts(
    predictor: Predictor,
    trace: Trace,
    *,
    horizons_s: Sequence[float] = CALIBRATION_HORIZONS_S,
    silences_s: Sequence[float] = CALIBRATION_SILENCES_S,
) -> ForecastTable:
    """Replay ``trace`` into ``predictor`` and record its forecast after every response, and
    the calibration forecasts ``silences_s`` later (none when ``silences_s`` is empty)."""
    scripts = [list(replay_session(s)) for s in trace.sessions]
    many = getattr(predictor, "forecast_many", None)
    quantiles: list[Sequence[float]] = []
    p_within: list[float] = []
    gaps: list[float] = []
    cal_p: list[np.ndarray] = []
    horizons, silences = tuple(map(float, horizons_s)), tuple(map(float, silences_s))
    nan3 = (math.nan,) * len(FORECAST_LEVELS)
    spent = 0.0
    rounds = max((len(s) // 2 for s in scripts), default=0)
    for k in range(rounds):
        ids: list[str] = []
        nows: list[float] = []
        nexts: list[float] = []
        t0 = time.perf_counter()
        for events in scripts:
            if 2 * k + 1 >= len(events):
                continue
            started, finished = events[2 * k], events[2 * k + 1]
            predictor.observe(started)
            predictor.observe(finished)
            ids.append(finished.session_id)
            nows.append(finished.time_s)
            nexts.append(
                events[2 * k + 2].time_s - finished.time_s if 2 * k + 2 < len(events)
                else math.inf
            )
        forecasts = _forecasts(predictor, many, ids, nows)
        spent += time.perf_counter() - t0
        if silences:
            cal_p.append(_calibration_round(predictor, many, ids, nows, nexts, forecasts,
                                            horizons, silences))
        for fc, gap in zip(forecasts, nexts, strict=True):
            gaps.append(gap)
            if fc is None:
                quantiles.append(nan3)
                p_within.append(math.nan)
            else:
                quantiles.append(fc.gap_quantiles_s)
                p_within.append(prob_return_within(fc, RETURN_WITHIN_S))
    for s in trace.sessions:
        predictor.forget(s.session_id)
    gap_arr = np.asarray(gaps, dtype=np.float64)
    calibration = None
    if silences:
        a = np.asarray(silences)
        h = np.asarray(horizons)
        calibration = CalibrationTable(
            horizons, silences, gap_arr[:, None] >= a[None, :],
            np.concatenate(cal_p).reshape(len(gaps), len(silences), len(horizons)) if cal_p
            else np.empty((0, len(silences), len(horizons))),
            gap_arr[:, None, None] <= a[None, :, None] + h[None, None, :],
        )
    return ForecastTable(
        np.asarray(quantiles, dtype=np.float64).reshape(len(gaps), len(FORECAST_LEVELS)),
        np.asarray(p_within, dtype=np.float64), gap_arr, spent, calibration,
    )


def _forecasts(
    predictor: Predictor, many: Any, ids: Sequence[str], nows: Sequence[float]
) -> list[ArrivalForecast | None]:
    """One forecast per (session, now): one batched call when the predictor has one."""
    if not ids:
        return []
    if many is not None:
        return list(many(list(ids), list(nows)))
    return [predictor.forecast(sid, now) for sid, now in zip(ids, nows, strict=True)]


def _calibration_round(
    predictor: Predictor,
    many: Any,
    ids: Sequence[str],
    finishes: Sequence[float],
    gaps: Sequence[float],
    at_finish: Sequence[ArrivalForecast | None],
    horizons: tuple[float, ...],
    silences: tuple[float, ...],
) -> np.ndarray:
    """(n, A, H) of ``p_within(h, finish + a)`` for one round's idle sessions; NaN where the
    session was no longer silent at ``finish + a`` or the predictor gave no forecast. The
    forecasts at ``a = 0`` are the round's own (same session, same time)."""
    out = np.full((len(ids), len(silences), len(horizons)), math.nan)
    for j, a in enumerate(silences):
        rows = [i for i, gap in enumerate(gaps) if gap >= a]
        if a == 0.0:
            fcs = [at_finish[i] for i in rows]
        else:
            fcs = _forecasts(predictor, many, [ids[i] for i in rows],
                             [finishes[i] + a for i in rows])
        for i, fc in zip(rows, fcs, strict=True):
            if fc is not None:
                now = finishes[i] + a
                out[i, j, :] = [fc.p_within(h, now) for h in horizons]
    return out


def pinball(y: np.ndarray, q: np.ndarray, level: float) -> float:
    d = y - q
    return float(np.mean(np.maximum(level * d, (level - 1.0) * d))) if len(y) else math.nan


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC by ranks (ties share their mean rank); NaN without both classes."""
    labels = labels.astype(bool)
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        return math.nan
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores))
    i = 0
    while i < len(scores):
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def score(table: ForecastTable) -> dict[str, Any]:
    """The metrics of the module docstring from a :class:`ForecastTable`."""
    have = ~np.isnan(table.quantiles_s).any(axis=1)
    returned = np.isfinite(table.gap_s) & have
    y = table.gap_s[returned]
    q = table.quantiles_s[returned]
    out: dict[str, Any] = {"gaps": int(returned.sum())}
    out["mae_log_gap"] = float(np.mean(np.abs(np.log1p(q[:, 1]) - np.log1p(y)))) if len(y) else (
        math.nan
    )
    for j, level in enumerate(FORECAST_LEVELS):
        out[f"pinball_q{round(level * 100)}"] = pinball(y, q[:, j], level)
    for j, level in enumerate(FORECAST_LEVELS):
        out[f"pinball_log_q{round(level * 100)}"] = pinball(
            np.log1p(y), np.log1p(np.maximum(q[:, j], 0.0)), level
        )
    out["coverage_80"] = float(np.mean((y >= q[:, 0]) & (y <= q[:, 2]))) if len(y) else math.nan
    labels = (table.gap_s <= RETURN_WITHIN_S)[have]
    out["auc_return_60s"] = roc_auc(labels, np.nan_to_num(table.p_within[have], nan=0.0))
    levels = [round(lv * 100) for lv in FORECAST_LEVELS]
    out["mean_pinball"] = float(np.mean([out[f"pinball_q{lv}"] for lv in levels]))
    out["mean_pinball_log"] = float(np.mean([out[f"pinball_log_q{lv}"] for lv in levels]))
    out["responses"] = len(table.gap_s)
    out["missing_forecasts"] = int((~have).sum())
    out["forecast_seconds"] = round(table.seconds, 4)
    if table.calibration is not None:
        cal = calibration(table.calibration)
        for cell in cal["cells"]:
            out[ece_key(cell["h_s"], cell["a_s"])] = cell["ece"]
        out["calibration"] = cal
    return out


def evaluate(predictor: Predictor, trace: Trace, *, calibrate: bool = True) -> dict[str, Any]:
    """Score ``predictor`` on every response of ``trace`` (see the module docstring);
    ``calibrate=False`` skips the calibration forecasts (and the ``calibration`` metrics)."""
    table = collect_forecasts(predictor, trace,
                              silences_s=CALIBRATION_SILENCES_S if calibrate else ())
    return score(table)


# ---------------------------------------------------------------------------------------------
# Calibration.
# ---------------------------------------------------------------------------------------------


def expected_calibration_error(
    p: np.ndarray, outcome: np.ndarray, bins: int = CALIBRATION_BINS
) -> tuple[float, list[dict[str, float]]]:
    """ECE of probabilities ``p`` against boolean outcomes over ``bins`` equal-width bins of
    [0, 1] (1.0 falls in the last): the count-weighted mean of |mean p - observed rate| over
    the bins. Returns it (NaN for no data) and the reliability bins (``lo``, ``hi``, ``n``,
    ``mean_p``, ``observed``; the last two NaN in empty bins)."""
    p = np.clip(np.asarray(p, dtype=np.float64), 0.0, 1.0)
    y = np.asarray(outcome, dtype=np.float64)
    idx = np.minimum((p * bins).astype(np.int64), bins - 1)
    ece = 0.0
    table: list[dict[str, float]] = []
    for b in range(bins):
        sel = idx == b
        n = int(sel.sum())
        mean_p = float(p[sel].mean()) if n else math.nan
        observed = float(y[sel].mean()) if n else math.nan
        if n:
            ece += n * abs(mean_p - observed)
        table.append({"lo": b / bins, "hi": (b + 1) / bins, "n": n, "mean_p": mean_p,
                      "observed": observed})
    return (ece / len(p) if len(p) else math.nan), table


def calibration(table: CalibrationTable, bins: int = CALIBRATION_BINS) -> dict[str, Any]:
    """Per (h, a) cell: ``n`` idle periods still silent at ``a`` with a forecast,
    ``missing`` those without one, ``mean_p``, ``observed`` (share that arrived within
    ``h``), ``ece`` and the reliability ``bins``."""
    cells: list[dict[str, Any]] = []
    for j, a in enumerate(table.silences_s):
        for k, h in enumerate(table.horizons_s):
            p = table.p[:, j, k]
            have = table.silent[:, j] & ~np.isnan(p)
            y = table.arrived[have, j, k]
            ece, reliability = expected_calibration_error(p[have], y, bins)
            cells.append({
                "h_s": h, "a_s": a, "n": int(have.sum()),
                "missing": int((table.silent[:, j] & np.isnan(p)).sum()),
                "mean_p": float(p[have].mean()) if have.any() else math.nan,
                "observed": float(y.mean()) if have.any() else math.nan,
                "ece": ece, "bins": reliability,
            })
    return {"horizons_s": list(table.horizons_s), "silences_s": list(table.silences_s),
            "bins": bins, "cells": cells}


def ece_key(h_s: float, a_s: float) -> str:
    """The flat metric name of one calibration cell, e.g. ``ece_h60_a30``."""
    return f"ece_h{h_s:g}_a{a_s:g}"


# ---------------------------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------------------------


def benchmark(
    predictor: Predictor, trace: Trace, *, sessions: int = 10_000, single_calls: int = 2_000,
    repeats: int = 3,
) -> dict[str, float]:
    """Time forecasts for ``sessions`` idle sessions cloned from ``trace``.

    Returns ``single_us`` (mean microseconds of one ``forecast`` call), ``batch_ms`` (best
    of ``repeats`` for one ``forecast_many`` over all of them, or a loop of ``forecast`` when
    the predictor has no batched call) and ``sessions``. Every timed call is cold: caches
    of model outputs (see ``LearnedPredictor.clear_cache``) are dropped before it.
    """
    clear = getattr(predictor, "clear_cache", lambda: None)
    scripts = [list(replay_session(s)) for s in trace.sessions if s.requests]
    ids: list[str] = []
    nows: list[float] = []
    i = 0
    while len(ids) < sessions and scripts:
        events = scripts[i % len(scripts)]
        turns = 1 + (i // len(scripts)) % max(1, len(events) // 2)
        sid = f"bench-{i}"
        for ev in events[: 2 * turns]:
            predictor.observe(_renamed(ev, sid))
        ids.append(sid)
        nows.append(events[2 * turns - 1].time_s)
        i += 1
    n_single = min(single_calls, len(ids))
    clear()
    t0 = time.perf_counter()
    for sid, now in zip(ids[:n_single], nows[:n_single], strict=True):
        predictor.forecast(sid, now)
    single_us = (time.perf_counter() - t0) / max(1, n_single) * 1e6
    many = getattr(predictor, "forecast_many", None)
    best = math.inf
    for _ in range(repeats):
        clear()
        t0 = time.perf_counter()
        if many is not None:
            many(ids, nows)
        else:
            for sid, now in zip(ids, nows, strict=True):
                predictor.forecast(sid, now)
        best = min(best, time.perf_counter() - t0)
    for sid in ids:
        predictor.forget(sid)
    return {"sessions": float(len(ids)), "single_us": single_us, "batch_ms": best * 1e3}


def _renamed(event: SessionEvent, session_id: str) -> SessionEvent:
    from dataclasses import replace

    return replace(event, session_id=session_id, parent_id=None)
