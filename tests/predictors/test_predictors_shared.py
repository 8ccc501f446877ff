"""Learned predictors on a slice of the shared Claude Code traces (skipped when absent)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvprefetch.predictors import registry
from kvprefetch.predictors.evaluate import evaluate
from kvprefetch.predictors.splits import split_trace

TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces" / "claude-code"


@pytest.mark.slow
@pytest.mark.skipif(not TRACES.is_dir(), reason="shared Claude Code traces not present")
def test_gbm_beats_empirical_on_held_out_claude_code_sessions():
    from kvprefetch.controlplane.traces import load_trace

    trace = load_trace(TRACES, limit_sessions=160)
    split = split_trace(trace, "session", 0.25, seed=0)
    scores = {}
    for name in ("empirical", "gbm"):
        model = registry.create(name)
        model.fit(split.train, seed=0)  # type: ignore[attr-defined]
        scores[name] = evaluate(model, split.test)
    gbm, emp = scores["gbm"], scores["empirical"]
    assert gbm["mean_pinball_log"] < emp["mean_pinball_log"]
    assert gbm["auc_return_60s"] > emp["auc_return_60s"]
    assert 0.6 < gbm["coverage_80"] < 0.95
