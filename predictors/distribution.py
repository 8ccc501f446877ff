"""A gap distribution from three quantiles, vectorised: CDF, inverse, conditioning.

Every learned model predicts ``u = log1p(gap_s)`` at the levels (0.1, 0.5, 0.9) and
``P(return within H)``. Between the quantiles the CDF is linear in ``u``; below q10 it falls
linearly to 0 at ``gap = 0``; above q90 the tail is Pareto-like (exponential in ``u``) with
the decay of the q50→q90 segment. That is enough to answer what the planner needs:

* quantiles *given that the session has been silent for* ``elapsed_s`` (overdue sessions),
* the probability of returning within any horizon (:func:`prob_return_within`).
"""

from __future__ import annotations

import math

import numpy as np

from kvprefetch.controlplane.base.types import FORECAST_LEVELS, ArrivalForecast

_LEVELS = np.asarray(FORECAST_LEVELS)
_MIN_STEP = 1e-3
_TAIL_DROP = math.log(5.0)  # survival falls 0.5 -> 0.1 over the q50 -> q90 segment


def monotone(u: np.ndarray) -> np.ndarray:
    """Sort quantiles along the last axis (crossing quantile regressors) and keep steps > 0."""
    u = np.sort(np.maximum(u, 0.0), axis=-1)
    u[..., 1] = np.maximum(u[..., 1], u[..., 0] + _MIN_STEP)
    u[..., 2] = np.maximum(u[..., 2], u[..., 1] + _MIN_STEP)
    return u


def cdf(u_q: np.ndarray, u: np.ndarray) -> np.ndarray:
    """CDF at ``u`` (n,) of the distributions with log-quantiles ``u_q`` (n, 3)."""
    u10, u50, u90 = u_q[:, 0], u_q[:, 1], u_q[:, 2]
    below = np.where(u10 > 0, 0.1 * u / np.maximum(u10, 1e-12), 0.1)
    mid1 = 0.1 + 0.4 * (u - u10) / (u50 - u10)
    mid2 = 0.5 + 0.4 * (u - u50) / (u90 - u50)
    rate = _TAIL_DROP / (u90 - u50)
    tail = 1.0 - 0.1 * np.exp(-rate * (u - u90))
    out = np.where(u < u10, below, np.where(u < u50, mid1, np.where(u < u90, mid2, tail)))
    return np.clip(np.where(u <= 0, 0.0, out), 0.0, 1.0)


def inverse_cdf(u_q: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Inverse of :func:`cdf`: ``u`` with ``cdf(u) = p`` for ``p`` (n,) in [0, 1)."""
    u10, u50, u90 = u_q[:, 0], u_q[:, 1], u_q[:, 2]
    p = np.clip(p, 0.0, 1.0 - 1e-9)
    below = u10 * p / 0.1
    mid1 = u10 + (p - 0.1) / 0.4 * (u50 - u10)
    mid2 = u50 + (p - 0.5) / 0.4 * (u90 - u50)
    rate = _TAIL_DROP / (u90 - u50)
    tail = u90 - np.log(np.maximum((1.0 - p) / 0.1, 1e-300)) / rate
    return np.where(p < 0.1, below, np.where(p < 0.5, mid1, np.where(p < 0.9, mid2, tail)))


def condition(
    u_q: np.ndarray, p_h: np.ndarray, elapsed_s: np.ndarray, horizon_s: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Condition forecasts made at the response end on ``elapsed_s`` seconds of silence.

    ``p_h`` is P(return within ``horizon_s`` of the response end). Returns the gap
    quantiles in seconds (n, 3) given that the session returns and has not yet, the
    probability that it returns within the next ``horizon_s`` from now, and that horizon
    measured from the response end (``elapsed_s + horizon_s``).
    """
    elapsed_s = np.maximum(elapsed_s, 0.0)
    horizon_from_finish = elapsed_s + horizon_s
    if not np.any(elapsed_s > 0):
        return np.expm1(u_q), np.clip(p_h, 0.0, 1.0), horizon_from_finish
    f_h = np.maximum(cdf(u_q, np.full(len(p_h), math.log1p(horizon_s))), 1e-9)
    p_ever = np.clip(p_h / f_h, 0.0, 1.0)
    f_e = cdf(u_q, np.log1p(elapsed_s))
    f_end = cdf(u_q, np.log1p(horizon_from_finish))
    alive = np.maximum(1.0 - p_ever * f_e, 1e-12)
    p_now = np.clip(p_ever * (f_end - f_e) / alive, 0.0, 1.0)
    cond = np.empty_like(u_q)
    for j, level in enumerate(_LEVELS):
        cond[:, j] = inverse_cdf(u_q, f_e + level * (1.0 - f_e))
    cond = np.where((elapsed_s > 0)[:, None], cond, u_q)
    q = np.maximum(np.expm1(monotone(cond)), elapsed_s[:, None])
    return q, p_now, horizon_from_finish


def prob_return_within(forecast: ArrivalForecast, within_s: float) -> float:
    """P(the session returns within ``within_s`` of its last response end), from any
    forecast: ``p_return`` rescaled by the forecast's own gap distribution when its horizon
    differs from ``within_s``. Exact for forecasts made at the response end; for
    conditional (overdue) forecasts an approximation."""
    if forecast.p_return <= 0.0:
        return 0.0
    if math.isclose(forecast.horizon_s, within_s, rel_tol=1e-9):
        return float(min(1.0, forecast.p_return))
    q = np.log1p(np.maximum(np.asarray([forecast.gap_quantiles_s], dtype=np.float64), 0.0))
    uq = monotone(q)
    f_t = cdf(uq, np.asarray([math.log1p(max(0.0, within_s))]))[0]
    f_h = cdf(uq, np.asarray([math.log1p(max(0.0, forecast.horizon_s))]))[0]
    return float(min(1.0, forecast.p_return * f_t / max(f_h, 1e-9)))
