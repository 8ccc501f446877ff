"""Render the result tables from the JSON beside the pages.

``python docs/results/generate.py`` rewrites, in every page of ``docs/results/``, the text
between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` with the tables rendered
from ``docs/results/data/NAME.json`` and the run's entry in ``data/runs.json`` (date,
commit, machine, command; written by ``run.py``). The docs hook (``docs/hooks.py``) renders
the same blocks at build time, so a page never shows figures other than its JSON's.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
#: The repository's README: its results summary is rendered from the same JSON.
README = HERE.parent.parent / "README.md"
GIB = 1 << 30
BLOCK = re.compile(r"(<!-- results:([a-z0-9-]+) -->\n)(.*?)(<!-- /results:\2 -->)", re.S)


def _load(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text())


def _runs() -> dict[str, Any]:
    path = DATA / "runs.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _gib(nbytes: Any) -> str:
    return "n/a" if nbytes is None else f"{nbytes / GIB:,.0f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


def run_block(name: str) -> list[str]:
    """The run's provenance: date, commit, machine, command, wall time."""
    run = _runs().get(name)
    if run is None:
        return [f"*(no entry for `{name}` in data/runs.json)*", ""]
    machine = run.get("machine", {})
    gpu = machine.get("gpu", "none")
    return [
        f"- **Run**: {run['date']}, commit `{run['commit']}`, "
        f"{machine.get('cores', '?')} CPU cores, GPU: {gpu}; wall time "
        f"{_num(run.get('wall_s'), 1)} s",
        f"- **Command**: `{run['command']}`",
        f"- **Data**: [`data/{name}.json`](data/{name}.json)",
        "",
    ]


def sim_table(name: str) -> list[str]:
    report = _load(name)
    meta = report["meta"]
    policies = report["policies"]
    base = policies.get("reactive", {}).get("returning", {}).get("ttft_mean_s")
    rows = []
    for policy, result in policies.items():
        ret = result.get("returning", {})
        ratio = ret.get("ttft_mean_s") / base if base else None
        rows.append([
            f"`{policy}`", _num(ret.get("requests")), _num(ret.get("ttft_mean_s")),
            _num(ret.get("ttft_p50_s")), _num(ret.get("ttft_p90_s")),
            _num(ret.get("ttft_p99_s")), _num(result.get("ttft_mean_s")),
            _num(ratio, 2), _num(result.get("stall_s"), 0),
            _num(result.get("prefetches")), _gib(result.get("prefetched_bytes")),
            _gib(result.get("wasted_bytes")), _gib(result.get("remote_bytes")),
        ])
    lines = [
        f"Trace `{meta['trace']}` ({_num(meta['sessions'])} sessions, "
        f"{_num(meta['requests'])} requests), {meta['nodes']} x {meta['model']}, "
        f"engine `{meta.get('engine')}`, predictor `{meta['predictor']}`, seed {meta['seed']}; "
        f"working set peak "
        f"{_gib(meta['working_set_peak_bytes'])} GiB vs local tiers "
        f"{_gib(meta['local_capacity_bytes'])} GiB (pressure {meta['pressure_ratio']}x).",
        "",
        *_table(["policy", "ret", "ret mean s", "ret p50 s", "ret p90 s", "ret p99 s",
                 "all mean s", "ret mean / reactive", "stall s", "prefetches",
                 "prefetched GiB", "wasted GiB", "remote GiB"], rows),
        "",
        *_yardstick_lines(report.get("yardstick") or {}),
    ]
    return lines


def _yardstick_lines(ys: dict[str, Any]) -> list[str]:
    """predictive / best baseline and the forecast gap closure, or why there is none."""
    closure = ys.get("forecast_gap_closure")
    return [
        f"`predictive` / best baseline (`{ys.get('best_baseline')}`), returning mean: "
        f"**{_num(ys.get('vs_best_baseline'))}**; p90 / the lowest baseline p90: "
        f"**{_num(ys.get('vs_best_baseline_p90'))}**.",
        "",
        (f"Forecast gap closure (reactive → perfect, returning mean): **{_num(closure)}**."
         if closure is not None else f"Forecast gap closure: none ({ys.get('no_closure')})."),
    ]


def grid_table(name: str) -> list[str]:
    report = _load(name)
    meta = report["meta"]
    subject = meta.get("subject", "predictive")
    rows = []
    for trace, summary in report["summary"].items():
        leaders = ", ".join(f"`{p}` {n}" for p, n in summary.get("leaders", {}).items())
        rows.append([
            f"`{trace}`" if trace != "all" else "**all**", _num(summary["cells"]),
            _num(summary["ratio_mean_best_geomean"]), _num(summary["ratio_p90_best_geomean"]),
            _num(summary["ratio_mean_geomean"]), _num(summary["worse_than_best"]),
            leaders or "-", _num(summary["forecast_gap_closure_median"]),
            _num(summary["cells_without_closure"]),
        ])
    cells = []
    for cell in report["cells"]:
        subj = cell["policies"].get(subject, {})
        perfect = cell["policies"].get("perfect", {})
        cells.append([
            f"`{cell['trace']}`", str(cell["nodes"]), _num(cell["load"], 1), str(cell["seed"]),
            _num(cell.get("pressure_ratio"), 2), _num(cell["ratio_mean_best"]),
            f"`{cell['best_mean_policy']}`", _num(cell["ratio_p90_best"]),
            _num(cell.get("forecast_gap_closure")) if cell.get("no_closure") is None
            else f"none: {cell['no_closure']}",
            _gib(subj.get("prefetched_bytes")), _gib(subj.get("wasted_bytes")),
            _gib(perfect.get("prefetched_bytes")),
        ])
    return [
        f"Engine `{meta.get('engine')}`; subject `{subject}`; policies in every cell: "
        f"{', '.join(f'`{p}`' for p in meta['policies'])}; predictor `{meta['predictor']}`, "
        f"model {meta['model']}, hints: {meta.get('hints') or 'none'}.",
        "",
        "Summary per trace (ratios are the subject's returning-request TTFT over the cell's "
        "best baseline's, or over `ondemand`'s: below 1 the subject is ahead; geometric mean "
        "over the cells). The closure is the median over the cells that have one; `none` "
        "counts the cells where `perfect` is not ahead of every policy (each listed below):",
        "",
        *_table(["trace", "cells", "/ best mean", "/ best p90", "/ ondemand mean",
                 "cells a baseline leads", "leaders", "closure (median)", "none"], rows),
        "",
        "Every cell:",
        "",
        *_table(["trace", "nodes", "load", "seed", "pressure", "/ best mean", "best",
                 "/ best p90", "forecast gap closure", f"{subject} prefetched GiB",
                 f"{subject} wasted GiB", "perfect prefetched GiB"], cells),
    ]


def control_plane_table(name: str) -> list[str]:
    report = _load(name)
    modes = report["modes"]
    inproc = modes.get("inproc", {}).get("events_per_s")
    rows = []
    http_rows = []
    for mode, result in modes.items():
        bps = result.get("bytes_per_session")
        # An http mode: a row per caller count of its separate load process.
        levels = result.get("callers") or {}
        for n, r in levels.items():
            http_rows.append([f"`{mode}`", str(n), _num(r.get("events_per_s"), 0),
                              _num(r.get("route_p50_ms")), _num(r.get("route_p99_ms")),
                              _num(r.get("lost_events")), _num(r.get("generator_cores"), 2)])
        if levels:
            continue
        rate = result.get("events_per_s")
        rows.append([
            f"`{mode}`", _num(rate, 0), _num(rate / inproc if rate and inproc else None, 3),
            _num(result.get("route_p50_ms")), _num(result.get("route_p99_ms")),
            _num(result.get("plan_p99_ms")),
            "n/a" if bps is None else _num(int(bps)), _num(result.get("lost_events")),
        ])
    extra = {k: v for k, v in report.items() if k != "modes" and not isinstance(v, dict | list)}
    setting = ", ".join(f"{k} {v}" for k, v in sorted(extra.items()))
    out = [
        f"Setting: {setting}." if setting else "",
        "",
        *_table(["mode", "events/s", "events/s vs inproc", "route p50 ms", "route p99 ms",
                 "planning step p99 ms", "bytes per idle session", "lost events"], rows),
    ]
    if http_rows:
        out += ["", "The HTTP API from a separate load process, by concurrent callers "
                "(each on its own connection, route then request_finished, closed loop):", "",
                *_table(["mode", "callers", "events/s", "route p50 ms", "route p99 ms",
                         "lost events", "load process cores"], http_rows)]
    return out


def store_table(name: str) -> list[str]:
    report = _load(name)
    mib = 1 << 20
    rows = []
    for condition, stores in report["conditions"].items():
        for store, r in stores.items():
            runs = ", ".join(_num(v, 0) for v in r.get("engine_runs_mib_s", []))
            naive_runs = ", ".join(_num(v, 0) for v in r.get("naive_runs_mib_s", []))
            rows.append([
                condition, f"`{store}`", _num(r.get("ttlb_s")),
                _num(r.get("throughput_mib_s"), 0), runs, _num(r.get("naive_ttlb_s")),
                _num(r.get("naive_throughput_mib_s"), 0), naive_runs,
                _num(r.get("speedup_vs_naive"), 2), _num(r.get("fraction_of_raw"), 2),
            ])
    load = report.get("load_avg_1m")
    load_text = " / ".join(_num(v, 2) for v in load) if isinstance(load, list) else _num(load)
    return [
        f"Object {report['object_bytes'] // mib} MiB in {report['chunks']} chunks of "
        f"{report['chunk_bytes'] // mib} MiB (parts of {report['part_bytes'] // mib} MiB); "
        f"S3 backend {report.get('s3_backend')}; {report.get('repeats_loopback')} interleaved "
        f"repeats, {report.get('statistic', 'medians')}; bytes verified: "
        f"{report.get('verified')}. Raw limit (a plain Valkey GET loop on one connection): "
        f"{_num(report.get('raw_limit_mib_s'), 0)} MiB/s median, best "
        f"{_num(report.get('raw_limit_best_mib_s'), 0)}. Load average while it ran "
        f"(1 min, before / after): {load_text} on {report.get('cpus')} CPUs.",
        "",
        *_table(["condition", "store", "TTLB s", "MiB/s", "MiB/s per run", "naive TTLB s",
                 "naive MiB/s", "naive MiB/s per run", "speedup vs naive",
                 "of raw limit"], rows),
        "",
        "\"naive\" reads chunk after chunk on one connection, one plain GET per value; the "
        "transfer "
        "engine is what the agent runs. \"of raw limit\" is the engine's rate over the raw "
        "Valkey loop's in the same run.",
    ]


def _headline(name: str) -> str:
    """One sentence of what a run found, from its JSON."""
    report = _load(name)
    if name.startswith("sim-ablation"):
        ret = {p: r.get("returning", {}).get("ttft_mean_s")
               for p, r in report["policies"].items()}
        parts = [f"{p.removeprefix('predictive-')} {_num(m / ret['predictive'], 3)}"
                 for p, m in ret.items() if p.startswith("predictive-")]
        return ("returning mean over predictive's, each decision's forecast off: "
                + "; ".join(parts))
    if name.startswith("sim-bundled"):
        ret = {p: r.get("returning", {}).get("ttft_mean_s") for p, r in report["policies"].items()}
        ratio = ret["predictive"] / ret["ondemand"] if ret.get("ondemand") else None
        ys = report.get("yardstick") or {}
        closure = ys.get("forecast_gap_closure")
        return (f"{report['meta']['nodes']} node(s), engine {report['meta'].get('engine')}: "
                f"predictive / best baseline ({ys.get('best_baseline')}) returning mean "
                f"{_num(ys.get('vs_best_baseline'), 3)}; predictive / ondemand "
                f"{_num(ratio, 2)}; forecast gap closure "
                + (_num(closure, 2) if closure is not None else f"none ({ys.get('no_closure')})"))
    if name.startswith("yardstick-"):
        total = report["summary"]["all"]
        leaders = ", ".join(f"{p} {n}" for p, n in total.get("leaders", {}).items()) or "none"
        subject = report["meta"].get("subject", "predictive")
        return (f"{total['cells']} cells: {subject} / best baseline returning mean geomean "
                f"{_num(total['ratio_mean_best_geomean'], 3)}, p90 "
                f"{_num(total['ratio_p90_best_geomean'], 3)}; cells a baseline leads on the "
                f"mean: {total['worse_than_best']} ({leaders}); median forecast gap closure "
                f"{_num(total['forecast_gap_closure_median'], 2)}, "
                f"{total['cells_without_closure']} cells without one")
    if name == "bench-control-plane":
        modes = report["modes"]
        parts = []
        for mode, r in modes.items():
            levels = r.get("callers") or {}
            if levels:  # an http mode: its 32-caller figures (else its last count's)
                n, r = next(((n, v) for n, v in levels.items() if n == "32"),
                            list(levels.items())[-1])
                parts.append(f"{mode} x{n} {_num(r.get('events_per_s'), 0)} events/s, route "
                             f"p50 {_num(r.get('route_p50_ms'), 1)} ms")
            else:
                parts.append(f"{mode} {_num(r.get('events_per_s'), 0)} events/s")
        return "; ".join(parts)
    if name == "bench-store":
        stores = report["conditions"].get("loopback", {})
        parts = [f"{store} TTLB {_num(r.get('ttlb_s'))} s ({_num(r.get('speedup_vs_naive'), 2)}x "
                 f"naive)" for store, r in stores.items()]
        return f"{report['object_bytes'] >> 20} MiB on loopback: " + "; ".join(parts)
    return "see the page"


PAGES = {
    "sim-bundled-n1": "prefetch-quality.md",
    "sim-bundled-n2": "prefetch-quality.md",
    "sim-ablation-local-n2": "prefetch-quality.md",
    "yardstick-vllm-lmcache": "yardstick.md",
    "yardstick-vllm-lmcache-lazy": "yardstick.md",
    "yardstick-vllm-lmcache-hints": "yardstick.md",
    "yardstick-true-law": "yardstick.md",
    "bench-control-plane": "control-plane.md",
    "bench-store": "data-plane.md",
}


def summary_table(_name: str) -> list[str]:
    runs = _runs()
    rows = []
    for name, page in PAGES.items():
        if not (DATA / f"{name}.json").exists() or name not in runs:
            rows.append([f"[{name}]({page})", "not measured", "", "", ""])
            continue
        run = runs[name]
        rows.append([f"[{name}]({page})", run["date"], f"`{run['commit']}`",
                     f"{run['machine'].get('cores')} cores, GPU: {run['machine'].get('gpu')}",
                     _headline(name)])
    return _table(["run", "date", "commit", "machine", "headline"], rows)


#: What each run is, in the README's words.
WHAT = {
    "sim-bundled-n1": "`kvprefetch sim`, bundled Claude Code slice, 1 node",
    "sim-bundled-n2": "`kvprefetch sim`, bundled Claude Code slice, 2 nodes",
    "sim-ablation-local-n2": "`kvprefetch sim --engine local --ablation`, every client "
                             "hinting, 2 nodes: each forecast decision switched off alone",
    "yardstick-vllm-lmcache": "`kvprefetch sim-grid --engine vllm-lmcache`: bundled slice "
                              "and four synthetic profiles x 2/4/8 nodes x 3 loads x 3 seeds",
    "yardstick-vllm-lmcache-lazy": "`kvprefetch sim-grid --engine vllm-lmcache-lazy`: the "
                                   "same grid on LMCache's lazy offload",
    "yardstick-vllm-lmcache-hints": "`kvprefetch sim-grid --engine vllm-lmcache --hints "
                                    "user_typing,tool_running`: the same grid, every "
                                    "client hinting",
    "yardstick-true-law": "`kvprefetch sim-grid` with `true-law` as the subject: the four "
                          "synthetic profiles x 2/4/8 nodes x 3 loads x 3 seeds, forecasts "
                          "from their true gap laws",
    "bench-control-plane": "`kvprefetch bench control-plane`: scheduler events per second",
    "bench-store": "`kvprefetch bench store`: one session's KV into the local tier",
}


def readme_table(_name: str) -> list[str]:
    """The README's results summary: the same headlines, linking the pages."""
    runs = _runs()
    rows = [[WHAT.get(name, name), _headline(name) if name in runs else "not measured",
             f"[{page.removesuffix('.md')}](docs/results/{page})"]
            for name, page in PAGES.items() if (DATA / f"{name}.json").exists()]
    return _table(["run", "result", "page"], rows)


#: The grids the yardstick page compares, with how each is described in its row.
YARDSTICK_GRIDS = {
    "yardstick-vllm-lmcache": "`vllm-lmcache`",
    "yardstick-vllm-lmcache-hints": "`vllm-lmcache`, every client hinting",
    "yardstick-vllm-lmcache-lazy": "`vllm-lmcache-lazy`",
}


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def _tib(nbytes: float) -> str:
    return f"{nbytes / (GIB * 1024):,.1f} TiB"


def _mean_s(cell: dict[str, Any], policy: str) -> float:
    return float(cell["policies"][policy]["ttft_mean_s"])


def _total(cells: list[dict[str, Any]], policy: str, field: str) -> float:
    return float(sum(c["policies"][policy][field] for c in cells))


def grids_table(_name: str) -> list[str]:
    """One row per yardstick grid, computed from its cells: predictive against the best
    baseline (every cell, and the cells at pressure >= 2), against ``reactive``, the cells
    a baseline leads by more than 1%, the forecast gap closure and the bytes moved."""
    rows = []
    for name, label in YARDSTICK_GRIDS.items():
        if not (DATA / f"{name}.json").exists():
            continue
        cells = _load(name)["cells"]

        busy = [c for c in cells if c["pressure_ratio"] >= 2]
        vs_reactive = [_mean_s(c, "predictive") / _mean_s(c, "reactive") for c in cells]
        closures = sorted(c["forecast_gap_closure"] for c in cells
                          if c["forecast_gap_closure"] is not None)
        closure = closures[len(closures) // 2] if closures else None
        rows.append([
            label,
            f"{_num(_geomean([c['ratio_mean_best'] for c in cells]))}, "
            f"{_num(_geomean([c['ratio_p90_best'] for c in cells]))}",
            f"{_num(_geomean([c['ratio_mean_best'] for c in busy]))} ({len(busy)} cells)",
            f"{_num(_geomean(vs_reactive))}, {_num(max(vs_reactive))}",
            str(sum(1 for c in cells if c["ratio_mean_best"] > 1.01)),
            _num(closure, 2),
            f"{_tib(_total(cells, 'predictive', 'prefetched_bytes'))} "
            f"({_tib(_total(cells, 'predictive', 'wasted_bytes'))})",
            _tib(_total(cells, "perfect", "prefetched_bytes")),
        ])
    return _table(["grid", "predictive / best baseline (mean, p90)", "at pressure >= 2",
                   "predictive / reactive (geomean, worst cell)",
                   "cells a baseline leads by > 1%", "closure median",
                   "predictive prefetched (wasted)", "perfect prefetched"], rows)


def true_law_table(name: str) -> list[str]:
    """Per trace, each forecasting policy's returning mean over ``reactive``'s (geometric
    mean over the cells, and over those at pressure >= 2), then the grid's own tables."""
    cells = _load(name)["cells"]
    rows = []
    for trace in [*sorted({c["trace"] for c in cells}), "all"]:
        sel = [c for c in cells if trace in ("all", c["trace"])]
        busy = [c for c in sel if c["pressure_ratio"] >= 2]

        def vs_reactive(policy: str, group: list[dict[str, Any]]) -> str:
            return _num(_geomean([_mean_s(c, policy) / _mean_s(c, "reactive") for c in group]))

        rows.append([f"`{trace}`" if trace != "all" else "**all**", str(len(sel)),
                     *(vs_reactive(p, sel) for p in ("true-law", "predictive", "perfect")),
                     str(len(busy)),
                     *(vs_reactive(p, busy) for p in ("true-law", "predictive", "perfect"))])
    return [
        "Returning mean over `reactive`'s, geometric mean over the cells (below 1: ahead):",
        "",
        *_table(["trace", "cells", "true-law", "predictive", "perfect", "cells at pressure >= 2",
                 "true-law", "predictive", "perfect"], rows),
        "",
        *grid_table(name),
    ]


#: The demos the "simulated vs live" page shows, with how each is described.
SIM_VS_LIVE = {
    "emulated": "emulated GPU nodes, the main job as `make demo` runs it (client hints on); "
                "TTFT in service seconds",
    "lmcache-mp": "emulated GPU nodes, a real LMCache MP server per node "
                  "(`--backend lmcache-mp`); TTFT in service seconds",
    "vllm": "vLLM's CPU build + LMCache per node behind the gateway (`--engine vllm`); "
            "TTFT in wall seconds at the client",
}


def _interval(ci: list[float] | None, scale: float = 1.0, signed: bool = True) -> str:
    if not ci:
        return "n/a"
    fmt = "+.3f" if signed else ".3f"
    return f"[{ci[0] * scale:{fmt}}, {ci[1] * scale:{fmt}}]"


def _per_seed_lines(report: dict[str, Any]) -> list[str]:
    """Predictive's returning mean and p90 against ondemand's in each arrival seed."""
    seeds = {policy: {s["seed"]: s for s in report["policies"].get(policy, {})
                      .get("per_seed", [])} for policy in ("ondemand", "predictive")}
    parts, lower = [], 0
    for seed, pred in sorted(seeds["predictive"].items()):
        ond = seeds["ondemand"].get(seed)
        if ond is None:
            continue
        if pred["ttft_mean_s"] < ond["ttft_mean_s"] and pred["ttft_p90_s"] < ond["ttft_p90_s"]:
            lower += 1
        parts.append(f"seed {seed} {pred['ttft_mean_s']:.3f} / {pred['ttft_p90_s']:.3f} against "
                     f"{ond['ttft_mean_s']:.3f} / {ond['ttft_p90_s']:.3f}")
    if not parts:
        return []
    return ["Per arrival seed, predictive's returning mean / p90 (s) against ondemand's: "
            + "; ".join(parts) + f"; lower on both in {lower} of {len(parts)} seeds.", ""]


def sim_vs_live_table(_name: str) -> list[str]:
    """Per demo: its provenance, then live against the calibrated twin (returning means,
    paired per request) and predictive against ondemand (live and twin), as a terminal
    table, the calibration and whether the targets are met."""
    path = DATA / "sim-vs-live.json"
    if not path.exists():
        return ["*(not measured: data/sim-vs-live.json is missing)*"]
    data = json.loads(path.read_text())
    lines: list[str] = []
    for demo, label in SIM_VS_LIVE.items():
        entry = data.get(demo)
        lines += [f"### `{demo}`: {label}", ""]
        if entry is None:
            lines += ["*(not measured)*", ""]
            continue
        report, machine = entry["report"], entry["machine"]
        meta, twin = report["meta"], report["twin"]
        lines += [
            f"- **Run**: {entry['date']}, commit `{entry['commit']}`, "
            f"{machine.get('cores', '?')} CPU cores, GPU: {machine.get('gpu', 'none')}; wall "
            f"time {_num(entry.get('wall_s'), 1)} s",
            f"- **Command**: `{entry['command']}`",
            f"- **Replay**: {meta['requests']} requests of {meta['sessions']} sessions per "
            f"policy over {meta['repeats']} arrival seeds from {meta['seed']}, "
            f"{meta['nodes']} nodes, {_num(float(meta['time_compression']), 0)}x "
            f"compression, pressure up to {_num(meta['pressure_ratio'], 2)}x",
            "- **Data**: [`data/sim-vs-live.json`](data/sim-vs-live.json) "
            f"(key `{demo}`)", ""]
        tol = twin["targets"]
        boot = twin["bootstrap"]
        head = (f"{'policy':<11} {'live':>8} {'twin':>8} {'uncal.':>8} {'live/twin':>9} "
                f"{'<=20%':>6} {'pairs':>6} {'twin-live':>10} {'95% CI':>18}")
        rows = [head, "-" * len(head)]
        for policy, p in twin["policies"].items():
            d = p["paired_twin_minus_live"] or {}
            unc = report["simulated"].get(policy, {}).get("returning", {}).get("ttft_mean_s")
            rows.append(
                f"{policy:<11} {p['live_returning_mean_s']:>8.3f} "
                f"{p['twin_returning_mean_s']:>8.3f} {_num(unc):>8} "
                f"{_num(p['live_over_twin']):>9} {'yes' if p['within_tolerance'] else 'NO':>6} "
                f"{d.get('pairs', 0):>6} {d.get('diff_s', 0.0):>+10.3f} "
                f"{_interval(d.get('diff_ci95_s')):>18}")
        cmp = twin.get("predictive_vs_ondemand") or {}
        if cmp.get("live") and cmp.get("twin"):
            rows.append("")
            rows.append(f"{'predictive / ondemand':<22} {'ratio':>6} {'95% CI':>16} "
                        f"{'pred - ond':>10} {'95% CI':>18} {'pairs':>6}")
            for side in ("live", "twin"):
                c = cmp[side]
                rows.append(f"{side:<22} {c['ratio']:>6.3f} "
                            f"{_interval(c['ratio_ci95'], signed=False):>16} "
                            f"{c['diff_s']:>+10.3f} {_interval(c['diff_ci95_s']):>18} "
                            f"{c['pairs']:>6}")
        lines += ["```text", *rows, "```", ""]
        means_ok = all(p["within_tolerance"] for p in twin["policies"].values())
        verdict = [f"returning means within {tol['mean_tolerance']:.0%} of the twin's: "
                   + ("**met**" if means_ok else "**not met**")]
        if "ratio_gap" in cmp:
            verdict.append(f"predictive / ondemand within {tol['ratio_tolerance']} of the "
                           f"twin's: {'**met**' if cmp['within_tolerance'] else '**not met**'}"
                           f" (gap {cmp['ratio_gap']:.3f})")
        lines += ["Targets: " + "; ".join(verdict) + f". Intervals: bootstrap, "
                  f"{boot['resamples']} resamples, seed {boot['seed']}, {boot['method']}; "
                  "`uncal.` is the simulator on the fleet model before calibration.", ""]
        lines += _per_seed_lines(report)
        firsts = []
        for policy, p in report["policies"].items():
            n, ret = p["requests"], p["returning"]["requests"]
            if n > ret:
                mean = (p["ttft_mean_s"] * n - p["returning"]["ttft_mean_s"] * ret) / (n - ret)
                firsts.append(f"{policy} {mean:.3f}")
        check = report.get("machine")
        if check:
            lines += [f"Machine: the demo's own check, control-plane lag p90 "
                      f"{check['control_plane_lag_p90_ms']:.1f} ms = "
                      f"{check['lag_share']:.0%} of the median compressed gap (at most "
                      f"{check['limit_share']:.0%}): "
                      + ("carried" if check["carried"] else "**not carried**")
                      + "; first turns (nothing to load), live mean: "
                      + ", ".join(firsts) + ".", ""]
        cal = twin["calibration"]
        before, after = twin["fleet_before"], twin["fleet_after"]
        cal_rows = [[f"`{k}`", _num(float(before[k]), 6), _num(float(after[k]), 6)]
                    for k in before if before[k] != after[k]]
        lines += ["Calibrated figures of the twin's fleet model (service clock):", "",
                  *_table(["figure", "fleet model", "calibrated"], cal_rows), "",
                  "From: " + "; ".join(f"{k}: {v}" for k, v in
                                       sorted(cal["sources"].items())) + ".", ""]
    return lines


RENDERERS: dict[str, Callable[[str], list[str]]] = {
    "sim-vs-live": sim_vs_live_table,
    "summary": summary_table,
    "yardstick-grids": grids_table,
    "readme": readme_table,
    "sim-bundled-n1": sim_table,
    "sim-bundled-n2": sim_table,
    "sim-ablation-local-n2": sim_table,
    "yardstick-vllm-lmcache": grid_table,
    "yardstick-vllm-lmcache-lazy": grid_table,
    "yardstick-vllm-lmcache-hints": grid_table,
    "yardstick-true-law": true_law_table,
    "bench-control-plane": control_plane_table,
    "bench-store": store_table,
}


def render(name: str) -> str:
    """The Markdown of one result block: provenance, then the tables."""
    if name in ("summary", "readme", "yardstick-grids", "sim-vs-live"):
        return "\n".join([*RENDERERS[name](name), ""])
    if not (DATA / f"{name}.json").exists():
        return f"*(not measured: data/{name}.json is missing)*\n"
    return "\n".join([*run_block(name), *RENDERERS[name](name), ""])


def fill(markdown: str) -> str:
    """Every ``<!-- results:NAME -->`` block of ``markdown`` re-rendered from its JSON."""
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2)) + m.group(4), markdown)


def main() -> int:
    for page in [*sorted(HERE.glob("*.md")), README]:
        text = page.read_text()
        new = fill(text)
        if new != text:
            page.write_text(new)
            print(f"rewrote {page.relative_to(HERE.parent.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
