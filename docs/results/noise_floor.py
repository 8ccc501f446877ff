"""Measure how far one grid cell's figures move when nothing but the router's tie order
changes: the noise floor under the yardstick's per-cell comparisons.

Usage (from the repository root)::

    python docs/results/noise_floor.py                 # the grid below, 4 salts
    python docs/results/noise_floor.py --salts 6 --workers 2

Each cell (the yardstick's traces x 2/4/8 nodes x loads 0.5/1/2, seed 0, engine
``vllm-lmcache``) is replayed with ``router.tie_salt`` set to each of the salts: every
salt is an equally good router, the sessions that no node holds merely land on other
equal nodes. For each cell it records ``reactive``'s returning mean under every salt (its
spread, max / min, is what a change of no consequence does to the cell), and
``predictive``'s ratio to ``reactive`` under each salt, without hints and with every
client hinting. It writes ``docs/results/data/noise-floor.json`` (atomically) with the
date, the short commit, the command and the machine, and prints a summary table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "noise-floor.json"
TRACES = ("controlplane/data/traces/claude-code", "synthetic:agentic",
          "synthetic:agentic-nostop", "synthetic:chat", "synthetic:research")
NODES = (2, 4, 8)
LOADS = (0.5, 1.0, 2.0)
ENGINE = "vllm-lmcache"
#: The lead above which a single cell counts a policy as ahead (the yardstick's 1%).
LEAD = 0.01


def _cell(trace: str, nodes: int, load: float, salts: int) -> dict[str, Any]:
    """One cell under every salt: each policy's returning mean TTFT per salt."""
    from kvprefetch.controlplane.base.config import default_fleet
    from kvprefetch.controlplane.cli.sim import DEFAULT_SIM_SESSION_RATE_PER_S
    from kvprefetch.controlplane.core.policies import POLICIES
    from kvprefetch.controlplane.sim.hints import HintConfig, plan_hints
    from kvprefetch.controlplane.sim.runner import run_policy
    from kvprefetch.controlplane.sim.simulator import clamp_to_window
    from kvprefetch.controlplane.traces import ArrivalOptions, load_trace

    base = default_fleet("8b", nodes)
    arrivals = ArrivalOptions(session_rate_per_s=DEFAULT_SIM_SESSION_RATE_PER_S, load=load)
    trace_ = clamp_to_window(load_trace(trace, arrivals=arrivals, seed=0),
                             base.model.max_context_tokens)
    hints = plan_hints(trace_, HintConfig(seed=0))
    runs: dict[str, list[float]] = {"reactive": [], "predictive": [], "predictive+hints": []}
    for salt in range(salts):
        router = base.router.model_copy(update={"tie_salt": f"noise-{salt}" if salt else ""})
        fleet = base.model_copy(update={"router": router})
        for name, policy, h in (("reactive", "reactive", None),
                                ("predictive", "predictive", None),
                                ("predictive+hints", "predictive", hints)):
            run = run_policy(trace_, fleet, POLICIES[policy], "default", hints=h,
                             engine=ENGINE)
            runs[name].append(statistics.fmean(r.ttft_s for r in run.records if r.returning))
    return {"trace": trace, "nodes": nodes, "load": load, "seed": 0, "returning_mean_s": runs}


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summarize(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """What the salts say: ``reactive``'s spread per cell, and for each predictive variant
    the per-salt ratios to ``reactive``, their mean per cell, and how many single-salt
    cells and salt-averaged cells ``reactive`` leads by more than 1%."""
    spreads = [max(c["returning_mean_s"]["reactive"]) / min(c["returning_mean_s"]["reactive"])
               for c in cells]
    out: dict[str, Any] = {
        "cells": len(cells),
        "reactive_spread_median": statistics.median(spreads),
        "reactive_spread_max": max(spreads),
    }
    for name in ("predictive", "predictive+hints"):
        single: list[float] = []
        averaged: list[float] = []
        for c in cells:
            means = c["returning_mean_s"]
            ratios = [p / r for p, r in zip(means[name], means["reactive"], strict=True)]
            single.extend(ratios)
            averaged.append(statistics.fmean(means[name]) / statistics.fmean(means["reactive"]))
        out[name] = {
            "geomean_single": _geomean(single), "worst_single": max(single),
            "single_led": sum(r > 1 + LEAD for r in single), "single_runs": len(single),
            "geomean_averaged": _geomean(averaged), "worst_averaged": max(averaged),
            "averaged_led": sum(r > 1 + LEAD for r in averaged),
        }
    return out


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--salts", type=int, default=4, help="router tie salts per cell (default 4)")
    p.add_argument("--workers", type=int, default=2, help="cells run at once (default 2)")
    args = p.parse_args(argv)
    if args.salts < 2:
        p.error("--salts: at least 2 (a spread needs two)")
    started = time.monotonic()
    grid = [(t, n, load) for t in TRACES for n in NODES for load in LOADS]
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = [pool.submit(_cell, t, n, load, args.salts) for t, n, load in grid]
        cells = []
        for i, fut in enumerate(futures, 1):
            cells.append(fut.result())
            print(f"\r{i}/{len(grid)} cells", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    summary = summarize(cells)
    doc = {"command": "python docs/results/noise_floor.py " + " ".join(argv),
           "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"), "commit": _commit(),
           "machine": {"cores": os.cpu_count(), "gpu": "none"},
           "wall_s": round(time.monotonic() - started, 1), "engine": ENGINE,
           "salts": args.salts, "summary": summary, "cells": cells}
    tmp = DATA.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, DATA)
    print(f"{len(cells)} cells x {args.salts} salts; reactive's spread over salts: median "
          f"{summary['reactive_spread_median']:.3f}, max {summary['reactive_spread_max']:.3f}")
    print("| subject | / reactive, one salt (geomean, worst) | runs reactive leads > 1% "
          "| / reactive, salts averaged (geomean, worst) | cells reactive leads > 1% |")
    print("|---|---|---|---|---|")
    for name in ("predictive", "predictive+hints"):
        s = summary[name]
        print(f"| `{name}` | {s['geomean_single']:.3f}, {s['worst_single']:.3f} | "
              f"{s['single_led']} of {s['single_runs']} | {s['geomean_averaged']:.3f}, "
              f"{s['worst_averaged']:.3f} | {s['averaged_led']} of {summary['cells']} |")
    print(f"wrote {DATA}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
