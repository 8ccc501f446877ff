"""Terminal table and PNG plot of a simulation report (JSON: :mod:`controlplane.base.atomic`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from controlplane.core.policies import POLICIES

GIB = 1 << 30


def format_table(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        f"trace {meta['trace']}: {meta['requests']} requests, {meta['sessions']} sessions; "
        f"{meta['nodes']} x {meta['model']}; predictor {meta['predictor']}",
        f"working set peak {meta['working_set_peak_bytes'] / GIB:,.0f} GiB vs local tiers "
        f"{meta['local_capacity_bytes'] / GIB:,.0f} GiB: pressure {meta['pressure_ratio']:.2f}x",
    ]
    head = (f"{'policy':<11} {'ret':>6} {'ret mean':>9} {'ret p50':>8} {'ret p90':>8} "
            f"{'ret p99':>8} {'all mean':>9} {'stall s':>9} {'prefetch':>9} {'wasted':>8} "
            f"{'remote':>9}")
    lines += ["", "TTFT in seconds (ret = returning requests); bytes in GiB", head,
              "-" * len(head)]
    for name, p in report["policies"].items():
        r = p["returning"]
        lines.append(
            f"{name:<11} {r['requests']:>6} {r['ttft_mean_s']:>9.3f} {r['ttft_p50_s']:>8.3f} "
            f"{r['ttft_p90_s']:>8.3f} {r['ttft_p99_s']:>8.3f} {p['ttft_mean_s']:>9.3f} "
            f"{p['stall_s']:>9.0f} {p['prefetched_bytes'] / GIB:>9.0f} "
            f"{p['wasted_bytes'] / GIB:>8.0f} {p['remote_bytes'] / GIB:>9.0f}"
        )
    if "gap_closure" in report:
        lines.append(f"\ngap_closure (ondemand -> oracle, returning mean TTFT): "
                     f"{report['gap_closure']:.3f}")
    lines.append(f"wall time {meta['wall_s']:.1f} s")
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str | Path) -> None:
    """TTFT CDF of returning requests per policy, and prefetched vs wasted bytes."""
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
    names = [n for n in report["policies"] if n in POLICIES and POLICIES[n].prefetch]
    useful = [(report["policies"][n]["prefetched_bytes"]
               - report["policies"][n]["wasted_bytes"]) / GIB for n in names]
    wasted = [report["policies"][n]["wasted_bytes"] / GIB for n in names]
    ax2.bar(names, useful, label="useful")
    ax2.bar(names, wasted, bottom=useful, label="wasted")
    ax2.set_ylabel("prefetched GiB")
    ax2.set_title("Prefetched bytes: useful vs wasted")
    ax2.legend()
    fig.suptitle(f"{report['meta']['trace']} - {report['meta']['nodes']} x "
                 f"{report['meta']['model']}")
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, p)
