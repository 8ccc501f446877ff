"""``kvprefetch demo --engine vllm`` end to end, short: a child process starts local Ray,
Valkey + S3, two nodes of real vLLM (CPU build, the tiny model) + ``lmcache server`` with
our L2 adapter, one ``lmcache-mp`` agent per node and the gateway, and replays 4 sessions
of at most 3 turns through the gateway, ondemand then predictive.

The report must have the emulated demo's shape plus the engine's part, every request must
have been answered, and the engines' own counters must account for the returning
requests' prefixes (found in vLLM's cache, LMCache's L1, or loaded from L2). Which policy
is faster is not asserted: at this size the difference is within noise.

Needs vLLM's CPU build (``make test-vllm`` runs it in .venv-vllm). About 2.5 min on 2
cores, most of it vLLM's start-up.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.servers, pytest.mark.slow, pytest.mark.live, pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]

#: Keys every policy block of the emulated demo's report has
#: (kvprefetch.controlplane.harness.demo_report).
EMULATED_POLICY_KEYS = {"returning", "per_seed", "ttft_mean_s", "ttft_p90_s", "stall_s",
                        "prefetched_bytes", "wasted_bytes", "prefetches", "orders_sent",
                        "orders_failed", "failed_requests", "unrouted", "hints_sent",
                        "route_overhead_ms", "real_bytes_moved", "agents", "link_mib_s"}
COUNTERS = {"vllm_prefix_hit_tokens", "vllm_external_hit_tokens", "lmcache_l1_hit_tokens",
            "lmcache_l2_hit_tokens"}


def test_the_vllm_demo_replays_through_the_gateway_and_reports_the_engines_counters(
        tmp_path: Path) -> None:
    from kvprefetch.agents.vllm.check_install import problems

    assert not problems(), f"vLLM's CPU build is not usable here (make setup-vllm): {problems()}"
    out = tmp_path / "demo-vllm.json"
    cmd = [sys.executable, "-m", "kvprefetch",
           "demo", "--engine", "vllm", "--repeats", "1", "--sessions", "4", "--turns", "3",
           "--no-progress",
           "--json", str(out)]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    wall_s = time.monotonic() - started
    print(f"\nthe short vLLM demo took {wall_s:.0f} s")
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    meta = report["meta"]
    assert meta["engine"] == "vllm" and meta["nodes"] == 2 and meta["sessions"] == 4
    assert meta["vllm"]["link_mib_s"] is None  # no pacing by default
    calibration = meta["vllm"]["calibration"]
    assert calibration["rounds"] > 0 and calibration["ttft_l2_s"] > 0
    assert meta["vllm"]["load_cost_ratio_reference"] > 0
    assert set(report) >= {"meta", "policies", "simulated"}
    assert list(report["policies"]) == ["ondemand", "predictive"]
    for name, run in report["policies"].items():
        assert set(run) >= EMULATED_POLICY_KEYS, name
        assert run["failed_requests"] == 0 and run["unrouted"] == 0, run["request_errors"]
        assert run["requests"] == meta["requests"]
        assert set(run["engine_counters"]) == COUNTERS
        counters = run["engine_counters_detail"]
        assert counters["vllm_requests"] == run["requests"]  # every request reached vLLM
        assert counters["lmcache_lookups"] == run["requests"]
        # Each returning request's earlier context came from somewhere: vLLM's own cache,
        # or LMCache (L1 as it was, or loaded from L2).
        reused = counters["vllm_prefix_hit_tokens"] + counters["vllm_external_hit_tokens"]
        assert run["returning"]["requests"] > 0 and reused > 0
        assert counters["lmcache_l1_hit_tokens"] + counters["lmcache_l2_hit_tokens"] > 0
        assert sum(run["requests_per_node"].values()) == run["requests"]
    assert "predictive vs ondemand" in done.stdout
