"""The simulator's report: :class:`SimReport` (what ``kvprefetch sim --json`` writes), its
terminal table and its PNG plot.

The records are frozen dataclasses; :meth:`SimReport.to_dict` and :meth:`SimReport.to_json`
give the JSON shape of ``--json`` (keys and their order are part of it: tools and the live
demo read it). Numbers are rounded where they are computed (:mod:`.metrics`), so the JSON
is byte-identical across runs, worker counts and platforms, ``wall_s`` aside.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvprefetch.controlplane.base.atomic import save_figure_atomic
from kvprefetch.controlplane.core.policies import POLICIES

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class TtftSummary:
    """Time to first token over a set of requests (seconds, rounded to 1 us)."""

    requests: int
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float

    @classmethod
    def empty(cls) -> TtftSummary:
        return cls(0, 0.0, 0.0, 0.0, 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "ttft_mean_s": self.ttft_mean_s,
                "ttft_p50_s": self.ttft_p50_s, "ttft_p90_s": self.ttft_p90_s,
                "ttft_p99_s": self.ttft_p99_s}


@dataclass(frozen=True, slots=True)
class TransferTimes:
    """Time to last byte of a replay's transfers (seconds)."""

    ttlb_mean_s: float
    ttlb_p90_s: float


@dataclass(frozen=True, slots=True)
class PrefetchLateness:
    """When prefetches landed that a request waited for: landing time minus the request's
    arrival (seconds; <= 0 is in time)."""

    lateness_p50_s: float
    prefetch_in_time_fraction: float


@dataclass(frozen=True, slots=True)
class PolicySummary:
    """One policy's replay, summarised (:func:`~kvprefetch.controlplane.sim.metrics.summarize`).

    The optional parts are None when the replay had nothing to measure (no returning
    request, no transfer, no prefetch a request waited for); the JSON then leaves their
    keys out.
    """

    #: Every request; in the JSON its fields sit at the top of the policy's object.
    overall: TtftSummary
    #: Requests of a session's later turns (those that can reuse KV).
    returning: TtftSummary
    #: TTFT of returning requests at percentiles 0, 1, ..., 100 (the plot's CDF).
    returning_ttft_quantiles_s: tuple[float, ...] | None
    #: Seconds requests waited for their KV, summed.
    stall_s: float
    prefetched_bytes: int
    #: Prefetched bytes that no request read.
    wasted_bytes: int
    #: Prefetched bytes that a request read.
    prefetch_used_bytes: int
    #: Bytes read from the remote stores (prefetch and demand).
    remote_bytes: int
    prefetches: int
    prefetches_dropped: int
    prefetches_cancelled: int
    #: Prefetches not started because the policy's waste budget was spent.
    prefetches_over_budget: int
    #: Bytes of the warm-ups of empty nodes (restart, join), part of ``prefetched_bytes``.
    warmup_bytes: int
    #: Of the tokens returning requests reused, the fraction found in the local tier.
    local_hit_fraction: float
    transfers: TransferTimes | None
    lateness: PrefetchLateness | None
    #: Events the scheduling core handled.
    events: int

    @property
    def ttft_mean_s(self) -> float:
        return self.overall.ttft_mean_s

    def to_dict(self) -> dict[str, Any]:
        out = self.overall.to_dict()
        out["returning"] = self.returning.to_dict()
        if self.returning_ttft_quantiles_s is not None:
            out["returning_ttft_quantiles_s"] = list(self.returning_ttft_quantiles_s)
        out.update(stall_s=self.stall_s, prefetched_bytes=self.prefetched_bytes,
                   wasted_bytes=self.wasted_bytes,
                   prefetch_used_bytes=self.prefetch_used_bytes,
                   remote_bytes=self.remote_bytes,
                   prefetches=self.prefetches, prefetches_dropped=self.prefetches_dropped,
                   prefetches_cancelled=self.prefetches_cancelled,
                   prefetches_over_budget=self.prefetches_over_budget,
                   warmup_bytes=self.warmup_bytes,
                   local_hit_fraction=self.local_hit_fraction)
        if self.transfers is not None:
            out.update(ttlb_mean_s=self.transfers.ttlb_mean_s,
                       ttlb_p90_s=self.transfers.ttlb_p90_s)
        if self.lateness is not None:
            out.update(lateness_p50_s=self.lateness.lateness_p50_s,
                       prefetch_in_time_fraction=self.lateness.prefetch_in_time_fraction)
        out["events"] = self.events
        return out


@dataclass(frozen=True, slots=True)
class Yardstick:
    """``predictive`` against its baselines and its two references, on returning TTFT
    (:func:`~kvprefetch.controlplane.sim.metrics.yardstick`)."""

    #: The baseline with the lowest returning mean (None: no baseline ran).
    best_baseline: str | None
    #: predictive / the best baseline's returning mean, and / the lowest baseline p90.
    vs_best_baseline: float | None
    vs_best_baseline_p90: float | None
    #: (reactive - predictive) / (reactive - perfect), returning mean; None with a reason.
    forecast_gap_closure: float | None
    #: Why there is no closure (None when there is one).
    no_closure: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"best_baseline": self.best_baseline, "vs_best_baseline": self.vs_best_baseline,
                "vs_best_baseline_p90": self.vs_best_baseline_p90,
                "forecast_gap_closure": self.forecast_gap_closure,
                "no_closure": self.no_closure}

    def lines(self) -> list[str]:
        """The table's closing lines."""
        out = []
        if self.best_baseline is not None:
            out.append(f"predictive / best baseline ({self.best_baseline}), returning mean: "
                       f"{_ratio_text(self.vs_best_baseline)}; p90 / the lowest baseline "
                       f"p90: {_ratio_text(self.vs_best_baseline_p90)}")
        if self.forecast_gap_closure is not None:
            out.append(f"forecast gap closure (reactive -> perfect, returning mean): "
                       f"{self.forecast_gap_closure:.3f}")
        else:
            out.append(f"forecast gap closure: none ({self.no_closure})")
        return out


def _ratio_text(ratio: float | None) -> str:
    """A ratio to 3 decimals, or why there is none (no returning request took time)."""
    return "n/a (no returning request took time)" if ratio is None else f"{ratio:.3f}"


@dataclass(frozen=True, slots=True)
class HintsMeta:
    """The client hints a replay sent (:mod:`~kvprefetch.controlplane.sim.hints`): the settings, and
    how many of each kind every policy's replay sent (the same planned hints for all)."""

    #: Hint kinds by their API names ("user_typing", "tool_running").
    kinds: tuple[str, ...]
    #: Share of session groups whose client sends hints.
    coverage: float
    seed: int
    tool_eta_sigma: float
    #: Share of typing hints that are abandoned (no request follows).
    abandon_share: float
    #: Real typing hints, tool-running hints, abandoned typing hints sent.
    sent_typing: int
    sent_tool: int
    sent_abandoned: int

    def to_dict(self) -> dict[str, Any]:
        return {"kinds": list(self.kinds), "coverage": self.coverage, "seed": self.seed,
                "tool_eta_sigma": self.tool_eta_sigma, "abandon_share": self.abandon_share,
                "sent_typing": self.sent_typing, "sent_tool": self.sent_tool,
                "sent_abandoned": self.sent_abandoned}


@dataclass(frozen=True, slots=True)
class SimMeta:
    """What was replayed, on what, and how hard the working set presses the local tiers."""

    trace: str
    trace_format: str
    requests: int
    sessions: int
    seed: int
    scenario: str
    predictor: str
    model: str
    nodes: int
    #: The engine profile every policy ran on (:mod:`kvprefetch.controlplane.core.engines`).
    engine: str
    #: Peak summed KV of live sessions
    #: (:func:`~kvprefetch.controlplane.sim.metrics.working_set_peak_bytes`).
    working_set_peak_bytes: int
    #: HBM + DRAM tiers of the whole fleet.
    local_capacity_bytes: int
    #: working_set_peak_bytes / local_capacity_bytes, rounded to 0.001.
    pressure_ratio: float
    #: Wall-clock seconds of the whole run (the one field that differs between runs).
    wall_s: float
    #: The client hints sent; None when the replay sent none (the JSON then has no key).
    hints: HintsMeta | None = None
    #: Scheduler shards the decisions were split over (the JSON has the key only when > 1).
    shards: int = 1
    #: Whether the shards shared each node's tier (the JSON has the key only when true).
    shared_tier: bool = False

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "trace": self.trace, "trace_format": self.trace_format,
            "requests": self.requests, "sessions": self.sessions, "seed": self.seed,
            "scenario": self.scenario, "predictor": self.predictor, "model": self.model,
            "nodes": self.nodes, "engine": self.engine,
            "working_set_peak_bytes": self.working_set_peak_bytes,
            "local_capacity_bytes": self.local_capacity_bytes,
            "pressure_ratio": self.pressure_ratio, "wall_s": self.wall_s}
        if self.hints is not None:
            out["hints"] = self.hints.to_dict()
        if self.shards > 1:
            out["shards"] = self.shards
        if self.shared_tier:
            out["shared_tier"] = True
        return out


@dataclass(frozen=True, slots=True)
class SimReport:
    """Every policy's replay of one trace
    (:func:`~kvprefetch.controlplane.sim.runner.run_policies`)."""

    meta: SimMeta
    #: Policy name -> its summary, in the order the policies were given.
    policies: Mapping[str, PolicySummary]
    #: predictive against its baselines and references; None when predictive did not run.
    yardstick: Yardstick | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``kvprefetch sim --json``."""
        out: dict[str, Any] = {
            "meta": self.meta.to_dict(),
            "policies": {name: p.to_dict() for name, p in self.policies.items()},
        }
        if self.yardstick is not None:
            out["yardstick"] = self.yardstick.to_dict()
        return out

    def to_json(self) -> str:
        """The text of the ``--json`` file (as
        :func:`~kvprefetch.controlplane.base.atomic.write_json_atomic`
        writes :meth:`to_dict`: sorted keys, indented by 2, a final newline)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


def format_table(report: SimReport) -> str:
    meta = report.meta
    lines = [
        f"trace {meta.trace}: {meta.requests} requests, {meta.sessions} sessions; "
        f"{meta.nodes} x {meta.model} on engine {meta.engine}; predictor {meta.predictor}",
        f"working set peak {meta.working_set_peak_bytes / GIB:,.0f} GiB vs local tiers "
        f"{meta.local_capacity_bytes / GIB:,.0f} GiB: pressure {meta.pressure_ratio:.2f}x",
    ]
    if meta.hints is not None:
        h = meta.hints
        lines.append(
            f"client hints {','.join(h.kinds)} from {h.coverage:g} of session groups (seed "
            f"{h.seed}, tool ETA sigma {h.tool_eta_sigma:g}, abandoned share "
            f"{h.abandon_share:g}): sent {h.sent_typing} typing, {h.sent_tool} tool, "
            f"{h.sent_abandoned} abandoned per policy"
        )
    w = max(11, *(len(name) for name in report.policies))  # the policy column's width
    head = (f"{'policy':<{w}} {'ret':>6} {'ret mean':>9} {'ret p50':>8} {'ret p90':>8} "
            f"{'ret p99':>8} {'all mean':>9} {'stall s':>9} {'prefetch':>9} {'wasted':>8} "
            f"{'remote':>9}")
    lines += ["", "TTFT in seconds (ret = returning requests); bytes in GiB", head,
              "-" * len(head)]
    for name, p in report.policies.items():
        r = p.returning
        lines.append(
            f"{name:<{w}} {r.requests:>6} {r.ttft_mean_s:>9.3f} {r.ttft_p50_s:>8.3f} "
            f"{r.ttft_p90_s:>8.3f} {r.ttft_p99_s:>8.3f} {p.ttft_mean_s:>9.3f} "
            f"{p.stall_s:>9.0f} {p.prefetched_bytes / GIB:>9.0f} "
            f"{p.wasted_bytes / GIB:>8.0f} {p.remote_bytes / GIB:>9.0f}"
        )
    if report.yardstick is not None:
        lines += ["", *report.yardstick.lines()]
    lines.append(f"wall time {meta.wall_s:.1f} s")
    return "\n".join(lines)


def write_plot(report: Mapping[str, Any], path: str | Path) -> None:
    """TTFT CDF of returning requests per policy, and prefetched vs wasted bytes.

    ``report`` is a report's JSON object (:meth:`SimReport.to_dict`, a ``--json`` file read
    back, or the live demo's report, which has the same ``meta`` and ``policies`` fields)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, p in report["policies"].items():
        qs = p.get("returning_ttft_quantiles_s")
        if not qs:
            continue
        ys = [i / (len(qs) - 1) for i in range(len(qs))]
        ax1.plot(qs, ys, label=name)
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT of returning requests (s)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("TTFT CDF, returning requests")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend()
    names = [n for n in report["policies"]
             if n in POLICIES and POLICIES[n].prefetch and POLICIES[n].forecasts]
    useful = [(report["policies"][n]["prefetched_bytes"]
               - report["policies"][n]["wasted_bytes"]) / GIB for n in names]
    wasted = [report["policies"][n]["wasted_bytes"] / GIB for n in names]
    ax2.set_title("Prefetched bytes: useful vs wasted")
    if any(report["policies"][n]["prefetched_bytes"] for n in names):
        ax2.bar(names, useful, label="useful")
        ax2.bar(names, wasted, bottom=useful, label="wasted")
        ax2.set_ylabel("prefetched GiB")
        ax2.legend()
    else:
        # Bars of height 0 would draw an empty panel on an arbitrary axis: say it instead.
        ax2.text(0.5, 0.5, "no prefetches", ha="center", va="center",
                 transform=ax2.transAxes, fontsize=12, color="0.4")
        ax2.set_xticks([])
        ax2.set_yticks([])
    fig.suptitle(f"{report['meta']['trace']} - {report['meta']['nodes']} x "
                 f"{report['meta']['model']}")
    fig.tight_layout()
    save_figure_atomic(fig, path)
