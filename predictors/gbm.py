"""``gbm``: scikit-learn histogram gradient boosting.

Three quantile regressors of ``log1p(gap_s)`` (levels 0.1, 0.5, 0.9; quantiles are
invariant under the monotone transform, and the log tames the heavy tail) trained on the
responses that were followed by a return, and a classifier of "returns within
``horizon_s``" trained on every response (including each session's last, which never
returned). Forecasts are vectorised: one ``predict`` per estimator for a whole batch.

scikit-learn is imported only when this model is trained or loaded. The artifact payload
is a pickle of the estimators, unpickled only after the artifact header and its checksum
have been verified (:mod:`kvprefetch.predictors.artifacts`).
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Any

import numpy as np

from kvprefetch.controlplane.base.errors import PredictorError
from kvprefetch.controlplane.base.types import FORECAST_LEVELS
from kvprefetch.predictors.features import GapDataset
from kvprefetch.predictors.learned import LearnedPredictor

#: Boosting settings: small trees and few iterations keep a batched forecast of 10,000
#: sessions under 100 ms (4 ensembles); accuracy was checked on a validation split of the
#: training part only. 40 trees at a learning rate of 0.2 score as well as 100 at 0.1 on held-out
#: Claude Code sessions (`kvprefetch eval-predictor`) and predict faster.
GBM_PARAMS: dict[str, Any] = {"max_iter": 40, "learning_rate": 0.2, "max_leaf_nodes": 15}


def _sklearn() -> Any:
    try:
        from sklearn import ensemble
    except ImportError as exc:  # translate the dependency error at the edge
        raise PredictorError(
            "predictor 'gbm' needs scikit-learn: pip install 'kvprefetch[ml]'"
        ) from exc
    return ensemble


#: Below this many rows a single OpenMP thread is faster than a thread team.
_THREADED_ROWS = 1024
_CONTROLLER: list[Any] = []


def _one_openmp_thread() -> Any:
    """A context limiting OpenMP to one thread. The controller (which scans the loaded
    libraries, ~3 ms) is built once, on first use."""
    if not _CONTROLLER:
        from threadpoolctl import ThreadpoolController

        _CONTROLLER.append(ThreadpoolController())
    return _CONTROLLER[0].limit(limits=1, user_api="openmp")


class GbmPredictor(LearnedPredictor):
    """Gradient-boosted quantile regressors + return classifier."""

    name = "gbm"
    payload_encoding = "pickle"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.regressors: list[Any] = []
        self.classifier: Any = None
        self._constant_p: float | None = None

    def _fit(self, ds: GapDataset, rng: np.random.Generator, progress: bool) -> None:
        ensemble = _sklearn()
        from tqdm.auto import tqdm

        seed = int(rng.integers(2**31 - 1))
        r = ds.returned
        x_r, y_r = ds.x[r], np.log1p(ds.gap_s[r])
        label = ds.gap_s <= self.horizon_s
        steps = tqdm(total=len(FORECAST_LEVELS) + 1, desc="gbm", disable=not progress)
        self.regressors = []
        for level in FORECAST_LEVELS:
            reg = ensemble.HistGradientBoostingRegressor(
                loss="quantile", quantile=level, random_state=seed, **GBM_PARAMS
            )
            self.regressors.append(reg.fit(x_r, y_r))
            steps.update()
        if label.all() or not label.any():
            self.classifier, self._constant_p = None, float(label.mean())
        else:
            clf = ensemble.HistGradientBoostingClassifier(random_state=seed, **GBM_PARAMS)
            self.classifier, self._constant_p = clf.fit(ds.x, label), None
        steps.update()
        steps.close()

    def _predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # One OpenMP thread for small batches: the scheduler asks for a few rows at a time,
        # where waking a thread team costs more than it saves (tests/predictors:
        # test_forecast_cost bounds a single-row forecast).
        with _one_openmp_thread() if len(x) < _THREADED_ROWS else contextlib.nullcontext():
            u_q = np.column_stack([reg.predict(x) for reg in self.regressors])
            if self.classifier is None:
                p = np.full(len(x), self._constant_p or 0.0)
            else:
                p = self.classifier.predict_proba(x)[:, 1]
        return u_q, p

    def _get_state(self) -> tuple[dict[str, Any], bytes]:
        blob = pickle.dumps(
            {"regressors": self.regressors, "classifier": self.classifier,
             "constant_p": self._constant_p},
            protocol=pickle.HIGHEST_PROTOCOL,
        )
        import sklearn

        return {"sklearn_version": sklearn.__version__, "gbm_params": GBM_PARAMS}, blob

    def _set_state(self, params: dict[str, Any], payload: bytes) -> None:
        _sklearn()
        state = pickle.loads(payload)  # header and checksum were verified first
        regressors = state["regressors"]
        if len(regressors) != len(FORECAST_LEVELS):
            raise PredictorError(f"expected {len(FORECAST_LEVELS)} regressors")
        self.regressors = list(regressors)
        self.classifier = state["classifier"]
        self._constant_p = state["constant_p"]
