"""The default predictor's forecast hot path (kvprefetch.predictors.adaptive._read_curve) gives the
numbers of the survival curve's own methods, bit for bit (no decision may
change for speed)."""

from __future__ import annotations

import random

import numpy as np

from kvprefetch.controlplane.base.types import FORECAST_LEVELS, SurvivalCurve
from kvprefetch.predictors.adaptive import (
    BUCKETS,
    NEVER_S,
    RETURN_HORIZON_S,
    _read_curve,
    load_default,
)


def _curves() -> list[SurvivalCurve]:
    model = load_default()
    curves = [model.curve_of(b) for b in BUCKETS]
    # Edge shapes: no returning mass, a flat stretch, all mass at one knot.
    curves.append(SurvivalCurve((0.0, 10.0, 100.0), (1.0, 1.0, 1.0)))
    curves.append(SurvivalCurve((0.0, 10.0, 20.0, 100.0), (1.0, 0.5, 0.5, 0.0)))
    curves.append(SurvivalCurve((0.0, 1.0, 2.0), (1.0, 0.0, 0.0)))
    return curves


def test_read_curve_equals_the_curve_methods_bit_for_bit() -> None:
    rng = random.Random(3)
    for curve in _curves():
        neg = tuple(-v for v in curve.survival)
        knots = list(curve.gaps_s)
        probes = [0.0, -1.0, 1e9, *knots, *(k + 60.0 for k in knots[:50]),
                  *(rng.uniform(0, 1.1 * knots[-1]) for _ in range(3000)),
                  *(rng.uniform(0, 700) for _ in range(3000))]
        for a in probes:
            silence = max(0.0, a)
            q, p = _read_curve(curve, neg, silence)
            want_q = tuple(min(NEVER_S, curve.quantile_after(silence, lv))
                           for lv in FORECAST_LEVELS)
            assert q == want_q, (silence, q, want_q)
            assert p == curve.p_within(silence, RETURN_HORIZON_S), silence


def _reference_curve(grid: tuple[float, ...], seg: list[float], p_never: float
                     ) -> SurvivalCurve:
    """The bucket curve as plain Python loops build it: the reference."""
    from itertools import accumulate

    done = list(accumulate(seg))
    k = (1.0 - p_never) / done[-1]  # the running total (Python 3.12's sum() compensates)
    surv = [1.0, *(min(1.0, max(p_never, 1.0 - k * c)) for c in done)]
    surv = list(accumulate(surv, min))
    surv[-1] = p_never
    return SurvivalCurve(grid, tuple(surv))


def test_bucket_curve_equals_the_checked_construction_bit_for_bit() -> None:
    from kvprefetch.predictors.adaptive import GRID_S, _bucket_curve

    rng = random.Random(5)
    n = len(GRID_S) - 1
    for trial in range(60):
        seg = [rng.random() ** 3 * (1e-150 if trial % 7 == 0 else 1.0) for _ in range(n)]
        if trial % 5 == 0:
            for i in rng.sample(range(n), n // 2):
                seg[i] = 0.0
        p_never = rng.choice([0.0, 0.5, rng.random(), 1.0 - 1e-12])
        got, neg = _bucket_curve(GRID_S, np.array(seg), p_never)
        want = _reference_curve(GRID_S, seg, p_never)
        assert got.survival == want.survival
        assert got._areas() == want._areas()
        assert tuple(got._neg) == want._neg == tuple(neg)
        assert got == want


def test_forecasts_at_silence_zero_read_once_per_curve_are_the_curve_s_numbers() -> None:
    """A just-finished session's forecast comes from the bucket's memo while the bucket's
    curve stands, and from the new curve once gaps have rebuilt it."""
    from kvprefetch.controlplane.base.types import EventKind, SessionEvent
    from kvprefetch.predictors.adaptive import REBUILD_EVERY

    model = load_default()

    def turn(sid: str, start: float, end: float) -> None:
        model.observe(SessionEvent(EventKind.REQUEST_STARTED, sid, start))
        model.observe(SessionEvent(EventKind.REQUEST_FINISHED, sid, end,
                                   stop_reason="tool_use"))

    def check(sid: str, now: float) -> SurvivalCurve:
        fc = model.forecast(sid, now)
        assert fc is not None and fc.survival is not None
        neg = tuple(-v for v in fc.survival.survival)
        assert (fc.gap_quantiles_s, fc.p_return) == _read_curve(fc.survival, neg, 0.0)
        return fc.survival

    turn("a", 0.0, 1.0)
    turn("b", 0.0, 1.0)
    first = check("a", 1.0)
    assert check("b", 1.0) is first  # the memo's curve, same numbers
    bucket = model.idle_group("a")
    assert bucket is not None
    for _ in range(REBUILD_EVERY):  # gaps of the same bucket: its curve is rebuilt
        model._buckets[bucket].add_gap(30.0)
    turn("c", 500.0, 501.0)  # the same history as "a": the same bucket
    assert check("c", 501.0) is model.curve_of(bucket) is not first
