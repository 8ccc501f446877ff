"""``survival``: a discrete-time hazard model of the gap, numpy only.

The gap axis is cut into bins (:data:`EDGES`, seconds). The hazard of returning in bin
``b`` given no return before it is ``sigmoid(alpha[b, stop] + z @ beta[band(b)])``: a
baseline hazard per bin and previous stop reason (tool call, end of turn, ...), shifted by
a few standardised features (turn index, the session's recent gaps, API time, output size)
whose effect differs between short, medium and long gaps (``band``). Each session's last
response, which was never followed by a request, survives every bin (the "never returns"
mass). Fitted by full-batch Adam on the exact log-likelihood.

Conditioning on the time since the last response is exact: ``S(t | silent for e) =
S(t) / S(e)``, so overdue sessions get later quantiles and a lower return probability.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvprefetch.controlplane.base.types import FORECAST_LEVELS
from kvprefetch.predictors.empirical import BUCKETS
from kvprefetch.predictors.features import GapDataset, SessionFeatures, feature_index
from kvprefetch.predictors.learned import MAX_CONFIDENCE, LearnedPredictor, npz_bytes, npz_load

#: Bin edges of the gap (seconds); the last bin is open-ended.
EDGES: tuple[float, ...] = (
    0, 1, 2, 3, 4, 5, 6, 8, 10, 13, 17, 22, 30, 40, 50, 60, 80, 110, 150, 200, 300, 450,
    700, 1000, 1600, 2500, 4000, 7000, 12000, 25000, 60000,
)
#: Where the open last bin is taken to end when interpolating quantiles (seconds).
LAST_EDGE_S = 200_000.0
#: Bins at or above these edges (seconds) use the next band's feature weights.
BAND_STARTS_S: tuple[float, ...] = (10.0, 60.0, 600.0)
#: The features that shift the hazard.
SURVIVAL_FEATURES: tuple[str, ...] = (
    "log_api_time_s", "log_output_tokens", "log_input_growth_tokens", "log_turn", "has_gap",
    "log_last_gap_s", "ewma_log_gap", "has_gap_same_stop", "ewma_log_gap_same_stop",
    "last_log_gap_same_stop", "frac_long_gaps_same_stop", "frac_end_turn", "mean_log_gap",
    "frac_long_gaps", "is_child",
)
ITERATIONS = 400
LEARNING_RATE = 0.05
L2 = 1e-3

_COLS = [feature_index(f) for f in SURVIVAL_FEATURES]
_STOP_COLS = [feature_index(f"stop_{b}") for b in BUCKETS]
_B = len(EDGES)
_EDGE_U = np.log1p(np.asarray([*EDGES, LAST_EDGE_S], dtype=np.float64))  # (B + 1,)
_BAND = np.searchsorted(np.asarray(BAND_STARTS_S), np.asarray(EDGES), side="right")
_LEVELS = np.asarray(FORECAST_LEVELS)


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


class SurvivalPredictor(LearnedPredictor):
    """Discrete-time hazard model conditioned on stop reason and a few session features."""

    name = "survival"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.alpha = np.zeros((_B, len(BUCKETS)))
        self.beta = np.zeros((len(BAND_STARTS_S) + 1, len(_COLS)))
        self.mean = np.zeros(len(_COLS))
        self.scale: np.ndarray = np.ones(len(_COLS))

    # -- fitting --------------------------------------------------------------------------
    def _fit(self, ds: GapDataset, rng: np.random.Generator, progress: bool) -> None:
        from tqdm.auto import tqdm

        raw = ds.x[:, _COLS]
        self.mean = raw.mean(axis=0)
        self.scale = np.where(raw.std(axis=0) > 1e-9, raw.std(axis=0), 1.0)
        z = (raw - self.mean) / self.scale
        stop = _stop_index(ds.x)
        returned = ds.returned
        # bin of each return; B (= past every bin) for the responses never followed by one
        k = np.where(returned, np.searchsorted(np.asarray(EDGES), ds.gap_s, side="right") - 1,
                     _B)
        bins = np.arange(_B)
        at_risk = bins[None, :] <= k[:, None]
        event = (bins[None, :] == k[:, None]) & returned[:, None]
        n = len(ds)
        # start from the pooled discrete hazard per bin and stop bucket
        for s in range(len(BUCKETS)):
            m = stop == s
            risk = at_risk[m].sum(axis=0) + 2.0
            ev = event[m].sum(axis=0) + 1.0
            self.alpha[:, s] = np.log(ev / np.maximum(risk - ev, 1.0))
        self.beta[:] = 0.0
        params = [self.alpha, self.beta]
        m1 = [np.zeros_like(p) for p in params]
        m2 = [np.zeros_like(p) for p in params]
        onehot = np.eye(len(BUCKETS))[stop]  # (n, S)
        for it in tqdm(range(1, ITERATIONS + 1), desc="survival", disable=not progress):
            eta = self.alpha[:, stop].T + (z @ self.beta.T)[:, _BAND]  # (n, B)
            h = 1.0 / (1.0 + np.exp(-eta))
            g = np.where(at_risk, event - h, 0.0) / n  # d loglik / d eta
            grad_alpha = -(g.T @ onehot) + L2 * self.alpha
            g_band = np.zeros((n, self.beta.shape[0]))
            np.add.at(g_band.T, _BAND, g.T)
            grad_beta = -(g_band.T @ z) + L2 * self.beta
            for p, gr, a, b in zip(params, (grad_alpha, grad_beta), m1, m2, strict=True):
                a *= 0.9
                a += 0.1 * gr
                b *= 0.999
                b += 0.001 * gr * gr
                p -= LEARNING_RATE * (a / (1 - 0.9**it)) / (np.sqrt(b / (1 - 0.999**it)) + 1e-8)

    # -- prediction -----------------------------------------------------------------------
    def survival_curves(self, x: np.ndarray) -> np.ndarray:
        """S at every bin edge (n, B + 1): P(no return before the edge); S[:, -1] is the
        probability of never returning."""
        z = (x[:, _COLS] - self.mean) / self.scale
        eta = self.alpha[:, _stop_index(x)].T + (z @ self.beta.T)[:, _BAND]
        log_stay = -_softplus(eta)
        s = np.ones((len(x), _B + 1))
        s[:, 1:] = np.exp(np.cumsum(log_stay, axis=1))
        return s

    def _predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        u_q, p, _ = self._from_curves(self.survival_curves(x), np.zeros(len(x)))
        return u_q, p

    def _raw_outputs(self, states: Sequence[SessionFeatures]) -> np.ndarray:
        """The survival curves: conditioning on the silence so far is exact on them."""
        return self.survival_curves(self._tracker.rows(states))

    def _condition(
        self, raw: np.ndarray, elapsed_s: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        u_q, p, horizon = self._from_curves(raw, np.maximum(elapsed_s, 0.0))
        u_q = _monotone_floor(u_q + self.shift[None, :], np.log1p(np.maximum(elapsed_s, 0.0)))
        confidence = np.clip(np.exp(-0.5 * (u_q[:, 2] - u_q[:, 0])), 0.0, MAX_CONFIDENCE)
        return np.expm1(u_q), p, horizon, confidence

    def _from_curves(
        self, s: np.ndarray, elapsed_s: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Log-gap quantiles given a return after ``elapsed_s``, P(return within the next
        ``horizon_s``), and that horizon measured from the response end."""
        s_never = s[:, -1]
        s_e = _interp_rows(s, np.log1p(elapsed_s))
        horizon = elapsed_s + self.horizon_s
        s_h = _interp_rows(s, np.log1p(horizon))
        p = np.clip((s_e - s_h) / np.maximum(s_e, 1e-12), 0.0, 1.0)
        u_q = np.empty((len(s), len(_LEVELS)))
        for j, level in enumerate(_LEVELS):
            target = s_e - level * (s_e - s_never)
            u_q[:, j] = _invert_rows(s, target)
        return u_q, p, horizon

    # -- artifacts ------------------------------------------------------------------------
    def _get_state(self) -> tuple[dict[str, Any], bytes]:
        params = {"edges_s": list(EDGES), "features": list(SURVIVAL_FEATURES),
                  "band_starts_s": list(BAND_STARTS_S)}
        return params, npz_bytes(alpha=self.alpha, beta=self.beta, mean=self.mean,
                                 scale=self.scale)

    def _set_state(self, params: dict[str, Any], payload: bytes) -> None:
        if params.get("edges_s") != list(EDGES) or params.get("features") != list(
            SURVIVAL_FEATURES
        ):
            raise ValueError("bins or features differ from this version's survival model")
        arrays = npz_load(payload)
        self.alpha = arrays["alpha"].reshape(self.alpha.shape)
        self.beta = arrays["beta"].reshape(self.beta.shape)
        self.mean = arrays["mean"].reshape(self.mean.shape)
        self.scale = arrays["scale"].reshape(self.scale.shape)


def _stop_index(x: np.ndarray) -> np.ndarray:
    onehot = x[:, _STOP_COLS]
    return np.where(onehot.max(axis=1) > 0, onehot.argmax(axis=1), len(BUCKETS) - 1)


def _interp_rows(s: np.ndarray, u: np.ndarray) -> np.ndarray:
    """S at log-gap ``u`` per row, linear in u between edges."""
    k = np.clip(np.searchsorted(_EDGE_U, u, side="right") - 1, 0, _B - 1)
    lo, hi = _EDGE_U[k], _EDGE_U[k + 1]
    w = np.clip((u - lo) / (hi - lo), 0.0, 1.0)
    rows = np.arange(len(s))
    return s[rows, k] + w * (s[rows, k + 1] - s[rows, k])


def _invert_rows(s: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Smallest log-gap u per row with S(u) <= target (S is non-increasing)."""
    below = s <= target[:, None] + 1e-15
    k = np.clip(np.argmax(below, axis=1), 1, _B)  # first edge at or below the target
    rows = np.arange(len(s))
    s_lo, s_hi = s[rows, k - 1], s[rows, k]
    w = np.clip((s_lo - target) / np.maximum(s_lo - s_hi, 1e-15), 0.0, 1.0)
    return _EDGE_U[k - 1] + w * (_EDGE_U[k] - _EDGE_U[k - 1])


def _monotone_floor(u: np.ndarray, floor: np.ndarray) -> np.ndarray:
    u = np.sort(np.maximum(u, floor[:, None]), axis=1)
    u[:, 1] = np.maximum(u[:, 1], u[:, 0] + 1e-3)
    u[:, 2] = np.maximum(u[:, 2], u[:, 1] + 1e-3)
    return u


