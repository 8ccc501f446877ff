"""``sim-grid`` judges its subject against the best baseline of each cell: ondemand, queue
every peer and reactive, for the mean and the p90 apart; never predictive or perfect; and
gives the forecast gap closure only where perfect is ahead of every policy."""

from __future__ import annotations

from typing import Any

import pytest

from kvprefetch.controlplane.cli.sim_grid import Cell, _ratio_row, best_baseline, summarize_rows


def _report(means: dict[str, tuple[float, float]]) -> dict[str, Any]:
    return {"meta": {"pressure_ratio": 3.0},
            "policies": {name: {"returning": {"ttft_mean_s": m, "ttft_p90_s": p90},
                                "prefetched_bytes": 0, "wasted_bytes": 0}
                         for name, (m, p90) in means.items()}}


def test_the_best_baseline_is_per_metric_and_leads_are_named() -> None:
    report = _report({"ondemand": (2.0, 5.0), "queue": (3.0, 4.0), "mori": (1.5, 6.0),
                      "predictive": (1.8, 4.5), "perfect": (0.5, 1.0)})
    assert best_baseline(report["policies"], "predictive", "ttft_mean_s") == ("mori", 1.5)
    assert best_baseline(report["policies"], "predictive", "ttft_p90_s") == ("queue", 4.0)
    row = _ratio_row(Cell("t", 2, 1.0, 0), report, "predictive")
    assert row["best_mean_policy"] == "mori" and row["best_p90_policy"] == "queue"
    assert row["ratio_mean_best"] == pytest.approx(1.8 / 1.5)
    assert row["ratio_p90_best"] == pytest.approx(4.5 / 4.0)
    assert row["worse_than_best"] and row["leader"] == "mori"
    assert row["lead_fraction"] == pytest.approx(1 - 1.5 / 1.8)
    calm = _ratio_row(Cell("t", 2, 2.0, 0), _report({
        "ondemand": (2.0, 5.0), "mori": (2.5, 6.0), "reactive": (1.5, 4.0),
        "predictive": (1.0, 3.0), "perfect": (0.5, 1.0)}), "predictive")
    assert calm["leader"] is None and calm["lead_fraction"] is None
    assert calm["forecast_gap_closure"] == pytest.approx(0.5) and calm["no_closure"] is None
    assert row["forecast_gap_closure"] is None and "reactive" in row["no_closure"]
    summary = summarize_rows([row, calm])
    assert summary["worse_than_best"] == 1 and summary["leaders"] == {"mori": 1}
    assert summary["largest_lead_fraction"] == pytest.approx(1 - 1.5 / 1.8)
    assert summary["ratio_mean_best_geomean"] == pytest.approx((1.2 * (1.0 / 1.5)) ** 0.5)
    assert summary["forecast_gap_closure_median"] == pytest.approx(0.5)
    assert summary["cells_without_closure"] == 1


def test_a_cell_where_perfect_is_not_ahead_is_listed_never_dropped_nor_above_one() -> None:
    row = _ratio_row(Cell("t", 2, 1.0, 0), _report({
        "ondemand": (2.0, 5.0), "reactive": (1.5, 4.0), "predictive": (0.4, 3.0),
        "perfect": (0.5, 1.0)}), "predictive")
    assert row["forecast_gap_closure"] is None
    assert row["no_closure"] == "perfect is not ahead of predictive (0.400 s < 0.500 s)"
    summary = summarize_rows([row])
    assert summary["cells_without_closure"] == 1
    assert summary["forecast_gap_closure_median"] is None
