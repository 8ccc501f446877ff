"""Scoring predictors on a trace, through the public protocol only.

Every session of the trace is replayed as events (:func:`~predictors.features.replay_session`)
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
  :func:`~predictors.distribution.prob_return_within`) over every response, the never-returned
  last responses included.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from controlplane.base.types import FORECAST_LEVELS, ArrivalForecast, SessionEvent, Trace
from predictors.base import Predictor
from predictors.distribution import prob_return_within
from predictors.features import replay_session

RETURN_WITHIN_S = 60.0


@dataclass(frozen=True)
class ForecastTable:
    """One row per response: the forecast made at its end and the gap that followed."""

    quantiles_s: np.ndarray  # (n, 3); NaN where the predictor gave no forecast
    p_within: np.ndarray  # (n,) P(return within RETURN_WITHIN_S)
    gap_s: np.ndarray  # (n,) inf = never returned
    seconds: float  # wall time spent in observe/forecast


def collect_forecasts(predictor: Predictor, trace: Trace) -> ForecastTable:
    """Replay ``trace`` into ``predictor`` and record its forecast after every response."""
    scripts = [list(replay_session(s)) for s in trace.sessions]
    many = getattr(predictor, "forecast_many", None)
    quantiles: list[Sequence[float]] = []
    p_within: list[float] = []
    gaps: list[float] = []
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
        forecasts: list[ArrivalForecast | None] = (
            list(many(ids, nows)) if many is not None
            else [predictor.forecast(sid, now) for sid, now in zip(ids, nows, strict=True)]
        )
        spent += time.perf_counter() - t0
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
    return ForecastTable(
        np.asarray(quantiles, dtype=np.float64).reshape(len(gaps), len(FORECAST_LEVELS)),
        np.asarray(p_within, dtype=np.float64), np.asarray(gaps, dtype=np.float64), spent,
    )


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
    return out


def evaluate(predictor: Predictor, trace: Trace) -> dict[str, Any]:
    """Score ``predictor`` on every response of ``trace`` (see the module docstring)."""
    return score(collect_forecasts(predictor, trace))


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
