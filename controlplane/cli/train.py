"""``kvprefetch train``: fit a predictor on a trace and write its artifact.

The trace is split first (``--split session|time``, ``--test-fraction``, ``--seed``); the
model trains on the train side only and is scored on the held-out side, so that
``kvprefetch eval-predictor`` with the same split options evaluates it without leakage.
``--test-fraction 0`` trains on everything.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvprefetch.controlplane.cli.options import (
    add_test_fraction_option,
    add_trace_format_option,
    load_trace_option,
    non_negative_int,
    positive_int,
)
from kvprefetch.controlplane.cli.predictor_option import add_predictor_option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="trace file or folder")
    add_trace_format_option(parser)
    add_predictor_option(
        parser, several=False, required=True,
        help="the one trainable predictor: empirical, survival, gbm, torch-seq, "
        "hinted:SPEC (the hint layer over a trainable SPEC, e.g. hinted:gbm), or "
        "module:Class with fit/save",
    )
    parser.add_argument("--out", required=True, help="artifact file to write")
    parser.add_argument("--split", choices=("session", "time"), default="session",
                        help="hold out whole session groups at random, or the latest ones")
    add_test_fraction_option(parser, allow_zero=True, default=0.25,
                             help="share of session groups held out (default 0.25; 0 = none)")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="split and training seed")
    parser.add_argument("--limit-sessions", type=positive_int, default=None,
                        help="first N sessions")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from kvprefetch.controlplane.base.errors import PredictorError
    from kvprefetch.predictors import registry
    from kvprefetch.predictors.evaluate import evaluate
    from kvprefetch.predictors.splits import split_trace

    progress = not args.no_progress and sys.stderr.isatty()
    trace = load_trace_option(args.trace, args.trace_format, seed=args.seed,
                              limit_sessions=args.limit_sessions, progress=progress)
    split = split_trace(trace, args.split, args.test_fraction, args.seed)
    model = registry.create(args.predictor)
    fit = getattr(model, "fit", None)
    save = getattr(model, "save", None)
    if fit is None or save is None:
        raise PredictorError(f"predictor {args.predictor!r} cannot be trained (no fit/save)")
    unsaved = _unsavable_inner(model)
    if unsaved is not None:  # refused before the fit, not after it
        raise PredictorError(f"predictor {args.predictor!r} cannot be trained: it wraps "
                             f"{unsaved!r}, which has no artifact (no save); wrap a "
                             "trainable one, e.g. hinted:gbm")
    fit(split.train, seed=args.seed, progress=progress)
    path = save(args.out)
    summary: dict[str, object] = {"artifact": str(path), "predictor": model.name,
                                  **split.describe()}
    if split.test.sessions:
        summary["held_out"] = {
            k: v for k, v in evaluate(model, split.test, calibrate=False).items()
            if k in ("gaps", "mae_log_gap", "mean_pinball", "mean_pinball_log", "coverage_80",
                     "auc_return_60s")
        }
    print(json.dumps(summary, indent=2, default=float))
    return 0


def _unsavable_inner(model: object) -> str | None:
    """The name of the innermost model a wrapper (its ``inner``) holds that cannot be
    saved; None when every model down the chain can."""
    inner = getattr(model, "inner", None)
    while inner is not None:
        if getattr(inner, "save", None) is None:
            return str(getattr(inner, "name", type(inner).__name__))
        inner = getattr(inner, "inner", None)
    return None
