"""``empirical``: quantiles of the gap conditioned on the previous response's stop reason.

A strong, cheap baseline: a tool call returns in seconds, a person at the end of a turn in
minutes, hours or never. Per stop bucket (see :func:`kvprefetch.predictors.features.stop_category`)
it stores the empirical log-gap quantiles and the share of responses followed by a return
within the horizon; buckets with too few gaps fall back to the pooled figures.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvprefetch.controlplane.base.types import FORECAST_LEVELS
from kvprefetch.predictors.features import KNOWN_STOP_REASONS, GapDataset, feature_index
from kvprefetch.predictors.learned import LearnedPredictor, npz_bytes, npz_load

#: Buckets in the order of the one-hot stop features, then the pooled fallback.
BUCKETS: tuple[str, ...] = (*KNOWN_STOP_REASONS, "other")
#: Fewest gaps a bucket needs for its own quantiles.
MIN_BUCKET_GAPS = 10
_STOP_COLUMNS = [feature_index(f"stop_{b}") for b in BUCKETS]


class EmpiricalPredictor(LearnedPredictor):
    """Per-stop-reason empirical quantiles (the baseline every model must beat)."""

    name = "empirical"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: (len(BUCKETS) + 1, 3) log1p quantiles and (len(BUCKETS) + 1,) P(return <= H);
        #: the last row is the pooled fallback.
        self.table_u = np.zeros((len(BUCKETS) + 1, len(FORECAST_LEVELS)))
        self.table_p = np.zeros(len(BUCKETS) + 1)

    def _fit(self, ds: GapDataset, rng: np.random.Generator, progress: bool) -> None:
        r = ds.returned
        u = np.log1p(ds.gap_s[r])
        within = ds.gap_s <= self.horizon_s
        pooled_u = np.quantile(u, FORECAST_LEVELS)
        pooled_p = float(within.mean())
        self.table_u[-1], self.table_p[-1] = pooled_u, pooled_p
        for b, bucket in enumerate(BUCKETS):
            m = ds.stop == bucket
            if (m & r).sum() >= MIN_BUCKET_GAPS:
                self.table_u[b] = np.quantile(np.log1p(ds.gap_s[m & r]), FORECAST_LEVELS)
                self.table_p[b] = float(within[m].mean())
            else:
                self.table_u[b], self.table_p[b] = pooled_u, pooled_p

    def _predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        onehot = x[:, _STOP_COLUMNS]
        bucket = np.where(onehot.max(axis=1) > 0, onehot.argmax(axis=1), len(BUCKETS))
        return self.table_u[bucket], self.table_p[bucket]

    def _get_state(self) -> tuple[dict[str, Any], bytes]:
        return {"buckets": list(BUCKETS)}, npz_bytes(table_u=self.table_u, table_p=self.table_p)

    def _set_state(self, params: dict[str, Any], payload: bytes) -> None:
        arrays = npz_load(payload)
        self.table_u = arrays["table_u"].reshape(len(BUCKETS) + 1, len(FORECAST_LEVELS))
        self.table_p = arrays["table_p"].reshape(len(BUCKETS) + 1)
