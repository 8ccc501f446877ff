"""``kvprefetch sim-grid``: every cell is the sim it names, the summary is computed from
the cells, and bad grids are refused with the flag that is wrong."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvprefetch.controlplane.base.config import default_fleet
from kvprefetch.controlplane.cli import main
from kvprefetch.controlplane.cli.sim import DEFAULT_SIM_SESSION_RATE_PER_S
from kvprefetch.controlplane.core.policies import BASELINE_NAMES, parse_policies
from kvprefetch.controlplane.sim import SimOptions, run_policies
from kvprefetch.controlplane.sim.hints import HintConfig
from kvprefetch.controlplane.sim.simulator import clamp_to_window
from kvprefetch.controlplane.traces import ArrivalOptions, load_trace


def _sim_by_hand(trace_name: str, nodes: int, policies: str, options: SimOptions
                 ) -> dict[str, Any]:
    """``kvprefetch sim`` of one grid cell run by hand (the cell's seed is ``options.seed``)."""
    fleet = default_fleet("8b", nodes)
    trace = clamp_to_window(load_trace(
        trace_name, seed=options.seed,
        arrivals=ArrivalOptions(session_rate_per_s=DEFAULT_SIM_SESSION_RATE_PER_S)),
        fleet.model.max_context_tokens)
    return run_policies(trace, fleet, parse_policies(policies), options).to_dict()


def test_grid_cells_are_the_sims_they_name_and_the_summary_follows(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "grid.json", tmp_path / "grid.png"
    rc = main(["sim-grid", "--traces", "synthetic:research:24,synthetic:chat:24", "--nodes",
               "1,2", "--loads", "1", "--seeds", "0,3", "--workers", "2", "--no-progress",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(out.read_text())
    assert data["meta"]["subject"] == "predictive"
    assert len(data["cells"]) == 2 * 2 * 1 * 2
    assert list(data["summary"]) == ["synthetic:research:24", "synthetic:chat:24", "all"]
    # One cell, run again by hand as `kvprefetch sim` would: the same figures.
    cell = next(c for c in data["cells"] if c["trace"] == "synthetic:chat:24"
                and c["nodes"] == 2 and c["seed"] == 3)
    rep = _sim_by_hand("synthetic:chat:24", 2, "ondemand,queue,reactive,predictive,perfect",
                       SimOptions(seed=3))
    for name in ("ondemand", "queue", "reactive", "predictive", "perfect"):
        assert cell["policies"][name]["ttft_mean_s"] == rep["policies"][name]["returning"][
            "ttft_mean_s"]
    od = rep["policies"]["ondemand"]["returning"]["ttft_mean_s"]
    assert cell["ratio_mean"] == pytest.approx(
        rep["policies"]["predictive"]["returning"]["ttft_mean_s"] / od)
    # The summary is the cells' aggregate.
    cells = data["cells"]
    total = data["summary"]["all"]
    assert total["cells"] == len(cells)
    assert total["ratio_mean_geomean"] == pytest.approx(
        math.exp(sum(math.log(c["ratio_mean"]) for c in cells) / len(cells)))
    assert total["worse_than_ondemand"] == sum(c["worse_than_ondemand"] for c in cells)
    assert total["worse_than_best"] == sum(c["worse_than_best"] for c in cells)
    for c in cells:
        pol = c["policies"]
        best = min(pol[n]["ttft_mean_s"] for n in BASELINE_NAMES)  # the default runs them all
        assert c["worse_than_best"] == (pol["predictive"]["ttft_mean_s"] > best * 1.0005)
        assert (c["forecast_gap_closure"] is None) == (c["no_closure"] is not None)
    printed = capsys.readouterr().out
    assert "predictive/ondemand mean" in printed and "synthetic:research:24" in printed
    assert "returning mean s: ondemand" in printed and "closure" in printed
    assert total["cells_without_closure"] == sum(c["forecast_gap_closure"] is None
                                                 for c in cells)


@pytest.mark.parametrize("argv, words", [
    (["--nodes", "0"], "--nodes: 0 must be positive"),
    (["--loads", "fast"], "--loads: 'fast' is not a float"),
    (["--seeds", "-1"], "--seeds: -1 must be >= 0"),
    (["--policies", "queue,predictive"], "--policies must include 'ondemand'"),
    (["--subject", "perfect", "--policies", "ondemand,predictive"],
     "--policies must include 'perfect'"),
    (["--traces", "synthetic:nope"], "unknown synthetic profile 'nope'"),
    (["--model", "13b"], "unknown model '13b'"),
    (["--shards", "0"], "--shards must be 1-"),
])
def test_bad_grids_name_what_is_wrong(argv: list[str], words: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    base = {"--traces": "synthetic:chat:4", "--nodes": "1", "--loads": "1", "--seeds": "0"}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        base[flag] = value
    args = [x for kv in base.items() for x in kv]
    assert main(["sim-grid", *args, "--workers", "1", "--no-progress"]) == 2
    assert words in capsys.readouterr().err


def test_each_cell_draws_its_hints_from_its_own_seed(tmp_path: Path) -> None:
    out = tmp_path / "grid.json"
    assert main(["sim-grid", "--traces", "synthetic:agentic:12", "--nodes", "1", "--loads",
                 "1", "--seeds", "4", "--policies", "ondemand,predictive", "--hints",
                 "typing,tool", "--workers", "1", "--no-progress", "--json", str(out)]) == 0
    cell = json.loads(out.read_text())["cells"][0]
    rep = _sim_by_hand("synthetic:agentic:12", 1, "ondemand,predictive",
                       SimOptions(seed=4, hints=HintConfig(seed=4)))
    assert cell["policies"]["predictive"]["ttft_mean_s"] == rep["policies"]["predictive"][
        "returning"]["ttft_mean_s"]


def test_a_sharded_grid_runs_each_cell_with_its_shards_sharing_the_tier(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "grid.json"
    base = ["sim-grid", "--traces", "synthetic:agentic:16", "--nodes", "2", "--loads", "1",
            "--seeds", "1", "--policies", "ondemand,predictive", "--workers", "1",
            "--no-progress"]
    assert main([*base, "--shared-tier"]) == 2
    assert "--shared-tier needs --shards N" in capsys.readouterr().err
    assert main([*base, "--shards", "2", "--shared-tier", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert (data["meta"]["shards"], data["meta"]["shared_tier"]) == (2, True)
    rep = _sim_by_hand("synthetic:agentic:16", 2, "ondemand,predictive",
                       SimOptions(seed=1, shards=2, shared_tier=True))
    for name in ("ondemand", "predictive"):
        assert data["cells"][0]["policies"][name]["ttft_mean_s"] == rep["policies"][name][
            "returning"]["ttft_mean_s"]
