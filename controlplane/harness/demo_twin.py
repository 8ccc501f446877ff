"""A demo's calibrated twin and how it agrees with the live run.

The twin is the simulator on the live run's arrival seeds, client hints, fleet and
compression, with the costs the engine showed (:mod:`.twin_calibration`): for the emulated
engine (``--backend local`` or ``lmcache-mp``) the remote link and the node tier's lookup
fitted from the run's own per-request rows, for ``--engine vllm`` the engine's calibration
pass. Agreement is measured request by request: each policy's live and twin TTFT paired by
(seed, session, turn), and predictive against ondemand paired the same way, live and twin,
each with a seeded bootstrap interval (:mod:`.twin_stats`).

Targets (the report says whether each is met): each policy's returning mean within
:data:`MEAN_TOLERANCE` of its twin's (relative), and predictive / ondemand of the returning
means within :data:`RATIO_TOLERANCE` of the twin's ratio (absolute)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvprefetch.controlplane.harness.twin_calibration import Calibration, calibrated_fleet
from kvprefetch.controlplane.harness.twin_stats import bootstrap_paired, pair_rows

#: Live returning mean against the twin's: |live / twin - 1| at most this.
MEAN_TOLERANCE = 0.20
#: Predictive / ondemand returning mean, live against twin: at most this apart.
RATIO_TOLERANCE = 0.05
#: Bootstrap draws and the generator's seed of every interval in the section.
RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def twin_rows(seeds: Sequence[Any], fleet: Any, policy: str, predictor: str, hints: bool,
              time_unit_s: float = 1.0) -> list[dict[str, Any]]:
    """The simulator's per-request rows of ``policy`` over ``seeds``
    (:class:`~kvprefetch.controlplane.harness.demo_report.SeedTrace`) on ``fleet``, TTFT in
    service seconds times ``time_unit_s`` (1 / compression: wall seconds)."""
    from kvprefetch.controlplane.core.policies import POLICIES
    from kvprefetch.controlplane.sim.runner import run_policy

    rows: list[dict[str, Any]] = []
    for st in seeds:
        run = run_policy(st.trace, fleet, POLICIES[policy], predictor,
                         hints=st.hints if hints else None)
        rows.extend({"seed": st.seed, "session": r.session_id, "turn": r.turn,
                     "returning": r.returning, "ttft_s": r.ttft_s * time_unit_s,
                     "local_tokens": r.reused_local_tokens} for r in run.records)
    return rows


def _mean(rows: Sequence[dict[str, Any]]) -> float:
    ret = [r["ttft_s"] for r in rows if r["returning"] and not r.get("error")]
    return sum(ret) / len(ret) if ret else 0.0


def _fleet_figures(fleet: Any) -> dict[str, float]:
    return {"valkey_gbyte_s_per_node": fleet.remote.valkey_gbyte_s_per_node,
            "valkey_latency_s": fleet.remote.valkey_latency_s,
            "nic_gbps": fleet.node.nic_gbps, "h2d_gbyte_s": fleet.node.h2d_gbyte_s,
            "prefill_flops_per_s": fleet.node.prefill_flops_per_s,
            "request_overhead_s": fleet.node.request_overhead_s}


def twin_section(report: dict[str, Any], seeds: Sequence[Any], fleet: Any,
                 calibration: Calibration, *, predictor: str, hints: bool,
                 time_unit_s: float = 1.0, fits: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
    """The report's ``twin`` block: the calibration and the fleet it gives, and per policy
    live vs twin (returning means, their relative gap, the paired interval); with
    ``ondemand`` and ``predictive`` both run, predictive vs ondemand paired, live and twin,
    and the gap of their ratios. ``report["policies"][name]["per_request"]`` are the live
    rows; TTFT units as in the report (``time_unit_s`` converts the simulator's)."""
    twin_fleet = calibrated_fleet(fleet, calibration)
    live = {n: p["per_request"] for n, p in report["policies"].items()}
    twin = {n: twin_rows(seeds, twin_fleet, n, predictor, hints, time_unit_s) for n in live}
    policies = {}
    for name in live:
        lm, tm = _mean(live[name]), _mean(twin[name])
        pairs = pair_rows(live[name], twin[name])
        gap = lm / tm - 1 if tm else float("inf")
        policies[name] = {
            "live_returning_mean_s": round(lm, 6), "twin_returning_mean_s": round(tm, 6),
            "live_over_twin": round(lm / tm, 4) if tm else None,
            "within_tolerance": abs(gap) <= MEAN_TOLERANCE,
            "paired_twin_minus_live": (bootstrap_paired(pairs, resamples=RESAMPLES,
                                                        seed=BOOTSTRAP_SEED).to_dict()
                                       if pairs else None)}
    out: dict[str, Any] = {
        "calibration": calibration.to_dict(), "fits": fits or {},
        "fleet_before": _fleet_figures(fleet), "fleet_after": _fleet_figures(twin_fleet),
        "targets": {"mean_tolerance": MEAN_TOLERANCE, "ratio_tolerance": RATIO_TOLERANCE},
        "bootstrap": {"resamples": RESAMPLES, "seed": BOOTSTRAP_SEED,
                      "method": "percentile, pairs resampled with replacement"},
        "policies": policies}
    if "ondemand" in live and "predictive" in live:
        cmp: dict[str, Any] = {}
        for side, rows in (("live", live), ("twin", twin)):
            pairs = pair_rows(rows["ondemand"], rows["predictive"])
            cmp[side] = (bootstrap_paired(pairs, resamples=RESAMPLES,
                                          seed=BOOTSTRAP_SEED).to_dict() if pairs else None)
        if cmp["live"] and cmp["twin"]:
            gap = abs(cmp["live"]["ratio"] - cmp["twin"]["ratio"])
            cmp["ratio_gap"] = round(gap, 4)
            cmp["within_tolerance"] = gap <= RATIO_TOLERANCE
        out["predictive_vs_ondemand"] = cmp
    return out


def print_twin(report: dict[str, Any], unit: str = "s", scale: float = 1.0) -> None:
    """The twin block as a terminal table (TTFT times ``scale`` in ``unit``)."""
    t = report.get("twin")
    if not t:
        return
    tol = t["targets"]
    print(f"calibrated twin (the simulator on this run's measured costs: "
          f"{', '.join(sorted(t['calibration']['sources'])) or 'none measured'}); returning "
          f"TTFT mean, {unit}; paired by (seed, session, turn), bootstrap 95% intervals "
          f"({t['bootstrap']['resamples']} resamples, seed {t['bootstrap']['seed']})")
    head = (f"{'policy':<11} {'live':>8} {'twin':>8} {'live/twin':>9} {'within':>7} "
            f"{'pairs':>6} {'twin-live':>10} {'95% CI':>20}")
    print(head)
    print("-" * len(head))
    for name, p in t["policies"].items():
        d = p["paired_twin_minus_live"] or {}
        ci = d.get("diff_ci95_s") or [0.0, 0.0]
        interval = f"[{ci[0] * scale:+.3f}, {ci[1] * scale:+.3f}]"
        print(f"{name:<11} {p['live_returning_mean_s'] * scale:>8.3f} "
              f"{p['twin_returning_mean_s'] * scale:>8.3f} {p['live_over_twin'] or 0:>9.3f} "
              f"{'yes' if p['within_tolerance'] else 'NO':>7} {d.get('pairs', 0):>6} "
              f"{d.get('diff_s', 0.0) * scale:>+10.3f} "
              f"{interval:>20}")
    cmp = t.get("predictive_vs_ondemand")
    if cmp and cmp.get("live") and cmp.get("twin"):
        for side in ("live", "twin"):
            c = cmp[side]
            print(f"  predictive / ondemand, {side}: {c['ratio']:.3f} "
                  f"[{c['ratio_ci95'][0]:.3f}, {c['ratio_ci95'][1]:.3f}]; predictive - "
                  f"ondemand {c['diff_s'] * scale:+.3f} [{c['diff_ci95_s'][0] * scale:+.3f}, "
                  f"{c['diff_ci95_s'][1] * scale:+.3f}] {unit} over {c['pairs']} pairs")
        print(f"  ratio gap live vs twin {cmp['ratio_gap']:.3f} (target <= "
              f"{tol['ratio_tolerance']}): {'met' if cmp['within_tolerance'] else 'NOT met'}; "
              f"means within {tol['mean_tolerance']:.0%}: "
              + ("met" if all(p["within_tolerance"] for p in t["policies"].values())
                 else "NOT met"))
