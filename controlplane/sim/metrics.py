"""Summaries of a policy run, with the metric names of docs/concepts.md ("Metrics the
results use")."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kvprefetch.controlplane.base.types import Trace
from kvprefetch.controlplane.core.policies import BASELINE_NAMES

from .report import PolicySummary, PrefetchLateness, TransferTimes, TtftSummary, Yardstick
from .simulator import PolicyRun, RequestRecord


def _round(x: float) -> float:
    # Rounded so that the JSON is byte-identical across runs and platforms' last-bit noise.
    return float(round(x, 6))


def ttft_summary(records: list[RequestRecord]) -> TtftSummary:
    if not records:
        return TtftSummary.empty()
    ttft = np.fromiter((r.ttft_s for r in records), dtype=np.float64, count=len(records))
    p50, p90, p99 = np.percentile(ttft, [50, 90, 99])
    return TtftSummary(
        requests=len(records),
        ttft_mean_s=_round(float(ttft.mean())),
        ttft_p50_s=_round(float(p50)),
        ttft_p90_s=_round(float(p90)),
        ttft_p99_s=_round(float(p99)),
    )


def summarize(run: PolicyRun) -> PolicySummary:
    """One policy's replay as a :class:`PolicySummary` (a policy's block of `kvprefetch sim
    --json`)."""
    records = sorted(run.records, key=lambda r: (r.arrival_s, r.session_id, r.turn))
    returning = [r for r in records if r.returning]
    quantiles = None
    if returning:
        ttft = np.fromiter((r.ttft_s for r in returning), dtype=np.float64, count=len(returning))
        quantiles = tuple(
            _round(float(q)) for q in np.percentile(ttft, np.linspace(0, 100, 101))
        )
    transfers = None
    if run.ttlb_s:
        t = np.asarray(run.ttlb_s)
        transfers = TransferTimes(ttlb_mean_s=_round(float(t.mean())),
                                  ttlb_p90_s=_round(float(np.percentile(t, 90))))
    lateness = None
    if run.lateness_s:
        lat = np.asarray(run.lateness_s)
        lateness = PrefetchLateness(
            lateness_p50_s=_round(float(np.percentile(lat, 50))),
            prefetch_in_time_fraction=_round(float((lat <= 0).mean())))
    return PolicySummary(
        overall=ttft_summary(records),
        returning=ttft_summary(returning),
        returning_ttft_quantiles_s=quantiles,
        stall_s=_round(sum(r.stall_s for r in records)),
        prefetched_bytes=int(run.prefetched_bytes),
        wasted_bytes=int(run.wasted_bytes),
        prefetch_used_bytes=int(run.prefetch_used_bytes),
        remote_bytes=int(run.remote_bytes),
        prefetches=run.prefetches,
        prefetches_dropped=run.prefetches_dropped,
        prefetches_cancelled=run.prefetches_cancelled,
        prefetches_over_budget=run.prefetches_over_budget,
        warmup_bytes=run.warmup_bytes,
        local_hit_fraction=_round(
            sum(r.reused_local_tokens for r in returning)
            / max(1, sum(r.reused_tokens for r in returning))
        ),
        transfers=transfers,
        lateness=lateness,
        events=run.events,
    )


def forecast_gap_closure(returning_ttft_mean_s: Mapping[str, float],
                         subject: str = "predictive") -> tuple[float | None, str | None]:
    """(reactive - subject) / (reactive - perfect), given each policy's mean TTFT of
    returning requests, and None or why there is none: ``perfect`` is not ahead of (no
    slower than) every policy that ran, or ``reactive`` is no slower than it. A closure is
    therefore never above 1; it is below 0 where the subject is behind ``reactive``."""
    mean = returning_ttft_mean_s
    if any(n not in mean for n in ("reactive", subject, "perfect")):
        return None, f"needs reactive, {subject} and perfect in the run"
    behind = [n for n, m in mean.items() if m < mean["perfect"] - 1e-9]
    if behind:
        return None, "perfect is not ahead of " + ", ".join(
            f"{n} ({mean[n]:.3f} s < {mean['perfect']:.3f} s)" for n in behind)
    if mean["reactive"] - mean["perfect"] <= 1e-9:
        return None, "reactive is no slower than perfect: forecasts have nothing to gain"
    return _round((mean["reactive"] - mean[subject]) / (mean["reactive"] - mean["perfect"])), None


def yardstick(summaries: Mapping[str, PolicySummary]) -> Yardstick | None:
    """``predictive`` against the best baseline that ran (:data:`~kvprefetch.controlplane.
    core.policies.BASELINE_NAMES`: lowest returning mean; its p90 against the lowest
    baseline p90) and its :func:`forecast_gap_closure`. None when predictive did not
    run."""
    pred = summaries.get("predictive")
    if pred is None:
        return None
    mean = {name: p.returning.ttft_mean_s for name, p in summaries.items()}
    baselines = [n for n in BASELINE_NAMES if n in summaries]
    best = min(baselines, key=lambda n: mean[n]) if baselines else None
    best_p90 = (min(summaries[n].returning.ttft_p90_s for n in baselines)
                if baselines else None)
    closure, reason = forecast_gap_closure(mean)
    return Yardstick(
        best_baseline=best,
        vs_best_baseline=(_round(mean["predictive"] / mean[best])
                          if best is not None and mean[best] > 0 else None),
        vs_best_baseline_p90=(_round(pred.returning.ttft_p90_s / best_p90)
                              if best_p90 else None),
        forecast_gap_closure=closure, no_closure=reason)


def working_set_peak_bytes(trace: Trace, kv_bytes_per_token: int) -> int:
    """Peak, over time, of the summed KV size of live sessions (between a session's first
    arrival and its last request), on the trace's own timeline. Each session counts with
    the context it holds after each turn, from that turn's arrival on."""
    deltas: list[tuple[float, int]] = []
    for s in trace.sessions:
        finish = s.start_s
        held = 0
        for r in s.requests:
            closed = r.turn > 0 and r.gap_s is not None
            arrival = finish + (r.gap_s or 0.0) if closed else s.start_s + r.offset_s
            size = r.context_tokens_after * kv_bytes_per_token
            if size != held:
                deltas.append((arrival, size - held))
                held = size
            finish = arrival + (r.api_time_s or 0.0)
        deltas.append((finish, -held))
    deltas.sort(key=lambda d: (d[0], d[1]))
    cur = peak = 0
    for _, d in deltas:
        cur += d
        peak = max(peak, cur)
    return peak
