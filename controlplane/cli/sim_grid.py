"""``kvprefetch sim-grid``: judge a policy over traces x fleet sizes x loads x seeds.

A policy change is judged on several traces, seeds, loads and fleet sizes, never on one
run: single runs of a closed-loop replay are chaotic (a decision that moves one request
moves every later one), so only aggregates over many settings decide. This command runs
``kvprefetch sim`` once per cell of the grid (every policy of ``--policies`` in each) in
parallel worker processes, then summarises the subject policy (``--subject``, default
``predictive``) per trace and over all cells: the geometric mean of its returning mean
and p90 TTFT over ``ondemand``'s and over the best baseline's, the cells where it is worse
than ``ondemand`` (mean or p90), the cells where a baseline leads it (mean) and which, and
the forecast gap closure (reactive -> perfect): its median over the cells that have one,
and every cell that has none, with the reason. The best baseline of a cell is, for the
mean and for the p90 apart, the best of the baselines run other than the subject
(:data:`~kvprefetch.controlplane.core.policies.BASELINE_NAMES`: ``ondemand``, ``queue``,
the published peers and ``reactive``). Every policy of a grid runs on one engine profile
(``--engine``). A table on
the terminal, every cell and the summary in ``--json`` (written atomically), and with
``--plot`` a PNG: per trace, the subject's ratio to ``ondemand`` (top) and to the best
baseline (bottom, each cell a baseline leads marked with its name) in every cell against
the load, one series per fleet size.

Traces may be files, folders or synthetic traffic (``synthetic:PROFILE[:SESSIONS]``,
drawn from each cell's seed): the way to check a gain on traffic the predictor has
never seen.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvprefetch.controlplane.base.errors import ConfigError
from kvprefetch.controlplane.cli.options import positive_int
from kvprefetch.controlplane.cli.predictor_option import add_predictor_option
from kvprefetch.controlplane.cli.sim import (
    DEFAULT_SIM_SESSION_RATE_PER_S,
    add_engine_argument,
    add_hint_arguments,
    add_shard_arguments,
    check_shards,
    hint_config,
)
from kvprefetch.controlplane.core.engines import DEFAULT_ENGINE
from kvprefetch.controlplane.core.policies import BASELINE_NAMES, SIM_POLICIES

if TYPE_CHECKING:
    from kvprefetch.controlplane.sim.hints import HintConfig

EPILOG = """\
examples:
  kvprefetch sim-grid --traces synthetic:agentic,synthetic:chat,synthetic:research \\
      --nodes 2,4,8 --loads 0.5,1,2 --seeds 0,1 --json out/grid.json --plot out/grid.png
  kvprefetch sim-grid --traces kv-cache-tester/traces --nodes 2,4 --loads 1 \\
      --seeds 0,1,2 --policies ondemand,queue,predictive --subject queue
  kvprefetch sim-grid --traces synthetic:research --hints user_typing,tool_running \
      --hint-coverage 1
  kvprefetch sim-grid --traces kv-cache-tester/traces,synthetic:agentic --nodes 4,8 \\
      --loads 1,2 --seeds 0 --policies ondemand,predictive --shards 2 --shared-tier

kv-cache-tester/traces is the full public Claude Code set, the traces/ folder of
github.com/callanjfox/kv-cache-tester.
"""

#: A ratio above 1 + this counts as worse (rounding of the reported TTFTs aside).
WORSE_TOLERANCE = 5e-4
#: The policies a grid runs unless told otherwise: the baselines, predictive and perfect.
DEFAULT_GRID_POLICIES = ",".join((*BASELINE_NAMES, "predictive", "perfect"))


def best_baseline(policies: dict[str, Any], subject: str, key: str) -> tuple[str, float]:
    """The baseline with the lowest returning ``key`` (``ttft_mean_s``, ``ttft_p90_s``) in
    one cell's report, and that value: every policy of :data:`BASELINE_NAMES` that ran but
    the subject (ties to the first in run order)."""
    pairs = [(name, float(p["returning"][key])) for name, p in policies.items()
             if name != subject and name in BASELINE_NAMES]
    if not pairs:
        raise ConfigError(f"no baseline beside {subject!r} in the cell")
    return min(pairs, key=lambda nv: nv[1])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("--traces", required=True,
                   help="comma-separated traces: files, folders or synthetic:PROFILE[:SESSIONS]")
    p.add_argument("--nodes", default="2,4,8", help="comma-separated fleet sizes (default 2,4,8)")
    p.add_argument("--loads", default="0.5,1,2",
                   help="comma-separated --load values (default 0.5,1,2)")
    p.add_argument("--seeds", default="0,1", help="comma-separated seeds (default 0,1)")
    p.add_argument("--policies", default=DEFAULT_GRID_POLICIES,
                   help=f"policies run in every cell, a comma-separated subset of: "
                   f"{', '.join(SIM_POLICIES)}; must include ondemand and the subject "
                   f"(default {DEFAULT_GRID_POLICIES})")
    add_engine_argument(p)
    p.add_argument("--subject", default="predictive",
                   help="the policy the summary judges (default predictive)")
    add_predictor_option(p, several=False, default="default",
                         help="the predictor of the policies that take one (default 'default')")
    p.add_argument("--model", default="8b", help="model preset: 8b or 70b (default 8b)")
    add_hint_arguments(p)
    add_shard_arguments(p)
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1,
                   help="cells run at once, one process each (default: all cores)")
    p.add_argument("--json", dest="json_out", help="write every cell and the summary here")
    p.add_argument("--plot", help="write a PNG here: per trace, the subject's ratio to "
                   "ondemand (returning mean TTFT) in every cell against the load, one "
                   "series per fleet size")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _numbers(flag: str, text: str, kind: type[int] | type[float]) -> list[Any]:
    out: list[Any] = []
    for raw in text.split(","):
        try:
            value = kind(raw.strip())
        except ValueError:
            raise ConfigError(f"{flag}: {raw.strip()!r} is not a {kind.__name__}") from None
        if flag == "--seeds" and value < 0:
            raise ConfigError(f"{flag}: {value} must be >= 0")
        if flag != "--seeds" and value <= 0:
            raise ConfigError(f"{flag}: {value} must be positive")
        out.append(value)
    return out


@dataclass(frozen=True, slots=True)
class Cell:
    """One run of the grid."""

    trace: str
    nodes: int
    load: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.trace} nodes={self.nodes} load={self.load:g} seed={self.seed}"


def _run_cell(cell: Cell, policies: str, predictor: str, model: str,
              hints: HintConfig | None, shards: tuple[int, bool] = (1, False),
              engine: str = DEFAULT_ENGINE) -> dict[str, Any]:
    """One cell's ``kvprefetch sim``, as the JSON of its report (in a worker process)."""
    from kvprefetch.controlplane.base.config import default_fleet
    from kvprefetch.controlplane.core.policies import parse_policies
    from kvprefetch.controlplane.sim.runner import SimOptions, run_policies
    from kvprefetch.controlplane.sim.simulator import clamp_to_window
    from kvprefetch.controlplane.traces import ArrivalOptions, load_trace

    fleet = default_fleet(model, cell.nodes)
    arrivals = ArrivalOptions(session_rate_per_s=DEFAULT_SIM_SESSION_RATE_PER_S, load=cell.load)
    trace = load_trace(cell.trace, arrivals=arrivals, seed=cell.seed)
    trace = clamp_to_window(trace, fleet.model.max_context_tokens)
    options = SimOptions(predictor=predictor, seed=cell.seed, hints=hints, shards=shards[0],
                         shared_tier=shards[1], engine=engine)
    report = run_policies(trace, fleet, parse_policies(policies, peers=True), options)
    return report.to_dict()


def _hint_kinds_text(hints: HintConfig | None) -> str | None:
    """The hint kinds sent, by their API names (as ``sim``'s report names them)."""
    from kvprefetch.controlplane.sim.hints import hint_kind_names

    return None if hints is None else ",".join(hint_kind_names(hints.kinds))


def _ratio_row(cell: Cell, report: dict[str, Any], subject: str) -> dict[str, Any]:
    from kvprefetch.controlplane.sim.metrics import forecast_gap_closure

    pol = report["policies"]

    def ret(name: str, key: str) -> float:
        return float(pol[name]["returning"][key])

    od, od90 = ret("ondemand", "ttft_mean_s"), ret("ondemand", "ttft_p90_s")
    mean, p90 = ret(subject, "ttft_mean_s"), ret(subject, "ttft_p90_s")
    best_name, best = best_baseline(pol, subject, "ttft_mean_s")
    best90_name, best90 = best_baseline(pol, subject, "ttft_p90_s")
    leads = mean > best * (1 + WORSE_TOLERANCE)
    closure, no_closure = forecast_gap_closure(
        {name: ret(name, "ttft_mean_s") for name in pol}, subject)
    return {"trace": cell.trace, "nodes": cell.nodes, "load": cell.load, "seed": cell.seed,
            "ratio_mean": mean / od, "ratio_p90": p90 / od90,
            "worse_than_ondemand": mean > od * (1 + WORSE_TOLERANCE)
            or p90 > od90 * (1 + WORSE_TOLERANCE),
            "worse_than_best": leads,
            "best_mean_policy": best_name, "best_mean_s": best,
            "best_p90_policy": best90_name, "best_p90_s": best90,
            "ratio_mean_best": mean / best, "ratio_p90_best": p90 / best90,
            # The baseline that leads the subject on the mean, and by how much (its
            # mean is this fraction lower); None where none leads.
            "leader": best_name if leads else None,
            "lead_fraction": 1.0 - best / mean if leads else None,
            "forecast_gap_closure": closure, "no_closure": no_closure,
            "pressure_ratio": report["meta"]["pressure_ratio"],
            "policies": {name: p["returning"] | {"prefetched_bytes": p["prefetched_bytes"],
                                                 "wasted_bytes": p["wasted_bytes"]}
                         for name, p in pol.items()}}


def _geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summarize_rows(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The subject over ``rows``: geometric means of its ratios to ondemand and to the best
    baseline, the cells worse than ondemand, the cells a baseline leads (and how many each
    leads, and the largest lead), the median forecast gap closure over the cells that have
    one and how many have none."""
    closures = [r["forecast_gap_closure"] for r in rows if r["forecast_gap_closure"] is not None]
    leaders: dict[str, int] = {}
    for r in rows:
        if r["leader"] is not None:
            leaders[r["leader"]] = leaders.get(r["leader"], 0) + 1
    leads = [r["lead_fraction"] for r in rows if r["lead_fraction"] is not None]
    return {"cells": len(rows),
            "ratio_mean_geomean": _geomean([r["ratio_mean"] for r in rows]),
            "ratio_p90_geomean": _geomean([r["ratio_p90"] for r in rows]),
            "ratio_mean_best_geomean": _geomean([r["ratio_mean_best"] for r in rows]),
            "ratio_p90_best_geomean": _geomean([r["ratio_p90_best"] for r in rows]),
            "worse_than_ondemand": sum(r["worse_than_ondemand"] for r in rows),
            "worse_than_best": sum(r["worse_than_best"] for r in rows),
            "leaders": dict(sorted(leaders.items())),
            "largest_lead_fraction": max(leads) if leads else None,
            "forecast_gap_closure_median": statistics.median(closures) if closures else None,
            "cells_without_closure": len(rows) - len(closures)}


def format_summary(summary: dict[str, dict[str, Any]], subject: str) -> str:
    head = (f"{'trace':34s} {'cells':>5s} {subject + '/ondemand mean':>24s} {'p90':>6s} "
            f"{'/best mean':>10s} {'p90':>6s} {'worse than od':>13s} {'best leads':>10s} "
            f"{'closure':>7s} {'none':>4s}  leaders")
    lines = [head, "-" * len(head)]
    for name, s in summary.items():
        closure = s["forecast_gap_closure_median"]
        leaders = ", ".join(f"{k} {v}" for k, v in s["leaders"].items()) or "-"
        lines.append(f"{name[-34:]:34s} {s['cells']:5d} {s['ratio_mean_geomean']:24.3f} "
                     f"{s['ratio_p90_geomean']:6.3f} {s['ratio_mean_best_geomean']:10.3f} "
                     f"{s['ratio_p90_best_geomean']:6.3f} {s['worse_than_ondemand']:13d} "
                     f"{s['worse_than_best']:10d} "
                     f"{'n/a' if closure is None else f'{closure:.2f}':>7s} "
                     f"{s['cells_without_closure']:4d}  {leaders}")
    return "\n".join(lines)


def write_grid_plot(rows: Sequence[dict[str, Any]], subject: str, path: str) -> None:
    """One column per trace: ``subject``'s returning mean TTFT over ondemand's (top) and
    over the cell's best baseline's (bottom; a cell where a baseline leads is labelled
    with its name) in every cell (a point per seed, the line through their geometric
    means) against the load, one colour per fleet size; below 1 the subject wins."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvprefetch.controlplane.sim.report import save_figure_atomic

    traces = list(dict.fromkeys(r["trace"] for r in rows))
    fig, axes = plt.subplots(2, len(traces), figsize=(4.2 * len(traces), 7.6),
                             squeeze=False, sharey="row")
    for col, trace in enumerate(traces):
        mine = [r for r in rows if r["trace"] == trace]
        _plot_ratio(axes[0][col], mine, "ratio_mean", trace)
        _plot_ratio(axes[1][col], mine, "ratio_mean_best", trace)
        for r in mine:
            if r["leader"] is not None:
                axes[1][col].annotate(r["leader"], (r["load"], r["ratio_mean_best"]),
                                      fontsize=6, alpha=0.8, xytext=(3, 2),
                                      textcoords="offset points")
    axes[0][0].set_ylabel(f"{subject} / ondemand, returning mean TTFT")
    axes[1][0].set_ylabel(f"{subject} / best baseline, returning mean TTFT")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    save_figure_atomic(fig, path)


def _plot_ratio(ax: Any, mine: Sequence[dict[str, Any]], key: str, trace: str) -> None:
    """One panel: ``key`` of every cell of one trace against the load, per fleet size."""
    for nodes in sorted({r["nodes"] for r in mine}):
        cells = [r for r in mine if r["nodes"] == nodes]
        loads = sorted({r["load"] for r in cells})
        points = ax.scatter([r["load"] for r in cells], [r[key] for r in cells],
                            s=14, alpha=0.6)
        ax.plot(loads, [_geomean([r[key] for r in cells if r["load"] == load])
                        for load in loads],
                color=points.get_facecolor()[0],
                label=f"{nodes} node{'s' if nodes > 1 else ''}")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["load"] for r in mine}),
                  [f"{load:g}" for load in sorted({r["load"] for r in mine})])
    ax.minorticks_off()
    ax.set_xlabel("load")
    ax.set_title(trace[-40:], fontsize=9)
    ax.grid(True, which="both", alpha=0.3)


def run(args: argparse.Namespace) -> int:
    if args.plot:  # the plot is written last: a missing matplotlib stops the grid before it runs
        from kvprefetch.controlplane.cli.options import require_extra_module

        require_extra_module("matplotlib")
    from tqdm import tqdm

    from kvprefetch.controlplane.base.atomic import write_atomic
    from kvprefetch.controlplane.base.config import default_fleet
    from kvprefetch.controlplane.core.policies import parse_policies
    from kvprefetch.predictors.registry import resolve

    traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    if not traces:
        raise ConfigError("--traces: give at least one trace")
    nodes = _numbers("--nodes", args.nodes, int)
    loads = _numbers("--loads", args.loads, float)
    seeds = _numbers("--seeds", args.seeds, int)
    names = [p.name for p in parse_policies(args.policies, peers=True)]
    for needed in ("ondemand", args.subject):
        if needed not in names:
            raise ConfigError(f"--policies must include {needed!r} (the summary compares "
                              f"{args.subject!r} with ondemand)")
    resolve(args.predictor)
    default_fleet(args.model, nodes[0])  # an unknown --model fails here, not in every cell
    check_shards(args)
    # Each cell's hints are drawn from its own seed, as `sim --seed S --hints ...` would.
    hints = {s: hint_config(args, seed=s) for s in seeds}
    cells = [Cell(t, n, load, s) for t in traces for n in nodes for load in loads for s in seeds]
    reports: dict[Cell, dict[str, Any]] = {}
    bar = tqdm(total=len(cells), unit="cell", desc="sim-grid",
               disable=args.no_progress or not sys.stderr.isatty())
    with bar, ProcessPoolExecutor(max_workers=min(args.workers, len(cells))) as pool:
        futures = {pool.submit(_run_cell, c, args.policies, args.predictor, args.model,
                               hints[c.seed], (args.shards, args.shared_tier), args.engine): c
                   for c in cells}
        for fut in as_completed(futures):
            cell = futures[fut]
            try:
                reports[cell] = fut.result()
            except Exception as exc:
                for other in futures:
                    other.cancel()
                raise ConfigError(f"cell {cell.name}: {exc}") from exc
            bar.update(1)
    rows = [_ratio_row(c, reports[c], args.subject) for c in cells]
    summary = {t: summarize_rows([r for r in rows if r["trace"] == t]) for t in traces}
    if len(traces) > 1:
        summary["all"] = summarize_rows(rows)
    for r in rows:
        print(f"{r['trace'][-34:]:34s} nodes {r['nodes']:2d} load {r['load']:4g} seed "
              f"{r['seed']:2d}: {args.subject}/ondemand {r['ratio_mean']:.3f} "
              f"(p90 {r['ratio_p90']:.3f}); /best {r['ratio_mean_best']:.3f} "
              f"({r['best_mean_policy']}; p90 {r['ratio_p90_best']:.3f}, "
              f"{r['best_p90_policy']})"
              + ("  worse than ondemand" if r["worse_than_ondemand"] else "")
              + (f"  {r['leader']} leads by {r['lead_fraction']:.1%}"
                 if r["leader"] is not None else "")
              + (f"; closure {r['forecast_gap_closure']:.3f}"
                 if r["forecast_gap_closure"] is not None
                 else f"; no closure: {r['no_closure']}"))
        print("    returning mean s: " + ", ".join(
            f"{name} {p['ttft_mean_s']:.3f}" for name, p in r["policies"].items()))
    print()
    print(format_summary(summary, args.subject))
    if args.json_out:
        import json
        data = {"meta": {"traces": traces, "nodes": nodes, "loads": loads, "seeds": seeds,
                         "policies": names, "subject": args.subject, "engine": args.engine,
                         "predictor": args.predictor, "model": args.model,
                         "hints": _hint_kinds_text(hints[seeds[0]]), "shards": args.shards,
                         "shared_tier": args.shared_tier},
                "cells": rows, "summary": summary}
        write_atomic(args.json_out, [(json.dumps(data, indent=1) + "\n").encode()])
        print(f"wrote {args.json_out}")
    if args.plot:
        write_grid_plot(rows, args.subject, args.plot)
        print(f"wrote {args.plot}")
    return 0
