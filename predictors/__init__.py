"""Pluggable models of when each session returns. See :mod:`kvprefetch.predictors.base`.

Built-ins: ``last-gap``, ``ewma`` (no dependencies), ``empirical``, ``survival`` (numpy),
``gbm`` (scikit-learn), ``torch-seq`` (torch), ``hinted`` (wraps any), ``oracle``
(simulator only). Trained models are imported lazily by the registry.
"""

from kvprefetch.predictors.base import Predictor
from kvprefetch.predictors.distribution import prob_return_within
from kvprefetch.predictors.features import FEATURE_NAMES, FEATURE_SCHEMA_VERSION, FeatureTracker
from kvprefetch.predictors.heuristics import EwmaPredictor, LastGapPredictor
from kvprefetch.predictors.oracle import OraclePredictor
from kvprefetch.predictors.registry import available, create, load, load_artifact
from kvprefetch.predictors.splits import SplitKind, split_trace

__all__ = [
    "FEATURE_NAMES",
    "FEATURE_SCHEMA_VERSION",
    "EwmaPredictor",
    "FeatureTracker",
    "LastGapPredictor",
    "OraclePredictor",
    "Predictor",
    "SplitKind",
    "available",
    "create",
    "load",
    "load_artifact",
    "prob_return_within",
    "split_trace",
]
