"""What both demo engines share about their runs: one policy's replay of one arrival seed
(:class:`Run`), the seed's trace and hints (:class:`SeedTrace`), how sure the means are
(per-seed means, their 95% interval, the paired difference), the JSON report pooled over
the seeds (:func:`build_report`) and its plot (:func:`write_plot`)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvprefetch.controlplane.base.atomic import save_figure_atomic, write_json_atomic

GIB = 1 << 30

_T975 = (12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004,
         2.262157, 2.228139, 2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905,
         2.109816, 2.100922, 2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899,
         2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272)
_Z975 = 1.959964



# ---------------------------------------------------------------------------------------------
# How sure: per-seed means, their interval, pooled over seeds. Pure.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SeedStat:
    """One seed's returning requests under one policy (service seconds)."""

    seed: int
    ttft_mean_s: float
    ttft_p90_s: float
    requests: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "ttft_mean_s": self.ttft_mean_s,
                "ttft_p90_s": self.ttft_p90_s, "requests": self.requests}


def t975(dof: int) -> float:
    """The 0.975 quantile of Student's t with ``dof`` >= 1 degrees of freedom (a table to
    30, then the Cornish-Fisher expansion around the normal, within 1e-4)."""
    if dof < 1:
        raise ValueError("dof must be >= 1")
    if dof <= len(_T975):
        return _T975[dof - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)


def mean_ci95(values: Sequence[float]) -> tuple[float, float] | None:
    """95% confidence interval of the mean of ``values`` (Student t, n - 1 degrees of
    freedom); None for fewer than two values."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return (mean - half, mean + half)


def seed_summary(per_seed: Sequence[SeedStat]) -> dict[str, Any]:
    """The JSON a policy gets from its seeds: ``per_seed`` and ``ttft_mean_ci95_s`` (the
    interval of the mean over per-seed means; None for one seed)."""
    ci = mean_ci95([s.ttft_mean_s for s in per_seed])
    return {"per_seed": [s.to_dict() for s in per_seed],
            "ttft_mean_ci95_s": [round(ci[0], 6), round(ci[1], 6)] if ci else None}


def paired_difference(base: Sequence[SeedStat], other: Sequence[SeedStat]
                      ) -> dict[str, Any] | None:
    """``other - base`` of the returning mean, seed by seed (the runs of a seed replay the
    same trace): the per-seed differences, their mean and its 95% interval. None when the
    two share no seed."""
    by_seed = {s.seed: s for s in base}
    diffs = [(s.seed, s.ttft_mean_s - by_seed[s.seed].ttft_mean_s)
             for s in other if s.seed in by_seed]
    if not diffs:
        return None
    values = [d for _, d in diffs]
    ci = mean_ci95(values)
    return {"per_seed": [{"seed": seed, "ttft_mean_diff_s": round(d, 6)} for seed, d in diffs],
            "ttft_mean_diff_s": round(sum(values) / len(values), 6),
            "ttft_mean_diff_ci95_s": [round(ci[0], 6), round(ci[1], 6)] if ci else None}


# ---------------------------------------------------------------------------------------------
# The runs.
# ---------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One policy's replay of one seed: what the replayer saw and the service's books."""

    seed: int
    policy: str
    run: Any  # kvprefetch.controlplane.sim.simulator.PolicyRun
    replay: Any  # kvprefetch.controlplane.harness.replay.ReplayResult
    books: dict[str, Any]  # the scheduler's summary
    agents: list[Any] = field(default_factory=list)  # the agents' statuses at the end
    link_mib_s: float | None = None


@dataclass(frozen=True, slots=True)
class SeedTrace:
    """One arrival seed's replayed trace and the client hints planned for it."""

    seed: int
    trace: Any
    hints: tuple[Any, ...]  # kvprefetch.controlplane.sim.hints.PlannedHint



def run_from_books(policy: str, records: Any, books: dict[str, Any]) -> Any:
    """A replay's ``PolicyRun``: its records at the client, its byte counts from the
    scheduler's summary (``books``)."""
    from kvprefetch.controlplane.sim.simulator import PolicyRun

    return PolicyRun(
        policy, records=records, prefetched_bytes=books["prefetch_model_bytes"],
        wasted_bytes=books["wasted_bytes_modelled"],
        prefetch_used_bytes=books["prefetch_used_bytes_modelled"],
        prefetches_over_budget=books["prefetches_over_budget"],
        warmup_bytes=books["warmup_bytes"],
        remote_bytes=books["prefetch_model_bytes"] + books["demand_model_bytes"],
        prefetches=books["prefetches"], prefetches_dropped=books["prefetches_dropped"],
        ttlb_s=books["ttlb_s"], lateness_s=books["lateness_s"], events=books["events"])


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0.0}
    xs = sorted(values)

    def q(p: float) -> float:
        return xs[min(len(xs) - 1, int(p * len(xs)))]

    return {"mean": round(sum(xs) / len(xs), 2), "p50": round(q(0.5), 2),
            "p90": round(q(0.9), 2), "max": round(xs[-1], 2)}


# ---------------------------------------------------------------------------------------------
# The report: pooled over seeds, plus per seed.
# ---------------------------------------------------------------------------------------------


def pooled_run(policy: str, runs: Sequence[Any]) -> Any:
    """One PolicyRun of several (the same policy over several seeds): records and transfer
    times together, counts and bytes summed."""
    from kvprefetch.controlplane.sim.simulator import PolicyRun

    out = PolicyRun(policy)
    for r in runs:
        out.records.extend(r.records)
        out.ttlb_s.extend(r.ttlb_s)
        out.lateness_s.extend(r.lateness_s)
        out.prefetched_bytes += r.prefetched_bytes
        out.wasted_bytes += r.wasted_bytes
        out.prefetch_used_bytes += r.prefetch_used_bytes
        out.remote_bytes += r.remote_bytes
        out.prefetches += r.prefetches
        out.prefetches_dropped += r.prefetches_dropped
        out.prefetches_cancelled += r.prefetches_cancelled
        out.prefetches_over_budget += r.prefetches_over_budget
        out.warmup_bytes += r.warmup_bytes
        out.events += r.events
    return out


def _live(runs: list[Run]) -> dict[str, Any]:
    """The real system's side of one policy, over all its runs."""
    results = [r for one in runs for r in one.replay.results]
    ok = [r for r in results if not r.error]
    books = [one.books for one in runs]
    agents: dict[int, dict[str, int]] = {}
    for one in runs:
        for s in one.agents:
            a = agents.setdefault(s.node, {"node": s.node, "keys": 0, "used_bytes": 0,
                                           "orders_done": 0, "bytes_moved": 0})
            # keys and used bytes as at the end of the fullest run; work summed over runs
            a["keys"] = max(a["keys"], s.keys)
            a["used_bytes"] = max(a["used_bytes"], s.used_bytes)
            a["orders_done"] += s.orders_done
            a["bytes_moved"] += s.bytes_moved
    link = runs[0].link_mib_s if runs else None
    return {
        "link_mib_s": round(link, 3) if link is not None else None,
        # Control-plane time, wall milliseconds (not in the TTFT: see EngineEmulator.serve).
        "route_overhead_ms": percentiles([r.route_overhead_s * 1e3 for r in ok]),
        "gpu_overhead_ms": percentiles([r.gpu_overhead_s * 1e3 for r in ok]),
        "timeline_lag_ms": percentiles([r.lag_s * 1e3 for r in ok]),
        "real_bytes_moved": sum(b["prefetch_bytes"] + b["demand_bytes"] for b in books),
        "real_prefetch_bytes": sum(b["prefetch_bytes"] for b in books),
        "real_demand_bytes": sum(b["demand_bytes"] for b in books),
        "real_bytes_read_local": sum(r.read_bytes for r in results),
        "real_bytes_written": sum(r.written_bytes for r in results),
        "orders_sent": sum(b["orders_sent"] for b in books),
        "orders_failed": sum(b["orders_failed"] for b in books),
        "unrouted": sum(one.replay.unrouted for one in runs),
        "failed_requests": sum(one.replay.failed for one in runs),
        "hints_sent": sum(one.replay.hints_sent for one in runs),
        "hints_failed": sum(one.replay.hints_failed for one in runs),
        "replay_wall_s": round(sum(one.replay.wall_s for one in runs), 2),
        "agents": [agents[n] for n in sorted(agents)],
    }


def _policy_block(policy: str, runs: list[Run]) -> tuple[dict[str, Any], list[SeedStat]]:
    from kvprefetch.controlplane.sim.metrics import summarize

    block = summarize(pooled_run(policy, [one.run for one in runs])).to_dict()
    block.update(_live(runs))
    per_seed = []
    for one in runs:
        r = summarize(one.run).returning
        per_seed.append(SeedStat(one.seed, r.ttft_mean_s, r.ttft_p90_s, r.requests))
    seeds = seed_summary(per_seed)
    block["returning"]["ttft_mean_ci95_s"] = seeds["ttft_mean_ci95_s"]
    block["per_seed"] = seeds["per_seed"]
    block["per_request"] = [row for one in runs for row in request_rows(one)]
    return block, per_seed


def request_rows(one: Run) -> list[dict[str, Any]]:
    """One row per request of a run, in the report's TTFT unit: what the replayer saw
    (``ttft_s``) and what the engine measured on its way (transfer and lookup waits, wall
    seconds), for pairing by (session, turn) and for calibrating a twin."""
    rows = []
    for rec, res in zip(one.replay.records, one.replay.results, strict=True):
        rows.append({
            "seed": one.seed, "session": rec.session_id, "turn": rec.turn, "node": rec.node,
            "returning": rec.returning, "ttft_s": round(rec.ttft_s, 6),
            "reused_tokens": rec.reused_tokens, "local_tokens": res.local_tokens,
            "hbm_tokens": res.hbm_tokens, "error": res.error,
            "transfer_wall_s": round(res.transfer_wall_s, 6),
            "demand_bytes_moved": res.demand_bytes_moved,
            "looked_up": res.looked_up, "lookup_wall_s": round(res.lookup_wall_s, 6),
            "lookup_tokens": res.lookup_tokens})
    return rows


def _simulated(args: argparse.Namespace, fleet: Any, seeds: list[SeedTrace],
               policies: list[str]) -> dict[str, Any]:
    """The simulator's figures for the same traces and the same client hints, pooled."""
    from kvprefetch.controlplane.core.policies import POLICIES
    from kvprefetch.controlplane.sim.metrics import summarize
    from kvprefetch.controlplane.sim.runner import run_policy

    out = {}
    for name in policies:
        runs = [run_policy(st.trace, fleet, POLICIES[name], args.predictor,
                           hints=st.hints if args.hints else None) for st in seeds]
        p = summarize(pooled_run(name, runs))
        out[name] = {"returning": p.returning.to_dict(), "ttft_mean_s": p.overall.ttft_mean_s,
                     "stall_s": p.stall_s}
    return out


def build_report(args: argparse.Namespace, fleet: Any, seeds: list[SeedTrace],
            runs: dict[str, list[Run]], predictor: str, wall_s: float) -> dict[str, Any]:
    from kvprefetch.controlplane.base.types import HintKind
    from kvprefetch.controlplane.sim.metrics import working_set_peak_bytes

    per_trace = []
    for st in seeds:
        ws = working_set_peak_bytes(st.trace, fleet.model.kv_bytes_per_token)
        per_trace.append({
            "seed": st.seed, "requests": st.trace.requests, "sessions": len(st.trace.sessions),
            "working_set_peak_bytes": ws,
            "pressure_ratio": round(ws / max(1, fleet.local_capacity_bytes), 3)})
    ws_peak = max(t["working_set_peak_bytes"] for t in per_trace)
    trace = seeds[0].trace
    results: dict[str, Any] = {}
    stats: dict[str, list[SeedStat]] = {}
    for name, rs in runs.items():
        results[name], stats[name] = _policy_block(name, rs)
    planned = [h for st in seeds for h in st.hints]
    report: dict[str, Any] = {
        "meta": {
            "trace": trace.name, "trace_format": trace.source_format,
            "requests": sum(t["requests"] for t in per_trace),
            "sessions": sum(t["sessions"] for t in per_trace), "seed": args.seed,
            "repeats": len(seeds), "seeds": per_trace,
            "scenario": "live-demo", "predictor": args.predictor,
            "service_predictor": predictor, "model": fleet.model.name,
            "nodes": fleet.nodes, "working_set_peak_bytes": ws_peak,
            "local_capacity_bytes": fleet.local_capacity_bytes,
            "pressure_ratio": round(ws_peak / max(1, fleet.local_capacity_bytes), 3),
            "wall_s": round(wall_s, 3), "time_compression": args.compression,
            "kv_scale": args.kv_scale, "chunk_tokens": args.chunk_tokens,
            "link_emulation": args.link_emulation, "backend": args.backend,
            "sessions_per_seed": args.sessions, "turns": args.turns,
            "session_rate_per_s": args.session_rate,
            "hints": {"enabled": bool(args.hints), "coverage": args.hint_coverage,
                      "planned_per_policy": len(planned),
                      "planned_typing": sum(h.kind is HintKind.USER_TYPING for h in planned),
                      "planned_tool": sum(h.kind is HintKind.TOOL_RUNNING for h in planned)},
        },
        "policies": results,
        "simulated": _simulated(args, fleet, seeds, list(runs)),
        "machine": machine_check(seeds, results, float(getattr(args, "compression", 1.0))),
    }
    if "ondemand" in stats and "predictive" in stats:
        diff = paired_difference(stats["ondemand"], stats["predictive"])
        if diff is not None:
            # A run with failed or unrouted requests lost part of its sessions: its means are
            # over other requests than its pair's.
            comparable = all(not (results[n]["failed_requests"] or results[n]["unrouted"])
                             for n in ("ondemand", "predictive"))
            report["comparison"] = {"baseline": "ondemand", "policy": "predictive",
                                    "comparable": comparable, "returning": diff}
    return report



#: The share of the median compressed gap (wall time between a response and the session's
#: next request) the control plane's own lag may take: beyond it, the replay's timing is the
#: machine's, not the policies', and the demo gives no verdict.
CARRY_GAP_SHARE = 0.1


def machine_check(seeds: Sequence[SeedTrace], policies: dict[str, Any],
                  compression: float) -> dict[str, Any]:
    """Whether this machine carried the comparison: the worst policy's control-plane lag
    (p90 of the route overhead and of the run's lag behind the GPU timeline, wall ms)
    against the median gap between a session's requests at ``compression`` (wall ms)."""
    gaps = sorted(r.gap_s * 1e3 / compression for st in seeds for session in st.trace.sessions
                  for r in session.requests if r.gap_s is not None)
    gap_p50 = gaps[len(gaps) // 2] if gaps else 0.0
    lag = max((max(p["route_overhead_ms"]["p90"], p["timeline_lag_ms"]["p90"])
               for p in policies.values()), default=0.0)
    share = lag / gap_p50 if gap_p50 > 0 else 0.0
    return {"control_plane_lag_p90_ms": round(lag, 2),
            "compressed_gap_p50_ms": round(gap_p50, 2), "lag_share": round(share, 4),
            "limit_share": CARRY_GAP_SHARE, "carried": share <= CARRY_GAP_SHARE}


def machine_verdict(check: dict[str, Any]) -> str | None:
    """The line that says the machine could not carry the comparison; None when it did."""
    if check["carried"]:
        return None
    return (f"this machine cannot carry the comparison: control-plane lag p90 "
            f"{check['control_plane_lag_p90_ms']:.1f} ms is {check['lag_share']:.0%} of the "
            f"median compressed gap {check['compressed_gap_p50_ms']:.1f} ms (at most "
            f"{check['limit_share']:.0%}); no verdict: lower --compression, or run on an "
            f"idle machine")


def write_outputs(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """The report's files, as the demos' ``--json`` and ``--plot`` ask: JSON written
    atomically, the PNG by :func:`write_plot`; each named on the terminal."""
    if args.json_out:
        write_json_atomic(args.json_out, report)
        print(f"wrote {args.json_out}")
    if args.plot:
        write_plot(report, args.plot)
        print(f"wrote {args.plot}")


def write_plot(report: dict[str, Any], path: str | Path) -> None:
    """One PNG: the pooled TTFT CDF of returning requests per policy; each policy's
    per-seed returning means with the 95% interval of their mean; prefetched bytes, useful
    vs wasted. Written atomically (a temporary file, then a rename)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = report["policies"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5))
    for name, p in policies.items():
        qs = p.get("returning_ttft_quantiles_s")
        if qs:
            ax1.plot(qs, [i / (len(qs) - 1) for i in range(len(qs))], label=name)
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT of returning requests (s)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title(f"TTFT CDF, returning, pooled over {report['meta']['repeats']} seed(s)")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend()
    for x, p in enumerate(policies.values()):
        means = [s["ttft_mean_s"] for s in p["per_seed"]]
        ax2.scatter([x] * len(means), means, s=18, alpha=0.6, color=f"C{x}")
        ci = p["returning"]["ttft_mean_ci95_s"]
        mid = sum(means) / len(means) if means else 0.0
        err = [[mid - ci[0]], [ci[1] - mid]] if ci else None
        ax2.errorbar([x + 0.15], [mid], yerr=err, fmt="o", capsize=6, color=f"C{x}")
    ax2.set_xticks(range(len(policies)), list(policies))
    ax2.set_xlim(-0.5, len(policies) - 0.5)
    ax2.set_ylabel("returning TTFT mean (s)")
    ax2.set_title("per-seed means (dots), mean and 95% CI")
    ax2.grid(True, axis="y", alpha=0.3)
    names = list(policies)
    useful = [(policies[n]["prefetched_bytes"] - policies[n]["wasted_bytes"]) / GIB
              for n in names]
    wasted = [policies[n]["wasted_bytes"] / GIB for n in names]
    ax3.bar(names, useful, label="useful")
    ax3.bar(names, wasted, bottom=useful, label="wasted")
    ax3.set_ylabel("prefetched GiB (modelled), all seeds")
    ax3.set_title("Prefetched bytes: useful vs wasted")
    ax3.legend()
    meta = report["meta"]
    fig.suptitle(f"live demo, {meta['trace']} - {meta['nodes']} x {meta['model']}, "
                 f"{meta['time_compression']:g}x")
    fig.tight_layout()
    save_figure_atomic(fig, path)
