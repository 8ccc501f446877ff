"""Pluggable models of when each session returns. See :mod:`predictors.base`.

Built-ins: ``last-gap``, ``ewma`` (no dependencies), ``empirical``, ``survival`` (numpy),
``gbm`` (scikit-learn), ``torch-seq`` (torch), ``hinted`` (wraps any), ``oracle``
(simulator only). Trained models are imported lazily by the registry.
"""

from predictors.base import Predictor
from predictors.distribution import prob_return_within
from predictors.features import FEATURE_NAMES, FEATURE_SCHEMA_VERSION, FeatureTracker
from predictors.heuristics import EwmaPredictor, LastGapPredictor
from predictors.oracle import OraclePredictor
from predictors.registry import available, create, load, load_artifact
from predictors.splits import SplitKind, split_trace

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
