"""``kvprefetch eval-predictor``: compare predictors side by side on held-out gaps.

The trace is split by session group (``--split session``, default) or by time; predictors
that need training and come without an artifact (``gbm``, ``survival``, ``torch-seq``,
``empirical``) are trained on the train side; every predictor is scored on the test side
(:mod:`kvprefetch.predictors.evaluate`). ``last-gap`` and ``empirical`` are always included.
A second table gives the calibration of each predictor's P(return within h | silent for a)
(expected calibration error per cell; ``--calibration-plot`` draws the reliability curves).
Artifacts (``gbm:FILE``) are used as they are: train them with ``kvprefetch train`` and the
same ``--split/--test-fraction/--seed`` so that they never saw the test sessions (a warning
is printed when an artifact's training sessions overlap the test side).

Example (one command, trains and compares)::

    kvprefetch eval-predictor --trace kv-cache-tester/traces \\
        --predictors survival,gbm,torch-seq --json out/predictors.json \\
        --calibration-plot out/calibration.png

``kv-cache-tester/traces`` is the full public Claude Code set, the ``traces/`` folder of
github.com/callanjfox/kv-cache-tester (the bundled slice holds 24 of its files).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from kvprefetch.controlplane.base import atomic
from kvprefetch.controlplane.cli.options import (
    add_test_fraction_option,
    add_trace_format_option,
    load_trace_option,
    non_negative_int,
    positive_int,
    require_extra_module,
)
from kvprefetch.controlplane.cli.predictor_option import add_predictor_option

BASELINES = ("last-gap", "empirical")
TABLE_COLUMNS = (
    ("gaps", "gaps", "{:d}"),
    ("mae_log_gap", "mae_log", "{:.3f}"),
    ("pinball_q10", "pin_q10", "{:.2f}"),
    ("pinball_q50", "pin_q50", "{:.2f}"),
    ("pinball_q90", "pin_q90", "{:.2f}"),
    ("mean_pinball", "pin_mean", "{:.2f}"),
    ("mean_pinball_log", "pin_log", "{:.4f}"),
    ("coverage_80", "cov80", "{:.3f}"),
    ("auc_return_60s", "auc60", "{:.3f}"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="trace file or folder")
    add_trace_format_option(parser)
    add_predictor_option(parser, several=True,
                         help="comma-separated predictors: NAME, NAME:ARTIFACT or "
                         "module:Class (last-gap and empirical always run)")
    parser.add_argument("--split", choices=("session", "time"), default="session")
    add_test_fraction_option(parser, allow_zero=False, default=0.25,
                             help="share of session groups held out for scoring "
                             "(default 0.25)")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="split and training seed")
    parser.add_argument("--limit-sessions", type=positive_int, default=None,
                        help="first N sessions")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the metrics here")
    parser.add_argument("--calibration-plot", default=None, metavar="PNG",
                        help="write reliability curves of P(return within h | silent for a) "
                        "here: one row per predictor, one panel per h, one line per a")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    if args.calibration_plot:  # written last: a missing matplotlib stops the run before it
        require_extra_module("matplotlib")
    from kvprefetch.predictors import registry
    from kvprefetch.predictors.evaluate import evaluate
    from kvprefetch.predictors.splits import split_trace

    progress = not args.no_progress and sys.stderr.isatty()
    specs = list(dict.fromkeys([*BASELINES, *args.predictors]))
    trace = load_trace_option(args.trace, args.trace_format, seed=args.seed,
                              limit_sessions=args.limit_sessions, progress=progress)
    split = split_trace(trace, args.split, args.test_fraction, args.seed)
    test_groups = {s.parent_id or s.session_id for s in split.test.sessions}
    results: dict[str, dict[str, Any]] = {}
    for spec in specs:
        model = registry.create(spec)
        trained_here = False
        if not getattr(model, "fitted", True):
            model.fit(split.train, seed=args.seed, progress=progress)  # type: ignore[attr-defined]
            trained_here = True
        else:
            seen = set(getattr(model, "train_info", {}).get("train_groups", ()))
            if seen & test_groups:
                print(f"warning: {spec!r} was trained on {len(seen & test_groups)} of the "
                      f"{len(test_groups)} test session groups: its scores are optimistic",
                      file=sys.stderr)
        metrics = evaluate(model, split.test)
        metrics["trained_on_train_split"] = trained_here
        results[spec] = metrics
    print(format_table(results))
    print()
    print(format_calibration_table(results))
    if args.json:
        write_json_atomic(Path(args.json), {"predictors": results, **split.describe(),
                                            "trace": trace.name})
    if args.calibration_plot:
        write_calibration_plot(results, Path(args.calibration_plot))
        print(f"wrote {args.calibration_plot}")
    return 0


def format_table(results: dict[str, dict[str, Any]]) -> str:
    width = max([len("predictor"), *(len(n) for n in results)])
    head = "predictor".ljust(width) + "".join(f"{c:>10}" for _, c, _ in TABLE_COLUMNS)
    lines = [head, "-" * len(head)]
    for name, m in results.items():
        cells = []
        for key, _, fmt in TABLE_COLUMNS:
            v = m.get(key)
            missing = v is None or (isinstance(v, float) and math.isnan(v))
            cells.append(f"{'nan' if missing else fmt.format(v):>10}")
        lines.append(name.ljust(width) + "".join(cells))
    return "\n".join(lines)


def format_calibration_table(results: dict[str, dict[str, Any]]) -> str:
    """ECE per (a, h) cell, one block of rows per predictor; ``n`` counts the idle periods
    still silent at ``a`` (the same for every ``h``)."""
    with_cal = {name: m["calibration"] for name, m in results.items() if "calibration" in m}
    if not with_cal:
        return "calibration: not measured"
    horizons = next(iter(with_cal.values()))["horizons_s"]
    width = max([len("predictor"), *(len(n) for n in with_cal)])
    head = ("predictor".ljust(width) + f"{'a_s':>6}{'n':>8}"
            + "".join(f"{f'h={h:g}s':>9}" for h in horizons))
    lines = [f"calibration: ECE of P(return within h | silent for a), "
             f"{next(iter(with_cal.values()))['bins']} equal-width bins", head, "-" * len(head)]
    for name, cal in with_cal.items():
        by_cell = {(c["a_s"], c["h_s"]): c for c in cal["cells"]}
        for i, a in enumerate(cal["silences_s"]):
            cells = [by_cell[(a, h)] for h in cal["horizons_s"]]
            eces = "".join(f"{_fmt(c['ece'], '{:.3f}'):>9}" for c in cells)
            lines.append((name if i == 0 else "").ljust(width)
                         + f"{a:>6g}{cells[0]['n']:>8d}" + eces)
    return "\n".join(lines)


def _fmt(value: Any, fmt: str) -> str:
    missing = value is None or (isinstance(value, float) and math.isnan(value))
    return "nan" if missing else fmt.format(value)


def write_calibration_plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    """Reliability curves (observed share vs mean forecast per bin): one row per predictor,
    one panel per horizon h, one line per silence a; the diagonal is perfect calibration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_cal = {name: m["calibration"] for name, m in results.items() if "calibration" in m}
    if not with_cal:
        return
    horizons = next(iter(with_cal.values()))["horizons_s"]
    fig, axes = plt.subplots(len(with_cal), len(horizons), squeeze=False,
                             figsize=(4.2 * len(horizons), 3.9 * len(with_cal)))
    for row, (name, cal) in enumerate(with_cal.items()):
        for col, h in enumerate(horizons):
            ax = axes[row][col]
            ax.plot([0, 1], [0, 1], color="0.6", linestyle=":", linewidth=1)
            for cell in (c for c in cal["cells"] if c["h_s"] == h):
                pts = [(b["mean_p"], b["observed"]) for b in cell["bins"] if b["n"]]
                if not pts:
                    continue
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o", markersize=3,
                        label=f"a={cell['a_s']:g}s (ECE {_fmt(cell['ece'], '{:.3f}')}, "
                        f"n={cell['n']})")
            ax.set_xlim(0, 1)
            ax.set_ylim(0, 1)
            ax.set_title(f"{name}: return within {h:g} s")
            ax.set_xlabel("forecast P (bin mean)")
            ax.set_ylabel("observed share")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    atomic.save_figure_atomic(fig, path)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """The report as JSON, NaN written as null, atomically."""
    atomic.write_json_atomic(path, _finite(data), sort_keys=False)


def _finite(value: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
