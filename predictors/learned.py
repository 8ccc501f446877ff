"""Shared machinery of the trained predictors (``empirical``, ``survival``, ``gbm``,
``torch-seq``): event bookkeeping through the shared :class:`FeatureTracker`, batched
forecasts, conditioning on elapsed silence, conformal calibration, and artifacts.

Optional extensions of the :class:`~kvprefetch.predictors.base.Predictor` protocol they implement:

* ``forecast_many(session_ids, now_s)`` — one vectorised call for many sessions; the
  planner should prefer it when it re-plans many idle sessions at once.
* ``fit(trace, *, seed, progress)`` — train on a trace (called by ``kvprefetch train`` and
  ``eval-predictor``, never on the event path). Returns ``self``.
* ``save(path)`` / ``load(path)`` (classmethod) — one versioned artifact file
  (:mod:`kvprefetch.predictors.artifacts`); the registry calls ``load`` for ``name:FILE`` specs.
* ``fitted`` — false until trained or loaded; the registry refuses an untrained model.

Subclasses implement ``_fit(ds, rng, progress)``, ``_predict(ds_rows) -> (u_q, p_h)`` (log1p
gap quantiles at the forecast levels and P(return within ``horizon_s``), unconditional, at
the response end), and ``_get_state``/``_set_state`` for their parameters.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Self

import numpy as np

from kvprefetch.controlplane.base.errors import PredictorError
from kvprefetch.controlplane.base.types import FORECAST_LEVELS, ArrivalForecast, SessionEvent, Trace
from kvprefetch.predictors.artifacts import read_artifact, write_artifact
from kvprefetch.predictors.distribution import condition, monotone
from kvprefetch.predictors.features import (
    FeatureTracker,
    GapDataset,
    SessionFeatures,
    build_dataset,
)

#: Default horizon of ``p_return`` for trained models: return within 60 s of now.
DEFAULT_RETURN_HORIZON_S = 60.0
#: Fewest inter-request gaps (and session groups) a trace must hold to train on.
MIN_TRAIN_GAPS = 20
MIN_TRAIN_GROUPS = 2
#: The most a learned forecast claims (see ``_condition``).
MAX_CONFIDENCE = 0.99
#: Share of the training groups held back to calibrate the quantiles (conformal shift).
CALIBRATION_FRACTION = 0.2

#: Gap reported for a session known to be closed (it will not return).
NEVER_S = 1e12

_LEVELS = np.asarray(FORECAST_LEVELS)


class LearnedPredictor:
    """Base class of trained predictors; see the module docstring."""

    name: ClassVar[str] = "learned"
    #: How the payload is encoded in the artifact ("npz", "pickle", "torch").
    payload_encoding: ClassVar[str] = "npz"

    def __init__(self, *, horizon_s: float = DEFAULT_RETURN_HORIZON_S, seed: int = 0) -> None:
        if horizon_s <= 0:
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        self.horizon_s = float(horizon_s)
        self.seed = seed
        self.fitted = False
        #: per-level shift of the log1p gap quantiles learned on the calibration split
        self.shift = np.zeros(len(_LEVELS))
        self.train_info: dict[str, Any] = {}
        self._tracker = FeatureTracker()
        #: Raw model outputs per session (one row of :meth:`_raw_outputs`), valid until its
        #: next event: the model's inputs change only on events, while the planner asks
        #: again and again (every eviction decision ranks every candidate) as time passes.
        #: Conditioning on the time elapsed is applied on every call (:meth:`_condition`).
        self._raw: dict[str, np.ndarray] = {}

    # -- the Predictor protocol ---------------------------------------------------------
    def observe(self, event: SessionEvent) -> None:
        self._tracker.observe(event)
        self._raw.pop(event.session_id, None)

    def forget(self, session_id: str) -> None:
        self._tracker.forget(session_id)
        self._raw.pop(session_id, None)

    def clear_cache(self) -> None:
        """Drop cached model outputs (benchmarks time cold calls with it)."""
        self._raw.clear()

    def forecast(self, session_id: str, now_s: float) -> ArrivalForecast | None:
        return self.forecast_many((session_id,), now_s)[0]

    def forecast_many(
        self, session_ids: Sequence[str], now_s: float | Sequence[float]
    ) -> list[ArrivalForecast | None]:
        """Forecasts for many sessions in one vectorised call (``None`` where a session is
        unknown or in flight). ``now_s`` is one time for all or one per session."""
        self._require_fitted()
        nows = [now_s] * len(session_ids) if isinstance(now_s, int | float) else list(now_s)
        out: list[ArrivalForecast | None] = [None] * len(session_ids)
        ready: list[int] = []
        states: list[SessionFeatures] = []
        for i, sid in enumerate(session_ids):
            st = self._tracker.ready(sid)
            if st is not None:
                ready.append(i)
                states.append(st)
        if not ready:
            return out
        last = np.array([st.last_finish_s for st in states], dtype=np.float64)
        elapsed = np.array([nows[i] for i in ready], dtype=np.float64) - last
        q, p, horizon, conf = self._cached_predict([session_ids[i] for i in ready], states,
                                                   elapsed)
        q_rows, p_l, h_l, c_l, last_l = q.tolist(), p.tolist(), horizon.tolist(), conf.tolist(), (
            last.tolist()
        )
        closed_horizon = NEVER_S
        for k, i in enumerate(ready):
            st = states[k]
            if st.closed:
                out[i] = ArrivalForecast(
                    session_ids[i], last_l[k], (closed_horizon,) * 3, 0.0, closed_horizon, 1.0
                )
                continue
            # Conditioned on the elapsed silence (see _condition): no recency floor on top.
            out[i] = ArrivalForecast(
                session_ids[i], last_l[k], tuple(q_rows[k]), p_l[k], h_l[k], c_l[k],
                conditioned=True,
            )
        return out

    def _cached_predict(
        self, sids: Sequence[str], states: Sequence[SessionFeatures], elapsed_s: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        missing = [k for k, sid in enumerate(sids) if sid not in self._raw]
        if missing:
            fresh = self._raw_outputs([states[k] for k in missing])
            for j, k in enumerate(missing):
                self._raw[sids[k]] = fresh[j]
        return self._condition(np.vstack([self._raw[sid] for sid in sids]), elapsed_s)

    # -- the two steps of a forecast (subclasses may override either) ---------------------
    def _raw_outputs(self, states: Sequence[SessionFeatures]) -> np.ndarray:
        """What the model says about each session at its response end, as one row per
        session: here the log-gap quantiles and P(return within the horizon)."""
        u_q, p_h = self._predict_states(states)
        return np.column_stack([u_q, p_h])

    def _condition(
        self, raw: np.ndarray, elapsed_s: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(gap quantiles s (n,3), p_return (n,), horizon_s (n,), confidence (n,)) given
        that ``elapsed_s`` have passed since each response end without a return."""
        u_q = monotone(raw[:, : len(_LEVELS)] + self.shift[None, :])
        p_h = np.clip(raw[:, len(_LEVELS)], 0.0, 1.0)
        q, p, horizon = condition(u_q, p_h, elapsed_s, self.horizon_s)
        # A model is never certain: 1.0 is the oracle's (exact timing, Belady eviction,
        # prefetches that may evict); a collapsed quantile spread must not claim it.
        confidence = np.clip(np.exp(-0.5 * (u_q[:, 2] - u_q[:, 0])), 0.0, MAX_CONFIDENCE)
        return q, p, horizon, confidence

    def _predict_states(self, states: Sequence[SessionFeatures]) -> tuple[np.ndarray, np.ndarray]:
        return self._predict(self._tracker.rows(states))

    # -- training -------------------------------------------------------------------------
    def fit(self, trace: Trace | GapDataset, *, seed: int | None = None,
            progress: bool = False) -> Self:
        """Train on every response of ``trace``; a seeded share of its session groups is held
        back to calibrate the quantiles. Deterministic given ``seed``."""
        self._raw.clear()
        started = time.perf_counter()
        if seed is not None:
            self.seed = seed
        ds = trace if isinstance(trace, GapDataset) else build_dataset(trace)
        returned = int(ds.returned.sum())
        groups = np.unique(ds.group) if len(ds) else np.zeros(0, dtype=object)
        name = trace.name if isinstance(trace, Trace) else "dataset"
        if returned < MIN_TRAIN_GAPS or len(groups) < MIN_TRAIN_GROUPS:
            raise PredictorError(
                f"trace {name!r} is too small to train {self.name!r}: {returned} inter-request "
                f"gaps in {len(groups)} session group(s); need at least {MIN_TRAIN_GAPS} gaps "
                f"in {MIN_TRAIN_GROUPS} groups"
            )
        rng = np.random.default_rng(self.seed)
        n_cal = round(len(groups) * CALIBRATION_FRACTION)
        cal_groups = set(rng.permutation(groups)[:n_cal].tolist()) if len(groups) >= 5 else set()
        cal_mask = np.array([g in cal_groups for g in ds.group], dtype=bool)
        fit_ds = ds.subset(~cal_mask) if cal_groups else ds
        cal_ds = ds.subset(cal_mask) if cal_groups else ds
        self.shift = np.zeros(len(_LEVELS))
        self._fit(fit_ds, rng, progress)
        self.fitted = True
        self._calibrate(cal_ds)
        self.train_info = {
            "trace": name,
            "examples": len(ds),
            "gaps": returned,
            "groups": len(groups),
            "calibration_groups": len(cal_groups),
            "seed": self.seed,
            "train_groups": sorted(str(g) for g in groups),
            "fit_seconds": round(time.perf_counter() - started, 3),
            "calibration_shift_log": self.shift.round(6).tolist(),
        }
        return self

    def _calibrate(self, cal: GapDataset) -> None:
        """Per level, shift the log quantile so that exactly that share of the held-back
        gaps falls below it (split-conformal quantile calibration)."""
        r = cal.returned
        if r.sum() < 10:
            return
        u_q, _ = self._predict_dataset(cal.subset(r))
        y = np.log1p(cal.gap_s[r])
        self.shift = np.array(
            [np.quantile(y - u_q[:, j], lvl) for j, lvl in enumerate(_LEVELS)]
        )

    def _predict_dataset(self, ds: GapDataset) -> tuple[np.ndarray, np.ndarray]:
        """Raw (uncalibrated) predictions for dataset rows; sequence models override."""
        return self._predict(ds.x)

    def _require_fitted(self) -> None:
        if not self.fitted:
            raise PredictorError(
                f"predictor {self.name!r} is not trained: train it (kvprefetch train) and load "
                f"it as '{self.name}:FILE'"
            )

    # -- artifacts ------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the trained model to one artifact file (atomically)."""
        self._require_fitted()
        params, payload = self._get_state()
        params = {
            **params,
            "horizon_s": self.horizon_s,
            "seed": self.seed,
            "shift": self.shift.tolist(),
        }
        return write_artifact(
            path, model=self.name, payload=payload, payload_encoding=self.payload_encoding,
            params=params, train=self.train_info,
        )

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """Read a model written by :meth:`save`; :class:`PredictorError` names any problem."""
        header, payload = read_artifact(path, cls.name)
        params = header.get("params", {})
        try:
            obj = cls(horizon_s=float(params["horizon_s"]), seed=int(params["seed"]))
            obj.shift = np.asarray(params["shift"], dtype=np.float64).reshape(len(_LEVELS))
            obj._set_state(params, payload)
        except PredictorError:
            raise
        except Exception as exc:
            raise PredictorError(
                f"predictor artifact {str(path)!r}: corrupt {cls.name!r} payload: {exc}"
            ) from exc
        obj.train_info = dict(header.get("train", {}))
        obj.fitted = True
        return obj

    # -- subclass hooks -------------------------------------------------------------------
    def _fit(self, ds: GapDataset, rng: np.random.Generator, progress: bool) -> None:
        raise NotImplementedError

    def _predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def _get_state(self) -> tuple[dict[str, Any], bytes]:
        raise NotImplementedError

    def _set_state(self, params: dict[str, Any], payload: bytes) -> None:
        raise NotImplementedError


def npz_bytes(**arrays: np.ndarray) -> bytes:
    """Arrays as an ``.npz`` blob (no pickle)."""
    import io

    buf = io.BytesIO()
    np.savez(buf, allow_pickle=False, **arrays)
    return buf.getvalue()


def npz_load(payload: bytes) -> dict[str, np.ndarray]:
    import io

    with np.load(io.BytesIO(payload), allow_pickle=False) as data:
        return {k: data[k] for k in data.files}
